"""Shared fixtures. The suite runs unchanged on CPU (CI) and on a GPU machine: the backend is whatever
JAX picks; tests marked ``gpu`` skip cleanly when no GPU is present."""

import jax
import pytest
import warp as wp

wp.config.log_level = wp.LOG_WARNING  # Warp 1.19: no banner or module-load lines (wp.config.quiet is gone)


def pytest_addoption(parser):
    parser.addoption("--corpus-full", action="store_true", default=False,
                     help="cross-check the access facts over every corpus package, warp.examples included (slow)")


def pytest_collection_modifyitems(config, items):
    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (jax.default_backend() != 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def key():
    return jax.random.PRNGKey(0)


@pytest.fixture
def x64():
    """Run a test with 64-bit JAX types (for float64 kernels and check_grads)."""
    with jax.enable_x64(True):
        yield
