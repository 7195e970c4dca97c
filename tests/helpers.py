"""Test helpers shared across test files."""

import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_close(actual, expected, rtol=1e-5, atol=1e-6, err_msg=""):
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=rtol, atol=atol, err_msg=err_msg)


def subprocess_env(*first: str, **variables: str) -> dict[str, str]:
    """The environment for a Python subprocess of a test: this one's, with ``variables`` set, and ``first``, the
    repository root and ``src/`` at the front of ``PYTHONPATH``, *before* what is already there. Whatever made
    Warp importable in this process (a ``--target`` install on ``PYTHONPATH``, as on the GPU machine) must stay
    visible to the child: replacing ``PYTHONPATH`` crashed every fuzz case there with "No module named 'warp'"."""
    path = [*first, ROOT, os.path.join(ROOT, "src"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **variables, "PYTHONPATH": os.pathsep.join(p for p in path if p)}


def on_one_device():
    """Warp's default device and JAX's on one platform: the GPU on a GPU host, else the CPU (a context manager).

    A program traced from launches with thread blocks replays only on the platform it was traced on."""
    import contextlib

    import jax
    import warp as wp

    stack = contextlib.ExitStack()
    if jax.default_backend() == "gpu":
        stack.enter_context(jax.default_device(jax.devices("gpu")[0]))
        stack.enter_context(wp.ScopedDevice("cuda:0"))
    else:
        stack.enter_context(jax.default_device(jax.devices("cpu")[0]))
        stack.enter_context(wp.ScopedDevice("cpu"))
    return stack
