"""warpnn calls under ``jax_debug_nans`` / ``jax_debug_infs`` (``_sharding._impl``, ``_bridge._fence``).

A NaN (or inf) made by a Warp kernel, forward or adjoint, eager or under ``jax.jit``, raises JAX's
``FloatingPointError`` naming the kernel and the direction; a NaN made by a JAX op before the call is blamed on
that op; one arriving through an argument is blamed, as JAX blames any, on the first operation whose result holds it
(the warpnn call), never on warpnn's optimization barrier.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn

from .helpers import assert_close


@wp.kernel
def sqrt_kernel(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = wp.sqrt(x[i])


@wp.kernel
def scale_kernel(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = 3.0 * x[i]


sqrt_fn = warpnn.jax_kernel(sqrt_kernel)
scale_fn = warpnn.jax_kernel(scale_kernel)


def forward(x):
    return sqrt_fn(x)[0]


def loss(x):
    return sqrt_fn(x)[0].sum()


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nan_from_the_forward_kernel_names_it(jit):
    f = jax.jit(forward) if jit else forward
    with jax.debug_nans(True), pytest.raises(FloatingPointError, match=r"nan.*warpnn kernel 'sqrt_kernel' \(forward\)"):
        jax.block_until_ready(f(jnp.array([1.0, -1.0, 4.0])))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_inf_from_the_adjoint_kernel_names_it(jit):
    # d sqrt(x)/dx = 0.5 / sqrt(x) is inf at 0; the forward value sqrt(0) = 0 is finite.
    g = jax.grad(loss)
    g = jax.jit(g) if jit else g
    with jax.debug_infs(True), pytest.raises(FloatingPointError, match=r"inf.*warpnn kernel 'sqrt_kernel' \(adjoint\)"):
        jax.block_until_ready(g(jnp.array([0.0, 1.0])))


def test_nan_made_by_a_jax_op_is_blamed_on_that_op():
    with jax.debug_nans(True), pytest.raises(FloatingPointError, match=r"encountered in log"):
        jax.block_until_ready(jax.jit(lambda x: scale_fn(jnp.log(x))[0])(jnp.array([-1.0, 1.0])))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nan_from_an_input_is_not_blamed_on_the_barrier(jit):
    # Made outside the debug context, so no checked op made it: the first checked op that produces a NaN is the
    # Warp call. (A NumPy input would be blamed on its conversion, 'stage', as in pure JAX.)
    x = jnp.array([np.nan, 1.0])
    f = (lambda x: scale_fn(x)[0])
    f = jax.jit(f) if jit else f
    with jax.debug_nans(True), pytest.raises(FloatingPointError) as info:
        jax.block_until_ready(f(x))
    assert "optimization_barrier" not in str(info.value)
    assert "warpnn kernel 'scale_kernel' (forward)" in str(info.value)


def test_finite_values_pass_the_checks_unchanged():
    x = jnp.linspace(0.5, 2.0, 8)
    xs = jnp.stack([x, 2 * x])
    with jax.debug_nans(True), jax.debug_infs(True):
        values = [forward(x), jax.jit(forward)(x), jax.grad(loss)(x), jax.jit(jax.grad(loss))(x),
                  jax.vmap(forward)(xs), jax.jit(jax.vmap(jax.grad(loss)))(xs)]
    expected = [jnp.sqrt(x), jnp.sqrt(x), 0.5 / jnp.sqrt(x), 0.5 / jnp.sqrt(x), jnp.sqrt(xs), 0.5 / jnp.sqrt(xs)]
    for got, want in zip(values, expected):
        assert_close(got, want)


def test_without_the_flags_nans_are_returned():
    out = np.asarray(jax.jit(forward)(jnp.array([1.0, -1.0])))
    assert out[0] == 1.0 and np.isnan(out[1])
