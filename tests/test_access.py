"""The access facts (_access.py): warpnn's walk against Warp's code generator, and what the bridge does with them.

Each case here was silently wrong before the walk followed views into calls and before Warp's own facts checked
it: a launch whose only write goes through a row view, an input written that way, gradients of outputs written
through a view or a tile store. The corpus test runs the cross-check over code nobody here wrote.
"""

import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn._access import ArrayUse, codegen_access, reconcile, walk_array_uses
from warpnn._signature import kernel_array_uses

from .helpers import ROOT, assert_close, subprocess_env, warp_config_kept


@wp.func
def store_in_func(out: wp.array(dtype=float), i: int, v: float):
    out[i] = v


@wp.kernel
def atomic_through_row_view(x: wp.array2d(dtype=float), acc: wp.array2d(dtype=float)):
    w, j = wp.tid()
    wp.atomic_add(acc[w], j, x[w, j])  # mujoco_warp's pattern: an atomic on a view of the world's row


@wp.kernel
def store_through_row_view(x: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    row = out[i]
    row[j] = x[i, j] * 2.0


@wp.kernel
def tile_rows(x: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i = wp.tid()
    t = wp.tile_load(x[i], shape=4)
    wp.tile_store(out[i], t * t)


@wp.kernel
def store_via_func(x: wp.array(dtype=float), out: wp.array(dtype=float)):
    i = wp.tid()
    store_in_func(out, i, x[i] * 3.0)


@wp.kernel
def accumulate_into_input_row(acc: wp.array2d(dtype=float), x: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    w, j = wp.tid()
    wp.atomic_add(acc[w], j, x[w, j])
    out[w, j] = x[w, j]


CASES = [atomic_through_row_view, store_through_row_view, tile_rows, store_via_func, accumulate_into_input_row]


@pytest.mark.parametrize("kernel", CASES, ids=lambda k: k.key)
def test_walk_places_every_write_warp_finds(kernel):
    uses = kernel_array_uses(kernel)
    facts = codegen_access(kernel)
    assert facts is not None
    for name, (_, writes) in facts.items():
        assert uses[name].undecided is None, (name, uses[name].undecided)
        if writes:
            assert uses[name].writes, name
    # what Warp's codegen does not mark (tiles), the walk does
    assert uses["out" if "out" in uses else "acc"].writes


def test_views_and_tiles_classified():
    assert [a.kind for a in kernel_array_uses(atomic_through_row_view)["acc"].accesses] == ["accumulate"]
    assert kernel_array_uses(atomic_through_row_view)["acc"].viewed
    assert not kernel_array_uses(atomic_through_row_view)["x"].writes
    assert [a.kind for a in kernel_array_uses(tile_rows)["out"].accesses] == ["store"]
    assert not kernel_array_uses(tile_rows)["x"].writes
    via = kernel_array_uses(store_via_func)["out"].written_in_function
    assert via is not None and via.via == "store_in_func"


def test_reconcile_makes_an_unplaced_write_undecided():
    """A write Warp's codegen finds and the walk missed is never taken as 'not written'."""
    walked = {"a": ArrayUse("a"), "b": ArrayUse("b")}
    out = reconcile(walked, {"a": (False, True), "b": (False, False)})
    assert out["a"].undecided and "Warp's code generator" in out["a"].undecided
    assert out["a"].writes and out["a"].reads and out["a"].in_place_problem() is not None
    assert out["b"].undecided is None and not out["b"].writes


def test_input_written_through_a_row_view_is_refused():
    x = jnp.ones((2, 4))
    with pytest.raises(TypeError, match="writes its input array 'acc'"):
        warpnn.jax_kernel(accumulate_into_input_row)(x, x, launch_dims=(2, 4))


def _tape_vjp(kernel, x, cotangent, dims, tiled_block=None):
    xw = wp.array(np.asarray(x), dtype=float, requires_grad=True)
    out = wp.zeros(cotangent.shape, dtype=float, requires_grad=True)
    tape = wp.Tape()
    with tape:
        if tiled_block:
            wp.launch_tiled(kernel, dim=dims[:-1], inputs=[xw], outputs=[out], block_dim=tiled_block)
        else:
            wp.launch(kernel, dims, inputs=[xw], outputs=[out])
    tape.backward(grads={out: wp.array(np.asarray(cotangent), dtype=float)})
    return out.numpy(), xw.grad.numpy()


# (tile_rows: launch_dims carry the block, as wp.launch_tiled(dim=2, block_dim=4) launches (2, 4) threads)
@pytest.mark.parametrize("kernel, dims, block", [(atomic_through_row_view, (2, 4), None),
                                                 (store_through_row_view, (2, 4), None), (tile_rows, (2, 4), 4)],
                         ids=["atomic-row-view", "store-row-view", "tile-store-row"])
def test_gradients_through_views_equal_wp_tape(kernel, dims, block):
    x = jnp.arange(1.0, 9.0).reshape(2, 4)
    ct = jnp.arange(8.0).reshape(2, 4) - 3.0
    f = warpnn.jax_kernel(kernel, block_dim=block) if block else warpnn.jax_kernel(kernel)
    call = lambda x: f(x, launch_dims=dims, output_dims=(2, 4))[0]  # noqa: E731
    want_out, want_grad = _tape_vjp(kernel, x, ct, dims, block)
    out, vjp = jax.vjp(jax.jit(call), x)
    assert_close(out, want_out)
    assert_close(vjp(ct)[0], want_grad)
    assert np.abs(want_grad).max() > 0
    assert_close(jax.jit(jax.grad(lambda x: (call(x) * ct).sum()))(x), want_grad)


@wp.func
def add_in_func(acc: wp.array(dtype=float), i: int, v: float):
    wp.atomic_add(acc, i, v)


@wp.kernel
def in_out_via_func(x: wp.array(dtype=float), acc: wp.array(dtype=float)):
    i = wp.tid()
    add_in_func(acc, i, x[i] * x[i])


def test_results_written_inside_a_func_differentiate_like_wp_tape_and_leave_xla_buffers_alone():
    """Warp's adjoint runs each @wp.func call's forward again, stores included, into the array's primal slot.
    That slot was the cotangent (a pure output's): the gradient was wrong under jit and the caller's cotangent
    array was overwritten. Now each such result gets a buffer of its own (KernelSignature.replay_buffers)."""
    x = jnp.arange(1.0, 5.0)
    ct = jnp.array([1.0, -2.0, 0.5, 3.0])
    ct_before = np.asarray(ct).copy()
    f = warpnn.jax_kernel(store_via_func)
    call = lambda x: f(x, launch_dims=4)[0]  # noqa: E731
    assert_close(call(x), 3.0 * np.asarray(x))
    out, vjp = jax.vjp(jax.jit(call), x)
    assert_close(jax.jit(vjp)(ct)[0], 3.0 * ct_before)
    assert_close(jax.jit(jax.grad(lambda x: (call(x) * ct).sum()))(x), 3.0 * ct_before)
    np.testing.assert_array_equal(np.asarray(ct), ct_before)
    # an in-out array accumulated inside a @wp.func: its value before the launch must survive the adjoint
    g = warpnn.jax_kernel(in_out_via_func, num_outputs=1, in_out_argnames=["acc"])
    acc0 = jnp.array([10.0, 20.0, 30.0, 40.0])
    loss = lambda x, acc: (g(x, acc, launch_dims=4)[0] * ct).sum()  # noqa: E731
    dx, dacc = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, acc0)
    assert_close(dx, 2.0 * np.asarray(x) * ct_before)
    assert_close(dacc, ct_before)
    np.testing.assert_array_equal(np.asarray(acc0), [10.0, 20.0, 30.0, 40.0])
    xw = wp.array(np.asarray(x), dtype=float, requires_grad=True)
    accw = wp.array(np.asarray(acc0), dtype=float, requires_grad=True)
    tape = wp.Tape()
    with tape:
        wp.launch(in_out_via_func, 4, inputs=[xw], outputs=[accw])
    tape.backward(grads={accw: wp.array(ct_before, dtype=float)})
    assert_close(dx, xw.grad.numpy())


# --------------------------------------------------------------------------------------------------
# The cross-check over real Warp code


def _kernels_in(package: str, skip=("tests", "viewer", "benchmarks", "fem")) -> list:
    """Every non-generic kernel defined at module level in ``package`` (Warp's config put back after importing it:
    ``helpers.warp_config_kept``)."""
    with warp_config_kept():
        return _import_kernels(package, skip)


def _import_kernels(package: str, skip) -> list:
    pkg = importlib.import_module(package)
    root = os.path.dirname(pkg.__file__)
    kernels = {}
    for dirpath, _, files in os.walk(root):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), root)[:-3].replace(os.sep, ".")
            name = package if rel == "__init__" else f"{package}.{rel.removesuffix('.__init__')}"
            if any(s in name.split(".") for s in skip):
                continue
            try:
                module = importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - an optional dependency of one module: its kernels are skipped
                continue
            for value in vars(module).values():
                if isinstance(value, wp.Kernel) and not value.is_generic:
                    kernels[id(value)] = value
    return list(kernels.values())


