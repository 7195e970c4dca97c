"""The native (C) launcher against the Python launcher and pure-JAX references, its errors, and the fallback.

Every comparison runs the same warpnn calls twice, once per launcher (``_launch.use_launcher``), checks that
the launcher under test really executed them (its handler counters moved, and under the native launcher the
Python handlers were never entered), and compares both results with each other and with a pure-JAX reference.
"""

import ctypes
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

import warpnn
from warpnn import _launch, _native_launch

from . import kernels_for_tests as K
from .helpers import ROOT, assert_close, subprocess_env

N = 16

try:
    _native_launch.get_launcher()
    NATIVE_ERROR = None
except _native_launch.NativeUnavailable as e:  # no compiler and no prebuilt library on this machine
    NATIVE_ERROR = str(e)
needs_native = pytest.mark.skipif(NATIVE_ERROR is not None, reason=f"native launcher unavailable: {NATIVE_ERROR}")
# Tests of the CPU handlers: JAX must compute on the CPU, and Warp must be able to build CPU kernels (the GPU
# machine's Warp ships without its LLVM compiler).
cpu_only = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not wp.is_cpu_available(), reason="tests the CPU handlers (JAX on CPU, Warp with CPU support)"
)


def _entries(launcher) -> int:
    return sum(launcher.handler_entries.values())


def run_both(make):
    """``make()`` under the Python launcher and under the native one; returns (python, native) as NumPy trees."""
    results = {}
    for name in ("python", "native"):
        with _launch.use_launcher(name) as impl:
            python_impl = _launch.LAUNCHER._python_launcher()
            before, python_before = _entries(impl), _entries(python_impl)
            results[name] = jax.tree.map(np.asarray, jax.block_until_ready(make()))
            assert _entries(impl) > before, f"the {name} launcher was not called"
            if name == "native":  # no Python on the hot path: the Python handlers never ran
                assert _entries(python_impl) == python_before
    return results["python"], results["native"]


def check_both(make, reference, rtol=1e-5, atol=1e-6):
    py, nat = run_both(make)
    ref = jax.tree.map(np.asarray, reference())
    # Same kernels: the launchers agree to rounding. On a GPU atomics add in no fixed order, and under vmap the
    # native launcher runs one batched launch where the Python one launches per element (2e-6 seen on the H200).
    rtol_same, atol_same = (1e-6, 1e-7) if jax.default_backend() == "cpu" else (1e-5, 1e-5)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol_same, atol_same), nat, py)
    jax.tree.map(lambda a, b: assert_close(a, b, rtol, atol), nat, ref)


def value_and_grads(f, argnums, key):
    """Outputs and gradients of a random projection of the outputs (one function for Warp and reference)."""

    def run(*args):
        out = f(*args)
        weights = [jax.random.normal(jax.random.fold_in(key, i), o.shape, o.dtype) for i, o in enumerate(jax.tree.leaves(out))]
        loss = lambda *a: sum(jnp.vdot(w, o) for w, o in zip(weights, jax.tree.leaves(f(*a))))  # noqa: E731
        return out, jax.grad(loss, argnums)(*args)

    return run


@pytest.fixture(scope="module")
def springs_setup():
    return K.springs_case(N)


springs_fn = K.spring_forces_fn



# ---------------------------------------------------------------------------------------------- forward + grad


@needs_native
def test_elementwise(key):
    f = warpnn.jax_kernel(K.scale_square)
    x = jax.random.normal(key, (N,))
    run = lambda fn: jax.jit(value_and_grads(fn, 0, key))(x)  # noqa: E731
    check_both(lambda: run(lambda x: f(x, 1.5)[0]), lambda: run(lambda x: K.scale_square_ref(x, 1.5)))


@needs_native
def test_gather_with_repeated_indices(key):
    f = warpnn.jax_kernel(K.weighted_gather)
    x, w = jax.random.normal(key, (N,)), jax.random.normal(jax.random.PRNGKey(3), (N,))
    idx = jnp.asarray(np.random.default_rng(0).integers(0, N, N), jnp.int32)
    run = lambda fn: value_and_grads(fn, (0, 1), key)(x, w)  # noqa: E731
    check_both(lambda: run(lambda x, w: f(x, idx, w)[0]), lambda: run(lambda x, w: K.weighted_gather_ref(x, idx, w)))


