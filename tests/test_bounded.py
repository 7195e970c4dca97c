"""Dynamic loops bounded by the program's constants (warpnn._bounded): unrolled for the adjoint where the trace
proves their trip counts fixed, with gradients checked against pure-JAX references of the same math; refused
(Warp's adjoint of the loop would be wrong) where the bound depends on an input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn

from .helpers import assert_close


@wp.kernel
def subtree_norm(count: wp.array(dtype=int), x: wp.array(dtype=float), out: wp.array(dtype=float)):
    # mujoco_warp's _subtree_com in miniature: a sum over a range the model gives, used after the loop
    i = wp.tid()
    s = float(0.0)
    for j in range(i, i + count[i]):
        s += x[j] * x[j]
    out[i] = wp.sqrt(s + 1.0)


@wp.kernel
def path_product(parent: wp.array(dtype=int), w: wp.array(dtype=float), out: wp.array(dtype=float)):
    # a walk to the root of a tree (mujoco_warp's _M, _cfrc_world): a while loop the model's parents bound
    i = wp.tid()
    p = float(1.0)
    b = i
    while b > 0:
        p = p * w[b]
        b = parent[b]
    out[i] = p


@wp.kernel
def clipped_sum(start: wp.array(dtype=int), stop: wp.array(dtype=int), limit: float, x: wp.array(dtype=float),
                out: wp.array(dtype=float)):
    # continue and break on the data, inside a loop the model bounds
    i = wp.tid()
    s = float(0.0)
    for j in range(start[i], stop[i]):
        v = x[j]
        if v < 0.0:
            continue
        s = s + v * v * x[i]
        if s > limit:
            break
    out[i] = s * s


@wp.func
def matching_norm(kinds: wp.array(dtype=int), w: wp.array(dtype=float), target: int) -> float:
    # mujoco_warp's actuator_target_damping in miniature: a scan over the model inside a @wp.func
    total = float(0.0)
    for k in range(kinds.shape[0]):
        if kinds[k] != target:
            continue
        total = total + w[k] * w[k]
    return wp.sqrt(total + 1.0)


@wp.func
def scaled_norm(kinds: wp.array(dtype=int), w: wp.array(dtype=float), target: int, scale: float) -> float:
    return scale * matching_norm(kinds, w, target)  # (the loop one call further down)


@wp.kernel
def per_kind(kinds: wp.array(dtype=int), w: wp.array(dtype=float), out: wp.array(dtype=float)):
    i = wp.tid()
    out[i] = scaled_norm(kinds, w, i, 2.0) * w[i]


def _trace(kernel, constants, inputs_np, n_out, scalars=()):
    arrays = {k: wp.array(v, dtype=int) for k, v in constants.items()}
    inputs = {k: wp.array(v.astype(np.float32), dtype=float) for k, v in inputs_np.items()}
    out = wp.zeros(n_out, dtype=float)

    def step():
        wp.launch(kernel, n_out, [*arrays.values(), *scalars, *inputs.values(), out])

    return warpnn.trace(step, inputs, {"out": out})


def subtree_norm_reference(x, count):
    return jnp.stack([jnp.sqrt(jnp.sum(x[i:i + c] ** 2) + 1.0) for i, c in enumerate(count)])


def path_product_reference(w, parent):
    outs = []
    for i in range(len(parent)):
        p, b = 1.0, i
        while b > 0:
            p, b = p * w[b], parent[b]
        outs.append(p)
    return jnp.stack([jnp.asarray(o, jnp.float32) for o in outs])


def clipped_sum_reference(x, start, stop, limit, at):
    """The same sum, its branches taken as at ``at`` (the derivative of a branch is that of the side taken)."""
    outs = []
    xn = np.asarray(at)
    for i in range(len(start)):
        s = 0.0
        sn = 0.0
        for j in range(start[i], stop[i]):
            if xn[j] < 0.0:
                continue
            s = s + x[j] * x[j] * x[i]
            sn = sn + xn[j] * xn[j] * xn[i]
            if sn > limit:
                break
        outs.append(s * s)
    return jnp.stack([jnp.asarray(o, jnp.float32) for o in outs])


def _check(program, reference, x0, name="x"):
    weights = jnp.cos(jnp.arange(len(reference(x0)), dtype=jnp.float32))

    def loss(x):
        return (weights * program({name: x})["out"]).sum()

    def reference_loss(x):
        return (weights * reference(x)).sum()

    assert_close(program({name: x0})["out"], reference(x0), rtol=1e-5, atol=1e-6)
    assert_close(jax.jit(jax.grad(loss))(x0), jax.grad(reference_loss)(x0), rtol=1e-4, atol=1e-6)


def test_a_loop_over_a_range_the_model_gives_differentiates():
    count = np.array([4, 2, 1, 0, 1])
    x0 = np.linspace(-1.0, 1.5, 5).astype(np.float32)
    program = _trace(subtree_norm, {"count": count}, {"x": x0}, 5)
    assert program.reverse_refusals() == {}
    _check(program, lambda x: subtree_norm_reference(x, count), jnp.asarray(x0))


def test_a_while_loop_walking_the_model_tree_differentiates():
    parent = np.array([0, 0, 1, 1, 3, 0, 5])
    w0 = np.linspace(0.5, 1.7, 7).astype(np.float32)
    program = _trace(path_product, {"parent": parent}, {"w": w0}, 7)
    assert program.reverse_refusals() == {}
    _check(program, lambda w: path_product_reference(w, parent), jnp.asarray(w0), name="w")


def test_continue_and_break_on_the_data_inside_a_bounded_loop():
    start, stop = np.array([0, 1, 3, 2]), np.array([4, 5, 3, 6])
    x0 = np.array([0.9, -0.4, 1.1, 0.7, -0.2, 1.3], np.float32)
    limit = 1.5  # rows 0 and 1 break before their end at x0; row 3 does not
    program = _trace(clipped_sum, {"start": start, "stop": stop}, {"x": x0}, 4, scalars=(limit,))
    assert program.reverse_refusals() == {}
    _check(program, lambda x: clipped_sum_reference(x, start, stop, limit, x0), jnp.asarray(x0))


def test_a_loop_inside_a_called_function_differentiates():
    kinds = np.array([0, 2, 0, 1, 2, 2])
    w0 = np.linspace(-0.8, 1.3, 6).astype(np.float32)

    def reference(w):
        return jnp.stack([2.0 * jnp.sqrt(jnp.sum(jnp.where(kinds == i, w * w, 0.0)) + 1.0) * w[i] for i in range(3)])

    program = _trace(per_kind, {"kinds": kinds}, {"w": w0}, 3)
    assert program.reverse_refusals() == {}
    _check(program, reference, jnp.asarray(w0), name="w")


def test_a_bound_read_from_an_input_keeps_the_refusal():
    # the same loop with count an input of the program: another call may loop longer than the trace measured
    count = wp.array(np.array([2, 1, 0]), dtype=int)
    x = wp.array(np.ones(3, np.float32), dtype=float)
    out = wp.zeros(3, dtype=float)
    program = warpnn.trace(lambda: wp.launch(subtree_norm, 3, [count, x, out]), {"x": x, "count": count},
                           {"out": out})
    refusals = program.reverse_refusals()
    assert "dynamic for loop" in refusals.get(subtree_norm.key, "")
    with pytest.raises(TypeError, match="subtree_norm"):
        jax.grad(lambda x: program({"x": x, "count": jnp.asarray([2, 1, 0], jnp.int32)})["out"].sum())(jnp.ones(3))


def test_a_bound_array_written_later_in_the_program_keeps_the_refusal():
    count = wp.array(np.array([2, 1, 0]), dtype=int)
    x = wp.array(np.ones(3, np.float32), dtype=float)
    out = wp.zeros(3, dtype=float)

    def step():
        wp.launch(subtree_norm, 3, [count, x, out])
        count.fill_(3)  # the next replay's bound is not the one measured: no proof

    program = warpnn.trace(step, {"x": x}, {"out": out})
    assert subtree_norm.key in program.reverse_refusals()


def test_the_loop_inside_the_twin_matches_the_kernel_forward():
    # the replay runs the twin: its forward equals Warp's run of the kernel itself
    count = np.array([3, 0, 2, 1])
    x0 = np.linspace(0.2, 1.1, 4).astype(np.float32)
    program = _trace(subtree_norm, {"count": count}, {"x": x0}, 4)
    direct = wp.zeros(4, dtype=float)
    wp.launch(subtree_norm, 4, [wp.array(count, dtype=int), wp.array(x0, dtype=float), direct])
    np.testing.assert_array_equal(np.asarray(program({"x": jnp.asarray(x0)})["out"]), direct.numpy())
