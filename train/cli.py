"""``warpnn-train``: the main job. ``warpnn-train`` (or ``warpnn-train cloth``) runs the default task end to end.

Usage::

    warpnn-train [TASK] [--steps N] [--device {auto,cpu,gpu}] [--out DIR] [--seed S] [task options]
    warpnn-train TASK ... --resume  # continue the run in --out from its checkpoint
    warpnn-train TASK --help        # the task's own options, with their defaults

Parsing happens in two passes because ``--device cpu`` must reach ``JAX_PLATFORMS`` before anything imports
JAX, and every task module imports JAX: the first pass reads only the task name and ``--device``, the
second (after the environment is set) imports the chosen task and parses its options.

Adding a task: write a module ``warpnn_train.<name>`` with ``add_arguments(parser)`` (optional; set the
task's ``--steps`` default there with ``parser.set_defaults``), ``config_from_args(args)`` (optional: a
dataclass, which becomes part of the run's identity for ``--resume``) and ``run(args) -> dict`` (the
metrics), and add one line to :data:`TASKS`. ``run`` gets the claimed output folder from
``warpnn_train.common.run_dir(args)`` and drives training with ``warpnn_train.common.train_loop`` (progress
bar, ``--checkpoint-every``, ``--stop-after``, Ctrl-C); ``--resume`` is then the task's to honour by loading
its checkpoint (see the existing tasks).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import tempfile

# task name -> (module under warpnn_train, one-line description). Each module defines
# ``add_arguments(parser)`` (optional) and ``run(args) -> dict`` (the metrics written to metrics.json).
TASKS = {
    "cloth": ("cloth_sysid", "identify cloth stiffness and damping from a simulated trajectory (default)"),
    "control": ("cloth_control", "train an NNX MLP controller through a differentiable cloth rollout"),
    "geometry": ("geometry", "deform a template point cloud to a target shape under Chamfer loss"),
}
DEFAULT_TASK = "cloth"
DEVICES = ("auto", "cpu", "gpu")


def _top_parser() -> argparse.ArgumentParser:
    epilog = "tasks:\n" + "\n".join(f"  {name:<10} {help_text}" for name, (_, help_text) in TASKS.items())
    epilog += f"\n\nWith no TASK, runs '{DEFAULT_TASK}'. 'warpnn-train TASK --help' lists a task's options."
    parser = argparse.ArgumentParser(
        prog="warpnn-train",
        description="Train warpnn models end to end: writes a checkpoint, metrics.json and PNG figures.",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("task", nargs="?", choices=list(TASKS), metavar="TASK", help="task to run")
    return parser


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where there is none to show (None, flags)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def _task_parser(name: str, module) -> argparse.ArgumentParser:
    help_text = TASKS[name][1]
    p = argparse.ArgumentParser(prog=f"warpnn-train {name}", description=help_text,
                                formatter_class=_DefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=None, help="optimisation steps")
    p.add_argument("--device", choices=DEVICES, default="auto", help="JAX/Warp device; auto: JAX's default")
    p.add_argument("--out", default=f"runs/{name}", help="output folder for checkpoint, metrics.json, PNGs")
    p.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and sampling")
    g = p.add_argument_group("run control")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its checkpoint (same task and options); ends where an "
                        "uninterrupted run ends")
    g.add_argument("--overwrite", action="store_true", help="replace the run that --out holds")
    g.add_argument("--checkpoint-every", type=int, default=50, metavar="N",
                   help="write a resumable checkpoint every N steps (0: only at the end)")
    g.add_argument("--stop-after", type=int, default=None, metavar="K",
                   help="stop after step K, checkpointed; continue later with --resume")
    g.add_argument("--verbose", action="store_true",
                   help="show Warp's banner and module loads, and the traceback of an error")
    if hasattr(module, "add_arguments"):
        module.add_arguments(p)
    return p


def _split_task(argv: list[str]) -> tuple[str, list[str]]:
    if argv and not argv[0].startswith("-"):
        if argv[0] not in TASKS:
            _top_parser().error(f"unknown task {argv[0]!r}; choose from {', '.join(TASKS)}")
        return argv[0], argv[1:]
    return DEFAULT_TASK, argv


def _peek_device(argv: list[str]) -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", choices=DEVICES, default="auto")
    known, _ = pre.parse_known_args(argv)
    return known.device


def _peek_devices(argv: list[str]) -> int | None:
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # "--device" is not "--devices"
    pre.add_argument("--devices", type=int, default=None)
    known, _ = pre.parse_known_args(argv)
    return known.devices


CUDA_DRIVER_NOTICE = "Could not find or load the NVIDIA CUDA driver"


def _init_warp(verbose: bool) -> None:
    """Initialise Warp now, quietly unless ``verbose``: no banner, no module-load lines, and no CUDA-driver
    notice on a machine without a GPU (Warp's C runtime prints that one to stderr itself)."""
    import warp as wp

    if verbose:
        wp.init()
        return
    wp.config.log_level = wp.LOG_WARNING  # Warp 1.19: the banner and "Module ... load" lines are INFO
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            wp.init()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        captured.seek(0)
        lines = captured.read().decode(errors="replace").splitlines(keepends=True)
    sys.stderr.write("".join(line for line in lines if CUDA_DRIVER_NOTICE not in line))


@contextlib.contextmanager
def _stop_on_signals(stop):
    """Ctrl-C or SIGTERM: finish the current step, checkpoint and stop (a second Ctrl-C aborts)."""

    def request(signum, _frame):
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        print(f"\nwarpnn-train: {signal.Signals(signum).name}: stopping after this step (Ctrl-C again aborts)",
              file=sys.stderr)

    previous = {}
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, request)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop.clear()


