"""A Warp spring layer in a Flax NNX model, trained with nnx.Optimizer: it recovers the springs' stiffness."""

import jax
import jax.numpy as jnp
import optax
import warp as wp
from flax import nnx

import warpnn.nnx

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
layer = lambda k: warpnn.nnx.WarpLayer(binding, {"k": jnp.array([k])}, {"edges": edges}, {"rest": 0.5})  # noqa: E731


class Model(nnx.Module):  # Warp springs plus an MLP for the remaining (external) force
    def __init__(self, rngs: nnx.Rngs):
        self.springs = layer(1.0)  # k: nnx.Param, edges: warpnn.nnx.Buffer, rest: a static attribute
        self.hidden, self.out = nnx.Linear(3, 16, rngs=rngs), nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):  # (16, 3) -> (16, 3)
        return self.springs(x) + self.out(jax.nn.relu(self.hidden(x)))


xs = jax.random.normal(jax.random.PRNGKey(0), (32, 16, 3))  # 32 configurations
target = jax.vmap(layer(3.0))(xs) + jnp.array([0.0, 0.0, -1.0])  # stiffness 3, plus gravity
model = Model(nnx.Rngs(1))
optimizer = nnx.Optimizer(model, optax.adam(2e-2), wrt=nnx.Param)


@nnx.jit
def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((jax.vmap(m)(xs) - target) ** 2))(model)
    optimizer.update(model, grads)
    return loss


for i in range(301):
    loss = step(model, optimizer)
print(f"loss {loss:.4f}, stiffness {model.springs.k[0]:.3f} (true: 3)")
