"""A spatial tendon's wrap around a sphere or a cylinder, in JAX: mujoco_warp's ``util_misc.wrap`` (with
``wrap_circle``, ``wrap_inside``, ``length_circle``, ``is_intersect``) transcribed branch for branch, over any
leading axes, for the rule that replaces ``smooth._spatial_geom_tendon`` (its Jacobian walks bodies in a while
loop, and ``wrap_inside``'s Newton iteration is a while loop: Warp's adjoint runs neither again).

Every branch is computed and one is selected (``jnp.where``), with safe arguments in the branches not taken so
that their derivatives are not NaN. ``wrap_inside``'s Newton iteration runs its 20 iterations as a fixed-length
loop with each world's exit conditions as masks, on values only; its derivative is the solution's (the implicit
function theorem at the root the iteration found), not the iteration's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from mujoco_warp._src.types import MJ_MAXVAL, MJ_MINVAL

from .mujoco import _mj_safe_div as _safe_div, _safe_norm


def _dot(a, b):
    return jnp.sum(a * b, axis=-1)


def _cross2(a, b):
    return a[..., 0] * b[..., 1] - a[..., 1] * b[..., 0]


def _norm(v):
    """``|v|`` over the last axis, with a zero (not NaN) derivative at ``v = 0``."""
    return _safe_norm(v)[..., 0]


def _normalize_with_norm(v):
    """``math.normalize_with_norm``: ``(v / |v|, |v|)``, and ``(v, 0)`` where ``|v|`` is 0."""
    norm = _norm(v)
    return jnp.where((norm == 0.0)[..., None], v, v / jnp.where(norm == 0.0, 1.0, norm)[..., None]), norm


def _arctan2(y, x):
    """``atan2(y, x)``, 0 at ``(0, 0)`` as Warp's, with a zero (not NaN) derivative there: a point at the origin
    comes from a branch the caller does not take."""
    ok = x * x + y * y > 0.0
    return jnp.where(ok, jnp.arctan2(jnp.where(ok, y, 0.0), jnp.where(ok, x, 1.0)), 0.0)


def _winding_angle(p, q):
    """The signed angle swept from ``p`` to ``q`` around the origin (2D)."""
    return _arctan2(_cross2(p, q), _dot(p, q))


def _is_intersect(p1, p2, p3, p4):
    """Whether segments ``p1 p2`` and ``p3 p4`` intersect (2D): a choice, not differentiated."""
    p1, p2, p3, p4 = (jax.lax.stop_gradient(p) for p in (p1, p2, p3, p4))
    u, v = p2 - p1, p4 - p3
    det = v[..., 1] * u[..., 0] - v[..., 0] * u[..., 1]
    s = jnp.where(det > 0.0, 1.0, -1.0)
    w, d = p1 - p3, p2 - p4
    a0, a1 = (v[..., 0] * w[..., 1] - v[..., 1] * w[..., 0]) * s, (v[..., 0] * d[..., 1] - v[..., 1] * d[..., 0]) * s
    b0, b1 = (u[..., 0] * w[..., 1] - u[..., 1] * w[..., 0]) * s, (u[..., 0] * d[..., 1] - u[..., 1] * d[..., 0]) * s
    return (jnp.abs(det) >= MJ_MINVAL) & (a0 >= 0.0) & (a1 < 0.0) & (b0 >= 0.0) & (b1 < 0.0)


def _length_circle(p0, p1, counterclockwise, radius):
    """``length_circle``: the arc from ``p0`` to ``p1`` on the circle, the long way where the orientation asks."""
    cross = p0[..., 1] * p1[..., 0] - p0[..., 0] * p1[..., 1]
    angle = _arctan2(jnp.abs(cross), _dot(p0, p1))
    flip = (angle > 1.0e-6) & (((cross > 0.0) & counterclockwise) | ((cross < 0.0) & ~counterclockwise))
    return radius * jnp.where(flip, 2.0 * jnp.pi - angle, angle)


def _wrap_circle(end0, end1, side, has_side, radius):
    """``wrap_circle``: the arc's length (-1 where the tendon does not wrap) and its two tangent points (2D)."""
    sqlen0, sqlen1, sqrad = _dot(end0, end0), _dot(end1, end1), radius * radius
    dif = end1 - end0
    dd = _dot(dif, dif)
    nowrap = (sqlen0 < sqrad) | (sqlen1 < sqrad) | (radius < MJ_MINVAL) | (dd < MJ_MINVAL)
    a = jnp.clip(-_dot(dif, end0) / jnp.where(dd < MJ_MINVAL, 1.0, dd), 0.0, 1.0)
    nearest = a[..., None] * dif + end0
    clear = _dot(nearest, nearest) > sqrad
    side = jnp.where(has_side[..., None], side, jnp.ones_like(side))  # (a harmless point where there is none)
    wside = _winding_angle(end0, side) + _winding_angle(side, end1)
    nowrap |= jnp.where(has_side, clear & (jnp.abs(wside - _winding_angle(end0, end1)) < jnp.pi), clear)

    sqrt0 = jnp.sqrt(jnp.where(sqlen0 > sqrad, sqlen0 - sqrad, 1.0))
    sqrt1 = jnp.sqrt(jnp.where(sqlen1 > sqrad, sqlen1 - sqrad, 1.0))
    x0, y0, x1, y1 = end0[..., 0], end0[..., 1], end1[..., 0], end1[..., 1]
    point = lambda x, y, sqlen: jnp.stack([_safe_div(x, sqlen), _safe_div(y, sqlen)], -1)  # noqa: E731
    sol00 = point(x0 * sqrad + radius * y0 * sqrt0, y0 * sqrad - radius * x0 * sqrt0, sqlen0)
    sol01 = point(x1 * sqrad - radius * y1 * sqrt1, y1 * sqrad + radius * x1 * sqrt1, sqlen1)
    sol10 = point(x0 * sqrad - radius * y0 * sqrt0, y0 * sqrad + radius * x0 * sqrt0, sqlen0)
    sol11 = point(x1 * sqrad + radius * y1 * sqrt1, y1 * sqrad - radius * x1 * sqrt1, sqlen1)
    intersect0, intersect1 = _is_intersect(end0, sol00, end1, sol01), _is_intersect(end0, sol10, end1, sol11)
    good0 = jnp.where(intersect0, -10000.0, -_dot(sol00 - sol01, sol00 - sol01))
    good1 = jnp.where(intersect1, -10000.0, -_dot(sol10 - sol11, sol10 - sol11))
    counterclockwise = jnp.where(has_side, wside > 0.0, ~(good0 > good1))  # (the kernel's ind == 1)
    pnt0 = jnp.where(counterclockwise[..., None], sol10, sol00)
    pnt1 = jnp.where(counterclockwise[..., None], sol11, sol01)
    nowrap |= jnp.where(counterclockwise, intersect1, intersect0)
    length = jnp.where(has_side,
                       radius * jnp.abs(wside - _winding_angle(end0, pnt0) - _winding_angle(pnt1, end1)),
                       _length_circle(pnt0, pnt1, counterclockwise, radius))
    return jnp.where(nowrap, -1.0, length), pnt0, pnt1


