"""Elementwise input/output pairs sharing one buffer (``KernelSignature.in_place_pairs``).

For ``y[i] = f(x[i])`` the adjoint call writes ``x``'s adjoint where ``y``'s cotangent was, as an in-out
array's adjoint is carried (no zeroed adjoint buffer, no copy into a ``lax.scan``'s backward carry), and a call
that is not differentiated writes ``y`` into ``x``'s buffer (no copy into a forward scan's carry). The
additions are the same, in the same order, so results must be bitwise those of the out-of-place calls (the
variant without pairs), match pure JAX, and leave every array the caller holds unchanged.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _batched, _bridge, _launch
from warpnn._signature import KernelSignature, signature_of

from .helpers import assert_close
from .kernels_for_tests import heat_step


@wp.kernel
def blend(x: wp.array(dtype=float), alpha: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i] * alpha[i] + wp.sin(x[i])


def blend_ref(x, alpha):
    return x * alpha + jnp.sin(x)


@wp.kernel
def advance(x: wp.array(dtype=wp.vec3), v: wp.array(dtype=wp.vec3), dt: float,
            x_new: wp.array(dtype=wp.vec3), v_new: wp.array(dtype=wp.vec3)):
    i = wp.tid()
    v1 = v[i] + wp.vec3(0.0, -9.8, 0.0) * dt - 0.1 * v[i] * wp.length(x[i])
    x_new[i] = x[i] + v1 * dt
    v_new[i] = v1


def advance_ref(x, v, dt):
    v1 = v + jnp.array([0.0, -9.8, 0.0]) * dt - 0.1 * v * jnp.linalg.norm(x, axis=-1, keepdims=True)
    return x + v1 * dt, v1


@wp.kernel
def copy_then_double(x: wp.array(dtype=float), y: wp.array(dtype=float), z: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i]
    z[i] = 2.0 * x[i]  # x is read after y's store: only (x, z) can be a pair


@wp.kernel
def neighbour_sum(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i] + x[(i + 1) % x.shape[0]]


@wp.kernel
def branch_stores(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    if x[i] > 0.0:
        y[i] = x[i]
    else:
        y[i] = -x[i]


@wp.kernel
def reads_in_loop(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    acc = float(0.0)
    for k in range(3):
        acc += x[i] * float(k)
    y[i] = acc


@wp.kernel
def reads_its_output(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i]
    y[i] = y[i] * 2.0


@wp.kernel
def to_double(x: wp.array(dtype=wp.float32), y: wp.array(dtype=wp.float64)):
    i = wp.tid()
    y[i] = wp.float64(x[i])


@wp.kernel
def branch_reads(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    t = float(0.0)
    if x[i] > 0.0:
        t = x[i] * x[i]
    else:
        t = -3.0 * x[i]
    y[i] = t


@wp.kernel
def scale_2d(x: wp.array2d(dtype=float), y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    y[i, j] = wp.exp(0.5 * x[i, j])


@wp.kernel
def plus_next_of(x: wp.array(dtype=float), other: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    v = 2.0 * x[i]
    y[i] = v * v + other[(i + 1) % other.shape[0]]  # a neighbour of the other input, whatever buffer it is


@pytest.mark.parametrize("kernel, num_outputs, pairs", [
    (plus_next_of, 1, (("x", "y"),)),
    (branch_reads, 1, (("x", "y"),)),
    (scale_2d, 1, (("x", "y"),)),
    (blend, 1, (("x", "y"), ("alpha", "y"))),
    (advance, 2, (("x", "x_new"), ("v", "x_new"), ("x", "v_new"), ("v", "v_new"))),
    (copy_then_double, 2, (("x", "z"),)),
    (neighbour_sum, 1, ()),
    (branch_stores, 1, ()),
    (reads_in_loop, 1, ()),
    (reads_its_output, 1, ()),
    (to_double, 1, ()),
    (heat_step, 1, ()),
])
def test_candidates_are_found_conservatively_in_the_source(kernel, num_outputs, pairs):
    assert signature_of(kernel, num_outputs).in_place_pairs == pairs


def test_each_input_and_output_pairs_once_and_only_at_matching_shapes():
    sig = signature_of(advance, 2)
    full = {"x": (8, 3), "v": (8, 3), "x_new": (8, 3), "v_new": (8, 3)}
    assert sig.in_place_pairs_for(full, (8,)) == (("x", "x_new"), ("v", "v_new"))
    assert sig.in_place_pairs_for({**full, "x_new": (9, 3)}, (8,)) == (("x", "v_new"),)
    assert sig.in_place_pairs_for(full, (4,)) == ()  # the launch covers part of the arrays
    constant_x = sig.without_adjoints(frozenset({"x"}))
    assert constant_x.in_place_pairs_for(full, (8,)) == (("v", "x_new"),)


@pytest.fixture(autouse=True)
def in_place_wherever_possible(monkeypatch):
    """These tests check the pairs themselves: share buffers wherever the kernel allows, as on the CPU, also on a
    GPU with XLA's default flags (where warpnn keeps small pairs apart: see the policy's test)."""
    monkeypatch.setattr(_bridge, "_adjoint_in_place_pays", lambda sig, shapes, pairs: True)


@pytest.mark.parametrize("backend, xla_flags, nbytes, expected", [
    ("cpu", "", 16, True),
    ("gpu", "", 16, False),  # a lost CUDA graph would cost more than the copy saves
    ("gpu", "", _bridge.IN_PLACE_MIN_BYTES, True),
    ("gpu", "--xla_gpu_graph_min_graph_size=1 --xla_cmd_buffer_trace_cache_size=1024", 16, True),
    ("gpu", "--xla_gpu_graph_min_graph_size=1 --xla_gpu_graph_min_graph_size=5", 16, False),  # the last one counts
])
def test_on_a_gpu_small_adjoints_stay_out_of_place_unless_xla_captures_short_graphs(monkeypatch, backend, xla_flags,
                                                                                 nbytes, expected):
    monkeypatch.undo()  # the library's own policy, not the autouse fixture's
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    shapes = {"x": (nbytes // 4,), "alpha": (nbytes // 4,), "y": (nbytes // 4,)}
    assert _bridge._adjoint_in_place_pays(signature_of(blend, 1), shapes, (("x", "y"),)) is expected


def test_the_forward_writes_in_place_whatever_the_adjoints_policy(monkeypatch):
    """The adjoint's policy weighs a lost CUDA graph; a one-kernel forward loop body is under XLA's minimum
    either way, so the forward of an elementwise pair is written in place on every backend and with any flags."""
    monkeypatch.setattr(_bridge, "_adjoint_in_place_pays", lambda sig, shapes, pairs: False)
    f = warpnn.jax_kernel(blend)
    x, alpha = _blend_inputs()
    assert "output_to_operand_aliasing" in _scan_forward(f, alpha).lower(x).compile().as_text()
    adjoint_calls = _ffi_calls("adjoint", jax.grad(lambda x: jnp.sum(f(x, alpha)[0])), x)
    assert adjoint_calls and all("output_operand_alias" not in line for line in adjoint_calls)


def _ffi_calls(kind: str, fn, *args) -> list[str]:
    """The lines of ``fn``'s lowered program that call warpnn's ``kind`` ("forward" or "adjoint") handler."""
    text = jax.jit(fn).lower(*args).as_text()
    return [line for line in text.splitlines() if "custom_call" in line and kind in line]


@pytest.fixture
def out_of_place(monkeypatch):
    """Run a function with no pair sharing a buffer, forward or backward (the reference), with fresh traces."""

    def run(fn):
        jax.clear_caches()
        with monkeypatch.context() as m:
            m.setattr(KernelSignature, "in_place_pairs_for", lambda self, shapes, dims: ())
            result = jax.tree.map(np.asarray, fn())
        jax.clear_caches()
        return result

    return run


@pytest.fixture
def pairs_used(monkeypatch):
    """The pairs each call traced since the fixture started (forward or adjoint, outside ``out_of_place``) chose."""
    used = []
    choose = KernelSignature.in_place_pairs_for

    def recording(self, shapes, dims):
        pairs = choose(self, shapes, dims)
        used.append(pairs)
        return pairs

    monkeypatch.setattr(KernelSignature, "in_place_pairs_for", recording)
    return used


def _adjoint_launches() -> int:
    return _launch.LAUNCHER.impl.twins.kernel_launches()["adjoint"] if _launch.LAUNCHER.name == "native" else 0


def _close(actual, expected, **tolerances):
    jax.tree.map(lambda a, b: assert_close(a, b, **tolerances), actual, expected)


def _bitwise(actual, expected):
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, actual), expected)


def _blend_inputs(n=64, batch=None):
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    shape = (n,) if batch is None else (batch, n)
    return jax.random.normal(k1, shape), 0.5 + jax.random.uniform(k2, shape)


@pytest.mark.parametrize("launcher", ["native", "python"])
def test_single_call_gradient_is_bitwise_the_out_of_place_one(launcher, out_of_place):
    x, alpha = _blend_inputs()
    with _launch.use_launcher(launcher):
        f = warpnn.jax_kernel(blend)
        grad = lambda: jax.grad(lambda x, a: jnp.sum(f(x, a)[0] ** 2), argnums=(0, 1))(x, alpha)
        expected = out_of_place(grad)
        _bitwise(grad(), expected)
    _close(expected, jax.grad(lambda x, a: jnp.sum(blend_ref(x, a) ** 2), argnums=(0, 1))(x, alpha))


def test_vec3_pairs_in_a_scan_match_the_out_of_place_adjoint_and_pure_jax(out_of_place):
    f = warpnn.jax_kernel(advance, num_outputs=2)
    x = jax.random.normal(jax.random.PRNGKey(1), (32, 3))
    v = jax.random.normal(jax.random.PRNGKey(2), (32, 3))

    def rollout(step):
        def loss(x, v):
            (x, v), _ = jax.lax.scan(lambda c, _: (step(*c), None), (x, v), None, length=20)
            return jnp.sum(x ** 2) + jnp.sum(jnp.sin(v))
        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    run = lambda: rollout(lambda x, v: tuple(f(x, v, 0.01)))(x, v)
    expected = out_of_place(run)
    _bitwise(run(), expected)
    _close(expected, rollout(lambda x, v: advance_ref(x, v, 0.01))(x, v), rtol=1e-4, atol=1e-5)


def _f32_copies(compiled_text: str) -> int:
    return len(re.findall(r"= f32\[[\d,]*\]\{[^}]*\} copy\(", compiled_text))


def test_the_scan_backward_has_one_copy_fewer(out_of_place):
    f = warpnn.jax_kernel(blend)
    x, alpha = _blend_inputs()

    def loss(x):
        y, _ = jax.lax.scan(lambda c, _: (f(c, alpha)[0], None), x, None, length=10)
        return jnp.sum(y)

    text = lambda: jax.jit(jax.grad(loss)).lower(x).compile().as_text()
    assert _f32_copies(text()) < out_of_place(lambda: _f32_copies(text()))  # the backward carry's copy goes


@pytest.mark.parametrize("batched", ["both", "alpha only"])
@pytest.mark.parametrize("mode", ["0", "twin"])
def test_vmapped_gradients_match_the_out_of_place_adjoint(out_of_place, pairs_used, monkeypatch, batched, mode):
    """Under vmap the pair's input may be shared (a broadcast operand) while its output is batched: its adjoint
    is still per batch element, in the output's batched cotangent buffer."""
    monkeypatch.setenv(_batched.BATCHED_ENV, mode)  # "0": per-element launches, "twin": the batched twin
    x, alpha = _blend_inputs(batch=3)
    if batched == "alpha only":
        x = x[0]
    f = warpnn.jax_kernel(blend)
    in_axes = (0 if batched == "both" else None, 0)
    loss = lambda x, a: jnp.sum(jnp.cos(f(x, a)[0]))
    ref_loss = lambda x, a: jnp.sum(jnp.cos(blend_ref(x, a)))
    per_element = lambda: jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=in_axes)(x, alpha)
    of_sum = lambda: jax.grad(lambda x, a: jnp.sum(jax.vmap(loss, in_axes=in_axes)(x, a)), argnums=(0, 1))(x, alpha)
    for run, ref in ((per_element, jax.vmap(jax.grad(ref_loss, argnums=(0, 1)), in_axes=in_axes)(x, alpha)),
                     (of_sum, jax.grad(lambda x, a: jnp.sum(jax.vmap(ref_loss, in_axes=in_axes)(x, a)),
                                       argnums=(0, 1))(x, alpha))):
        launches = _adjoint_launches()
        expected = out_of_place(run)
        launches_out_of_place, launches = _adjoint_launches() - launches, _adjoint_launches()
        _bitwise(run(), expected)
        _close(expected, ref)
        assert pairs_used == [(("x", "y"),)] * len(pairs_used) and pairs_used
        if _launch.LAUNCHER.name == "native":  # the same launches: a shared input does not cost the twin
            assert _adjoint_launches() - launches == launches_out_of_place == (1 if mode == "twin" else 3)
        pairs_used.clear()


