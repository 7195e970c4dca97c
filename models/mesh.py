"""Triangle meshes built in code, and a mesh obstacle that pushes particles (e.g. cloth) out of it.

Generators return NumPy ``(vertices (v, 3) float32, faces (f, 3) int32)``, closed and oriented
counter-clockwise seen from outside, so signed distances are negative inside:

* :func:`icosphere`: a subdivided icosahedron projected on a sphere;
* :func:`box`: an axis-aligned box, two triangles per side;
* :func:`torus`: a torus around the z axis.

:class:`MeshObstacle` is an Equinox module that owns a ``wp.Mesh`` (a static field, so it is kept alive
as long as the module and never traced) and gives per-particle penalty energies and forces; plug its
``forces`` into a cloth step as the external force::

    obstacle = MeshObstacle.from_arrays(*icosphere(3, radius=0.3), stiffness=1e4, margin=0.01)
    x, v = cloth.step(x, v, f_ext=obstacle.forces(x))
"""

from __future__ import annotations

import equinox as eqx
import jax
import numpy as np
import warp as wp

from warpnn.kernels.mesh import make_mesh, mesh_penalty, signed_distance, signed_distance_reference

__all__ = ["MeshObstacle", "box", "icosphere", "signed_distance_reference", "torus"]


def icosphere(subdivisions: int = 2, radius: float = 1.0, center=(0.0, 0.0, 0.0)) -> tuple[np.ndarray, np.ndarray]:
    """A sphere meshed as a subdivided icosahedron: ``10 * 4^s + 2`` vertices, ``20 * 4^s`` faces.

    Args:
        subdivisions: times each triangle is split into four (0 gives the icosahedron).
        radius: sphere radius. center: (3,) sphere centre.

    Returns:
        ``(vertices, faces)``: (v, 3) float32 and (f, 3) int32, outward-oriented.
    """
    t = (1.0 + 5.0**0.5) / 2.0
    verts = [(-1, t, 0), (1, t, 0), (-1, -t, 0), (1, -t, 0), (0, -1, t), (0, 1, t),
             (0, -1, -t), (0, 1, -t), (t, 0, -1), (t, 0, 1), (-t, 0, -1), (-t, 0, 1)]
    verts = [np.asarray(v, np.float64) / np.linalg.norm(v) for v in verts]
    faces = [(0, 11, 5), (0, 5, 1), (0, 1, 7), (0, 7, 10), (0, 10, 11), (1, 5, 9), (5, 11, 4), (11, 10, 2),
             (10, 7, 6), (7, 1, 8), (3, 9, 4), (3, 4, 2), (3, 2, 6), (3, 6, 8), (3, 8, 9), (4, 9, 5),
             (2, 4, 11), (6, 2, 10), (8, 6, 7), (9, 8, 1)]
    for _ in range(subdivisions):
        midpoint: dict[tuple[int, int], int] = {}

        def mid(i, j):
            key = (min(i, j), max(i, j))
            if key not in midpoint:  # shared by the two faces of the edge
                m = verts[i] + verts[j]
                verts.append(m / np.linalg.norm(m))
                midpoint[key] = len(verts) - 1
            return midpoint[key]

        new_faces = []
        for a, b, c in faces:
            ab, bc, ca = mid(a, b), mid(b, c), mid(c, a)
            new_faces += [(a, ab, ca), (b, bc, ab), (c, ca, bc), (ab, bc, ca)]
        faces = new_faces
    vertices = np.asarray(verts) * radius + np.asarray(center, np.float64)
    return vertices.astype(np.float32), np.asarray(faces, np.int32)


def box(extents=(1.0, 1.0, 1.0), center=(0.0, 0.0, 0.0)) -> tuple[np.ndarray, np.ndarray]:
    """An axis-aligned box of side lengths ``extents``: 8 vertices, 12 outward-oriented triangles."""
    corners = np.array([[x, y, z] for z in (-0.5, 0.5) for y in (-0.5, 0.5) for x in (-0.5, 0.5)])
    vertices = corners * np.asarray(extents, np.float64) + np.asarray(center, np.float64)
    # Vertex k has bits (x, y, z) = (k & 1, k >> 1 & 1, k >> 2 & 1); each side is two triangles.
    quads = [(0, 2, 3, 1), (4, 5, 7, 6), (0, 1, 5, 4), (2, 6, 7, 3), (0, 4, 6, 2), (1, 3, 7, 5)]
    faces = [tri for a, b, c, d in quads for tri in ((a, b, c), (a, c, d))]
    return vertices.astype(np.float32), np.asarray(faces, np.int32)