@needs_native
def test_springs_scatter_over_springs(springs_setup, key):
    pos, springs, stiffness, rest = springs_setup
    forces = springs_fn()
    run = lambda fn: jax.jit(value_and_grads(lambda p, k, r: fn(p, springs, k, r, 0.7), (0, 1, 2), key))(pos, stiffness, rest)  # noqa: E731
    check_both(lambda: run(forces), lambda: run(K.spring_forces_ref), 1e-4, 1e-5)


@needs_native
def test_outputs_zeroed_on_every_call(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    forces = jax.jit(springs_fn())

    def repeated():
        return [forces(pos, springs, stiffness, rest) for _ in range(3)]  # an accumulator must start at 0 each call

    py, nat = run_both(repeated)
    for out in nat:
        assert_close(out, py[0], 1e-6, 1e-7)


@needs_native
def test_2d_launch(key):
    f = warpnn.jax_kernel(K.affine_2d)
    a = jax.random.normal(key, (5, 7))
    b, c = jnp.linspace(-1, 1, 7), jnp.linspace(0, 2, 5)
    run = lambda fn: value_and_grads(fn, (0, 1, 2), key)(a, b, c)  # noqa: E731
    check_both(lambda: run(lambda a, b, c: f(a, b, c)[0]), lambda: run(K.affine_2d_ref))


@needs_native
def test_multiple_outputs(key):
    f = warpnn.jax_kernel(K.two_outputs, num_outputs=2, output_dims={"y": N, "total": 1})
    x = jax.random.normal(key, (N,))
    run = lambda fn: value_and_grads(fn, 0, key)(x)  # noqa: E731
    check_both(lambda: run(lambda x: f(x, 0.3)), lambda: run(lambda x: K.two_outputs_ref(x, 0.3)))


@needs_native
def test_vector_and_matrix_dtypes(key):
    f = warpnn.jax_kernel(K.rotate)
    m = jax.random.normal(key, (N, 3, 3))
    v = jax.random.normal(jax.random.PRNGKey(5), (N, 3))
    run = lambda fn: value_and_grads(fn, (0, 1), key)(m, v)  # noqa: E731
    check_both(lambda: run(lambda m, v: f(m, v)[0]), lambda: run(K.rotate_ref))


@needs_native
def test_float64(x64, key):
    f = warpnn.jax_kernel(K.cubic_f64)
    x = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64)
    w = jnp.linspace(0.5, 2.0, 8, dtype=jnp.float64)
    run = lambda fn: value_and_grads(fn, (0, 1), key)(x, w)  # noqa: E731
    check_both(lambda: run(lambda x, w: f(x, w)[0]), lambda: run(K.cubic_f64_ref), 1e-12, 1e-12)


@wp.kernel
def mixed_types(x: wp.array(dtype=float), bins: wp.array(dtype=wp.int32), a: float, n: int, flip: bool,
                y: wp.array(dtype=float), hits: wp.array(dtype=wp.int32)):
    # integer input and output arrays next to float ones; int, float and bool static scalars
    i = wp.tid()
    v = x[i] * a + float(n)
    if flip:
        v = -v
    y[i] = v * x[i]
    wp.atomic_add(hits, bins[i], 1)


def mixed_types_ref(x, bins, a, n, flip):
    v = (x * a + n) * (-1.0 if flip else 1.0)
    return v * x, jnp.zeros(4, jnp.int32).at[bins].add(1)


@needs_native
@pytest.mark.parametrize("flip", [False, True])
def test_integer_arrays_and_scalar_types(key, flip):
    f = warpnn.jax_kernel(mixed_types, num_outputs=2, output_dims={"y": N, "hits": 4})
    x = jax.random.normal(key, (N,))
    bins = jnp.asarray(np.random.default_rng(2).integers(0, 4, N), jnp.int32)

    def run(fn):
        y, hits = fn(x)
        g_x = jax.grad(lambda x: jnp.sum(fn(x)[0] * x))(x)
        return y, hits, g_x

    def warp_fn(x, b=bins):
        return f(x, b, 0.5, 3, flip)

    def ref_fn(x, b=bins):
        return mixed_types_ref(x, b, 0.5, 3, flip)

    check_both(lambda: run(warp_fn), lambda: run(ref_fn))
    g = jax.grad(lambda x, b: f(x, b, 0.5, 3, flip)[0].sum(), argnums=1, allow_int=True)(x, bins)
    assert g.dtype == jax.dtypes.float0


