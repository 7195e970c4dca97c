"""Checked mode (``_checked.py``): out-of-range accesses become Python errors; in-range calls are unchanged.

In-range calls are compared with the default mode and with pure-JAX references (values and gradients, eager,
jit, vmap, both launchers). Out-of-range calls (writes past an output, reads past an input, bad gather and
scatter indices, views, adjoints) run in subprocesses, which must exit cleanly having raised a
``KernelIndexError`` for each, naming the kernel, the array and the index.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import warpnn
from warpnn import _checked, _launch

from . import checked_kernels as C
from .helpers import ROOT, assert_close, subprocess_env


def _gather_ref(x, idx, w):
    return w * x[idx]


def _scatter_ref(v, pairs, n):
    return jnp.zeros(n).at[pairs[:, 0]].add(v).at[pairs[:, 1]].add(-v)


def _cases():
    key = jax.random.PRNGKey(3)
    x = jax.random.normal(key, (12,))
    xv = jax.random.normal(key, (7, 3))
    idx = jnp.array([6, 0, 3, 3, -1], jnp.int32)  # -1: Warp's negative indexing, the last row
    v = jnp.linspace(0.5, 1.5, 5)
    pairs = jnp.array([[0, 1], [1, 2], [2, 3], [-1, 0], [1, -4]], jnp.int32)  # negative: Warp's wrap-around
    g = jax.random.normal(key, (3, 5))
    shifted = warpnn.jax_kernel(C.shifted_scale)
    gather = warpnn.jax_kernel(C.gather_rows)
    scatter = warpnn.jax_kernel(C.scatter_pairs)
    rows = warpnn.jax_kernel(C.grid_rows)
    return {
        # name: (function of the differentiated array, its value, pure-JAX reference)
        "elementwise": (lambda x: shifted(x, 2.0, -1)[0], x, lambda x: 2.0 * jnp.roll(x, 1)),
        "gather": (lambda xv: gather(xv, idx, 0.5, launch_dims=5, output_dims=5)[0], xv,
                   lambda xv: _gather_ref(xv, idx, 0.5)),
        "scatter": (lambda v: scatter(v, pairs, launch_dims=5, output_dims=4)[0], v, lambda v: _scatter_ref(v, pairs, 4)),
        "view": (lambda g: rows(g, 1, launch_dims=(3, 4), output_dims=3)[0], g, lambda g: g[:, 1:].sum(1)),
    }


# Gradients through row views are zero in the default mode too (the launchers leave the primal array_t's grad
# pointer null, and Warp's view adjoint accumulates into it; see test_launch.py): compare values only there.
_FORWARD_ONLY = {"view"}


def _value_and_grad(f, x, case=""):
    shape = jax.eval_shape(f, x).shape
    weights = jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32)).reshape(shape)
    if case in _FORWARD_ONLY:
        return f(x), jnp.zeros_like(x)
    return f(x), jax.grad(lambda x: jnp.vdot(weights, f(x)))(x)


@pytest.mark.parametrize("launcher", ["python", "native"])
@pytest.mark.parametrize("case", ["elementwise", "gather", "scatter", "view"])
def test_in_range_calls_match_default_mode_and_reference(case, launcher):
    f, x, ref = _cases()[case]
    with _launch.use_launcher(launcher):
        default = _value_and_grad(f, x, case)
        with warpnn.checked():
            eager = _value_and_grad(f, x, case)
            jitted = jax.jit(lambda x: _value_and_grad(f, x, case))(x)
            batched = jax.jit(jax.vmap(lambda x: _value_and_grad(f, x, case)))(jnp.stack([x, 2 * x]))
    expected = _value_and_grad(ref, x, case)
    for got in (default, eager, jitted):
        jax.tree.map(lambda a, b: assert_close(a, b, 1e-5, 1e-6), got, expected)
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-5, 1e-6), jax.tree.map(lambda t: t[1], batched),
                 _value_and_grad(ref, 2 * x, case))


def test_checked_is_per_thread_and_set_checked_is_global():
    assert not warpnn.is_checked()
    seen = []
    with warpnn.checked():
        assert warpnn.is_checked()
        t = threading.Thread(target=lambda: seen.append(warpnn.is_checked()))
        t.start()
        t.join()
        with warpnn.checked(False):
            assert not warpnn.is_checked()
    assert seen == [False] and not warpnn.is_checked()
    assert warpnn.set_checked(True) is False
    try:
        assert warpnn.is_checked()
    finally:
        warpnn.set_checked(False)


def test_accesses_inside_functions_are_reported_as_unguarded():
    f = warpnn.jax_kernel(C.through_function)
    with warpnn.checked(), pytest.warns(RuntimeWarning, match=r"'through_function'.*x passed to read_at\(\)"):
        y = f(jnp.arange(4.0))[0]
    assert_close(y, jnp.arange(4.0))


def test_atomic_inside_an_expression_is_refused():
    f = warpnn.jax_kernel(C.atomic_in_expression)
    with warpnn.checked(), pytest.raises(_checked.CheckedBuildError, match=r"atomic_in_expression.*wp.atomic_add"):
        f(jnp.arange(4.0))


OUT_OF_RANGE = r'''
import json, sys
import jax, jax.numpy as jnp, numpy as np, warp as wp
wp.config.quiet = True
import warpnn
from warpnn import _launch
from tests import checked_kernels as C

shifted = warpnn.jax_kernel(C.shifted_scale)
gather = warpnn.jax_kernel(C.gather_rows)
scatter = warpnn.jax_kernel(C.scatter_pairs)
rows = warpnn.jax_kernel(C.grid_rows)
slots = warpnn.jax_kernel(C.counter_slots, num_outputs=2)
permute = warpnn.jax_kernel(C.permute)
x, xv, v = jnp.arange(8.0), jnp.ones((4, 3)), jnp.ones(3)
bad_idx = jnp.array([0, 9, 1], jnp.int32)
grad_gather = lambda xv: jax.grad(lambda xv: gather(xv, bad_idx, 1.0, launch_dims=3, output_dims=3)[0].sum())(xv)
cases = {
    "write past the output": lambda: shifted(x, 1.0, 0, launch_dims=8, output_dims=4)[0],  # caught at trace time
    "store at a computed index": lambda: permute(x[:3], bad_idx, output_dims=4)[0],
    "read past the input": lambda: shifted(x, 1.0, 1)[0],
    "gather index": lambda: gather(xv, bad_idx, 1.0, launch_dims=3, output_dims=3)[0],
    "gather index under jit": lambda: jax.jit(lambda xv: gather(xv, bad_idx, 1.0, launch_dims=3, output_dims=3)[0])(xv),
    "scatter index": lambda: scatter(v, jnp.array([[0, 1], [1, -9], [2, 0]], jnp.int32), output_dims=3)[0],
    "adjoint": lambda: grad_gather(xv),
    "adjoint under jit": lambda: jax.jit(grad_gather)(xv),
    "view": lambda: rows(jnp.ones((3, 4)), 1, launch_dims=(3, 4), output_dims=3)[0],
    "view row": lambda: rows(jnp.ones((3, 4)), 0, launch_dims=(4, 4), output_dims=4)[0],
    "atomic slot": lambda: slots(jnp.ones(5), output_dims={"counter": 1, "slots": 4})[1],  # one slot too many
    "vmap": lambda: jax.jit(jax.vmap(lambda i: gather(xv, i, 1.0, launch_dims=3, output_dims=3)[0]))(jnp.stack([jnp.zeros(3, jnp.int32), bad_idx])),
}
results = {}
with warpnn.checked():
    for name, run in cases.items():
        try:
            out = jax.block_until_ready(run())
            results[name] = "no error"
        except Exception as e:  # KernelIndexError, or JAX's runtime error carrying its message
            results[name] = f"{type(e).__name__}: {e}"
print("RESULTS " + json.dumps({"launcher": _launch.LAUNCHER.name, "results": results}))
'''

EXPECTED = {
    "store at a computed index": ("permute", "'y'", "write at index 9, but its shape is 4"),
    "read past the input": ("shifted_scale", "'x'", "read at index 8, but its shape is 8"),
    "gather index": ("gather_rows", "'x'", "read at index 9, but its shape is 4"),
    "gather index under jit": ("gather_rows", "'x'", "read at index 9, but its shape is 4"),
    "scatter index": ("scatter_pairs", "'out'", "augmented store at index -9, but its shape is 3"),
    "adjoint": ("gather_rows", "'x'", "read at index 9, but its shape is 4"),
    "adjoint under jit": ("gather_rows", "'x'", "read at index 9, but its shape is 4"),
    "view": ("grid_rows", "'g' (through its view 'r')", "read at index 4, but its shape is 4"),
    "view row": ("grid_rows", "'g'", "view (index 0) at index 3, but its shape is 3"),
    "atomic slot": ("counter_slots", "'slots'", "write at index 4, but its shape is 4"),
    "vmap": ("gather_rows", "'x'", "read at index 9, but its shape is 4"),
}


@pytest.mark.parametrize("launcher", ["python", "native"])
def test_out_of_range_accesses_raise_and_the_process_lives(launcher):
    script = os.path.join(ROOT, "build", f"checked_out_of_range_{launcher}.py")
    os.makedirs(os.path.dirname(script), exist_ok=True)
    with open(script, "w") as fh:
        fh.write(textwrap.dedent(OUT_OF_RANGE))
    env = subprocess_env(WARPNN_LAUNCHER=launcher)
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULTS "))
    report = json.loads(line[len("RESULTS "):])
    if launcher == "native" and report["launcher"] != "native":
        pytest.skip("native launcher unavailable")
    # Provable from the source (y[tid] over a launch bigger than y): the bridge refuses it at trace time.
    trace_time = report["results"]["write past the output"]
    assert trace_time.startswith("ValueError: Kernel 'shifted_scale'") and "output 'y'" in trace_time, trace_time
    for name, (kernel, array, what) in EXPECTED.items():
        message = report["results"][name]
        assert "warpnn checked mode" in message and f"kernel '{kernel}'" in message, (name, message)
        assert f"array {array}" in message and what in message, (name, message)


def test_env_var_turns_checked_mode_on():
    code = textwrap.dedent('''
        import jax.numpy as jnp, warpnn
        from tests import checked_kernels as C
        assert warpnn.is_checked()
        try:
            warpnn.jax_kernel(C.shifted_scale)(jnp.arange(4.0), 1.0, 1)
        except warpnn.KernelIndexError as e:
            print("raised", e)
    ''')
    env = subprocess_env(WARPNN_CHECK="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "raised warpnn checked mode: kernel 'shifted_scale' indexed array 'x'" in out.stdout


def test_a_jit_function_compiled_before_runs_checked_inside_the_block():
    gather = warpnn.jax_kernel(C.gather_rows)
    f = jax.jit(lambda xv, idx: gather(xv, idx, 1.0, launch_dims=2, output_dims=2)[0])
    xv = jnp.ones((3, 3))
    f(xv, jnp.array([0, 2], jnp.int32))  # compiled unchecked
    with warpnn.checked(), pytest.raises(Exception, match=r"kernel 'gather_rows' indexed array 'x'.*index 5"):
        jax.block_until_ready(f(xv, jnp.array([0, 5], jnp.int32)))  # same shapes, yet traced again, checked
    with warpnn.checked():
        f(xv, jnp.array([0, 1], jnp.int32))
    assert not warpnn.is_checked()
    assert_close(f(xv, jnp.array([1, 2], jnp.int32)), jnp.ones((2, 3)))  # traced again after the block


def test_struct_fields_are_reported_as_unguarded_and_results_unchanged(key):
    from .test_structs import _body, _inputs, body_energy, body_energy_ref

    x, weight, offset = _inputs(key)
    f = warpnn.jax_kernel(body_energy)
    with warpnn.checked(), pytest.warns(RuntimeWarning, match=r"'body_energy'.*body\.x\[\.\.\.\].*body\.material passed to material_term"):
        (e,) = f(_body(x, weight), offset)
    assert_close(e, body_energy_ref(x, weight, offset), 1e-5, 1e-5)


def test_a_cpu_launch_split_into_slices_reports_one_clear_violation():
    """Several slices of a threaded CPU launch hit out-of-range reads: the record keeps one violation (the
    slices' records were once summed into a site that does not exist, and the error was an IndexError)."""
    from warpnn import _batched

    if _launch.LAUNCHER.name != "native" or jax.default_backend() != "cpu":
        pytest.skip("CPU threads are the native CPU handler's")
    twins = _launch.LAUNCHER.impl.twins
    saved = _batched._LAUNCH_CONFIG.get()
    try:
        twins.set_cpu_threads(3, 1)  # 3 slices of the 8 threads: reads past the end in the 2nd and 3rd
        jax.clear_caches()
        f = warpnn.jax_kernel(C.shifted_scale)
        x = jnp.arange(8.0)
        with warpnn.checked(), pytest.raises(warpnn.KernelIndexError, match="kernel 'shifted_scale'") as caught:
            jax.block_until_ready(f(x, 2.0, 5))
        assert "warpnn checked mode" in str(caught.value) and "'x'" in str(caught.value), str(caught.value)
        assert_close(f(x, 2.0, 0)[0], 2.0 * x)  # in range, sliced as well
    finally:
        twins.set_cpu_threads(*saved)
        jax.clear_caches()


VALID_STENCILS = '''
import json
import jax, jax.numpy as jnp, numpy as np
import warp as wp
import warpnn


@wp.func
def west(u: wp.array2d(dtype=float), i: int, j: int):
    v = u[i - 1, j]  # read first, measured after: Warp's adjoint of .shape resets the adjoint's shape
    return v * float(u.shape[0])


@wp.kernel
def stencil(u: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    v = u[i - 1, j] * 2.0 + u[i, j]
    n = u.shape[0]
    out[i, j] = v + u[(i + 1) % n, j]


@wp.kernel
def stencil_in_func(u: wp.array2d(dtype=float), out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    out[i, j] = west(u, i, j) + u[i, j]


@wp.kernel
def shifted(u: wp.array2d(dtype=float), k: int, out: wp.array2d(dtype=float)):
    i, j = wp.tid()
    n = u.shape[0]
    out[i, j] = u[(i + k - 2 + n) % n, j] * 3.0


u = jnp.asarray(np.random.default_rng(0).random((8, 5), np.float32))
n = u.shape[0]
cases = {
    "stencil": (lambda f, u: f(u)[0], lambda u: 2.0 * jnp.roll(u, 1, 0) + u + jnp.roll(u, -1, 0), stencil),
    "stencil_in_func": (lambda f, u: f(u)[0], lambda u: n * jnp.roll(u, 1, 0) + u, stencil_in_func),
    "shifted": (lambda f, u: f(u, 3)[0], lambda u: 3.0 * jnp.roll(u, -1, 0), shifted),
}
errors = {}
for name, (call, ref, kernel) in cases.items():
    f = warpnn.jax_kernel(kernel)
    with warpnn.checked():
        value = jax.jit(lambda u: call(f, u))(u)
    errors[name] = [float(jnp.max(jnp.abs(value - ref(u))))]
    for checked in (True, False):
        try:
            with warpnn.checked(checked):
                grad = jax.jit(jax.grad(lambda u: jnp.sum(call(f, u) ** 2)))(u)
        except TypeError as e:  # refused at trace time
            errors[name].append(str(e))
            continue
        grad_ref = jax.grad(lambda u: jnp.sum(ref(u) ** 2))(u)
        errors[name].append(float(jnp.max(jnp.abs(grad - grad_ref))))
print("RESULTS " + json.dumps(errors))
'''


# (each launcher once, with one thread and with the CPU pool split: the four crossings took 34 s of CI's suite;
# the Python launcher's is --slow on a CPU, 11 s with Warp's kernel cache empty)
@pytest.mark.parametrize("launcher,threads", [pytest.param("python", "1", marks=pytest.mark.slow), ("native", "3")])
def test_valid_stencils_differentiate_in_checked_mode(launcher, threads):
    """Stencils that read ``u[i - 1, j]`` and then ``u.shape`` and index with ``(i + k - 2 + n) % n`` (int32 and
    int64 mixed once failed to compile) run and differentiate, checked and not, in a subprocess: checked mode
    once crashed on them. The same measurement inside a ``@wp.func`` (whose adjoint resets the shape of u's
    adjoint where no twin can move it) is refused at trace time in both modes, naming the function."""
    script = os.path.join(ROOT, "build", "checked_valid_stencils.py")  # (Warp reads kernels' source from a file)
    os.makedirs(os.path.dirname(script), exist_ok=True)
    with open(script, "w") as fh:
        fh.write(VALID_STENCILS)
    env = subprocess_env(WARPNN_LAUNCHER=launcher, WARPNN_CPU_THREADS=threads, WARPNN_CPU_MIN_WORK="1")
    out = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    line = next(l for l in out.stdout.splitlines() if l.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS "):])
    refusals = results.pop("stencil_in_func")[1:]
    for message in refusals:
        assert message.startswith("Kernel 'stencil_in_func' cannot be differentiated: array 'u'"), message
        assert "inside @wp.func 'west'" in message and "pass the size to the function" in message, message
    for name, (forward, *gradients) in results.items():
        assert forward < 1e-5 and all(g < 1e-4 for g in gradients), (name, forward, gradients)
