"""Tile kernels (warpnn.kernels.tiles) against jnp.matmul: forward, gradients, vmap, and an optax-trained MLP."""

import jax
import jax.numpy as jnp
import optax
import pytest
import warp as wp

import warpnn
from warpnn.kernels import tiles

from .helpers import assert_close


# On a GPU, Warp's tile_matmul and XLA's dot both use TF32 tensor cores for float32 (10-bit mantissas).
TOL = (1e-5, 1e-4) if jax.default_backend() == "cpu" else (5e-3, 2e-2)


def _matmul_highest(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.parametrize("shape", [(32, 16, 32), (40, 24, 70), (5, 3, 7)])
def test_tile_matmul_forward_and_gradient_match_jnp_matmul(shape, key):
    m, k, n = shape
    ka, kb, kw = jax.random.split(key, 3)
    a, b = jax.random.normal(ka, (m, k)), jax.random.normal(kb, (k, n))
    w = jax.random.normal(kw, (m, n))
    assert_close(jax.jit(tiles.tile_matmul)(a, b), _matmul_highest(a, b), *TOL)
    loss = lambda mm: lambda a, b: jnp.vdot(w, jnp.tanh(mm(a, b)))
    g = jax.grad(loss(tiles.tile_matmul), (0, 1))(a, b)
    g_ref = jax.grad(loss(_matmul_highest), (0, 1))(a, b)
    assert_close(g[0], g_ref[0], *TOL)
    assert_close(g[1], g_ref[1], *TOL)


def test_tile_matmul_with_cpu_blocks_and_under_vmap(key):
    a = jax.random.normal(key, (3, 32, 16))
    b = jax.random.normal(jax.random.PRNGKey(5), (16, 32))
    assert_close(jax.vmap(lambda a: tiles.tile_matmul(a, b))(a), jnp.einsum("bmk,kn->bmn", a, b, precision="highest"), *TOL)
    saved = wp.config.enable_cpu_blocks
    wp.config.enable_cpu_blocks = True
    # 16 cooperative threads per block on the CPU (a separate module build); on the H200 cuBLASDx refuses a
    # 16-thread 32x32x16 tile GEMM (its LTO compile fails), so the GPU takes 128
    bd = 16 if jax.default_backend() == "cpu" else 128
    try:
        assert_close(tiles.tile_matmul(a[0], b, block_dim=bd), _matmul_highest(a[0], b), *TOL)
        g = jax.grad(lambda a: tiles.tile_matmul(a, b, block_dim=bd).sum())(a[0])
        assert_close(g, jnp.broadcast_to(b.sum(1), (32, 16)), *TOL)
    finally:
        wp.config.enable_cpu_blocks = saved


def test_a_vmapped_tile_kernel_launches_its_cpu_batch_on_one_thread():
    """Warp's CPU tiles share one static pointer to their memory per module, so two threads in a tile kernel at
    once would use each other's tiles: the native handler runs a tile kernel's batch one element after another,
    whatever the CPU threads."""
    from warpnn import _batched
    from warpnn._launch import LAUNCHER

    if LAUNCHER.name != "native" or jax.default_backend() != "cpu":
        pytest.skip("CPU threads are the native CPU handler's")
    assert not _batched.cpu_thread_safe(tiles.tile_matmul_kernel)
    twins = LAUNCHER.impl.twins
    saved = _batched._LAUNCH_CONFIG.get()
    a = jax.random.normal(jax.random.PRNGKey(3), (6, 32, 16))
    b = jax.random.normal(jax.random.PRNGKey(4), (16, 32))
    try:
        twins.set_cpu_threads(3, 1)
        jax.clear_caches()
        before = twins.threaded_launches()
        for _ in range(5):
            got = jax.vmap(lambda a: tiles.tile_matmul(a, b))(a)
            assert_close(got, jnp.einsum("bmk,kn->bmn", a, b, precision="highest"), *TOL)
        assert twins.threaded_launches() == before
    finally:
        twins.set_cpu_threads(*saved)
        jax.clear_caches()


def test_tile_analysis_sees_tile_store_as_a_write_not_a_read():
    sig = warpnn.jax_kernel(tiles.tile_matmul_kernel).signature
    assert sig.outputs_read == () and sig.reverse_problems == {} and sig.written_inputs == ()
    assert [a.kind for a in sig.uses["c"].accesses] == ["store"]


def test_tile_mlp_trains_with_optax_like_its_pure_jax_reference(key):
    kx, k1, k2 = jax.random.split(key, 3)
    x = jax.random.uniform(kx, (64, 2), minval=-1.0, maxval=1.0)
    y = jnp.sin(3.0 * x[:, :1]) * x[:, 1:]
    params = {"w1": 0.5 * jax.random.normal(k1, (2, 32)), "b1": jnp.zeros(32),
              "w2": 0.5 * jax.random.normal(k2, (32, 1)), "b2": jnp.zeros(1)}

    def mlp(dense):
        return lambda p, x: dense(dense(x, p["w1"], p["b1"], jnp.tanh), p["w2"], p["b2"])

    def train(dense, steps=150):
        opt = optax.adam(3e-2)
        loss = lambda p: jnp.mean((mlp(dense)(p, x) - y) ** 2)

        @jax.jit
        def step(p, s):
            value, g = jax.value_and_grad(loss)(p)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, value

        p, s, history = params, opt.init(params), []
        for _ in range(steps):
            p, s, value = step(p, s)
            history.append(float(value))
        return history

    warp_history, jax_history = train(tiles.dense), train(tiles.dense_reference)
    assert warp_history[-1] < 0.1 * warp_history[0]
    assert_close(jnp.array(warp_history), jnp.array(jax_history), 1e-2, 1e-4)
