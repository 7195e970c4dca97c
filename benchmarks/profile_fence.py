"""A/B of the optimization barrier around warpnn's FFI calls (``_bridge._fence``), in scans, against pure JAX.

Without the barrier, XLA's GPU compiler wraps a custom call whose operand is a slice of a stacked buffer
(or whose result is stacked into one) in a dynamic-slice fusion, whose thunk computes the slice offset on the
host every loop iteration. This times the two scan cases of ``benchmarks.bridge`` with and without the
barrier, and pure JAX, in alternating rounds of one process, under this process's XLA_FLAGS:

    python -m benchmarks.profile_fence
    XLA_FLAGS="--xla_gpu_graph_min_graph_size=1 --xla_cmd_buffer_trace_cache_size=1024" python -m benchmarks.profile_fence
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

import warpnn
from warpnn import _bridge

from .bridge import N, SCAN_STEPS, _scan_grad, _trajectory_grad, affine, pure_jax
from .common import print_rounds


@contextlib.contextmanager
def _fence(enabled: bool):
    """Trace with (the library's behaviour) or without the barrier; compiled functions keep what they saw."""
    saved = _bridge._fence
    if not enabled:
        _bridge._fence = list
    try:
        yield
    finally:
        _bridge._fence = saved


def main(rounds: int = 3) -> None:
    x = jnp.linspace(0.0, 1.0, N, dtype=jnp.float32)
    xs = jnp.tile(x, (SCAN_STEPS, 1)) * 0.01
    kernel = warpnn.jax_kernel(affine)
    ours = lambda c: kernel(c)[0]  # noqa: E731
    builders = {"scan step fwd+bwd": (_scan_grad, (x,)), "scan xs→ys step fwd+bwd": (_trajectory_grad, (x, xs))}
    cases = {}
    for case, (build, args) in builders.items():
        for label, step, fenced in (("warpnn", ours, True), ("warpnn, no barrier", ours, False), ("pure JAX", pure_jax, True)):
            with _fence(fenced):
                cases[(case, label)] = (jax.jit(build(step)).lower(*args).compile(), args)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; µs per scan step (× pure JAX), {rounds} rounds")
    print_rounds(cases, rounds, SCAN_STEPS)


if __name__ == "__main__":
    main()
