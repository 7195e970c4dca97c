"""Mesh kernels (signed distance, penalty) against brute-force pure-JAX references; generators; cloth contact."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from warpnn.kernels import mesh as M
from warpnn_models.cloth import Cloth, make_cloth_grid
from warpnn_models.mesh import MeshObstacle, box, icosphere, torus

from .helpers import assert_close

SHAPES = {
    "icosphere": lambda: icosphere(2, radius=0.8),
    "box": lambda: box((1.2, 0.8, 1.6), center=(0.1, 0.0, -0.1)),
    "torus": lambda: torus(1.0, 0.35, 24, 12),
}


@pytest.fixture(scope="module")
def meshes():
    """Each shape's (vertices, faces, wp.Mesh); built once, kept alive for the whole module."""
    return {name: (*make(), M.make_mesh(*make())) for name, make in SHAPES.items()}


def _points(seed, n=256, extent=1.6):
    return jax.random.uniform(jax.random.PRNGKey(seed), (n, 3), jnp.float32, -extent, extent)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_generated_meshes_are_closed_and_outward(shape):
    vertices, faces = SHAPES[shape]()
    assert vertices.dtype == np.float32 and faces.dtype == np.int32
    # Closed and consistently oriented: every directed edge appears once, and its reverse once.
    edges = np.concatenate([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]])
    directed = {tuple(e) for e in edges}
    assert len(directed) == len(edges)
    assert all((b, a) in directed for a, b in directed)
    inside = {"icosphere": [0.0, 0.0, 0.0], "box": [0.1, 0.0, -0.1], "torus": [1.0, 0.0, 0.0]}[shape]
    w = M.winding_number(jnp.array([inside, [5.0, 5.0, 5.0]], jnp.float32), jnp.asarray(vertices), jnp.asarray(faces))
    assert_close(w, [1.0, 0.0], atol=1e-4)  # +1 inside: faces wind counter-clockwise seen from outside


@pytest.mark.parametrize("shape", list(SHAPES))
def test_signed_distance_and_gradient_match_reference(meshes, shape):
    vertices, faces, mesh = meshes[shape]
    points = _points(1)
    sdf, normal = jax.jit(lambda p: M.signed_distance(mesh, p))(points)
    ref_sdf, ref_closest = jax.jit(M.signed_distance_reference)(points, vertices, faces)
    assert 0 < int(jnp.sum(ref_sdf < 0)) < points.shape[0]  # points on both sides
    assert_close(sdf, ref_sdf, atol=1e-5)
    assert_close(points - sdf[:, None] * normal, ref_closest, atol=2e-4)
    assert_close(jnp.linalg.norm(normal, axis=1), jnp.ones(points.shape[0]), atol=1e-5)

    grad = jax.jit(jax.grad(lambda p: M.signed_distance(mesh, p)[0].sum()))(points)
    ref_grad = jax.jit(jax.grad(lambda p: M.signed_distance_reference(p, vertices, faces)[0].sum()))(points)
    assert_close(grad, ref_grad, atol=2e-4)
    assert_close(grad, normal, atol=2e-4)  # the normal is the gradient of the signed distance


def test_normal_gradient_matches_reference(meshes):
    # Differentiating the normal (a cloth step's contact force depends on it) goes through Warp's adjoint
    # of the closest point on the triangle, not just the distance.
    vertices, faces, mesh = meshes["box"]
    points = _points(2)
    w = jnp.array([1.0, -2.0, 0.5])

    def reference_normal(p):
        sdf, closest = M.signed_distance_reference(p, vertices, faces)
        d = p - closest
        return jnp.sign(sdf)[:, None] * d / jnp.linalg.norm(d, axis=1, keepdims=True)

    got = jax.grad(lambda p: jnp.sum(M.signed_distance(mesh, p)[1] * w))(points)
    want = jax.grad(lambda p: jnp.sum(reference_normal(p) * w))(points)
    # The normal's derivative jumps where the closest feature switches (face <-> edge <-> vertex); a point
    # within rounding of such a switch may land on either side in the two implementations.
    mismatched = jnp.abs(got - want).max(axis=1) > 2e-3
    assert int(mismatched.sum()) <= 2, np.flatnonzero(np.asarray(mismatched))
    assert float(jnp.abs(want).max()) > 0.5  # the points do see curved (edge / corner) regions


def test_signed_distance_gradient_matches_finite_differences(meshes):
    # Outside a convex shape the distance is C1, so central differences are valid at every point.
    _, _, mesh = meshes["icosphere"]
    points = _points(3, 64) * 1.5
    points = points[jnp.linalg.norm(points, axis=1) > 1.0]
    f = jax.jit(lambda p: M.signed_distance(mesh, p)[0])
    grad = jax.grad(lambda p: f(p).sum())(points)
    eps = 1e-2
    fd = jnp.stack([(f(points + eps * e) - f(points - eps * e)) / (2 * eps) for e in jnp.eye(3)], axis=1)
    assert_close(grad, fd, atol=2e-3)


