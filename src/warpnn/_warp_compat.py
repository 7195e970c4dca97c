"""Every use of Warp's private API lives here, so a Warp upgrade touches one file.

warpnn needs a few things Warp does not export: the ctypes mirror of XLA's FFI call frame
(``warp._src.jax.xla_ffi``), Warp's own ``jax_callable`` machinery (``warp._src.jax.ffi``: taken from
there rather than from ``wp.jax_callable``, which a user may have replaced by warpnn's), the array descriptor ``array_t``, launch-bound construction,
and the CPU entry-point invoker. They are stable across the 1.19 series that
``pyproject.toml`` pins.
"""

from __future__ import annotations

import warp as wp
from warp._src.codegen import _TID_MAX_EXTENT as TID_MAX_EXTENT
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
    "tid_extent_limit",
]


def tid_extent_limit(kernel) -> int | None:
    """The largest extent of each ``wp.tid()`` dimension a launch of ``kernel`` may have (None: no limit).

    Warp gates every kernel at ``adj.tid_extent_limit_candidate`` (2**31: ``wp.tid()`` is a signed 32-bit
    coordinate) and resolves the exact value (None for a kernel that never calls ``wp.tid()``) only for a launch
    past it, by a code generation of the kernel; warpnn's launch bounds, built at lowering for each launch's dims
    (``build_launch_bounds``), go through that same gate. The native handler's copy of the limit, registered
    once per kernel, takes the exact value where Warp has resolved it and the candidate otherwise: resolving it
    for every kernel cost a code generation each (7 of the 37 s a MuJoCo step's gradient took to lower on a CPU).
    """
    module, key = kernel.module, getattr(kernel, "hash", None)
    if key is not None:
        for (_, kernel_hash), limit in getattr(module, "_tid_extent_limits", {}).items():
            if kernel_hash == key:
                return limit
    return getattr(kernel.adj, "tid_extent_limit_candidate", TID_MAX_EXTENT)  # (set when Warp resolves the kernel)


def runtime():
    """Warp's runtime singleton, initialising Warp on first use."""
    if wp._src.context.runtime is None:
        wp.init()
    return wp._src.context.runtime
