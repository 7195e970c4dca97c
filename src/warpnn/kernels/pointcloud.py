"""Point-cloud kernels: nearest neighbours, Chamfer distance and radius-neighbour features.

**Spatial structures are rebuilt inside the JAX graph on every call**, from the arrays passed in, so every
function here is a pure function of its arrays: it works under ``jit``, ``vmap`` and ``lax.scan``, both
clouds may move during training, and there is no host object to keep alive. Why not a host-built
``wp.HashGrid`` / ``wp.Bvh``: those are built from concrete arrays outside tracing and their id is a
compile-time constant of the call, so they cannot follow points that change every step, and Chamfer needs
a structure over *both* clouds. Each structure costs one ``lax.sort`` plus a few cheap reductions.

* Nearest neighbours use a **Morton-ordered index**: points sorted along a Z-order curve (one sort), a
  dense grid over their bounding cube whose cells are contiguous runs of that order (about one cell per
  point), and a binary tree of bounding boxes over leaves of ``_LEAF_SIZE`` consecutive points (heap
  layout, built level by level with ``min`` / ``max``). The query kernel (one thread per query point)
  first searches up to ``_MAX_SHELLS`` rings of grid cells around the query, which settles near queries
  (the common case) after a few dozen points; a query with no certain candidate then runs
  branch-and-bound over the tree, seeded with its best candidate so far. Both stages are exact, so there
  is no search radius to choose and no brute-force fallback when clouds start far apart (shape fitting).
* Radius features use a **hash grid** with cells the size of the radius (cell coordinates wrapped per
  axis into a table, as in ``wp.HashGrid``): a Warp kernel computes each point's bucket, ``lax.sort``
  groups the points by bucket, a second kernel records each bucket's range, and the feature kernel reads
  the 27 cells around each query, which hold every neighbour within the radius.

**Gradients.** Nearest-neighbour indices are piecewise constant in the positions, so the index query is an
integer-only kernel on ``stop_gradient`` inputs, and squared distances are recomputed from the indices with
differentiable gathers: the exact gradient with respect to *both* clouds wherever the nearest neighbour is
unique (almost everywhere). Radius features are sums over neighbours inside the radius, accumulated by
the kernel and differentiated through Warp's adjoint.

Each function has a brute-force pure-JAX reference (``*_reference``) with the same semantics, used by the
tests and as the baseline the kernels are measured against.
"""

# No `from __future__ import annotations`: Warp evaluates kernel annotations, and the factory below
# annotates with local types (vec3 of float32 or float64) that string annotations could not resolve.

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

from .._bridge import jax_kernel

__all__ = [
    "chamfer",
    "chamfer_reference",
    "nearest_neighbors",
    "nearest_neighbors_reference",
    "radius_features",
    "radius_features_reference",
]

# Points per leaf of the nearest-neighbour tree: fewer means more box tests, more means more point tests.
_LEAF_SIZE = 16
# Morton codes quantise the bounding cube to 2^10 fine cells per axis (30-bit codes); grid cells are
# 2^(10 - bits) fine cells wide, with at most 2^_MAX_GRID_BITS per axis (a table of 2^21 cells).
_MORTON_BITS = 10
_MORTON_MAX = (1 << _MORTON_BITS) - 1
_MAX_GRID_BITS = 7
# Rings of grid cells searched around a query before it switches to the tree.
_MAX_SHELLS = 2
# The hash table has about 2 buckets per point (at least 2^6, at most 2^24), split over the three axes.
_MIN_TABLE_BITS = 6
_MAX_TABLE_BITS = 24
# Cell coordinates are clamped before the float -> int cast so far-away queries cannot overflow int32.
_MAX_CELL = 1.0e9


# --------------------------------------------------------------------------------------------------
# Warp side: the nearest-neighbour index. Every cell coordinate, of points and of queries, comes from
# _fine_cell, so the sort, the cell table and the queries agree bit for bit.


_STACK_SIZE = 32  # > depth of the tree (at most log2(n) levels), so the traversal stack never overflows
_stack_type = wp.types.vector(length=_STACK_SIZE, dtype=wp.int32)


