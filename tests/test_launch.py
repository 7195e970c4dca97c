"""Lifetime of the code the launchers run: calls executing on other threads while Warp rebuilds the module.

A kernel added later to the same Python module (a notebook cell, a file edited and re-imported) makes Warp
rebuild that module; the next trace of a warpnn call then loads the rebuilt code. A call of an executable
compiled earlier may be running the old code on another thread at that moment: the launchers must keep it
loaded (the native launcher used to let the old ModuleExec go, whose destructor unloaded the code under the
running handler: SIGSEGV). These checks run in a subprocess, which must exit cleanly, for both launchers, on
whatever backend JAX picks (CPU here, CUDA on a GPU machine).
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _kernel_load, _launch

from . import checked_kernels as C
from . import kernels_for_tests as K
from .helpers import ROOT, assert_close, subprocess_env


KERNELS = '''
import warp as wp

@wp.kernel
def slow_scale(x: wp.array(dtype=float), iters: int, y: wp.array(dtype=float)):
    i = wp.tid()
    acc = float(0.0)
    for k in range(iters):  # a long-running launch: a wide window for the reload to hit
        acc += wp.sin(x[i] + float(k))
    y[i] = 2.0 * x[i] + acc * 0.0

def add_kernel(r):
    """A new kernel in slow_scale's Warp module: Warp rebuilds the module on its next load."""
    def added(x: wp.array(dtype=float)):
        x[wp.tid()] = float(1.0)
    return wp.Kernel(added, key=f"added_{r}", module=slow_scale.module)
'''

STRESS = '''
import gc, sys, threading
import jax, jax.numpy as jnp, numpy as np, warp as wp
wp.config.quiet = True
import warpnn
from warpnn import _launch
import stress_kernels as mod

gpu = jax.default_backend() == "gpu"
n, iters, rounds = (1 << 20, 400, 8) if gpu else (4096, 1500, 4)
f = warpnn.jax_kernel(mod.slow_scale)
x = jnp.arange(n, dtype=jnp.float32) / n
expected = np.asarray(2.0 * x)
step = jax.jit(lambda x: f(x, iters)[0])  # compiled once; the callers run this executable throughout
np.asarray(step(x))
launcher = _launch.LAUNCHER.impl

stop, failures, calls = threading.Event(), [], [0]
def caller():
    try:
        while not stop.is_set():
            if not np.array_equal(np.asarray(step(x)), expected):
                failures.append("wrong result")
            calls[0] += 1
    except Exception as e:  # noqa: BLE001 - reported below
        failures.append(repr(e))

threads = [threading.Thread(target=caller) for _ in range(3)]
for t in threads:
    t.start()
loads = 0
for r in range(rounds):
    mod.add_kernel(r)
    # A retrace (new scalar: a new executable) loads the rebuilt module and registers its code with the
    # launcher while the callers are inside the old code.
    out = np.asarray(jax.jit(lambda x: f(x, iters + r)[0])(x))
    assert np.array_equal(out, expected), r
    gc.collect()
stop.set()
for t in threads:
    t.join()
assert not failures, failures[:3]
assert calls[0] >= 3, calls[0]
# Each round really rebuilt the module: the launcher saw a new ModuleExec every time.
if type(launcher).__name__ == "NativeLauncher":
    assert len(launcher._retired) >= rounds, len(launcher._retired)