def torus(major: float = 1.0, minor: float = 0.35, n_major: int = 48, n_minor: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """A torus around the z axis: tube radius ``minor`` at distance ``major`` from the axis.

    Args:
        major: distance from the z axis to the tube's centre line. minor: tube radius (< major).
        n_major: segments around the z axis. n_minor: segments around the tube.

    Returns:
        ``(vertices, faces)``: (n_major * n_minor, 3) float32 and (2 * n_major * n_minor, 3) int32.
    """
    if not 0 < minor < major:
        raise ValueError(f"torus: need 0 < minor < major, got minor={minor}, major={major}.")
    u = 2 * np.pi * np.arange(n_major) / n_major
    v = 2 * np.pi * np.arange(n_minor) / n_minor
    uu, vv = np.meshgrid(u, v, indexing="ij")
    ring = major + minor * np.cos(vv)
    vertices = np.stack([ring * np.cos(uu), ring * np.sin(uu), minor * np.sin(vv)], -1).reshape(-1, 3)
    i, j = np.meshgrid(np.arange(n_major), np.arange(n_minor), indexing="ij")
    a = i * n_minor + j
    b = ((i + 1) % n_major) * n_minor + j
    c = ((i + 1) % n_major) * n_minor + (j + 1) % n_minor
    d = i * n_minor + (j + 1) % n_minor
    faces = np.concatenate([np.stack([a, b, c], -1).reshape(-1, 3), np.stack([a, c, d], -1).reshape(-1, 3)])
    return vertices.astype(np.float32), faces.astype(np.int32)


class MeshObstacle(eqx.Module):
    """A fixed triangle-mesh obstacle with a penalty contact for particles.

    Attributes:
        mesh: the ``wp.Mesh`` (static: compared by identity, kept alive by the module).
        stiffness: penalty stiffness (force per unit depth).
        margin: contact thickness: particles within ``margin`` of the surface are pushed out too.
    """

    mesh: wp.Mesh = eqx.field(static=True)
    stiffness: float = eqx.field(static=True)
    margin: float = eqx.field(static=True, default=0.0)

    @classmethod
    def from_arrays(cls, vertices, faces, *, stiffness: float, margin: float = 0.0) -> MeshObstacle:
        """Build the ``wp.Mesh`` (on JAX's device) from ``vertices`` (v, 3) and ``faces`` (f, 3)."""
        return cls(make_mesh(vertices, faces), float(stiffness), float(margin))

    @property
    def vertices(self) -> np.ndarray:
        """(v, 3) float32 vertices (a host copy), e.g. for plots or the pure-JAX reference."""
        return self.mesh.points.numpy()

    @property
    def faces(self) -> np.ndarray:
        """(f, 3) int32 triangles (a host copy)."""
        return self.mesh.indices.numpy().reshape(-1, 3)

    def signed_distance(self, points: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(n, 3) float32 points -> (sdf (n,), normal (n, 3)); see :func:`warpnn.kernels.mesh.signed_distance`."""
        return signed_distance(self.mesh, points)

    def penalty(self, points: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(n, 3) float32 points -> (energy (n,), force (n, 3)); see :func:`warpnn.kernels.mesh.mesh_penalty`."""
        return mesh_penalty(self.mesh, points, stiffness=self.stiffness, margin=self.margin)

    def energy(self, points: jax.Array) -> jax.Array:
        """Total penalty energy (a scalar), differentiable with respect to ``points`` (n, 3)."""
        return self.penalty(points)[0].sum()

    def forces(self, points: jax.Array) -> jax.Array:
        """(n, 3) contact forces on the particles (``-grad(energy)``), e.g. a cloth step's ``f_ext``."""
        return self.penalty(points)[1]
