"""Mass-spring cloth and soft-body kernels: spring forces and a semi-implicit Euler particle update.

Two Warp kernels, each wrapped as a differentiable JAX function with :func:`warpnn.jax_kernel`:

* :func:`spring_forces`: one thread per spring, Hooke stretch + dashpot damping along the spring, scattered
  into per-particle forces with ``wp.atomic_add``. Stretch, shear and bend springs of a cloth are all
  springs; only their stiffness, damping and rest length differ.
* :func:`integrate_particles`: one thread per particle, adds gravity, air drag and penalty ground
  contact with smoothed Coulomb friction on the plane ``y = 0``, then takes a semi-implicit Euler step.
  Particles with ``inv_mass == 0`` are kinematic (pinned): forces do not move them.

Both are reverse-mode differentiable with respect to every float array argument (positions, velocities,
forces, per-spring stiffness / damping / rest length, inverse masses) through Warp's adjoint kernels, and
come in float32 and float64 (chosen from the dtype of ``x``; float64 needs ``jax_enable_x64``).
"""

# No `from __future__ import annotations`: Warp evaluates kernel annotations, and the factories below
# annotate with local types (vec3 of float32 or float64) that string annotations could not resolve.

import functools

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

from .._bridge import jax_kernel
from .._equality_guard import keep_side_taken

__all__ = ["integrate_particles", "integrate_particles_reference", "spring_forces", "spring_forces_reference"]

# Below this length a spring has no direction; its force is taken along a clamped length rather than NaN.
_MIN_LENGTH = 1.0e-9


@functools.cache
def _spring_forces_kernel(scalar):
    vec3 = wp.types.vector(3, scalar)

    # One kernel per float type: Warp kernels are typed, and float64 lets the tests check gradients
    # against finite differences. module="unique" gives each its own (separately cached) Warp module.
    @wp.kernel(module="unique")
    def spring_forces_kernel(
        x: wp.array(dtype=vec3),
        v: wp.array(dtype=vec3),
        springs: wp.array(dtype=wp.vec2i),
        stiffness: wp.array(dtype=scalar),
        damping: wp.array(dtype=scalar),
        rest_length: wp.array(dtype=scalar),
        f: wp.array(dtype=vec3),
    ):
        s = wp.tid()
        ij = springs[s]
        i = ij[0]
        j = ij[1]
        d = x[j] - x[i]
        length = wp.length(d)
        direction = d / wp.max(length, scalar(_MIN_LENGTH))
        stretch_rate = wp.dot(v[j] - v[i], direction)
        fs = direction * (stiffness[s] * (length - rest_length[s]) + damping[s] * stretch_rate)
        wp.atomic_add(f, i, fs)
        wp.atomic_sub(f, j, fs)

    return jax_kernel(spring_forces_kernel)


@functools.cache
def _integrate_kernel(scalar):
    vec3 = wp.types.vector(3, scalar)

    @wp.kernel(module="unique")
    def integrate_particles_kernel(
        x: wp.array(dtype=vec3),
        v: wp.array(dtype=vec3),
        f: wp.array(dtype=vec3),
        inv_mass: wp.array(dtype=scalar),
        gravity: scalar,
        drag: scalar,
        ground_ke: scalar,
        ground_kd: scalar,
        friction: scalar,
        friction_eps: scalar,
        dt: scalar,
        x_out: wp.array(dtype=vec3),
        v_out: wp.array(dtype=vec3),
    ):
        p = wp.tid()
        xp = x[p]
        vp = v[p]
        w = inv_mass[p]
        if w == scalar(0.0):
            # Kinematic (pinned): keeps its velocity, so a pin can also be moved at a prescribed speed.
            x_out[p] = xp + dt * vp
            v_out[p] = vp
            return
        fp = f[p]
        depth = -xp[1]
        if depth > scalar(0.0):
            # Penalty normal force (spring + dashpot, never pulling), then Coulomb friction whose
            # stick/slip switch is smoothed over friction_eps so the gradient exists at zero slip.
            fn = wp.max(ground_ke * depth - ground_kd * vp[1], scalar(0.0))
            vt = vec3(vp[0], scalar(0.0), vp[2])
            slip = wp.sqrt(wp.dot(vt, vt) + friction_eps * friction_eps)
            fp = fp + vec3(scalar(0.0), fn, scalar(0.0)) - vt * (friction * fn / slip)
        a = fp * w + vec3(scalar(0.0), gravity, scalar(0.0)) - drag * vp
        v_new = vp + dt * a
        x_out[p] = xp + dt * v_new
        v_out[p] = v_new

    # A pin is a switch, not a limit: a pinned particle's inverse mass is not a parameter, and its gradient is 0 (as
    # the reference's jnp.where gives), not the NaN reverse mode gives where a branch met float equality.
    keep_side_taken(integrate_particles_kernel, "inv_mass == 0 pins a particle (a switch, not a limit): its inverse "
                    "mass is not a parameter, and its gradient is 0 by convention")
    return jax_kernel(integrate_particles_kernel, num_outputs=2)


