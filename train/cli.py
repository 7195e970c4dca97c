"""``warpnn-train``: the main job. ``warpnn-train`` (or ``warpnn-train cloth``) runs the default task end to end.

Usage::

    warpnn-train [TASK] [--steps N] [--device {auto,cpu,gpu}] [--out DIR] [--seed S] [task options]
    warpnn-train TASK ... --resume  # continue the run in --out from its checkpoint
    warpnn-train TASK --help        # the task's own options, with their defaults

Every argument is parsed and checked (ranges included) before JAX or Warp is imported: ``--help``, a mistyped
flag or ``--steps 0`` answers at once, in one line, and leaves nothing behind. Only then does ``--device cpu``
reach ``JAX_PLATFORMS`` (JAX reads it once, at its first import) and the chosen task's module load.

Adding a task: write its configuration dataclass and ``add_<task>_arguments(parser)`` in
``warpnn_train.options`` (set the task's ``--steps`` default there with ``parser.set_defaults``; the options must
not import JAX), and a module ``warpnn_train.<name>`` with ``config_from_args(args)`` (optional: the dataclass,
which becomes part of the run's identity for ``--resume``) and ``run(args) -> dict`` (the metrics); add one line
to :data:`TASKS` and one to ``options.ADD_ARGUMENTS``. ``run`` gets the claimed output folder from
``warpnn_train.common.run_dir(args)`` and drives training with ``warpnn_train.common.train_loop`` (progress
bar, ``--checkpoint-every``, ``--stop-after``, Ctrl-C); ``--resume`` is then the task's to honour by loading
its checkpoint through ``warpnn_train.common.read_checkpoint`` (see the existing tasks).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import tempfile

from . import options

# task name -> (module under warpnn_train, one-line description). Each module defines ``run(args) -> dict`` (the
# metrics written to metrics.json); its options are in options.ADD_ARGUMENTS.
TASKS = {
    "cloth": ("cloth_sysid", "identify cloth stiffness and damping from a simulated trajectory (default)"),
    "control": ("cloth_control", "train an NNX MLP controller through a differentiable cloth rollout"),
    "geometry": ("geometry", "deform a template point cloud to a target shape under Chamfer loss"),
    "newton": ("newton_push", "an NNX policy drags a cloth on the ground through Newton's own solver"),
    "mujoco": ("mujoco_sysid", "identify a MuJoCo arm's link masses and joint damping through MuJoCo Warp"),
}
DEFAULT_TASK = "cloth"
DEVICES = ("auto", "cpu", "gpu")


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (the usage block is what --help is for), exit status 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _top_parser() -> argparse.ArgumentParser:
    epilog = "tasks:\n" + "\n".join(f"  {name:<10} {help_text}" for name, (_, help_text) in TASKS.items())
    epilog += f"\n\nWith no TASK, runs '{DEFAULT_TASK}'. 'warpnn-train TASK --help' lists a task's options."
    parser = _Parser(
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


def _task_parser(name: str) -> argparse.ArgumentParser:
    help_text = TASKS[name][1]
    p = _Parser(prog=f"warpnn-train {name}", description=help_text, formatter_class=_DefaultsHelpFormatter)
    p.add_argument("--steps", type=options.STEPS, default=None, help="optimisation steps")
    p.add_argument("--device", choices=DEVICES, default="auto", help="JAX/Warp device; auto: JAX's default")
    p.add_argument("--out", default=f"runs/{name}", help="output folder for checkpoint, metrics.json, PNGs")
    p.add_argument("--seed", type=options.NON_NEGATIVE, default=0, help="seed for data, initialisation and sampling")
    g = p.add_argument_group("run control")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its checkpoint (same task and options); ends where an "
                        "uninterrupted run ends")
    g.add_argument("--overwrite", action="store_true", help="replace the run that --out holds")
    g.add_argument("--checkpoint-every", type=options.NON_NEGATIVE, default=50, metavar="N",
                   help="write a resumable checkpoint every N steps (0: only at the end)")
    g.add_argument("--stop-after", type=options.NON_NEGATIVE, default=None, metavar="K",
                   help="stop after step K, checkpointed; continue later with --resume")
    g.add_argument("--verbose", action="store_true",
                   help="show Warp's banner and module loads, and the traceback of an error")
    options.ADD_ARGUMENTS[name](p)
    return p


def _split_task(argv: list[str]) -> tuple[str, list[str]]:
    if argv and not argv[0].startswith("-"):
        if argv[0] not in TASKS:
            _top_parser().error(f"unknown task {argv[0]!r}; choose from {', '.join(TASKS)}")
        return argv[0], argv[1:]
    return DEFAULT_TASK, argv


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
    # Everything the command line says is checked here, before JAX and Warp load (seconds) and before --out is
    # touched: a mistake answers in one line and leaves nothing behind.
    parser = _task_parser(task)
    args = parser.parse_args(rest)
    args.task = task
    if args.resume and args.overwrite:
        parser.error("--resume continues the run in --out and --overwrite replaces it: give one of them")
    if args.resume and not os.path.isdir(args.out):
        what = "is not a folder" if os.path.exists(args.out) else "does not exist"
        print(f"warpnn-train {task}: error: --resume: {args.out} {what}, so it holds no run to continue; run without "
              "--resume to start one", file=sys.stderr)
        return 2
    verbose = args.verbose
    if args.device == "cpu":
        # Must precede the first `import jax` anywhere (task modules import it): JAX reads it once.
        os.environ["JAX_PLATFORMS"] = "cpu"
    devices = getattr(args, "devices", None)
    if devices and devices > 1:
        # --devices N on the CPU needs N host devices, which XLA creates only if told before it starts.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"

    import jax

    if args.device == "cpu" and jax.default_backend() != "cpu":
        parser.error(
            "--device cpu: JAX was already initialised on another backend before warpnn-train could set "
            "JAX_PLATFORMS=cpu; run warpnn-train in a fresh process or export JAX_PLATFORMS=cpu."
        )
    if args.device == "gpu" and jax.default_backend() != "gpu":
        parser.error(f"--device gpu: JAX sees no GPU (jax.devices() = {jax.devices()}); install jax[cuda12] or use --device cpu")

    prog = f"warpnn-train {task}"
    try:
        _init_warp(verbose)  # before the task's modules import warpnn, which compiles nothing but may print
        module = importlib.import_module(f"warpnn_train.{TASKS[task][0]}")
        from . import common
    except Exception as e:
        if verbose:
            raise
        print(f"{prog}: error: {type(e).__name__}: {e} (--verbose shows the traceback)", file=sys.stderr)
        return 1

    resume_command = _resume_command(task, rest)
    finished = False  # the run ended with something worth keeping in --out (results, or a checkpoint to resume)
    try:
        # Claimed before anything trains: a folder that cannot be written, or holds another run, fails now.
        config = module.config_from_args(args) if hasattr(module, "config_from_args") else None
        args.run_dir = common.RunDir.open(args.out, common.run_identity(task, args, config), resume=args.resume,
                                          overwrite=args.overwrite, checkpoint_every=args.checkpoint_every,
                                          stop_after=args.stop_after, command=resume_command)
        with _stop_on_signals(common.STOP_REQUESTED):
            metrics = module.run(args)
        finished = True
    except common.Stopped as stopped:
        finished = True
        print(f"{prog}: {stopped}; checkpoint in {args.out}/. Continue with:\n  {resume_command}")
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
            args.run_dir.close(failed=not finished)
    scalars = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
                        if isinstance(v, (int, float)) and not isinstance(v, bool))
    print(f"wrote {args.out}/ ({scalars})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
