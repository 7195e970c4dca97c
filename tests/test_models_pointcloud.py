"""Point-cloud kernels (nearest neighbours, Chamfer, radius features) against brute-force pure-JAX references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from .helpers import assert_close
from warpnn.kernels import pointcloud as pc
from warpnn_models.pointcloud import PointDeformer, chamfer, chamfer_reference, sphere_points, torus_points


def _cloud(seed, n, scale=1.0, shift=0.0):
    return jax.random.normal(jax.random.PRNGKey(seed), (n, 3), jnp.float32) * scale + shift


# Clouds that exercise each path of the query: overlapping (grid rings), far apart (tree from the root),
# anisotropic and flat (thin boxes), clustered with outliers, and tiny or odd sizes (padded leaves).
def _flat(seed, n):
    return _cloud(seed, n) * jnp.array([2.0, 1.0, 0.0])


def _clusters(seed, n):
    centers = jnp.array([[0.0, 0.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 40.0]])
    return _cloud(seed, n, 0.05) + centers[jnp.arange(n) % 3]


CASES = {
    "overlapping": lambda: (_cloud(0, 700), _cloud(1, 500, 0.8, 0.2)),
    "far_apart": lambda: (_cloud(2, 300), _cloud(3, 400, 0.5, 25.0)),
    "flat_vs_blob": lambda: (_flat(4, 600), _cloud(5, 257)),
    "clusters_and_outliers": lambda: (_clusters(6, 999), jnp.concatenate([_clusters(7, 400), _cloud(8, 5, 100.0)])),
    "single_point": lambda: (_cloud(9, 64), _cloud(10, 1)),
    "odd_sizes": lambda: (_cloud(11, 17), _cloud(12, 33)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_nearest_neighbors_match_brute_force(case):
    queries, points = CASES[case]()
    idx, d2 = jax.jit(pc.nearest_neighbors)(queries, points)
    ref_idx, ref_d2 = jax.jit(pc.nearest_neighbors_reference)(queries, points)
    assert idx.dtype == jnp.int32 and idx.shape == (queries.shape[0],)
    assert_close(d2, ref_d2, rtol=1e-5, atol=1e-6)
    # Random clouds have no exact ties, so the indices agree too, except where two candidates are equally
    # near up to float rounding (possible in far-apart clouds on another backend); there either is right.
    differ = np.asarray(idx != ref_idx)
    assert differ.mean() <= 0.01, differ.sum()
    at_idx = jnp.sum((queries - points[idx]) ** 2, axis=-1)
    assert_close(at_idx[differ], ref_d2[differ], rtol=1e-6)


@pytest.mark.parametrize("case", ["overlapping", "far_apart"])
def test_chamfer_value_and_gradients_wrt_both_clouds(case):
    x, y = CASES[case]()
    value, (gx, gy) = jax.jit(jax.value_and_grad(chamfer, argnums=(0, 1)))(x, y)
    ref_value, (ref_gx, ref_gy) = jax.jit(jax.value_and_grad(chamfer_reference, argnums=(0, 1)))(x, y)
    assert_close(value, ref_value, rtol=1e-5)
    scale = float(jnp.abs(ref_gx).max())
    assert_close(gx, ref_gx, rtol=1e-4, atol=1e-6 * scale)
    assert_close(gy, ref_gy, rtol=1e-4, atol=1e-6 * scale)
    assert float(jnp.abs(gy).max()) > 0  # the target cloud gets a gradient too


def test_chamfer_gradient_matches_finite_differences(x64):
    # float64 clouds: neighbours are found in float32, distances and gradients computed in float64.
    x = _cloud(13, 40).astype(jnp.float64)
    y = _cloud(14, 50, 0.7, 0.3).astype(jnp.float64)
    check_grads(jax.jit(chamfer), (x, y), order=1, modes=("rev",), eps=1e-5, atol=1e-6, rtol=1e-6)


def test_chamfer_of_a_cloud_with_itself_is_zero():
    x = _cloud(15, 300)
    assert float(chamfer(x, x)) == 0.0
    assert_close(jax.grad(chamfer)(x, x), jnp.zeros_like(x))


def test_chamfer_under_vmap_and_scan():
    xs = jnp.stack([_cloud(20 + b, 200, 1.0, 0.1 * b) for b in range(3)])
    y = _cloud(30, 150)
    batched = jax.jit(jax.vmap(chamfer, in_axes=(0, None)))(xs, y)
    assert_close(batched, jax.vmap(chamfer_reference, in_axes=(0, None))(xs, y), rtol=1e-5)

    # A few steps of gradient descent on x inside lax.scan (the index is rebuilt every step, in the graph).
    def descend(x, _):
        loss, g = jax.value_and_grad(chamfer)(x, y)
        return x - 0.2 * g * x.shape[0], loss

    final, losses = jax.jit(lambda x: jax.lax.scan(descend, x, None, length=5))(xs[0])
    assert losses[-1] < 0.5 * losses[0]
    assert_close(chamfer(final, y), chamfer_reference(final, y), rtol=1e-5)


@pytest.mark.parametrize("radius", [0.3, 0.8])
def test_radius_features_match_reference(radius):
    q, p = _cloud(40, 300), _cloud(41, 500, 0.8)
    count, mean_offset, density = jax.jit(pc.radius_features, static_argnums=2)(q, p, radius)
    ref_count, ref_mean_offset, ref_density = pc.radius_features_reference(q, p, radius)
    np.testing.assert_array_equal(np.asarray(count), np.asarray(ref_count))
    assert int(count.sum()) > q.shape[0]  # the radius is not so small that the test is vacuous
    assert_close(mean_offset, ref_mean_offset, rtol=1e-5, atol=1e-6)
    assert_close(density, ref_density, rtol=1e-5, atol=1e-6)

    def loss(features, q, p):
        _, m, d = features(q, p, radius)
        return jnp.sum(d**2) + jnp.sum(m**2)

    got = jax.grad(lambda q, p: loss(pc.radius_features, q, p), argnums=(0, 1))(q, p)
    want = jax.grad(lambda q, p: loss(pc.radius_features_reference, q, p), argnums=(0, 1))(q, p)
    for g, w in zip(got, want):
        assert_close(g, w, rtol=1e-4, atol=1e-5 * float(jnp.abs(w).max()))


def test_radius_features_gradient_matches_finite_differences(x64):
    q = _cloud(42, 30).astype(jnp.float64)
    p = _cloud(43, 40, 0.6).astype(jnp.float64)

    def smooth_features(q, p):
        _, mean_offset, density = pc.radius_features(q, p, 0.8)
        return jnp.sum(density * jnp.sin(jnp.arange(30.0))) + jnp.sum(mean_offset * 0.3)

    check_grads(jax.jit(smooth_features), (q, p), order=1, modes=("rev",), eps=1e-6, atol=1e-5, rtol=1e-5)


def test_radius_features_of_a_cloud_include_each_point_itself():
    x = _cloud(44, 100, 10.0)  # sparse: almost every point is alone within the radius
    count, mean_offset, density = pc.radius_features(x, x, 0.05)
    assert int(count.min()) >= 1
    ref_count, _, ref_density = pc.radius_features_reference(x, x, 0.05)
    np.testing.assert_array_equal(np.asarray(count), np.asarray(ref_count))
    assert_close(density, ref_density, rtol=1e-6)


def test_errors_name_the_argument_and_the_fix():
    x = _cloud(0, 10)
    with pytest.raises(ValueError, match=r"'y' must be a point cloud of shape \(n, 3\).*got shape \(10, 2\).*vmap"):
        chamfer(x, x[:, :2])
    with pytest.raises(ValueError, match=r"'x'.*n >= 1"):
        chamfer(x[:0], x)
    with pytest.raises(TypeError, match=r"'points' must be float32 or float64, got int32.*astype"):
        pc.nearest_neighbors(x, x.astype(jnp.int32))
    with pytest.raises(ValueError, match=r"'radius' must be a positive Python float"):
        pc.radius_features(x, x, -1.0)


def test_mixed_dtypes_are_refused(x64):
    x = _cloud(0, 10)
    with pytest.raises(TypeError, match=r"'x' and 'y' must have the same dtype, got float32 and float64.*astype"):
        chamfer(x, x.astype(jnp.float64))


def test_samplers_and_deformer():
    s = sphere_points(500, radius=2.0)
    assert s.shape == (500, 3) and s.dtype == np.float32
    assert_close(np.linalg.norm(s, axis=1), np.full(500, 2.0), rtol=1e-5)
    assert np.abs(s.mean(0)).max() < 0.01  # evenly spread
    t = torus_points(800, major=1.0, minor=0.3, seed=1)
    ring = np.linalg.norm(t[:, :2], axis=1)
    assert_close((ring - 1.0) ** 2 + t[:, 2] ** 2, np.full(800, 0.09), atol=1e-5)
    # Area-uniform: the outer half of the tube (cos v > 0) holds 1/2 + r / (pi R) of the area.
    outer = np.mean(ring > 1.0)
    assert abs(outer - (0.5 + 0.3 / np.pi)) < 0.05
    model = PointDeformer(jax.random.PRNGKey(0), width=16, depth=2)
    assert_close(model(jnp.asarray(s)), s)  # identity at initialisation
