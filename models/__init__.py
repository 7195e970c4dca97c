"""Reusable models built from warpnn layers (installed as ``warpnn_models``).

``warpnn_models.cloth`` (mass-spring cloth and soft bodies), ``warpnn_models.pointcloud`` (point-cloud
deformation under Chamfer loss), ``warpnn_models.mesh`` (mesh obstacles and mesh generators),
``warpnn_models.newton`` (Newton's solvers as differentiable JAX steps; needs the ``newton`` extra),
``warpnn_models.mujoco`` (``mujoco_warp.step`` as a JAX step; needs the ``mujoco`` extra). Each
submodule is imported on demand: ``import warpnn_models.cloth``.
"""

__all__ = ["cloth", "mesh", "mujoco", "newton", "pointcloud"]