@wp.kernel
def narrow_scalars(x: wp.array(dtype=float), h: wp.float16, u: wp.uint8, big: wp.int64, d: wp.float64,
                   y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i] * float(h) + float(u) + float(big % wp.int64(1000)) + float(d)


@needs_native
def test_narrow_and_wide_scalars_native(key):
    # float16 / uint8 / int64 / float64 static scalars are cast natively exactly as ctypes would store them
    f = warpnn.jax_kernel(narrow_scalars)
    x = jax.random.normal(key, (N,))
    with _launch.use_launcher("native"):
        (y,) = f(x, 1.5, 200, 123456789012, 0.25)
    assert_close(y, x * 1.5 + 200 + 12 + 0.25, 1e-6, 1e-5)


@wp.kernel
def total_of(x: wp.array(dtype=float), total: wp.array(dtype=float)):
    i = wp.tid()
    wp.atomic_add(total, 0, x[i])


@needs_native
def test_extra_launch_dims_fold_like_warp():
    # a 1-D kernel launched over (n, 3): Warp folds the extra dim into threads sharing a coordinate
    f = warpnn.jax_kernel(total_of, output_dims=1)
    x = jnp.arange(1.0, N + 1.0)
    check_both(lambda: f(x, launch_dims=(N, 3))[0], lambda: jnp.array([3.0 * x.sum()]))


@needs_native
def test_zero_size_launch():
    f = warpnn.jax_kernel(K.scale_square)
    x = jnp.ones(N)
    check_both(lambda: f(x, 2.0, launch_dims=0, output_dims=N)[0], lambda: jnp.zeros(N))


# ---------------------------------------------------------------------------------------------- transformations


@needs_native
@pytest.mark.parametrize("batched", ["pos", "stiffness", "pos+stiffness", "springs"])
def test_vmap_mixed_batched_and_shared(springs_setup, batched, key):
    pos, springs, stiffness, rest = springs_setup
    B = 3
    keys = jax.random.split(key, B)
    values = {
        "pos": pos[None] + 0.1 * jax.vmap(lambda k: jax.random.normal(k, pos.shape))(keys),
        "stiffness": stiffness[None] * jnp.arange(1.0, B + 1)[:, None],
        "springs": jnp.stack([springs, springs[::-1], jnp.roll(springs, 1, 0)]),
    }
    args = {"pos": pos, "stiffness": stiffness, "springs": springs}
    axes = {name: None for name in args}
    for name in values:
        if name in batched:
            args[name], axes[name] = values[name], 0
    forces = springs_fn()

    def run(fn):
        return jax.vmap(lambda p, s, k: fn(p, s, k, rest, 1.0), in_axes=(axes["pos"], axes["springs"], axes["stiffness"]))(
            args["pos"], args["springs"], args["stiffness"])

    check_both(lambda: run(forces), lambda: run(K.spring_forces_ref), 1e-4, 1e-5)


@needs_native
def test_nested_vmap_with_broadcast_inner_and_outer(key):
    f = warpnn.jax_kernel(K.weighted_gather)
    x = jax.random.normal(key, (2, 3, N))
    w = jax.random.normal(jax.random.PRNGKey(9), (3, N))  # batched over the inner axis only
    idx = jnp.asarray(np.random.default_rng(1).integers(0, N, N), jnp.int32)

    def run(fn):
        return jax.vmap(jax.vmap(fn, in_axes=(0, None, 0)), in_axes=(0, None, None))(x, idx, w)

    check_both(lambda: run(lambda x, i, w: f(x, i, w)[0]), lambda: run(K.weighted_gather_ref))


@needs_native
def test_vmap_of_grad(springs_setup, key):
    pos, springs, stiffness, rest = springs_setup
    pos_b = pos[None] + 0.1 * jax.random.normal(key, (4, *pos.shape))

    def grads(fn):
        def energy_like(p, k):
            return jnp.sum(jnp.sin(fn(p, springs, k, rest, 1.0)))
        return jax.jit(jax.vmap(jax.grad(energy_like, argnums=(0, 1)), in_axes=(0, None)))(pos_b, stiffness)

    forces = springs_fn()
    check_both(lambda: grads(forces), lambda: grads(K.spring_forces_ref), 1e-4, 1e-5)


