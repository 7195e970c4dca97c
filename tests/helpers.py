"""Test helpers shared across test files."""

import fcntl
import json
import os

import numpy as np
import warp as wp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The clang optimization level for tests marked quick_compile and some docs blocks (Newton's and MuJoCo
# Warp's programs: hundreds of kernels, small arrays, a few steps) on a CPU machine: -O0 (Warp's CPU default: -O2).
# CI starts from an empty kernel cache, so there compiling is most of their time: Featherstone's and the
# semi-implicit cloth's differential tests went from 45 s to 17 s each, the XPBD forward test from 37 s to 15 s.
# Results do not change (no fast-math at either level). Not the whole suite: kernels that run long (warp.examples'
# tile n-body under finite differences) ran 30x slower. A GPU keeps Warp's default (it applies to CUDA kernels too).
# conftest.py sets it around each marked test; the snippet runner in its subprocess.
QUICK_COMPILE_LEVEL = None if wp.is_cuda_available() else 0


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, err_msg=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol, err_msg=err_msg)


def subprocess_env(*first: str, **variables: str) -> dict[str, str]:
    """The environment for a Python subprocess of a test: this one's, with ``variables`` set, and ``first``, the
    repository root and ``src/`` at the front of ``PYTHONPATH``, *before* what is already there. Whatever made
    Warp importable in this process (a ``--target`` install on ``PYTHONPATH``, as on the GPU machine) must stay
    visible to the child: replacing ``PYTHONPATH`` crashed every fuzz case there with "No module named 'warp'"."""
    path = [*first, ROOT, os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **_compilation_cache_env(), **variables, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def _compilation_cache_env() -> dict[str, str]:
    """The run's persistent XLA compilation cache (conftest.py) for a subprocess too: the children of one test
    (a check under each launcher, thread count or pool setting) compile the same programs. Nothing where this
    process has no cache or JAX is not loaded."""
    import sys

    jax = sys.modules.get("jax")
    directory = jax.config.jax_compilation_cache_dir if jax is not None else None
    if not directory:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": directory, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def on_one_device():
    """Warp's default device and JAX's on one platform: the GPU on a GPU host, else the CPU (a context manager).

    A program traced from launches with thread blocks replays only on the platform it was traced on."""
    import contextlib

    import jax

    stack = contextlib.ExitStack()
    if jax.default_backend() == "gpu":
        stack.enter_context(jax.default_device(jax.devices("gpu")[0]))
        stack.enter_context(wp.ScopedDevice("cuda:0"))
    else:
        stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
        stack.enter_context(wp.ScopedDevice("cpu"))
    return stack


def once_per_run(tmp_path_factory, name: str, compute):
    """``compute()``'s JSON-able result, computed once per test run and shared by every xdist worker.

    A module-scoped fixture runs once per worker that runs one of its tests, and ``-n auto`` spreads a module's
    tests over the workers: a fixture that runs a subprocess for tens of seconds ran on both workers of a 2-core
    machine. The first worker to need the result computes it under a lock in the run's shared temporary folder;
    the others wait for it and read it. (xdist's ``--dist loadgroup`` would pin the tests to one worker instead,
    but xdist 3.8 renames the tests through ``item._nodeid``, which pytest 9.2 no longer reads.) An exception
    in ``compute`` (a skip, a failure) stores nothing, and the next worker tries again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # basetemp/gwN: the parent is the run's, shared by its workers
    path = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return json.loads(path.read_text())
        result = compute()
        path.write_text(json.dumps(result))
        return result


def on_cpu_threads(compute):
    """``compute()`` with every CPU launch split over 3 worker threads (None where launches are not the native CPU
    handler's): the same kernels, atomics and scatters summed per thread and then together."""
    import jax

    from warpnn import _batched
    from warpnn._launch import LAUNCHER

    if LAUNCHER.name != "native" or jax.default_backend() != "cpu":
        return None
    twins = LAUNCHER.impl.twins
    saved = _batched._LAUNCH_CONFIG.get()
    twins.set_cpu_threads(3, 1)
    jax.clear_caches()  # (each lowering keeps the thread decision it was made with)
    try:
        return jax.tree.map(np.asarray, compute())
    finally:
        twins.set_cpu_threads(*saved)
        jax.clear_caches()


def warp_config_kept():
    """A context manager that puts Warp's global config back as it was: some of Warp's examples set it when
    imported (``wp.config.enable_backward = False`` in the FDTD example), and every module made later in the
    process would then compile without adjoints (a later test's ``wp.Tape`` reference would be wrong)."""
    import contextlib

    @contextlib.contextmanager
    def kept():
        wp.init()  # (Warp fills some config values, the kernel cache's path, when it starts: not the examples' doing)
        config = {k: v for k, v in vars(wp.config).items() if not k.startswith("__") and not callable(v)}
        try:
            yield
        finally:
            for k, v in config.items():
                setattr(wp.config, k, v)

    return kept()
