"""Batched twins (``warpnn._batched``): one launch per vmapped batch and CPU launches split across threads,
against per-element launches and pure-JAX references."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _batched
from warpnn._launch import LAUNCHER

from .helpers import ROOT, assert_close, subprocess_env
from .kernels_for_tests import (
    affine_2d,
    affine_2d_ref,
    cubic_f64,
    cubic_f64_ref,
    heat_step,
    heat_step_ref,
    shifted_rows,
    shifted_rows_through_a_func,
    rotate,
    rotate_ref,
    scale_square,
    scale_square_ref,
    spring_forces,
    spring_forces_fn,
    spring_forces_ref,
    springs_case,
    two_outputs,
    two_outputs_ref,
    weighted_gather,
    weighted_gather_ref,
)

native = pytest.mark.skipif(LAUNCHER.name != "native", reason="batched twins are launched by the native launcher")


def launches():
    return LAUNCHER.impl.twins.kernel_launches()


def per_element_and_batched(monkeypatch, run):
    """``run()`` with per-element launches, then with the batched twin (also on the CPU, where by default a
    batch runs its per-element launches on the CPU threads instead), fresh traces each, and the launch counts."""
    results, counts = [], []
    for flag in ("0", "twin"):
        monkeypatch.setenv(_batched.BATCHED_ENV, flag)
        jax.clear_caches()
        before = launches()
        results.append(jax.tree.map(np.asarray, run()))
        after = launches()
        counts.append({k: after[k] - before[k] for k in after})
    monkeypatch.delenv(_batched.BATCHED_ENV)
    jax.clear_caches()
    return results, counts


def _same(a, b):
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(a, b)
    else:  # float32 atomics in another order: a few ulps of the partial sums (~1e-6 relative of |sum| ~ 100)
        assert_close(a, b, rtol=1e-5, atol=1e-5)


def _springs_cases():
    pos, springs, stiffness, rest = springs_case(12)
    keys = jax.random.split(jax.random.PRNGKey(3), 5)
    pos_b = pos[None] + 0.1 * jax.vmap(lambda k: jax.random.normal(k, pos.shape))(keys)
    stiff_b = stiffness[None] * jnp.linspace(0.5, 1.5, 5)[:, None]
    fn = spring_forces_fn()

    def energy(p, k, ref=False):
        f = spring_forces_ref(p, springs, k, rest, 1.0) if ref else fn(p, springs, k, rest, 1.0)
        return jnp.sum(f**2)

    return {
        # scatter with shared connectivity: batched positions, shared stiffness
        "springs_fwd_mixed": (
            lambda: jax.jit(jax.vmap(lambda p: fn(p, springs, stiffness, rest, 1.0)))(pos_b),
            lambda: jax.vmap(lambda p: spring_forces_ref(p, springs, stiffness, rest, 1.0))(pos_b),
        ),
        # both batched, connectivity shared
        "springs_fwd_both": (
            lambda: jax.jit(jax.vmap(lambda p, k: fn(p, springs, k, rest, 1.0)))(pos_b, stiff_b),
            lambda: jax.vmap(lambda p, k: spring_forces_ref(p, springs, k, rest, 1.0))(pos_b, stiff_b),
        ),
        # vmap of grad: shared stiffness gets a per-element gradient
        "springs_vmap_grad": (
            lambda: jax.jit(jax.vmap(jax.grad(energy, argnums=(0, 1)), in_axes=(0, None)))(pos_b, stiffness),
            lambda: jax.vmap(jax.grad(lambda p, k: energy(p, k, True), argnums=(0, 1)), in_axes=(0, None))(pos_b, stiffness),
        ),
        # grad of vmap: the shared stiffness's gradient sums over the batch
        "springs_grad_vmap": (
            lambda: jax.jit(jax.grad(lambda k: jax.vmap(lambda p: energy(p, k))(pos_b).sum()))(stiffness),
            lambda: jax.grad(lambda k: jax.vmap(lambda p: energy(p, k, True))(pos_b).sum())(stiffness),
        ),
        # only the batched stiffness is differentiated (positions constant: null adjoints)
        "springs_grad_constant_input": (
            lambda: jax.jit(jax.vmap(jax.grad(energy, argnums=1)))(pos_b, stiff_b),
            lambda: jax.vmap(jax.grad(lambda p, k: energy(p, k, True), argnums=1))(pos_b, stiff_b),
        ),
    }


def _other_cases():
    key = jax.random.PRNGKey(7)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x = jax.random.normal(k1, (4, 3, 10))
    w = jax.random.normal(k2, (10,))
    idx = jax.random.randint(k3, (10,), 0, 10).astype(jnp.int32)
    gather = warpnn.jax_kernel(weighted_gather)
    sq = warpnn.jax_kernel(scale_square)
    aff = warpnn.jax_kernel(affine_2d)
    two = warpnn.jax_kernel(two_outputs, num_outputs=2)
    rot = warpnn.jax_kernel(rotate)
    a = jax.random.normal(k4, (3, 5, 6))
    m = jax.random.normal(k1, (3, 7, 3, 3))
    v = jax.random.normal(k2, (3, 7, 3))
    return {
        "gather_vmap": (
            lambda: jax.jit(jax.vmap(lambda x: gather(x, idx, w)[0]))(x[0]),
            lambda: jax.vmap(lambda x: weighted_gather_ref(x, idx, w))(x[0]),
        ),
        # nested vmap, x batched along both, w along the outer axis only (a mixed broadcast)
        "gather_nested_mixed": (
            lambda: jax.jit(jax.vmap(jax.vmap(lambda x, w: gather(x, idx, w)[0], in_axes=(0, None)), in_axes=(0, 0)))(x, x[:, 0]),
            lambda: jax.vmap(jax.vmap(lambda x, w: weighted_gather_ref(x, idx, w), in_axes=(0, None)), in_axes=(0, 0))(x, x[:, 0]),
        ),
        # nested vmap, x batched along the inner axis only, w along the outer only
        "gather_nested_crossed": (
            lambda: jax.jit(jax.vmap(jax.vmap(lambda x, w: gather(x, idx, w)[0], in_axes=(0, None)), in_axes=(None, 0)))(x[0], x[:, 1]),
            lambda: jax.vmap(jax.vmap(lambda x, w: weighted_gather_ref(x, idx, w), in_axes=(0, None)), in_axes=(None, 0))(x[0], x[:, 1]),
        ),
        "gather_grad_nested": (
            lambda: jax.jit(jax.vmap(jax.vmap(jax.grad(lambda x, w: jnp.sum(gather(x, idx, w)[0] ** 2), argnums=(0, 1)))))(x, x),
            lambda: jax.vmap(jax.vmap(jax.grad(lambda x, w: jnp.sum(weighted_gather_ref(x, idx, w) ** 2), argnums=(0, 1))))(x, x),
        ),
        "scale_square_grad_vmap": (
            lambda: jax.jit(jax.grad(lambda x: jnp.sum(jax.vmap(lambda x: sq(x, 1.5)[0])(x))))(x[0]),
            lambda: jax.grad(lambda x: jnp.sum(jax.vmap(lambda x: scale_square_ref(x, 1.5))(x)))(x[0]),
        ),
        "affine_2d_vmap_grad": (
            lambda: jax.jit(jax.vmap(jax.grad(lambda a, b, c: jnp.sum(aff(a, b, c)[0] ** 2), argnums=(0, 1, 2)), in_axes=(0, None, 0)))(a, a[0, 0], a[:, :, 0]),
            lambda: jax.vmap(jax.grad(lambda a, b, c: jnp.sum(affine_2d_ref(a, b, c) ** 2), argnums=(0, 1, 2)), in_axes=(0, None, 0))(a, a[0, 0], a[:, :, 0]),
        ),
        "two_outputs_vmap": (
            lambda: jax.jit(jax.vmap(lambda x: two(x, 0.5, output_dims={"y": 10, "total": 1})))(x[0]),
            lambda: jax.vmap(lambda x: two_outputs_ref(x, 0.5))(x[0]),
        ),
        "two_outputs_grad_vmap": (
            lambda: jax.jit(jax.grad(lambda x: sum(jnp.sum(o) for o in jax.vmap(lambda x: two(x, 0.5, output_dims={"y": 10, "total": 1}))(x))))(x[0]),
            lambda: jax.grad(lambda x: sum(jnp.sum(o) for o in jax.vmap(lambda x: two_outputs_ref(x, 0.5))(x)))(x[0]),
        ),
        "rotate_vmap_grad": (
            lambda: jax.jit(jax.vmap(jax.grad(lambda m, v: jnp.sum(rot(m, v)[0] ** 2), argnums=(0, 1))))(m, v),
            lambda: jax.vmap(jax.grad(lambda m, v: jnp.sum(rotate_ref(m, v) ** 2), argnums=(0, 1)))(m, v),
        ),
    }


@wp.kernel
def decay_in_place(a: wp.array(dtype=float), y: wp.array(dtype=float)):
    tid = wp.tid()  # (named as in Newton's kernels) reads its own element, then overwrites it: private in-out
    y[tid] = 0.5 * y[tid] * y[tid] + a[0] * y[tid]


@wp.kernel
def scatter_into(idx: wp.array(dtype=wp.int32), v: wp.array(dtype=float), acc: wp.array(dtype=float)):
    i = wp.tid()  # accumulates anywhere into an in-out array
    wp.atomic_add(acc, idx[i], v[i])


def _in_out_cases():
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(11), 3)
    a = jnp.array([0.7])
    y = jax.random.normal(k1, (4, 9))
    v = jax.random.normal(k2, (4, 12))
    idx = jax.random.randint(k3, (12,), 0, 9).astype(jnp.int32)
    decay = warpnn.jax_kernel(decay_in_place, launch_dims=9, in_out_argnames=["y"])
    scatter = warpnn.jax_kernel(scatter_into, in_out_argnames=["acc"])
    decay_ref = lambda a, y: 0.5 * y * y + a[0] * y  # noqa: E731
    scatter_ref = lambda v, acc: acc.at[idx].add(v)  # noqa: E731
    decay_loss = lambda f: lambda a, y: jnp.sum(f(a, y) ** 2)  # noqa: E731
    scatter_loss = lambda f: lambda v, acc: jnp.sum(jnp.sin(f(v, acc)))  # noqa: E731
    ours_decay, ours_scatter = (lambda a, y: decay(a, y)[0]), (lambda v, acc: scatter(idx, v, acc)[0])
    return {
        "in_place_vmap": (
            lambda: jax.jit(jax.vmap(ours_decay, in_axes=(None, 0)))(a, y),
            lambda: jax.vmap(decay_ref, in_axes=(None, 0))(a, y),
        ),
        "in_place_vmap_grad": (
            lambda: jax.jit(jax.vmap(jax.grad(decay_loss(ours_decay), argnums=(0, 1)), in_axes=(None, 0)))(a, y),
            lambda: jax.vmap(jax.grad(decay_loss(decay_ref), argnums=(0, 1)), in_axes=(None, 0))(a, y),
        ),
        "in_out_scatter_vmap": (
            lambda: jax.jit(jax.vmap(ours_scatter))(v, y),
            lambda: jax.vmap(scatter_ref)(v, y),
        ),
        "in_out_scatter_grad_vmap": (
            lambda: jax.jit(jax.grad(lambda v, acc: jax.vmap(scatter_loss(ours_scatter))(v, acc).sum(), argnums=(0, 1)))(v, y),
            lambda: jax.grad(lambda v, acc: jax.vmap(scatter_loss(scatter_ref))(v, acc).sum(), argnums=(0, 1))(v, y),
        ),
    }


CASES = {**_springs_cases(), **_other_cases(), **_in_out_cases()}


@native
@pytest.mark.parametrize("name", sorted(CASES))
def test_batched_launch_matches_per_element_and_pure_jax(monkeypatch, name):
    run, reference = CASES[name]
    (per_element, batched), (n_per, n_bat) = per_element_and_batched(monkeypatch, run)
    expected = jax.tree.map(np.asarray, reference())
    # CPU: the twin runs each element's threads in the per-element order, so even scatters add alike; a GPU's
    # atomics add in no fixed order either way
    jax.tree.map(_same, batched, per_element)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=2e-5, atol=2e-5), batched, expected)
    # one launch per call and direction, against one per batch element (XLA may drop an unused forward)
    assert any(n_per.values()), (n_per, n_bat)
    for direction, n in n_per.items():
        assert n_bat[direction] == (1 if n else 0) and n != 1, (n_per, n_bat)


@native
def test_batched_float64_gradient(monkeypatch, x64):
    f = warpnn.jax_kernel(cubic_f64)
    x = jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float64).reshape(3, 8)
    w = jnp.linspace(0.5, 2.0, 8, dtype=jnp.float64)
    run = lambda: jax.jit(jax.vmap(jax.grad(lambda x, w: jnp.sum(f(x, w)[0]), argnums=(0, 1)), in_axes=(0, None)))(x, w)  # noqa: E731
    (per_element, batched), _ = per_element_and_batched(monkeypatch, run)
    ref = jax.vmap(jax.grad(lambda x, w: jnp.sum(cubic_f64_ref(x, w)), argnums=(0, 1)), in_axes=(0, None))(x, w)
    jax.tree.map(_same, batched, per_element)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-12, atol=1e-12), batched, ref)


@wp.kernel
def four_d(x: wp.array4d(dtype=float), y: wp.array4d(dtype=float)):
    i, j, k, l = wp.tid()
    y[i, j, k, l] = 2.0 * x[i, j, k, l]


@native
def test_kernel_without_twin_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setenv(_batched.BATCHED_ENV, "twin")  # the CPU would not ask for a twin by default
    f = warpnn.jax_kernel(four_d)
    x = jnp.arange(2 * 2 * 3 * 2 * 2, dtype=jnp.float32).reshape(2, 2, 3, 2, 2)
    jax.clear_caches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (y,) = jax.jit(jax.vmap(lambda x: f(x)))(x)
    messages = [str(w.message) for w in caught if "launches once per batch element" in str(w.message)]
    assert len(messages) == 1 and "four_d" in messages[0] and "4 dims" in messages[0], messages
    assert_close(y, 2 * x)


@wp.func
def _softplus(v: float):
    return wp.log(1.0 + wp.exp(v))


def _activation(name: str):
    return {"softplus": _softplus}[name]


@wp.kernel
def softplus_kernel(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = wp.static(_activation("softplus"))(x[i])  # (a function chosen by wp.static, as mujoco_warp's filters are)


@native
def test_a_kernel_warp_has_built_gets_its_twin(monkeypatch):
    """Warp attaches the function a wp.static() expression returns (holding ctypes pointers) to the kernel's AST
    when it builds the module; copying that tree for a twin failed, so a kernel launched once before (mujoco_warp's broad phase) ran once per
    batch element under vmap, with a warning about pickling."""
    wp.launch(softplus_kernel, 4, [wp.zeros(4, dtype=float), wp.zeros(4, dtype=float)])  # built and loaded first
    assert not isinstance(_batched.twin_of(softplus_kernel), str)
    monkeypatch.setenv(_batched.BATCHED_ENV, "twin")  # the CPU would not ask for a twin by default
    f = warpnn.jax_kernel(softplus_kernel)
    x = jnp.linspace(-2.0, 2.0, 12).reshape(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (y,) = jax.jit(jax.vmap(lambda x: f(x)))(x)
    assert not [str(w.message) for w in caught if "launches once per batch element" in str(w.message)]
    assert_close(y, jax.nn.softplus(x))


@wp.func
def _first(a: wp.array(dtype=float)):
    return a[0]


@wp.kernel
def passes_array(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i] + _first(x)


def test_twin_refuses_what_it_cannot_express():
    assert "passes it to a function" in _batched.twin_of(passes_array)
    assert "4 dims" in _batched.twin_of(four_d)
    assert isinstance(_batched.twin_of(scale_square), _batched.Twin)
    assert isinstance(_batched.twin_of(decay_in_place), _batched.Twin)  # a variable named `tid` is no alias


# --------------------------------------------------------------------------------------------------
# CPU threads


@pytest.fixture(params=[(1, "warpnn"), (5, "warpnn"), (1, "xla")],
                ids=["slice per worker", "5 slices per worker", "XLA's pool"])
def cpu_threads(request):
    """Set the CPU launch threads for a test (fresh traces), restoring the configuration afterwards; every such
    test runs with a slice per worker, with five (threads claiming finer slices), and on XLA's intra-op pool."""
    if LAUNCHER.name != "native" or jax.default_backend() != "cpu":
        pytest.skip("CPU threads are the native CPU handler's")
    twins = LAUNCHER.impl.twins
    saved = _batched._LAUNCH_CONFIG.get(), twins.cpu_slices_per_worker, twins.cpu_pool
    slices, pool = request.param
    twins.set_cpu_slices_per_worker(slices)
    twins.set_cpu_pool(pool)

    def use(threads, min_work=1):
        twins.set_cpu_threads(threads, min_work)
        jax.clear_caches()

    yield use
    twins.set_cpu_threads(*saved[0])
    twins.set_cpu_slices_per_worker(saved[1])
    twins.set_cpu_pool(saved[2])
    jax.clear_caches()


def _threaded_and_single(cpu_threads, run):
    cpu_threads(1)
    single = jax.tree.map(np.asarray, run())
    cpu_threads(3)  # more workers than cores is fine: the slices are what is tested
    twins = LAUNCHER.impl.twins
    before, tasks_before = twins.threaded_launches(), twins.xla_pool_tasks()
    threaded = jax.tree.map(np.asarray, run())
    launches = twins.threaded_launches() - before
    if twins.cpu_pool == "xla" and launches:  # the slices went to XLA's pool (this jaxlib offers it), not ours
        assert twins.xla_pool_tasks() > tasks_before
    return single, threaded, launches


def test_cpu_pool_setting_names_what_it_accepts():
    if LAUNCHER.name != "native":
        pytest.skip("the CPU pool is the native launcher's")
    twins = LAUNCHER.impl.twins
    with pytest.raises(ValueError, match="WARPNN_CPU_POOL.*expected 'warpnn' or 'xla'"):
        twins.set_cpu_pool("openmp")
    assert twins.cpu_pool in ("warpnn", "xla")  # unchanged by the refusal


def test_private_rows_analysis():
    from warpnn._signature import signature_of

    private, assigned = signature_of(heat_step, 1).thread_private_arrays
    assert private == {"out"}  # u is read at neighbours, alpha at 0: their adjoints scatter
    assert assigned == {"out"}
    private, assigned = signature_of(spring_forces, 1).thread_private_arrays
    assert private == {"stiffness", "rest", "springs"} and "f" not in assigned
    private, _ = signature_of(scale_square, 1).thread_private_arrays
    assert private == {"x", "y"}


@wp.kernel
def _gather_scatter_rows(x: wp.array(dtype=float), pairs: wp.array(dtype=wp.vec2i), tri: wp.array2d(dtype=int),
                         f: wp.array(dtype=float), g: wp.array(dtype=float), h: wp.array(dtype=float)):
    s = wp.tid()
    ij = pairs[s]
    i = ij[0]
    a = tri[s, 0]
    wp.atomic_add(f, i, x[a])      # f at pairs' values; x read at tri's
    g[pairs[s][1]] += 1.0          # an index not bound to a name: no window
    wp.atomic_add(h, i + 1, 2.0)   # an index computed from one: no window


@wp.kernel
def _rewritten_row(x: wp.array(dtype=float), pairs: wp.array(dtype=wp.vec2i), f: wp.array(dtype=float)):
    s = wp.tid()
    ij = pairs[s]
    ij[0] = ij[0] + 1  # the row vector no longer holds the index array's values
    wp.atomic_add(f, ij[0], x[ij[1]])


def test_row_windows_analysis():
    from warpnn._signature import signature_of

    assert signature_of(spring_forces, 1).thread_row_windows == {"pos": ("springs",), "f": ("springs",)}
    assert signature_of(_gather_scatter_rows, 3).thread_row_windows == {"x": ("tri",), "f": ("pairs",)}
    assert signature_of(_rewritten_row, 1).thread_row_windows == {}
    assert signature_of(heat_step, 1).thread_row_windows == {}  # read at neighbours of wp.tid(), no index array


def test_a_scatter_whose_partial_buffers_exceed_the_budget_is_not_split(cpu_threads):
    """Each worker of a split scatter zeroes and sums a partial buffer of the result: past the budget (partial
    bytes of all workers per launch thread, ``set_cpu_partial_budget``) the launch keeps fewer workers. The
    stencil's forward writes only its own rows (no partials); its adjoint scatters into u's adjoint."""
    heat = warpnn.jax_kernel(heat_step)
    u = jax.random.normal(jax.random.PRNGKey(0), (33, 17))
    alpha = jnp.array([0.7])
    grad = lambda: jax.grad(lambda u: jnp.sum(heat(u, alpha, 0.2)[0] ** 2))(u)
    twins = LAUNCHER.impl.twins
    expected = jax.grad(lambda u: jnp.sum(heat_step_ref(u, alpha, 0.2) ** 2))(u)
    launches = {}
    try:
        for budget in (1, _batched.DEFAULT_PARTIAL_BUDGET):
            twins.set_cpu_partial_budget(budget)
            cpu_threads(3)
            before = twins.threaded_launches()
            assert_close(grad(), expected, rtol=1e-5, atol=1e-5)
            launches[budget] = twins.threaded_launches() - before
    finally:
        twins.set_cpu_partial_budget(_batched.DEFAULT_PARTIAL_BUDGET)
    assert launches == {1: 1, _batched.DEFAULT_PARTIAL_BUDGET: 2}  # the forward alone, then the adjoint too


def _window_case(n: int, shuffled: bool):
    pos, springs, stiffness, rest = springs_case(n)  # stretch springs (i, i + 1), then bend springs (i, i + 2)
    order = jax.random.permutation(jax.random.PRNGKey(7), springs.shape[0]) if shuffled else jnp.argsort(springs[:, 0])
    return pos, springs[order], stiffness[order], rest[order]


@pytest.mark.parametrize("shuffled", [False, True])
def test_threaded_scatters_zero_and_sum_only_the_rows_their_indices_reach(cpu_threads, shuffled):
    """Each slice's partial buffer covers the rows between its smallest and largest index: its share of the rows
    for springs sorted by particle, about all of them shuffled, and the results agree with one thread and pure JAX either way."""
    fn = spring_forces_fn()
    pos, springs, stiffness, rest = _window_case(400, shuffled)

    def loss(pos, k):
        return jnp.sum(fn(pos, springs, k, rest, 1.0) ** 2)

    run = lambda: jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(pos, stiffness)
    rows = LAUNCHER.impl.twins.partial_rows
    cpu_threads(1)
    single = jax.tree.map(np.asarray, run())
    cpu_threads(4)
    jax.block_until_ready(run())
    before = rows()
    threaded = jax.tree.map(np.asarray, run())
    zeroed = rows() - before  # forward: f; adjoint: pos's adjoint; 3 workers with partials each
    whole = 2 * 3 * pos.shape[0]
    if shuffled:
        assert zeroed > whole // 2
    else:
        assert zeroed < whole // 2
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-5, atol=1e-5), threaded, single)
    ref = jax.value_and_grad(lambda p, k: jnp.sum(spring_forces_ref(p, springs, k, rest, 1.0) ** 2), argnums=(0, 1))
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-4, atol=1e-4), threaded, ref(pos, stiffness))


