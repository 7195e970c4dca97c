"""warpnn.equinox.WarpLayer: training with optax, vmap/remat/scan, static fields, checkpoints."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import warpnn
import warpnn.equinox

from .helpers import assert_close
from .layer_kernels import K_TRUE, SPRINGS, force_dataset, rollout, spring_forces_reference


class ForceModel(eqx.Module):
    """Forces on a ring of points: Warp springs (trainable stiffness) plus a per-point MLP."""

    springs: warpnn.equinox.WarpLayer
    mlp: eqx.nn.MLP

    def __init__(self, edges, rest, key):
        self.springs = warpnn.equinox.WarpLayer(
            SPRINGS, params={"k": jnp.ones(1)}, buffers={"edges": edges, "rest": rest}, static={"scale": 1.0}
        )
        self.mlp = eqx.nn.MLP(3, 3, width_size=32, depth=1, activation=jnp.tanh, key=key)

    def __call__(self, x):  # x: (n, 3) -> (n, 3)
        return self.springs(x) + jax.vmap(self.mlp)(x)


def loss_fn(model, xs, target):
    return jnp.mean((jax.vmap(model)(xs) - target) ** 2)


@pytest.mark.parametrize("filter_spec", ["is_inexact_array", "trainable"])
def test_mixed_model_trains_with_optax(key, filter_spec):
    xs, target, edges, rest = force_dataset()
    model = ForceModel(edges, rest, key)
    spec = eqx.is_inexact_array if filter_spec == "is_inexact_array" else warpnn.equinox.trainable(model)
    # adamw's decoupled weight decay would move anything in the optimizer's view: buffers must not be.
    optimizer = optax.adamw(2e-2, weight_decay=1e-4) if filter_spec == "trainable" else optax.adam(2e-2)
    opt_state = optimizer.init(eqx.filter(model, spec))

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, xs, target)
        updates, opt_state = optimizer.update(eqx.filter(grads, spec), opt_state, eqx.filter(model, spec))
        return eqx.apply_updates(model, updates), opt_state, loss

    first = eqx.filter_jit(loss_fn)(model, xs, target)
    for _ in range(150):
        model, opt_state, loss = step(model, opt_state)
    assert loss < 0.05 * first, (first, loss)
    assert abs(model.springs.params["k"][0] - K_TRUE) < 0.5 * abs(1.0 - K_TRUE)
    np.testing.assert_array_equal(model.springs.buffers["rest"], rest)  # a float buffer: never updated


def test_trainable_spec_leaves_out_buffers_only(key):
    _, _, edges, rest = force_dataset()
    model = ForceModel(edges, rest, key)
    spec = warpnn.equinox.trainable(model)
    assert spec.springs.params == {"k": True}
    assert spec.springs.buffers == {"edges": False, "rest": False}
    assert spec.mlp == jax.tree.map(eqx.is_inexact_array, model.mlp)


def test_vmap_remat_scan_match_reference(key):
    xs, _, edges, rest = force_dataset(num=3)
    layer = warpnn.equinox.WarpLayer(
        SPRINGS, params={"k": jnp.array([2.0])}, buffers={"edges": edges, "rest": rest}, static={"scale": 0.5}
    )

    def loss(force, xs):  # vmap over configurations of a scan rollout of a rematerialised layer
        return jnp.sum(jax.vmap(lambda x0: rollout(eqx.filter_checkpoint(force), x0))(xs) ** 2)

    got_loss, got = eqx.filter_jit(eqx.filter_value_and_grad(lambda layer: loss(layer, xs)))(layer)
    ref = lambda k: loss(lambda x: spring_forces_reference(x, edges, rest, k, 0.5), xs)  # noqa: E731
    want_loss, want = jax.jit(jax.value_and_grad(ref))(layer.params["k"])
    assert_close(got_loss, want_loss, rtol=1e-5)
    assert_close(got.params["k"], want, rtol=1e-4)


def test_static_field_change_retraces(key):
    x, _, edges, rest = force_dataset(num=1)
    layer = warpnn.equinox.WarpLayer(SPRINGS, {"k": jnp.ones(1)}, {"edges": edges, "rest": rest}, {"scale": 1.0})
    traces = []

    @eqx.filter_jit
    def forces(layer, x):
        traces.append(layer.static["scale"])  # a Python float at trace time, never a tracer
        return layer(x)

    f1 = forces(layer, x[0])
    f1_again = forces(eqx.tree_at(lambda m: m.params["k"], layer, jnp.ones(1)), x[0])  # new array: no retrace
    f2 = forces(dataclasses.replace(layer, static={"scale": 2.0}), x[0])
    assert traces == [1.0, 2.0]
    assert_close(f1_again, f1)
    assert_close(f2, 2 * f1, rtol=1e-5)


def test_static_misuse_is_refused():
    _, _, edges, rest = force_dataset(num=1)
    fields = dict(params={"k": jnp.ones(1)}, buffers={"edges": edges, "rest": rest})
    with pytest.raises(TypeError, match=r"static value 'scale' .* is an array of shape \(1,\)(.|\n)*scale\[0\]"):
        warpnn.equinox.WarpLayer(SPRINGS, **fields, static={"scale": jnp.ones(1)})
    with pytest.raises(TypeError, match=r"static value 'scale' .* is a traced value.*built outside jax.jit"):
        jax.jit(lambda s: warpnn.equinox.WarpLayer(SPRINGS, **fields, static={"scale": s}).params["k"])(1.0)


def test_checkpoint_round_trip(key, tmp_path):
    xs, target, edges, rest = force_dataset(num=2)
    model = ForceModel(edges, rest, key)
    model = eqx.tree_at(lambda m: m.springs.params["k"], model, jnp.array([2.5]))
    path = tmp_path / "model.eqx"
    with warpnn.atomic_write(path) as f:
        eqx.tree_serialise_leaves(f, model)

    like = ForceModel(edges, jnp.zeros_like(rest), jax.random.PRNGKey(1))  # different values, same structure
    restored = eqx.tree_deserialise_leaves(path, like)
    arrays = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
    for saved, loaded in zip(arrays(model), arrays(restored), strict=True):
        np.testing.assert_array_equal(loaded, saved)  # the checkpoint holds the values bit for bit
    np.testing.assert_array_equal(restored.springs.buffers["rest"], rest)
    # The spring forces scatter with atomic adds, whose order (so the last bit) varies between GPU launches.
    assert_close(jax.vmap(restored)(xs), jax.vmap(model)(xs), rtol=1e-6, atol=1e-6)