def _wrap_inside(end0, end1, radius):
    """``wrap_inside`` (a side site inside the geom): 0 where the tendon wraps (-1 where not) and the one point
    where it touches the circle, from Newton's method on ``asin(A z) + asin(B z) - 2 asin(z) + G = 0``."""
    maxiter, tolerance = 20, 1.0e-6
    len0, len1 = _norm(end0), _norm(end1)
    dif = end1 - end0
    dd = _dot(dif, dif)
    nowrap = (len0 <= radius) | (len1 <= radius) | (radius < MJ_MINVAL) | (len0 < MJ_MINVAL) | (len1 < MJ_MINVAL)
    a = -_dot(dif, end0) / jnp.where(dd > MJ_MINVAL, dd, 1.0)
    crossing = (dd > MJ_MINVAL) & (a > 0.0) & (a < 1.0) & (_norm(end0 + a[..., None] * dif) <= radius)
    nowrap |= crossing
    default = _normalize_with_norm(0.5 * (end0 + end1))[0] * radius[..., None]  # (where the iteration fails)

    A, B = _safe_div(radius, len0), _safe_div(radius, len1)
    cosG = _safe_div(len0 * len0 + len1 * len1 - dd, 2.0 * len0 * len1)
    nowrap |= cosG < -1.0 + MJ_MINVAL
    failed = cosG > 1.0 - MJ_MINVAL
    G = jnp.arccos(jnp.where(jnp.abs(cosG) < 1.0, cosG, 0.0))  # (at +-1 it is not used: no infinite derivative)
    A, B = jnp.where(nowrap, 0.5, A), jnp.where(nowrap, 0.5, B)  # (harmless where the result is not used)

    # Newton's iteration on the values (no derivative through it), then the solution's derivative: at the root
    # of f(phi; A, B, G), dphi = -df/d(A, B, G) / df/dphi (one Newton step's, whose value change is taken back out)
    A_, B_, G_ = (jax.lax.stop_gradient(x) for x in (A, B, G))

    def residual(phi, A, B, G):
        return jnp.arcsin(A * jnp.sin(phi)) + jnp.arcsin(B * jnp.sin(phi)) - 2.0 * phi + G

    def slope(phi, A, B):
        sq_z = jnp.square(jnp.sin(phi))
        return jnp.cos(phi) * (A / jnp.maximum(MJ_MINVAL, jnp.sqrt(jnp.maximum(0.0, 1.0 - sq_z * A * A)))
                               + B / jnp.maximum(MJ_MINVAL, jnp.sqrt(jnp.maximum(0.0, 1.0 - sq_z * B * B)))) - 2.0

    phi = jnp.full_like(A, 0.5 * jnp.pi)
    f = jnp.arcsin(A_) + jnp.arcsin(B_) - jnp.pi + G_
    failed |= f > 0.0
    done = nowrap | failed

    def iteration(_, carry):
        phi, f, done, failed, count = carry
        active = ~done & (jnp.abs(f) > tolerance)
        df = slope(phi, A_, B_)
        uphill = active & (df > -MJ_MINVAL)
        phi1 = phi - _safe_div(f, jnp.where(uphill, -1.0, df))
        right = active & ~uphill & (phi1 > phi)
        update = active & ~uphill & ~right
        phi = jnp.where(update, phi1, phi)
        f = jnp.where(update, residual(phi, A_, B_, G_), f)
        positive = update & (f > tolerance)
        failed |= uphill | right | positive
        done |= uphill | right | positive | (active & ~update)
        return phi, f, done, failed, count + update.astype(jnp.int32)

    phi, f, done, failed, count = jax.lax.fori_loop(
        0, maxiter, iteration, (phi, f, done, failed, jnp.zeros(A.shape, jnp.int32)))
    failed |= count >= maxiter
    step = residual(phi, A, B, G)
    phi = phi - (step - jax.lax.stop_gradient(step)) / jnp.where(failed | nowrap, -1.0, slope(phi, A_, B_))
    asin_Az, asin_Bz = jnp.arcsin(A * jnp.sin(phi)), jnp.arcsin(B * jnp.sin(phi))

    from_end0 = (end0[..., 0] * end1[..., 1] - end0[..., 1] * end1[..., 0]) > 0.0
    vec = _normalize_with_norm(jnp.where(from_end0[..., None], end0, end1))[0]
    angle = phi - jnp.where(from_end0, asin_Az, asin_Bz)
    c, s = jnp.cos(angle), jnp.sin(angle)
    touch = radius[..., None] * jnp.stack([c * vec[..., 0] - s * vec[..., 1], s * vec[..., 0] + c * vec[..., 1]], -1)
    touch = jnp.where(failed[..., None], default, touch)
    return jnp.where(nowrap, -1.0, 0.0), touch, touch