@wp.func
def _store_pair(out: wp.array(dtype=float), k: int, v: float):
    out[2 * k] = v
    out[2 * k + 1] = -v


@wp.kernel
def _stores_through_a_func(x: wp.array(dtype=float), out: wp.array(dtype=float)):
    i = wp.tid()
    _store_pair(out, i, x[i])  # stores, at other threads' rows, inside a @wp.func


def test_an_array_a_wp_func_stores_into_is_never_summed_through_partial_buffers(cpu_threads):
    """Summing per-thread partial buffers is right only for arrays a kernel adds into. An array passed to a
    @wp.func may be stored into there (Newton's integrate_generalized_joints writes joint_q_new in jcalc_integrate):
    a split launch summing it would add the stored values to the array's old ones (an in-out array), silently."""
    from warpnn._signature import signature_of

    assert "out" in signature_of(_stores_through_a_func, 1).thread_private_arrays[1]
    f = warpnn.jax_kernel(_stores_through_a_func, in_out_argnames=["out"], launch_dims=(48,))
    x = jnp.arange(1.0, 49.0)
    old = jnp.full((96,), 100.0)
    expected = jnp.stack([x, -x], 1).reshape(-1)
    for threads in (1, 3):
        cpu_threads(threads)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda x, o: f(x, o)[0])(x, old)), np.asarray(expected))


