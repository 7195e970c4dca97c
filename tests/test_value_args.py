"""warpnn._value_args: kernels taking vectors, matrices, quaternions and transforms by value (``offset: wp.vec3``), as
Newton's inverse kinematics, ray casts and SDF builders and mujoco_warp's sweep-and-prune do, through jax_kernel and
the tracer: against wp.launch, pure-JAX references and wp.Tape. (Warp's own jax_kernel refuses such arguments.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _value_args

from .helpers import assert_close


@wp.kernel
def rotate_scale_shift(x: wp.array(dtype=wp.vec3), offset: wp.vec3, rot: wp.quat, s: float,
                       y: wp.array(dtype=wp.vec3)):
    i = wp.tid()
    y[i] = wp.quat_rotate(rot, x[i] * s) + offset


@wp.kernel
def through_matrix_and_transform(x: wp.array(dtype=wp.vec3), m: wp.mat33, tf: wp.transform, k: wp.vec2i,
                                 y: wp.array(dtype=wp.vec3)):
    i = wp.tid()
    y[i] = wp.transform_point(tf, m * x[i]) * float(k[0] + k[1])


def _quat_rotate(q, v):
    """q = (x, y, z, w), Warp's order."""
    u, w = q[:3], q[3]
    return v + 2.0 * jnp.cross(u, jnp.cross(u, v) + w * v)


X = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
Q = wp.quat_from_axis_angle(wp.normalize(wp.vec3(0.3, -1.0, 0.5)), 0.7)


def _warp_run(kernel, *values):
    x = wp.array(X, dtype=wp.vec3, requires_grad=True)
    y = wp.zeros(len(X), dtype=wp.vec3, requires_grad=True)
    tape = wp.Tape()
    with tape:
        wp.launch(kernel, len(X), inputs=[x, *values], outputs=[y])
    tape.backward(grads={y: wp.array(np.ones_like(X), dtype=wp.vec3)})
    return y.numpy(), x.grad.numpy()


def test_vector_and_quaternion_values_forward_and_gradient():
    f = warpnn.jax_kernel(rotate_scale_shift)
    x = jnp.asarray(X)
    (y,) = jax.jit(lambda x: f(x, wp.vec3(1.0, 2.0, 3.0), Q, 2.0))(x)
    want_y, want_grad = _warp_run(rotate_scale_shift, wp.vec3(1.0, 2.0, 3.0), Q, 2.0)
    assert_close(y, want_y)
    q = jnp.asarray(np.array(Q), jnp.float32)
    assert_close(y, jax.vmap(lambda v: _quat_rotate(q, 2.0 * v))(x) + jnp.array([1.0, 2.0, 3.0]), rtol=1e-5, atol=1e-5)
    # the same values as a tuple and a NumPy array; the gradient against wp.Tape and the pure-JAX reference
    grad = jax.grad(lambda x: f(x, (1.0, 2.0, 3.0), np.array(Q), 2.0)[0].sum())(x)
    assert_close(grad, want_grad)
    assert_close(grad, jax.grad(lambda x: jax.vmap(lambda v: _quat_rotate(q, 2.0 * v))(x).sum())(x), atol=1e-5)
    # another value is another static argument of the same kernel: no new twin
    (y2,) = f(x, (0.0, 0.0, 0.0), Q, 1.0)
    assert_close(y2, jax.vmap(lambda v: _quat_rotate(q, v))(x), atol=1e-5)
    assert _value_args.with_components(rotate_scale_shift) is _value_args.with_components(rotate_scale_shift)


def test_matrix_transform_and_integer_vector_values():
    m = wp.mat33(1.0, 0.5, 0.0, 0.0, 2.0, 0.0, 0.25, 0.0, 1.0)
    tf = wp.transform(wp.vec3(0.1, -0.2, 0.3), Q)
    f = warpnn.jax_kernel(through_matrix_and_transform)
    (y,) = f(jnp.asarray(X), m, tf, wp.vec2i(1, 2))
    want_y, want_grad = _warp_run(through_matrix_and_transform, m, tf, wp.vec2i(1, 2))
    assert_close(y, want_y, atol=1e-5)
    assert_close(jax.grad(lambda x: f(x, np.array(m), tf, (1, 2))[0].sum())(jnp.asarray(X)), want_grad, atol=1e-5)


def test_a_value_of_the_wrong_size_or_kind_is_an_error_naming_the_argument():
    f = warpnn.jax_kernel(rotate_scale_shift)
    x = jnp.asarray(X)
    with pytest.raises(TypeError, match=r"argument 'offset' is a static wp.vec3f \(3 components\), but got tuple"):
        f(x, (1.0, 2.0), Q, 2.0)
    with pytest.raises(TypeError, match=r"argument 'rot' is a static wp.quatf \(4 components\), but got str"):
        f(x, (1.0, 2.0, 3.0), "identity", 2.0)
    with pytest.raises(TypeError, match=r"takes 4 inputs \['x', 'offset', 'rot', 's'\].*called with 3"):
        f(x, Q, 2.0)


@wp.kernel
def fall(x: wp.array(dtype=wp.vec3), v: wp.array(dtype=wp.vec3), gravity: wp.vec3, dt: float,
         x_new: wp.array(dtype=wp.vec3), v_new: wp.array(dtype=wp.vec3)):
    i = wp.tid()
    v1 = v[i] + gravity * dt - 0.1 * v[i] * wp.length(v[i]) * dt  # (quadratic drag)
    v_new[i] = v1
    x_new[i] = x[i] + v1 * dt


def test_a_traced_program_passes_vector_values():
    x, v = wp.array(X, dtype=wp.vec3), wp.array(0.5 * X, dtype=wp.vec3)
    x1, v1 = wp.zeros_like(x), wp.zeros_like(v)

    def step():
        wp.launch(fall, len(X), inputs=[x, v, wp.vec3(0.0, 0.0, -9.8), 0.01], outputs=[x1, v1])

    program = warpnn.trace(step, {"x": x, "v": v}, {"x": x1, "v": v1})
    out = program({"x": jnp.asarray(X), "v": jnp.asarray(0.5 * X)})
    step()
    assert_close(out["x"], x1.numpy())
    assert_close(out["v"], v1.numpy())

    def loss(v0):  # (through the drag: nonlinear in v)
        return program({"x": jnp.asarray(X), "v": v0})["x"].sum()

    # wp.Tape on the same step
    xt = wp.array(X, dtype=wp.vec3, requires_grad=True)
    vt = wp.array(0.5 * X, dtype=wp.vec3, requires_grad=True)
    xo, vo = wp.zeros_like(xt), wp.zeros_like(vt)
    tape = wp.Tape()
    with tape:
        wp.launch(fall, len(X), inputs=[xt, vt, wp.vec3(0.0, 0.0, -9.8), 0.01], outputs=[xo, vo])
    tape.backward(grads={xo: wp.array(np.ones_like(X), dtype=wp.vec3)})
    assert_close(jax.grad(loss)(jnp.asarray(0.5 * X)), vt.grad.numpy())
    assert program.reverse_refusals() == {}
