"""warpnn._unrolled: a kernel whose dynamic loops run over a scalar argument or an array's shape differentiates
through its twin with the call's values as constants, where Warp unrolls those loops; Warp's own tape gets these
gradients wrong (its adjoint of a dynamic loop sees the carried values from before the loop). References: pure-JAX
versions of the same math (tests/test_access.py), central differences, and wp.Tape on the unrolled twin itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _unrolled
from warpnn._signature import signature_of

from .helpers import assert_close, on_cpu_threads
from .test_access import (
    WARP_ADJOINT_WRONG,
    _LOOP_X,
    _loop_call,
    _loop_tape_grad,
    loop_counter_indexes,
    loop_flag_guards_the_store,
    loop_norm,
    loop_reads_an_earlier_iteration,
    loop_returns_from_the_thread,
    loop_running_product,
    loop_skips_with_continue,
    loop_sum_scaled_in_place,
    loop_two_sums_multiplied,
)

OVER_THE_ARGUMENT = [loop_norm, loop_running_product, loop_two_sums_multiplied, loop_counter_indexes,
                     loop_flag_guards_the_store, loop_sum_scaled_in_place, loop_skips_with_continue,
                     loop_reads_an_earlier_iteration]


@pytest.mark.parametrize("kernel", OVER_THE_ARGUMENT, ids=lambda k: k.key)
def test_a_loop_over_an_argument_differentiates_where_warps_tape_is_wrong(kernel):
    ref, _ = WARP_ADJOINT_WRONG[kernel]
    x = jnp.asarray(_LOOP_X)
    want = jax.grad(lambda x: ref(x).sum())(x)
    assert_close(jax.jit(jax.grad(lambda x: _loop_call(kernel)(x).sum()))(x), want)
    assert not np.allclose(_loop_tape_grad(kernel), want, rtol=1e-3, atol=1e-3)  # Warp's tape, on the kernel itself


def test_a_return_from_an_unrolled_loop_differentiates():
    f = warpnn.jax_kernel(loop_returns_from_the_thread, num_outputs=1)
    x = jnp.asarray(_LOOP_X)
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(3, 4)), jnp.float32)
    reached = np.cumsum(np.cumsum(np.asarray(x) > 1.2, axis=1), axis=1) <= 1
    grad = jax.grad(lambda x: (f(x, 4, launch_dims=3, output_dims=(3, 4))[0] * weights).sum())(x)
    assert_close(grad, np.where(reached, 2.0 * np.asarray(x) * np.asarray(weights), 0.0))


@wp.kernel
def softmax_weighted(x: wp.array2d(dtype=float), out: wp.array(dtype=float)):
    """A loop over x.shape[1] carrying a running maximum and a normaliser: no argument bounds it, the shape does."""
    t = wp.tid()
    m = float(-1.0e30)
    for i in range(x.shape[1]):
        m = wp.max(m, x[t, i])
    z = float(0.0)
    s = float(0.0)
    for i in range(x.shape[1]):
        e = wp.exp(x[t, i] - m)
        z += e
        s += e * x[t, i]
    out[t] = s / z


def _softmax_weighted(x):
    return jnp.sum(jax.nn.softmax(x, axis=1) * x, axis=1)


@pytest.mark.parametrize("batched", ["auto", "twin"])
def test_a_loop_over_an_arrays_shape_differentiates_and_vmaps(batched, monkeypatch):
    """Under vmap (``batched="twin"``: the batched twins on the CPU too) and with CPU threads on, the adjoint's
    twins are built from the unrolled twin's source: the same gradient."""
    monkeypatch.setenv("WARPNN_BATCHED_LAUNCH", batched)
    jax.clear_caches()
    f = warpnn.jax_kernel(softmax_weighted, num_outputs=1)
    call = lambda x: f(x, launch_dims=x.shape[0], output_dims=x.shape[0])[0]  # noqa: E731
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5)), jnp.float32)
    assert_close(call(x), _softmax_weighted(x))
    grad = jax.jit(jax.grad(lambda x: (call(x) * jnp.arange(1.0, 4.0)).sum()))
    want = jax.grad(lambda x: (_softmax_weighted(x) * jnp.arange(1.0, 4.0)).sum())
    assert_close(grad(x), want(x))
    # central differences along a random direction
    v = jnp.asarray(np.random.default_rng(3).normal(size=x.shape), jnp.float32)
    loss = lambda x: float((call(x) * jnp.arange(1.0, 4.0)).sum())  # noqa: E731
    eps = 1e-2
    assert abs((loss(x + eps * v) - loss(x - eps * v)) / (2 * eps) - float((grad(x) * v).sum())) < 2e-2
    # vmapped gradients (the adjoint's batched twins are built from the unrolled twin's source)
    xs = jnp.stack([x, 0.5 * x, x + 1.0])
    assert_close(jax.vmap(grad)(xs), jnp.stack([want(xi) for xi in xs]))
    # another shape is another twin
    y = x[:, :3]
    assert_close(grad(y), want(y))
    threaded = on_cpu_threads(lambda: jax.grad(lambda x: (call(x) * jnp.arange(1.0, 4.0)).sum())(x))
    if threaded is not None:
        assert_close(threaded, want(x))


