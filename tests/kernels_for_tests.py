"""Small Warp kernels covering the shapes a bridge must get right, each with a pure-JAX reference."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import warp as wp


@wp.kernel
def scale_square(x: wp.array(dtype=float), s: float, y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = s * x[i] * x[i]


def scale_square_ref(x, s):
    return s * x * x


@wp.kernel
def weighted_gather(x: wp.array(dtype=float), idx: wp.array(dtype=wp.int32), w: wp.array(dtype=float),
                    y: wp.array(dtype=float)):
    # thread i reads another element of x: a vmap that folds the batch into dim 0 breaks this
    i = wp.tid()
    y[i] = w[i] * x[idx[i]]


def weighted_gather_ref(x, idx, w):
    return w * x[idx]


@wp.kernel
def spring_forces(pos: wp.array(dtype=wp.vec3), springs: wp.array2d(dtype=wp.int32),
                  stiffness: wp.array(dtype=float), rest: wp.array(dtype=float), force_scale: float,
                  f: wp.array(dtype=wp.vec3)):
    # one thread per spring, scattering into per-particle forces
    s = wp.tid()
    i = springs[s, 0]
    j = springs[s, 1]
    d = pos[j] - pos[i]
    length = wp.length(d)
    fs = force_scale * stiffness[s] * (length - rest[s]) * d / length
    wp.atomic_add(f, i, fs)
    wp.atomic_sub(f, j, fs)


def spring_forces_ref(pos, springs, stiffness, rest, force_scale):
    i, j = springs[:, 0], springs[:, 1]
    d = pos[j] - pos[i]
    length = jnp.linalg.norm(d, axis=-1, keepdims=True)
    fs = force_scale * stiffness[:, None] * (length - rest[:, None]) * d / length
    return jnp.zeros_like(pos).at[i].add(fs).at[j].add(-fs)


@wp.kernel
def affine_2d(a: wp.array2d(dtype=float), b: wp.array(dtype=float), c: wp.array(dtype=float),
              out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    out[i, j] = a[i, j] * b[j] + c[i] * a[i, j] * a[i, j]


def affine_2d_ref(a, b, c):
    return a * b[None, :] + c[:, None] * a * a


@wp.kernel
def two_outputs(x: wp.array(dtype=float), a: float, y: wp.array(dtype=float), total: wp.array(dtype=float)):
    # outputs of different shapes: y is elementwise, total accumulates over every thread
    i = wp.tid()
    y[i] = wp.sin(x[i]) * a
    wp.atomic_add(total, 0, x[i] * x[i])


def two_outputs_ref(x, a):
    return jnp.sin(x) * a, jnp.sum(x * x)[None]


@wp.kernel
def rotate(m: wp.array(dtype=wp.mat33), v: wp.array(dtype=wp.vec3), out: wp.array(dtype=wp.vec3)):
    i = wp.tid()
    out[i] = m[i] * v[i]


def rotate_ref(m, v):
    return jnp.einsum("nij,nj->ni", m, v)


@wp.kernel
def cubic_f64(x: wp.array(dtype=wp.float64), w: wp.array(dtype=wp.float64), y: wp.array(dtype=wp.float64)):
    i = wp.tid()
    y[i] = w[i] * x[i] * x[i] * x[i] + wp.sin(x[i] * w[i])


def cubic_f64_ref(x, w):
    return w * x**3 + jnp.sin(x * w)


@wp.func
def periodic_neighbours(i: int, n: int):
    """The neighbours of ``i`` in ``[0, n)`` on a ring, wrapped by branches (no modulo)."""
    up = i + 1
    if up == n:
        up = 0
    down = i - 1
    if down < 0:
        down = n - 1
    return up, down


# A 2-D periodic heat-diffusion step: a stencil whose threads read their neighbours (u's adjoint scatters),
# with neighbours wrapped by branches, not modulo. Also what benchmarks.heat times.
@wp.kernel
def heat_step(u: wp.array2d(dtype=float), alpha: wp.array(dtype=float), c: float, out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    ip, im = periodic_neighbours(i, u.shape[0])
    jp, jm = periodic_neighbours(j, u.shape[1])
    lap = u[ip, j] + u[im, j] + u[i, jp] + u[i, jm] - 4.0 * u[i, j]
    out[i, j] = u[i, j] + alpha[0] * c * lap


def heat_step_ref(u, alpha, c):
    lap = jnp.roll(u, 1, 0) + jnp.roll(u, -1, 0) + jnp.roll(u, 1, 1) + jnp.roll(u, -1, 1) - 4.0 * u
    return u + alpha[0] * c * lap


# Reads the row above through Warp's negative-index wrap (u[-1, j] is the last row) and measures u in the body:
# Warp's adjoint of `u.shape` resets the shape of u's adjoint, so the row-loop twin must measure u before its loop.
@wp.kernel
def shifted_rows(u: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    n = u.shape[0]
    out[i, j] = u[i - 1, j] * float(n)


@wp.func
def scaled_row_above(u: wp.array2d(dtype=float), i: int, j: int):
    n = u.shape[0]  # measured before the read: Warp's own adjoint resets the shape after the read's (right once)
    return u[i - 1, j] * float(n)


@wp.kernel
def shifted_rows_through_a_func(u: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    # the same, with the measuring inside a @wp.func that gets u (and u's adjoint, by reference)
    i, j = wp.tid()
    out[i, j] = scaled_row_above(u, i, j)


def shifted_rows_ref(u):
    return jnp.roll(u, 1, 0) * u.shape[0]


# Measures x after reading it at a wrapped negative index (x[-1] is the last element): Warp's adjoint of x.shape
# resets the shape of x's adjoint before the read's adjoint runs, so the bridge differentiates a twin that measures
# first (_measured.py).
@wp.kernel
def previous_scaled(x: wp.array(dtype=float), out: wp.array(dtype=float)):
    i = wp.tid()
    out[i] = x[i - 1] * float(x.shape[0])


def previous_scaled_ref(x):
    return jnp.roll(x, 1) * x.shape[0]


@wp.kernel
def previous_scaled_in_a_loop(x: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i = wp.tid()
    for j in range(4):
        out[i, j] = x[i - 1, j - 1] * float(x.shape[1])


def previous_scaled_in_a_loop_ref(x):
    return jnp.roll(x, (1, 1), (0, 1)) * x.shape[1]


def chain_springs(n):
    """A chain of n particles with springs (i, i+1) and (i, i+2): shared connectivity for the tests."""
    a = jnp.arange(n - 1)
    b = jnp.arange(n - 2)
    return jnp.concatenate([jnp.stack([a, a + 1], 1), jnp.stack([b, b + 2], 1)]).astype(jnp.int32)


def random_positions(key, n):
    return jax.random.normal(key, (n, 3), jnp.float32) + jnp.arange(n, dtype=jnp.float32)[:, None] * jnp.array([1.0, 0.0, 0.0])


def springs_case(n: int = 16):
    """A chain of n particles with random positions, per-spring stiffness and rest lengths (seeded)."""
    springs = chain_springs(n)
    m = springs.shape[0]
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(1), 3)
    pos = random_positions(k1, n)
    stiffness = jax.random.uniform(k2, (m,), minval=0.5, maxval=2.0)
    rest = jax.random.uniform(k3, (m,), minval=0.5, maxval=1.5)
    return pos, springs, stiffness, rest


def spring_forces_fn():
    """``spring_forces`` through warpnn.jax_kernel, launched over springs (not particles, its first input)."""
    import warpnn

    f = warpnn.jax_kernel(spring_forces)

    def forces(pos, springs, stiffness, rest, scale=1.0):
        (out,) = f(pos, springs, stiffness, rest, scale, launch_dims=springs.shape[0], output_dims=pos.shape[0])
        return out

    return forces


# --------------------------------------------------------------------------------------------------
# A multi-kernel Warp function for warpnn.jax_callable: springs gather positions into an intermediate, scatter
# it into forces, and an energy reads those forces back (a later kernel reading an earlier output). Generic
# kernels with one overload per float type: float64 for the tests' finite differences, float32 for
# benchmarks.callable, which times this same function.


@wp.kernel
def _spring_tension(x: wp.array(dtype=Any), k: wp.array(dtype=Any), pairs: wp.array2d(dtype=wp.int32), rest: Any,
                    t: wp.array(dtype=Any)):
    s = wp.tid()
    t[s] = k[s] * (x[pairs[s, 1]] - x[pairs[s, 0]] - rest)


@wp.kernel
def _spring_scatter(t: wp.array(dtype=Any), pairs: wp.array2d(dtype=wp.int32), f: wp.array(dtype=Any)):
    s = wp.tid()
    wp.atomic_add(f, pairs[s, 0], t[s])
    wp.atomic_sub(f, pairs[s, 1], t[s])


@wp.kernel
def _spring_energy(x: wp.array(dtype=Any), f: wp.array(dtype=Any), e: wp.array(dtype=Any)):
    i = wp.tid()
    wp.atomic_add(e, 0, wp.sin(x[i]) * f[i] * f[i])


@functools.cache
def spring_kernels(dtype) -> tuple[wp.Kernel, wp.Kernel, wp.Kernel]:
    """The tension, scatter and energy kernels for float type ``dtype`` (concrete overloads: no type inference
    at launch)."""
    a, pairs = wp.array(dtype=dtype), wp.array2d(dtype=wp.int32)
    return (wp.overload(_spring_tension, [a, a, pairs, dtype, a]), wp.overload(_spring_scatter, [a, pairs, a]),
            wp.overload(_spring_energy, [a, a, a]))


@functools.cache
def springs_function(dtype):
    """``springs(x, k, pairs, rest, f, e)`` for float type ``dtype``: the three kernels launched in turn, their
    intermediate tension array differentiable (``requires_grad``), as wp.Tape needs it."""
    tension, scatter, energy = spring_kernels(dtype)

    def springs(x: wp.array(dtype=dtype), k: wp.array(dtype=dtype), pairs: wp.array2d(dtype=wp.int32), rest: dtype,
                f: wp.array(dtype=dtype), e: wp.array(dtype=dtype)):
        f.zero_()
        e.zero_()
        t = wp.zeros(k.shape, dtype=dtype, device=k.device, requires_grad=True)
        wp.launch(tension, dim=k.shape, inputs=[x, k, pairs, rest], outputs=[t])
        wp.launch(scatter, dim=k.shape, inputs=[t, pairs], outputs=[f])
        wp.launch(energy, dim=x.shape, inputs=[x, f], outputs=[e])

    springs.__name__ = springs.__qualname__ = f"springs_{dtype.__name__}"
    return springs


def springs_ref(x, k, pairs, rest):
    """``springs``'s results ``(f, e)`` in pure JAX."""
    t = k * (x[pairs[:, 1]] - x[pairs[:, 0]] - rest)
    f = jnp.zeros_like(x).at[pairs[:, 0]].add(t).at[pairs[:, 1]].add(-t)
    return f, jnp.sum(jnp.sin(x) * f * f)[None]
