"""warpnn.kernels.cloth: the Warp kernels against their pure-JAX references and finite differences.

Problem construction and comparisons run under jax.jit: eagerly, every small op would compile its own XLA
program, which dominates the runtime of these small tests on CPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from .helpers import assert_close
from warpnn.kernels.cloth import (
    integrate_particles,
    integrate_particles_reference,
    spring_forces,
    spring_forces_reference,
)


def _springs(rows=4, cols=5):
    """Structural + shear + bend springs of a small grid, independent of warpnn_models (no shared code)."""
    idx = np.arange(rows * cols).reshape(rows, cols)
    pairs = [(idx[:, :-1], idx[:, 1:]), (idx[:-1, :], idx[1:, :]), (idx[:-1, :-1], idx[1:, 1:]),
             (idx[:-1, 1:], idx[1:, :-1]), (idx[:, :-2], idx[:, 2:]), (idx[:-2, :], idx[2:, :])]
    return np.concatenate([np.stack([a.ravel(), b.ravel()], 1) for a, b in pairs]).astype(np.int32)


@functools.partial(jax.jit, static_argnames=("dtype", "rows", "cols"))
def _spring_problem(key, dtype=jnp.float32, rows=4, cols=5):
    springs = _springs(rows, cols)
    n, s = rows * cols, len(springs)
    k = jax.random.split(key, 6)
    grid = np.stack(np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy"), -1).reshape(-1, 2) * 0.1
    x = jnp.asarray(np.c_[grid[:, 0], np.zeros(n), grid[:, 1]], dtype) + 0.02 * jax.random.normal(k[0], (n, 3), dtype)
    v = jax.random.normal(k[1], (n, 3), dtype)
    stiffness = jax.random.uniform(k[2], (s,), dtype, 10.0, 100.0)
    damping = jax.random.uniform(k[3], (s,), dtype, 0.1, 1.0)
    rest = jnp.linalg.norm(x[springs[:, 1]] - x[springs[:, 0]], axis=1) * jax.random.uniform(k[4], (s,), dtype, 0.8, 1.2)
    return x, v, jnp.asarray(springs), stiffness, damping, rest


def _spring_loss(fn, springs, weights):
    return lambda x, v, ke, kd, rest: jnp.sum(weights * fn(x, v, springs, ke, kd, rest))


def test_spring_forces_match_reference(key):
    x, v, springs, ke, kd, rest = _spring_problem(key)
    f = jax.jit(spring_forces)(x, v, springs, ke, kd, rest)
    assert f.shape == x.shape and f.dtype == jnp.float32
    assert_close(f, jax.jit(spring_forces_reference)(x, v, springs, ke, kd, rest), rtol=1e-5, atol=1e-4)
    # Internal forces: they sum to zero (Newton's third law).
    assert_close(np.asarray(f).sum(0), np.zeros(3), atol=1e-3)


def test_spring_forces_independent_check():
    """One stretched spring along x, with a closing speed: hand-computed force."""
    x = jnp.array([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    v = jnp.array([[0.0, 0.0, 0.0], [-0.5, 3.0, 0.0]])  # the y-velocity is perpendicular: no damping from it
    f = spring_forces(x, v, jnp.array([[0, 1]], jnp.int32), jnp.array([10.0]), jnp.array([2.0]), jnp.array([1.5]))
    fs = 10.0 * (2.0 - 1.5) + 2.0 * (-0.5)  # = 4: pulls the particles together
    assert_close(f, jnp.array([[fs, 0.0, 0.0], [-fs, 0.0, 0.0]]), atol=1e-6)


def test_spring_forces_gradients_match_reference(key):
    x, v, springs, ke, kd, rest = _spring_problem(key)
    weights = np.random.default_rng(7).normal(size=x.shape).astype(np.float32)
    args = (x, v, ke, kd, rest)
    grads = jax.jit(jax.grad(_spring_loss(spring_forces, springs, weights), argnums=range(5)))(*args)
    expected = jax.jit(jax.grad(_spring_loss(spring_forces_reference, springs, weights), argnums=range(5)))(*args)
    for name, g, e in zip(("x", "v", "stiffness", "damping", "rest_length"), grads, expected):
        assert_close(g, e, rtol=1e-4, atol=1e-3, err_msg=f"d/d{name}")


def test_spring_forces_float64_finite_differences(key, x64):
    x, v, springs, ke, kd, rest = _spring_problem(key, jnp.float64, rows=3, cols=3)
    assert jax.jit(spring_forces)(x, v, springs, ke, kd, rest).dtype == jnp.float64
    weights = np.random.default_rng(3).normal(size=x.shape)
    check_grads(_spring_loss(spring_forces, springs, weights), (x, v, ke, kd, rest), order=1, modes=("rev",),
                eps=1e-6, atol=1e-6, rtol=1e-6)


def test_spring_forces_vmap_over_cloths(key):
    """A batch of cloths sharing connectivity: per-element launches keep each cloth's scatter separate."""
    x, v, springs, ke, kd, rest = _spring_problem(key)
    xs = np.asarray(x) + 0.01 * np.random.default_rng(1).normal(size=(3, *x.shape)).astype(np.float32)
    kes = np.asarray(ke) * np.arange(1.0, 4.0, dtype=np.float32)[:, None]
    in_axes = (0, None, None, 0, None, None)
    batched = jax.jit(jax.vmap(spring_forces, in_axes))(xs, v, springs, kes, kd, rest)
    expected = jax.jit(jax.vmap(spring_forces_reference, in_axes))(xs, v, springs, kes, kd, rest)
    assert_close(batched, expected, rtol=1e-5, atol=1e-4)

    # Gradients to batched (xs, kes) and to shared (kd, v) arguments; shared ones sum over the batch.
    def loss(fn):
        return lambda xs, kes, kd, v: jnp.sum(jax.vmap(fn, in_axes)(xs, v, springs, kes, kd, rest) ** 2)

    grads = jax.jit(jax.grad(loss(spring_forces), range(4)))(xs, kes, kd, v)
    expected = jax.jit(jax.grad(loss(spring_forces_reference), range(4)))(xs, kes, kd, v)
    for name, g, e in zip(("xs", "kes", "kd", "v"), grads, expected):
        assert g.shape == e.shape, name
        assert_close(g, e, rtol=1e-4, atol=1e-4 * np.abs(np.asarray(e)).max(), err_msg=name)


