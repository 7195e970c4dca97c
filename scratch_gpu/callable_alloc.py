"""GPU probe: jax_callable that allocates inside, under jit(grad(scan)) (issue 29 item 4)."""
import time, traceback
import jax, jax.numpy as jnp, numpy as np, warp as wp
import warpnn

@wp.kernel
def tension(x: wp.array(dtype=float), k: wp.array(dtype=float), t: wp.array(dtype=float)):
    s = wp.tid()
    t[s] = k[s] * (x[s + 1] - x[s])

@wp.kernel
def scatter(t: wp.array(dtype=float), f: wp.array(dtype=float)):
    s = wp.tid()
    wp.atomic_add(f, s, t[s])
    wp.atomic_sub(f, s + 1, t[s])

def step(x: wp.array(dtype=float), k: wp.array(dtype=float), f: wp.array(dtype=float)):
    t = wp.zeros(k.shape, dtype=float, device=k.device, requires_grad=True)
    wp.launch(tension, dim=k.shape, inputs=[x, k], outputs=[t])
    wp.launch(scatter, dim=k.shape, inputs=[t], outputs=[f])

xs, ks = jnp.linspace(0.0, 1.0, 5) ** 2, jnp.ones(4)

def run(mode_name, **kw):
    f = warpnn.jax_callable(step, **kw)
    def loss(k):
        def body(c, _):
            return c + 0.01 * f(c, k)[0], None
        y, _ = jax.lax.scan(body, xs, None, length=10)
        return (y ** 2).sum()
    try:
        v = jax.jit(loss)(ks); g = jax.jit(jax.grad(loss))(ks)
        # reference: pure JAX
        def ref(k):
            def body(c, _):
                t = k * (c[1:] - c[:-1])
                fo = jnp.zeros_like(c).at[:-1].add(t).at[1:].add(-t)
                return c + 0.01 * fo, None
            y, _ = jax.lax.scan(body, xs, None, length=10)
            return (y ** 2).sum()
        print(mode_name, "ok value err", float(abs(v - ref(ks))), "grad err", float(jnp.abs(g - jax.grad(ref)(ks)).max()))
    except Exception as e:
        print(mode_name, "FAILED", type(e).__name__, str(e)[:300])

print(jax.devices())
run("default (JAX graph mode)")
run("graph_mode NONE", graph_mode=wp.JaxCallableGraphMode.NONE)
run("graph_mode WARP", graph_mode=wp.JaxCallableGraphMode.WARP)
