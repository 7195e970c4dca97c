"""In-out arrays, kernels that read their outputs, writes to inputs and optional (None) arrays.

References: pure-JAX versions of the same math, and central finite differences in float64 (``check_grads``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp
from jax.test_util import check_grads

import warpnn
from warpnn import _launch

from .helpers import assert_close

N = 8
F64 = wp.float64

LAUNCHERS = pytest.mark.parametrize("launcher", ["native", "python"])


@wp.kernel
def square_plus_axpy(a: wp.array(dtype=F64), x: wp.array(dtype=F64), y: wp.array(dtype=F64)):
    # reads y[i], then overwrites it: in place
    i = wp.tid()
    y[i] = y[i] * y[i] + a[0] * x[i]


def square_plus_axpy_ref(a, x, y):
    return y * y + a[0] * x


@wp.kernel
def scale_where_positive(x: wp.array(dtype=F64), y: wp.array(dtype=F64)):
    # writes only some elements: the others pass through unchanged
    i = wp.tid()
    if x[i] > F64(0.0):
        y[i] = F64(3.0) * y[i] * x[i]


@wp.kernel
def scatter_add_into(idx: wp.array(dtype=wp.int32), v: wp.array(dtype=F64), acc: wp.array(dtype=F64)):
    # accumulates into the in-out array at other threads' elements (atomics): y_new = y_old + scatter(v)
    i = wp.tid()
    wp.atomic_add(acc, idx[i], v[i] * v[i])


@wp.kernel
def accumulate_own_output(x: wp.array(dtype=F64), y: wp.array(dtype=F64)):
    # a pure output it reads (zeros) before writing
    i = wp.tid()
    v = y[i] + wp.sin(x[i])
    y[i] = v
    y[i] = v * F64(2.0)  # a second store of the same element: only the last one reaches the result


@wp.kernel
def read_after_write(x: wp.array(dtype=F64), y: wp.array(dtype=F64)):
    i = wp.tid()
    y[i] = x[i]
    y[i] = y[i] * x[i]


@wp.kernel
def write_first_half(x: wp.array(dtype=F64), y: wp.array(dtype=F64)):
    # writes some elements of y and never reads y
    i = wp.tid()
    if i < x.shape[0] // 2:
        y[i] = wp.sin(x[i])


@wp.kernel
def shift_in_place(y: wp.array(dtype=F64)):
    i = wp.tid()
    if i > 0:
        y[i] = y[i - 1]


def _x64_inputs(key):
    k1, k2, k3 = jax.random.split(key, 3)
    a = jnp.array([0.7])
    x = jax.random.normal(k1, (N,), jnp.float64)
    y = jax.random.normal(k2, (N,), jnp.float64)
    return a, x, y, k3


@LAUNCHERS
def test_in_out_read_then_write_forward_grad_and_finite_differences(x64, key, launcher):
    with _launch.use_launcher(launcher):
        f = warpnn.jax_kernel(square_plus_axpy, num_outputs=1, in_out_argnames=["y"], launch_dims=N)
        a, x, y, _ = _x64_inputs(key)
        y_before = np.asarray(y).copy()
        (y_new,) = jax.jit(f)(a, x, y)
        assert_close(y_new, square_plus_axpy_ref(a, x, y), 1e-12, 1e-12)
        np.testing.assert_array_equal(np.asarray(y), y_before)  # the caller's array is untouched
        loss = lambda fn: lambda a, x, y: jnp.sum(jnp.sin(fn(a, x, y)))
        g = jax.grad(loss(lambda *args: f(*args)[0]), (0, 1, 2))(a, x, y)
        g_ref = jax.grad(loss(square_plus_axpy_ref), (0, 1, 2))(a, x, y)
        for got, want in zip(g, g_ref):
            assert_close(got, want, 1e-12, 1e-12)
        check_grads(lambda a, x, y: f(a, x, y)[0], (a, x, y), order=1, modes=("rev",))


def test_in_out_partial_write_passes_unwritten_elements_through(x64, key):
    f = warpnn.jax_kernel(scale_where_positive, in_out_argnames=["y"])
    _, x, y, _ = _x64_inputs(key)
    ref = lambda x, y: jnp.where(x > 0, 3.0 * y * x, y)
    assert_close(f(x, y)[0], ref(x, y), 1e-12, 1e-12)
    g = jax.grad(lambda x, y: jnp.sum(f(x, y)[0] ** 3), (0, 1))(x, y)
    g_ref = jax.grad(lambda x, y: jnp.sum(ref(x, y) ** 3), (0, 1))(x, y)
    assert_close(g[0], g_ref[0], 1e-12, 1e-12)
    assert_close(g[1], g_ref[1], 1e-12, 1e-12)
    check_grads(lambda x, y: f(x, y)[0], (x, y), order=1, modes=("rev",))


@LAUNCHERS
def test_an_in_out_array_the_kernel_only_writes_is_not_kept_for_the_adjoint(x64, key, launcher):
    # Its adjoint never reads it, so the backward pass keeps none of its values (zeros stand in): kept before the
    # launch they would cost a copy, as the launch overwrites them in place, and after it a residual per call.
    with _launch.use_launcher(launcher):
        f = warpnn.jax_kernel(write_first_half, in_out_argnames=["y"])
        assert f.signature.unread_in_out == ("y",)
        _, x, y, _ = _x64_inputs(key)
        ref = lambda x, y: y.at[: N // 2].set(jnp.sin(x[: N // 2]))
        out, backward = jax.vjp(lambda x, y: f(x, y)[0], x, y)
        kept = [np.asarray(r) for r in jax.tree_util.tree_leaves(backward)]
        assert len(kept) == 1 and np.array_equal(kept[0], x)  # x, which the kernel reads
        assert_close(out, ref(x, y), 1e-12, 1e-12)
        loss = lambda fn: lambda x, y: jnp.sum(jnp.cos(fn(x, jnp.exp(y))) * x)
        g = jax.grad(loss(lambda x, y: f(x, y)[0]), (0, 1))(x, y)
        g_ref = jax.grad(loss(ref), (0, 1))(x, y)
        assert_close(g[0], g_ref[0], 1e-12, 1e-12)
        assert_close(g[1], g_ref[1], 1e-12, 1e-12)
        check_grads(lambda x, y: f(x, y)[0], (x, y), order=1, modes=("rev",))
        # under vmap (y shared, then batched) and in a scan that carries y
        xb = x[None] + jnp.arange(3.0)[:, None]
        for y_axis, yb in ((None, y), (0, y[None] * jnp.arange(1.0, 4.0)[:, None])):
            batched = lambda fn: lambda xb, yb: jnp.sum(jnp.cos(jax.vmap(fn, (0, y_axis))(xb, yb)) * xb)
            g = jax.grad(batched(lambda x, y: f(x, y)[0]), (0, 1))(xb, yb)
            g_ref = jax.grad(batched(ref), (0, 1))(xb, yb)
            assert_close(g[0], g_ref[0], 1e-12, 1e-12)
            assert_close(g[1], g_ref[1], 1e-12, 1e-12)
        scanned = lambda fn: lambda x, y: jnp.sum(jax.lax.scan(lambda y, _: (jnp.cos(fn(x * y, y)), None), y, None,
                                                               length=3)[0])
        g = jax.grad(scanned(lambda x, y: f(x, y)[0]), (0, 1))(x, y)
        g_ref = jax.grad(scanned(ref), (0, 1))(x, y)
        assert_close(g[0], g_ref[0], 1e-12, 1e-12)
        assert_close(g[1], g_ref[1], 1e-12, 1e-12)


@LAUNCHERS
def test_in_out_scatter_accumulation_matches_previous_value_plus_scatter(x64, key, launcher):
    with _launch.use_launcher(launcher):
        f = warpnn.jax_kernel(scatter_add_into, in_out_argnames=["acc"])
        idx = jnp.asarray(np.random.default_rng(0).integers(0, 4, N), jnp.int32)  # repeats: atomics collide
        v = jax.random.normal(key, (N,), jnp.float64)
        acc = jnp.arange(4.0)
        ref = lambda v, acc: acc.at[idx].add(v * v)
        assert_close(f(idx, v, acc)[0], ref(v, acc), 1e-12, 1e-12)
        w = jnp.array([1.0, -2.0, 0.5, 3.0])
        g = jax.grad(lambda v, acc: jnp.vdot(w, f(idx, v, acc)[0]), (0, 1))(v, acc)
        g_ref = jax.grad(lambda v, acc: jnp.vdot(w, ref(v, acc)), (0, 1))(v, acc)
        assert_close(g[0], g_ref[0], 1e-12, 1e-12)
        assert_close(g[1], g_ref[1], 1e-12, 1e-12)


def test_kernel_reading_its_output_before_writing_it_is_differentiable(x64, key):
    f = warpnn.jax_kernel(accumulate_own_output)
    assert f.signature.outputs_read == ("y",)
    _, x, _, _ = _x64_inputs(key)
    ref = lambda x: 2.0 * jnp.sin(x)
    assert_close(f(x)[0], ref(x), 1e-12, 1e-12)
    g = jax.grad(lambda x: jnp.sum(f(x)[0] ** 2))(x)
    assert_close(g, jax.grad(lambda x: jnp.sum(ref(x) ** 2))(x), 1e-12, 1e-12)


def test_in_out_under_vmap_with_shared_and_batched_arrays(x64, key):
    f = warpnn.jax_kernel(square_plus_axpy, in_out_argnames=["y"], launch_dims=N)
    a, x, y, k = _x64_inputs(key)
    xb = x[None] + jax.random.normal(k, (3, N), jnp.float64)
    got = jax.vmap(lambda x: f(a, x, y)[0])(xb)  # y (in-out) is shared, x batched
    assert_close(got, jax.vmap(lambda x: square_plus_axpy_ref(a, x, y))(xb), 1e-12, 1e-12)
    g = jax.grad(lambda y: jnp.sum(jax.vmap(lambda x: f(a, x, y)[0])(xb) ** 2))(y)
    g_ref = jax.grad(lambda y: jnp.sum(jax.vmap(lambda x: square_plus_axpy_ref(a, x, y))(xb) ** 2))(y)
    assert_close(g, g_ref, 1e-12, 1e-12)


def test_in_out_inside_scan(x64, key):
    f = warpnn.jax_kernel(square_plus_axpy, in_out_argnames=["y"], launch_dims=N)
    a, x, y, _ = _x64_inputs(key)
    y = 0.1 * y

    def rollout(fn, a, y):
        return jax.lax.scan(lambda y, _: (fn(a, x, y), None), y, None, length=5)[0].sum()

    warp_step = lambda a, x, y: f(a, x, y)[0]
    assert_close(rollout(warp_step, a, y), rollout(square_plus_axpy_ref, a, y), 1e-12, 1e-12)
    g = jax.grad(lambda a, y: rollout(warp_step, a, y), (0, 1))(a, y)
    g_ref = jax.grad(lambda a, y: rollout(square_plus_axpy_ref, a, y), (0, 1))(a, y)
    assert_close(g[0], g_ref[0], 1e-10, 1e-12)
    assert_close(g[1], g_ref[1], 1e-10, 1e-12)


@pytest.mark.parametrize(
    "kernel, in_out, message",
    [
        (read_after_write, (), r"array 'y': line \d+ reads it after the kernel wrote it"),
        (shift_in_place, ("y",), r"array 'y': .*touches an element other than the thread's own wp.tid\(\) index"),
    ],
)
def test_in_place_patterns_warp_cannot_differentiate_run_forward_and_refuse_reverse(x64, kernel, in_out, message):
    f = warpnn.jax_kernel(kernel, in_out_argnames=list(in_out))
    x = jnp.arange(1.0, N + 1.0)
    jax.block_until_ready(f(x))  # the forward pass runs
    with pytest.raises(TypeError, match=f"'{kernel.key}' cannot be differentiated.*{message}"):
        jax.grad(lambda x: f(x)[0].sum())(x)


# ---------------------------------------------------------------------------------------------- input writes


@wp.func
def store_zero(a: wp.array(dtype=float), i: int):
    a[i] = 0.0


@wp.kernel
def writes_input(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = 2.0 * x[i]
    x[i] = 0.0


@wp.kernel
def atomically_writes_input(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i]
    wp.atomic_add(x, 0, 1.0)


@wp.kernel
def writes_input_in_func(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i]
    store_zero(x, i)


@wp.kernel
def writes_input_through_view(x: wp.array2d(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    row = x[i]
    y[i] = row[0]
    row[1] = 5.0


@pytest.mark.parametrize(
    "kernel, where",
    [
        (writes_input, r"line \d+\)"),
        (atomically_writes_input, r"line \d+\)"),
        (writes_input_in_func, r"line \d+, inside @wp.func 'store_zero'"),
        (writes_input_through_view, r"line \d+\)"),
    ],
)
def test_a_kernel_writing_an_input_is_refused_with_the_fix(kernel, where):
    with pytest.raises(TypeError, match=rf"'{kernel.key}' writes its input array 'x' \({where}.*in_out_argnames=\['x'\]"):
        warpnn.jax_kernel(kernel)


def test_declaring_the_written_input_in_out_returns_it_and_leaves_the_caller_alone():
    f = warpnn.jax_kernel(writes_input, num_outputs=2, in_out_argnames=["x"])
    x = jnp.arange(1.0, 5.0)
    for run in (f, jax.jit(f)):
        x_new, y = run(x)
        np.testing.assert_array_equal(np.asarray(y), 2.0 * np.arange(1.0, 5.0))
        np.testing.assert_array_equal(np.asarray(x_new), np.zeros(4))
        np.testing.assert_array_equal(np.asarray(x), np.arange(1.0, 5.0))
    const = jax.jit(lambda: f(jnp.arange(1.0, 5.0))[1])  # a constant baked into the executable
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(const()), 2.0 * np.arange(1.0, 5.0))


def test_in_out_argnames_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"in_out_argnames \['z'\] are not parameters"):
        warpnn.jax_kernel(writes_input, num_outputs=2, in_out_argnames=["z"])
    with pytest.raises(ValueError, match="names an argument twice"):
        warpnn.jax_kernel(writes_input, num_outputs=2, in_out_argnames=["x", "x"])
    with pytest.raises(ValueError, match=r"num_outputs=1 .*in-out arrays included \(2 here\)"):
        warpnn.jax_kernel(writes_input, num_outputs=1, in_out_argnames=["x", "y"])
    with pytest.raises(ValueError, match="in-out argument 'y' comes after the inputs.*must precede"):
        warpnn.jax_kernel(writes_input, num_outputs=2, in_out_argnames=["y"])
    with pytest.raises(TypeError, match="in-out argument 'x' cannot be None"):
        warpnn.jax_kernel(writes_input, num_outputs=2, in_out_argnames=["x"])(None)


# ---------------------------------------------------------------------------------------------- None arrays


@wp.kernel
def optionally_weighted(x: wp.array(dtype=float), w: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    s = float(1.0)
    if w:
        s = w[i]
    y[i] = s * x[i] * x[i]


@LAUNCHERS
def test_none_array_is_warps_null_array_forward_and_backward(key, launcher):
    with _launch.use_launcher(launcher):
        f = warpnn.jax_kernel(optionally_weighted)
        x, w = jax.random.normal(key, (N,)), jax.random.normal(jax.random.PRNGKey(7), (N,))
        assert_close(f(x, None)[0], x * x, 1e-6, 1e-6)
        assert_close(f(x, w)[0], w * x * x, 1e-6, 1e-6)
        assert_close(jax.grad(lambda x: f(x, None)[0].sum())(x), 2 * x, 1e-6, 1e-6)
        gx, gw = jax.grad(lambda x, w: f(x, w)[0].sum(), (0, 1))(x, w)
        assert_close(gx, 2 * w * x, 1e-6, 1e-6)
        assert_close(gw, x * x, 1e-6, 1e-6)
        assert_close(jax.jit(jax.vmap(lambda x: f(x, None)[0]))(jnp.stack([x, 2 * x])), jnp.stack([x * x, 4 * x * x]), 1e-6, 1e-5)
