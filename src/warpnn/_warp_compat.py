"""Every use of Warp's private API lives here, so a Warp upgrade touches one file.

warpnn needs a few things Warp does not export: the ctypes mirror of XLA's FFI call frame
(``warp._src.jax.xla_ffi``), Warp's own ``jax_callable`` machinery (``warp._src.jax.ffi``: taken from
there rather than from ``wp.jax_callable``, which a user may have replaced by warpnn's), the array descriptor ``array_t``, launch-bound construction,
and the CPU entry-point invoker. They are stable across the 1.19 series that
``pyproject.toml`` pins.
"""

from __future__ import annotations

import warp as wp
from warp._src.context import _build_kernel_launch_bounds as build_launch_bounds
from warp._src.context import invoke as invoke_cpu
from warp._src.context import _resolve_launch_block_dim as resolve_block_dim
from warp._src.context import invoke_cpu_blocks
from warp._src.jax import ffi as jax_ffi
from warp._src.jax import xla_ffi
from warp._src.jax.ffi import _validate_ffi_kernel_launch_bounds as validate_launch_bounds
from warp._src.types import array_t, matches_array_class, strides_from_shape, type_size_in_bytes, value_types
from warp._src.types import float_types, int_types, type_scalar_type

__all__ = [
    "array_t",
    "build_launch_bounds",
    "invoke_cpu",
    "invoke_cpu_blocks",
    "jax_ffi",
    "matches_array_class",
    "resolve_block_dim",
    "runtime",
    "strides_from_shape",
    "type_size_in_bytes",
    "validate_launch_bounds",
    "value_types",
    "float_types",
    "int_types",
    "type_scalar_type",
    "xla_ffi",
]


def runtime():
    """Warp's runtime singleton, initialising Warp on first use."""
    if wp._src.context.runtime is None:
        wp.init()
    return wp._src.context.runtime
