"""Spread adjoints (``_spread.py``): a small parameter read at constant indices by every thread gets its adjoint
added over copies, and the gradients stay those of pure JAX and of Warp's own adjoint."""

import jax
import jax.numpy as jnp
import pytest
import warp as wp

import warpnn
from warpnn import _spread
from warpnn._signature import signature_of

from .helpers import assert_close
from .kernels_for_tests import heat_step, heat_step_ref, two_outputs, two_outputs_ref


@wp.kernel
def shared_params(x: wp.array(dtype=wp.vec3), g: wp.array(dtype=wp.vec3), m: wp.array2d(dtype=float),
                  w: wp.array(dtype=float), y: wp.array(dtype=wp.vec3)):
    # g: read at a constant index and at a computed one; m: two constant indices; w: at the thread's own element
    i = wp.tid()
    k = i % 4
    y[i] = m[1, 0] * x[i] + m[0, 1] * g[0] + w[i] * g[k]


def shared_params_ref(x, g, m, w):
    k = jnp.arange(x.shape[0]) % 4
    return m[1, 0] * x + m[0, 1] * g[0] + w[:, None] * g[k]


@wp.kernel
def scaled_sine(x: wp.array(dtype=float), a: wp.array(dtype=float), y: wp.array(dtype=float),
                z: wp.array(dtype=float)):
    # an elementwise pair x -> y (its adjoint computed in place) and an output z a loss may leave unused (pruned)
    i = wp.tid()
    y[i] = a[0] * x[i] + wp.sin(x[i])
    z[i] = a[1] * wp.sqrt(x[i])


@wp.kernel
def weighted_losses(x: wp.array(dtype=float), a: wp.array(dtype=float), y: wp.array(dtype=float),
                    loss: wp.array(dtype=float)):
    # a spread read (a[0]) and a spread output accumulated at two constant indices
    i = wp.tid()
    v = a[0] * x[i]
    y[i] = v * v
    wp.atomic_add(loss, 0, v)
    wp.atomic_sub(loss, 1, wp.sin(x[i]))


def weighted_losses_ref(x, a):
    v = a[0] * x
    return v * v, jnp.stack([v.sum(), -jnp.sin(x).sum()])


@wp.kernel
def outputs_not_spread(x: wp.array(dtype=float), read: wp.array(dtype=float), stored: wp.array(dtype=float),
                       computed: wp.array(dtype=float), returned: wp.array(dtype=float), maxed: wp.array(dtype=float),
                       y: wp.array(dtype=float)):
    i = wp.tid()
    wp.atomic_add(read, 0, x[i])
    y[i] = read[0]
    stored[0] = x[i]
    wp.atomic_add(computed, i % 2, x[i])
    old = wp.atomic_add(returned, 0, x[i])
    wp.atomic_max(maxed, 0, x[i] + old)


@wp.func
def scaled(a: wp.array(dtype=float), v: float):
    return a[0] * v


