"""pytest plugin: run Warp's own JAX interop tests with warpnn in place of Warp's bridge.

Warp's ``warp/tests/interop/test_jax.py`` looks its bridge up as ``wp.jax_kernel`` / ``wp.jax_callable`` when a
test runs, so replacing those attributes before collection substitutes warpnn everywhere without modifying
the file. Used by ``tests/test_warp_interop.py`` as ``python -m pytest -p warpnn_substitute ...``.
"""

import warp as wp

import warpnn


def pytest_configure(config):
    wp.jax_kernel = warpnn.jax_kernel
    if hasattr(warpnn, "jax_callable"):
        wp.jax_callable = warpnn.jax_callable