def test_signed_distance_under_vmap(meshes):
    vertices, faces, mesh = meshes["torus"]
    batch = jnp.stack([_points(10 + b, 64) for b in range(3)])
    sdf, _ = jax.vmap(lambda p: M.signed_distance(mesh, p))(batch)
    assert_close(sdf, jax.vmap(lambda p: M.signed_distance_reference(p, vertices, faces)[0])(batch), atol=1e-5)


def test_max_dist_marks_far_points_as_outside(meshes):
    _, _, mesh = meshes["icosphere"]
    points = jnp.array([[0.0, 0.0, 0.9], [0.0, 0.0, 3.0]])
    sdf, normal = M.signed_distance(mesh, points, max_dist=0.5)
    assert_close(sdf, [0.1, 0.5], atol=2e-3)  # the sphere's faces sit just inside radius 0.8
    assert_close(normal[1], jnp.zeros(3))


def test_penalty_forces_are_minus_the_energy_gradient(meshes):
    vertices, faces, mesh = meshes["icosphere"]
    points = _points(4, 128, 1.0)
    energy, force = M.mesh_penalty(mesh, points, stiffness=100.0, margin=0.05)
    reference = jax.jit(lambda p: M.mesh_penalty_reference(p, vertices, faces, stiffness=100.0, margin=0.05))
    ref_energy, ref_force = reference(points)
    assert_close(energy, ref_energy, rtol=1e-5, atol=1e-6)
    assert_close(force, ref_force, rtol=1e-3, atol=1e-3)  # forces reach ~40: float32 roundoff
    grad = jax.grad(lambda p: M.mesh_penalty(mesh, p, stiffness=100.0, margin=0.05)[0].sum())(points)
    assert_close(force, -grad, rtol=1e-3, atol=1e-3)
    active = energy > 0
    assert 0 < int(active.sum()) < points.shape[0]
    # Inside a sphere the push is outwards; particles beyond the margin feel nothing.
    assert bool(jnp.all(jnp.sum(force * points, axis=1)[active] > 0))
    assert_close(force[~active], jnp.zeros_like(force[~active]))


def test_mesh_obstacle_stops_a_falling_cloth():
    """A cloth dropped on a sphere rests on it (penetration within the margin) with the obstacle's forces as
    the cloth's feedback force; the rollout stays differentiable end to end."""
    vertices, faces = icosphere(2, radius=0.3)
    obstacle = MeshObstacle.from_arrays(vertices, faces, stiffness=2000.0, margin=0.02)
    np.testing.assert_array_equal(obstacle.faces, faces)
    grid = make_cloth_grid(8, 8, spacing=0.1, origin=(-0.35, 0.45, -0.35), plane="xz", mass=0.01)
    cloth = Cloth.from_grid(grid, stiffness=[200.0, 100.0, 5.0], damping=[1.0, 0.5, 0.05], dt=2e-3, drag=1.0)
    x0 = jnp.asarray(grid.positions)

    @eqx.filter_jit
    def drop(cloth, obstacle, x0):
        xs, _ = cloth.rollout(x0, jnp.zeros_like(x0), num_steps=300, policy=lambda x, v, t: obstacle.forces(x))
        return xs

    xs = drop(cloth, obstacle, x0)
    sdf, _ = obstacle.signed_distance(xs[-1])
    assert float(xs[-1][:, 1].min()) < 0.2  # the free edges fell past the top of the sphere...
    assert float(sdf.min()) > -0.02  # ...but nothing went through it

    # Gradient of the final height through 300 steps of contact, with respect to the initial positions.
    g = jax.grad(lambda x: drop(cloth, obstacle, x)[-1][:, 1].mean())(x0)
    assert bool(jnp.all(jnp.isfinite(g))) and float(jnp.abs(g).max()) > 0


def test_errors_name_the_argument_and_the_fix(meshes):
    _, _, mesh = meshes["box"]
    with pytest.raises(TypeError, match=r"'mesh' must be a wp.Mesh .*make_mesh"):
        M.signed_distance(123, jnp.zeros((4, 3)))
    with pytest.raises(TypeError, match=r"'points' must be float32.*astype"):
        M.signed_distance(mesh, jnp.zeros((4, 3), jnp.int32))
    with pytest.raises(ValueError, match=r"'points' must have shape \(n, 3\), got \(4,\)"):
        M.signed_distance(mesh, jnp.zeros(4))
    with pytest.raises(ValueError, match=r"face indices must lie in \[0, 3\)"):
        M.make_mesh(np.zeros((3, 3)), np.array([[0, 1, 3]]))
