"""Point-cloud models: shape samplers, a learned deformation field, and the Chamfer losses.

The Warp functions come from :mod:`warpnn.kernels.pointcloud` and are re-exported here with their pure-JAX
references, so benchmarks and training code import one place::

    from warpnn_models.pointcloud import chamfer, chamfer_reference
    chamfer(x, y)            # Warp: in-graph Morton grid + box tree, one thread per query point
    chamfer_reference(x, y)  # pure JAX: batched brute force, memory batch_size * n

Both are ``mean_i min_j |x_i - y_j|^2 + mean_j min_i |y_j - x_i|^2`` for (n, 3) and (m, 3) clouds, and
differentiable with respect to both clouds.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from warpnn.kernels.pointcloud import (
    chamfer,
    chamfer_reference,
    nearest_neighbors,
    nearest_neighbors_reference,
    radius_features,
    radius_features_reference,
)

__all__ = [
    "PointDeformer",
    "chamfer",
    "chamfer_reference",
    "nearest_neighbors",
    "nearest_neighbors_reference",
    "radius_features",
    "radius_features_reference",
    "sphere_points",
    "torus_points",
]


def sphere_points(n: int, radius: float = 1.0) -> np.ndarray:
    """``n`` points spread evenly over a sphere (Fibonacci lattice, deterministic): (n, 3) float32."""
    i = np.arange(n) + 0.5
    z = 1.0 - 2.0 * i / n
    phi = np.pi * (3.0 - 5.0**0.5) * i  # golden angle steps: no two points line up
    r = np.sqrt(1.0 - z * z)
    return (radius * np.stack([r * np.cos(phi), r * np.sin(phi), z], -1)).astype(np.float32)


def torus_points(n: int, major: float = 1.0, minor: float = 0.35, seed: int = 0) -> np.ndarray:
    """``n`` points uniform over the area of a torus around the z axis: (n, 3) float32.

    The tube angle ``v`` is drawn by rejection with density proportional to ``major + minor * cos(v)``
    (the outer side has more area than the inner side).
    """
    rng = np.random.default_rng(seed)
    vs = np.empty(0)
    while vs.size < n:
        v = rng.uniform(0.0, 2.0 * np.pi, 2 * n)
        keep = rng.uniform(0.0, major + minor, 2 * n) < major + minor * np.cos(v)
        vs = np.concatenate([vs, v[keep]])
    v = vs[:n]
    u = rng.uniform(0.0, 2.0 * np.pi, n)
    ring = major + minor * np.cos(v)
    return np.stack([ring * np.cos(u), ring * np.sin(u), minor * np.sin(v)], -1).astype(np.float32)


class PointDeformer(eqx.Module):
    """A learned deformation field ``x -> x + mlp(x)`` applied to every point of a cloud.

    The last layer starts at zero, so the untrained deformer is the identity.

    Attributes:
        mlp: the displacement network, R^3 -> R^3.
    """

    mlp: eqx.nn.MLP

    def __init__(self, key: jax.Array, width: int = 128, depth: int = 3):
        mlp = eqx.nn.MLP(3, 3, width, depth, activation=jax.nn.gelu, key=key)
        last = mlp.layers[-1]
        self.mlp = eqx.tree_at(lambda m: (m.layers[-1].weight, m.layers[-1].bias), mlp,
                               (jnp.zeros_like(last.weight), jnp.zeros_like(last.bias)))

    def __call__(self, points: jax.Array) -> jax.Array:
        """(n, 3) points -> (n, 3) deformed points."""
        return points + jax.vmap(self.mlp)(points)