def _warp_scalar(x, what: str):
    dtype = np.dtype(x.dtype)
    if dtype == np.float32:
        return wp.float32
    if dtype == np.float64:
        return wp.float64
    raise TypeError(f"{what}: expected float32 or float64 positions of shape (n, 3), got dtype {dtype.name}. "
                    f"Fix: pass x.astype(jnp.float32).")


def _check_vec3(name: str, a, what: str, n: int | None = None) -> None:
    shape = tuple(np.shape(a))
    if len(shape) != 2 or shape[1] != 3 or (n is not None and shape[0] != n):
        want = f"({n}, 3)" if n is not None else "(n, 3)"
        raise ValueError(f"{what}: '{name}' must have shape {want} (one 3-vector per particle), got {shape}. "
                         "To batch, use jax.vmap instead of adding leading dims.")


def spring_forces(x, v, springs, stiffness, damping, rest_length) -> jax.Array:
    """Forces of damped linear springs on their particles (Warp kernel, one thread per spring).

    For spring ``s = (i, j)`` with ``d = x[j] - x[i]``, ``l = |d|``, ``u = d / l``::

        f_s = (stiffness[s] * (l - rest_length[s]) + damping[s] * dot(v[j] - v[i], u)) * u
        f[i] += f_s,   f[j] -= f_s

    Differentiable (reverse mode) with respect to ``x``, ``v``, ``stiffness``, ``damping`` and
    ``rest_length``; ``springs`` is integer connectivity. Under ``jax.vmap`` any argument may be batched
    (e.g. a batch of cloths sharing ``springs``).

    Speed depends on the order of ``springs``: the kernel is bound by L2 (its six float atomics per spring
    and four gathers), so springs that touch nearby particles should be adjacent. On an H200 at 16.8M springs,
    row by row (every kind of spring of one grid row, then the next row) runs in 460 µs; all stretch springs,
    then all shear springs, in 537 µs. ``warpnn_models.cloth.make_cloth_grid`` emits row order.

    Args:
        x: (n, 3) float32 or float64 particle positions.
        v: (n, 3) particle velocities, same dtype as ``x``.
        springs: (s, 2) int32 particle indices of each spring.
        stiffness: (s,) spring stiffness (force per unit stretch), same dtype as ``x``.
        damping: (s,) dashpot coefficient along the spring (force per unit stretch rate).
        rest_length: (s,) rest lengths.

    Returns:
        (n, 3) force on each particle, same dtype as ``x``.
    """
    what = "warpnn.kernels.cloth.spring_forces"
    scalar = _warp_scalar(x, what)
    _check_vec3("x", x, what)
    n = np.shape(x)[0]
    _check_vec3("v", v, what, n)
    if np.ndim(springs) != 2 or np.shape(springs)[1] != 2:
        raise ValueError(f"{what}: 'springs' must have shape (num_springs, 2), got {tuple(np.shape(springs))}.")
    num_springs = np.shape(springs)[0]
    for name, a in (("stiffness", stiffness), ("damping", damping), ("rest_length", rest_length)):
        if tuple(np.shape(a)) != (num_springs,):
            raise ValueError(
                f"{what}: '{name}' must have shape ({num_springs},) (one value per spring), got {tuple(np.shape(a))}. "
                "For per-material parameters, gather them first: table[material]; for one shared value, "
                f"jnp.full(({num_springs},), value)."
            )
    dtype = np.dtype(x.dtype)
    (f,) = _spring_forces_kernel(scalar)(
        x, v.astype(dtype), jnp.asarray(springs, jnp.int32),
        stiffness.astype(dtype), damping.astype(dtype), rest_length.astype(dtype),
        # Springs are the threads; forces are per particle.
        launch_dims=num_springs, output_dims=n,
    )
    return f


