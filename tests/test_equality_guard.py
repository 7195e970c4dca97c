"""The equality guard (warpnn._equality_guard): reverse mode through a float ``==`` / ``!=`` branch gives NaN in a
thread that met equality, Warp's adjoint everywhere else; against pure-JAX versions of the same functions and
central differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _equality_guard

from .helpers import assert_close


@wp.func
def damping_force(damping: float, v: float):
    f = float(0.0)
    if damping != 0.0:  # (mujoco_warp's passive forces skip a zero damper so: the sides agree in value, not slope)
        f = -damping * v
    return f


@wp.kernel
def damped(damping: wp.array(dtype=float), v: wp.array(dtype=float), f: wp.array(dtype=float)):
    i = wp.tid()
    f[i] = damping_force(damping[i], v[i])


@wp.func
def rotation_vector(q: wp.quat):
    """mujoco_warp's ``quat_to_vel``: zero through a branch where ``|axis| == 0``, whose side's adjoint is zero."""
    axis = wp.vec3(q[1], q[2], q[3])
    s = wp.length(axis)
    if s == 0.0:
        return wp.vec3(0.0)
    return axis * (2.0 * wp.atan2(s, q[0]) / s)


@wp.kernel
def rotation_length(q: wp.array(dtype=wp.quat), gear: wp.array(dtype=wp.vec3), out: wp.array(dtype=float)):
    i = wp.tid()
    out[i] = wp.dot(rotation_vector(q[i]), gear[i])


@wp.kernel
def skip_zero_force(force: wp.array(dtype=wp.vec3), arm: wp.array(dtype=wp.vec3), torque: wp.array(dtype=wp.vec3)):
    i = wp.tid()  # (mujoco_warp's _apply_ft skips a body whose force is exactly zero: a vector comparison)
    f = force[i]
    if f == wp.vec3():
        return
    torque[i] = wp.cross(arm[i], f)


def rotation_length_reference(q, gear):
    """The same map in JAX with its limit at the identity written out (``2 axis / w``)."""
    axis, w = q[:, 1:], q[:, :1]
    squared = jnp.sum(axis * axis, -1, keepdims=True)
    nonzero = squared > 0
    s = jnp.sqrt(jnp.where(nonzero, squared, 1.0))  # (sqrt's derivative at 0 would be NaN in the reference too)
    scale = jnp.where(nonzero, 2.0 * jnp.arctan2(s, w) / jnp.where(nonzero, s, 1.0), 2.0 / w)
    return jnp.sum(axis * scale * gear, -1)


def test_a_thread_that_met_equality_gets_nan_for_what_the_compared_value_came_from():
    """Off the boundary the gradient is Warp's (the derivative); in the thread at ``damping == 0`` the damping's
    gradient is NaN, where Warp's adjoint gives the side taken (0, against the derivative -v). The velocity's
    gradient there is not poisoned: the comparison does not read it (its derivative, -damping = 0, is right)."""
    call = warpnn.jax_kernel(damped, num_outputs=1)

    def gradients(damping):
        return jax.grad(lambda d, v: call(d, v)[0].sum(), argnums=(0, 1))(jnp.asarray(damping), jnp.full(3, 3.0))

    d_damping, d_v = gradients([0.0, 0.5, -0.25])
    assert np.isnan(d_damping[0]) and not np.isnan(d_damping[1:]).any()
    assert_close(d_damping[1:], [-3.0, -3.0])
    assert_close(d_v, [0.0, -0.5, 0.25])


def test_the_side_setting_keeps_warps_adjoint_and_a_declaration_keeps_it_for_one_function(monkeypatch):
    call = warpnn.jax_kernel(damped, num_outputs=1)

    def d_damping():
        return jax.grad(lambda d: call(d, jnp.full(2, 3.0))[0].sum())(jnp.asarray([0.0, 0.5]))

    monkeypatch.setenv("WARPNN_EQUALITY_GRADIENT", "side")
    assert_close(d_damping(), [0.0, -3.0])  # Warp's adjoint: the side taken at 0
    monkeypatch.delenv("WARPNN_EQUALITY_GRADIENT")
    assert np.isnan(d_damping()[0])
    monkeypatch.setattr(_equality_guard, "_SIDE_TAKEN", {})
    warpnn.keep_side_taken(damping_force, "a test's claim (false: the slopes differ)")
    assert _equality_guard.declared_side_taken() == {
        f"{__name__}.damping_force": "a test's claim (false: the slopes differ)"}
    assert_close(d_damping(), [0.0, -3.0])  # the declared function keeps the side taken
    with pytest.raises(TypeError, match="a @wp.func or @wp.kernel and a reason"):
        warpnn.keep_side_taken(damping_force, " ")


def test_the_guard_reaches_the_inputs_past_an_adjoint_that_passes_nothing_on():
    """At the identity ``rotation_vector`` takes its zero branch, and Warp's adjoint of ``wp.length`` at the zero
    vector passes nothing back: poisoning the compared value alone would leave a zero gradient (the side taken,
    where the derivative is ``2 gear``). Every value the comparison was computed from is poisoned, the quaternion
    included. Off the identity the gradient is the pure-JAX reference's and matches central differences."""
    call = warpnn.jax_kernel(rotation_length, num_outputs=1)
    gear = jnp.asarray([[0.3, 1.0, 0.5]] * 2)

    def loss(q):
        return call(q, gear)[0].sum()

    turned = np.array([0.9, 0.2, -0.3, 0.1]) / np.linalg.norm([0.9, 0.2, -0.3, 0.1])
    q = jnp.asarray([[1.0, 0.0, 0.0, 0.0], turned], jnp.float32)
    grad = np.asarray(jax.grad(loss)(q))
    assert np.isnan(grad[0]).all() and not np.isnan(grad[1]).any()
    expected = jax.grad(lambda q: rotation_length_reference(q, gear[1:]).sum())(q[1:])
    assert_close(grad[1:], expected, rtol=1e-4)
    with jax.enable_x64():  # central differences of the reference in float64
        q64, gear64 = jnp.asarray(turned[None]), jnp.asarray(gear[:1], jnp.float64)
        eps = 1e-6
        fd = [(rotation_length_reference(q64 + eps * e, gear64) - rotation_length_reference(q64 - eps * e, gear64))[0]
              / (2 * eps) for e in np.eye(4)]
    assert_close(grad[1], fd, rtol=1e-4, atol=1e-5)
    # the reference's own derivative at the identity, which the guard refuses to guess: 2 gear
    assert_close(jax.grad(lambda q: rotation_length_reference(q, gear[:1]).sum())(q[:1])[0, 1:], 2 * gear[0])