def test_threaded_cpu_launches_agree(out_of_place):
    if _launch.LAUNCHER.name != "native" or jax.default_backend() != "cpu":
        pytest.skip("CPU threads are the native CPU handler's")
    twins = _launch.LAUNCHER.impl.twins
    saved = _batched._LAUNCH_CONFIG.get()
    try:
        twins.set_cpu_threads(3, 1)
        x, alpha = _blend_inputs(n=4096)
        f = warpnn.jax_kernel(blend)
        run = lambda: jax.grad(lambda x, a: jnp.sum(f(x, a)[0] ** 2), argnums=(0, 1))(x, alpha)
        before = twins.threaded_launches()
        _bitwise(run(), out_of_place(run))
        assert twins.threaded_launches() > before
    finally:
        twins.set_cpu_threads(*saved)
        jax.clear_caches()


def test_an_unused_output_leaves_the_other_pair(out_of_place):
    f = warpnn.jax_kernel(copy_then_double, num_outputs=2)
    x = jnp.linspace(-1.0, 1.0, 16)
    for pick in (0, 1):
        run = lambda: jax.grad(lambda x: jnp.sum(jnp.sin(f(x)[pick])))(x)
        expected = out_of_place(run)
        _bitwise(run(), expected)
        _close(expected, jax.grad(lambda x: jnp.sum(jnp.sin((x, 2.0 * x)[pick])))(x))


