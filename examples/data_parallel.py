"""Data-parallel training of a Warp spring layer on every device, with JAX's own sharding.

The batch is split over a 1-D device mesh, the model is replicated, and the step is a plain
``eqx.filter_jit``: each device launches the Warp kernels on its own configurations, XLA all-reduces the
gradients. On a CPU-only machine it runs on 4 virtual devices.
"""

import os

if "JAX_PLATFORMS" not in os.environ and not os.path.exists("/dev/nvidia0"):  # CPU: 4 virtual devices
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import warp as wp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import warpnn.equinox  # noqa: E402

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
layer = lambda k: warpnn.equinox.WarpLayer(binding, {"k": jnp.array([k])}, {"edges": edges}, {"rest": 0.5})  # noqa: E731

mesh = jax.make_mesh((jax.device_count(),), ("data",))
xs = jax.random.normal(jax.random.PRNGKey(0), (32 * jax.device_count(), 16, 3))  # 32 configurations per device
target = jax.vmap(layer(3.0))(xs)  # forces of springs of stiffness 3
# The batch is split over the devices; the model and optimizer state are whole on each.
xs, target = jax.device_put((xs, target), NamedSharding(mesh, P("data")))
model = jax.device_put(layer(1.0), NamedSharding(mesh, P()))
tx = optax.adam(5e-2)
opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))


@eqx.filter_jit
def step(model, opt_state, xs, target):  # data as arguments: a closed-over constant would be replicated
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(xs) - target) ** 2))(model)
    updates, opt_state = tx.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state, loss


for i in range(200):
    model, opt_state, loss = step(model, opt_state, xs, target)
print(f"{jax.device_count()} devices: loss {loss:.2e}, stiffness {model.params['k'][0]:.3f} (true: 3)")