def test_vector_comparisons_are_guarded():
    """``f == wp.vec3()`` (a body with no applied force skipped, as mujoco_warp's ``_apply_ft`` does): the torque is
    linear in the force, the skipped body's derivative is ``arm x``, and Warp's adjoint gives 0; guarded, NaN."""
    call = warpnn.jax_kernel(skip_zero_force, num_outputs=1)
    arm = jnp.asarray([[0.0, 1.0, 0.0], [1.0, 0.0, 2.0]])

    def d_force(force):
        return jax.grad(lambda f: jnp.sum(call(f, arm)[0] * jnp.asarray([1.0, -2.0, 0.5])))(jnp.asarray(force))

    got = np.asarray(d_force([[0.0, 0.0, 0.0], [0.5, -1.0, 2.0]]))
    assert np.isnan(got[0]).all()
    weights = jnp.asarray([1.0, -2.0, 0.5])
    assert_close(got[1], jax.grad(lambda f: jnp.sum(jnp.cross(arm[1], f) * weights))(jnp.asarray([0.5, -1.0, 2.0])))


def test_a_jax_callable_s_tape_gradient_is_guarded_too():
    """``jax_callable`` differentiates by ``wp.Tape`` over the function: its recorded kernels' adjoints run from the
    guarded twins, so the tape's gradient is NaN where a thread met equality, Warp's elsewhere."""

    def apply(damping: wp.array(dtype=float), v: wp.array(dtype=float), f: wp.array(dtype=float)):
        wp.launch(damped, damping.shape, inputs=[damping, v], outputs=[f])

    call = warpnn.jax_callable(apply, num_outputs=1)
    d_damping, d_v = jax.grad(lambda d, v: call(d, v)[0].sum(), argnums=(0, 1))(jnp.asarray([0.0, 0.5]),
                                                                                  jnp.full(2, 3.0))
    assert np.isnan(d_damping[0]) and not np.isnan(d_v).any()
    assert_close(d_damping[1], -3.0)
    assert_close(d_v, [0.0, -0.5])


