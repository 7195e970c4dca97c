"""warpnn.jax_kernel takes wp.jax_kernel's parameters (Warp 1.19) with Warp's meaning, plus what warpnn adds.

The differences by design listed in tests/test_warp_interop.py are each checked here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn

from . import kernels_for_tests as K
from .helpers import assert_close

N = 16


def test_same_arguments_return_the_same_wrapper():
    f = warpnn.jax_kernel(K.scale_square)
    assert warpnn.jax_kernel(K.scale_square) is f
    assert warpnn.jax_kernel(K.scale_square, 1, None, None, None, []) is f
    assert warpnn.jax_kernel(K.scale_square, launch_dims=4) is not f
    assert warpnn.jax_kernel(K.two_outputs, 2, output_dims={"y": N, "total": 1}) is warpnn.jax_kernel(
        K.two_outputs, 2, output_dims={"total": 1, "y": N})
    assert warpnn.jax_kernel(K.scale_square, enable_backward=True) is f  # warpnn's default: None means True
    assert warpnn.jax_kernel(K.scale_square, enable_backward=False) is not f
    assert warpnn.jax_kernel(K.scale_square, block_dim=np.int64(8)) is warpnn.jax_kernel(K.scale_square, block_dim=8)


def test_warp_kernel_is_created_by_jax_kernel():
    # WarpKernel takes jax_kernel's checked options, not Warp's arguments: a direct call says what to use.
    with pytest.raises(TypeError, match=r"created by warpnn\.jax_kernel"):
        warpnn.WarpKernel(K.scale_square, 1)


def test_positional_parameters_follow_warps_order():
    # kernel, num_outputs, vmap_method, launch_dims, output_dims, in_out_argnames, module_preload_mode,
    # enable_backward, has_side_effect, block_dim
    f = warpnn.jax_kernel(K.scale_square, 1, "sequential", (4,), (6,), None, wp.JaxModulePreloadMode.ALL_DEVICES,
                          True, False, 64)
    assert (f.vmap_method, f.launch_dims, f.output_dims, f.block_dim) == ("sequential", (4,), (6,), 64)
    (y,) = f(jnp.arange(1.0, 7.0), 2.0)
    assert_close(y, jnp.array([2.0, 8.0, 18.0, 32.0, 0.0, 0.0]), 0, 0)


def test_enable_backward_false_runs_forward_and_refuses_gradients_clearly(key):
    f = warpnn.jax_kernel(K.scale_square, enable_backward=False)
    x = jax.random.normal(key, (N,))
    assert_close(f(x, 2.0)[0], K.scale_square_ref(x, 2.0), 1e-6, 1e-6)
    with pytest.raises(TypeError, match="enable_backward=False.*enable_backward=True"):
        jax.grad(lambda x: f(x, 2.0)[0].sum())(x)


@pytest.mark.parametrize("method", ["broadcast_all", "sequential", "sequential_unrolled", "expand_dims", "legacy_vectorized", None])
def test_every_vmap_method_gives_per_element_results_for_a_gather(method, key):
    # Warp folds the batch into the first launch dim for "broadcast_all", which is wrong for a gather.
    f = warpnn.jax_kernel(K.weighted_gather, vmap_method=method)
    x = jax.random.normal(key, (3, N))
    idx = jnp.asarray(np.random.default_rng(1).integers(0, N, N), jnp.int32)
    w = jnp.linspace(0.5, 1.5, N)
    got = jax.vmap(lambda x: f(x, idx, w, launch_dims=N)[0])(x)
    assert_close(got, jax.vmap(lambda x: K.weighted_gather_ref(x, idx, w))(x), 1e-6, 1e-6)
    assert_close(jax.vmap(lambda x: f(x, idx, w, launch_dims=N, vmap_method="sequential")[0])(x), got, 0, 0)


def test_bad_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="vmap_method='fold' is not one of"):
        warpnn.jax_kernel(K.scale_square, vmap_method="fold")
    for bad, error in ((True, TypeError), (1.5, TypeError), (0, ValueError), (-1, ValueError)):
        with pytest.raises(error, match="block_dim must be"):
            warpnn.jax_kernel(K.scale_square, block_dim=bad)
    with pytest.raises(ValueError, match="module_preload_mode='everywhere' is not a wp.JaxModulePreloadMode"):
        warpnn.jax_kernel(K.scale_square, module_preload_mode="everywhere")(jnp.ones(4), 1.0)


def test_per_call_overrides_work_with_reverse_mode(key):
    # Warp refuses per-call launch_dims / vmap_method with enable_backward=True; warpnn's forward and adjoint
    # share each call's static plan, so overrides are as differentiable as the defaults.
    f = warpnn.jax_kernel(K.scale_square, launch_dims=N, enable_backward=True)
    x = jax.random.normal(key, (N,))
    g = jax.grad(lambda x: f(x, 3.0, launch_dims=N // 2, vmap_method="sequential")[0].sum())(x)
    want = jnp.where(jnp.arange(N) < N // 2, 2.0 * 3.0 * x, 0.0)
    assert_close(g, want, 1e-6, 1e-6)


def test_output_dims_work_with_reverse_mode(key):
    # Warp refuses output_dims with enable_backward=True; warpnn differentiates outputs of any shape.
    f = warpnn.jax_kernel(K.two_outputs, num_outputs=2, output_dims={"y": N, "total": 1}, enable_backward=True)
    x = jax.random.normal(key, (N,))
    y, total = f(x, 0.5)
    y_ref, total_ref = K.two_outputs_ref(x, 0.5)
    assert_close(y, y_ref, 1e-6, 1e-6)
    assert_close(total, total_ref, 1e-5, 1e-5)
    loss = lambda fn: lambda x: fn(x, 0.5)[1].sum() + (fn(x, 0.5)[0] ** 2).sum()
    g, g_ref = jax.grad(loss(f))(x), jax.grad(loss(K.two_outputs_ref))(x)
    assert_close(g, g_ref, 1e-5, 1e-5)


@wp.kernel
def count_calls(x: wp.array(dtype=float), counter: wp.array(dtype=float)):
    i = wp.tid()
    wp.atomic_add(counter, 0, 1.0)


def test_has_side_effect_keeps_an_unused_call():
    f = warpnn.jax_kernel(count_calls, in_out_argnames=["counter"], has_side_effect=True)
    hlo = jax.jit(lambda x, c: (f(x, c), x + 1.0)[1]).lower(jnp.ones(4), jnp.zeros(1)).as_text()
    assert "custom_call" in hlo
    g = warpnn.jax_kernel(count_calls, in_out_argnames=["counter"])
    hlo = jax.jit(lambda x, c: (g(x, c), x + 1.0)[1]).lower(jnp.ones(4), jnp.zeros(1)).as_text()
    assert "custom_call" not in hlo


# ---------------------------------------------------------------------------------------------- dtypes


@wp.kernel
def cube_bf16(x: wp.array(dtype=wp.bfloat16), y: wp.array(dtype=wp.bfloat16)):
    i = wp.tid()
    y[i] = x[i] * x[i] * x[i]


@wp.kernel
def cube_f16(x: wp.array(dtype=wp.float16), y: wp.array(dtype=wp.float16)):
    i = wp.tid()
    y[i] = x[i] * x[i] * x[i]


@pytest.mark.parametrize("kernel, dtype", [(cube_bf16, jnp.bfloat16), (cube_f16, jnp.float16)])
def test_half_precision_forward_and_gradient(kernel, dtype):
    f = warpnn.jax_kernel(kernel)
    x = jnp.linspace(-2.0, 2.0, N).astype(dtype)
    (y,) = jax.jit(f)(x)
    assert y.dtype == dtype
    assert_close(y.astype(jnp.float32), (x.astype(jnp.float32) ** 3), 2e-2, 1e-2)
    g = jax.grad(lambda x: f(x)[0].astype(jnp.float32).sum())(x)
    assert g.dtype == dtype
    assert_close(g.astype(jnp.float32), 3.0 * x.astype(jnp.float32) ** 2, 2e-2, 2e-2)
    assert float(jnp.abs(g.astype(jnp.float32)).sum()) > 0  # never a silent zero


# ---------------------------------------------------------------------------------------------- launch checks


def test_launch_larger_than_an_output_written_at_tid_is_a_trace_time_error():
    f = warpnn.jax_kernel(K.scale_square)
    with pytest.raises(ValueError, match=r"launch_dims=\(16,\) exceed the Warp shape \(8,\) of output 'y'.*write out of range"):
        jax.jit(lambda x: f(x, 1.0, launch_dims=16, output_dims=8)).lower(jnp.ones(16))


def test_launch_larger_than_an_input_read_at_tid_is_a_trace_time_error():
    f = warpnn.jax_kernel(K.scale_square)
    with pytest.raises(ValueError, match=r"exceed the Warp shape \(4,\) of input 'x'.*read out of range"):
        f(jnp.ones(4), 1.0, launch_dims=8, output_dims=8)


def test_launch_beyond_warps_32_bit_thread_index_is_a_trace_time_error():
    f = warpnn.jax_kernel(K.scale_square)
    with pytest.raises(ValueError, match=r"wp\.tid\(\) with extent 2147483649"):
        jax.jit(lambda x: f(x, 1.0, launch_dims=2**31 + 1, output_dims=1)).lower(jnp.ones(1))


@wp.kernel(module="unique")  # (a module of its own: loading it builds nothing else)
def _fill_without_tid(y: wp.array(dtype=float)):
    y[0] = 1.0  # (no wp.tid(): Warp lets any number of threads run it)


@wp.kernel(module="unique")
def _fill_at_tid(y: wp.array(dtype=float)):
    y[wp.tid()] = 1.0


def test_the_native_handlers_thread_limit_is_warps_gate_or_the_exact_value_warp_resolved():
    """The limit each native handler checks: Warp's gate (2**31, for every kernel) unless Warp resolved the exact
    value (at a fresh build of the module, or for a launch past the gate): None for a kernel without wp.tid(), as
    Warp's own launch checks it. Never a code generation of its own (that cost 7 s of a MuJoCo gradient's lowering)."""
    from warpnn import _warp_compat as wc

    for kernel in (_fill_at_tid, _fill_without_tid):
        kernel.module.load(wp.get_device("cpu"))  # (as a launch loads it: a build, or the binary from Warp's cache)
    assert wc.tid_extent_limit(_fill_at_tid) == 2**31
    assert wc.tid_extent_limit(_fill_without_tid) in (2**31, None)
    with pytest.raises(ValueError, match=r"wp\.tid\(\) with extent 2147483649"):
        wc.build_launch_bounds((2**31 + 1,), _fill_at_tid)
    wc.build_launch_bounds((2**31 + 1,), _fill_without_tid)  # (Warp resolves it: no limit)
    assert wc.tid_extent_limit(_fill_at_tid) == 2**31 and wc.tid_extent_limit(_fill_without_tid) is None
