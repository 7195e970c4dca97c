"""A Warp spring layer in a Flax Linen model, trained with a TrainState: it recovers the springs' stiffness."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import warp as wp
from flax.training.train_state import TrainState

import warpnn.linen

wp.config.log_level = wp.LOG_WARNING  # quiet: no Warp banner or module-load lines (wp.LOG_INFO shows them)


@wp.kernel
def springs(x: wp.array(dtype=wp.vec3), edges: wp.array(dtype=wp.vec2i), k: wp.array(dtype=float), rest: float,
            f: wp.array(dtype=wp.vec3)):
    e = wp.tid()  # one thread per spring; k is a trainable scalar, read as k[0]
    d = x[edges[e][1]] - x[edges[e][0]]
    wp.atomic_add(f, edges[e][0], k[0] * (wp.length(d) - rest) * wp.normalize(d))
    wp.atomic_sub(f, edges[e][1], k[0] * (wp.length(d) - rest) * wp.normalize(d))


binding = warpnn.bind(springs, inputs=["x"], launch_dims="edges", output_dims="x")
edges = jnp.stack([jnp.arange(15), jnp.arange(1, 16)], 1).astype(jnp.int32)  # a chain of 16 points
layer = lambda k: warpnn.linen.WarpLayer(binding, {"k": jnp.array([k])}, {"edges": edges}, {"rest": 0.5})  # noqa: E731


class Model(nn.Module):  # Warp springs plus an MLP for the remaining (external) force
    @nn.compact
    def __call__(self, x):  # (16, 3) -> (16, 3)
        return layer(1.0)(x) + nn.Dense(3)(nn.relu(nn.Dense(16)(x)))


xs = jax.random.normal(jax.random.PRNGKey(0), (32, 16, 3))  # 32 configurations
teacher = layer(3.0)
target = jax.vmap(lambda x: teacher.apply(teacher.init(jax.random.PRNGKey(0), x), x))(xs) + jnp.array([0.0, 0.0, -1.0])
model = Model()
variables = model.init(jax.random.PRNGKey(1), xs[0])  # {"params": ..., "buffers": {"WarpLayer_0": {"edges"}}}
state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optax.adam(2e-2))


@jax.jit
def step(state):
    forces = lambda p: jax.vmap(lambda x: state.apply_fn({**variables, "params": p}, x))(xs)  # noqa: E731
    loss, grads = jax.value_and_grad(lambda p: jnp.mean((forces(p) - target) ** 2))(state.params)
    return state.apply_gradients(grads=grads), loss


for i in range(301):
    state, loss = step(state)
print(f"loss {loss:.4f}, stiffness {state.params['WarpLayer_0']['k'][0]:.3f} (true: 3)")