@wp.kernel
def _stores_through_a_row_view(rows: wp.array(dtype=int), x: wp.array2d(dtype=float)):
    i = wp.tid()
    row = x[rows[i]]  # a view of another thread's row
    row[0] = 2.0 * row[1]


def test_an_array_stored_through_a_row_view_is_never_summed_through_partial_buffers(cpu_threads):
    """``row = x[k]; row[0] = v`` stores into ``x``. The slice analysis saw only a read of ``x[k]``; the uses analysis
    sees the store (it is what rejects a kernel writing an input so), and now decides: a split launch summing
    ``x`` would add the stored values to the old ones (an in-out array), silently. Latent until now: a kernel
    that takes row views has no twin (so no split launch); the analysis must not rely on that."""
    from warpnn._signature import signature_of

    sig = signature_of(_stores_through_a_row_view, 1, in_out_argnames=["x"])
    assert "x" in sig.thread_private_arrays[1]
    f = warpnn.jax_kernel(_stores_through_a_row_view, num_outputs=1, in_out_argnames=["x"], launch_dims=(4096,))
    rows = jnp.asarray(np.random.default_rng(0).permutation(4096), jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(3), (4096, 2))
    expected = x.at[:, 0].set(2.0 * x[:, 1])
    for threads in (1, 3):
        cpu_threads(threads)
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda r, x: f(r, x)[0])(rows, x)), np.asarray(expected))


