import jax, jax.numpy as jnp, warp as wp, warpnn
exec(open("scratch_gpu/callable_alloc.py").read().split("xs, ks =")[0].split("import warpnn\n",1)[1])
xs, ks = jnp.linspace(0.0, 1.0, 5) ** 2, jnp.ones(4)
f = warpnn.jax_callable(step)
def fwd(k):
    def body(c, _):
        return c + 0.01 * f(c, k)[0], None
    return jax.lax.scan(body, xs, None, length=10)[0].sum()
for name, fn in (("jit(scan) forward, JAX mode", jax.jit(fwd)), ("jit(grad(scan)), JAX mode", jax.jit(jax.grad(fwd)))):
    try:
        print(name, "ok", jax.block_until_ready(fn(ks)))
    except Exception as e:
        print(name, "FAILED", str(e)[:150])
