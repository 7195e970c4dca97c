"""Reusable Warp kernels wrapped as differentiable JAX functions.

Each submodule groups the kernels of one kind of simulation: ``warpnn.kernels.cloth`` (mass-spring
cloth and soft bodies), ``warpnn.kernels.pointcloud`` (nearest neighbours, Chamfer, radius features). Models built from them live outside the library, in ``warpnn_models``.
"""

from . import cloth as cloth
from . import pointcloud as pointcloud

__all__ = ["cloth", "pointcloud"]