@wp.func
def _fine_cell(p: wp.vec3, frame: wp.array(dtype=wp.float32)):
    # frame = (origin.x, origin.y, origin.z, fine cell size); unclamped, so queries may lie outside.
    c = (p - wp.vec3(frame[0], frame[1], frame[2])) / frame[3]
    return wp.vec3i(
        int(wp.floor(wp.clamp(c[0], -_MAX_CELL, _MAX_CELL))),
        int(wp.floor(wp.clamp(c[1], -_MAX_CELL, _MAX_CELL))),
        int(wp.floor(wp.clamp(c[2], -_MAX_CELL, _MAX_CELL))),
    )


@wp.func
def _point_cell(p: wp.vec3, frame: wp.array(dtype=wp.float32)):
    # Points lie in the frame's box; the clamp only absorbs rounding at its upper faces.
    return wp.min(wp.max(_fine_cell(p, frame), wp.vec3i(0)), wp.vec3i(_MORTON_MAX))


@wp.func
def _spread_bits(v: int):
    # Two zero bits between each of the low 10 bits: the Morton (Z-order) interleave.
    v = (v | (v << 16)) & 0x030000FF
    v = (v | (v << 8)) & 0x0300F00F
    v = (v | (v << 4)) & 0x030C30C3
    return (v | (v << 2)) & 0x09249249


@wp.kernel(enable_backward=False)
def _morton_kernel(points: wp.array(dtype=wp.vec3), frame: wp.array(dtype=wp.float32), code: wp.array(dtype=int)):
    i = wp.tid()
    c = _point_cell(points[i], frame)
    code[i] = _spread_bits(c[0]) | (_spread_bits(c[1]) << 1) | (_spread_bits(c[2]) << 2)


@wp.func
def _table_index(c: wp.vec3i, shift: int, bits: int):
    # Linear index of the coarse cell holding fine cell c; -1 outside the table.
    x = c[0] >> shift
    y = c[1] >> shift
    z = c[2] >> shift
    dim = 1 << bits
    if x < 0 or y < 0 or z < 0 or x >= dim or y >= dim or z >= dim:
        return -1
    return x + (y << bits) + (z << (2 * bits))


@wp.kernel(enable_backward=False)
def _cell_range_kernel(
    points: wp.array(dtype=wp.vec3),
    frame: wp.array(dtype=wp.float32),
    shift: int,
    bits: int,
    cell_start: wp.array(dtype=int),
    cell_end: wp.array(dtype=int),
):
    # Points are in Morton order, so each coarse cell (a Morton prefix) is one contiguous run. Outputs
    # start zeroed, so empty cells read as the empty range [0, 0).
    t = wp.tid()
    n = points.shape[0]
    cell = _table_index(_point_cell(points[t], frame), shift, bits)
    if t == 0:
        cell_start[cell] = t
    elif _table_index(_point_cell(points[t - 1], frame), shift, bits) != cell:
        cell_start[cell] = t
    if t == n - 1:
        cell_end[cell] = t + 1
    elif _table_index(_point_cell(points[t + 1], frame), shift, bits) != cell:
        cell_end[cell] = t + 1


@wp.func
def _box_sq_distance(q: wp.vec3, lo: wp.vec3, hi: wp.vec3):
    # Squared distance from q to the box [lo, hi]; +inf for an empty box (lo = +inf, hi = -inf).
    dx = wp.max(wp.max(lo[0] - q[0], q[0] - hi[0]), 0.0)
    dy = wp.max(wp.max(lo[1] - q[1], q[1] - hi[1]), 0.0)
    dz = wp.max(wp.max(lo[2] - q[2], q[2] - hi[2]), 0.0)
    return dx * dx + dy * dy + dz * dz


