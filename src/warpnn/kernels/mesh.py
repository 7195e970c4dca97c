"""Triangle-mesh kernels: signed distance from points to a ``wp.Mesh``, and a penetration penalty.

A mesh here is a fixed obstacle or target: a ``wp.Mesh`` (vertices, triangles and Warp's BVH over them)
is built once on the host from concrete arrays, owned by the caller, and passed to every call; its
``uint64`` id is a compile-time constant of the call. Query points are JAX arrays that may change every
step; one Warp thread per point runs ``wp.mesh_query_point_sign_normal`` (the BVH closest-point query,
with the sign from the angle-weighted pseudo-normal), so results are differentiable with respect to the
points through Warp's adjoint of the query. To move a mesh rigidly, transform the points into its frame
instead of rebuilding it; to deform it, update ``mesh.points`` and ``mesh.refit()`` outside ``jit`` (the id
stays the same, nothing retraces).

Warp meshes are float32, so these functions take and return float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

from .._bridge import jax_kernel
from .._devices import geometry_id, jax_warp_device

__all__ = [
    "closest_point_on_triangle",
    "make_mesh",
    "mesh_penalty",
    "mesh_penalty_reference",
    "signed_distance",
    "signed_distance_kernel",
    "signed_distance_reference",
    "winding_number",
]

# Below this distance a point is on the surface, where (p - closest) has no direction; the face normal
# is used instead.
_ON_SURFACE = 1.0e-7
# Default query range: large enough that a deeply penetrating point still finds its closest face (the
# sign comes from that face), so "not found" only happens for points farther than any useful distance.
_DEFAULT_MAX_DIST = 1.0e6


@wp.kernel
def _signed_distance_kernel(
    mesh: wp.uint64,
    points: wp.array(dtype=wp.vec3),
    max_dist: float,
    sdf: wp.array(dtype=float),
    normal: wp.array(dtype=wp.vec3),
):
    i = wp.tid()
    p = points[i]
    query = wp.mesh_query_point_sign_normal(mesh, p, max_dist)
    if query.result:
        closest = wp.mesh_eval_position(mesh, query.face, query.u, query.v)
        d = p - closest
        dist = wp.length(d)
        sdf[i] = query.sign * dist
        if dist > _ON_SURFACE:
            normal[i] = (query.sign / dist) * d
        else:
            normal[i] = wp.mesh_eval_face_normal(mesh, query.face)
    else:
        # Nothing within max_dist: far away, taken as outside; the normal stays zero (outputs start zeroed).
        sdf[i] = max_dist


_signed_distance = jax_kernel(_signed_distance_kernel, num_outputs=2)

signed_distance_kernel = _signed_distance_kernel
"""The Warp kernel behind :func:`signed_distance`, for layers: ``(mesh: wp.uint64, points: vec3 array,
max_dist: float) -> (sdf: float array, normal: vec3 array)``. Bind it with
``warpnn.bind(signed_distance_kernel, inputs=["points"], num_outputs=2)`` and give the layer
``static={"mesh": mesh, "max_dist": ...}``."""


def make_mesh(vertices, faces) -> wp.Mesh:
    """A ``wp.Mesh`` on the device JAX computes on (the CPU, or the first GPU), ready for these functions.

    The caller owns the mesh and must keep it alive as long as any function (or compiled function) uses it:
    hold it in the model, e.g. as an ``eqx.field(static=True)``.

    Args:
        vertices: (v, 3) float vertex positions (NumPy or concrete JAX array).
        faces: (f, 3) int vertex indices of each triangle, counter-clockwise seen from outside (so that
            the face normals, and the sign of the distance, point outwards). The mesh should be closed for
            the sign to mean inside / outside.

    Returns:
        The ``wp.Mesh``.
    """
    vertices = np.asarray(vertices, np.float32)
    faces = np.asarray(faces)
    if vertices.ndim != 2 or vertices.shape[1] != 3 or faces.ndim != 2 or faces.shape[1] != 3:
        raise ValueError(f"make_mesh: expected vertices (v, 3) and faces (f, 3), got {vertices.shape} and {faces.shape}.")
    if faces.size and (faces.min() < 0 or faces.max() >= len(vertices)):
        raise ValueError(f"make_mesh: face indices must lie in [0, {len(vertices)}), got [{faces.min()}, {faces.max()}].")
    device = jax_warp_device()
    return wp.Mesh(
        points=wp.array(vertices, dtype=wp.vec3, device=device),
        indices=wp.array(faces.astype(np.int32).reshape(-1), dtype=wp.int32, device=device),
    )


def _mesh_id(mesh, what: str) -> int:
    if not isinstance(mesh, wp.Mesh):
        raise TypeError(
            f"{what}: 'mesh' must be a wp.Mesh (build one with warpnn.kernels.mesh.make_mesh(vertices, faces) "
            f"and keep it alive in your model), got {type(mesh).__name__}."
        )
    return geometry_id(mesh, f"{what}, argument 'mesh'")


def _check_points(points, what: str) -> None:
    shape = tuple(np.shape(points))
    if len(shape) != 2 or shape[1] != 3:
        raise ValueError(f"{what}: 'points' must have shape (n, 3), got {shape}. To batch, use jax.vmap.")
    if np.dtype(points.dtype) != np.float32:
        raise TypeError(f"{what}: 'points' must be float32 (Warp meshes are float32), got {np.dtype(points.dtype).name}. "
                        "Fix: points.astype(jnp.float32).")


def signed_distance(mesh: wp.Mesh, points, *, max_dist: float = _DEFAULT_MAX_DIST) -> tuple[jax.Array, jax.Array]:
    """Signed distance from each point to a closed triangle mesh (one Warp thread per point, BVH query).

    Negative inside, positive outside; the sign comes from the angle-weighted pseudo-normal at the
    closest point, which is robust for closed, consistently oriented, non-self-intersecting meshes.

    Args:
        mesh: a ``wp.Mesh`` on JAX's device (see :func:`make_mesh`); a static value of the call.
        points: (n, 3) float32 query points.
        max_dist: static; a point with no triangle within ``max_dist`` gets ``sdf = max_dist`` and a zero
            normal (taken as far outside).

    Returns:
        ``(sdf, normal)``: (n,) float32 signed distance and (n, 3) float32 unit gradient of the signed
        distance (from the closest point outwards; the face normal for points on the surface). The closest
        point is ``points - sdf[:, None] * normal``. Differentiable with respect to ``points`` (reverse
        mode, through Warp's adjoint of the closest-point query): ``grad(sdf) == normal``.
    """
    what = "warpnn.kernels.mesh.signed_distance"
    mesh_id = _mesh_id(mesh, what)
    _check_points(points, what)
    return _signed_distance(mesh_id, points, float(max_dist))


def mesh_penalty(
    mesh: wp.Mesh, points, *, stiffness: float, margin: float = 0.0, max_dist: float = _DEFAULT_MAX_DIST
) -> tuple[jax.Array, jax.Array]:
    """Quadratic penetration penalty of particles against a mesh obstacle, and the forces it exerts.

    With ``depth = max(margin - sdf(p), 0)`` (how far a particle is inside the obstacle grown by
    ``margin``)::

        energy = 0.5 * stiffness * depth^2            (per particle)
        force  = stiffness * depth * normal(p)        (= -d energy / d p, pushing out along the normal)

    Use ``energy.sum()`` as a loss or potential (differentiable with respect to ``points``), or add ``force``
    to a cloth solver's particle forces (e.g. the ``f`` of ``warpnn.kernels.cloth.integrate_particles``);
    both are differentiable, so a rollout with collisions can be trained through.

    Args:
        mesh: a closed ``wp.Mesh`` on JAX's device (see :func:`make_mesh`).
        points: (n, 3) float32 particle positions.
        stiffness: static penalty stiffness (force per unit depth).
        margin: static contact thickness: particles closer than ``margin`` to the surface are pushed too.
        max_dist: static query range of :func:`signed_distance`.

    Returns:
        ``(energy, force)``: (n,) and (n, 3) float32.
    """
    sdf, normal = signed_distance(mesh, points, max_dist=max_dist)
    depth = jnp.maximum(margin - sdf, 0.0)
    return 0.5 * stiffness * depth**2, (stiffness * depth)[:, None] * normal


# --------------------------------------------------------------------------------------------------
# Pure-JAX references (brute force over all triangles: small meshes), for the tests.


def _safe_div(a, b):
    # Divides only where b != 0, so the branches jnp.where discards cannot put NaN into gradients.
    ok = b != 0
    return jnp.where(ok, a / jnp.where(ok, b, 1.0), 0.0)


def closest_point_on_triangle(p, a, b, c):
    """Closest point to ``p`` on triangle ``(a, b, c)`` (Ericson, *Real-Time Collision Detection* 5.1.5).

    All arguments broadcast, with a trailing axis of 3. Differentiable with respect to ``p``.
    """
    dot = lambda u, v: jnp.sum(u * v, axis=-1, keepdims=True)  # noqa: E731
    ab, ac, ap, bp, cp = b - a, c - a, p - a, p - b, p - c
    d1, d2, d3, d4, d5, d6 = dot(ab, ap), dot(ac, ap), dot(ab, bp), dot(ac, bp), dot(ab, cp), dot(ac, cp)
    va, vb, vc = d3 * d6 - d5 * d4, d5 * d2 - d1 * d6, d1 * d4 - d3 * d2
    denom = va + vb + vc
    result = a + ab * _safe_div(vb, denom) + ac * _safe_div(vc, denom)  # interior
    # Voronoi regions of the edges and vertices, the later the more specific (as in Ericson's order).
    regions = [
        (va <= 0) & (d4 - d3 >= 0) & (d5 - d6 >= 0), b + (c - b) * _safe_div(d4 - d3, (d4 - d3) + (d5 - d6)),
        (vb <= 0) & (d2 >= 0) & (d6 <= 0), a + ac * _safe_div(d2, d2 - d6),
        (d6 >= 0) & (d5 <= d6), c,
        (vc <= 0) & (d1 >= 0) & (d3 <= 0), a + ab * _safe_div(d1, d1 - d3),
        (d3 >= 0) & (d4 <= d3), b,
        (d1 <= 0) & (d2 <= 0), a,
    ]
    for i in range(0, len(regions), 2):
        result = jnp.where(regions[i], jnp.broadcast_to(regions[i + 1], result.shape), result)
    return result


def winding_number(points, vertices, faces):
    """Generalised winding number of a triangle mesh at each point: 1 inside a closed mesh, 0 outside.

    Solid angles by Van Oosterom and Strackee's formula. (n, 3), (v, 3), (f, 3) -> (n,).
    """
    tri = vertices[faces]  # (f, 3, 3)
    r = tri[None, :, :, :] - points[:, None, None, :]  # (n, f, 3 corners, 3)
    a, b, c = r[:, :, 0], r[:, :, 1], r[:, :, 2]
    la, lb, lc = (jnp.linalg.norm(v, axis=-1) for v in (a, b, c))
    det = jnp.sum(a * jnp.cross(b, c), axis=-1)
    den = la * lb * lc + jnp.sum(a * b, -1) * lc + jnp.sum(b * c, -1) * la + jnp.sum(c * a, -1) * lb
    return jnp.sum(2.0 * jnp.arctan2(det, den), axis=1) / (4.0 * jnp.pi)


def signed_distance_reference(points, vertices, faces) -> tuple[jax.Array, jax.Array]:
    """Brute-force :func:`signed_distance` (closest point over every triangle, sign from the winding number).

    Args:
        points: (n, 3) query points. vertices: (v, 3). faces: (f, 3) int, closed and outward-oriented.

    Returns:
        ``(sdf, closest)``: (n,) signed distance and (n, 3) closest surface point. Differentiable with
        respect to ``points`` by JAX.
    """
    vertices = jnp.asarray(vertices, points.dtype)
    faces = jnp.asarray(faces)
    tri = vertices[faces]
    cp = closest_point_on_triangle(points[:, None, :], tri[None, :, 0], tri[None, :, 1], tri[None, :, 2])  # (n, f, 3)
    d2 = jnp.sum((points[:, None, :] - cp) ** 2, axis=-1)
    k = jnp.argmin(d2, axis=1)
    closest = jnp.take_along_axis(cp, k[:, None, None], axis=1)[:, 0]
    dist = jnp.linalg.norm(points - closest, axis=-1)
    inside = jax.lax.stop_gradient(winding_number(points, vertices, faces)) > 0.5
    return jnp.where(inside, -dist, dist), closest


def mesh_penalty_reference(points, vertices, faces, *, stiffness: float, margin: float = 0.0):
    """Pure-JAX :func:`mesh_penalty`: ``(energy (n,), force (n, 3))``, the force as ``-grad(energy)``."""

    def energy(p):
        sdf, _ = signed_distance_reference(p, vertices, faces)
        return 0.5 * stiffness * jnp.maximum(margin - sdf, 0.0) ** 2

    e = energy(points)
    return e, -jax.grad(lambda p: jnp.sum(energy(p)))(points)