def test_threaded_race_free_kernels_are_bitwise_single_threaded(cpu_threads):
    heat = warpnn.jax_kernel(heat_step)
    sq = warpnn.jax_kernel(scale_square)
    u = jax.random.normal(jax.random.PRNGKey(0), (37, 29))
    alpha = jnp.array([0.7])
    x = jax.random.normal(jax.random.PRNGKey(1), (1001,))

    def run():
        return jax.jit(lambda u, a, x: (heat(u, a, 0.2)[0], sq(x, 1.5)[0]))(u, alpha, x)

    single, threaded, n = _threaded_and_single(cpu_threads, run)
    assert n == 2
    jax.tree.map(np.testing.assert_array_equal, threaded, single)
    assert_close(threaded[0], heat_step_ref(u, alpha, 0.2))
    assert_close(threaded[1], scale_square_ref(x, 1.5))


def test_threaded_scatters_and_adjoints_reduce_partials(cpu_threads):
    heat = warpnn.jax_kernel(heat_step)
    fn = spring_forces_fn()
    pos, springs, stiffness, rest = springs_case(40)
    u = jax.random.normal(jax.random.PRNGKey(0), (33, 17))
    alpha = jnp.array([0.7])

    def loss(u, a, pos, k):
        return jnp.sum(heat(u, a, 0.2)[0] ** 2) + jnp.sum(fn(pos, springs, k, rest, 1.0) ** 2)

    def loss_ref(u, a, pos, k):
        return jnp.sum(heat_step_ref(u, a, 0.2) ** 2) + jnp.sum(spring_forces_ref(pos, springs, k, rest, 1.0) ** 2)

    def run():
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(u, alpha, pos, stiffness)

    single, threaded, n = _threaded_and_single(cpu_threads, run)
    assert n >= 4  # two forward, two adjoint launches split
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-5, atol=1e-5), threaded, single)
    ref = jax.value_and_grad(loss_ref, argnums=(0, 1, 2, 3))(u, alpha, pos, stiffness)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-4, atol=1e-4), threaded, ref)


