"""What docs/bridge.md says about Warp's own bridge (``wp.jax_kernel``, warp-lang 1.19), checked against Warp itself.

If Warp changes, these fail and docs/bridge.md's comparison table must change with them. Warp's source:
``warp/_src/jax/ffi.py`` (``jax_kernel``; ``_FFI_KERNEL_REGISTRY``; ``FfiKernel.ffi_callback``).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

pytestmark = pytest.mark.skipif(not wp.is_cpu_available() and jax.default_backend() == "cpu",
                                reason="this Warp build cannot compile CPU kernels")


@wp.kernel
def _scale(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = 2.0 * x[i]


@pytest.fixture
def registrations(monkeypatch):
    names = []
    register = jax.ffi.register_ffi_target

    def counting(name, *args, **kwargs):
        names.append(name)
        return register(name, *args, **kwargs)

    monkeypatch.setattr(jax.ffi, "register_ffi_target", counting)
    return names


def test_plain_wrappers_are_reused(registrations):
    """docs/bridge.md: one target per kernel and configuration, reused (not two new targets per construction)."""
    wrappers = [wp.jax_kernel(_scale, launch_dims=5) for _ in range(5)]
    for w in wrappers:
        jax.block_until_ready(w(jnp.arange(5.0)))
    assert all(w is wrappers[0] for w in wrappers)
    assert len(set(registrations)) <= 1  # 0 if an earlier test built the same configuration


def test_differentiable_wrappers_register_two_targets_per_construction(registrations):
    """docs/bridge.md: with enable_backward=True, each construction registers new forward and backward targets."""
    for _ in range(3):
        wp.jax_kernel(_scale, enable_backward=True)
    assert len(set(registrations)) == 6


def test_differentiable_outputs_take_the_first_inputs_shape():
    with pytest.raises(NotImplementedError, match="output_dims"):
        wp.jax_kernel(_scale, output_dims=4, enable_backward=True)


def test_vmap_with_explicit_launch_dims():
    """docs/bridge.md: the batch is folded into the first Warp dim, which the plain wrapper scales for explicit
    launch_dims; the differentiable wrapper does not, so only batch element 0 is computed."""
    xb = jnp.stack([jnp.arange(4.0), 10 * jnp.arange(4.0) + 1, 100 * jnp.arange(4.0) + 1])
    # The differentiable call first: no buffer holding the right answer exists yet for it to land in.
    diff = wp.jax_kernel(_scale, launch_dims=4, enable_backward=True)
    out = np.asarray(jax.vmap(lambda a: diff(a)[0])(xb))
    np.testing.assert_allclose(out[0], 2 * xb[0])
    assert not np.allclose(out[1:], 2 * xb[1:])
    plain = wp.jax_kernel(_scale, launch_dims=4)
    np.testing.assert_allclose(jax.vmap(lambda a: plain(a)[0])(xb), 2 * xb)
