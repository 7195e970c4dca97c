"""Kernels that measure an array after using it: their adjoint comes from a twin that measures first (_measured.py).

Warp's adjoint of ``x.shape`` resets the shape of ``x``'s adjoint; the adjoints of earlier accesses at a negative
(wrapped) index then add before the buffer. The gradients run in subprocesses: a regression corrupts the heap."""

import subprocess
import sys

import pytest
import warp as wp

from warpnn import _measured
from warpnn._signature import signature_of
from warpnn.kernels.tiles import tile_matmul_kernel

from .helpers import ROOT, subprocess_env
from .kernels_for_tests import heat_step, previous_scaled, previous_scaled_in_a_loop, shifted_rows


@wp.kernel
def measures_first(x: wp.array(dtype=float), out: wp.array(dtype=float)):
    n = x.shape[0]
    i = wp.tid()
    out[i] = x[i - 1] * float(n)


@wp.kernel
def passes_its_shape_on(x: wp.array(dtype=float), out: wp.array(dtype=float)):
    i = wp.tid()
    out[i] = x[i - 1]
    s = x.shape
    out[i] = out[i] * float(s[0])


def _late(kernel):
    fn = kernel.adj.tree.body[0]
    arrays = frozenset(a.label for a in kernel.adj.args if isinstance(a.type, wp.array))
    return _measured.measures_after_use(fn, arrays)


def test_which_kernels_measure_an_array_after_using_it():
    assert _late(previous_scaled) == {"x"}  # in the statement that reads it
    assert _late(previous_scaled_in_a_loop) == {"x"}  # in a loop
    assert _late(measures_first) == frozenset()
    assert _late(heat_step) == frozenset()  # u.shape is read before u
    assert _late(shifted_rows) == frozenset()
    assert _late(tile_matmul_kernel) == frozenset()  # measured in its loop's range, evaluated once before the loop


def test_the_twin_measures_first_and_only_where_it_can():
    sig = signature_of(previous_scaled, 1)
    twin = _measured.measured_first(sig)
    assert twin is not sig and [a.label for a in twin.kernel.adj.args] == [a.label for a in previous_scaled.adj.args]
    lines = [line.strip() for line in twin.kernel.adj.source.splitlines()]
    assert lines[1] == "wnmeasure_0 = x.shape[0]" and "x.shape" not in "".join(lines[2:])
    for kernel in (measures_first, heat_step):
        sig = signature_of(kernel, 1)
        assert _measured.measured_first(sig) is sig
    sig = signature_of(passes_its_shape_on, 1)
    assert _measured.measured_first(sig) is sig  # `s = x.shape` cannot move (Warp's own behaviour remains)


_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, warp as wp
import warpnn
from tests import kernels_for_tests as K
wp.config.quiet = True
errors = []
for name, shape in (("previous_scaled", (9,)), ("previous_scaled_in_a_loop", (5, 4))):
    kernel, ref = warpnn.jax_kernel(getattr(K, name)), getattr(K, name + "_ref")
    f = lambda x: kernel(x, launch_dims=x.shape[0])[0]  # one thread per row (the loop kernel's tid is 1-D)
    x = jax.random.normal(jax.random.PRNGKey(0), shape)
    w = jax.random.normal(jax.random.PRNGKey(1), shape)
    loss = lambda x: jnp.vdot(w, f(x))
    loss_ref = lambda x: jnp.vdot(w, ref(x))
    errors.append(float(jnp.abs(f(x) - ref(x)).max()))
    for _ in range(3):  # the heap corruption showed on a later call
        errors.append(float(jnp.abs(jax.jit(jax.grad(loss))(x) - jax.grad(loss_ref)(x)).max()))
    xs = jnp.stack([x, 2 * x, -x])
    errors.append(float(jnp.abs(jax.vmap(jax.grad(loss))(xs) - jax.vmap(jax.grad(loss_ref))(xs)).max()))
print("MAXERR", max(errors))
"""


@pytest.mark.parametrize("platform", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gradients_through_negative_indices_of_an_array_measured_after_use_are_right(platform):
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env=subprocess_env(JAX_PLATFORMS=platform))
    assert out.returncode == 0, out.stderr[-3000:]
    err = float(out.stdout.split("MAXERR")[-1])
    assert err < 1e-4, out.stdout
