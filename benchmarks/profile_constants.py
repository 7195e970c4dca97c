"""A/B of skipping the adjoints of inputs JAX does not differentiate (``KernelSignature.without_adjoints``).

warpnn's custom VJP learns in the forward pass which inputs are perturbed; the others get a null adjoint
array, so Warp's adjoint kernel skips their atomic adds and nothing is zeroed for them. This times gradients
with respect to part of a kernel's inputs with the skipping (the library's behaviour) and without it (every
float input's adjoint computed, as before), device time from a ``jax.profiler`` trace where available:

    python -m benchmarks.profile_constants
"""

from __future__ import annotations

import contextlib
import sys

import jax
import jax.numpy as jnp

from warpnn import _signature
from warpnn.kernels import cloth, pointcloud

from .common import device_time, fmt_us, time_call
from .models import spring_problem


@contextlib.contextmanager
def _skipping(enabled: bool):
    saved = _signature.KernelSignature.without_adjoints
    if not enabled:
        _signature.KernelSignature.without_adjoints = lambda self, names: self
    try:
        yield
    finally:
        _signature.KernelSignature.without_adjoints = saved


def cases(small: bool):
    n, points = (256, 5000) if small else (2048, 100_000)
    x, v, springs, k, d, r, w = spring_problem(n)
    m = springs.shape[0]
    springs_loss = lambda x, v, k, d, r: jnp.vdot(w, cloth.spring_forces(x, v, springs, k, d, r))  # noqa: E731
    a = jax.random.normal(jax.random.PRNGKey(3), (points, 3))
    b = jax.random.normal(jax.random.PRNGKey(4), (points, 3)) * 1.1 + 0.05
    size = f"{n * n} particles / {m} springs"
    return [
        (f"springs fwd+bwd, all 5 inputs ({size})", springs_loss, (0, 1, 2, 3, 4), (x, v, k, d, r)),
        (f"springs fwd+bwd, positions and velocities ({size})", springs_loss, (0, 1), (x, v, k, d, r)),
        (f"springs fwd+bwd, stiffness, damping, rest ({size})", springs_loss, (2, 3, 4), (x, v, k, d, r)),
        (f"chamfer fwd+bwd, both clouds ({points} + {points})", pointcloud.chamfer, (0, 1), (a, b)),
        (f"chamfer fwd+bwd, one cloud ({points} + {points})", pointcloud.chamfer, (0,), (a, b)),
    ]


def main() -> None:
    small = jax.default_backend() == "cpu" or "--small" in sys.argv
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| gradient with respect to | skipping µs (device µs) | all adjoints µs (device µs) |\n|---|---|---|")
    for name, loss, argnums, args in cases(small):
        cells = []
        for enabled in (True, False):
            with _skipping(enabled):
                fn = jax.jit(jax.grad(loss, argnums=argnums)).lower(*args).compile()
            t = time_call(fn, *args, reps=10)
            on_device = device_time(fn, *args)
            cells.append(f"{fmt_us(t)} ({fmt_us(on_device)})")
        print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
