"""Warp kernels and their pure-JAX references shared by the layer tests (one Warp module: one compile)."""

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

import warpnn


@wp.kernel
def spring_forces(
    x: wp.array(dtype=wp.vec3),
    edges: wp.array(dtype=wp.vec2i),
    rest: wp.array(dtype=float),
    k: wp.array(dtype=float),
    scale: float,
    f: wp.array(dtype=wp.vec3),
):
    """Hooke forces of springs ``edges`` (one thread per edge), scattered onto both end points."""
    e = wp.tid()
    i = edges[e][0]
    j = edges[e][1]
    d = x[j] - x[i]
    length = wp.length(d)
    fe = scale * k[0] * (length - rest[e]) / length * d
    wp.atomic_add(f, i, fe)
    wp.atomic_sub(f, j, fe)


def spring_forces_reference(x, edges, rest, k, scale):
    d = x[edges[:, 1]] - x[edges[:, 0]]
    length = jnp.linalg.norm(d, axis=-1, keepdims=True)
    fe = scale * k[0] * (length - rest[:, None]) / length * d
    return jnp.zeros_like(x).at[edges[:, 0]].add(fe).at[edges[:, 1]].add(-fe)


SPRINGS = warpnn.bind(spring_forces, inputs=["x"], launch_dims="edges", output_dims="x")


def spring_system(n=12, seed=0):
    """Points on a noisy ring joined to their two next neighbours: ``(x (n, 3), edges (2n, 2) int32, rest (2n,))``."""
    rng = np.random.default_rng(seed)
    angle = np.linspace(0, 2 * np.pi, n, endpoint=False)
    x = np.stack([np.cos(angle), np.sin(angle), 0.1 * rng.standard_normal(n)], -1).astype(np.float32)
    i = np.arange(n)
    edges = np.concatenate([np.stack([i, (i + 1) % n], -1), np.stack([i, (i + 2) % n], -1)]).astype(np.int32)
    rest = (0.8 * np.linalg.norm(x[edges[:, 1]] - x[edges[:, 0]], axis=-1)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(edges), jnp.asarray(rest)


@wp.kernel
def closest_point_distance(
    points: wp.array(dtype=wp.vec3),
    mesh: wp.uint64,
    max_dist: float,
    dist2: wp.array(dtype=float),
):
    """Squared distance from each point to the closest point of a ``wp.Mesh`` (its id is a static uint64)."""
    i = wp.tid()
    p = points[i]
    query = wp.mesh_query_point_no_sign(mesh, p, max_dist)
    if query.result:
        c = wp.mesh_eval_position(mesh, query.face, query.u, query.v)
        dist2[i] = wp.length_sq(p - c)


def unit_square_mesh(device=None):
    """The square [0, 1]^2 in the z = 0 plane, as a two-triangle ``wp.Mesh`` (default: on JAX's device)."""
    device = device or warpnn.jax_warp_device()
    points = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0]], np.float32)
    faces = np.array([0, 1, 2, 0, 2, 3], np.int32)
    return wp.Mesh(points=wp.array(points, dtype=wp.vec3, device=device), indices=wp.array(faces, dtype=int, device=device))


@wp.kernel
def scale_by(x: wp.array(dtype=float), train: float, y: wp.array(dtype=float)):
    """``y = train * x``; its scalar's name collides with ``nnx.Module.train``."""
    i = wp.tid()
    y[i] = train * x[i]


def closest_point_distance_reference(points):
    closest = jnp.concatenate([jnp.clip(points[:, :2], 0.0, 1.0), jnp.zeros_like(points[:, 2:])], -1)
    return jnp.sum((points - closest) ** 2, -1)


def rollout(force, x0, steps=4, dt=0.1):
    """``steps`` explicit steps x <- x + dt * force(x) with ``lax.scan``; returns the final positions."""

    def step(x, _):
        return x + dt * force(x), None

    return jax.lax.scan(step, x0, None, length=steps)[0]


K_TRUE = 3.0


def external_force(x):
    """The part of the training target that a standard MLP must learn: gravity plus a pull to the origin."""
    return jnp.array([0.0, 0.0, -1.0]) - 0.5 * x


def force_dataset(num=16, n=12, seed=0):
    """A small system-identification task: noisy ring configurations ``xs (num, n, 3)`` and the forces on them
    ``(num, n, 3)`` from springs of stiffness ``K_TRUE`` plus :func:`external_force`."""
    x0, edges, rest = spring_system(n, seed)
    xs = x0 + 0.15 * jnp.asarray(np.random.default_rng(seed + 1).standard_normal((num, n, 3)), jnp.float32)
    k = jnp.array([K_TRUE])
    target = jax.jit(jax.vmap(lambda x: spring_forces_reference(x, edges, rest, k, 1.0) + external_force(x)))(xs)
    return xs, target, edges, rest
