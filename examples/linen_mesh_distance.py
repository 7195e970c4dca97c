"""A Flax Linen model with a Warp mesh-distance layer: an MLP learns to move points onto a torus."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import warp as wp

import warpnn
import warpnn.linen
from warpnn.kernels.mesh import make_mesh, signed_distance_kernel
from warpnn_models.mesh import torus

wp.config.log_level = wp.LOG_WARNING  # quiet: no Warp banner or module-load lines (wp.LOG_INFO shows them)

mesh = make_mesh(*torus(major=1.0, minor=0.35))  # a wp.Mesh on JAX's device; the layer keeps it alive
binding = warpnn.bind(signed_distance_kernel, inputs=["points"], num_outputs=2)  # -> (sdf, normal)


class SnapToSurface(nn.Module):
    @nn.compact
    def __call__(self, x):  # (n, 3) points -> moved points (n, 3) and their signed distance (n,)
        h = nn.gelu(nn.Dense(64)(nn.gelu(nn.Dense(64)(x))))
        y = x + nn.Dense(3, kernel_init=nn.initializers.zeros)(h)
        sdf, _ = warpnn.linen.WarpLayer(binding, static={"mesh": mesh, "max_dist": 1.0e6})(y)
        return y, sdf


x = jax.random.uniform(jax.random.PRNGKey(0), (2048, 3), minval=-1.5, maxval=1.5)
model = SnapToSurface()
params = model.init(jax.random.PRNGKey(1), x)
optimizer = optax.adam(3e-3)
opt_state = optimizer.init(params)


@jax.jit
def step(params, opt_state):
    def loss(p):  # gradients reach the MLP through Warp's adjoint of the closest-point query
        y, sdf = model.apply(p, x)
        return jnp.mean(sdf**2) + 1e-3 * jnp.mean((y - x) ** 2)

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, value


before = jnp.abs(model.apply(params, x)[1]).mean()
for i in range(300):
    params, opt_state, value = step(params, opt_state)
print(f"mean |distance to the torus|: {before:.3f} -> {jnp.abs(model.apply(params, x)[1]).mean():.4f}")
