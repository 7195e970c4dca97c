"""warpnn: NVIDIA Warp kernels as differentiable JAX functions and Flax / Equinox layers.

The public surface is this file; everything in ``warpnn._*`` may change.
"""

from ._bridge import SECOND_ORDER_MESSAGE as SECOND_ORDER_MESSAGE
from ._bridge import WarpKernel as WarpKernel
from ._bridge import jax_kernel as jax_kernel
from ._binding import Binding as Binding
from ._callable import WarpCallable as WarpCallable
from ._callable import clear_jax_callable_graph_cache as clear_jax_callable_graph_cache
from ._callable import jax_callable as jax_callable
from ._callable import register_ffi_callback as register_ffi_callback
from ._binding import bind as bind
from ._checked import KernelIndexError as KernelIndexError
from ._checked import checked as checked
from ._checked import is_checked as is_checked
from ._checked import set_checked as set_checked
from ._cuda_graphs import enable_cuda_graph_capture as enable_cuda_graph_capture
from ._devices import jax_warp_device as jax_warp_device
from ._equality_guard import keep_side_taken as keep_side_taken
from ._io import atomic_write as atomic_write
from ._io import atomic_write_bytes as atomic_write_bytes
from ._stage_rules import StageRule as StageRule
from ._tracer import LaunchRecord as LaunchRecord
from ._tracer import WarpProgram as WarpProgram
from ._tracer import trace as trace

# Layers for each framework are submodules, imported on demand so that warpnn needs neither Flax nor
# Equinox to import: warpnn.equinox.WarpLayer, warpnn.nnx.WarpLayer, warpnn.linen.WarpLayer.

__version__ = "0.2.0"  # the one place the version is written: pyproject.toml reads it from here

# Every public name, for `from warpnn import *`, help(warpnn) and the API reference (docs/api/warpnn.md
# renders exactly these). Add a name here when you re-export it above.
__all__ = [
    "SECOND_ORDER_MESSAGE",
    "StageRule",
    "Binding",
    "KernelIndexError",
    "LaunchRecord",
    "WarpCallable",
    "WarpKernel",
    "WarpProgram",
    "atomic_write",
    "atomic_write_bytes",
    "bind",
    "checked",
    "clear_jax_callable_graph_cache",
    "enable_cuda_graph_capture",
    "keep_side_taken",
    "is_checked",
    "jax_callable",
    "jax_kernel",
    "jax_warp_device",
    "register_ffi_callback",
    "set_checked",
    "trace",
]
