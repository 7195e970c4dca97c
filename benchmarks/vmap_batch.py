"""``jax.vmap`` over many small simulations: one launch for the batch vs one launch per batch element vs pure JAX.

The spring forces of a 10x10 cloth (100 particles, 342 springs, connectivity and material shared by every
cloth), vmapped over B cloths whose positions and velocities differ; fwd, and fwd+bwd (gradient of a
weighted sum of the forces w.r.t. positions and the shared stiffness). Three implementations timed in
alternating rounds of one process: warpnn as it runs by default (the batched twin, one launch per call, on a
GPU; the kernel's own per-element launches across the CPU threads on a CPU), the batched twin forced
(``WARPNN_BATCHED_LAUNCH=twin``, the same as the default on a GPU), per-element launches
(``WARPNN_BATCHED_LAUNCH=0``), and pure JAX of the same math. Also counts the kernel launches per call.

    python -m benchmarks vmap_batch [--sizes 1,64,1024,4096,16384] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import warp as wp

from warpnn import _batched
from warpnn._launch import LAUNCHER
from warpnn.kernels import cloth

from .common import environment, fmt_ratio, fmt_us, time_interleaved
from .models import spring_problem

wp.config.quiet = True
DEFAULT_SIZES = (1, 16, 64, 256, 1024, 4096, 16384)


def _compiled(fn, args, mode: str):
    """``jax.jit(fn)`` compiled now with ``WARPNN_BATCHED_LAUNCH=mode`` (the choice is made while lowering)."""
    previous = os.environ.get(_batched.BATCHED_ENV)
    os.environ[_batched.BATCHED_ENV] = mode
    jax.clear_caches()  # JAX caches lowerings: without this the other choice's lowering may be reused
    try:
        return jax.jit(fn).lower(*args).compile()
    finally:
        if previous is None:
            del os.environ[_batched.BATCHED_ENV]
        else:
            os.environ[_batched.BATCHED_ENV] = previous


def _launches_per_call(fn, args) -> dict | None:
    twins = getattr(LAUNCHER.impl, "twins", None)
    if twins is None:
        return None
    jax.block_until_ready(fn(*args))
    before = twins.kernel_launches()
    jax.block_until_ready(fn(*args))
    after = twins.kernel_launches()
    return {k: after[k] - before[k] for k in after}


def bench(sizes) -> list[dict]:
    x, v, springs, k, d, r, w = spring_problem(10)
    rows = []
    for batch in sizes:
        xb = x[None] + 1e-3 * jax.random.normal(jax.random.PRNGKey(batch), (batch, *x.shape))
        vb = jnp.broadcast_to(v, xb.shape) * 1.0
        args = (xb, vb, k)

        def make(forces):
            fwd = lambda xb, vb, k: jax.vmap(lambda x, v: forces(x, v, springs, k, d, r))(xb, vb)  # noqa: E731
            loss = lambda xb, vb, k: jnp.vdot(jnp.broadcast_to(w, xb.shape), fwd(xb, vb, k))  # noqa: E731
            return fwd, jax.grad(loss, argnums=(0, 2))

        ours_fwd, ours_grad = make(cloth.spring_forces)
        ref_fwd, ref_grad = make(cloth.spring_forces_reference)
        for direction, ours, ref in (("fwd", ours_fwd, ref_fwd), ("fwd+bwd", ours_grad, ref_grad)):
            cases = {
                "warpnn default": (_compiled(ours, args, "1"), args),
                "warpnn batched twin": (_compiled(ours, args, "twin"), args),
                "warpnn per element": (_compiled(ours, args, "0"), args),
                "pure JAX": (jax.jit(ref).lower(*args).compile(), args),
            }
            launches = {name: _launches_per_call(fn, args) for name, (fn, _) in cases.items() if name.startswith("warpnn")}
            times = time_interleaved(cases, rounds=10 if batch < 4096 else 5, per_round=3)
            rows.append({
                "batch": batch, "direction": direction,
                **{f"{name} s": (t if isinstance(t, float) else None) for name, t in times.items()},
                **{f"launches per call ({name})": launches.get(name) for name in launches},
            })
            print(f"B={batch:6d} {direction:8s} " + "  ".join(f"{n}: {fmt_us(t if isinstance(t, float) else None)} µs" for n, t in times.items()),
                  file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    names = ("warpnn default", "warpnn batched twin", "warpnn per element", "pure JAX")
    lines = [
        "| B | direction | " + " | ".join(f"{n} (µs)" for n in names) + " | "
        + " | ".join(f"{n} / pure JAX" for n in names[:-1]) + " | launches per call (" + ", ".join(names[:-1]) + ") |",
        "|---|---|" + "---|" * (2 * len(names)),
    ]
    count = lambda c: "—" if not c else "+".join(str(c[k]) for k in ("forward", "adjoint") if c[k])  # noqa: E731
    for row in rows:
        t = [row.get(f"{n} s") for n in names]
        lines.append(f"| {row['batch']} | {row['direction']} | " + " | ".join(fmt_us(x) for x in t) + " | "
                     + " | ".join(fmt_ratio(x, t[-1]) for x in t[:-1]) + " | "
                     + ", ".join(count(row.get(f"launches per call ({n})")) for n in names[:-1]) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = parser.parse_args(argv)
    rows = bench([int(s) for s in args.sizes.split(",")])
    if args.json:
        print(json.dumps({"environment": environment(), "rows": rows}))
    else:
        print(f"Environment: {environment()}\n")
        print(table(rows))


if __name__ == "__main__":
    main()
