"""Tile matmul and in-out accumulation against pure JAX, in one run (alternating rounds).

* ``warpnn.kernels.tiles.tile_matmul`` vs ``jnp.dot`` (XLA: cuBLAS on a GPU) and a ``flax.nnx.Linear``, forward
  and forward+backward, at square sizes; achieved TFLOP/s (2 m n k per product; the backward does two more).
* A force accumulation ``f[i] += k * (x[j] - x[i])`` over springs, written into an in-out force buffer that
  already holds other forces (``in_out_argnames``), vs the out-of-place kernel plus a JAX add; GB/s by a
  per-spring byte count.

``python -m benchmarks tiles_inout`` writes ``docs/tiles-inout-{gpu,cpu}.md`` with the device and versions.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

import warpnn
from warpnn.kernels import tiles

from .common import time_interleaved

wp.config.quiet = True


@wp.kernel
def spring_accumulate(x: wp.array(dtype=wp.vec3), pairs: wp.array2d(dtype=wp.int32), k: wp.array(dtype=float),
                      f: wp.array(dtype=wp.vec3)):
    s = wp.tid()
    d = x[pairs[s, 1]] - x[pairs[s, 0]]
    wp.atomic_add(f, pairs[s, 0], k[s] * d)
    wp.atomic_sub(f, pairs[s, 1], k[s] * d)


def matmul_rows(sizes):
    from flax import nnx

    rows = []
    for n in sizes:
        a = jax.random.normal(jax.random.PRNGKey(0), (n, n))
        b = jax.random.normal(jax.random.PRNGKey(1), (n, n))
        linear = nnx.Linear(n, n, use_bias=False, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(linear)
        state = jax.tree.map(lambda v: b, state)
        nnx_fwd = jax.jit(lambda a, s: nnx.merge(graphdef, s)(a))
        cases = {
            "warpnn fwd": (jax.jit(tiles.tile_matmul), (a, b)),
            "jnp.dot fwd": (jax.jit(jnp.dot), (a, b)),
            "nnx.Linear fwd": (nnx_fwd, (a, state)),
            "warpnn fwd+bwd": (jax.jit(jax.grad(lambda a, b: tiles.tile_matmul(a, b).sum(), (0, 1))), (a, b)),
            "jnp.dot fwd+bwd": (jax.jit(jax.grad(lambda a, b: jnp.dot(a, b).sum(), (0, 1))), (a, b)),
        }
        t = time_interleaved(cases, rounds=10)
        flops = 2.0 * n ** 3
        for name, seconds in t.items():
            if isinstance(seconds, Exception):
                rows.append((f"{n}^3", name, f"error: {seconds}", ""))
                continue
            work = flops * (3 if "bwd" in name else 1)
            rows.append((f"{n}^3", name, f"{seconds * 1e6:.1f} µs", f"{work / seconds / 1e12:.2f} TFLOP/s"))
    return rows


def accumulate_rows(sizes):
    rows = []
    for n in sizes:
        rng = np.random.default_rng(0)
        springs = 4 * n
        pairs = jnp.asarray(rng.integers(0, n, (springs, 2)), jnp.int32)
        x = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
        k = jnp.ones(springs, jnp.float32)
        f0 = jnp.asarray(rng.normal(size=(n, 3)), jnp.float32)
        in_place = warpnn.jax_kernel(spring_accumulate, in_out_argnames=["f"], launch_dims=springs)
        out_of_place = warpnn.jax_kernel(spring_accumulate, launch_dims=springs)
        cases = {
            "in-out f += springs": (jax.jit(lambda x, k, f: in_place(x, pairs, k, f)[0]), (x, k, f0)),
            "out-of-place + add": (jax.jit(lambda x, k, f: f + out_of_place(x, pairs, k, output_dims=n)[0]), (x, k, f0)),
        }
        t = time_interleaved(cases, rounds=10)
        bytes_moved = springs * (8 + 4 + 2 * 12 + 2 * 12)  # pairs, k, two gathers, two scatters
        for name, seconds in t.items():
            rows.append((f"{n} particles", name, f"{seconds * 1e6:.1f} µs", f"{bytes_moved / seconds / 1e9:.0f} GB/s"))
    return rows


def main(argv=None):
    gpu = jax.default_backend() == "gpu"
    sizes = (256, 1024, 4096) if gpu else (64, 256, 512)
    particles = (1 << 16, 1 << 20, 1 << 22) if gpu else (1 << 12, 1 << 16)
    device = jax.devices()[0].device_kind if gpu else f"CPU ({platform.processor() or platform.machine()})"
    lines = [f"# Tile matmul and in-out accumulation ({device})", "",
             f"jax {jax.__version__}, warp-lang {wp.__version__}, Python {sys.version.split()[0]}; medians of "
             "alternating rounds in one process (`python -m benchmarks tiles_inout`).", "",
             "| size | case | time | throughput |", "|---|---|---|---|"]
    for row in matmul_rows(sizes) + accumulate_rows(particles):
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    out = Path(__file__).resolve().parents[1] / "docs" / f"tiles-inout-{'gpu' if gpu else 'cpu'}.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