@wp.kernel
def damped_output_first(f: wp.array(dtype=float), damping: wp.array(dtype=float), v: wp.array(dtype=float)):
    i = wp.tid()
    d = damping[i]
    f[i] = wp.where(d != 0.0, -d * v[i], 0.0)


def test_the_guard_and_a_kernel_declaration_reach_the_twins_warpnn_generates(monkeypatch):
    """``warpnn.trace`` replays a kernel whose output comes first through a twin generated with its parameters
    reordered: the twin's adjoint is guarded, and a declaration of the kernel holds for it."""
    damping, v, f = (wp.array(np.zeros(2), dtype=float) for _ in range(3))
    program = warpnn.trace(lambda: wp.launch(damped_output_first, 2, inputs=[f, damping, v]),
                           inputs={"damping": damping, "v": v}, outputs={"f": f})
    assert any(op.kernel is not damped_output_first for op in program.launches())  # (the generated twin)

    def d_damping():
        return jax.grad(lambda d: program({"damping": d, "v": jnp.full(2, 3.0)})["f"].sum())(jnp.asarray([0.0, 0.5]))

    got = d_damping()
    assert np.isnan(got[0]) and not np.isnan(got[1])
    monkeypatch.setattr(_equality_guard, "_SIDE_TAKEN", {})
    warpnn.keep_side_taken(damped_output_first, "a test's claim")
    assert_close(d_damping(), [0.0, -3.0])


@pytest.mark.parametrize("batched", ["twin", "off"])
def test_the_guard_holds_under_vmap(monkeypatch, batched):
    """Under ``jax.vmap`` the adjoint runs from the batched twin of the guarded twin (or per element): NaN exactly in
    the batch elements' threads that met equality."""
    monkeypatch.setenv("WARPNN_BATCHED_LAUNCH", batched)
    call = warpnn.jax_kernel(damped, num_outputs=1)
    got = jax.vmap(jax.grad(lambda d, v: call(d, v)[0].sum()))(jnp.asarray([[0.0, 0.5], [0.5, 0.0]]),
                                                                jnp.full((2, 2), 3.0))
    np.testing.assert_array_equal(np.isnan(got), [[True, False], [False, True]])
    assert_close([got[0, 1], got[1, 0]], [-3.0, -3.0])


def test_jax_debug_nans_names_the_comparison():
    """Under ``jax_debug_nans`` the NaN is reported at the guarded adjoint, naming the place and the way out."""
    call = warpnn.jax_kernel(damped, num_outputs=1)
    with jax.debug_nans(True), pytest.raises(FloatingPointError) as raised:
        jax.grad(lambda d: call(d, jnp.full(2, 3.0))[0].sum())(jnp.asarray([0.0, 0.5]))
    message = str(raised.value)
    assert "damped" in message and "(adjoint)" in message, message
    assert "if damping != 0.0:" in message and "warpnn.keep_side_taken" in message, message
