"""Outputs with a zero cotangent add nothing to gradients (no 0 * inf), as in pure JAX."""

import jax
import jax.numpy as jnp
import pytest
import warp as wp

import warpnn
from warpnn import _launch

from .helpers import assert_close


@wp.kernel
def sqrt_and_copy(x: wp.array(dtype=float), a: wp.array(dtype=float), b: wp.array(dtype=float)):
    i = wp.tid()
    s = wp.sqrt(x[i])
    a[i] = s
    b[i] = x[i]


@wp.func
def log_into(out: wp.array(dtype=float), i: int, v: float):
    out[i] = wp.log(v)


@wp.kernel
def log_via_function(x: wp.array(dtype=float), a: wp.array(dtype=float), b: wp.array(dtype=float)):
    i = wp.tid()
    log_into(a, i, x[i])  # a call that writes: kept (the twin only drops what it can prove unused)
    b[i] = 2.0 * x[i]


@pytest.mark.parametrize("launcher", ["native", "python"])
def test_an_unused_output_contributes_no_nan(launcher):
    with _launch.use_launcher(launcher):
        f = warpnn.jax_kernel(sqrt_and_copy, num_outputs=2)
        x = jnp.array([0.0, 4.0, -1.0])
        g = jax.grad(lambda x: f(x)[1].sum())(x)
        assert_close(g, jax.grad(lambda x: x.sum())(x), 0, 0)  # pure JAX: [1, 1, 1]; 0 * inf would give NaN
        x = jnp.array([1.0, 4.0, 9.0])
        g = jax.jit(jax.grad(lambda x: f(x)[0].sum() + 3.0 * f(x)[1].sum()))(x)
        assert_close(g, jax.grad(lambda x: jnp.sqrt(x).sum() + 3.0 * x.sum())(x), 1e-6, 1e-6)


def test_outputs_written_through_functions_are_kept_and_still_right():
    f = warpnn.jax_kernel(log_via_function, num_outputs=2)
    x = jnp.array([1.0, 2.0, 3.0])
    assert_close(jax.grad(lambda x: f(x)[1].sum())(x), jnp.full(3, 2.0), 0, 0)
    assert_close(jax.grad(lambda x: f(x)[0].sum())(x), 1.0 / x, 1e-6, 1e-6)
