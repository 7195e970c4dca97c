"""Shared fixtures. The suite runs unchanged on CPU (CI) and on a GPU machine: the backend is whatever
JAX picks; tests marked ``gpu`` skip cleanly when no GPU is present."""

import gc
import os

import jax
import pytest
import warp as wp

wp.config.log_level = wp.LOG_WARNING  # Warp 1.19: no banner or module-load lines (wp.config.quiet is gone)

from .helpers import QUICK_COMPILE_LEVEL  # noqa: E402

if QUICK_COMPILE_LEVEL is not None and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # On a CPU machine XLA's own compiles are likewise unoptimised (LLVM -O0): a MuJoCo rollout's gradient compiled
    # in 4.2 s instead of 6.5 s; the whole suite took 1,424 s of test time instead of 1,721 s. XLA reads the flag
    # when JAX first makes its CPU client, after this; the tests' subprocesses inherit it. A GPU host keeps XLA's
    # default.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

_default_optimization_level = wp.config.optimization_level


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """One persistent XLA compilation cache for this run, shared by its xdist workers and by nothing else.

    Many tests call ``jax.clear_caches()`` (a configuration read at trace time must be traced again), and with
    the traces go the compiled executables of every eager ``jnp`` operation and every ``jax.jit`` after it:
    the same few hundred small programs were compiled again in each test, most of a CPU run's time. XLA
    compiles an executable from its HLO alone, so one loaded from this cache is the one a compile would give;
    the programs are still traced and lowered anew (what the tests check), only their compilation is shared.
    The directory lives under this run's pytest base temp (which pytest prunes), so every run starts cold:
    nothing carries over from an earlier run. Set here, before collection: JAX decides at its first compile
    whether the cache is used."""
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or jax.config.jax_compilation_cache_dir:
        return  # no base temp (pytest -p no:tmpdir), or the caller chose a cache of their own
    base = factory.getbasetemp()
    run = base.parent if hasattr(config, "workerinput") else base  # xdist: <run>/popen-gwN, shared <run>
    jax.config.update("jax_compilation_cache_dir", str(run / "xla-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_runtest_setup(item):
    # (a hook, not a fixture: it must cover the module-scoped fixtures that build and trace the programs)
    if QUICK_COMPILE_LEVEL is not None and item.get_closest_marker("quick_compile") is not None:
        wp.config.optimization_level = QUICK_COMPILE_LEVEL


def pytest_runtest_teardown(item, nextitem):
    wp.config.optimization_level = _default_optimization_level


def pytest_addoption(parser):
    parser.addoption("--corpus-full", action="store_true", default=False,
                     help="cross-check the access facts over every corpus package, warp.examples included (slow)")
    parser.addoption("--slow", action="store_true", default=False,
                     help="also run the tests marked slow on a CPU-only machine (a GPU host always runs them)")


# The longest tests (tens of seconds of subprocesses each on a 2-core machine), in the order they start. Under
# -n auto xdist hands tests out in collection order, and one of these started last kept one worker busy for half
# a minute after the other had finished; started first, they overlap with the many short tests.
SLOW_FIRST = (
    "tests/test_warp_interop.py::",
    "tests/test_access.py::test_walk_agrees_with_warp_codegen_on_real_code",
    "tests/test_sharding.py::",
    "tests/test_train_cli.py::",
)


# Modules whose tests share module-scoped fixtures that take long to build (a MuJoCo model traced, its Warp modules
# compiled): under -n with few workers their tests run on one worker, in collection order, which builds each fixture
# once. Under xdist's default scheduling CI's two workers both built the arm (13-15 s each) and compiled the same
# kernels at once. With more workers (a GPU host's -n 8) the module alone would outlast the rest of the suite.
ONE_WORKER_MODULES = ("tests/test_models_mujoco.py",)
ONE_WORKER_MODULES_UP_TO = 2  # workers
# Tests that trace MuJoCo Warp in their own process run on that module's worker too: the code-generation facts,
# twins and checks of mujoco_warp's kernels are then made once per run, not once per worker.
ONE_WORKER_ALSO = {"tests/test_train_mujoco.py": "tests/test_models_mujoco.py",
                   "tests/test_access.py::test_walk_agrees_with_warp_codegen_on_real_code[mujoco_warp]":
                       "tests/test_models_mujoco.py"}


@pytest.hookimpl(optionalhook=True)  # (an xdist hook: without xdist, never called)
def pytest_xdist_make_scheduler(config, log):
    """xdist's ``load`` with each of ``ONE_WORKER_MODULES`` one unit of work, for a few workers. (Not
    ``--dist=loadgroup``: with pytest 9 its ``xdist_group`` marks no longer reach the scheduler, xdist 3.8 rewrites
    a node id pytest now derives elsewhere.)"""
    workers = config.getoption("numprocesses")
    if config.getvalue("dist") != "load" or not isinstance(workers, int) or workers > ONE_WORKER_MODULES_UP_TO:
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            if module in ONE_WORKER_MODULES:
                return module
            return ONE_WORKER_ALSO.get(nodeid, ONE_WORKER_ALSO.get(module, nodeid))

    return OneWorkerModules(config, log)


def _slow_first(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(SLOW_FIRST) if nodeid.startswith(prefix)), len(SLOW_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: _slow_first(item.nodeid))  # stable: collection order otherwise
    if jax.default_backend() == "gpu":
        return
    # (the suite keeps under 10 minutes on CI's 2-core machine; a GPU host runs these, or pytest --slow here)
    skip_slow = None if config.getoption("--slow") else pytest.mark.skip(reason="slow on a CPU: pytest --slow runs it")
    skip = pytest.mark.skip(reason="needs a CUDA GPU (jax.default_backend() != 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
        elif skip_slow is not None and "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session):
    """Free the run's garbage now, while the session is still finishing, and freeze what is left.

    Under ``-n auto`` an xdist worker reports "workerfinished" at the end of this hook; the controller then
    asks it to exit, and execnet sends the worker a SIGINT when it has not finished within 5 s (the
    ``KeyboardInterrupt`` traceback that ended some runs). What the worker still does then is pytest's
    unconfigure: the unraisable-exception and thread-exception plugins each run a full ``gc.collect()``,
    which after a whole suite walks every object JAX, Warp and the tests made and runs the finalizers of
    freed XLA executables: seconds on a loaded 2-core machine. Collected here instead (the controller waits
    for "workerfinished" without a limit), with JAX's compilation caches dropped first; ``gc.freeze()`` then
    leaves those later collections only what was made after this point."""
    jax.clear_caches()
    gc.collect()
    gc.freeze()


@pytest.fixture
def key():
    return jax.random.PRNGKey(0)


@pytest.fixture
def x64():
    """Run a test with 64-bit JAX types (for float64 kernels and check_grads)."""
    with jax.enable_x64(True):
        yield