def test_threaded_vmapped_batch_splits_by_element_through_the_twin(cpu_threads, monkeypatch):
    monkeypatch.setenv(_batched.BATCHED_ENV, "twin")
    test_threaded_vmapped_batch_splits_by_element(cpu_threads)


def test_threaded_vmapped_batch_splits_by_element(cpu_threads):
    fn = spring_forces_fn()
    pos, springs, stiffness, rest = springs_case(12)
    pos_b = pos[None] + jnp.linspace(0.0, 1.0, 7)[:, None, None]

    def run():
        return jax.jit(jax.vmap(jax.grad(lambda p: jnp.sum(fn(p, springs, stiffness, rest, 1.0) ** 2))))(pos_b)

    single, threaded, n = _threaded_and_single(cpu_threads, run)
    assert n == 2
    np.testing.assert_array_equal(threaded, single)  # batch elements are independent: no reduction


# --------------------------------------------------------------------------------------------------
# The row-loop twin: a CPU launch over 2+ dims loops over its last dim inside the kernel


@wp.kernel
def masked_square_sum(x: wp.array2d(dtype=float), w: wp.array(dtype=float), y: wp.array2d(dtype=float),
                      s: wp.array(dtype=float)):
    i, j = wp.tid()
    if x[i, j] < 0.0:
        return  # becomes the row loop's `continue`
    v = x[i, j] * w[j]
    y[i, j] = v * v
    wp.atomic_add(s, 0, v)


def masked_square_sum_ref(x, w):
    v = jnp.where(x < 0.0, 0.0, x * w[None, :])
    return v * v, jnp.sum(v)[None]


@wp.kernel
def stores_then_returns(a: wp.array2d(dtype=float), y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    if j == 0:
        y[i, 0] = 2.0 * a[i, 0]
        return  # the row loop had `continue` here: Warp's adjoint lost the store above (d/da[:, 0] was 0)
    y[i, j] = a[i, j] * a[i, j]


@wp.kernel
def ramp_3d(x: wp.array3d(dtype=float), y: wp.array3d(dtype=float)):
    i, j, k = wp.tid()
    y[i, j, k] = 2.0 * x[i, j, k] * x[i, j, k] + float(k)


@wp.kernel
def returns_in_a_loop(x: wp.array2d(dtype=float), y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    for k in range(3):
        if x[i, j] > float(k):
            return  # leaves the thread from inside a loop: no `continue` can say that
    y[i, j] = x[i, j]


@wp.kernel
def polynomial_2d(x: wp.array2d(dtype=float), p: wp.array(dtype=float), y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    y[i, j] = p[0] * x[i, j] + p[1] * x[i, j] * x[i, j] + p[0]


@wp.kernel
def reads_a_parameter_after_a_guard(x: wp.array2d(dtype=float), p: wp.array(dtype=float), y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    if x[i, j] < 0.0:
        return
    y[i, j] = p[0] * x[i, j]


@wp.kernel
def stores_into_its_parameter_through_a_row(x: wp.array2d(dtype=float), p: wp.array2d(dtype=float),
                                            y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    y[i, j] = p[0, 0] * x[i, j]
    row = p[1]
    row[0] = x[i, j]


@wp.kernel
def adds_into_its_parameter(x: wp.array2d(dtype=float), p: wp.array(dtype=float), y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    y[i, j] = p[0] * x[i, j]
    wp.atomic_add(p, 1, x[i, j])


def _row_loop_cases():
    k1, k2 = jax.random.split(jax.random.PRNGKey(5))
    heat, masked, ramp = (warpnn.jax_kernel(heat_step), warpnn.jax_kernel(masked_square_sum, num_outputs=2),
                          warpnn.jax_kernel(ramp_3d))
    u, alpha = jax.random.normal(k1, (19, 23)), jnp.array([0.7])
    x, w = jax.random.normal(k2, (13, 11)), jnp.linspace(-1.0, 2.0, 11)
    v = jax.random.normal(k1, (3, 5, 7))
    ramp_ref = lambda v: 2.0 * v * v + jnp.arange(7.0)  # noqa: E731
    poly, p = warpnn.jax_kernel(polynomial_2d), jnp.array([0.4, -1.3])
    stored = warpnn.jax_kernel(stores_then_returns)
    poly_ref = lambda x, p: p[0] * x + p[1] * x * x + p[0]  # noqa: E731
    return {  # kernel, forward, its pure-JAX reference, arguments (every one differentiated)
        "constant_index_reads_2d": (polynomial_2d, lambda x, p: poly(x, p)[0], poly_ref, (x, p)),
        "heat_2d": (heat_step, lambda u, a: heat(u, a, 0.2)[0], lambda u, a: heat_step_ref(u, a, 0.2), (u, alpha)),
        "early_return_and_atomics_2d": (
            masked_square_sum, lambda x, w: tuple(masked(x, w, output_dims={"y": x.shape, "s": 1})), masked_square_sum_ref, (x, w)),
        "3d": (ramp_3d, lambda v: ramp(v)[0], ramp_ref, (v,)),
        "work_before_a_return_2d": (stores_then_returns, lambda a: stored(a)[0],
                                    lambda a: jnp.where(jnp.arange(a.shape[1]) == 0, 2.0 * a, a * a), (x,)),
    }


@native
@pytest.mark.parametrize("case", sorted(_row_loop_cases()))
def test_row_loop_twin_matches_the_kernel_and_pure_jax(cpu_threads, monkeypatch, case):
    kernel, forward, reference, args = _row_loop_cases()[case]
    assert _batched.twin_of(kernel, False).inner_loop
    argnums = tuple(range(len(args)))
    loss = lambda f: lambda *a: sum(jnp.sum(jnp.sin(o)) for o in jax.tree.leaves(f(*a)))  # noqa: E731

    def run():
        lowered = jax.jit(forward).lower(*args)
        values = jax.jit(forward)(*args), jax.jit(jax.grad(loss(forward), argnums=argnums))(*args)
        return "twin_launch" in lowered.as_text(), jax.tree.map(np.asarray, values)

    cpu_threads(1)  # one thread: the loop alone, not the thread split
    looped, (fwd_loop, grad_loop) = run()
    monkeypatch.setenv(_batched.BATCHED_ENV, "0")  # the kernel itself
    jax.clear_caches()
    plain, (fwd_plain, grad_plain) = run()
    assert looped and not plain
    # The loop visits elements in the launch's order: the forward is bitwise the kernel's. The adjoint loop runs
    # backwards, so gradients accumulated by several elements (heat's neighbours, masked's w) add in another order.
    jax.tree.map(np.testing.assert_array_equal, fwd_loop, fwd_plain)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-6, atol=1e-6), grad_loop, grad_plain)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-5, atol=1e-5), fwd_loop, reference(*args))
    grad_ref = jax.grad(loss(reference), argnums=argnums)(*args)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol=1e-4, atol=1e-4), grad_loop, grad_ref)


