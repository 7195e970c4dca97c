"""warpnn.nnx.WarpLayer: training with nnx.Optimizer, vmap/remat/scan, static attributes, checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, serialization

import warpnn
import warpnn.nnx

from .helpers import assert_close
from .layer_kernels import K_TRUE, SPRINGS, force_dataset, rollout, scale_by, spring_forces_reference


class ForceModel(nnx.Module):
    """Forces on a ring of points: Warp springs (trainable stiffness) plus a per-point MLP."""

    def __init__(self, edges, rest, rngs: nnx.Rngs):
        self.springs = warpnn.nnx.WarpLayer(
            SPRINGS, params={"k": jnp.ones(1)}, buffers={"edges": edges, "rest": rest}, static={"scale": 1.0}
        )
        self.hidden = nnx.Linear(3, 32, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):  # x: (n, 3) -> (n, 3)
        return self.springs(x) + self.out(jnp.tanh(self.hidden(x)))


def loss_fn(model, xs, target):
    return jnp.mean((jax.vmap(model)(xs) - target) ** 2)


def test_mixed_model_trains_with_nnx_optimizer():
    xs, target, edges, rest = force_dataset()
    model = ForceModel(edges, rest, nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(2e-2, weight_decay=1e-4), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        loss, grads = nnx.value_and_grad(loss_fn)(model, xs, target)
        optimizer.update(model, grads)
        return loss

    first = nnx.jit(loss_fn)(model, xs, target)
    for _ in range(150):
        loss = step(model, optimizer)
    assert loss < 0.05 * first, (first, loss)
    assert abs(model.springs.k[0] - K_TRUE) < 0.5 * abs(1.0 - K_TRUE)
    # Buffers are not nnx.Param: no gradient, no optimizer state, no weight decay.
    np.testing.assert_array_equal(model.springs.rest[...], rest)
    optimizer_paths = [path for path, _ in nnx.to_flat_state(nnx.state(optimizer))]
    assert any("k" in p for p in optimizer_paths) and not any("rest" in p or "edges" in p for p in optimizer_paths)


def test_vmap_remat_scan_match_reference():
    xs, _, edges, rest = force_dataset(num=3)
    layer = warpnn.nnx.WarpLayer(
        SPRINGS, params={"k": jnp.array([2.0])}, buffers={"edges": edges, "rest": rest}, static={"scale": 0.5}
    )

    def loss(force, xs):  # vmap over configurations of a scan rollout of a rematerialised layer
        return jnp.sum(jax.vmap(lambda x0: rollout(jax.checkpoint(lambda x: force(x)), x0))(xs) ** 2)

    got_loss, got = nnx.jit(nnx.value_and_grad(lambda layer: loss(layer, xs)))(layer)
    ref = lambda k: loss(lambda x: spring_forces_reference(x, edges, rest, k, 0.5), xs)  # noqa: E731
    want_loss, want = jax.jit(jax.value_and_grad(ref))(layer.k[...])
    assert_close(got_loss, want_loss, rtol=1e-5)
    assert_close(got["k"][...], want, rtol=1e-4)


def test_static_attribute_change_retraces():
    x, _, edges, rest = force_dataset(num=1)
    layer = warpnn.nnx.WarpLayer(SPRINGS, {"k": jnp.ones(1)}, {"edges": edges, "rest": rest}, {"scale": 1.0})
    traces = []

    @nnx.jit
    def forces(layer, x):
        traces.append(layer.scale)  # a Python float at trace time, never a tracer
        return layer(x)

    f1 = forces(layer, x[0])
    layer.k[...] = jnp.ones(1)  # a new param value: same graph, no retrace
    assert_close(forces(layer, x[0]), f1)
    layer.scale = 2.0
    assert_close(forces(layer, x[0]), 2 * f1, rtol=1e-5)
    assert traces == [1.0, 2.0]


def test_static_misuse_is_refused():
    x, _, edges, rest = force_dataset(num=1)
    fields = dict(params={"k": jnp.ones(1)}, buffers={"edges": edges, "rest": rest})
    with pytest.raises(TypeError, match=r"static value 'scale' .* is an array of shape \(1,\)"):
        warpnn.nnx.WarpLayer(SPRINGS, **fields, static={"scale": jnp.ones(1)})
    layer = warpnn.nnx.WarpLayer(SPRINGS, **fields, static={"scale": 1.0})
    with pytest.raises(TypeError, match=r"static value 'scale' .* is a traced value"):
        nnx.jit(lambda layer, s: (setattr(layer, "scale", s), layer(x[0]))[1])(layer, jnp.float32(2.0))
    layer.k = jnp.ones(1)
    with pytest.raises(TypeError, match=r"WarpLayer.k is a bare \(1,\) array.*layer.k = nnx.Param\(array\)"):
        layer(x[0])
    with pytest.raises(ValueError, match=r"argument 'train' would hide nnx.Module.train"):
        warpnn.nnx.WarpLayer(warpnn.bind(scale_by, inputs=["x"]), static={"train": 2.0})


def test_checkpoint_round_trip(tmp_path):
    xs, _, edges, rest = force_dataset(num=2)
    model = ForceModel(edges, rest, nnx.Rngs(0))
    model.springs.k[...] = jnp.array([2.5])
    path = tmp_path / "model.msgpack"
    warpnn.atomic_write_bytes(path, serialization.msgpack_serialize(nnx.to_pure_dict(nnx.state(model))))

    restored = ForceModel(edges, jnp.zeros_like(rest), nnx.Rngs(1))  # different values, same structure
    state = nnx.state(restored)
    nnx.replace_by_pure_dict(state, serialization.msgpack_restore(path.read_bytes()))
    nnx.update(restored, state)
    for saved, loaded in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(restored)), strict=True):
        np.testing.assert_array_equal(loaded, saved)  # the checkpoint holds the values bit for bit
    np.testing.assert_array_equal(restored.springs.rest[...], rest)
    # The spring forces scatter with atomic adds, whose order (so the last bit) varies between GPU launches.
    assert_close(jax.vmap(restored)(xs), jax.vmap(model)(xs), rtol=1e-6, atol=1e-6)
