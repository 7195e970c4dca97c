"""How many copies a spread adjoint needs (``warpnn._spread``): the heat stencil's backward scan on a GPU; and a
loss kernel accumulated into one element, spread or not.

``python -m benchmarks.profile_spread --sizes 256,1024 --slots 32,256,1024,4096,16384``: a scan of the stencil
step's VJP (``benchmarks.heat.backward_scan``: every step adds ``alpha``'s adjoint from every thread) with the
adjoint spread over each number of copies, with Warp's own adjoint (one address) and in pure JAX, in alternating
rounds in one process; ms per scan. ``--loss-sizes 65536,1048576``: ``wp.atomic_add(total, 0, x[i] * x[i])``
(``tests.kernels_for_tests.two_outputs``) forward and forward+backward, with the loss accumulated into copies (the
library's choice), into one element, and ``jnp.sum`` in pure JAX; µs per call. Run from the repository root.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from warpnn import _spread

from .common import environment, fmt_ratio, time_interleaved
from .heat import _jax_step, _warp_step, backward_scan


def _compiled(fn, args, slots: int | None):
    """``fn`` compiled with its adjoints spread over ``slots`` copies (None: not spread)."""
    before = _spread.SLOTS, _spread.THREADS_PER_SLOT
    _spread.SLOTS, _spread.THREADS_PER_SLOT = (slots or 32), 1  # the count is read while tracing
    try:
        with _spread.override(slots is not None):
            jax.clear_caches()  # JAX reuses a function's trace: each count must be traced anew
            return jax.jit(fn).lower(*args).compile()
    finally:
        _spread.SLOTS, _spread.THREADS_PER_SLOT = before


def bench_loss(sizes) -> None:
    import warpnn
    from tests.kernels_for_tests import two_outputs, two_outputs_ref

    print("\n| n | direction | spread (µs) | one element (µs) | pure JAX (µs) | spread / pure JAX | one element / pure JAX |")
    print("|---|---|---|---|---|---|---|")
    for n in sizes:
        f = warpnn.jax_kernel(two_outputs, num_outputs=2, output_dims={"y": n, "total": 1})
        x = jax.random.normal(jax.random.PRNGKey(n), (n,))
        fns = {"fwd": (lambda x: f(x, 0.5)[1], lambda x: two_outputs_ref(x, 0.5)[1]),
               "fwd+bwd": (jax.grad(lambda x: f(x, 0.5)[1][0] + f(x, 0.5)[0].sum()),
                           jax.grad(lambda x: two_outputs_ref(x, 0.5)[1][0] + two_outputs_ref(x, 0.5)[0].sum()))}
        for direction, (ours, ref) in fns.items():
            cases = {}
            for label, spread in (("spread", None), ("one element", False)):
                with _spread.override(spread):
                    jax.clear_caches()
                    cases[label] = (jax.jit(ours).lower(x).compile(), (x,))
            cases["pure JAX"] = (jax.jit(ref).lower(x).compile(), (x,))
            t = time_interleaved(cases, rounds=8, per_round=5)
            print(f"| {n:,} | {direction} | {t['spread'] * 1e6:.1f} | {t['one element'] * 1e6:.1f} | "
                  f"{t['pure JAX'] * 1e6:.1f} | {fmt_ratio(t['spread'], t['pure JAX'])} | "
                  f"{fmt_ratio(t['one element'], t['pure JAX'])} |", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--slots", default="32,256,1024,4096,16384")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--loss-sizes", default="")
    args = parser.parse_args(argv)
    slot_counts = [int(s) for s in args.slots.split(",")]
    print(f"Environment: {environment()}\n")
    labels = [*(f"{s} copies" for s in slot_counts), "not spread", "pure JAX"]
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if sizes:
        print("| size | " + " | ".join(f"{label} (ms)" for label in labels) + " | best / pure JAX |")
        print("|---|" + "---|" * (len(labels) + 1))
    for n in sizes:
        u = jax.random.normal(jax.random.PRNGKey(n), (n, n))
        call = (u, jnp.array([0.5]), jax.random.normal(jax.random.PRNGKey(1), (n, n)))
        ours = backward_scan(_warp_step, args.steps)
        cases = {f"{s} copies": (_compiled(ours, call, s), call) for s in slot_counts}
        cases["not spread"] = (_compiled(ours, call, None), call)
        cases["pure JAX"] = (jax.jit(backward_scan(_jax_step, args.steps)).lower(*call).compile(), call)
        times = time_interleaved(cases, rounds=8, per_round=3)
        best = min(times[f"{s} copies"] for s in slot_counts)
        print(f"| {n}² | " + " | ".join(f"{times[label] * 1e3:.2f}" for label in labels)
              + f" | {fmt_ratio(best, times['pure JAX'])} |", flush=True)
        print(f"{n}^2 done", file=sys.stderr, flush=True)

    if args.loss_sizes:
        bench_loss([int(s) for s in args.loss_sizes.split(",")])


if __name__ == "__main__":
    main()
