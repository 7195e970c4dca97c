"""In-place updates at indices read from the program's constants (warpnn._owned): differentiated where a
launch-time probe proves that no thread touches an element another thread writes, refused otherwise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn

from .helpers import assert_close

BALL = wp.constant(1)


@wp.kernel
def integrate_joints(adr: wp.array(dtype=int), kind: wp.array(dtype=int), dt: wp.array(dtype=float),
                     q_in: wp.array(dtype=float), v: wp.array(dtype=float), q_out: wp.array(dtype=float)):
    # mujoco_warp's _next_position in miniature: one joint per thread, its elements at adr[j] (3 for a ball),
    # called with q_in and q_out the same array
    j = wp.tid()
    a = adr[j]
    h = dt[0]
    if kind[j] == BALL:
        x0 = q_in[a]
        x1 = q_in[a + 1]
        x2 = q_in[a + 2]
        q_out[a] = x0 + h * v[a]
        q_out[a + 1] = x1 + h * v[a + 1]
        q_out[a + 2] = x2 + h * v[a + 2]
    else:
        x = q_in[a]
        q_out[a] = x + h * wp.sin(v[a]) * x


def reference(q, v, dt, adr, kind):
    out = q
    for a, k in zip(adr, kind):
        if k == 1:
            out = out.at[a:a + 3].set(q[a:a + 3] + dt[0] * v[a:a + 3])
        else:
            out = out.at[a].set(q[a] + dt[0] * jnp.sin(v[a]) * q[a])
    return out


def _trace(adr_np, kind_np, *, adr_is_input=False, kind_is_input=False, rewrite_adr=False):
    n = int(adr_np.max()) + 3
    q = wp.array(np.linspace(0.5, 1.5, n).astype(np.float32))
    v = wp.array(np.linspace(-1.0, 1.0, n).astype(np.float32))
    dt = wp.array([0.1], dtype=float)
    adr, kind = wp.array(adr_np, dtype=int), wp.array(kind_np, dtype=int)

    def step():
        wp.launch(integrate_joints, len(adr_np), [adr, kind, dt, q, v, q])
        if rewrite_adr:
            adr.fill_(0)

    inputs = {"q": q, "v": v, "dt": dt, **({"adr": adr} if adr_is_input else {}),
              **({"kind": kind} if kind_is_input else {})}
    return warpnn.trace(step, inputs, {"q": q}), n


def _loss_and_grad(program, n, adr_np, kind_np):
    q0 = jnp.linspace(0.5, 1.5, n)
    v0 = jnp.linspace(-1.0, 1.0, n)
    dt0 = jnp.array([0.1])
    weights = jnp.cos(jnp.arange(n, dtype=jnp.float32))

    def warpnn_loss(q, v, dt):
        return (weights * program({"q": q, "v": v, "dt": dt})["q"] ** 2).sum()

    def reference_loss(q, v, dt):
        return (weights * reference(q, v, dt, adr_np, kind_np) ** 2).sum()

    return (warpnn_loss, reference_loss), (q0, v0, dt0)


@pytest.mark.parametrize(("adr_np", "kind_np"), [
    (np.array([0, 3, 4, 7]), np.array([1, 0, 1, 0])),  # balls at 0 and 4, hinges at 3 and 7
    # adjacent hinges: a ball's three elements at 0 would overlap the next, but no thread takes that branch
    (np.array([0, 1, 2]), np.array([0, 0, 0])),
])
def test_disjoint_joints_differentiate_like_the_reference(adr_np, kind_np):
    program, n = _trace(adr_np, kind_np)
    assert program.reverse_refusals() == {}
    (ours, ref), args = _loss_and_grad(program, n, adr_np, kind_np)
    assert_close(jax.jit(ours)(*args), ref(*args), rtol=1e-5)
    for got, want in zip(jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(*args), jax.grad(ref, argnums=(0, 1, 2))(*args)):
        assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["overlapping joints", "index array is an input", "index array rewritten later",
                                  "branch condition is an input"])
def test_unproven_in_place_updates_stay_refused(case):
    adr_np, kind_np = {"overlapping joints": (np.array([0, 2]), np.array([1, 0])),
                       # the probe then records both branches of every joint: a superset, which overlaps
                       "branch condition is an input": (np.array([0, 1]), np.array([0, 0]))}.get(
                           case, (np.array([0, 3]), np.array([1, 0])))
    program, n = _trace(adr_np, kind_np, adr_is_input=case == "index array is an input",
                        kind_is_input=case == "branch condition is an input",
                        rewrite_adr=case == "index array rewritten later")
    refusals = program.reverse_refusals()
    assert any("touches an element other than" in why for why in refusals.values()), refusals
    (ours, _), args = _loss_and_grad(program, n, adr_np, kind_np)
    if case in ("index array is an input", "branch condition is an input"):
        return  # (the program then takes that array too; the refusal above is the bridge's decision)
    with pytest.raises(TypeError, match="integrate_joints"):
        jax.grad(ours)(*args)


@wp.kernel
def with_activations(na: int, act: wp.array(dtype=float), x: wp.array(dtype=float), y: wp.array(dtype=float)):
    # mujoco_warp's _actuator_force in miniature: activations updated at computed indices, when the model has any
    i = wp.tid()
    if na > 0:
        act[i % na] = act[(i + 1) % na] + x[i]
    y[i] = x[i] * x[i]


def test_an_array_without_elements_is_no_reason_to_refuse():
    x, y, act = wp.array(np.arange(1.0, 5.0, dtype=np.float32)), wp.zeros(4, dtype=float), wp.zeros(0, dtype=float)
    program = warpnn.trace(lambda: wp.launch(with_activations, 4, [0, act, x], [y]), {"x": x}, {"y": y})
    assert program.reverse_refusals() == {}
    grad = jax.grad(lambda x: program({"x": x})["y"].sum())(jnp.arange(1.0, 5.0))
    assert_close(grad, 2.0 * np.arange(1.0, 5.0))
    act = wp.zeros(3, dtype=float)  # with activations the same launch stays refused (threads share elements)
    program = warpnn.trace(lambda: wp.launch(with_activations, 4, [3, act, x], [y]), {"x": x}, {"y": y})
    assert "touches an element other than" in program.reverse_refusals()["with_activations"]


@wp.func
def slot_after(a: int, q: wp.array(dtype=float)) -> int:
    return a + int(q[a] > 1.0)


@wp.kernel
def with_a_rare_kind(adr: wp.array(dtype=int), kind: wp.array(dtype=int), q_in: wp.array(dtype=float),
                     q_out: wp.array(dtype=float)):
    # mujoco_warp's _actuator_force in miniature: a branch taken only by a kind of joint (its DC motors) writes at
    # an index a @wp.func computes, which the probe cannot follow
    j = wp.tid()
    a = adr[j]
    if kind[j] == BALL:
        b = slot_after(a, q_in)
        q_out[b] = 3.0 * q_in[b]
    else:
        q_out[a] = 2.0 * q_in[a]


@pytest.mark.parametrize("kind_np", [np.array([0, 0, 0]), np.array([0, 1, 0])])
def test_a_branch_the_probe_cannot_follow_refuses_only_where_a_thread_takes_it(kind_np):
    """The probe replaces a side of an ``if`` it cannot follow, under a condition the constants decide, by an access
    that fails the proof where a thread reaches it: with no thread of that kind the launch differentiates (it was
    refused whatever the model before), with one it stays refused."""
    q = wp.array(np.linspace(0.5, 1.5, 4).astype(np.float32))
    adr, kind = wp.array(np.arange(3), dtype=int), wp.array(kind_np, dtype=int)
    program = warpnn.trace(lambda: wp.launch(with_a_rare_kind, 3, [adr, kind, q, q]), {"q": q}, {"q": q})
    if kind_np.any():
        assert "touches an element other than" in program.reverse_refusals()["with_a_rare_kind"]
        return
    assert program.reverse_refusals() == {}
    weights = jnp.cos(jnp.arange(4.0))
    grad = jax.grad(lambda q: (weights * program({"q": q})["q"] ** 2).sum())(jnp.linspace(0.5, 1.5, 4))
    reference = jax.grad(lambda q: (weights * q.at[:3].multiply(2.0) ** 2).sum())(jnp.linspace(0.5, 1.5, 4))
    assert_close(grad, reference, rtol=1e-5)


@wp.kernel
def reads_in_conditions(adr: wp.array(dtype=int), q_in: wp.array(dtype=float), q_out: wp.array(dtype=float)):
    j = wp.tid()
    a = adr[j]
    if q_out:  # Warp's null-array test: no element read
        if q_in[a + 1] > 0.0:  # a neighbour's element, read in a condition
            q_out[a] = 2.0 * q_in[a]


def test_reads_in_conditions_are_placed_too():
    """The condition's read of the next joint's element (which that joint's thread writes) means no proof: before,
    the probe skipped conditions, and the launch differentiated as if the elements were owned."""
    q = wp.array(np.linspace(0.5, 1.5, 4).astype(np.float32))
    adr = wp.array(np.arange(3), dtype=int)
    program = warpnn.trace(lambda: wp.launch(reads_in_conditions, 3, [adr, q, q]), {"q": q}, {"q": q})
    assert "touches an element other than" in program.reverse_refusals()["reads_in_conditions"]
    adr = wp.array(np.array([0, 2]), dtype=int)  # every other element: the read is no other thread's
    program = warpnn.trace(lambda: wp.launch(reads_in_conditions, 2, [adr, q, q]), {"q": q}, {"q": q})
    assert program.reverse_refusals() == {}


@wp.kernel
def walk_branches(branch_start: wp.array(dtype=int), branch_bodies: wp.array(dtype=int), parent: wp.array(dtype=int),
                  q: wp.array(dtype=float), x: wp.array(dtype=float)):
    # mujoco_warp's _kinematics_branch in miniature: one thread per branch of the tree, root to leaf, each body's
    # value from its parent's, which the same thread wrote one iteration before (x[0], the world, is read only)
    b = wp.tid()
    for i in range(branch_start[b], branch_start[b + 1]):
        body = branch_bodies[i]
        x[body] = x[parent[body]] * wp.cos(q[body]) + q[body]


def _tree(branch_start, branch_bodies, parent):
    q = wp.array(np.linspace(0.3, 1.2, len(parent)).astype(np.float32))
    x = wp.array(np.r_[1.5, np.zeros(len(parent) - 1)].astype(np.float32))
    arrays = [wp.array(np.asarray(a), dtype=int) for a in (branch_start, branch_bodies, parent)]
    program = warpnn.trace(lambda: wp.launch(walk_branches, len(branch_start) - 1, [*arrays, q, x]),
                           {"q": q, "x": x}, {"x": x})
    return program, q.numpy(), x.numpy()


def walk_reference(q, x, order, parent):
    for body in order:
        x = x.at[body].set(x[parent[body]] * jnp.cos(q[body]) + q[body])
    return x


def test_a_walk_down_a_chain_replays_on_the_values_it_wrote():
    # one branch (a chain, as an arm): every read of x but the world's comes after this thread's one write of it,
    # so the adjoint replays on x after the launch
    parent = [0, 0, 1, 2, 3]
    program, q0, x0 = _tree([0, 4], [1, 2, 3, 4], parent)
    assert program.reverse_refusals() == {}

    def loss(program_or_none, q, x):
        out = program({"q": q, "x": x})["x"] if program_or_none else walk_reference(q, x, [1, 2, 3, 4], parent)
        return (jnp.cos(jnp.arange(5.0)) * out).sum()

    args = (jnp.asarray(q0), jnp.asarray(x0))
    assert_close(program({"q": args[0], "x": args[1]})["x"], walk_reference(*args, [1, 2, 3, 4], parent))
    for got, want in zip(jax.jit(jax.grad(lambda q, x: loss(True, q, x), argnums=(0, 1)))(*args),
                         jax.grad(lambda q, x: loss(False, q, x), argnums=(0, 1))(*args)):
        assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_branches_sharing_a_body_stay_refused():
    # two branches through body 1: both threads write it (the same value), and Warp's adjoint would count its
    # gradient twice: no proof
    parent = [0, 0, 1, 1]
    program, _, _ = _tree([0, 2, 4], [1, 2, 1, 3], parent)
    assert "touches an element other than" in program.reverse_refusals().get(walk_branches.key, "")