def test_spring_forces_under_jit_and_scan(key):
    x, v, springs, ke, kd, rest = _spring_problem(key)

    def relax(fn):
        def body(x, _):
            return x + 1e-4 * fn(x, v, springs, ke, kd, rest), None
        return jax.jit(lambda x: jax.lax.scan(body, x, None, length=5)[0])

    assert_close(relax(spring_forces)(x), relax(spring_forces_reference)(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(stiffness=jnp.ones(3)), "'stiffness' must have shape"),
        (dict(v=jnp.ones((4, 3))), "'v' must have shape"),
        (dict(springs=jnp.ones((5,), jnp.int32)), "'springs' must have shape"),
    ],
)
def test_spring_forces_errors_name_the_argument(key, bad, match):
    x, v, springs, ke, kd, rest = _spring_problem(key)
    kwargs = dict(x=x, v=v, springs=springs, stiffness=ke, damping=kd, rest_length=rest) | bad
    with pytest.raises(ValueError, match=match):
        spring_forces(**kwargs)


# --------------------------------------------------------------------------------------------------
# integrate_particles

SCENE = dict(dt=5e-3, gravity=-9.81, drag=0.3, ground_ke=200.0, ground_kd=2.0, friction=0.6, friction_eps=0.05)


@functools.partial(jax.jit, static_argnames=("dtype", "n"))
def _particles(key, dtype=jnp.float32, n=12):
    k = jax.random.split(key, 4)
    x = jax.random.uniform(k[0], (n, 3), dtype, -1.0, 1.0)
    # Keep every particle clearly in or out of contact (y away from 0), so the kink at y = 0 is not probed.
    x = x.at[:, 1].set(jnp.where(jnp.arange(n) % 2 == 0, -0.05, 0.3) + 0.01 * x[:, 1])
    v = jax.random.normal(k[1], (n, 3), dtype)
    v = v.at[:, 1].set(-1.0 - jnp.abs(v[:, 1]))  # approaching the ground: the normal force is not clamped to 0
    f = jax.random.normal(k[2], (n, 3), dtype)
    inv_mass = jax.random.uniform(k[3], (n,), dtype, 0.5, 2.0).at[jnp.array([1, 4])].set(0.0)  # two pins
    return x, v, f, inv_mass


