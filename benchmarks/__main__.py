"""The one entry point that regenerates the benchmark tables of docs/.

    python -m benchmarks [--out DIR] [--skip-train]   # the overview tables: docs/benchmarks-{gpu,cpu}.{md,json}
    python -m benchmarks NAME [ARGS...]               # one benchmark: python -m benchmarks NAME --help
    python -m benchmarks --list                       # the names

Without NAME each part runs in its own process (XLA reads its flags once per process), with XLA's default
flags and with warpnn.enable_cuda_graph_capture()'s flags (on a GPU). Writes ``DIR/benchmarks-{gpu,cpu}.json``
and ``.md`` (default DIR: docs/). Each docs page with a table names the command that wrote it.
"""

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from warpnn._cuda_graphs import CAPTURE_FLAGS

from . import bridge, callable as callable_bench, models

CAPTURE = " ".join(f"--{k}={v}" for k, v in CAPTURE_FLAGS.items())


def _run(module: str, xla_flags: str, *extra: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": xla_flags, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, "-m", module, *extra], capture_output=True, text=True, env=env, timeout=1800)
    sys.stderr.write(out.stderr[-4000:])
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])  # Warp may print its banner to stdout first


def _train_steps_per_s(task: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "warpnn_train.cli", task, "--steps", str(steps), "--out", tmp]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            return {"task": task, "error": out.stderr[-2000:]}
        metrics = json.loads(Path(tmp, "metrics.json").read_text())
    return {"task": task, "steps": steps, "steps_per_s": metrics.get("steps_per_s")}


# NAME -> what its table shows (and where it goes).
BENCHMARKS = {
    "bridge": "bridge overhead: warpnn.jax_kernel vs wp.jax_kernel vs pure JAX (part of the overview)",
    "callable": "warpnn.jax_callable vs Warp with wp.Tape (part of the overview)",
    "models": "model layers at scale: spring forces and Chamfer distance (part of the overview)",
    "graph_capture": "handler entries per 1000 launches under CUDA graphs (GPU; part of the overview)",
    "vmap_batch": "vmap over many small cloths: docs/benchmarks-speed-{gpu,cpu}.md",
    "heat": "heat stencil in a lax.scan, CPU-thread scaling: docs/benchmarks-speed-{gpu,cpu}.md",
    "cpu_codegen": "where a Warp CPU kernel's time per element goes: docs/benchmarks-speed-cpu.md",
    "checked_mode": "what checked mode costs: docs/checked-mode-{gpu,cpu}.md",
    "tiles_inout": "tile matmul and in-out accumulation: docs/tiles-inout-{gpu,cpu}.md",
    "newton_rollout": "Newton rollout vs wp.Tape: docs/newton-rollout-{gpu,cpu}.md",
    "mujoco_step": "MuJoCo Warp's step vs mujoco_warp's captured graph and MJX: docs/mujoco-step-{gpu,cpu}.md",
    "multi_gpu": "data-parallel cloth training on 1..N GPUs: docs/multi_gpu.md",
    "launch_overhead": "per-call overhead of warpnn's launchers",
}


def _run_one(name: str, args: list[str]) -> None:
    sys.argv = [f"python -m benchmarks {name}", *args]
    runpy.run_module(f"benchmarks.{name}", run_name="__main__", alter_sys=True)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "--list":
        print("\n".join(f"{name:16} {what}" for name, what in BENCHMARKS.items()))
        return
    if argv and argv[0] in BENCHMARKS:
        _run_one(argv[0], argv[1:])
        return
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     epilog="or: python -m benchmarks NAME [ARGS...]; NAME one of "
                                            + ", ".join(BENCHMARKS))
    parser.add_argument("--out", default="docs")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--train-steps", type=int, default=100)
    args = parser.parse_args(argv)

    import jax

    gpu = jax.default_backend() == "gpu"
    flag_sets = {"default XLA flags": ""}
    if gpu:
        flag_sets["enable_cuda_graph_capture()"] = CAPTURE
    results = {"runs": {}}
    for label, flags in flag_sets.items():
        results["runs"][label] = {
            "bridge": _run("benchmarks.bridge", flags),
            "graph_capture": _run("benchmarks.graph_capture", flags) if gpu else None,
        }
    results["models"] = _run("benchmarks.models", CAPTURE if gpu else "")
    results["callable"] = _run("benchmarks.callable", "")
    if not args.skip_train:
        results["training"] = [_train_steps_per_s(t, args.train_steps) for t in ("cloth", "control", "geometry")]
    env = next(iter(results["runs"].values()))["bridge"].get("environment", {})
    results["environment"] = env

    md = [f"# Benchmarks\n\nGenerated by `python -m benchmarks` on {env.get('date')}: "
          f"{env.get('nvidia_smi') or env.get('device')} ({env.get('backend')}), jax {env.get('jax')}, "
          f"warp {env.get('warp')}, Python {env.get('python')}. Times are medians of jitted calls; in the bridge "
          f"tables the implementations are timed in alternating rounds, so their ratios come from the same "
          f"minutes of the machine. Device µs: kernels, memsets and copies of one call in a jax.profiler trace.\n"]
    for label, run in results["runs"].items():
        md.append(f"## Bridge overhead, trivial kernel (4096 elements), {label}\n")
        md.append(bridge.table(run["bridge"]["bridge"]) if "bridge" in run["bridge"] else f"failed: {run['bridge']}")
        if run.get("graph_capture") and "graph_capture" in run["graph_capture"]:
            md.append("\nHandler entries per 1000 Warp launches (0: replayed from a CUDA graph):\n")
            md.append("| case | entries per 1000 launches |\n|---|---|")
            md += [f"| {r['case']} | {r['entries_per_1000_launches']:.1f} |" for r in run["graph_capture"]["graph_capture"]]
        md.append("")
    if "models" in results["models"]:
        md.append("## Model layers" + (" (with enable_cuda_graph_capture())" if gpu else " (CPU sizes)") + "\n")
        md.append(models.table(results["models"]["models"], results["models"]["copy_bandwidth_Bps"]))
        md.append("")
    if "callable" in results["callable"]:
        md.append("## warpnn.jax_callable vs Warp with wp.Tape (3-kernel spring function, µs per iteration)\n")
        md.append(callable_bench.table(results["callable"]["callable"]))
        md.append("")
    if results.get("training"):
        md.append("## Main job training throughput\n\n| task | steps/s |\n|---|---|")
        md += [f"| {r['task']} | {r['steps_per_s']:.1f} |" if r.get("steps_per_s") else f"| {r['task']} | failed |"
               for r in results["training"]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "gpu" if gpu else "cpu"
    (out / f"benchmarks-{suffix}.json").write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    (out / f"benchmarks-{suffix}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