@pytest.mark.parametrize("case", ["branch reads", "2-D"])
def test_reads_under_branches_and_2d_pairs_match_pure_jax(out_of_place, pairs_used, case):
    if case == "branch reads":
        f, ref = warpnn.jax_kernel(branch_reads), lambda x: jnp.where(x > 0, x * x, -3.0 * x)
        x = jnp.linspace(-2.0, 2.0, 33)
    else:
        f, ref = warpnn.jax_kernel(scale_2d), lambda x: jnp.exp(0.5 * x)
        x = jax.random.normal(jax.random.PRNGKey(4), (5, 7))
    run = lambda: jax.grad(lambda x: jnp.sum(jnp.sin(f(x)[0])))(x)
    got = run()
    assert pairs_used and all(p == (("x", "y"),) for p in pairs_used)
    _bitwise(got, out_of_place(run))
    _close(got, jax.grad(lambda x: jnp.sum(jnp.sin(ref(x))))(x))


def test_a_launch_short_of_the_arrays_keeps_the_adjoint_out_of_place(pairs_used):
    """Threads beyond the launch never store their element of y, so y's cotangent there must not become x's
    adjoint: the pair needs the launch to cover both arrays."""
    f = warpnn.jax_kernel(blend)
    x, alpha = _blend_inputs(n=16)
    g = jax.grad(lambda x: jnp.sum(f(x, alpha, launch_dims=12, output_dims=16)[0] * 3.0))(x)
    assert pairs_used and all(p == () for p in pairs_used)  # forward and adjoint
    expected = jnp.where(jnp.arange(16) < 12, 3.0 * (alpha + jnp.cos(x)), 0.0)
    _close(g, expected)