def _resume_command(task: str, argv: list[str]) -> str:
    """The command that continues a stopped run: the same options, without --stop-after/--overwrite."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--stop-after":
            skip = True
            continue
        if arg.startswith("--stop-after=") or arg in ("--overwrite", "--resume"):
            continue
        kept.append(arg)
    return " ".join(["warpnn-train", task, *kept, "--resume"])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        _top_parser().print_help()
        return 0
    task, rest = _split_task(argv)
    verbose = "--verbose" in rest
    device = _peek_device(rest)
    if device == "cpu":
        # Must precede the first `import jax` anywhere (task modules import it): JAX reads it once.
        os.environ["JAX_PLATFORMS"] = "cpu"
    devices = _peek_devices(rest)
    if devices and devices > 1:
        # --devices N on the CPU needs N host devices, which XLA creates only if told before it starts.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    module = importlib.import_module(f"warpnn_train.{TASKS[task][0]}")
    parser = _task_parser(task, module)
    args = parser.parse_args(rest)
    args.task = task
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.stop_after is not None and args.stop_after < 0:
        parser.error(f"--stop-after must be >= 0, got {args.stop_after}")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out and --overwrite replaces it: give one of them")

    import jax

    if device == "cpu" and jax.default_backend() != "cpu":
        parser.error(
            "--device cpu: JAX was already initialised on another backend before warpnn-train could set "
            "JAX_PLATFORMS=cpu; run warpnn-train in a fresh process or export JAX_PLATFORMS=cpu."
        )
    if device == "gpu" and jax.default_backend() != "gpu":
        parser.error(f"--device gpu: JAX sees no GPU (jax.devices() = {jax.devices()}); install jax[cuda12] or use --device cpu")

    from . import common

    prog = f"warpnn-train {task}"
    try:
        _init_warp(verbose)
        # Claimed before anything trains: a folder that cannot be written, or holds another run, fails now.
        config = module.config_from_args(args) if hasattr(module, "config_from_args") else None
        args.run_dir = common.RunDir.open(args.out, common.run_identity(task, args, config), resume=args.resume,
                                          overwrite=args.overwrite, checkpoint_every=args.checkpoint_every,
                                          stop_after=args.stop_after)
        with _stop_on_signals(common.STOP_REQUESTED):
            metrics = module.run(args)
    except common.Stopped as stopped:
        print(f"{prog}: {stopped}; checkpoint in {args.out}/. Continue with:\n  {_resume_command(task, rest)}")
        return 0 if args.stop_after is not None and stopped.step >= args.stop_after else 130
    except common.UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if verbose:
            raise
        print(f"{prog}: error: {type(e).__name__}: {e} (--verbose shows the traceback)", file=sys.stderr)
        return 1
    finally:
        if getattr(args, "run_dir", None) is not None:
            args.run_dir.close()
    scalars = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
                        if isinstance(v, (int, float)) and not isinstance(v, bool))
    print(f"wrote {args.out}/ ({scalars})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