def cross_check(kernels) -> dict:
    """Counts of kernels and arrays, and every (kernel, array, access) that Warp finds and the walk misses."""
    from warpnn._signature import _kernel_specs

    kernels_checked, arrays, missed = 0, 0, []
    for kernel in kernels:
        facts = codegen_access(kernel)
        if facts is None:
            continue
        uses = walk_array_uses(kernel, _kernel_specs(kernel))
        kernels_checked += 1
        for name, (reads, writes) in facts.items():
            arrays += 1
            use = uses[name]
            if writes and not use.writes:
                missed.append((kernel.key, name, "write"))
            if reads and not use.reads:
                missed.append((kernel.key, name, "read"))
    return {"kernels": kernels_checked, "arrays": arrays, "missed": missed}


NEWTON_IN_CI = ["newton._src.solvers.semi_implicit", "newton._src.solvers.featherstone", "newton._src.solvers.xpbd",
                "newton._src.solvers.vbd"]  # the solvers warpnn's tests trace; --corpus-full: all of newton._src.solvers
CORPUS = [("newton._src.solvers", 60), ("mujoco_warp", 200), ("warp.examples", 60)]


@pytest.mark.parametrize("package, at_least", CORPUS, ids=[p for p, _ in CORPUS])
def test_walk_agrees_with_warp_codegen_on_real_code(package, at_least, request):
    """No kernel array that Warp's code generator finds written (or read) and warpnn's walk does not: measured on
    2026-12-03 over Newton 1.8's 1,453 kernels (12,118 arrays), MuJoCo Warp 4.0's 245 (2,321) and warp.examples'
    111 (299): 0 missed. CI checks the Newton solvers warpnn's tests trace, MuJoCo Warp and the examples other
    than warp.fem's; --corpus-full checks all of Newton's solvers."""
    pytest.importorskip(package)  # (the GPU machine's Warp has no warp.examples)
    full = request.config.getoption("--corpus-full", default=False)
    packages = NEWTON_IN_CI if package == "newton._src.solvers" and not full else [package]
    result = cross_check([k for p in packages for k in _kernels_in(p)])
    assert result["kernels"] >= at_least, result["kernels"]
    assert result["missed"] == [], result["missed"][:20]


