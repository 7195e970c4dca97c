"""warpnn: NVIDIA Warp kernels as differentiable JAX functions and Flax / Equinox layers.

The public surface is this file; everything in ``warpnn._*`` may change.
"""

from ._bridge import SECOND_ORDER_MESSAGE as SECOND_ORDER_MESSAGE
from ._bridge import WarpKernel as WarpKernel
from ._bridge import jax_kernel as jax_kernel
from ._binding import Binding as Binding
from ._binding import bind as bind
from ._cuda_graphs import enable_cuda_graph_capture as enable_cuda_graph_capture
from ._devices import jax_warp_device as jax_warp_device
from ._io import atomic_write as atomic_write
from ._io import atomic_write_bytes as atomic_write_bytes
from ._tracer import WarpProgram as WarpProgram
from ._tracer import trace as trace

# Layers for each framework are submodules, imported on demand so that warpnn needs neither Flax nor
# Equinox to import: warpnn.equinox.WarpLayer, warpnn.nnx.WarpLayer, warpnn.linen.WarpLayer.

__version__ = "0.1.0"
