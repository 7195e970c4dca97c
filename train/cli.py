"""``warpnn-train``: the main job. ``warpnn-train`` (or ``warpnn-train cloth``) runs the default task end to end.

Usage::

    warpnn-train [TASK] [--steps N] [--device {auto,cpu,gpu}] [--out DIR] [--seed S] [task options]
    warpnn-train TASK --help        # the task's own options

Parsing happens in two passes because ``--device cpu`` must reach ``JAX_PLATFORMS`` before anything imports
JAX, and every task module imports JAX: the first pass reads only the task name and ``--device``, the
second (after the environment is set) imports the chosen task and parses its options.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# task name -> (module under warpnn_train, one-line description). Each module defines
# ``add_arguments(parser)`` (optional) and ``run(args) -> dict`` (the metrics written to metrics.json).
TASKS = {
    "cloth": ("cloth_sysid", "identify cloth stiffness and damping from a simulated trajectory (default)"),
    "control": ("cloth_control", "train an NNX MLP controller through a differentiable cloth rollout"),
    "geometry": ("geometry", "deform a template point cloud to a target shape under Chamfer loss"),
    "newton": ("newton_push", "an NNX policy drags a cloth on the ground through Newton's own solver"),
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


def _task_parser(name: str, module) -> argparse.ArgumentParser:
    help_text = TASKS[name][1]
    p = argparse.ArgumentParser(prog=f"warpnn-train {name}", description=help_text)
    p.add_argument("--steps", type=int, default=None, help="optimisation steps (task default if omitted)")
    p.add_argument("--device", choices=DEVICES, default="auto", help="JAX/Warp device (default: JAX's default)")
    p.add_argument("--out", default=f"runs/{name}", help="output folder for checkpoint, metrics.json, PNGs")
    p.add_argument("--seed", type=int, default=0, help="seed for data, initialisation and sampling")
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


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        _top_parser().print_help()
        return 0
    task, rest = _split_task(argv)
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

    import jax

    if device == "cpu" and jax.default_backend() != "cpu":
        parser.error(
            "--device cpu: JAX was already initialised on another backend before warpnn-train could set "
            "JAX_PLATFORMS=cpu; run warpnn-train in a fresh process or export JAX_PLATFORMS=cpu."
        )
    if device == "gpu" and jax.default_backend() != "gpu":
        parser.error(f"--device gpu: JAX sees no GPU (jax.devices() = {jax.devices()}); install jax[cuda12] or use --device cpu")
    metrics = module.run(args)
    scalars = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
                        if isinstance(v, (int, float)) and not isinstance(v, bool))
    print(f"wrote {args.out}/ ({scalars})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
