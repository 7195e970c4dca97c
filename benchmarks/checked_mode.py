"""What checked mode costs: jitted calls with index-checked kernels (``warpnn.checked()``) vs the default mode.

Three kernels: an elementwise map, a gather, and the cloth spring forces (a gather and an atomic scatter, fwd
and fwd+bwd). Checked mode is decided at trace time and switching it clears JAX's caches, so the modes run in
alternating phases (default, checked, default, checked, ...), each phase compiling its functions once; the
reported time is the median over all calls of each mode.

    python -m benchmarks checked_mode            # writes docs/checked-mode-{cpu,gpu}.md and .json
"""

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

import warpnn
from warpnn.kernels import cloth

from .common import environment, fmt_ratio, fmt_us
from .models import spring_problem

wp.config.quiet = True


@wp.kernel
def affine(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = 0.999 * x[i] + 0.001 * x[i] * x[i]


@wp.kernel
def gather(x: wp.array(dtype=wp.vec3), idx: wp.array(dtype=wp.int32), y: wp.array(dtype=wp.vec3)):
    i = wp.tid()
    y[i] = 2.0 * x[idx[i]]


def _cases(n: int, grid: int):
    affine_fn, gather_fn = warpnn.jax_kernel(affine), warpnn.jax_kernel(gather)
    x = jnp.linspace(0.0, 1.0, n)
    xv = jnp.ones((n, 3))
    idx = jax.random.randint(jax.random.PRNGKey(0), (n,), 0, n, jnp.int32)
    px, pv, springs, k, d, r, w = spring_problem(grid)

    def springs_loss(px, pv, k, d, r):
        return jnp.vdot(w, cloth.spring_forces(px, pv, springs, k, d, r))

    return {
        f"elementwise, {n} floats, fwd": (lambda x: affine_fn(x)[0], (x,)),
        f"gather, {n} vec3, fwd": (lambda xv, idx: gather_fn(xv, idx)[0], (xv, idx)),
        f"spring forces, {springs.shape[0]} springs, fwd": (
            lambda px, pv, k, d, r: cloth.spring_forces(px, pv, springs, k, d, r), (px, pv, k, d, r)),
        f"spring forces, {springs.shape[0]} springs, fwd+bwd": (
            jax.grad(springs_loss, argnums=(0, 1, 2, 3, 4)), (px, pv, k, d, r)),
    }


def _phase(cases, calls: int) -> dict:
    jitted = {name: (jax.jit(fn), args) for name, (fn, args) in cases.items()}
    for fn, args in jitted.values():  # compile (and, checked, build the checked kernels) outside the timing
        jax.block_until_ready(fn(*args))
    samples = {name: [] for name in cases}
    for _ in range(calls):
        for name, (fn, args) in jitted.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples[name].append(time.perf_counter() - t0)
    return samples


def run(n: int, grid: int, phases: int = 3, calls: int = 10) -> dict:
    cases = _cases(n, grid)
    samples = {mode: {name: [] for name in cases} for mode in ("default", "checked")}
    for _ in range(phases):
        for mode in ("default", "checked"):
            with warpnn.checked(mode == "checked"):
                for name, s in _phase(cases, calls).items():
                    samples[mode][name] += s
    rows = []
    for name in cases:
        default, checked = (float(np.median(samples[m][name])) for m in ("default", "checked"))
        rows.append({"case": name, "default_s": default, "checked_s": checked})
    return {"environment": environment(), "rows": rows}


def markdown(result: dict) -> str:
    env = result["environment"]
    lines = [
        f"# Checked mode cost ({env['backend']}: {env['device']})",
        "",
        f"jax {env['jax']}, warp {env['warp']}, {env['date']}; `python -m benchmarks checked_mode`. Median wall "
        "time per jitted call; checked = the kernels' index-checked variants plus reading the violation record "
        "back (a host callback per call).",
        "",
        "| case | default | checked | checked / default |",
        "|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(f"| {row['case']} | {fmt_us(row['default_s'])} µs | {fmt_us(row['checked_s'])} µs | "
                     f"{fmt_ratio(row['checked_s'], row['default_s'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks checked_mode")
    parser.add_argument("--out", default="docs", help="directory for checked-mode-{cpu,gpu}.{md,json}")
    args = parser.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    result = run(n=1 << 24 if gpu else 1 << 20, grid=2048 if gpu else 256)
    suffix = "gpu" if gpu else "cpu"
    out = Path(args.out)
    warpnn.atomic_write_bytes(out / f"checked-mode-{suffix}.md", markdown(result).encode())
    warpnn.atomic_write_bytes(out / f"checked-mode-{suffix}.json", (json.dumps(result, indent=1, sort_keys=True) + "\n").encode())
    sys.stdout.write(markdown(result))


if __name__ == "__main__":
    main()