def test_integrate_matches_reference(key):
    x, v, f, w = _particles(key)
    got = jax.jit(functools.partial(integrate_particles, **SCENE))(x, v, f, w)
    expected = jax.jit(functools.partial(integrate_particles_reference, **SCENE))(x, v, f, w)
    for g, e in zip(got, expected):
        assert_close(g, e, rtol=1e-5, atol=1e-6)
    # Pinned particles are kinematic.
    assert_close(got[1][jnp.array([1, 4])], v[jnp.array([1, 4])])


def test_integrate_independent_check():
    """Free fall, then a particle resting in the ground with friction opposing its slide."""
    x = jnp.array([[0.0, 1.0, 0.0], [0.0, -0.01, 0.0]])
    v = jnp.array([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    x1, v1 = integrate_particles(x, v, jnp.zeros((2, 3)), jnp.ones(2), dt=0.1, gravity=-10.0,
                                 ground_ke=1000.0, friction=0.5, friction_eps=1e-6)
    assert_close(v1[0], jnp.array([0.0, -1.0, 0.0]), atol=1e-6)
    assert_close(x1[0], jnp.array([0.0, 0.9, 0.0]), atol=1e-6)
    fn = 1000.0 * 0.01  # normal force: 10; friction 5 against +x
    assert_close(v1[1], jnp.array([2.0 - 0.1 * 0.5 * fn, 0.1 * (fn - 10.0), 0.0]), atol=1e-5)


def test_integrate_gradients_match_reference(key):
    x, v, f, w = _particles(key)
    weights = np.random.default_rng(5).normal(size=(2, *x.shape)).astype(np.float32)

    def loss(fn):
        return lambda *a: jnp.sum(weights * jnp.stack(fn(*a, **SCENE)))

    grads = jax.jit(jax.grad(loss(integrate_particles), range(4)))(x, v, f, w)
    expected = jax.jit(jax.grad(loss(integrate_particles_reference), range(4)))(x, v, f, w)
    for name, g, e in zip(("x", "v", "f", "inv_mass"), grads, expected):
        assert_close(g, e, rtol=1e-4, atol=1e-4, err_msg=f"d/d{name}")


def test_integrate_float64_finite_differences(key, x64):
    x, v, f, w = _particles(key, jnp.float64)
    weights = np.random.default_rng(5).normal(size=(2, *x.shape))

    def loss(x, v, f, w):
        return jnp.sum(weights * jnp.stack(integrate_particles(x, v, f, w, **SCENE)))

    # With pins, for x, v, f; inv_mass without pins: a finite difference at w = 0 would unpin the particle.
    check_grads(lambda x, v, f: loss(x, v, f, w), (x, v, f), order=1, modes=("rev",), eps=1e-6, atol=1e-6, rtol=1e-6)
    check_grads(lambda w: loss(x, v, f, w), (jnp.where(w == 0, 1.0, w),), order=1, modes=("rev",), eps=1e-6,
                atol=1e-6, rtol=1e-6)


def test_integrate_rejects_wrong_shapes(key):
    x, v, f, w = _particles(key)
    with pytest.raises(ValueError, match="'inv_mass' must have shape"):
        integrate_particles(x, v, f, w[:-1], dt=1e-3)
    with pytest.raises(TypeError, match="float32 or float64"):
        integrate_particles(x.astype(jnp.int32), v, f, w, dt=1e-3)
