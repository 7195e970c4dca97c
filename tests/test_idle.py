"""Launches the program's constants keep idle (warpnn._idle): every thread leaves at a guard the constants decide,
so the launch writes nothing and replays as nothing, whatever its kernel's adjoint would do; a thread past the
guard, or a guard on values that may change, keeps the kernel's refusal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn

from .helpers import assert_close


@wp.func
def total_weight(weights: wp.array(dtype=float), i: int) -> float:
    return 2.0 * weights[i]


@wp.kernel
def scale(x: wp.array(dtype=float), f: wp.array(dtype=float)):
    i = wp.tid()
    f[i] = 3.0 * x[i]


@wp.kernel
def add_up_the_chain(weights: wp.array(dtype=float), parent: wp.array(dtype=int), x: wp.array(dtype=float),
                     f: wp.array(dtype=float)):
    # mujoco_warp's _tendon_armature in miniature: a walk up a chain (a while loop, whose adjoint Warp gets wrong)
    # that a thread takes only where the model gives it a weight
    i = wp.tid()
    w = total_weight(weights, i)
    if w == 0.0:
        return
    j = i
    while j >= 0:
        wp.atomic_add(f, j, w * x[i])
        j = parent[j]


N = 5
PARENT = np.array([-1, 0, 1, 0, 3])


def _trace(weights_np, *, weights_is_input=False, rewrite_weights=None):
    x = wp.array(np.linspace(0.5, 1.5, N).astype(np.float32))
    f = wp.zeros(N, dtype=float)
    weights, parent = wp.array(weights_np.astype(np.float32)), wp.array(PARENT, dtype=int)

    def step():
        if rewrite_weights == "before":
            weights.fill_(0.0)
        wp.launch(scale, N, [x, f])
        wp.launch(add_up_the_chain, N, [weights, parent, x, f])
        if rewrite_weights == "after":
            weights.fill_(0.0)

    inputs = {"x": x, **({"weights": weights} if weights_is_input else {})}
    return warpnn.trace(step, inputs, {"f": f}), x, f


def _warp_forward(weights_np, x_np):
    """The same two launches run by Warp directly."""
    x, f = wp.array(x_np), wp.zeros(N, dtype=float)
    weights, parent = wp.array(weights_np.astype(np.float32)), wp.array(PARENT, dtype=int)
    wp.launch(scale, N, [x, f])
    wp.launch(add_up_the_chain, N, [weights, parent, x, f])
    return f.numpy()


def test_a_launch_no_thread_of_which_gets_past_its_guard_differentiates_as_nothing():
    program, x, _ = _trace(np.zeros(N))
    assert program.reverse_refusals() == {}
    assert "add_up_the_chain__wnidle" in program.describe()
    x0 = jnp.linspace(-1.0, 1.0, N)
    assert_close(program({"x": x0})["f"], _warp_forward(np.zeros(N), np.asarray(x0, np.float32)))
    weights = jnp.cos(jnp.arange(N, dtype=jnp.float32))
    grad = jax.grad(lambda x: (weights * program({"x": x})["f"]).sum())(x0)
    assert_close(grad, 3.0 * weights)  # (f = 3 x: the chain adds nothing)


@pytest.mark.parametrize("case", ["a thread past the guard", "the guard's array an input",
                                  "the guard's array written before", "the guard's array written later"])
def test_a_launch_the_constants_do_not_keep_idle_keeps_its_refusal(case):
    weights_np = np.where(np.arange(N) == 3, 0.5, 0.0) if case == "a thread past the guard" else np.zeros(N)
    rewrite = {"the guard's array written before": "before", "the guard's array written later": "after"}.get(case)
    program, x, f = _trace(weights_np, weights_is_input=case == "the guard's array an input", rewrite_weights=rewrite)
    assert "add_up_the_chain" in program.reverse_refusals()
    inputs = {"x": jnp.linspace(-1.0, 1.0, N)}
    if case == "the guard's array an input":
        inputs["weights"] = jnp.asarray(weights_np, jnp.float32)
    assert_close(program(inputs)["f"], _warp_forward(weights_np, np.asarray(inputs["x"], np.float32)))
    with pytest.raises(TypeError, match="add_up_the_chain"):
        jax.grad(lambda x: program({**inputs, "x": x})["f"].sum())(inputs["x"])
