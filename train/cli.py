"""``warpnn-train``: the main job. ``warpnn-train cloth`` runs the default task end to end."""

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
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warpnn-train", description=__doc__)
    sub = parser.add_subparsers(dest="task", metavar="TASK")
    for name, (module_name, help_text) in TASKS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--steps", type=int, default=None, help="optimisation steps (task default if omitted)")
        p.add_argument("--device", choices=["auto", "cpu", "gpu"], default="auto", help="JAX/Warp device")
        p.add_argument("--out", default=f"runs/{name}", help="output folder for checkpoint, metrics.json, PNGs")
        p.add_argument("--seed", type=int, default=0)
        module = importlib.import_module(f"warpnn_train.{module_name}")
        if hasattr(module, "add_arguments"):
            module.add_arguments(p)
    args = parser.parse_args(argv)
    if args.task is None:
        args = parser.parse_args(["cloth", *(argv if argv is not None else sys.argv[1:])])
    if args.device == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # must be set before JAX initialises a backend
    import jax

    if args.device == "gpu" and jax.default_backend() != "gpu":
        parser.error("--device gpu: JAX sees no GPU (jax.devices() = %s)" % jax.devices())
    module = importlib.import_module(f"warpnn_train.{TASKS[args.task][0]}")
    metrics = module.run(args)
    print(f"wrote {args.out}/ (metrics: {', '.join(f'{k}={v}' for k, v in metrics.items() if isinstance(v, (int, float)))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