# the running product compiled without an adjoint (as mujoco_warp builds its modules), in a module of its own
product_without_adjoint = wp.Kernel(loop_running_product.func, key="product_without_adjoint",
                                    module=wp.get_module("tests.test_unrolled.without_adjoint"),
                                    options={"enable_backward": False})


def test_a_kernel_compiled_without_an_adjoint_differentiates_through_the_unrolled_twin():
    from warpnn._access import warp_builds_adjoint

    assert not warp_builds_adjoint(product_without_adjoint)
    x = jnp.asarray(_LOOP_X)
    assert_close(jax.grad(lambda x: _loop_call(product_without_adjoint)(x).sum())(x),
                 jax.grad(lambda x: jnp.prod(x, 1).sum())(x))


@wp.kernel
def product_of_a_counted_prefix(x: wp.array2d(dtype=float), counts: wp.array(dtype=int), out: wp.array(dtype=float)):
    t = wp.tid()
    p = float(1.0)
    for i in range(counts[t]):  # a bound read from an array: not fixed by the call
        p = p * x[t, i]
    out[t] = p


def test_loops_the_call_does_not_fix_stay_refused(monkeypatch):
    f = warpnn.jax_kernel(product_of_a_counted_prefix, num_outputs=1)
    x, counts = jnp.asarray(_LOOP_X), jnp.asarray([4, 2, 3], jnp.int32)
    with pytest.raises(TypeError, match="Kernel 'product_of_a_counted_prefix' cannot be differentiated.*changes 'p'"):
        jax.grad(lambda x: f(x, counts, launch_dims=3)[0].sum())(x)
    # a loop over an argument longer than $WARPNN_MAX_UNROLL: refused with the kernel's reasons and the advice
    monkeypatch.setenv("WARPNN_MAX_UNROLL", "3")
    with pytest.raises(TypeError, match="Kernel 'loop_norm' cannot be differentiated.*WARPNN_MAX_UNROLL"):
        jax.grad(lambda x: _loop_call(loop_norm)(x).sum())(x)


def test_the_twin_is_the_kernel_with_the_values_substituted_and_warps_tape_agrees_on_it():
    """The twin's facts have no loop problem left, and wp.Tape over the twin gives warpnn's gradient."""
    sig = signature_of(loop_running_product, 1, [], None)
    twin_sig, reasons = _unrolled.adjoint_signature(sig, {"n": 4}, {"x": (3, 4), "out": (3,)})
    assert reasons == [] and twin_sig is not sig and twin_sig.adjoint_problems == ()
    assert "range(4)" in twin_sig.kernel.adj.source and _unrolled.is_unrolled(twin_sig.kernel)
    assert not _unrolled.is_unrolled(loop_running_product)
    assert _unrolled.adjoint_signature(sig, {"n": 4}, {"x": (3, 4), "out": (3,)})[0].kernel is twin_sig.kernel
    # other values, another twin in a module of its own (a kernel added to a loaded module unloads its code)
    other, _ = _unrolled.adjoint_signature(sig, {"n": 3}, {"x": (3, 4), "out": (3,)})
    assert other.kernel is not twin_sig.kernel and other.kernel.module is not twin_sig.kernel.module
    assert_close(_loop_tape_grad(twin_sig.kernel), jax.grad(lambda x: jnp.prod(x, 1).sum())(jnp.asarray(_LOOP_X)))