@needs_native
def test_scan_rollout_gradient(springs_setup):
    pos, springs, stiffness, rest = springs_setup
    vel = jnp.zeros_like(pos)

    def rollout(forces_fn, steps=12, dt=0.05):
        def simulate(pos0, vel0, stiffness, rest):
            def step(carry, _):
                p, v = carry
                v = 0.98 * v + dt * forces_fn(p, springs, stiffness, rest, 1.0)
                p = p + dt * v
                return (p, v), jnp.sum(p[:, 1])

            (p, v), heights = jax.lax.scan(step, (pos0, vel0), None, length=steps)
            return jnp.sum(p**2) + jnp.sum(heights)

        return jax.jit(jax.value_and_grad(simulate, argnums=(0, 1, 2, 3)))(pos, vel, stiffness, rest)

    forces = springs_fn()
    check_both(lambda: rollout(forces), lambda: rollout(K.spring_forces_ref), 2e-3, 2e-4)


def _run_script(tmp_path, source, env_updates, drop=()):
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(source))
    env = subprocess_env(**env_updates)
    for name in drop:
        env.pop(name, None)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


@needs_native
@cpu_only
def test_concurrent_calls_on_several_cpu_devices(tmp_path):
    """pmap over 4 host devices: XLA calls the CPU handlers from several threads at once, on device ordinals > 0."""
    out = _run_script(tmp_path, """
        import jax, jax.numpy as jnp, numpy as np, warp as wp, warpnn
        from warpnn import _launch
        from tests import kernels_for_tests as K
        wp.config.quiet = True
        assert jax.device_count() == 4
        n, reps = 64, 20
        springs = K.chain_springs(n)
        m = springs.shape[0]
        pos = jnp.stack([K.random_positions(jax.random.PRNGKey(i), n) for i in range(4)])
        k = jnp.linspace(0.5, 2.0, m)
        rest = jnp.ones(m)
        f = warpnn.jax_kernel(K.spring_forces)
        def loss(fn):
            return lambda p: jnp.sum(fn(p) ** 2)
        warp = lambda p: f(p, springs, k, rest, 1.0, launch_dims=m, output_dims=n)[0]
        ref = lambda p: K.spring_forces_ref(p, springs, k, rest, 1.0)
        run = jax.pmap(jax.value_and_grad(loss(warp)))
        want = jax.pmap(jax.value_and_grad(loss(ref)))(pos)
        for _ in range(reps):
            got = run(pos)
            for a, b in zip(got, want):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
        print(_launch.LAUNCHER.name, _launch.LAUNCHER.handler_entries["forward"] >= 4 * reps)
    """, {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu", _launch.LAUNCHER_ENV: "native"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["native", "True"], out.stdout


# ---------------------------------------------------------------------------------------------- layout, registration


@needs_native
@cpu_only
def test_args_struct_layout_matches_warps_invoke(springs_setup):
    """The layout registered natively equals the ctypes struct Warp's own `invoke` builds for the same call."""
    pos, springs, stiffness, rest = springs_setup
    kernel = K.spring_forces
    with _launch.use_launcher("python"):  # the Python launcher calls warp's invoke, which caches its struct
        jax.block_until_ready(springs_fn()(pos, springs, stiffness, rest))
    warp_structs = [v[0] for (_, adjoint), v in kernel._invoke_cache.items() if not adjoint]
    assert warp_structs, "warp's invoke did not run"
    layout = _native_launch.describe(warpnn.jax_kernel(kernel).signature)
    for struct in warp_structs:
        assert ctypes.sizeof(struct) == layout["args_size"]
        assert [getattr(struct, name).offset for name, _ in struct._fields_] == [row[1] for row in layout["rows"]]


@needs_native
def test_one_descriptor_per_signature_and_one_target_pair():
    f = warpnn.jax_kernel(K.scale_square)
    x = jnp.ones(8)
    with _launch.use_launcher("native") as native:
        f(x, 1.0)
        registered, callbacks = native.num_registered, len(native._callbacks)
        for i in range(20):  # new scalars retrace, but register nothing
            warpnn.jax_kernel(K.scale_square)(x, float(i))
        assert native.num_registered == registered
        assert len(native._callbacks) == callbacks
        assert native.targets(f.signature) == (_native_launch.FORWARD_TARGET, _native_launch.ADJOINT_TARGET)


# ---------------------------------------------------------------------------------------------- errors through XLA


def _raw_call(kernel_id, operands, n_out=1, launch_dims=(N,), adjoint=False, **attrs):
    target = _native_launch.ADJOINT_TARGET if adjoint else _native_launch.FORWARD_TARGET
    call = jax.ffi.ffi_call(target, [jax.ShapeDtypeStruct((N,), jnp.float32)] * n_out)
    return call(*operands, kernel_id=np.int64(kernel_id), launch_dims=np.asarray(launch_dims, np.int64), **attrs)


def _register_raw(sig, with_entry=False):
    """Register ``sig``'s descriptor with the library directly (a new kernel id, unknown to the launcher)."""
    launcher = _native_launch.get_launcher()
    launcher._kernel_id(sig)  # module loaded and hashed
    d = _native_launch.describe(sig)
    table = np.asarray(d["rows"], np.int64)
    names = (ctypes.c_char_p * len(d["attr_names"]))(*d["attr_names"])
    kid = launcher._lib.warpnn_register_kernel(
        d["name"].encode(), d["kernel_dim"], d["tid_limit"], len(d["rows"]),
        table.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), names, d["args_size"], d["bounds_size"],
        d["bounds_size_offset"], d["bounds_coord_mult_offset"], d["num_args"][0], d["num_rets"][0],
        d["num_args"][1], d["num_rets"][1],
    )
    assert kid >= 0
    return launcher, kid


@needs_native
def test_unknown_kernel_id_is_an_ffi_error():
    _native_launch.get_launcher()
    with pytest.raises(Exception, match=r"unknown kernel id 123456789"):
        jax.block_until_ready(_raw_call(123456789, [jnp.ones(N)], arg_s=np.float64(1.0)))


@needs_native
def test_wrong_operand_count_is_an_ffi_error():
    sig = warpnn.jax_kernel(K.scale_square).signature
    launcher = _native_launch.get_launcher()
    kid = launcher._kernel_id(sig)
    with pytest.raises(Exception, match=r"kernel 'scale_square.*expects 1 operands and 1 results, got 2"):
        jax.block_until_ready(_raw_call(kid, [jnp.ones(N), jnp.ones(N)], arg_s=np.float64(1.0)))


@needs_native
def test_missing_scalar_attribute_is_an_ffi_error():
    sig = warpnn.jax_kernel(K.scale_square).signature
    kid = _native_launch.get_launcher()._kernel_id(sig)
    with pytest.raises(Exception, match=r"scale_square.*missing or non-numeric scalar attribute 'arg_s'"):
        jax.block_until_ready(_raw_call(kid, [jnp.ones(N)]))


@needs_native
@cpu_only
def test_missing_device_entry_is_an_ffi_error_naming_the_kernel():
    sig = warpnn.jax_kernel(K.scale_square).signature
    _, kid = _register_raw(sig)  # no entry points, and the launcher cannot resolve an id it never issued
    with pytest.raises(Exception, match=r"kernel 'scale_square.*has no entry point for CPU device 0"):
        jax.block_until_ready(_raw_call(kid, [jnp.ones(N)], arg_s=np.float64(1.0)))


@needs_native
@cpu_only
def test_missing_entry_point_function_is_an_ffi_error():
    sig = warpnn.jax_kernel(K.scale_square).signature
    launcher, kid = _register_raw(sig)
    assert launcher._lib.warpnn_set_cpu_entry(kid, None, None, 1) == 0
    with pytest.raises(Exception, match=r"kernel 'scale_square' has no compiled forward entry point on CPU"):
        jax.block_until_ready(_raw_call(kid, [jnp.ones(N)], arg_s=np.float64(1.0)))


@needs_native
def test_device_without_entries_is_loaded_on_first_call():
    # a device the trace did not preload (e.g. a jit placed on another backend) is resolved once, then runs natively
    sig = warpnn.jax_kernel(K.scale_square).signature
    launcher, kid = _register_raw(sig)
    launcher._sigs[kid] = sig
    x = jnp.arange(N, dtype=jnp.float32)
    (y,) = _raw_call(kid, [x], arg_s=np.float64(2.0))
    assert_close(y, 2.0 * x * x, 0, 0)


# ---------------------------------------------------------------------------------------------- selection, fallback, build


def test_selection_fallback_warns_and_uses_python(monkeypatch):
    def unavailable():
        raise _native_launch.NativeUnavailable("simulated: no compiler")

    monkeypatch.setattr(_native_launch, "get_launcher", unavailable)
    monkeypatch.delenv(_launch.LAUNCHER_ENV, raising=False)
    selected = _launch._SelectedLauncher()
    with pytest.warns(RuntimeWarning, match=r"native launcher is unavailable.*simulated: no compiler.*WARPNN_LAUNCHER=python"):
        assert isinstance(selected.impl, _launch.PythonLauncher)
    assert selected.name == "python"
    selected.impl  # resolved once: no second warning  # noqa: B018

    monkeypatch.setenv(_launch.LAUNCHER_ENV, "native")
    with pytest.raises(RuntimeError, match=r"WARPNN_LAUNCHER=native, but the native launcher is unavailable.*simulated"):
        _launch._SelectedLauncher().impl  # noqa: B018
    monkeypatch.setenv(_launch.LAUNCHER_ENV, "python")
    assert _launch._SelectedLauncher().name == "python"
    monkeypatch.setenv(_launch.LAUNCHER_ENV, "fast")
    with pytest.raises(ValueError, match=r"WARPNN_LAUNCHER='fast'.*auto, native, python"):
        _launch._SelectedLauncher().impl  # noqa: B018


def test_fallback_end_to_end_in_a_fresh_process(tmp_path):
    """With the library unloadable, a fresh process warns once, runs on the Python launcher, and is right."""
    out = _run_script(tmp_path, """
        import warnings
        warnings.simplefilter("always")
        import jax, jax.numpy as jnp, warp as wp, warpnn
        from warpnn import _launch
        from tests import kernels_for_tests as K
        wp.config.quiet = True
        x = jnp.arange(8.0, dtype=jnp.float32)
        f = warpnn.jax_kernel(K.scale_square)
        y = f(x, 2.0)[0]
        g = jax.grad(lambda x: f(x, 2.0)[0].sum())(x)
        h = warpnn.jax_kernel(K.weighted_gather)(x, jnp.arange(8, dtype=jnp.int32), x)[0]
        print(_launch.LAUNCHER.name, float(y.sum()), float(g.sum()), float(h.sum()))
    """, {_native_launch.LIB_ENV: str(tmp_path / "missing" / "libwarpnn_ffi.so")}, drop=(_launch.LAUNCHER_ENV,))
    assert out.returncode == 0, out.stderr
    name, y, g, h = out.stdout.split()[-4:]
    x = np.arange(8.0)
    assert name == "python"
    assert np.isclose(float(y), (2 * x * x).sum()) and np.isclose(float(g), (4 * x).sum()) and np.isclose(float(h), (x * x).sum())
    assert out.stderr.count("native launcher is unavailable") == 1, out.stderr


@needs_native
@pytest.mark.skipif(_native_launch._find_compiler() is None, reason="no C compiler")
def test_build_from_source_and_stale_library_rejected(tmp_path, monkeypatch):
    path = _native_launch.compile_library(tmp_path / "libwarpnn_ffi.so")
    lib = _native_launch._open(path)
    assert lib.warpnn_abi_version() == _native_launch.ABI_VERSION
    monkeypatch.setattr(_native_launch, "source_hash", lambda: "0" * 16)  # as if the source had changed since
    with pytest.raises(_native_launch.NativeUnavailable, match="stale"):
        _native_launch._open(path)


@needs_native
def test_a_library_built_against_newer_ffi_headers_than_this_jaxlib_is_refused(monkeypatch):
    """XLA refuses handlers newer than itself, and its CPU backend then fails to start: a build compiled against a
    newer jax's headers (a second environment's, sharing the source tree or the wheel) must never be loaded."""
    running = _native_launch.running_ffi_api_version()
    assert running is not None and running >= 1  # the headers of this jax are readable (0.1 at least)
    path = _native_launch.library_path()
    _native_launch._open(path)  # the loaded build passes the check as it is
    assert f"-ffi{running}-" in _native_launch.cache_dir().name  # cache builds are kept apart per FFI version
    monkeypatch.setattr(_native_launch, "running_ffi_api_version", lambda: running - 1)  # as under an older jaxlib
    with pytest.raises(_native_launch.NativeUnavailable, match="newer than this jaxlib"):
        _native_launch._open(path)


# ---------------------------------------------------------------------------------------------- GPU only


@needs_native
@pytest.mark.gpu
def test_each_gpu_gets_its_own_entry_points(key):
    devices = jax.local_devices(backend="gpu")
    if len(devices) < 2:
        pytest.skip("needs 2 GPUs")
    f = warpnn.jax_kernel(K.scale_square)
    x = jax.random.normal(key, (N,))
    with _launch.use_launcher("native"):
        for d in devices:
            xd = jax.device_put(x, d)
            (y,) = jax.jit(lambda x: f(x, 1.5))(xd)
            assert y.devices() == {d}
            assert_close(y, 1.5 * x * x, 1e-6, 1e-6)


@needs_native
@pytest.mark.gpu
def test_driver_path_matches_warps_launcher(springs_setup, key):
    """On CUDA the handlers launch and zero through the driver; Warp's launcher (the fallback) gives the same."""
    assert _native_launch.driver_entry_points() is not None, "no CUDA driver entry points on a GPU machine"
    pos, springs, stiffness, rest = springs_setup
    forces = springs_fn()
    run = jax.jit(value_and_grads(lambda p, k, r: forces(p, springs, k, r, 0.7), (0, 1, 2), key))
    reference = jax.jit(value_and_grads(lambda p, k, r: K.spring_forces_ref(p, springs, k, r, 0.7), (0, 1, 2), key))
    with _launch.use_launcher("native") as native:
        try:
            native.set_driver_path(False)
            before = native.driver_launches
            through_warp = jax.tree.map(np.asarray, run(pos, stiffness, rest))
            assert native.driver_launches == before, "the driver path was taken while turned off"
        finally:
            native.set_driver_path(True)
        through_driver = jax.tree.map(np.asarray, run(pos, stiffness, rest))
        assert native.driver_launches >= before + 2, "forward and adjoint did not launch through the driver"
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-6, 1e-7), through_driver, through_warp)
    jax.tree.map(lambda a, b: assert_close(a, b, 1e-4, 1e-5), through_driver, jax.tree.map(np.asarray, reference(pos, stiffness, rest)))