@pytest.mark.parametrize("launcher", ["native", "python"])
def test_replay_buffers_under_vmap_and_both_launchers(launcher):
    from warpnn._launch import use_launcher

    f = warpnn.jax_kernel(store_via_func)
    xs = jnp.arange(1.0, 9.0).reshape(2, 4)
    cts = jnp.array([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, 2.0, -1.0]])
    with use_launcher(launcher):
        grads = jax.jit(jax.vmap(jax.grad(lambda x, c: (f(x, launch_dims=4)[0] * c).sum())))(xs, cts)
    assert_close(grads, 3.0 * np.asarray(cts))


# --------------------------------------------------------------------------------------------------
# Where Warp's own adjoint is silently wrong. Warp's adjoint does not run a dynamic loop again before its reverse
# pass, so a value the loop changes is seen, after the loop and inside its reverse pass, as it was before the
# loop; an iteration that leaves early loses its adjoint; a builtin Warp has no adjoint for gives zero. Reverse
# mode takes the loops whose adjoint does not depend on those values and refuses the others, naming the place;
# each refusal here comes with the evidence (wp.Tape's gradient differs from the pure-JAX reference).


@wp.kernel
def loop_sum_of_squares(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    c = int(0)  # a counter no statement reads
    for i in range(n):
        if x[t, i] > 1.0:
            s += x[t, i] * x[t, i]
        c += 1
    out[t] = s


@wp.kernel
def loop_nested_sum(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    for i in range(n):
        for j in range(n):
            s = s + x[t, i] * x[t, j]
    out[t] = s - x[t, 0]


@wp.kernel
def loop_constant_range_norm(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    for i in range(4):  # a constant range: Warp unrolls it, nothing is carried
        s += x[t, i] * x[t, i]
    out[t] = wp.sqrt(s)


@wp.kernel
def loop_values_of_one_iteration(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    r = float(0.0)
    last_big = float(0.0)
    for i in range(n):
        r = x[t, i] * 2.0  # set at the top of each iteration: the adjoint's replay of the iteration sets it again
        r = r * x[t, i]
        s += r * r
        if x[t, i] > 1.0:
            last_big = x[t, i]  # never read in the loop
    out[t] = s + r + last_big  # a sum stored: its adjoint does not read r or last_big


@wp.kernel
def loop_value_set_in_a_branch(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    w = float(0.0)
    for i in range(n):
        if x[t, i] > 1.0:
            w = 2.0 * x[t, i]  # set in the branch that reads it (the point cloud kernel's neighbour weight)
            s += w * w
    out[t] = s


@wp.func
def product_of_row(x: wp.array2d(dtype=float), t: int, n: int):
    p = float(1.0)
    for i in range(n):
        p = p * x[t, i]
    return p


@wp.func
def product_of_row_by_hand(x: wp.array2d(dtype=float), t: int, n: int):
    p = float(1.0)
    for i in range(n):
        p = p * x[t, i]
    return p


@wp.func_grad(product_of_row_by_hand)
def adj_product_of_row_by_hand(x: wp.array2d(dtype=float), t: int, n: int, adj_ret: float):
    p = product_of_row_by_hand(x, t, n)
    for i in range(n):
        wp.adjoint[x][t, i] += adj_ret * p / x[t, i]


@wp.kernel
def loop_in_a_func(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    out[t] = product_of_row(x, t, n)


@wp.kernel
def loop_in_a_func_with_its_own_gradient(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    out[t] = product_of_row_by_hand(x, t, n)  # Warp uses adj_product_of_row_by_hand, not the loop's adjoint


@wp.kernel
def loop_reads_an_earlier_iteration(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    v = float(0.0)
    s = float(0.0)
    for i in range(n):
        if x[t, i] > 1.0:
            v = x[t, i] * 2.0
        s += v * v  # v may come from an earlier iteration
    out[t] = s


@wp.kernel
def loop_skips_with_continue(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    for i in range(n):
        if x[t, i] > 1.0:
            s += x[t, i] * x[t, i]
            continue  # Warp's adjoint of this iteration loses the line above
        s += 2.0 * x[t, i]
    out[t] = s


@wp.kernel
def loop_constant_range_continue(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    for i in range(4):  # unrolled: Warp lowers the continue to a condition
        if x[t, i] > 1.0:
            s += x[t, i] * x[t, i]
            continue
        s += 2.0 * x[t, i]
    out[t] = s


@wp.kernel
def loop_stops_with_break(x: wp.array2d(dtype=float), n: int, out: wp.array2d(dtype=float)):
    t = wp.tid()
    for i in range(n):
        out[t, i] = x[t, i] * x[t, i]
        if x[t, i] > 1.2:
            break


@wp.kernel
def loop_sum_scaled_in_place(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    for i in range(n):
        s += x[t, i] * x[t, i]
    s *= x[t, 0]  # reads s after the loop (mujoco_warp's `com /= mass`)
    out[t] = s


@wp.kernel
def through_frac(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    out[t] = wp.frac(3.0 * x[t, 0]) + x[t, n - 1]  # Warp has no adjoint for frac: d/dx[t, 0] would be 0


@wp.func
def softened_inverse(r: float):
    return 1.0 / (r + 0.1)


@wp.kernel
def through_grad_call(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    out[t] = wp.grad(softened_inverse)(x[t, 0]) + x[t, n - 1]  # forward-only in Warp: d/dx[t, 0] would be 0


@wp.func
def repulsion(r: float):
    return -wp.grad(softened_inverse)(r)  # (warp.examples' particle repulsion computes its forces so)


@wp.kernel
def grad_call_in_a_func(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    out[t] = repulsion(x[t, 0]) + x[t, n - 1]  # Warp makes no reverse call of a function that calls wp.grad


@wp.func
def repulsion_with_its_gradient(r: float):
    return -wp.grad(softened_inverse)(r)


@wp.func_grad(repulsion_with_its_gradient)
def adj_repulsion_with_its_gradient(r: float, adj_ret: float):
    wp.adjoint[r] += adj_ret * (-2.0) / ((r + 0.1) * (r + 0.1) * (r + 0.1))


@wp.kernel
def grad_call_in_a_func_with_its_gradient(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    out[t] = repulsion_with_its_gradient(x[t, 0]) + x[t, n - 1]  # Warp skips even the @wp.func_grad


@wp.kernel
def tile_row_max(x: wp.array2d(dtype=float), out: wp.array(dtype=float)):
    i = wp.tid()
    wp.tile_store(out, wp.tile_max(wp.tile_load(x[i], shape=4)), offset=i)  # no adjoint for tile_max either


@wp.kernel
def loop_norm(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    for i in range(n):
        s += x[t, i] * x[t, i]
    out[t] = wp.sqrt(s)  # the adjoint of sqrt reads s: Warp's adjoint sees 0 here (an infinite gradient)


@wp.kernel
def loop_running_product(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    p = float(1.0)
    for i in range(n):
        p = p * x[t, i]
    out[t] = p


@wp.kernel
def loop_two_sums_multiplied(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    q = float(0.0)
    for i in range(n):
        s += x[t, i] * x[t, i]
        q = q + 2.0 * x[t, i]
    out[t] = s * q


@wp.kernel
def loop_counter_indexes(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    c = int(0)
    for i in range(n):
        s += x[t, i] * x[t, i]
        c += 1
    out[t] = s + x[t, c // 2]


@wp.kernel
def loop_flag_guards_the_store(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    found = bool(False)
    s = float(0.0)
    for i in range(n):
        if x[t, i] > 1.0:
            found = True
        s += x[t, i] * x[t, i]
    if found:
        out[t] = s


@wp.kernel
def while_sum(x: wp.array2d(dtype=float), n: int, out: wp.array(dtype=float)):
    t = wp.tid()
    s = float(0.0)
    i = int(0)
    while i < n:
        s += x[t, i] * x[t, i]
        i += 1
    out[t] = s


def _square_sum(x):
    return jnp.sum(x * x, 1)


def _last_big(x):
    """Per row, the last element above 1 (0 if none)."""
    return jax.vmap(lambda row: jax.lax.fori_loop(0, row.size, lambda i, b: jnp.where(row[i] > 1.0, row[i], b), 0.0))(x)


def _squares_of_last_big_doubled(row):
    def step(carry, xi):
        v, s = carry
        v = jnp.where(xi > 1.0, 2.0 * xi, v)
        return (v, s + v * v), None
    return jax.lax.scan(step, (0.0, 0.0), row)[0][1]


WARP_ADJOINT_RIGHT = {
    loop_sum_of_squares: lambda x: jnp.sum(jnp.where(x > 1.0, x * x, 0.0), 1),
    loop_nested_sum: lambda x: jnp.sum(x, 1) ** 2 - x[:, 0],
    loop_constant_range_norm: lambda x: jnp.sqrt(_square_sum(x)),
    loop_value_set_in_a_branch: lambda x: jnp.sum(jnp.where(x > 1.0, 4.0 * x * x, 0.0), 1),
    loop_constant_range_continue: lambda x: jnp.sum(jnp.where(x > 1.0, x * x, 2.0 * x), 1),
    loop_values_of_one_iteration: lambda x: jnp.sum(4.0 * x**4, 1) + 2.0 * x[:, -1] ** 2 + _last_big(x),
}
WARP_ADJOINT_WRONG = {  # kernel: (pure-JAX reference, what the refusal names)
    loop_norm: (lambda x: jnp.sqrt(_square_sum(x)), "changes 's' and line"),
    loop_running_product: (lambda x: jnp.prod(x, 1), "reads the value an earlier iteration left in it"),
    loop_two_sums_multiplied: (lambda x: _square_sum(x) * jnp.sum(2.0 * x, 1), "changes 'q'"),
    loop_counter_indexes: (lambda x: _square_sum(x) + x[:, 2], "changes 'c'"),
    loop_flag_guards_the_store: (lambda x: jnp.where(jnp.any(x > 1.0, 1), _square_sum(x), 0.0), "changes 'found'"),
    while_sum: (_square_sum, "the while loop at line"),
    loop_in_a_func: (lambda x: jnp.prod(x, 1), "in @wp.func 'product_of_row'"),
    loop_sum_scaled_in_place: (lambda x: _square_sum(x) * x[:, 0], "changes 's' and line"),
    through_frac: (lambda x: jnp.mod(3.0 * x[:, 0], 1.0) + x[:, -1], "calls wp.frac (line"),
    through_grad_call: (lambda x: -1.0 / (x[:, 0] + 0.1) ** 2 + x[:, -1], "calls wp.grad(softened_inverse) (line"),
    grad_call_in_a_func: (lambda x: 1.0 / (x[:, 0] + 0.1) ** 2 + x[:, -1], "@wp.func 'repulsion' calls wp.grad"),
    grad_call_in_a_func_with_its_gradient: (lambda x: 1.0 / (x[:, 0] + 0.1) ** 2 + x[:, -1],
                                            "@wp.func 'repulsion_with_its_gradient' calls wp.grad"),
    loop_skips_with_continue: (lambda x: jnp.sum(jnp.where(x > 1.0, x * x, 2.0 * x), 1), "leaves an iteration early"),
    loop_reads_an_earlier_iteration: (lambda x: jax.vmap(_squares_of_last_big_doubled)(x), "changes 'v' and line"),
}
_LOOP_X = np.random.default_rng(0).uniform(0.5, 1.5, (3, 4)).astype(np.float32)


def _loop_call(kernel):
    f = warpnn.jax_kernel(kernel, num_outputs=1)
    return lambda x: f(x, 4, launch_dims=3)[0]


def _loop_tape_grad(kernel):
    xw = wp.array(_LOOP_X, dtype=float, requires_grad=True)
    out = wp.zeros(3, dtype=float, requires_grad=True)
    tape = wp.Tape()
    with tape:
        wp.launch(kernel, 3, inputs=[xw, 4], outputs=[out])
    tape.backward(grads={out: wp.ones(3, dtype=float)})
    return xw.grad.numpy()


@pytest.mark.parametrize("kernel", list(WARP_ADJOINT_RIGHT), ids=lambda k: k.key)
def test_loops_whose_adjoint_is_right_differentiate(kernel):
    ref = WARP_ADJOINT_RIGHT[kernel]
    x = jnp.asarray(_LOOP_X)
    want = jax.grad(lambda x: ref(x).sum())(x)
    assert_close(jax.jit(jax.grad(lambda x: _loop_call(kernel)(x).sum()))(x), want)
    assert_close(_loop_tape_grad(kernel), want)


def test_a_loop_under_a_custom_gradient_is_not_judged():
    """Warp differentiates a @wp.func with a @wp.func_grad through that gradient, never through the generated
    adjoint of its loop: the loop is no reason to refuse (mujoco_warp and Newton write such functions)."""
    from warpnn._access import codegen_facts

    assert codegen_facts(loop_in_a_func_with_its_own_gradient).adjoint_problems == ()
    assert codegen_facts(loop_in_a_func).adjoint_problems != ()
    assert_close(_loop_tape_grad(loop_in_a_func_with_its_own_gradient),
                 jax.grad(lambda x: jnp.prod(x, 1).sum())(jnp.asarray(_LOOP_X)))


@pytest.mark.parametrize("kernel", list(WARP_ADJOINT_WRONG), ids=lambda k: k.key)
def test_kernels_whose_warp_adjoint_is_wrong_are_refused_naming_the_place(kernel, monkeypatch):
    """(With the unrolling limit below the loops' 4 iterations: the loops over the argument `n` differentiate through
    their unrolled twin by default, tests/test_unrolled.py.)"""
    monkeypatch.setenv("WARPNN_MAX_UNROLL", "2")
    ref, named = WARP_ADJOINT_WRONG[kernel]
    x = jnp.asarray(_LOOP_X)
    call = _loop_call(kernel)
    assert_close(call(x), ref(x))  # the forward pass is right and stays available
    with pytest.raises(TypeError, match=f"Kernel '{kernel.key}' cannot be differentiated") as refusal:
        jax.grad(lambda x: call(x).sum())(x)
    assert named in str(refusal.value) and ("Warp's adjoint" in str(refusal.value) or "no adjoint" in str(refusal.value))
    # the evidence that refusing is right: Warp's own tape gets this gradient wrong
    want = np.asarray(jax.grad(lambda x: ref(x).sum())(x))
    got = _loop_tape_grad(kernel)
    assert not np.allclose(got, want, rtol=1e-3, atol=1e-3), (got, want)


@wp.kernel
def loop_returns_from_the_thread(x: wp.array2d(dtype=float), n: int, out: wp.array2d(dtype=float)):
    t = wp.tid()
    for i in range(n):
        out[t, i] = x[t, i] * x[t, i]
        if x[t, i] > 1.2:
            return  # wp.Tape's reverse pass still runs the iterations after this one


def test_a_tile_builtin_without_adjoint_is_a_problem_of_the_kernel():
    from warpnn._access import codegen_facts

    problems = codegen_facts(tile_row_max).adjoint_problems
    assert len(problems) == 1 and "calls wp.tile_max" in problems[0], problems


@pytest.mark.parametrize("kernel, exit", [(loop_stops_with_break, "break"), (loop_returns_from_the_thread, "return")],
                         ids=["break", "return"])
def test_a_loop_that_stops_early_is_refused(kernel, exit, monkeypatch):
    """(A `return` from a loop Warp unrolls is straight-line code: unrolled by default, tests/test_unrolled.py.)"""
    monkeypatch.setenv("WARPNN_MAX_UNROLL", "2")
    f = warpnn.jax_kernel(kernel, num_outputs=1)
    x = jnp.asarray(_LOOP_X)
    # (the elements after the exit keep the zeros the output starts from)
    reached = np.cumsum(np.cumsum(np.asarray(x) > 1.2, axis=1), axis=1) <= 1
    assert_close(f(x, 4, launch_dims=3, output_dims=(3, 4))[0], np.where(reached, np.asarray(x) ** 2, 0.0))
    with pytest.raises(TypeError, match=f"leaves an iteration early .`{exit}`"):
        jax.grad(lambda x: f(x, 4, launch_dims=3, output_dims=(3, 4))[0].sum())(x)


def test_jax_callable_refuses_a_loop_whose_tape_gradient_is_wrong():
    def norms(x: wp.array2d(dtype=float), out: wp.array(dtype=float)):
        wp.launch(loop_norm, 3, inputs=[x, 4], outputs=[out])

    f = warpnn.jax_callable(norms, num_outputs=1)
    x = jnp.asarray(_LOOP_X)
    assert_close(f(x, output_dims={"out": 3})[0], jnp.sqrt(_square_sum(x)))
    with pytest.raises(RuntimeError, match="kernel 'loop_norm' reads arrays that have gradients.*dynamic for loop"):
        # (on a GPU the error reaches Python when the result does: block on it)
        jax.block_until_ready(jax.grad(lambda x: f(x, output_dims={"out": 3})[0].sum())(x))


@wp.kernel
def flags_refilled(x: wp.array(dtype=float), flags: wp.array(dtype=int), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i] * x[i]
    if x[i] > 1.0:
        flags[i] = flags[i] | 1
    if x[i] > 2.0:
        flags[i] = flags[i] | 2  # reads what the line above may have written: only into the flags again


@wp.kernel
def flags_steer_the_result(x: wp.array(dtype=float), flags: wp.array(dtype=int), y: wp.array(dtype=float)):
    i = wp.tid()
    if x[i] > 1.0:
        flags[i] = 1
    if flags[i] == 1:  # the adjoint's replay would read the flag as it was before the launch
        y[i] = x[i] * x[i]


def test_integer_flags_read_after_writing_refuse_reverse_mode_only_where_they_steer_something():
    """mujoco_warp's `overflow` flags: read after the launch wrote them, but only to set more bits."""
    x = jnp.array([0.5, 1.5, 2.5])
    flags = jnp.zeros(3, jnp.int32)
    f = warpnn.jax_kernel(flags_refilled, num_outputs=2, in_out_argnames=["flags"])
    new_flags, y = f(x, flags)
    np.testing.assert_array_equal(np.asarray(new_flags), [0, 1, 3])
    assert_close(jax.grad(lambda x: f(x, flags)[1].sum())(x), 2.0 * x)
    g = warpnn.jax_kernel(flags_steer_the_result, num_outputs=2, in_out_argnames=["flags"])
    with pytest.raises(TypeError, match="array 'flags': line .* reads it after the kernel wrote it"):
        jax.grad(lambda x: g(x, flags)[1].sum())(x)


@wp.kernel
def doubled_in_arrival_order(count: wp.array(dtype=int), x: wp.array(dtype=float), out: wp.array(dtype=float)):
    # each thread takes the next free slot (mujoco_warp allocates contacts and sparse rows so)
    i = wp.tid()
    slot = wp.atomic_add(count, 0, 1)
    out[slot] = 2.0 * x[i]


# wp.Tape over doubled_in_arrival_order, in a subprocess: its adjoint stores through a slot the atomic never set
# there, which at clang -O0 is garbage and crashed the process (a segmentation fault, 2026-12-07)
_TAPE_OF_ARRIVAL_ORDER = """
import numpy as np, warp as wp
from tests.test_access import doubled_in_arrival_order
weights = np.array([1.0, 10.0, 100.0, 1000.0], np.float32)
count, out = wp.zeros(1, dtype=int), wp.zeros(4, dtype=float, requires_grad=True)
x = wp.array(np.arange(1.0, 5.0, dtype=np.float32), requires_grad=True)
tape = wp.Tape()
with tape:
    wp.launch(doubled_in_arrival_order, 4, [count, x, out])
tape.backward(grads={out: wp.array(weights)})
right = np.empty(4, np.float32)
right[np.argsort(out.numpy())] = 2.0 * weights  # (the thread that wrote each slot: out[slot] = 2 x[thread])
print("TAPE", "right" if np.allclose(x.grad.numpy(), right) else "wrong")
"""


def test_a_value_an_atomic_returned_refuses_reverse_mode():
    """Warp's adjoint kernel does not run atomics again (``skip_replay``), so the slot is not there when the store
    is replayed: wp.Tape's gradient is wrong or the process crashes (the evidence below, in a subprocess), and
    warpnn refuses instead, naming the atomic."""
    x_np = np.arange(1.0, 5.0, dtype=np.float32)
    weights = np.array([1.0, 10.0, 100.0, 1000.0], np.float32)
    tape = subprocess.run([sys.executable, "-c", _TAPE_OF_ARRIVAL_ORDER], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert tape.returncode != 0 or "TAPE wrong" in tape.stdout, (tape.stdout, tape.stderr[-2000:])
    call = warpnn.jax_kernel(doubled_in_arrival_order, num_outputs=2, in_out_argnames=["count"])
    count_after, doubled = call(jnp.zeros(1, jnp.int32), jnp.asarray(x_np), launch_dims=4)
    assert_close(jnp.sort(doubled), 2.0 * x_np)  # the forward pass is right and stays available
    with pytest.raises(TypeError, match="uses the value wp.atomic_add returns"):
        jax.grad(lambda x: (call(jnp.zeros(1, jnp.int32), x, launch_dims=4)[1] * weights).sum())(jnp.asarray(x_np))


@wp.func
def _scale_into(src: wp.array(dtype=float), dst: wp.array(dtype=float), i: int):
    dst[i] = 2.0 * src[i]


@wp.func
def _shift_into(src: wp.array(dtype=float), dst: wp.array(dtype=float), i: int):
    dst[i] = src[i] + 1.0


def _table_kernel(use_shift: bool):
    # mujoco_warp's collision drivers call functions from tables through wp.static; Warp resolves the call
    chosen = _shift_into if use_shift else _scale_into

    @wp.kernel
    def call_from_table(src: wp.array(dtype=float), dst: wp.array(dtype=float)):
        i = wp.tid()
        wp.static(chosen)(src, dst, i)

    return call_from_table


def test_a_function_called_through_wp_static_is_followed_and_only_the_branch_warp_generates_is_walked():
    uses = kernel_array_uses(_table_kernel(True))
    assert uses["src"].undecided is None and uses["dst"].undecided is None
    assert uses["src"].reads and not uses["src"].writes and uses["dst"].writes and not uses["dst"].reads
    program = warpnn.jax_kernel(_table_kernel(False), num_outputs=1)
    x = jnp.arange(4.0)
    grad = jax.grad(lambda x: jnp.sum(program(x)[0] * jnp.arange(4.0)))(x)
    np.testing.assert_allclose(np.asarray(grad), 2.0 * np.arange(4.0))

    @wp.kernel
    def static_branch(src: wp.array(dtype=float), dst: wp.array(dtype=float)):
        i = wp.tid()
        if wp.static(False):
            dst[0] = src[i]  # never generated: would make dst's element shared between threads
        dst[i] = src[i]

    assert kernel_array_uses(static_branch)["dst"].in_place_problem() is None
    assert [a.kind for a in kernel_array_uses(static_branch)["dst"].accesses] == ["store"]
