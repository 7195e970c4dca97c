"""Tile kernels: a matrix product and a dense layer through Warp's tile API (``wp.tile_load`` /
``wp.tile_matmul`` / ``wp.tile_store``), differentiable through Warp's tile adjoints.

One thread block computes one ``TILE_M x TILE_N`` tile of the result, accumulating ``TILE_K``-wide slices
of the inputs, as Warp's ``warp/examples/tile/example_tile_matmul.py`` does. Shapes that are not multiples
of the tile are zero-padded in JAX (zeros add nothing to the product), so any ``(m, k) @ (k, n)`` works.
The block size is ``block_dim`` (default 64 on CUDA; on the CPU one thread, or ``block_dim`` threads when
``wp.config.enable_cpu_blocks`` is on). Pure-JAX references: ``tile_matmul_reference``, ``dense_reference``.
"""

# No `from __future__ import annotations`: Warp evaluates kernel annotations.

import functools

import jax
import jax.numpy as jnp
import warp as wp

from .._bridge import jax_kernel

__all__ = ["TILE_K", "TILE_M", "TILE_N", "dense", "dense_reference", "tile_matmul", "tile_matmul_reference"]

TILE_M = wp.constant(32)
TILE_N = wp.constant(32)
TILE_K = wp.constant(16)
CUDA_BLOCK_DIM = 64


@wp.kernel(module="unique")
def tile_matmul_kernel(a: wp.array2d(dtype=float), b: wp.array2d(dtype=float), c: wp.array2d(dtype=float)):
    i, j = wp.tid()
    acc = wp.tile_zeros(shape=(TILE_M, TILE_N), dtype=float)
    for k in range(a.shape[1] // TILE_K):
        ta = wp.tile_load(a, shape=(TILE_M, TILE_K), offset=(i * TILE_M, k * TILE_K))
        tb = wp.tile_load(b, shape=(TILE_K, TILE_N), offset=(k * TILE_K, j * TILE_N))
        wp.tile_matmul(ta, tb, acc)
    wp.tile_store(c, acc, offset=(i * TILE_M, j * TILE_N))


@functools.cache
def _matmul(block_dim: int):
    return jax_kernel(tile_matmul_kernel, block_dim=block_dim)


def _block_dim(block_dim: int | None) -> int:
    if block_dim is not None:
        return int(block_dim)
    return CUDA_BLOCK_DIM if jax.default_backend() == "gpu" else 1


def _pad_to(x, multiples):
    pads = [(0, -n % m) for n, m in zip(x.shape, multiples)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def tile_matmul(a: jax.Array, b: jax.Array, block_dim: int | None = None) -> jax.Array:
    """``a @ b`` for ``a: (m, k)`` and ``b: (k, n)`` float32, one Warp thread block per 32x32 output tile.

    Differentiable with respect to both (Warp's tile adjoints), vmappable, jittable.
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"tile_matmul: expected a (m, k) and b (k, n), got shapes {a.shape} and {b.shape}.")
    m, n = a.shape[0], b.shape[1]
    a_p = _pad_to(a, (TILE_M, TILE_K))
    b_p = _pad_to(b, (TILE_K, TILE_N))
    mp, np_ = a_p.shape[0], b_p.shape[1]
    bd = _block_dim(block_dim)
    (c,) = _matmul(bd)(a_p, b_p, launch_dims=(mp // TILE_M, np_ // TILE_N, bd), output_dims=(mp, np_))
    return c[:m, :n]


def tile_matmul_reference(a: jax.Array, b: jax.Array) -> jax.Array:
    """Pure-JAX ``a @ b``: the reference :func:`tile_matmul` is tested against."""
    return jnp.matmul(a, b)


def dense(x: jax.Array, w: jax.Array, bias: jax.Array, activation=None, block_dim: int | None = None) -> jax.Array:
    """A dense layer ``activation(x @ w + bias)`` for ``x: (batch, in)``, ``w: (in, out)``, ``bias: (out,)``,
    with the product in Warp tiles (bias and activation are fused by XLA)."""
    y = tile_matmul(x, w, block_dim) + bias
    return y if activation is None else activation(y)


def dense_reference(x, w, bias, activation=None):
    """Pure-JAX ``activation(x @ w + bias)``: the reference :func:`dense` is tested against."""
    y = x @ w + bias
    return y if activation is None else activation(y)
