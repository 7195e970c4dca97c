"""wp.struct arguments: a dict of the struct's fields (arrays differentiable, scalars static, nested structs),
checked against pure JAX and against wp.Tape on the same Warp kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _launch

from .helpers import assert_close

N = 6


@wp.struct
class Material:
    weight: wp.array(dtype=float)
    scale: float


@wp.struct
class Body:
    x: wp.array(dtype=wp.vec3)
    stiffness: float
    material: Material


@wp.func
def material_term(m: Material, i: int):
    return m.weight[i] * m.weight[i] * m.scale


@wp.kernel
def body_energy(body: Body, offset: wp.array(dtype=float), e: wp.array(dtype=float)):
    i = wp.tid()
    e[i] = body.stiffness * wp.length_sq(body.x[i]) + material_term(body.material, i) + offset[i]


@wp.kernel
def writes_struct_field(body: Body, e: wp.array(dtype=float)):
    i = wp.tid()
    e[i] = body.stiffness
    body.material.weight[i] = 0.0


def body_energy_ref(x, weight, offset):
    return 2.0 * jnp.sum(x * x, axis=1) + weight * weight * 0.5 + offset


def _inputs(key):
    kx, kw, ko = jax.random.split(key, 3)
    return jax.random.normal(kx, (N, 3)), jax.random.normal(kw, (N,)), jax.random.normal(ko, (N,))


def _body(x, weight):
    return {"x": x, "stiffness": 2.0, "material": {"weight": weight, "scale": 0.5}}


@pytest.mark.parametrize("launcher", ["native", "python"])
def test_struct_fields_forward_and_gradients_match_pure_jax_and_tape(key, launcher):
    with _launch.use_launcher(launcher):
        f = warpnn.jax_kernel(body_energy)
        x, weight, offset = _inputs(key)
        (e,) = jax.jit(lambda x, w, o: f(_body(x, w), o))(x, weight, offset)
        assert_close(e, body_energy_ref(x, weight, offset), 1e-5, 1e-5)
        ct = jnp.cos(e)
        grads = jax.grad(lambda x, w, o: jnp.sum(jnp.sin(f(_body(x, w), o)[0])), (0, 1, 2))(x, weight, offset)
        refs = jax.grad(lambda x, w, o: jnp.sum(jnp.sin(body_energy_ref(x, w, o))), (0, 1, 2))(x, weight, offset)
        for got, want in zip(grads, refs):
            assert_close(got, want, 1e-5, 1e-5)

    # wp.Tape on the same kernel, with the same cotangent
    wx = wp.array(np.asarray(x), dtype=wp.vec3, requires_grad=True)
    ww = wp.array(np.asarray(weight), dtype=float, requires_grad=True)
    wo = wp.array(np.asarray(offset), dtype=float, requires_grad=True)
    material, body = Material(), Body()
    material.weight, material.scale = ww, 0.5
    body.x, body.stiffness, body.material = wx, 2.0, material
    out = wp.zeros(N, dtype=float, requires_grad=True)
    tape = wp.Tape()
    with tape:
        wp.launch(body_energy, dim=N, inputs=[body, wo], outputs=[out])
    tape.backward(grads={out: wp.array(np.asarray(ct), dtype=float)})
    for got, want in zip(grads, (wx.grad.numpy(), ww.grad.numpy(), wo.grad.numpy())):
        assert_close(got, jnp.asarray(want), 1e-5, 1e-6)


def test_struct_under_vmap_with_batched_and_shared_fields(key):
    f = warpnn.jax_kernel(body_energy)
    x, weight, offset = _inputs(key)
    xb = x[None] + jax.random.normal(key, (3, N, 3))
    got = jax.vmap(lambda x: f(_body(x, weight), offset)[0])(xb)
    assert_close(got, jax.vmap(lambda x: body_energy_ref(x, weight, offset))(xb), 1e-5, 1e-5)


def test_struct_errors_name_the_field():
    f = warpnn.jax_kernel(body_energy)
    x, weight, offset = _inputs(jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match=r"argument 'body' is the wp.struct .*Body.* lacks \['stiffness'\]"):
        f({"x": x, "material": {"weight": weight, "scale": 0.5}}, offset)
    with pytest.raises(TypeError, match=r"argument 'body.material' is the wp.struct .*: pass a dict of its fields"):
        f({"x": x, "stiffness": 1.0, "material": 3.0}, offset)
    with pytest.raises(TypeError, match=r"argument 'body.x' expects dtype float32"):
        f(_body(x.astype(jnp.int32), weight), offset)
    with pytest.raises(TypeError, match=r"writes .*'body.material.weight' held in a struct argument"):
        warpnn.jax_kernel(writes_struct_field)


def test_struct_analysis_follows_fields_through_functions():
    sig = warpnn.jax_kernel(body_energy).signature
    assert [a.kind for a in sig.uses["body.material.weight"].accesses] == ["read", "read"]
    assert sig.uses["body.material.weight"].accesses[0].via == "material_term"
    assert [a.name for a in sig.array_inputs] == ["body.x", "body.material.weight", "offset"]