def wrap(x0, x1, pos, mat, radius, cylinder, side, has_side):
    """``util_misc.wrap``: a tendon from ``x0`` to ``x1`` around a sphere (or, where ``cylinder``, a cylinder) at
    ``pos`` with orientation ``mat`` (``(..., 3, 3)``) and ``radius``, with a side site at ``side`` where
    ``has_side``. Returns the wrapped length (-1 where the tendon does not wrap) and the two points where the
    tendon meets the geom (``MJ_MAXVAL`` where it does not wrap)."""
    matT = jnp.swapaxes(mat, -1, -2)
    p0 = jnp.einsum("...ij,...j->...i", matT, x0 - pos)
    p1 = jnp.einsum("...ij,...j->...i", matT, x1 - pos)
    nowrap = (_norm(p0) < MJ_MINVAL) | (_norm(p1) < MJ_MINVAL)

    # the 2D frame: a sphere's in the plane of the origin and both ends (another plane where they are parallel)
    sphere_axis0 = _normalize_with_norm(p0)[0]
    normal, normal_norm = _normalize_with_norm(jnp.cross(p0, p1))
    magnitude = jnp.abs(sphere_axis0)
    largest = jnp.where((magnitude[..., 1] > magnitude[..., 0]) & (magnitude[..., 1] > magnitude[..., 2]), 1,
                        jnp.where((magnitude[..., 2] > magnitude[..., 0]) & (magnitude[..., 2] > magnitude[..., 1]),
                                  2, 0))
    other = 1.0 - jax.nn.one_hot(largest, 3, dtype=p0.dtype)
    normal = jnp.where((normal_norm < MJ_MINVAL)[..., None],
                       _normalize_with_norm(jnp.cross(sphere_axis0, other))[0], normal)
    sphere_axis1 = _normalize_with_norm(jnp.cross(normal, sphere_axis0))[0]
    cylinder_ = cylinder[..., None]
    axis0 = jnp.where(cylinder_, jnp.asarray([1.0, 0.0, 0.0], p0.dtype), sphere_axis0)
    axis1 = jnp.where(cylinder_, jnp.asarray([0.0, 1.0, 0.0], p0.dtype), sphere_axis1)
    end0 = jnp.stack([_dot(p0, axis0), _dot(p0, axis1)], -1)
    end1 = jnp.stack([_dot(p1, axis0), _dot(p1, axis1)], -1)

    side_local = jnp.einsum("...ij,...j->...i", matT, jnp.where(has_side[..., None], side, pos + 1.0) - pos)
    side_2d, side_norm = _normalize_with_norm(jnp.stack([_dot(side_local, axis0), _dot(side_local, axis1)], -1))
    side_2d = jnp.where((side_norm < MJ_MINVAL)[..., None], jnp.asarray([1.0, 0.0], p0.dtype), side_2d)
    side_2d = side_2d * radius[..., None]
    inside = has_side & (_norm(side_local) < radius)

    circle = _wrap_circle(end0, end1, side_2d, has_side, radius)
    within = _wrap_inside(end0, end1, radius)
    length, pnt0, pnt1 = (jnp.where(inside[..., None] if c.ndim > inside.ndim else inside, w, c)
                          for c, w in zip(circle, within))
    nowrap |= length < 0.0
    length = jnp.maximum(length, 0.0)

    res0 = axis0 * pnt0[..., :1] + axis1 * pnt0[..., 1:]
    res1 = axis0 * pnt1[..., :1] + axis1 * pnt1[..., 1:]
    # a cylinder: the points' heights along the axis, in proportion to the path's length up to each
    L0 = _norm(p0[..., :2] - res0[..., :2])
    L1 = _norm(p1[..., :2] - res1[..., :2])
    total = L0 + length + L1
    z0 = p0[..., 2] + (p1[..., 2] - p0[..., 2]) * _safe_div(L0, total)
    z1 = p0[..., 2] + (p1[..., 2] - p0[..., 2]) * _safe_div(L0 + length, total)
    res0 = jnp.where(cylinder_, res0.at[..., 2].set(z0), res0)
    res1 = jnp.where(cylinder_, res1.at[..., 2].set(z1), res1)
    length = jnp.where(cylinder, _norm(jnp.stack([length, jnp.abs(z1 - z0)], -1)), length)

    wpnt0 = jnp.einsum("...ij,...j->...i", mat, res0) + pos
    wpnt1 = jnp.einsum("...ij,...j->...i", mat, res1) + pos
    far = jnp.full_like(wpnt0, MJ_MAXVAL)
    return (jnp.where(nowrap, -1.0, length), jnp.where(nowrap[..., None], far, wpnt0),
            jnp.where(nowrap[..., None], far, wpnt1))
