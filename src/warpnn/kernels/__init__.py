"""Reusable Warp kernels wrapped as differentiable JAX functions.

Each submodule groups the kernels of one kind of simulation: ``warpnn.kernels.cloth`` (mass-spring
cloth and soft bodies), ``warpnn.kernels.pointcloud`` (nearest neighbours, Chamfer distance, radius
features), ``warpnn.kernels.mesh`` (signed distance to a ``wp.Mesh``, penetration penalty),
``warpnn.kernels.tiles`` (matrix product and dense layer in Warp tiles). Models built
from them live outside the library, in ``warpnn_models``.
"""

from . import cloth as cloth
from . import mesh as mesh
from . import pointcloud as pointcloud
from . import tiles as tiles

__all__ = ["cloth", "mesh", "pointcloud", "tiles"]