def test_the_row_loop_reads_a_read_only_array_at_a_constant_index_once_per_row():
    """``alpha[0]`` read by every element is read once before the row loop (its adjoint then sums in a register), but
    only where every iteration reads it and nothing writes the array."""

    def hoisted(kernel):
        source = _batched.twin_of(kernel, False).kernel.adj.source
        return [line.strip() for line in source.splitlines() if line.strip().startswith(f"{_batched.BATCH_PREFIX}h")]

    assert hoisted(heat_step) == ["warpnn_h0 = alpha[0]"]
    assert hoisted(polynomial_2d) == ["warpnn_h0 = p[0]", "warpnn_h1 = p[1]"]
    assert hoisted(reads_a_parameter_after_a_guard) == []  # an element that returns early never reads it
    assert hoisted(adds_into_its_parameter) == []  # written by the kernel: its value may change during the launch
    assert hoisted(stores_into_its_parameter_through_a_row) == []  # a row view may be stored through
    assert hoisted(masked_square_sum) == []


@wp.kernel
def loops_over_its_own_range(x: wp.array2d(dtype=float), w: wp.array(dtype=float), y: wp.array2d(dtype=float)):
    # a dynamic loop whose range depends on the last coordinate, which the row twin turns into its own loop
    i, j = wp.tid()
    for k in range(j):
        wp.atomic_add(y, i, j, w[k] * x[i, j] * x[i, j])


@wp.kernel
def stores_in_a_stepped_loop(x: wp.array2d(dtype=float), a: wp.array(dtype=float), y: wp.array2d(dtype=float)):
    i, j = wp.tid()
    s = a[0]
    for p in range(j % 3, 3, 3):  # one iteration for every j
        y[i, j] = s * x[i, j] * x[i, j]


@pytest.mark.parametrize("case", ["triangle", "stepped"])
def test_a_row_loop_around_the_kernels_own_dynamic_loop_has_warps_gradients(case):
    """The row twin nests the kernel's own loops in its loop over the last dim: values and gradients against pure
    JAX and Warp's tape on the kernel itself."""
    x = jax.random.normal(jax.random.PRNGKey(0), (6, 7))
    ct = jax.random.normal(jax.random.PRNGKey(1), (6, 7))
    if case == "triangle":
        kernel, p = loops_over_its_own_range, jnp.arange(1.0, 8.0)
        ref = lambda x, w: jnp.concatenate([jnp.zeros(1), jnp.cumsum(w)])[:7][None, :] * x * x  # noqa: E731
    else:
        kernel, p = stores_in_a_stepped_loop, jnp.array([2.0])
        ref = lambda x, a: a[0] * x * x  # noqa: E731
    assert _batched.twin_of(kernel, False).inner_loop
    f = warpnn.jax_kernel(kernel)
    assert_close(f(x, p)[0], ref(x, p), 1e-5, 1e-5)
    got = jax.grad(lambda x, p: jnp.vdot(ct, f(x, p)[0]), (0, 1))(x, p)
    want = jax.grad(lambda x, p: jnp.vdot(ct, ref(x, p)), (0, 1))(x, p)
    xa, pa = wp.array(np.asarray(x), requires_grad=True), wp.array(np.asarray(p), requires_grad=True)
    ya = wp.zeros((6, 7), dtype=float, requires_grad=True)
    tape = wp.Tape()
    with tape:
        wp.launch(kernel, dim=(6, 7), inputs=[xa, pa, ya])
    tape.backward(grads={ya: wp.array(np.asarray(ct))})
    for ours, expected, warps in zip(got, want, (xa.grad.numpy(), pa.grad.numpy())):
        assert_close(ours, expected, 1e-5, 1e-4)
        assert_close(ours, warps, 1e-5, 1e-4)


def test_row_loop_needs_every_return_outside_loops():
    twin = _batched.twin_of(returns_in_a_loop, False)
    assert isinstance(twin, _batched.Twin) and not twin.inner_loop  # the plain row twin (thread slices) remains
    assert not _batched.twin_of(scale_square, False).inner_loop  # a 1-D launch has no inner dim to loop over