def integrate_particles(
    x,
    v,
    f,
    inv_mass,
    *,
    dt: float,
    gravity: float = -9.81,
    drag: float = 0.0,
    ground_ke: float = 0.0,
    ground_kd: float = 0.0,
    friction: float = 0.0,
    friction_eps: float = 1.0e-2,
) -> tuple[jax.Array, jax.Array]:
    """One semi-implicit Euler step of free particles with gravity, drag and ground contact (Warp kernel).

    Per particle ``p`` with ``w = inv_mass[p] > 0``::

        f_c = contact force on y = 0 if x[p].y < 0, else 0:
              normal  fn = max(ground_ke * (-x.y) - ground_kd * v.y, 0)   (along +y)
              tangent -friction * fn * v_t / sqrt(|v_t|^2 + friction_eps^2)  (smoothed Coulomb)
        a      = w * (f[p] + f_c) + (0, gravity, 0) - drag * v[p]
        v_new  = v[p] + dt * a
        x_new  = x[p] + dt * v_new

    Particles with ``w == 0`` are kinematic (pinned): ``x_new = x + dt * v``, ``v_new = v``.
    Contact is off when ``ground_ke == ground_kd == 0``.

    Args:
        x: (n, 3) float32 or float64 positions.
        v: (n, 3) velocities.
        f: (n, 3) applied force (springs plus any external / control force).
        inv_mass: (n,) inverse particle masses; 0 pins a particle.
        dt: time step. gravity: acceleration along y. drag: air damping rate (1/s, mass-proportional).
        ground_ke, ground_kd: contact penalty stiffness and damping (force per unit depth / speed).
        friction: Coulomb coefficient. friction_eps: slip speed over which friction ramps up.

    Returns:
        ``(x_new, v_new)``, each (n, 3). Differentiable with respect to ``x``, ``v``, ``f``, ``inv_mass``.
    """
    what = "warpnn.kernels.cloth.integrate_particles"
    scalar = _warp_scalar(x, what)
    _check_vec3("x", x, what)
    n = np.shape(x)[0]
    _check_vec3("v", v, what, n)
    _check_vec3("f", f, what, n)
    if tuple(np.shape(inv_mass)) != (n,):
        raise ValueError(f"{what}: 'inv_mass' must have shape ({n},), got {tuple(np.shape(inv_mass))}.")
    dtype = np.dtype(x.dtype)
    x_new, v_new = _integrate_kernel(scalar)(
        x, v.astype(dtype), f.astype(dtype), inv_mass.astype(dtype),
        float(gravity), float(drag), float(ground_ke), float(ground_kd), float(friction), float(friction_eps),
        float(dt),
    )
    return x_new, v_new


# --------------------------------------------------------------------------------------------------
# Pure-JAX references: the same math, used by the tests and as the baseline the kernels are measured against.


def spring_forces_reference(x, v, springs, stiffness, damping, rest_length) -> jax.Array:
    """Pure-JAX :func:`spring_forces` (gathers + one ``segment_sum`` scatter). Same arguments and result."""
    springs = jnp.asarray(springs, jnp.int32)
    i, j = springs[:, 0], springs[:, 1]
    d = x[j] - x[i]
    length = jnp.linalg.norm(d, axis=-1)
    direction = d / jnp.maximum(length, _MIN_LENGTH)[:, None]
    stretch_rate = jnp.sum((v[j] - v[i]) * direction, axis=-1)
    fs = direction * (stiffness * (length - rest_length) + damping * stretch_rate)[:, None]
    return jax.ops.segment_sum(jnp.concatenate([fs, -fs]), jnp.concatenate([i, j]), num_segments=x.shape[0])


def integrate_particles_reference(
    x,
    v,
    f,
    inv_mass,
    *,
    dt: float,
    gravity: float = -9.81,
    drag: float = 0.0,
    ground_ke: float = 0.0,
    ground_kd: float = 0.0,
    friction: float = 0.0,
    friction_eps: float = 1.0e-2,
) -> tuple[jax.Array, jax.Array]:
    """Pure-JAX :func:`integrate_particles`. Same arguments and result."""
    depth = -x[:, 1]
    fn = jnp.where(depth > 0, jnp.maximum(ground_ke * depth - ground_kd * v[:, 1], 0.0), 0.0)
    vt = v * jnp.asarray([1.0, 0.0, 1.0], v.dtype)
    slip = jnp.sqrt(jnp.sum(vt * vt, axis=-1) + friction_eps * friction_eps)
    up = jnp.asarray([0.0, 1.0, 0.0], x.dtype)
    f_contact = fn[:, None] * up - vt * (friction * fn / slip)[:, None]
    a = (f + f_contact) * inv_mass[:, None] + gravity * up - drag * v
    v_new = v + dt * a
    x_new = x + dt * v_new
    pinned = (inv_mass == 0)[:, None]
    return jnp.where(pinned, x + dt * v, x_new), jnp.where(pinned, v, v_new)