@wp.kernel(enable_backward=False)
def _nearest_kernel(
    queries: wp.array(dtype=wp.vec3),
    points: wp.array(dtype=wp.vec3),
    frame: wp.array(dtype=wp.float32),
    cell_start: wp.array(dtype=int),
    cell_end: wp.array(dtype=int),
    node_lo: wp.array(dtype=wp.vec3),
    node_hi: wp.array(dtype=wp.vec3),
    shift: int,
    bits: int,
    max_shells: int,
    leaf_size: int,
    nearest: wp.array(dtype=int),
):
    i = wp.tid()
    q = queries[i]
    n = points.shape[0]
    c = _fine_cell(q, frame)
    unit = 1 << shift  # fine cells per grid cell
    cell_size = frame[3] * float(unit)
    best = float(3.0e38)
    best_t = int(-1)

    # 1. Rings of grid cells at Chebyshev distance s = 0, 1, ... around the query's cell. After ring s every
    #    point within s * cell_size has been seen (less two fine cells of slack: one for the clamp of points
    #    into the cube, one for float rounding), so a candidate that close is exact. Near queries, the
    #    common case, stop here after a few dozen points.
    confirmed = bool(False)
    s = int(0)
    while s <= max_shells and not confirmed:
        for dz in range(-s, s + 1):
            for dy in range(-s, s + 1):
                # Only the ring's surface: full rows on its outer z / y faces, two end cells elsewhere.
                step = 2 * s
                if s == 0 or dz == -s or dz == s or dy == -s or dy == s:
                    step = 1
                for dx in range(-s, s + 1, step):
                    cell = _table_index(c + wp.vec3i(dx, dy, dz) * unit, shift, bits)
                    if cell >= 0:
                        for t in range(cell_start[cell], cell_end[cell]):
                            d2 = wp.length_sq(points[t] - q)
                            if d2 < best:
                                best = d2
                                best_t = t
        reach = float(s) * cell_size - 2.0 * frame[3]
        if reach > 0.0 and best <= reach * reach:
            confirmed = True
        s += 1

    # 2. Otherwise (a far query: an outlier, or clouds far apart) branch and bound over the box tree,
    #    starting from the best candidate so far: nearer child first, the farther one on the stack, boxes
    #    that cannot beat the best dropped. Exact at any distance.
    first_leaf = (node_lo.shape[0] - 1) // 2  # heap layout: children of k are 2k+1, 2k+2; leaves last
    stack = _stack_type()
    sp = int(0)
    node = int(-1)
    if not confirmed:
        node = 0
    while node >= 0:
        if node >= first_leaf:
            start = (node - first_leaf) * leaf_size
            for t in range(start, wp.min(start + leaf_size, n)):
                d2 = wp.length_sq(points[t] - q)
                if d2 < best:
                    best = d2
                    best_t = t
            node = -1
        else:
            left = 2 * node + 1
            d_left = _box_sq_distance(q, node_lo[left], node_hi[left])
            d_right = _box_sq_distance(q, node_lo[left + 1], node_hi[left + 1])
            near = left
            far = left + 1
            d_near = d_left
            d_far = d_right
            if d_right < d_left:
                near = left + 1
                far = left
                d_near = d_right
                d_far = d_left
            node = -1
            if d_near < best:
                node = near
                if d_far < best:
                    stack[sp] = far
                    sp += 1
        while node < 0 and sp > 0:
            sp -= 1
            candidate = stack[sp]
            if _box_sq_distance(q, node_lo[candidate], node_hi[candidate]) < best:
                node = candidate
    nearest[i] = best_t


# --------------------------------------------------------------------------------------------------
# Warp side: hash grid for radius queries. Build and query share _cell_of / _bucket_of, so they agree
# bit for bit on which bucket a position falls in.


@wp.func
def _cell_of(p: wp.vec3, grid: wp.array(dtype=wp.float32)):
    # grid = (origin.x, origin.y, origin.z, cell_size)
    c = (p - wp.vec3(grid[0], grid[1], grid[2])) / grid[3]
    return wp.vec3i(
        int(wp.floor(wp.clamp(c[0], -_MAX_CELL, _MAX_CELL))),
        int(wp.floor(wp.clamp(c[1], -_MAX_CELL, _MAX_CELL))),
        int(wp.floor(wp.clamp(c[2], -_MAX_CELL, _MAX_CELL))),
    )