@pytest.mark.gpu
@needs_native
def test_native_calls_replay_from_cuda_graphs_inside_scan(tmp_path):
    """Declared command-buffer compatible: under graph-capture flags XLA replays fwd and adjoint without calling back."""
    out = _run_script(tmp_path, """
        import warpnn
        warpnn.enable_cuda_graph_capture()
        import jax, jax.numpy as jnp, numpy as np, warp as wp
        from warpnn import _launch
        from tests import kernels_for_tests as K
        wp.config.quiet = True
        f = warpnn.jax_kernel(K.scale_square)
        def scan(step):
            return lambda x: jax.lax.scan(lambda c, _: (step(c), None), x, None, length=50)[0].sum()
        warp = jax.jit(jax.value_and_grad(scan(lambda c: f(c, 0.9)[0])))
        ref = jax.jit(jax.value_and_grad(scan(lambda c: 0.9 * c * c)))
        x = jnp.linspace(0.1, 0.9, 4096, dtype=jnp.float32)
        for _ in range(3):
            got = warp(x)
        before = sum(_launch.LAUNCHER.handler_entries.values())
        for _ in range(20):
            got = warp(x)
        jax.block_until_ready(got)
        per_launch = (sum(_launch.LAUNCHER.handler_entries.values()) - before) / (20 * 100)
        want = ref(x)
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
        print(_launch.LAUNCHER.name, per_launch)
    """, {_launch.LAUNCHER_ENV: "native"}, drop=("XLA_FLAGS",))
    assert out.returncode == 0, out.stderr[-3000:]
    name, per_launch = out.stdout.split()[-2:]
    assert name == "native" and float(per_launch) < 0.1, out.stdout