print("clean", _launch.LAUNCHER.name, calls[0], flush=True)
'''


# (the Python launcher's run is --slow on a CPU: 8 s of CI's suite; the native launcher's runs there)
@pytest.mark.parametrize("launcher", [pytest.param("python", marks=pytest.mark.slow), "native"])
def test_calls_survive_module_rebuilds_on_other_threads(tmp_path, launcher):
    """3 threads run a compiled executable while the main thread adds kernels to its Warp module and retraces."""
    (tmp_path / "stress_kernels.py").write_text(KERNELS)
    script = tmp_path / "stress.py"
    script.write_text(textwrap.dedent(STRESS))
    env = subprocess_env(str(tmp_path), WARPNN_LAUNCHER=launcher)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    if launcher == "native" and "native launcher is unavailable" in out.stderr:
        pytest.skip("native launcher unavailable")
    assert out.returncode == 0, f"exit {out.returncode} (negative: killed by that signal)\n{out.stdout}\n{out.stderr[-3000:]}"
    assert f"clean {launcher}" in out.stdout


# --------------------------------------------------------------------------------------------------
# Warp's deterministic mode: refused on CUDA (hidden launch parameters warpnn does not pass), fine on the CPU.

# The springs scatter of kernels_for_tests, compiled in its own module in run-to-run deterministic mode.
deterministic_springs = wp.kernel(
    module="unique", module_options={"deterministic": wp.DeterministicMode.RUN_TO_RUN}
)(K.spring_forces.func)


def _springs_loss(forces):
    def loss(pos, springs, stiffness, rest):
        (f,) = forces(pos, springs, stiffness, rest, 1.0, launch_dims=springs.shape[0], output_dims=pos.shape[0])
        return jnp.sum(f * jnp.sin(pos))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 2, 3)))


def test_deterministic_mode_refusal_names_kernel_and_fix():
    device = wp.get_device("cpu")
    hooks = deterministic_springs.module.load(device, 1).get_kernel_hooks(deterministic_springs)
    with pytest.raises(NotImplementedError, match=r"Kernel 'spring_forces'.*deterministic mode \(RUN_TO_RUN.*NOT_GUARANTEED"):
        _kernel_load.refuse_deterministic(deterministic_springs, hooks, on_cuda=True)
    _kernel_load.refuse_deterministic(deterministic_springs, hooks, on_cuda=False)  # CPU code has no hidden parameters
    plain = K.spring_forces.module.load(device, 1).get_kernel_hooks(K.spring_forces)
    _kernel_load.refuse_deterministic(K.spring_forces, plain, on_cuda=True)  # not compiled deterministic: nothing to refuse


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU path of a deterministic-mode kernel")
@pytest.mark.parametrize("launcher", ["python", "native"])
def test_deterministic_mode_kernel_runs_on_cpu_bitwise_reproducibly(launcher):
    pos, springs, stiffness, rest = K.springs_case(32)
    with _launch.use_launcher(launcher):
        step = _springs_loss(warpnn.jax_kernel(deterministic_springs))
        first, second = step(pos, springs, stiffness, rest), step(pos, springs, stiffness, rest)
    ref = _springs_loss(lambda *a, **kw: (K.spring_forces_ref(*a[:5]),))(pos, springs, stiffness, rest)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), first, second)
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-4, 1e-5), first, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("launcher", ["python", "native"])
def test_deterministic_mode_is_refused_on_cuda_at_trace_time(launcher):
    pos, springs, stiffness, rest = K.springs_case(32)
    with _launch.use_launcher(launcher):
        step = _springs_loss(warpnn.jax_kernel(deterministic_springs))
        with pytest.raises(NotImplementedError, match=r"Kernel 'spring_forces'.*deterministic mode"):
            step(pos, springs, stiffness, rest)
        # The same kernel compiled without deterministic mode runs, and matches the pure-JAX reference.
        got = _springs_loss(warpnn.jax_kernel(K.spring_forces))(pos, springs, stiffness, rest)
    ref = _springs_loss(lambda *a, **kw: (K.spring_forces_ref(*a[:5]),))(pos, springs, stiffness, rest)
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-4, 1e-5), got, ref)


# --------------------------------------------------------------------------------------------------
# Found by the checked-mode tests: Warp's adjoint of a row view (r = g[b]; r[j]) accumulates into the viewed
# array's grad pointer, so the launchers alias it to the adjoint buffer (as wp.Tape does); before, zero gradients.


@pytest.mark.parametrize("launcher", ["python", "native"])
def test_gradient_through_a_row_view_matches_tape(launcher):
    g = np.arange(15.0, dtype=np.float32).reshape(3, 5)
    g_wp = wp.array(g, requires_grad=True)
    out = wp.zeros(3, dtype=float, requires_grad=True)
    tape = wp.Tape()
    with tape:
        wp.launch(C.grid_rows, dim=(3, 4), inputs=[g_wp, 1, out])
    tape.backward(grads={out: wp.array(np.ones(3, np.float32))})
    rows = warpnn.jax_kernel(C.grid_rows)
    with _launch.use_launcher(launcher):
        grad = jax.grad(lambda g: rows(g, 1, launch_dims=(3, 4), output_dims=3)[0].sum())(jnp.asarray(g))
    np.testing.assert_array_equal(np.asarray(grad), g_wp.grad.numpy())