@wp.func
def _bucket_of(c: wp.vec3i, bits_x: int, bits_y: int, bits_z: int):
    # Wrapping each axis with a mask works for negative coordinates too (two's complement).
    bx = c[0] & ((1 << bits_x) - 1)
    by = c[1] & ((1 << bits_y) - 1)
    bz = c[2] & ((1 << bits_z) - 1)
    return bx | (by << bits_x) | (bz << (bits_x + bits_y))


@wp.kernel(enable_backward=False)
def _bucket_kernel(
    points: wp.array(dtype=wp.vec3),
    grid: wp.array(dtype=wp.float32),
    bits_x: int,
    bits_y: int,
    bits_z: int,
    bucket: wp.array(dtype=int),
):
    i = wp.tid()
    bucket[i] = _bucket_of(_cell_of(points[i], grid), bits_x, bits_y, bits_z)


@wp.kernel(enable_backward=False)
def _bucket_range_kernel(
    sorted_bucket: wp.array(dtype=int),
    bucket_start: wp.array(dtype=int),
    bucket_end: wp.array(dtype=int),
):
    # Outputs start zeroed, so empty buckets read as the empty range [0, 0).
    t = wp.tid()
    b = sorted_bucket[t]
    if t == 0:
        bucket_start[b] = t
    elif sorted_bucket[t - 1] != b:
        bucket_start[b] = t
    if t == sorted_bucket.shape[0] - 1:
        bucket_end[b] = t + 1
    elif sorted_bucket[t + 1] != b:
        bucket_end[b] = t + 1


@functools.cache
def _features_kernel(scalar):
    vec3 = wp.types.vector(3, scalar)

    # One kernel per float type (module="unique": separately built and cached), so the tests can check
    # gradients in float64. Bucketing always uses the float32 positions, as the grid was built from them.
    @wp.kernel(module="unique")
    def radius_features_kernel(
        queries: wp.array(dtype=vec3),
        points: wp.array(dtype=vec3),
        queries32: wp.array(dtype=wp.vec3),
        bucket_start: wp.array(dtype=int),
        bucket_end: wp.array(dtype=int),
        grid: wp.array(dtype=wp.float32),
        bits_x: int,
        bits_y: int,
        bits_z: int,
        radius: scalar,
        count: wp.array(dtype=int),
        offset_sum: wp.array(dtype=vec3),
        density: wp.array(dtype=scalar),
    ):
        i = wp.tid()
        q = queries[i]
        c = _cell_of(queries32[i], grid)
        r2 = radius * radius
        n = int(0)
        acc = vec3()
        rho = scalar(0.0)
        # The cell size is the radius, so the 27 cells around the query hold every neighbour; the table
        # has at least 4 buckets per axis, so the 27 cells are 27 distinct buckets (nothing counted twice).
        for dz in range(-1, 2):
            for dy in range(-1, 2):
                for dx in range(-1, 2):
                    b = _bucket_of(c + wp.vec3i(dx, dy, dz), bits_x, bits_y, bits_z)
                    for t in range(bucket_start[b], bucket_end[b]):
                        d = points[t] - q
                        d2 = wp.dot(d, d)
                        if d2 < r2:
                            w = scalar(1.0) - d2 / r2
                            n += 1
                            acc += d
                            rho += w * w * w
        count[i] = n
        offset_sum[i] = acc
        density[i] = rho

    return jax_kernel(radius_features_kernel, num_outputs=3)


_morton = jax_kernel(_morton_kernel)
_cell_range = jax_kernel(_cell_range_kernel, num_outputs=2)
_nearest = jax_kernel(_nearest_kernel)
_bucket = jax_kernel(_bucket_kernel)
_bucket_range = jax_kernel(_bucket_range_kernel, num_outputs=2)


# --------------------------------------------------------------------------------------------------
# JAX side: building the structures in the graph.


