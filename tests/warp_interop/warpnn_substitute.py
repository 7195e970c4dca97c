"""pytest plugin: run Warp's own JAX interop tests with warpnn in place of Warp's bridge.

Warp's ``warp/tests/interop/test_jax.py`` looks its bridge up as ``wp.jax_kernel`` / ``wp.jax_callable`` (and
``wp.clear_jax_callable_graph_cache``) when a
test runs, so replacing those attributes before collection substitutes warpnn everywhere without modifying
the file. Used by ``tests/test_warp_interop.py`` as ``python -m pytest -p warpnn_substitute ...``.
"""

import os

import warp as wp

import warpnn


def pytest_configure(config):
    # WARPNN_SUBSTITUTE=jax_callable substitutes only jax_callable (and its graph-cache helper); else both.
    if os.environ.get("WARPNN_SUBSTITUTE", "all") != "jax_callable":
        wp.jax_kernel = warpnn.jax_kernel
    wp.jax_callable = warpnn.jax_callable
    wp.clear_jax_callable_graph_cache = warpnn.clear_jax_callable_graph_cache
