"""warpnn_models.cloth: the Warp cloth model against the same model on the pure-JAX backend, and finite differences."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from warpnn_models.cloth import BEND, SHEAR, STRETCH, Cloth, make_cloth_grid, step_reference

from .helpers import assert_close

# A small cloth that starts just above the ground, falls into it and slides (contact and friction active).
SCENE = dict(dt=2e-3, drag=0.2, ground_ke=500.0, ground_kd=2.0, friction=0.5, friction_eps=0.05)
T = 40


@pytest.fixture(scope="module")
def grid():
    return make_cloth_grid(4, 5, spacing=0.1, origin=(0.0, 0.02, 0.0), plane="xz", mass=0.05, pinned=[0])


def _cloth(grid, backend="warp", dtype=jnp.float32):
    cloth = Cloth.from_grid(grid, stiffness=[300.0, 150.0, 10.0], damping=[1.0, 0.5, 0.05], backend=backend, **SCENE)
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, cloth)


def _state(grid, dtype=jnp.float32):
    rng = np.random.default_rng(0)
    x0 = grid.positions + 0.01 * rng.normal(size=grid.positions.shape)
    v0 = rng.normal(size=grid.positions.shape) * [0.5, 0.0, 0.5] + [0.3, -1.0, 0.0]
    v0[grid.inv_mass == 0] = 0.0
    controls = 0.05 * rng.normal(size=(T, *grid.positions.shape))
    return jnp.asarray(x0, dtype), jnp.asarray(v0, dtype), jnp.asarray(controls, dtype)


# --------------------------------------------------------------------------------------------------
# The grid


def test_make_cloth_grid_counts_and_geometry():
    rows, cols = 4, 6
    g = make_cloth_grid(rows, cols, spacing=0.2, origin=(1.0, 2.0, 3.0), plane="xy", pinned="top-corners")
    n = rows * cols
    assert g.positions.shape == (n, 3) and g.springs.dtype == np.int32
    counts = np.bincount(g.kind, minlength=3)
    assert counts[STRETCH] == rows * (cols - 1) + (rows - 1) * cols
    assert counts[SHEAR] == 2 * (rows - 1) * (cols - 1)
    assert counts[BEND] == rows * (cols - 2) + (rows - 2) * cols
    lengths = {STRETCH: 0.2, SHEAR: 0.2 * np.sqrt(2), BEND: 0.4}
    for kind, length in lengths.items():
        np.testing.assert_allclose(g.rest_length[g.kind == kind], length, rtol=1e-6)
    # "xy": row 0 on top, rows going down; pins at the two top corners.
    np.testing.assert_allclose(g.positions[cols + 1], [1.2, 1.8, 3.0], rtol=1e-6)
    assert set(np.flatnonzero(g.inv_mass == 0)) == {0, cols - 1}
    assert len({tuple(sorted(s)) for s in g.springs.tolist()}) == len(g.springs)  # no duplicates
    # Row by row (the order the spring kernel runs fastest in): the first particle's row never decreases.
    assert np.all(np.diff(g.springs[:, 0] // cols) >= 0)


def test_make_cloth_grid_benchmark_size_formula():
    # Without bend springs, a grid has ~4 springs per particle: 2048^2 particles -> 16.8M springs.
    g = make_cloth_grid(64, 64, bend=False)
    assert len(g.springs) == 2 * 64 * 63 + 2 * 63 * 63


def test_make_cloth_grid_errors():
    with pytest.raises(ValueError, match="rows and cols must be >= 2"):
        make_cloth_grid(1, 5)
    with pytest.raises(ValueError, match="plane must be"):
        make_cloth_grid(3, 3, plane="yz")
    with pytest.raises(ValueError, match="pinned must be"):
        make_cloth_grid(3, 3, pinned="corners")


def test_cloth_checks_parameter_shapes(grid):
    with pytest.raises(ValueError, match="one entry per material"):
        Cloth.from_grid(grid, stiffness=[1.0, 2.0, 3.0], damping=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"material indices must be in \[0, 2\)"):
        Cloth.from_grid(grid, stiffness=[1.0, 2.0], damping=[1.0, 1.0])
    with pytest.raises(ValueError, match="per spring and must have shape"):
        Cloth.from_grid(grid, stiffness=[1.0] * 3, damping=[1.0] * 3, material=False)
    with pytest.raises(ValueError, match="backend must be"):
        Cloth.from_grid(grid, stiffness=[1.0] * 3, damping=[1.0] * 3, backend="torch")
    with pytest.raises(ValueError, match="num_steps"):
        _cloth(grid).rollout(*_state(grid)[:2])


# --------------------------------------------------------------------------------------------------
# One step


def test_step_matches_reference(grid):
    cloth = _cloth(grid)
    x0, v0, controls = _state(grid)
    got = jax.jit(lambda c, x, v, u: c.step(x, v, u))(cloth, x0, v0, controls[0])
    expected = jax.jit(step_reference)(cloth, x0, v0, controls[0])
    for g, e in zip(got, expected):
        assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(x0[:, 1]) > 0) and np.any(np.asarray(got[0][:, 1]) < np.asarray(x0[:, 1]))


def test_material_table_equals_per_spring_parameters(grid):
    cloth = _cloth(grid)
    per_spring = dataclasses.replace(cloth, stiffness=cloth.spring_parameters()[0],
                                     damping=cloth.spring_parameters()[1], material=None)
    x0, v0, _ = _state(grid)
    assert_close(jax.jit(lambda c: c.forces(x0, v0))(per_spring), jax.jit(lambda c: c.forces(x0, v0))(cloth))


# --------------------------------------------------------------------------------------------------
# Rollouts: forward, gradients to every parameter, initial state and controls


def _rollout_loss(cloth, x0, v0, controls):
    xs, vs = cloth.rollout(x0, v0, controls)
    # Weigh late frames more, so the loss depends on the whole trajectory, contact included.
    w = jnp.linspace(0.5, 1.5, xs.shape[0])[:, None, None]
    return jnp.sum(w * xs**2) + 0.1 * jnp.sum(w * vs * jnp.asarray([1.0, 0.5, -1.0], vs.dtype))


def _grads(cloth, x0, v0, controls):
    params, static = eqx.partition(cloth, eqx.is_inexact_array)
    fn = lambda p, *a: _rollout_loss(eqx.combine(p, static), *a)  # noqa: E731
    return jax.jit(jax.value_and_grad(fn, argnums=(0, 1, 2, 3)))(params, x0, v0, controls)


def test_rollout_matches_reference(grid):
    x0, v0, controls = _state(grid)
    run = jax.jit(lambda c: c.rollout(x0, v0, controls))
    xs, vs = run(_cloth(grid))
    xs_ref, vs_ref = run(_cloth(grid, "jax"))
    assert xs.shape == (T, x0.shape[0], 3)
    assert_close(xs, xs_ref, rtol=1e-4, atol=1e-5)
    assert_close(vs, vs_ref, rtol=1e-4, atol=1e-4)
    assert np.asarray(xs[:, :, 1]).min() < 0  # the cloth did reach the ground
    assert_close(xs[:, 0], np.broadcast_to(x0[0], (T, 3)))  # the pin stays


def test_rollout_gradients_match_reference(grid):
    x0, v0, controls = _state(grid)
    value, grads = _grads(_cloth(grid), x0, v0, controls)
    value_ref, grads_ref = _grads(_cloth(grid, "jax"), x0, v0, controls)
    assert_close(value, value_ref, rtol=1e-5)
    (params, g_x0, g_v0, g_u), (params_ref, r_x0, r_v0, r_u) = grads, grads_ref
    for name in ("stiffness", "damping", "rest_length", "inv_mass"):
        g, r = getattr(params, name), getattr(params_ref, name)
        assert np.abs(np.asarray(r)).max() > 0, name
        assert_close(g, r, rtol=2e-3, atol=2e-3 * np.abs(np.asarray(r)).max(), err_msg=name)
    for name, g, r in (("x0", g_x0, r_x0), ("v0", g_v0, r_v0), ("controls", g_u, r_u)):
        assert_close(g, r, rtol=2e-3, atol=2e-3 * np.abs(np.asarray(r)).max(), err_msg=name)


def test_rollout_gradients_finite_differences(grid, x64):
    """float64 Warp kernels through lax.scan against central differences."""
    cloth = _cloth(grid, dtype=jnp.float64)
    x0, v0, controls = _state(grid, jnp.float64)
    controls = controls[:15]

    def loss(stiffness, damping, rest_length, x0, v0, controls):
        c = dataclasses.replace(cloth, stiffness=stiffness, damping=damping, rest_length=rest_length)
        return _rollout_loss(c, x0, v0, controls)

    check_grads(jax.jit(loss), (cloth.stiffness, cloth.damping, cloth.rest_length, x0, v0, controls), order=1,
                modes=("rev",), eps=1e-6, atol=1e-5, rtol=1e-5)


def test_rollout_vmap_over_initial_states(grid):
    x0, v0, controls = _state(grid)
    x0s = x0 + jnp.asarray(np.random.default_rng(2).normal(size=(3, *x0.shape)) * 0.01, jnp.float32)

    def batched_loss(cloth, x0s):
        return jnp.sum(jax.vmap(lambda x: cloth.rollout(x, v0, controls)[0][-1])(x0s) ** 2)

    run = jax.jit(jax.value_and_grad(batched_loss, argnums=1))
    value, grad = run(_cloth(grid), x0s)
    value_ref, grad_ref = run(_cloth(grid, "jax"), x0s)
    assert_close(value, value_ref, rtol=1e-4)
    assert_close(grad, grad_ref, rtol=1e-3, atol=1e-3 * np.abs(np.asarray(grad_ref)).max())


def test_rollout_policy_gradient_matches_reference(grid):
    """A feedback policy closed over traced parameters: gradient flows through the Warp adjoints to them."""
    x0, v0, _ = _state(grid)
    gain = jnp.asarray([[0.5, 0.0, 0.0], [0.0, -0.2, 0.0], [0.0, 0.0, 0.3]], jnp.float32)

    def loss(gain, cloth):
        policy = lambda x, v, t: -(x - x0) @ gain - 0.01 * v * t.astype(x.dtype)  # noqa: E731
        xs, _ = cloth.rollout(x0, v0, policy=policy, num_steps=T)
        return jnp.sum(xs[-1] ** 2)

    run = jax.jit(jax.value_and_grad(loss))
    value, grad = run(gain, _cloth(grid))
    value_ref, grad_ref = run(gain, _cloth(grid, "jax"))
    assert_close(value, value_ref, rtol=1e-5)
    assert_close(grad, grad_ref, rtol=2e-3, atol=1e-4)
    assert np.abs(np.asarray(grad)).max() > 0
