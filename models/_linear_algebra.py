"""Batched factorizations and solves for the MuJoCo rules, without LAPACK or cuSOLVER (see ``mujoco._spd_solve``).

Cholesky as Warp kernels, one thread per matrix: :func:`cholesky`, :func:`cholesky_solve`. Not differentiated (built
without adjoints): :func:`warpnn_models.mujoco._spd_solve` holds the factor constant and differentiates the solve
through ``lax.custom_linear_solve``, which solves again. Float32 and float64. Pure-JAX references of the same
arithmetic: :func:`cholesky_reference`, :func:`cholesky_solve_reference`, which the rules use on a GPU, where one
thread per matrix is slower than the references' column-by-column operations over every matrix.

LU without pivoting, in JAX (:func:`lu_reference`, :func:`lu_solve_reference`): the ``implicit`` integrator's
non-symmetric ``M - dt qDeriv``, which mujoco_warp (and MuJoCo) factorize without pivoting too.
"""

# No `from __future__ import annotations`: Warp evaluates kernel annotations.

import functools
from typing import Any

import jax.numpy as jnp
import warp as wp

import warpnn


@wp.kernel(enable_backward=False, module="unique")
def _factor(A: wp.array3d(dtype=Any), L: wp.array3d(dtype=Any)):
    w = wp.tid()
    n = A.shape[1]
    for j in range(n):
        diagonal = A[w, j, j]
        for k in range(j):
            diagonal -= L[w, j, k] * L[w, j, k]
        root = wp.sqrt(diagonal)
        L[w, j, j] = root
        for i in range(j + 1, n):
            entry = A[w, i, j]
            for k in range(j):
                entry -= L[w, i, k] * L[w, j, k]
            L[w, i, j] = entry / root  # (above the diagonal L keeps the zeros an output starts as)


@wp.kernel(enable_backward=False, module="unique")
def _solve(L: wp.array3d(dtype=Any), b: wp.array2d(dtype=Any), x: wp.array2d(dtype=Any)):
    w = wp.tid()
    n = b.shape[1]
    for j in range(n):  # L y = b, y kept in x
        entry = b[w, j]
        for k in range(j):
            entry -= L[w, j, k] * x[w, k]
        x[w, j] = entry / L[w, j, j]
    for back in range(n):  # L' x = y
        j = n - 1 - back
        entry = x[w, j]
        for k in range(j + 1, n):
            entry -= L[w, k, j] * x[w, k]
        x[w, j] = entry / L[w, j, j]


@functools.cache
def _wrapped(dtype):
    """The factorization and the solve for ``dtype`` as ``warpnn.jax_kernel`` calls (concrete overloads)."""
    scalar = wp.float64 if dtype == jnp.float64 else wp.float32
    factor = wp.overload(_factor, [wp.array3d(dtype=scalar), wp.array3d(dtype=scalar)])
    solve = wp.overload(_solve, [wp.array3d(dtype=scalar), wp.array2d(dtype=scalar), wp.array2d(dtype=scalar)])
    return (warpnn.jax_kernel(factor, num_outputs=1, enable_backward=False),
            warpnn.jax_kernel(solve, num_outputs=1, enable_backward=False))


def _checked(name, *arrays):
    dtype = arrays[0].dtype
    if dtype not in (jnp.float32, jnp.float64) or any(a.dtype != dtype for a in arrays):
        raise TypeError(f"{name}: float32 or float64 arrays of one dtype expected, got {[str(a.dtype) for a in arrays]}")
    return dtype


def cholesky(A):
    """The lower Cholesky factor of each symmetric positive definite matrix: ``(..., n, n) -> (..., n, n)``."""
    dtype = _checked("cholesky", A)
    n = A.shape[-1]
    flat = A.reshape(-1, n, n)
    factor, _ = _wrapped(dtype)
    return factor(flat, launch_dims=flat.shape[:1])[0].reshape(A.shape)


def cholesky_solve(L, b):
    """``(L L')^-1 b`` for each lower factor ``L``: ``(..., n, n), (..., n) -> (..., n)``."""
    dtype = _checked("cholesky_solve", L, b)
    n = b.shape[-1]
    flat_L, flat_b = L.reshape(-1, n, n), b.reshape(-1, n)
    _, solve = _wrapped(dtype)
    return solve(flat_L, flat_b, launch_dims=flat_b.shape[:1])[0].reshape(b.shape)


def cholesky_reference(A):
    """:func:`cholesky` in JAX: column by column (``n`` steps, each over every matrix)."""
    n = A.shape[-1]
    below = jnp.arange(n)
    L = jnp.zeros_like(A)
    for j in range(n):
        column = A[..., :, j] - jnp.sum(L[..., :, :j] * L[..., j : j + 1, :j], -1)
        L = L.at[..., :, j].set(jnp.where(below >= j, column / jnp.sqrt(column[..., j : j + 1]), 0.0))
    return L


def cholesky_solve_reference(L, b):
    """:func:`cholesky_solve` in JAX: forward then back substitution."""
    n = b.shape[-1]
    y = jnp.zeros_like(b)
    for j in range(n):
        y = y.at[..., j].set((b[..., j] - jnp.sum(L[..., j, :j] * y[..., :j], -1)) / L[..., j, j])
    x = jnp.zeros_like(b)
    for j in reversed(range(n)):
        x = x.at[..., j].set((y[..., j] - jnp.sum(L[..., j + 1 :, j] * x[..., j + 1 :], -1)) / L[..., j, j])
    return x


def lu_reference(A):
    """The LU factors of each square matrix without pivoting, packed: ``(..., n, n) -> (..., n, n)``, the unit lower
    factor's entries below the diagonal, the upper factor on and above it (Doolittle, row by row of ``U``)."""
    n = A.shape[-1]
    for k in range(n - 1):
        below = A[..., k + 1:, k] / A[..., k, k, None]
        A = A.at[..., k + 1:, k].set(below)
        A = A.at[..., k + 1:, k + 1:].add(-below[..., :, None] * A[..., k, None, k + 1:])
    return A


def lu_solve_reference(LU, b, transpose=False):
    """``A^-1 b`` (``transpose``: ``A'^-1 b``) for the packed factors ``LU`` of :func:`lu_reference`:
    ``(..., n, n), (..., n) -> (..., n)``. Forward then back substitution: ``L U x = b``, or ``U' L' x = b``."""
    n = b.shape[-1]
    unit_lower, upper = jnp.tril(LU, -1) + jnp.eye(n, dtype=LU.dtype), jnp.triu(LU)
    lower, upper = (jnp.swapaxes(upper, -1, -2), jnp.swapaxes(unit_lower, -1, -2)) if transpose else (unit_lower, upper)
    y = jnp.zeros_like(b)
    for j in range(n):
        y = y.at[..., j].set((b[..., j] - jnp.sum(lower[..., j, :j] * y[..., :j], -1)) / lower[..., j, j])
    x = jnp.zeros_like(b)
    for j in reversed(range(n)):
        x = x.at[..., j].set((y[..., j] - jnp.sum(upper[..., j, j + 1:] * x[..., j + 1:], -1)) / upper[..., j, j])
    return x