def test_the_row_loop_measures_arrays_before_its_loop_and_needs_arrays_kept_out_of_wp_funcs():
    """Warp's adjoint of ``u.shape`` resets the shape of ``u``'s adjoint (harmless once per thread, fatal in a loop
    with negative indices): the row loop reads ``u.shape[k]`` before it, and a kernel that hands an array to a
    ``@wp.func`` (whose adjoint may do the same through its reference) keeps the plain row twin."""

    def prologue(kernel):
        source = _batched.twin_of(kernel, False).kernel.adj.source
        return [line.strip() for line in source.splitlines() if line.strip().startswith(f"{_batched.BATCH_PREFIX}s")]

    assert _batched.twin_of(heat_step, False).inner_loop
    assert prologue(heat_step) == ["warpnn_s0 = u.shape[0]", "warpnn_s1 = u.shape[1]"]
    assert _batched.twin_of(shifted_rows, False).inner_loop
    assert prologue(shifted_rows) == ["warpnn_s0 = u.shape[0]"]
    twin = _batched.twin_of(shifted_rows_through_a_func, False)
    assert isinstance(twin, _batched.Twin) and not twin.inner_loop


def _kernels_of(module_names):
    import importlib

    found = {}
    for name in module_names:
        module = importlib.import_module(name)
        found.update({f"{name}.{k}": v for k, v in vars(module).items() if isinstance(v, wp.Kernel)})
    return found


def test_the_thread_split_analysis_never_sums_an_array_the_uses_analysis_finds_stored():
    """Two source analyses decide about a kernel's arrays: the slice analysis (which results a split CPU launch may
    sum through partial buffers) and the uses analysis (zeroing, in-out arrays, reverse mode), which also follows
    @wp.func calls. The fifth session's wrong sums came from the first missing a store the second saw. On every
    kernel of the suite, warpnn.kernels and Newton's solvers, the slice analysis on its own must already call
    every array the uses analysis finds stored (or cannot decide about) assigned. (A stored array may well be
    private: stored only at the thread's own rows, each slice writes its own.)"""
    from warpnn._signature import _slice_access, kernel_array_uses

    modules = ["tests.kernels_for_tests", "tests.checked_kernels", "tests.layer_kernels", "tests.test_batched",
               "tests.test_native", "tests.test_in_out", "tests.test_tiles", "tests.test_structs",
               "warpnn.kernels.cloth", "warpnn.kernels.mesh", "warpnn.kernels.pointcloud", "warpnn.kernels.tiles"]
    newton_modules = [f"newton._src.solvers.{m}" for m in (
        "semi_implicit.kernels_particle", "semi_implicit.kernels_contact", "semi_implicit.kernels_body",
        "xpbd.kernels", "featherstone.kernels")] + ["newton._src.sim.articulation"]
    try:
        import newton  # noqa: F401 - the [newton] extra: CI installs it
    except ImportError:
        newton_modules = []
    kernels = _kernels_of(modules + newton_modules)
    assert len(kernels) >= (120 if newton_modules else 60), len(kernels)
    stored_somewhere, disagreements = 0, []
    for key, kernel in kernels.items():
        uses = kernel_array_uses(kernel)  # every array parameter, whatever the inputs / outputs split
        names = list(uses)
        ndims = {a.label: a.type.ndim for a in kernel.adj.args if a.label in uses}
        private, assigned = _slice_access(kernel.adj.tree, names, ndims)
        stored = {n for n in names if uses[n].stores or uses[n].undecided is not None}
        stored_somewhere += bool(stored)
        undecided_private = {n for n in private if uses[n].undecided is not None}
        if stored - assigned or undecided_private:
            disagreements.append((key, sorted(stored - assigned), sorted(undecided_private)))
    assert not disagreements, disagreements
    assert stored_somewhere > 20  # the check had stores to look at


# The start of every pool script below (each runs in a subprocess: the pool's settings are read once per process).
_NATIVE_PRELUDE = """
import os, sys
import jax, jax.numpy as jnp, numpy as np, warp as wp
import warpnn
from warpnn._launch import LAUNCHER
from tests import kernels_for_tests as K
wp.config.quiet = True
if LAUNCHER.name != "native":
    print("SKIP native launcher unavailable"); sys.exit(0)
"""
# A 20-step scan of the heat stencil (`scan`) and its pure-JAX reference (`ref`), at a size whose launches split.
_HEAT_SCAN = """
heat = warpnn.jax_kernel(K.heat_step)
u, alpha = jax.random.normal(jax.random.PRNGKey(0), (96, 64)), jnp.array([0.3])
scan = jax.jit(lambda u: jax.lax.scan(lambda c, _: (heat(c, alpha, 0.2)[0], None), u, None, length=20)[0])
ref = jax.jit(lambda u: jax.lax.scan(lambda c, _: (K.heat_step_ref(c, alpha, 0.2), None), u, None, length=20)[0])
"""

_POOL_SCRIPT = _NATIVE_PRELUDE + _HEAT_SCAN + """
before = LAUNCHER.impl.twins.threaded_launches()
got = np.asarray(scan(u))
print("THREADED", LAUNCHER.impl.twins.threaded_launches() - before, "ERR", float(np.abs(got - np.asarray(ref(u))).max()))
"""



def _run_native_script(script: str, **variables: str) -> str:
    """The standard output of ``script`` run by a fresh CPU-only Python with ``variables`` set; skips the test where
    the script found no native launcher."""
    import subprocess
    import sys

    env = subprocess_env(JAX_PLATFORMS="cpu", **variables)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout)
    return out.stdout

_SHIFTED_ROWS_SCRIPT = _NATIVE_PRELUDE + """
u = jax.random.normal(jax.random.PRNGKey(0), (5, 64))
w = jax.random.normal(jax.random.PRNGKey(1), (5, 64))
want = np.asarray(jax.grad(lambda u: jnp.vdot(w, K.shifted_rows_ref(u)))(u))
for name in os.environ["KERNELS"].split(","):
    f = warpnn.jax_kernel(getattr(K, name))
    got = np.asarray(jax.jit(jax.grad(lambda u: jnp.vdot(w, f(u)[0])))(u))
    ua = wp.array(np.asarray(u), requires_grad=True, device="cpu")
    out = wp.zeros(u.shape, dtype=float, requires_grad=True, device="cpu")
    tape = wp.Tape()
    with tape:
        wp.launch(getattr(K, name), dim=u.shape, inputs=[ua, out], device="cpu")
    tape.backward(grads={out: wp.array(np.asarray(w), device="cpu")})
    print(name, "ERR", float(np.abs(got - want).max()), "TAPE", float(np.abs(got - ua.grad.numpy()).max()), flush=True)
"""