@wp.kernel
def not_spread(x: wp.array(dtype=float), stored: wp.array(dtype=float), added: wp.array(dtype=float),
               via_func: wp.array(dtype=float), computed: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = stored[0] * added[0] * scaled(via_func, x[i]) * computed[i % 2]
    stored[0] = 1.0  # (an input the kernel writes: refused at construction, but the analysis must not spread it)
    wp.atomic_add(added, 0, x[i])


def _heat_case(n=48, m=40):
    u = jax.random.normal(jax.random.PRNGKey(0), (n, m))
    w = jax.random.normal(jax.random.PRNGKey(1), (n, m))
    return u, jnp.array([0.3]), w


def _shared_case(n=64):
    keys = jax.random.split(jax.random.PRNGKey(2), 5)
    x = jax.random.normal(keys[0], (n, 3))
    g = jax.random.normal(keys[1], (4, 3))
    m = jax.random.normal(keys[2], (2, 2))
    w = jax.random.normal(keys[3], (n,))
    ct = jax.random.normal(keys[4], (n, 3))
    return (x, g, m, w), ct


def test_the_spread_inputs_are_small_float_arrays_read_at_constant_indices():
    sig = signature_of(shared_params, 1)
    shapes = {"x": (64, 3), "g": (4, 3), "m": (2, 2), "w": (64,)}
    assert _spread.spread_inputs(sig, shapes) == ("g", "m")
    assert _spread.spread_inputs(sig.without_adjoints(frozenset({"g"})), shapes) == ("m",)  # not differentiated
    assert _spread.spread_inputs(sig, {**shapes, "g": (_spread.MAX_ELEMENTS, 3)}) == ("m",)  # too big to copy
    sig = signature_of(not_spread, 1)
    shapes = {n: (8,) for n in ("x", "stored", "added", "via_func", "computed")}
    assert _spread.spread_inputs(sig, shapes) == ()  # stored, atomically added, passed to a func, computed index
    assert _spread.spread_inputs(signature_of(heat_step, 1), {"u": (8, 8), "alpha": (1,)}) == ("alpha",)
    assert _spread.spread_inputs(signature_of(scaled_sine, 2), {"x": (8,), "a": (2,)}) == ("a",)


def test_spreading_is_for_big_gpu_launches_unless_overridden(monkeypatch):
    monkeypatch.delenv(_spread.SPREAD_ENV, raising=False)
    big = (_spread.MIN_THREADS,)
    assert _spread.pays(big) == (jax.default_backend() != "cpu")
    assert not _spread.pays((_spread.MIN_THREADS - 1,))
    with _spread.override(True):
        assert _spread.pays((1,))
        with _spread.override(False):
            assert not _spread.pays(big)
        assert _spread.pays((1,))
    assert _spread.pays(big) == (jax.default_backend() != "cpu")
    monkeypatch.setenv(_spread.SPREAD_ENV, "1")
    assert _spread.pays((1,))
    monkeypatch.setenv(_spread.SPREAD_ENV, "0")
    assert not _spread.pays(big)
    with _spread.override(True):
        assert _spread.pays(big)  # override first
    monkeypatch.setenv(_spread.SPREAD_ENV, "yes")
    with pytest.raises(ValueError, match="WARPNN_SPREAD='yes': expected 0"):
        _spread.pays(big)


def _grads(loss, args, argnums, spread: bool):
    jax.clear_caches()  # the choice is made while tracing, and JAX reuses traces of the same call
    with _spread.override(spread):
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums))(*args))
        grads = jax.jit(jax.grad(loss, argnums))(*args)
    assert ("__wnspread" in jaxpr) == spread
    return grads


def test_a_spread_heat_stencil_has_the_gradients_of_pure_jax_and_of_warps_adjoint():
    f = warpnn.jax_kernel(heat_step)
    u, alpha, w = _heat_case()
    loss = lambda u, a: jnp.vdot(w, f(u, a, 0.2)[0])  # noqa: E731
    spread = _grads(loss, (u, alpha), (0, 1), True)
    plain = _grads(loss, (u, alpha), (0, 1), False)
    ref = jax.grad(lambda u, a: jnp.vdot(w, heat_step_ref(u, a, 0.2)), (0, 1))(u, alpha)
    for ours, theirs, expected in zip(spread, plain, ref):
        assert_close(ours, theirs, 1e-5, 1e-5)
        assert_close(ours, expected, 1e-5, 1e-4)


def test_spread_and_direct_reads_of_one_parameter_add_up():
    f = warpnn.jax_kernel(shared_params)
    args, ct = _shared_case()
    loss = lambda *a: jnp.vdot(ct, f(*a)[0])  # noqa: E731
    spread = _grads(loss, args, (0, 1, 2, 3), True)
    ref = jax.grad(lambda *a: jnp.vdot(ct, shared_params_ref(*a)), (0, 1, 2, 3))(*args)
    for ours, expected in zip(spread, ref):
        assert_close(ours, expected, 1e-5, 1e-5)
    # g not differentiated: a second twin (m only), in a module of its own; the first still runs after it
    only_m = _grads(loss, args, (0, 2), True)
    for ours, expected in zip(only_m, (ref[0], ref[2])):
        assert_close(ours, expected, 1e-5, 1e-5)
    again = _grads(lambda *a: 2.0 * loss(*a), args, (0, 1, 2, 3), True)
    for ours, expected in zip(again, ref):
        assert_close(ours, 2.0 * expected, 1e-5, 1e-5)


