"""A Warp spring layer in an Equinox model, trained with optax: it recovers the springs' stiffness."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import warp as wp

import warpnn.equinox

wp.config.log_level = wp.LOG_WARNING  # quiet: no Warp banner or module-load lines (wp.LOG_INFO shows them)


@wp.kernel
def springs(x: wp.array(dtype=wp.vec3), edges: wp.array(dtype=wp.vec2i), k: wp.array(dtype=float), rest: float,
            f: wp.array(dtype=wp.vec3)):
    e = wp.tid()  # one thread per spring; k is a trainable scalar, read as k[0]
    d = x[edges[e][1]] - x[edges[e][0]]
    wp.atomic_add(f, edges[e][0], k[0] * (wp.length(d) - rest) * wp.normalize(d))
    wp.atomic_sub(f, edges[e][1], k[0] * (wp.length(d) - rest) * wp.normalize(d))


class Model(eqx.Module):  # Warp springs plus an MLP for the remaining (external) force
    springs: warpnn.equinox.WarpLayer
    mlp: eqx.nn.MLP

    def __call__(self, x):  # (16, 3) -> (16, 3)
        return self.springs(x) + jax.vmap(self.mlp)(x)


binding = warpnn.bind(springs, inputs=["x"], launch_dims="edges", output_dims="x")
edges = jnp.stack([jnp.arange(15), jnp.arange(1, 16)], 1).astype(jnp.int32)  # a chain of 16 points
layer = lambda k: warpnn.equinox.WarpLayer(binding, {"k": jnp.array([k])}, {"edges": edges}, {"rest": 0.5})  # noqa: E731
xs = jax.random.normal(jax.random.PRNGKey(0), (32, 16, 3))  # 32 configurations
target = jax.vmap(layer(3.0))(xs) + jnp.array([0.0, 0.0, -1.0])  # stiffness 3, plus gravity
model = Model(layer(1.0), eqx.nn.MLP(3, 3, 16, 1, key=jax.random.PRNGKey(1)))
tx = optax.adam(2e-2)
opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def step(model, opt_state):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(xs) - target) ** 2))(model)
    updates, opt_state = tx.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state, loss


for i in range(301):
    model, opt_state, loss = step(model, opt_state)
print(f"loss {loss:.4f}, stiffness {model.springs.params['k'][0]:.3f} (true: 3)")
