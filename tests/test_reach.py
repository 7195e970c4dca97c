"""Row reach of computed indices (_reach.py): a probe of a kernel's index arithmetic bounds the partial buffers of
a split CPU adjoint launch; the gradients stay those of whole partial buffers, one thread and pure JAX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _batched, _reach
from warpnn._launch import LAUNCHER

from .helpers import assert_close
from .kernels_for_tests import heat_step, heat_step_ref, shifted_rows, shifted_rows_ref


@wp.kernel
def modulo_rows(u: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    out[i, j] = u[(i + 3) % u.shape[0], j] * u[i, j]


def modulo_rows_ref(u):
    return jnp.roll(u, -3, 0) * u


@wp.kernel
def diagonal_rows(u: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    out[i, j] = u[(i + j) % u.shape[0], j]  # the row read depends on the other coordinate: no reach


def diagonal_rows_ref(u):
    n, m = u.shape
    return u[(jnp.arange(n)[:, None] + jnp.arange(m)[None, :]) % n, jnp.arange(m)[None, :]]


@wp.func
def wrapped_by_division(i: int, n: int):
    return i - (i // n) * n  # divides by an argument: a probe could divide by zero


@wp.kernel
def divides_in_a_func(u: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    out[i, j] = u[wrapped_by_division(i + 1, u.shape[0]), j]


def test_the_probe_takes_first_indices_computed_from_the_row_alone():
    assert _reach._probe_of(heat_step).columns == {"alpha": (0,), "u": (1, 2, 3)}
    assert set(_reach._probe_of(modulo_rows).columns) == {"u"}
    assert _reach._probe_of(diagonal_rows) is None  # (i + j) % n: the other coordinate
    assert _reach._probe_of(divides_in_a_func) is None  # a @wp.func that divides by its argument


def test_block_spans_wrap_negative_rows_once_and_refuse_rows_outside():
    # a ring of 8 rows, each row reaching its neighbours (row 0's lower one written -1, Warp wraps it to 7)
    reached = np.array([[(r - 1) if r else -1, r, (r + 1) % 8] for r in range(8)])
    span = _reach._block_span(reached, (0, 1, 2), (8,), 4, 2)
    # rows as the launch row plus the nearest offset: block 0 (rows 0-3) reaches -1 .. 4, block 1 reaches 3 .. 8
    np.testing.assert_array_equal(span, [-1, 3, 4, 8])
    assert _reach._block_span(np.array([[4]]), (0,), (4,), 1, 1) is None
    assert _reach._block_span(np.array([[-5]]), (0,), (4,), 1, 1) is None


_CASES = {
    "heat": (lambda k: (lambda u: k(u, jnp.array([0.7]), 0.2)[0]), heat_step, lambda u: heat_step_ref(u, jnp.array([0.7]), 0.2)),
    "negative_indices": (lambda k: (lambda u: k(u)[0]), shifted_rows, shifted_rows_ref),
    "modulo": (lambda k: (lambda u: k(u)[0]), modulo_rows, modulo_rows_ref),
    "diagonal": (lambda k: (lambda u: k(u)[0]), diagonal_rows, diagonal_rows_ref),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_split_adjoints_bounded_by_the_probe_match_whole_partials(case, monkeypatch):
    if LAUNCHER.name != "native" or jax.default_backend() != "cpu":
        pytest.skip("CPU threads are the native CPU handler's")
    call, kernel, reference = _CASES[case]
    f = call(warpnn.jax_kernel(kernel))
    u = jax.random.normal(jax.random.PRNGKey(0), (97, 40))
    w = jax.random.normal(jax.random.PRNGKey(1), (97, 40))
    twins = LAUNCHER.impl.twins
    saved, saved_slices = _batched._LAUNCH_CONFIG.get(), twins.cpu_slices_per_worker

    def gradient(threads, windows, slices=1):
        monkeypatch.setenv(_batched.WINDOWS_ENV, windows)
        twins.set_cpu_threads(threads, 1)
        twins.set_cpu_slices_per_worker(slices)
        jax.clear_caches()
        before = twins.partial_rows()
        grad = np.asarray(jax.jit(jax.grad(lambda u: jnp.vdot(w, f(u))))(u))
        return grad, twins.partial_rows() - before

    try:
        one, _ = gradient(1, "1")
        bounded, rows_bounded = gradient(5, "1")
        whole, rows_whole = gradient(5, "0")
        # finer slices (threads claim 35 of them): each bounded by its own window, a few more rows in all
        fine, rows_fine = gradient(5, "1", slices=7)
    finally:
        twins.set_cpu_threads(*saved)
        twins.set_cpu_slices_per_worker(saved_slices)
        jax.clear_caches()
    assert_close(fine, one, rtol=1e-5, atol=1e-5)
    if case != "diagonal":
        assert rows_bounded < rows_fine < 35 * 97 / 4  # 35 slices, each about its own rows
    assert rows_whole == 4 * 97  # four partial buffers of u's adjoint, whole
    if case == "diagonal":
        assert rows_bounded == rows_whole
    else:
        assert rows_bounded < rows_whole / 4  # every slice's rows and a few more, the wrapped ones included
    assert_close(bounded, whole, rtol=1e-5, atol=1e-5)
    assert_close(bounded, one, rtol=1e-5, atol=1e-5)
    assert_close(bounded, jax.grad(lambda u: jnp.vdot(w, reference(u)))(u), rtol=1e-4, atol=1e-4)