# -- forward: a call that is not differentiated writes the pair's output into the input's buffer


def _scan_forward(f, alpha, steps=10):
    return jax.jit(lambda x: jax.lax.scan(lambda c, _: (f(c, alpha)[0], None), x, None, length=steps)[0])


def test_a_forward_only_scan_writes_its_carry_in_place(out_of_place):
    f = warpnn.jax_kernel(blend)
    x, alpha = _blend_inputs()
    text = lambda: _scan_forward(f, alpha).lower(x).compile().as_text()
    assert "output_to_operand_aliasing" in text()
    assert _f32_copies(text()) < out_of_place(lambda: _f32_copies(text()))
    expected = out_of_place(lambda: _scan_forward(f, alpha)(x))
    _bitwise(_scan_forward(f, alpha)(x), expected)
    ref = x
    for _ in range(10):
        ref = blend_ref(ref, alpha)
    _close(expected, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("launcher", ["native", "python"])
def test_calls_written_in_place_leave_the_callers_arrays_unchanged(launcher):
    """XLA copies an aliased operand that is still needed: the caller's array, eager or under jit, and a value
    the jitted function reads again after the call."""
    x, alpha = _blend_inputs()
    x_before, alpha_before = np.asarray(x).copy(), np.asarray(alpha).copy()
    with _launch.use_launcher(launcher):
        f = warpnn.jax_kernel(blend)
        eager = f(x, alpha)[0]
        jitted = jax.jit(lambda x, a: f(x, a)[0])(x, alpha)
        again, reused = jax.jit(lambda x, a: (f(x, a)[0], 2.0 * x))(x, alpha)
        batched = jax.vmap(lambda a: f(x, a)[0])(jnp.stack([alpha, 2.0 * alpha]))  # x shared by the batch
    for y in (eager, jitted, again):
        _close(y, blend_ref(x, alpha))
    _close(reused, 2.0 * x)
    _close(batched, jnp.stack([blend_ref(x, alpha), blend_ref(x, 2.0 * alpha)]))
    np.testing.assert_array_equal(np.asarray(x), x_before)
    np.testing.assert_array_equal(np.asarray(alpha), alpha_before)




@pytest.mark.parametrize("backend, adjoint_in_place, expected", [
    ("cpu", True, False),  # XLA's CPU scheduler would copy the scan carry for it: one copy more, not fewer
    ("gpu", False, False),  # a CUDA graph the adjoint's policy keeps would be lost in the forward body too
    ("gpu", True, True),
])
def test_a_differentiated_forward_is_written_in_place_on_a_gpu_where_its_adjoint_is(monkeypatch, backend,
                                                                                   adjoint_in_place, expected):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(_bridge, "_adjoint_in_place_pays", lambda sig, shapes, pairs: adjoint_in_place)
    shapes = {"x": (16,), "alpha": (16,), "y": (16,)}
    assert _bridge._differentiated_forward_in_place_pays(signature_of(blend, 1), shapes, (("x", "y"),)) is expected


def test_by_default_a_small_differentiated_forward_stays_out_of_place(monkeypatch):
    """On the CPU, and on a GPU with XLA's default flags, which the suite runs under."""
    monkeypatch.undo()  # the library's own adjoint policy, not the autouse fixture's
    f = warpnn.jax_kernel(blend)
    x, alpha = _blend_inputs()
    (plain,) = _ffi_calls("forward", lambda x: f(x, alpha)[0], x)
    (differentiated,) = _ffi_calls("forward", jax.grad(lambda x: jnp.sum(f(x, alpha)[0] ** 2)), x)
    assert "output_operand_alias" in plain and "output_operand_alias" not in differentiated


@pytest.fixture
def differentiated_forward_in_place(monkeypatch):
    """A differentiated call's forward written in place, as on a GPU under enable_cuda_graph_capture()."""
    jax.clear_caches()
    monkeypatch.setattr(_bridge, "_differentiated_forward_in_place_pays", lambda sig, shapes, pairs: True)
    yield
    jax.clear_caches()


def test_a_differentiated_forward_in_place_keeps_the_residual_the_adjoint_reads(differentiated_forward_in_place,
                                                                                out_of_place):
    """Under grad the input is a residual Warp's adjoint reads after the forward overwrote its buffer: XLA must
    copy it first (a layer's input) or store it before the call (a scan's carry, stacked as a residual), so the
    gradients are bitwise the out-of-place ones, and the caller's arrays do not change."""
    f = warpnn.jax_kernel(blend)
    x, alpha = _blend_inputs()
    x_before = np.asarray(x).copy()

    def scan_loss(x, a):
        y, _ = jax.lax.scan(lambda c, _: (f(c, a)[0], None), x, None, length=10)
        return jnp.sum(y ** 2)

    def scan_ref(x, a):
        y, _ = jax.lax.scan(lambda c, _: (blend_ref(c, a), None), x, None, length=10)
        return jnp.sum(y ** 2)

    layer_loss = lambda x, a: jnp.sum(jnp.sin(f(2.0 * x, a)[0]) * x)  # noqa: E731 (x read again after the call)
    layer_ref = lambda x, a: jnp.sum(jnp.sin(blend_ref(2.0 * x, a)) * x)  # noqa: E731
    for loss, ref in ((scan_loss, scan_ref), (layer_loss, layer_ref)):
        run = lambda: jax.jit(jax.grad(loss, argnums=(0, 1)))(x, alpha)  # noqa: E731
        assert "output_operand_alias" in _ffi_calls("forward", jax.grad(loss), x, alpha)[0]
        got = run()
        _bitwise(got, out_of_place(run))
        _close(got, jax.grad(ref, argnums=(0, 1))(x, alpha), rtol=1e-4, atol=1e-5)
        vmapped = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(jnp.stack([x, -x]), alpha)
        _close(vmapped, jax.vmap(jax.grad(ref), in_axes=(0, None))(jnp.stack([x, -x]), alpha), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(x), x_before)


def test_one_array_passed_as_both_inputs_is_not_overwritten_under_the_other_reads(out_of_place):
    """``f(x, x)``: the pair's input is also the other input, read at a neighbour. XLA must give the in-place
    output a buffer of its own (it copies the aliased operand), forward and backward."""
    f = warpnn.jax_kernel(plus_next_of)
    x = jnp.linspace(-1.0, 1.0, 16)
    ref = lambda x: (2.0 * x) ** 2 + jnp.roll(x, -1)
    runs = {
        "eager": lambda: f(x, x)[0],
        "jit": lambda: jax.jit(lambda x: f(x, x)[0])(x),
        "scan": lambda: jax.jit(lambda x: jax.lax.scan(lambda c, _: (0.1 * f(c, c)[0], None), x, None, length=3)[0])(x),
        "vmap": lambda: jax.vmap(lambda r: f(r, r)[0])(jnp.stack([x, -x])),
        "grad": lambda: jax.grad(lambda x: jnp.sum(jnp.sin(f(x, x)[0])))(x),
    }
    refs = {
        "eager": ref(x), "jit": ref(x),
        "scan": jax.lax.scan(lambda c, _: (0.1 * ref(c), None), x, None, length=3)[0],
        "vmap": jnp.stack([ref(x), ref(-x)]),
        "grad": jax.grad(lambda x: jnp.sum(jnp.sin(ref(x))))(x),
    }
    for name, run in runs.items():
        got = run()
        _close(got, refs[name], err_msg=name)
        _bitwise(got, out_of_place(run))
