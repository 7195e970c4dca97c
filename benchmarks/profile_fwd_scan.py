"""Why a forward-only ``lax.scan`` over a warpnn call is not replayed from a CUDA graph, and what would fix it.

A forward scan body holds the custom call, the loop counter and a copy of the call's result into the loop
carry (the call cannot write the buffer it reads). That is under XLA's minimum of 5 commands for a CUDA
graph (``--xla_gpu_graph_min_graph_size``), so every step enters the handler. This times, in alternating
rounds of one process, µs per scan step (and per single call, where in-place writing costs a copy):

* ``warpnn``: the out-of-place kernel ``y[i] = f(x[i])``, as users write it (which warpnn writes in place
  where that pays: ``_bridge._with_outputs_in_place``), and ``warpnn, never in place`` the same with that off;
* ``warpnn in-out``: the same update written in place, ``x[i] = f(x[i])`` with ``in_out_argnames=["x"]``
  (the call's result is its operand's buffer: no copy in the body, one before a call whose operand lives on);
* pure JAX;
* each of them again with ``lax.scan(..., unroll=k)`` (k steps per loop iteration).

It also prints, per case, the handler entries per step (about 0: XLA replays the body from a CUDA graph).
The loop body's ops are in the compiled HLO (``jax.jit(f).lower(x).compile().as_text()``).

    python -m benchmarks.profile_fwd_scan [rounds]
    XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 python -m benchmarks.profile_fwd_scan
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import warp as wp

import warpnn
from warpnn import _launch

from .bridge import N, SCAN_STEPS, _scan, affine, pure_jax
from .common import time_interleaved
from .profile_adjoint_in_place import _in_place

wp.config.quiet = True


@wp.kernel
def affine_in_place(x: wp.array(dtype=float)):
    i = wp.tid()
    x[i] = 0.999 * x[i] + 0.001 * x[i] * x[i]


def _entries_per_call(fn, x, calls: int = 20) -> float:
    jax.block_until_ready(fn(x))
    before = sum(_launch.LAUNCHER.handler_entries.values())
    for _ in range(calls):
        out = fn(x)
    jax.block_until_ready(out)
    return (sum(_launch.LAUNCHER.handler_entries.values()) - before) / calls


def main(rounds: int = 3) -> None:
    out_of_place = warpnn.jax_kernel(affine)
    in_place = warpnn.jax_kernel(affine_in_place, num_outputs=1, in_out_argnames=["x"])
    steps = {
        "warpnn": (lambda c: out_of_place(c)[0], "library"),
        "warpnn, never in place": (lambda c: out_of_place(c)[0], "out of place"),
        "warpnn in-out": (lambda c: in_place(c)[0], "library"),
        "pure JAX": (pure_jax, "library"),
    }
    small = jnp.linspace(0.0, 1.0, N, dtype=jnp.float32)
    large = jnp.linspace(0.0, 1.0, 1 << 24, dtype=jnp.float32)
    cases, entries = {}, {}

    def compiled(fn, x, mode):
        with _in_place(mode):
            return jax.jit(fn).lower(x).compile()

    for label, (step, mode) in steps.items():
        cases[("scan fwd", label)] = (compiled(_scan(step), small, mode), (small,))
        cases[(f"single call fwd, n={N}", label)] = (compiled(step, small, mode), (small,))
        if jax.default_backend() == "gpu":  # (on a CPU one such call takes seconds)
            cases[("scan fwd, n=16M", label)] = (compiled(_scan(step), large, mode), (large,))
        cases[("single call fwd, n=16M", label)] = (compiled(step, large, mode), (large,))
    for unroll in (2, 4, 8):
        for label, (step, mode) in steps.items():
            cases[("scan fwd", f"{label}, scan unroll={unroll}")] = (compiled(_scan(step, unroll), small, mode), (small,))
    for key, (compiled, args) in cases.items():
        per = SCAN_STEPS if key[0].startswith("scan") else 1
        entries[key] = _entries_per_call(compiled, *args) / per
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; µs per scan step or per call (× pure JAX)")
    for r in range(rounds):
        times = time_interleaved(cases, rounds=10)
        for (case, label), t in times.items():
            per = SCAN_STEPS if case.startswith("scan") else 1
            ref = times[(case, "pure JAX")]
            print(f"  round {r}  {case:24s} {label:26s} {t / per * 1e6:9.2f}  ({t / ref:.2f}×)  "
                  f"handler entries/step {entries[(case, label)]:.3f}")


if __name__ == "__main__":
    import sys

    main(rounds=int(sys.argv[1]) if len(sys.argv) > 1 else 3)
