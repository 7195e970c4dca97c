"""warpnn: NVIDIA Warp kernels as differentiable JAX functions and Flax / Equinox layers.

The public surface is this file; everything in ``warpnn._*`` may change.
"""

from ._bridge import SECOND_ORDER_MESSAGE as SECOND_ORDER_MESSAGE
from ._bridge import WarpKernel as WarpKernel
from ._bridge import jax_kernel as jax_kernel

__version__ = "0.1.0"
