"""Kernels for the checked-mode tests and the fuzz: each can be launched out of range by its arguments."""

import warp as wp


@wp.kernel
def shifted_scale(x: wp.array(dtype=float), s: float, shift: int, y: wp.array(dtype=float)):
    """Elementwise, reading a neighbour: y[i] = s * x[i + shift] (out of range for shift != 0 at the ends)."""
    i = wp.tid()
    y[i] = s * x[i + shift]


@wp.kernel
def gather_rows(x: wp.array(dtype=wp.vec3), idx: wp.array(dtype=wp.int32), w: float, y: wp.array(dtype=wp.vec3)):
    """A gather: y[i] = w * x[idx[i]]."""
    i = wp.tid()
    y[i] = w * x[idx[i]]


@wp.kernel
def scatter_pairs(v: wp.array(dtype=float), pairs: wp.array2d(dtype=wp.int32), out: wp.array(dtype=float)):
    """A scatter: each pair (a, b) adds v[s] to out[a] and subtracts it from out[b]."""
    s = wp.tid()
    wp.atomic_add(out, pairs[s, 0], v[s])
    out[pairs[s][1]] -= v[s]


@wp.kernel
def grid_rows(g: wp.array2d(dtype=float), offset: int, out: wp.array(dtype=float)):
    """A row view: out[b] += g[b][j + offset] over a 2-D launch."""
    b, j = wp.tid()
    r = g[b]
    out[b] += r[j + offset]


@wp.kernel
def counter_slots(v: wp.array(dtype=float), counter: wp.array(dtype=wp.int32), slots: wp.array(dtype=float)):
    """An atomic whose result is used: each thread takes a slot from a counter (counter is an output)."""
    i = wp.tid()
    slot = wp.atomic_add(counter, 0, 1)
    slots[slot] = v[i]


@wp.func
def read_at(x: wp.array(dtype=float), i: int):
    return x[i]


@wp.kernel
def through_function(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    """An access inside a @wp.func: checked mode cannot guard it, and says so."""
    i = wp.tid()
    y[i] = read_at(x, i)


@wp.kernel
def atomic_in_expression(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = 2.0 * wp.atomic_add(y, i, x[i])


@wp.kernel
def permute(x: wp.array(dtype=float), idx: wp.array(dtype=wp.int32), y: wp.array(dtype=float)):
    """A store at a computed index: y[idx[i]] = x[i]."""
    i = wp.tid()
    y[idx[i]] = x[i]