def test_a_row_loop_adjoint_through_negative_indices_and_a_measured_array_is_right():
    """The gradient of a kernel reading ``u[i - 1, j]`` (Warp wraps it at ``i = 0``) and measuring ``u`` in its body
    (``shifted_rows``) or in a ``@wp.func`` (``shifted_rows_through_a_func``), on the CPU where the row twin runs,
    against pure JAX and Warp's tape on the kernel itself. Before the row loop measured ``u`` first it wrote before
    the adjoint's buffer and the process died of heap corruption: a subprocess, so a regression fails this test
    rather than the suite (one for both kernels: the interpreter's start-up was most of each one's time)."""
    kernels = ["shifted_rows", "shifted_rows_through_a_func"]
    out = _run_native_script(_SHIFTED_ROWS_SCRIPT, KERNELS=",".join(kernels), WARPNN_CPU_THREADS="1")
    lines = {line.split()[0]: line.split() for line in out.splitlines() if " ERR " in f" {line} "}
    assert sorted(lines) == sorted(kernels), out
    for kernel in kernels:
        err, tape = (float(v) for v in lines[kernel][2::2])
        assert err < 1e-4 and tape < 1e-4, (kernel, out)


_OVERSUBSCRIBED_SCRIPT = """
import os
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before any thread starts: every thread inherits it
""" + _NATIVE_PRELUDE + _HEAT_SCAN + """
forces = K.spring_forces_fn()
pos, springs, stiffness, rest = K.springs_case(3000)
w = jax.random.normal(jax.random.PRNGKey(3), pos.shape)
grad = jax.jit(jax.grad(lambda p, k: jnp.vdot(w, forces(p, springs, k, rest)), argnums=(0, 1)))
grad_ref = jax.grad(lambda p, k: jnp.vdot(w, K.spring_forces_ref(p, springs, k, rest, 1.0)), argnums=(0, 1))
before = LAUNCHER.impl.twins.threaded_launches()
heats = [np.asarray(scan(u)) for _ in range(4)]
grads = [[np.asarray(g) for g in grad(pos, stiffness)] for _ in range(4)]
threaded = LAUNCHER.impl.twins.threaded_launches() - before
same = all(np.array_equal(h, heats[0]) for h in heats) and all(
    np.array_equal(a, b) for g in grads for a, b in zip(g, grads[0]))
err = max(float(np.abs(heats[0] - np.asarray(ref(u))).max()),
          *(float(np.abs(a - np.asarray(b)).max() / (np.abs(np.asarray(b)).max() + 1e-30)) for a, b in zip(grads[0], grad_ref(pos, stiffness))))
print("THREADED", threaded, "SAME", same, "ERR", err)
"""


# (XLA's pool is --slow on a CPU, 10 s of CI's suite; warpnn's, the default, runs there)
@pytest.mark.parametrize("pool", ["warpnn", pytest.param("xla", marks=pytest.mark.slow)])
def test_split_launches_with_more_threads_than_cpus_are_reproducible_and_right(pool):
    """Six pool threads on one CPU: any thread may run any slice (the caller those no worker has claimed yet), and a
    slice's partial buffer belongs to the slice, so every run sums the same partials in the same order: the heat scan
    and a spring-force scatter's gradient come out bitwise the same four times, and match pure JAX. A worker that
    wakes late for a launch claims nothing of it (subprocess: the pool is per process). On XLA's pool, where the
    runners handed over may wait behind XLA's own work, the caller covers what they have not claimed."""
    import os

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs os.sched_setaffinity (Linux)")
    stdout = _run_native_script(_OVERSUBSCRIBED_SCRIPT, WARPNN_CPU_THREADS="6", WARPNN_CPU_MIN_WORK="1",
                                WARPNN_CPU_POOL=pool)
    words = stdout.split("THREADED")[-1].split()
    assert int(words[0]) >= 4 * 20 + 4, stdout  # the scans' launches and the gradients' adjoints split
    assert words[2] == "True", stdout
    assert float(words[4]) < 1e-5, stdout


_BIG_ZEROED_SCRIPT = _NATIVE_PRELUDE + """
f = warpnn.jax_kernel(K.scale_square, output_dims=300_001)  # 1.2 MB, of which the launch writes the first 1000
call = jax.jit(lambda x: f(x, 2.0, launch_dims=1000)[0])
x = jnp.linspace(-1.0, 1.0, 1000)
bad = 0
for k in range(6):
    junk = jnp.full((300_001,), float(k + 1)) * 3.0  # freed buffers full of non-zeros for XLA to hand out again
    junk.block_until_ready(); del junk
    y = np.asarray(call(x))
    bad += int(np.count_nonzero(y[1000:])) + int(not np.allclose(y[:1000], 2.0 * np.asarray(x) ** 2))
print("BAD", bad)
"""


def test_a_big_cpu_result_is_zeroed_whole_on_every_call():
    """Every element of a 1.2 MB result that the launch does not write is 0, call after call, whatever buffer XLA
    reuses (subprocess: four pool threads). It guarded a pool-threaded zeroing that did not pay (noise-level on 16
    cores) and was taken out again; it keeps any later split of the zeroing honest."""
    stdout = _run_native_script(_BIG_ZEROED_SCRIPT, WARPNN_CPU_THREADS="4")
    assert stdout.split("BAD")[-1].split()[0] == "0", stdout


# (sleeping at once and polling long on warpnn's pool, a short poll on XLA's: five settings took 29 s of CI's suite)
@pytest.mark.parametrize("spin_us,pool", [("0", "warpnn"), ("100000", "warpnn"), ("100", "xla")])
def test_the_cpu_pool_hands_over_launches_with_and_without_polling(spin_us, pool):
    """$WARPNN_CPU_SPIN_US: how long idle workers (and the caller) poll before sleeping. Every setting, from sleeping
    at once to polling for 0.1 s, runs a scan's back-to-back split launches to the same result, on warpnn's pool and
    on XLA's (subprocess: the setting is read once per process)."""
    stdout = _run_native_script(_POOL_SCRIPT, WARPNN_CPU_SPIN_US=spin_us, WARPNN_CPU_THREADS="3", WARPNN_CPU_MIN_WORK="1",
                                WARPNN_CPU_POOL=pool)
    words = stdout.split("THREADED")[-1].split()
    assert int(words[0]) == 20, stdout  # every launch of the scan split across the pool
    assert float(words[2]) < 1e-5, stdout