class _Index:
    """Nearest-neighbour index over ``points`` (see the module docstring), built in the graph.

    ``points`` (Morton-sorted, caller's dtype) stays differentiable; everything else is stop_gradient'ed.
    """

    def __init__(self, points):
        n = points.shape[0]
        p32 = jax.lax.stop_gradient(points).astype(jnp.float32)
        lo = jnp.min(p32, axis=0)
        extent = jnp.max(jnp.max(p32, axis=0) - lo)
        # Cubic fine cells: the longest side of the bounding box spans 2^10 of them.
        fine = jnp.where(extent > 0, extent / (1 << _MORTON_BITS), 1.0)
        self.frame = jnp.concatenate([lo, fine[None]])
        (code,) = _morton(p32, self.frame)
        _, self.order = jax.lax.sort((code, jnp.arange(n, dtype=jnp.int32)), num_keys=1)
        self.points = points[self.order]
        self.points32 = p32[self.order]

        # Grid: 2^bits coarse cells per axis, about one per point if the cloud filled its bounding cube.
        self.bits = min(max(round(math.log2(n) / 3), 1), _MAX_GRID_BITS)
        self.shift = _MORTON_BITS - self.bits
        self.cell_start, self.cell_end = _cell_range(
            self.points32, self.frame, self.shift, self.bits, launch_dims=n, output_dims=1 << (3 * self.bits)
        )

        # Tree: leaves of _LEAF_SIZE consecutive points, padded to a power of two with empty boxes
        # (lo = +inf, hi = -inf) that every query prunes, then parents of consecutive pairs up to the root.
        num_leaves = 1 << max(math.ceil(math.log2(-(-n // _LEAF_SIZE))), 0)
        pad = num_leaves * _LEAF_SIZE - n
        blocks = jnp.concatenate([self.points32, jnp.zeros((pad, 3), jnp.float32)]).reshape(num_leaves, _LEAF_SIZE, 3)
        valid = (jnp.arange(num_leaves * _LEAF_SIZE) < n).reshape(num_leaves, _LEAF_SIZE, 1)
        level_lo = jnp.min(jnp.where(valid, blocks, jnp.inf), axis=1)
        level_hi = jnp.max(jnp.where(valid, blocks, -jnp.inf), axis=1)
        los, his = [level_lo], [level_hi]
        while level_lo.shape[0] > 1:
            level_lo = jnp.min(level_lo.reshape(-1, 2, 3), axis=1)
            level_hi = jnp.max(level_hi.reshape(-1, 2, 3), axis=1)
            los.append(level_lo)
            his.append(level_hi)
        # Heap layout, root first: node k's children are 2k + 1 and 2k + 2, the leaves come last.
        self.node_lo = jnp.concatenate(los[::-1])
        self.node_hi = jnp.concatenate(his[::-1])

    def nearest(self, queries32, max_shells: int = _MAX_SHELLS):
        """Index into the sorted ``self.points`` of each query's nearest point. No gradient."""
        (t,) = _nearest(
            queries32, self.points32, self.frame, self.cell_start, self.cell_end, self.node_lo, self.node_hi,
            self.shift, self.bits, max_shells, _LEAF_SIZE,
        )
        return t


def _table_bits(n: int) -> tuple[int, int, int]:
    """Bits per axis of the bucket table for ``n`` points: about 2 buckets per point, >= 4 per axis."""
    total = min(max(math.ceil(math.log2(max(n, 1))) + 1, _MIN_TABLE_BITS), _MAX_TABLE_BITS)
    bx = -(-total // 3)
    by = -(-(total - bx) // 2)
    return bx, by, total - bx - by


class _Grid:
    """Hash grid over ``points`` with cubic cells of edge ``cell_size``, built in the graph."""

    def __init__(self, points, cell_size: float):
        n = points.shape[0]
        self.bits = _table_bits(n)
        p32 = jax.lax.stop_gradient(points).astype(jnp.float32)
        self.params = jnp.concatenate([jnp.min(p32, axis=0), jnp.full((1,), cell_size, jnp.float32)])
        (bucket,) = _bucket(p32, self.params, *self.bits)
        sorted_bucket, order = jax.lax.sort((bucket, jnp.arange(n, dtype=jnp.int32)), num_keys=1)
        self.start, self.end = _bucket_range(sorted_bucket, output_dims=1 << sum(self.bits))
        self.points = points[order]


def _check_cloud(name: str, a, what: str) -> None:
    shape = tuple(np.shape(a))
    if len(shape) != 2 or shape[1] != 3 or shape[0] < 1:
        raise ValueError(
            f"{what}: '{name}' must be a point cloud of shape (n, 3) with n >= 1, got shape {shape}. "
            "To batch clouds, use jax.vmap instead of adding leading dims."
        )
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"{what}: '{name}' must be float32 or float64, got {np.dtype(a.dtype).name}. "
                        f"Fix: pass {name}.astype(jnp.float32).")


def _check_same_dtype(names: tuple[str, str], a, b, what: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{what}: '{names[0]}' and '{names[1]}' must have the same dtype, got {a.dtype} and "
                        f"{b.dtype}. Fix: {names[1]}.astype({names[0]}.dtype).")


# --------------------------------------------------------------------------------------------------
# Public functions.


def nearest_neighbors(queries, points):
    """Nearest point of ``points`` to each query point (tree search, one Warp thread per query).

    Exact at any distance (branch and bound over a bounding-volume hierarchy built in the graph); ties
    between equidistant points are broken arbitrarily.

    Args:
        queries: (m, 3) float32 or float64 query positions.
        points: (n, 3) positions to search, same dtype, n >= 1.

    Returns:
        ``(indices, sq_distances)``: (m,) int32 index into ``points`` of each query's nearest point, and the
        (m,) squared distance to it, differentiable with respect to both ``queries`` and ``points`` (exact
        wherever the nearest neighbour is unique). Neighbours are found in float32; distances are
        computed in the dtype of the inputs.
    """
    what = "warpnn.kernels.pointcloud.nearest_neighbors"
    _check_cloud("queries", queries, what)
    _check_cloud("points", points, what)
    _check_same_dtype(("queries", "points"), queries, points, what)
    tree = _Index(points)
    t = tree.nearest(jax.lax.stop_gradient(queries).astype(jnp.float32))
    return tree.order[t], jnp.sum((queries - tree.points[t]) ** 2, axis=-1)


def chamfer(x, y) -> jax.Array:
    """Symmetric Chamfer distance between two point clouds (squared distances, averaged per cloud)::

        chamfer(x, y) = mean_i min_j |x_i - y_j|^2 + mean_j min_i |y_j - x_i|^2

    Builds a tree over each cloud (in the graph, so both may move) and queries each cloud against the
    other's tree in Morton order, which keeps neighbouring threads on neighbouring boxes. Differentiable
    with respect to ``x`` and ``y``: nearest-neighbour indices carry no gradient and the squared distances
    are recomputed from them with gathers, which is exact wherever nearest neighbours are unique.

    Args:
        x: (n, 3) float32 or float64 points.
        y: (m, 3) points, same dtype as ``x``.

    Returns:
        A scalar of the dtype of ``x``.
    """
    what = "warpnn.kernels.pointcloud.chamfer"
    _check_cloud("x", x, what)
    _check_cloud("y", y, what)
    _check_same_dtype(("x", "y"), x, y, what)
    tx, ty = _Index(x), _Index(y)
    # The means do not depend on the order, so each side queries in its own (Morton) order.
    d_xy = jnp.sum((tx.points - ty.points[ty.nearest(tx.points32)]) ** 2, axis=-1)
    d_yx = jnp.sum((ty.points - tx.points[tx.nearest(ty.points32)]) ** 2, axis=-1)
    return jnp.mean(d_xy) + jnp.mean(d_yx)


def radius_features(queries, points, radius: float):
    """Features of the neighbours of each query within ``radius`` (hash grid, one Warp thread per query).

    For query ``q_i`` and its neighbours ``N_i = {j : |p_j - q_i| < radius}``::

        count[i]       = |N_i|
        mean_offset[i] = mean_{j in N_i} (p_j - q_i)          (0 if N_i is empty)
        density[i]     = sum_{j in N_i} (1 - |p_j - q_i|^2 / radius^2)^3

    ``density`` uses a compact polynomial kernel that goes to zero smoothly at the radius, so its gradient
    is continuous as points cross it (a truncated Gaussian would jump). When ``queries`` and ``points``
    are the same cloud, each point is its own neighbour (offset 0, weight 1).

    Differentiable with respect to ``queries`` and ``points`` (``mean_offset`` and ``density``; ``count`` is
    an integer). The grid cells are ``radius`` wide and cell coordinates are float32, so ``radius`` should
    exceed about 1e-6 of the cloud's extent.

    Args:
        queries: (m, 3) float32 or float64 query positions.
        points: (n, 3) neighbour positions, same dtype.
        radius: static positive Python float.

    Returns:
        ``(count, mean_offset, density)``: (m,) int32, (m, 3) and (m,) in the dtype of ``queries``.
    """
    what = "warpnn.kernels.pointcloud.radius_features"
    _check_cloud("queries", queries, what)
    _check_cloud("points", points, what)
    _check_same_dtype(("queries", "points"), queries, points, what)
    if isinstance(radius, bool) or not (isinstance(radius, (int, float)) and radius > 0):
        raise ValueError(f"{what}: 'radius' must be a positive Python float (static), got {radius!r}. "
                         "To learn a radius, scale the positions instead: radius_features(q / s, p / s, 1.0).")
    dtype = np.dtype(queries.dtype)
    grid = _Grid(points, float(radius))
    kernel = _features_kernel(wp.float64 if dtype == np.float64 else wp.float32)
    count, offset_sum, density = kernel(
        queries, grid.points, jax.lax.stop_gradient(queries).astype(jnp.float32),
        grid.start, grid.end, grid.params, *grid.bits, float(radius),
    )
    mean_offset = offset_sum / jnp.maximum(count, 1)[:, None].astype(dtype)
    return count, mean_offset, density


# --------------------------------------------------------------------------------------------------
# Pure-JAX references (brute force): the same semantics, for the tests and the benchmarks.


def nearest_neighbors_reference(queries, points, *, batch_size: int = 256):
    """Brute-force :func:`nearest_neighbors`: (m,) int32 indices and (m,) squared distances.

    Memory is ``batch_size * n``: queries go through ``lax.map`` in batches, and each batch is recomputed
    in the backward pass (``jax.checkpoint``) rather than storing its row of the distance matrix.
    """

    @jax.checkpoint
    def one(q):
        d2 = jnp.sum((points - q) ** 2, axis=-1)
        return jnp.argmin(d2).astype(jnp.int32), jnp.min(d2)

    return jax.lax.map(one, queries, batch_size=min(batch_size, queries.shape[0]))


def chamfer_reference(x, y, *, batch_size: int = 256) -> jax.Array:
    """Brute-force :func:`chamfer` (same definition), differentiated by JAX through ``min``.

    Memory is ``batch_size * max(n, m)`` in the forward and backward passes, so it runs at 100k points per
    cloud; time is O(n * m).
    """
    _, d_xy = nearest_neighbors_reference(x, y, batch_size=batch_size)
    _, d_yx = nearest_neighbors_reference(y, x, batch_size=batch_size)
    return jnp.mean(d_xy) + jnp.mean(d_yx)


def radius_features_reference(queries, points, radius: float):
    """Dense pure-JAX :func:`radius_features` (an (m, n) pairwise matrix: small clouds only)."""
    d = points[None, :, :] - queries[:, None, :]
    d2 = jnp.sum(d * d, axis=-1)
    inside = d2 < radius * radius
    count = jnp.sum(inside, axis=1).astype(jnp.int32)
    offset_sum = jnp.sum(jnp.where(inside[..., None], d, 0.0), axis=1)
    mean_offset = offset_sum / jnp.maximum(count, 1)[:, None].astype(queries.dtype)
    w = jnp.where(inside, 1.0 - d2 / (radius * radius), 0.0)
    return count, mean_offset, jnp.sum(w**3, axis=1)
