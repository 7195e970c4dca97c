"""Data-parallel cloth training on 1..N GPUs: correctness on every device, then throughput and scaling.

    python -m benchmarks multi_gpu                      # every GPU JAX sees; writes docs/multi_gpu.{json,md}
    python -m benchmarks multi_gpu --cpu-devices 4 --rows 8 --frames 10 --steps 3   # CPU smoke test

The step is the main job's data-parallel one (``warpnn_train.data_parallel``): ``jax.jit`` of
``value_and_grad`` of a ``vmap`` over cloths of a ``lax.scan`` rollout through the Warp spring and
integrator kernels, plus an Adam update, with the batch of cloths sharded over a 1-D mesh.

Checks, before timing anything:

* per device: ``jit(grad)`` of the batch loss on each GPU alone equals GPU 0's (Warp's own multi-GPU autodiff
  tests are skipped upstream: they saw zero gradients on devices > 0);
* per device count n: loss and gradient of the same global batch sharded over n devices equal one device's,
  and the compiled step has no ``all-gather`` (the batch is never gathered; only gradients are all-reduced)
  and launches the Warp kernels on ``batch / n`` cloths per device.

Then it times the step: weak scaling (``--cloths-per-device`` on each of n devices) and strong scaling (the
N-device batch split over n devices). With one GPU only the 1-device rows are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path


def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64, help="cloth rows = cols (particles: rows^2)")
    p.add_argument("--frames", type=int, default=50, help="rollout length per training step")
    p.add_argument("--cloths-per-device", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="timed training steps per configuration")
    p.add_argument("--max-devices", type=int, default=None, help="default: every device")
    p.add_argument("--cpu-devices", type=int, default=None, help="run on N virtual CPU devices (smoke test)")
    p.add_argument("--out", default="docs", help="folder for multi_gpu.json and multi_gpu.md ('' to skip)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    if args.cpu_devices:  # before JAX starts: XLA reads its flags once
        os.environ["JAX_PLATFORMS"] = "cpu"
        flag = f"--xla_force_host_platform_device_count={args.cpu_devices}"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}"

    import dataclasses
    import time

    import jax
    import numpy as np
    import optax
    import warp as wp

    import warpnn
    from warpnn_train import data_parallel as dp
    from warpnn_train.cloth_sysid import SysIdConfig, initial_theta

    from .common import environment

    wp.config.quiet = True
    if jax.default_backend() != "gpu" and not args.cpu_devices:
        print("no GPU: run with --cpu-devices N for a CPU smoke test", file=sys.stderr)
        return 2
    available = len(jax.devices())
    n_max = min(available, args.max_devices or available)
    counts = sorted({n for n in (1, 2, 4, 8, 16, n_max) if n <= n_max})
    config = dataclasses.replace(SysIdConfig(), rows=args.rows, cols=args.rows, frames=args.frames, height=3.0)
    optimizer = optax.adam(1e-2)
    theta0 = initial_theta(config)
    report = {"environment": environment(), "devices_available": available, "launcher": warpnn._launch.LAUNCHER.name,
              "bridge_partitions": hasattr(warpnn._bridge, "_sharding"), "config": vars(args), "checks": {},
              "weak": [], "strong": []}

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    def tree_rel(a, b):
        return max(rel(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    # One batch for the checks and the strong-scaling rows: cloths_per_device on each of n_max devices.
    mesh_all = dp.device_mesh(n_max)
    task = dp.make_batched_task(config, args.cloths_per_device * n_max, seed=0, mesh=mesh_all)
    loss = dp.make_batched_loss(task)
    grad = jax.jit(jax.value_and_grad(loss))
    data = jax.device_get((task.v0, task.xs_obs, task.vs_obs))

    # 1. The same gradient on each device alone (a slice of the batch, to keep it quick).
    small = jax.tree.map(lambda a: a[: max(2, args.cloths_per_device // 4)], data)
    per_device = [grad(*jax.device_put((theta0, *small), d)) for d in jax.devices()[:n_max]]
    report["checks"]["per_device"] = {
        "devices": [str(d) for d in jax.devices()[:n_max]],
        "grad_rel_error_vs_device0": [tree_rel(r[1], per_device[0][1]) for r in per_device],
        "grad_norm": [float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(r[1])))) for r in per_device],
    }

    # 2. The same global batch over n devices: equal to one device, never gathered.
    reference = grad(*jax.device_put((theta0, *data), jax.devices()[0]))
    update = dp.make_update(task, optimizer)
    for n in counts:
        if len(data[0]) % n:
            continue
        mesh = dp.device_mesh(n)
        sharded = (dp.replicate(mesh, theta0), *dp.shard_batch(mesh, data))
        value, g = grad(*sharded)
        hlo = update.lower(sharded[0], dp.replicate(mesh, optimizer.init(theta0)), *sharded[1:]).compile().as_text()
        batches = sorted({int(m) for line in hlo.splitlines() if 'custom_call_target="warpnn' in line
                          for m in re.findall(r"\[(\d+)[,\]]", line.split("custom-call(")[0].split("=", 1)[1])})
        report["checks"][f"{n}_devices"] = {
            "loss_rel_error": rel(value, reference[0]),
            "grad_rel_error": tree_rel(g, reference[1]),
            "all_gather": bool(re.search(r"\ball-gather(-start)?\(", hlo)),
            "all_reduce": bool(re.search(r"\ball-reduce(-start)?\(", hlo)),
            "warp_local_batch": batches,
            "expected_local_batch": len(data[0]) // n,
        }

    # 3. Throughput.
    def measure(n: int, cloths: int) -> dict:
        mesh = dp.device_mesh(n)
        batch = jax.tree.map(lambda a: np.resize(a, (cloths, *a.shape[1:])), data)  # repeat the data set
        theta, opt_state = dp.replicate(mesh, (theta0, optimizer.init(theta0)))
        batch = dp.shard_batch(mesh, batch)
        jax.block_until_ready(update(theta, opt_state, *batch))  # compile
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            theta, opt_state, value = update(theta, opt_state, *batch)
            jax.block_until_ready(value)
            times.append(time.perf_counter() - t0)
        step_s = float(np.median(times))
        frames = cloths * args.frames / step_s
        return {"devices": n, "cloths": cloths, "step_ms": step_s * 1e3, "steps_per_s": 1 / step_s,
                "cloth_frames_per_s": frames, "cloth_frames_per_s_per_device": frames / n}

    for n in counts:
        report["weak"].append(measure(n, args.cloths_per_device * n))
        if (args.cloths_per_device * n_max) % n == 0:  # a batch the devices do not divide would run replicated
            report["strong"].append(measure(n, args.cloths_per_device * n_max))
    for rows in (report["weak"], report["strong"]):
        base = rows[0]["cloth_frames_per_s"]
        for r in rows:
            r["speedup"] = r["cloth_frames_per_s"] / base
            r["efficiency"] = r["speedup"] / r["devices"]

    problems = [f"{k}: {v}" for k, v in report["checks"].items() if k != "per_device" and (
        v["loss_rel_error"] > 1e-4 or v["grad_rel_error"] > 1e-4 or v["all_gather"]
        or v["warp_local_batch"] != [v["expected_local_batch"]])]
    pd = report["checks"]["per_device"]
    if max(pd["grad_rel_error_vs_device0"]) > 1e-5 or min(pd["grad_norm"]) == 0:
        problems.append(f"per_device: {pd}")
    report["ok"] = not problems
    report["problems"] = problems
    text = _markdown(report, args, n_max)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        warpnn.atomic_write_bytes(out / "multi_gpu.json", (json.dumps(report, indent=2, sort_keys=True) + "\n").encode())
        warpnn.atomic_write_bytes(out / "multi_gpu.md", text.encode())
    return 0 if report["ok"] else 1


def _markdown(report: dict, args, n_max: int) -> str:
    env = report["environment"]
    lines = [
        f"# Data-parallel cloth training on 1..{n_max} {env['backend']} devices",
        "",
        f"{env['device']}, JAX {env['jax']}, Warp {env['warp']}, launcher {report['launcher']}, {env['date']}. "
        f"Cloth {args.rows}x{args.rows} ({args.rows ** 2} particles), {args.frames}-frame rollout per step, "
        "value_and_grad + Adam; medians of "
        f"{args.steps} steps. Produced by `python -m benchmarks multi_gpu`.",
        "",
        "Checks: " + ("all passed" if report["ok"] else "FAILED: " + "; ".join(report["problems"])),
        "",
        "| devices | loss rel. err. vs 1 | grad rel. err. vs 1 | all-gather | all-reduce | Warp batch per device |",
        "|---|---|---|---|---|---|",
    ]
    for k, v in report["checks"].items():
        if k != "per_device":
            lines.append(f"| {k.split('_')[0]} | {v['loss_rel_error']:.1e} | {v['grad_rel_error']:.1e} | "
                         f"{'yes' if v['all_gather'] else 'no'} | {'yes' if v['all_reduce'] else 'no'} | "
                         f"{v['warp_local_batch']} (expected {v['expected_local_batch']}) |")
    pd = report["checks"]["per_device"]
    lines += ["", "Gradient on each device alone vs device 0 (rel. error): "
              + ", ".join(f"{d}: {e:.1e}" for d, e in zip(pd["devices"], pd["grad_rel_error_vs_device0"])), ""]
    for name, title in (("weak", f"Weak scaling ({args.cloths_per_device} cloths per device)"),
                        ("strong", f"Strong scaling ({args.cloths_per_device * n_max} cloths in all)")):
        lines += [f"## {title}", "", "| devices | cloths | step (ms) | cloth-frames/s | per device | speedup | efficiency |",
                  "|---|---|---|---|---|---|---|"]
        for r in report[name]:
            lines.append(f"| {r['devices']} | {r['cloths']} | {r['step_ms']:.2f} | {r['cloth_frames_per_s']:.3g} | "
                         f"{r['cloth_frames_per_s_per_device']:.3g} | {r['speedup']:.2f}x | {r['efficiency']:.0%} |")
        lines.append("")
    if n_max == 1:
        lines.append("Only one device: scaling not measured (the 1-device rows are the baseline).")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
