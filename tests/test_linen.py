"""warpnn.linen.WarpLayer: training with a TrainState, vmap/remat/scan, static attributes, checkpoints."""

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from flax.training.train_state import TrainState

import warpnn
import warpnn.linen

from .helpers import assert_close
from .layer_kernels import K_TRUE, SPRINGS, force_dataset, rollout, spring_forces_reference


class ForceModel(nn.Module):
    """Forces on a ring of points: Warp springs (trainable stiffness) plus a per-point MLP."""

    edges: jax.Array
    rest: jax.Array
    k_init: Callable = nn.initializers.ones

    @nn.compact
    def __call__(self, x):  # x: (n, 3) -> (n, 3)
        springs = warpnn.linen.WarpLayer(
            SPRINGS,
            params={"k": (self.k_init, (1,))},
            buffers={"edges": self.edges, "rest": self.rest},
            static={"scale": 1.0},
            name="springs",
        )
        return springs(x) + nn.Dense(3)(jnp.tanh(nn.Dense(32)(x)))


def test_mixed_model_trains_with_train_state():
    xs, target, edges, rest = force_dataset()
    model = ForceModel(edges, rest)
    variables = model.init(jax.random.PRNGKey(0), xs[0])
    buffers = variables[warpnn.linen.BUFFERS]
    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optax.adam(2e-2))

    def loss_fn(params):
        forces = jax.vmap(lambda x: state.apply_fn({"params": params, "buffers": buffers}, x))(xs)
        return jnp.mean((forces - target) ** 2)

    @jax.jit
    def step(state):
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    first = jax.jit(loss_fn)(state.params)
    for _ in range(150):
        state, loss = step(state)
    assert loss < 0.05 * first, (first, loss)
    k = state.params["springs"]["k"]
    assert abs(k[0] - K_TRUE) < 0.5 * abs(1.0 - K_TRUE)
    np.testing.assert_array_equal(buffers["springs"]["rest"], rest)


def test_param_initializer_forms():
    x, _, edges, rest = force_dataset(num=1)
    fields = dict(buffers={"edges": edges, "rest": rest}, static={"scale": 1.0})
    key = jax.random.PRNGKey(0)
    for k in (jnp.array([1.5]), lambda key: jnp.array([1.5]), (nn.initializers.constant(1.5), (1,))):
        variables = warpnn.linen.WarpLayer(SPRINGS, params={"k": k}, **fields).init(key, x[0])
        np.testing.assert_array_equal(variables["params"]["k"], [1.5])
        assert set(variables[warpnn.linen.BUFFERS]) == {"edges", "rest"}


def test_vmap_remat_scan_match_reference():
    xs, _, edges, rest = force_dataset(num=3)
    layer = warpnn.linen.WarpLayer(
        SPRINGS, params={"k": jnp.array([2.0])}, buffers={"edges": edges, "rest": rest}, static={"scale": 0.5}
    )
    variables = layer.init(jax.random.PRNGKey(0), xs[0])

    def loss(force, xs):  # vmap over configurations of a scan rollout of a rematerialised layer
        return jnp.sum(jax.vmap(lambda x0: rollout(jax.checkpoint(force), x0))(xs) ** 2)

    warp_loss = lambda params: loss(lambda x: layer.apply({**variables, "params": params}, x), xs)  # noqa: E731
    got_loss, got = jax.jit(jax.value_and_grad(warp_loss))(variables["params"])
    ref = lambda k: loss(lambda x: spring_forces_reference(x, edges, rest, k, 0.5), xs)  # noqa: E731
    want_loss, want = jax.jit(jax.value_and_grad(ref))(variables["params"]["k"])
    assert_close(got_loss, want_loss, rtol=1e-5)
    assert_close(got["k"], want, rtol=1e-4)


def test_remat_module_transform():
    """nn.remat (Linen's lifted jax.checkpoint) of the layer gives the plain layer's values and gradients."""
    x, _, edges, rest = force_dataset(num=1)
    fields = dict(params={"k": jnp.array([2.0])}, buffers={"edges": edges, "rest": rest}, static={"scale": 0.5})
    plain, remat = warpnn.linen.WarpLayer(SPRINGS, **fields), nn.remat(warpnn.linen.WarpLayer)(SPRINGS, **fields)
    variables = plain.init(jax.random.PRNGKey(0), x[0])
    def grad(module):
        objective = lambda p: jnp.sum(module.apply({**variables, "params": p}, x[0]) ** 2)  # noqa: E731
        return jax.jit(jax.grad(objective))(variables["params"])["k"]

    want = jax.jit(jax.grad(lambda k: jnp.sum(spring_forces_reference(x[0], edges, rest, k, 0.5) ** 2)))(jnp.array([2.0]))
    assert_close(grad(remat), want, rtol=1e-4)
    assert_close(grad(remat), grad(plain))


def test_static_attribute_change_via_clone():
    x, _, edges, rest = force_dataset(num=1)
    layer = warpnn.linen.WarpLayer(SPRINGS, {"k": jnp.ones(1)}, {"edges": edges, "rest": rest}, {"scale": 1.0})
    variables = layer.init(jax.random.PRNGKey(0), x[0])
    f1 = jax.jit(layer.apply)(variables, x[0])  # static values stay Python numbers under jit
    f2 = jax.jit(layer.clone(static={"scale": 2.0}).apply)(variables, x[0])
    assert_close(f2, 2 * f1, rtol=1e-5)


def test_static_misuse_is_refused_at_construction():
    _, _, edges, rest = force_dataset(num=1)
    fields = dict(params={"k": jnp.ones(1)}, buffers={"edges": edges, "rest": rest})
    with pytest.raises(TypeError, match=r"static value 'scale' .* is an array of shape \(\)"):
        warpnn.linen.WarpLayer(SPRINGS, **fields, static={"scale": jnp.float32(1.0)})
    with pytest.raises(TypeError, match=r"static value 'scale' .* is a traced value"):
        jax.jit(lambda s: warpnn.linen.WarpLayer(SPRINGS, **fields, static={"scale": s}).static["scale"])(1.0)
    with pytest.raises(ValueError, match=r"arguments \['rest'\] are not bound"):
        warpnn.linen.WarpLayer(SPRINGS, params={"k": jnp.ones(1)}, buffers={"edges": edges}, static={"scale": 1.0})


def test_checkpoint_round_trip(tmp_path):
    xs, _, edges, rest = force_dataset(num=2)
    model = ForceModel(edges, rest, k_init=nn.initializers.constant(2.5))
    variables = model.init(jax.random.PRNGKey(0), xs[0])
    path = tmp_path / "variables.msgpack"
    warpnn.atomic_write_bytes(path, serialization.to_bytes(variables))

    like = ForceModel(edges, rest).init(jax.random.PRNGKey(1), xs[0])  # different values, same structure
    restored = serialization.from_bytes(like, path.read_bytes())
    for saved, loaded in zip(jax.tree.leaves(variables), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(loaded, saved)  # the checkpoint holds the values bit for bit
    apply = jax.vmap(lambda v, x: model.apply(v, x), (None, 0))
    # The spring forces scatter with atomic adds, whose order (so the last bit) varies between GPU launches.
    assert_close(apply(restored, xs), apply(variables, xs), rtol=1e-6, atol=1e-6)