def test_a_spread_adjoint_under_vmap_and_scan():
    f = warpnn.jax_kernel(heat_step)
    u, alpha, w = _heat_case(24, 16)
    us, alphas = jnp.stack([u, -2.0 * u, 0.5 * u]), jnp.stack([alpha, 2.0 * alpha, 0.1 + alpha])

    def rollout(step, u, a):
        return jnp.vdot(w, jax.lax.scan(lambda c, _: (step(c, a), None), u, None, length=3)[0])

    ours = lambda u, a: rollout(lambda c, a: f(c, a, 0.2)[0], u, a)  # noqa: E731
    ref = lambda u, a: rollout(lambda c, a: heat_step_ref(c, a, 0.2), u, a)  # noqa: E731
    expected = jax.vmap(jax.grad(ref, (0, 1)))(us, alphas)
    with _spread.override(True):
        per_element = jax.jit(jax.vmap(jax.grad(ours, (0, 1))))(us, alphas)  # vmap of grad
        summed = jax.jit(jax.grad(lambda us, a: jax.vmap(ours, (0, None))(us, a).sum(), (0, 1)))(us, alpha)
    for got, want in zip(per_element, expected):
        assert_close(got, want, 1e-5, 1e-4)
    assert_close(summed[1], jax.grad(lambda a: jax.vmap(ref, (0, None))(us, a).sum())(alpha), 1e-5, 1e-4)


@pytest.mark.gpu
def test_a_big_gpu_launch_spreads_by_default():
    f = warpnn.jax_kernel(heat_step)
    u, alpha, w = _heat_case(256, 128)
    loss = lambda a: jnp.vdot(w, f(u, a, 0.2)[0])  # noqa: E731
    assert "__wnspread" in str(jax.make_jaxpr(jax.grad(loss))(alpha))
    expected = jax.grad(lambda a: jnp.vdot(w, heat_step_ref(u, a, 0.2)))(alpha)
    assert_close(jax.jit(jax.grad(loss))(alpha), expected, 1e-4, 1e-3)


def test_the_copies_are_a_power_of_two_per_launch_size_and_any_count_gives_the_same_gradient():
    per = _spread.THREADS_PER_SLOT
    assert _spread.slots_for((1,)) == 32
    assert _spread.slots_for((1 << 30,)) == _spread.SLOTS
    assert _spread.slots_for((100 * per,)) == 64  # a power of two, rounded down
    assert _spread.slots_for((16, 32 * per)) == 512
    assert _spread.slots_for((1 << 20,), 64) == (1 << 20) // 1024  # at most one copied element per 16 threads
    assert _spread.slots_for((1 << 16,), 4) == (1 << 16) // per
    f = warpnn.jax_kernel(heat_step)
    u, alpha, w = _heat_case(24, 20)
    grad = jax.grad(lambda a: jnp.vdot(w, f(u, a, 0.2)[0]))
    expected = jax.grad(lambda a: jnp.vdot(w, heat_step_ref(u, a, 0.2)))(alpha)
    for slots in (1, 7, 4096):  # the twin reads the count from its operand
        with _spread.override(True), pytest.MonkeyPatch.context() as patch:
            patch.setattr(_spread, "slots_for", lambda dims, elements, slots=slots: slots)
            assert_close(jax.jit(lambda a: grad(a))(alpha), expected, 1e-5, 1e-4)  # a new function: traced again


def test_spreading_composes_with_adjoints_in_place_and_pruned_outputs():
    f = warpnn.jax_kernel(scaled_sine, num_outputs=2)
    x = jax.random.uniform(jax.random.PRNGKey(3), (300,), minval=0.0, maxval=2.0).at[0].set(0.0)  # sqrt'(0) = inf
    a = jnp.array([0.7, -0.2])
    w = jax.random.normal(jax.random.PRNGKey(4), (300,))

    def rollout(step, x, a):  # y carried (its adjoint in place on the CPU), z unused (its 0 * inf pruned)
        return jnp.vdot(w, jax.lax.scan(lambda c, _: (step(c, a), None), x, None, length=4)[0])

    ours = lambda x, a: rollout(lambda c, a: f(c, a)[0], x, a)  # noqa: E731
    ref = lambda x, a: rollout(lambda c, a: a[0] * c + jnp.sin(c), x, a)  # noqa: E731
    got = _grads(ours, (x, a), (0, 1), True)
    for ours_grad, expected in zip(got, jax.grad(ref, (0, 1))(x, a)):
        assert_close(ours_grad, expected, 1e-5, 1e-5)


def test_the_spread_outputs_are_small_float_outputs_only_accumulated_at_constant_indices():
    assert _spread.spread_outputs(signature_of(two_outputs, 2), {"x": (8,), "y": (8,), "total": (1,)}) == ("total",)
    assert _spread.spread_outputs(signature_of(two_outputs, 2), {"x": (8,), "y": (8,), "total": (65,)}) == ()
    assert _spread.spread_outputs(signature_of(weighted_losses, 2), {"x": (8,), "a": (1,), "y": (8,), "loss": (2,)}) == ("loss",)
    names = ("read", "stored", "computed", "returned", "maxed", "y")
    sig = signature_of(outputs_not_spread, len(names))
    assert _spread.spread_outputs(sig, {n: (8,) for n in ("x", *names)}) == ()  # read, stored, index, result, max


def test_spread_outputs_sum_to_pure_jax_forward_and_backward():
    f = warpnn.jax_kernel(weighted_losses, num_outputs=2, output_dims={"y": 700, "loss": 2})
    x = jax.random.normal(jax.random.PRNGKey(5), (700,))
    a = jnp.array([1.3])
    expected = weighted_losses_ref(x, a)
    for spread in (True, False):
        jax.clear_caches()
        with _spread.override(spread):
            assert ("__wnspread" in str(jax.make_jaxpr(f)(x, a))) == spread
            for got, want in zip(jax.jit(lambda x, a: f(x, a))(x, a), expected):  # not differentiated
                assert_close(got, want, 1e-5, 1e-4)
    ct = jnp.array([0.7, -1.1])
    loss = lambda x, a: jnp.vdot(ct, f(x, a)[1]) + f(x, a)[0].sum()  # noqa: E731
    got = _grads(loss, (x, a), (0, 1), True)  # forward rule and adjoint (a spread twin each)
    want = jax.grad(lambda x, a: jnp.vdot(ct, weighted_losses_ref(x, a)[1]) + weighted_losses_ref(x, a)[0].sum(),
                    (0, 1))(x, a)
    for g, w in zip(got, want):
        assert_close(g, w, 1e-5, 1e-4)


def test_a_spread_loss_under_vmap_and_scan():
    f = warpnn.jax_kernel(two_outputs, num_outputs=2, output_dims={"y": 200, "total": 1})
    xs = jax.random.normal(jax.random.PRNGKey(6), (3, 200))

    def ours(x):
        return jax.lax.scan(lambda c, _: (f(c, 0.9)[0], f(c, 0.9)[1][0]), x, None, length=3)[1].sum()

    def ref(x):
        return jax.lax.scan(lambda c, _: (two_outputs_ref(c, 0.9)[0], two_outputs_ref(c, 0.9)[1][0]), x, None,
                            length=3)[1].sum()

    with _spread.override(True):
        assert "__wnspread" in str(jax.make_jaxpr(jax.vmap(ours))(xs))
        values = jax.jit(jax.vmap(ours))(xs)
        grads = jax.jit(jax.vmap(jax.grad(ours)))(xs)
    assert_close(values, jax.vmap(ref)(xs), 1e-5, 1e-4)
    assert_close(grads, jax.vmap(jax.grad(ref))(xs), 1e-5, 1e-4)
