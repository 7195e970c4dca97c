"""Row reach of computed indices: which rows of an input's adjoint each block of a CPU launch's rows adds into.

A CPU launch split across threads accumulates a scattered result through one partial buffer per thread, zeroed
before and summed after the launch (``warpnn_ffi.c``). Where the kernel reaches the result's rows through values
read from index arrays (a cloth's springs), each thread zeroes and sums only the rows its slice's indices span
(``KernelSignature.thread_row_windows``). A stencil reaches its input's rows through arithmetic instead: the heat
step reads ``u[ip, j]`` with ``ip, im = periodic_neighbours(i, u.shape[0])``, so its adjoint adds into rows
``i - 1 .. i + 1`` (wrapped) of ``u``'s adjoint, yet every thread zeroed and summed the whole of it: on 16 CPU
cores that was 45% of the 256² heat stencil's backward step (docs/benchmarks-speed-cpu.md).

Here, for an adjoint launch, the first index of every access of an input whose first index depends on nothing but
the thread's row (the first ``wp.tid()`` coordinate, integer scalar arguments, array shapes and constants, through
arithmetic and Warp functions of those) is evaluated for every row by a *probe*: a Warp kernel generated from the
statements that compute those indices (compiled like the other twins, launched once per shape and scalars, on the
CPU, over dummy arrays whose data it never reads; Warp's own arithmetic, so the same values as the kernel's). The
smallest and largest row each block of rows reaches (as the launch row plus its nearest offset, so that a periodic
stencil's wrap stays a short circular range) goes to the handler as the attribute ``row_reach``, where it bounds
each thread's partial buffer like the index arrays' windows. Any doubt (an access through a ``@wp.func``, a
view, an index read from memory or from the other coordinates, a row out of range) leaves that result's partial
buffers whole, as before.
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import functools
import math

import numpy as np
import warp as wp

from . import _batched
from . import _twins
from . import _warp_compat as wc
from ._access import _names_visible_to, parents_of
from ._signature import KernelSignature, _bindings, _first_coordinate, _first_index

MAX_BLOCKS = 512  # blocks of launch rows in the attribute (a block spans ceil(rows / MAX_BLOCKS) rows)
_PREFIX = "wnreach_"
_SAFE_DIVISORS = (ast.FloorDiv, ast.Mod)


@dataclasses.dataclass(frozen=True)
class _Probe:
    kernel: object  # the probe kernel: the kernel's parameters, then wnreach_out (rows, leads) int32
    leads: tuple[tuple[str, tuple[int, ...]], ...]  # per reached array, the columns of wnreach_out with its first indices

    @property
    def columns(self) -> dict[str, tuple[int, ...]]:
        return dict(self.leads)


def attribute(sig: KernelSignature, launch_dims: tuple[int, ...], shapes: dict[str, tuple[int, ...]],
              scalars: dict[str, object], results: list[str]) -> np.ndarray | None:
    """The ``row_reach`` attribute of an adjoint CPU launch of ``sig`` over ``launch_dims`` whose results (in the
    handler's order) are the adjoints of ``results`` (names; "" for a result with none), given every array
    parameter's shape and the scalar arguments; None where no result's reach is known."""
    probe = _probe_of(sig.kernel)
    if probe is None or not any(name in probe.columns for name in results) or not launch_dims:
        return None
    if any(wc.matches_array_class(a.type, wp.array) and a.label not in shapes for a in sig.kernel.adj.args):
        return None
    key = (tuple(launch_dims), tuple(sorted(shapes.items())), tuple(sorted(scalars.items())))
    return _attribute(sig.kernel, probe, key, tuple(results))


@functools.lru_cache(maxsize=256)
def _attribute(kernel, probe: _Probe, key, results: tuple[str, ...]) -> np.ndarray | None:
    launch_dims, shapes, scalar_items = key
    shapes = dict(shapes)
    rows = int(launch_dims[0])
    if rows < 1 or any(d < 1 for shape in shapes.values() for d in shape):
        return None
    scalars = dict(scalar_items)
    reached = _probe_rows(kernel, probe, rows, shapes, scalars)
    if reached is None:
        return None
    block = max(1, math.ceil(rows / MAX_BLOCKS))
    blocks = math.ceil(rows / block)
    values = [block, blocks, len(results)]
    known = False
    for name in results:
        span = _block_span(reached, probe.columns.get(name), shapes.get(name), block, blocks)
        known |= span is not None
        values += [1, *span] if span is not None else [0] * (1 + 2 * blocks)
    return np.asarray(values, dtype=np.int64) if known else None


def _block_span(reached: np.ndarray, columns, shape, block: int, blocks: int) -> np.ndarray | None:
    """Per block of launch rows, the smallest then the largest row of an array of ``shape`` that ``columns`` of
    ``reached`` index, each written as its launch row plus the nearest offset to it modulo the array's rows (a
    periodic stencil's last row reaching row 0 gives rows + 0): the handler's window is circular. Negative indices
    wrap once, as Warp's do; None if any falls outside the array."""
    if not columns or not shape:
        return None
    extent = shape[0]
    targets = reached[:, list(columns)].astype(np.int64)
    targets = np.where(targets < 0, targets + extent, targets)
    if (targets < 0).any() or (targets >= extent).any():
        return None
    row = np.arange(targets.shape[0], dtype=np.int64)[:, None]
    offset = (targets - row) % extent
    unwrapped = row + np.where(offset > extent // 2, offset - extent, offset)
    pad = blocks * block - targets.shape[0]
    low = np.pad(unwrapped.min(axis=1), (0, pad), mode="edge").reshape(blocks, block).min(axis=1)
    high = np.pad(unwrapped.max(axis=1), (0, pad), mode="edge").reshape(blocks, block).max(axis=1)
    return np.concatenate([low, high])


def _probe_rows(kernel, probe: _Probe, rows: int, shapes: dict, scalars: dict) -> np.ndarray | None:
    """Run the probe over ``rows`` rows: (rows, leads) int32, or None if it could not run."""
    cell = (ctypes.c_uint8 * 1024)()  # every dummy array's elements alias these bytes (strides 0): never read
    inputs: list = []
    for arg in kernel.adj.args:
        if wc.matches_array_class(arg.type, wp.array):
            shape = tuple(shapes[arg.label])
            inputs.append(wp.array(ptr=ctypes.addressof(cell), shape=shape, strides=(0,) * len(shape),
                                   dtype=arg.type.dtype, device="cpu"))
        elif arg.label in scalars:
            inputs.append(scalars[arg.label])
        else:
            return None
    out = wp.zeros((rows, 1 + max(k for _, c in probe.leads for k in c)), dtype=wp.int32, device="cpu")
    try:
        wp.launch(probe.kernel, dim=rows, inputs=[*inputs, out], device="cpu")
    except Exception:  # noqa: BLE001 - a probe that does not build or launch leaves the partial buffers whole
        return None
    return out.numpy()


@functools.cache
def _probe_of(kernel) -> _Probe | None:
    """The probe of ``kernel``'s row-only first indices, or None if no float input is reached only through them."""
    fn = _batched.kernel_body(kernel, _PREFIX)
    if fn is None:
        return None
    arg_types = dict(kernel.adj.arg_types)
    arg_types.pop("return", None)
    arrays = {n: t.ndim for n, t in arg_types.items() if wc.matches_array_class(t, wp.array)}
    floats = {n for n in arrays if wc.type_scalar_type(arg_types[n].dtype) in wc.float_types}
    int_scalars = {n for n, t in arg_types.items() if n not in arrays and t in (wp.int32, int, wp.int64)}
    bindings = _bindings(fn)
    first = _first_coordinate(fn, bindings)
    if first is None:
        return None
    scope = _names_visible_to(kernel.func)
    row_only = {first, *int_scalars}
    measures: set[str] = set()  # names bound to an array's extent
    statements: list[ast.stmt] = []
    tid_statement = None
    for stmt in fn.body:
        if tid_statement is None and isinstance(stmt, ast.Assign) and _batched._is_tid_call(stmt.value):
            tid_statement = stmt
            continue
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            continue
        target = stmt.targets[0]
        names = [e for e in (target.elts if isinstance(target, ast.Tuple) else [target])]
        if not all(isinstance(e, ast.Name) and bindings[e.id] == 1 for e in names):
            continue
        if _row_only(stmt.value, row_only, arrays, scope, measures):
            statements.append(stmt)
            row_only |= {e.id for e in names}  # type: ignore[attr-defined]
            if isinstance(target, ast.Name) and _shape_of(stmt.value, arrays):
                measures.add(target.id)  # `n = x.shape[0]` (as the measuring twin writes it): at least 1 here
    leads: list[str] = []
    columns: dict[str, tuple[int, ...]] = {}
    for name in sorted(floats):
        found = _first_indices(fn, name, arrays[name], row_only, arrays, scope, measures)
        if found:
            for lead in found:
                if lead not in leads:
                    leads.append(lead)
            columns[name] = tuple(leads.index(lead) for lead in found)
    if not columns:
        return None
    body = [f"{first} = {_twins.WP_NAME}.tid()", *(ast.unparse(s) for s in statements),
            *(f"{_PREFIX}out[{first}, {k}] = {_twins.WP_NAME}.int32({lead})" for k, lead in enumerate(leads))]
    annotations = {**arg_types, f"{_PREFIX}out": wp.array2d(dtype=wp.int32)}
    name = f"{fn.name}__wnreach"
    source = "\n".join([f"def {name}({', '.join(annotations)}):", *("    " + line for line in body)]) + "\n"
    try:
        probe = _twins.kernel_from_source(kernel, source, name, annotations, key=f"{kernel.key}__wnreach",
                                             kind="warpnn_reach")
    except Exception:  # noqa: BLE001 - no probe: whole partial buffers
        return None
    return _Probe(probe, tuple(columns.items()))


def _first_indices(fn: ast.FunctionDef, name: str, ndim: int, row_only: set[str], arrays, scope, measures) -> tuple[str, ...]:
    """The first indices (as source) of every access of array ``name``, if each is a whole element read whose first
    index is row-only and the array is used in no other way than that and measured; else ()."""
    parents = parents_of(*fn.body)
    found: list[str] = []
    for node, parent in _batched._mentions(fn.body, {name}, parents):
        if isinstance(parent, ast.Attribute) and parent.attr == "shape":
            continue
        if not (isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, ast.Load)
                and _batched._indexes_every_dim(parent, ndim) and not isinstance(parents.get(parent), ast.Subscript)):
            return ()
        lead = _first_index(parent.slice)
        if not _row_only(lead, row_only, arrays, scope, measures):
            return ()
        source = ast.unparse(lead)
        if source not in found:
            found.append(source)
    return tuple(found)


def _row_only(node: ast.AST, row_only: set[str], arrays, scope, measures: set[str] | frozenset[str] = frozenset()) -> bool:
    """Whether ``node`` computes an integer from row-only names, constants and array shapes alone (no memory read,
    no division by anything but a positive constant or an array's extent, at least 1 where a probe runs)."""

    def only(n: ast.AST) -> bool:
        return _row_only(n, row_only, arrays, scope, measures)

    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.Name):
        return node.id in row_only
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.USub, ast.UAdd)) and only(node.operand)
    if isinstance(node, ast.BinOp):
        if not isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, *_SAFE_DIVISORS)):
            return False
        divisor = node.right
        if isinstance(node.op, _SAFE_DIVISORS) and not (
                _shape_of(divisor, arrays) or (isinstance(divisor, ast.Name) and divisor.id in measures)
                or (isinstance(divisor, ast.Constant) and type(divisor.value) is int and divisor.value > 0)):
            return False
        return only(node.left) and only(node.right)
    if isinstance(node, ast.Subscript):
        return _shape_of(node, arrays)
    if isinstance(node, ast.Call):
        target = _batched.call_target(node.func, scope)
        return not node.keywords and _safe_function(target) and all(only(a) for a in node.args)
    return False


# Warp builtins a probe may call on integers: none divides, none reads memory or the thread's coordinates.
_SAFE_BUILTINS = frozenset({"min", "max", "abs", "clamp", "sign", "select", "where", "int", "int32", "int64"})


def _safe_function(target, depth: int = 0) -> bool:
    """Whether a probe may call ``target`` on any integers: a safe builtin, or a ``@wp.func`` whose body has no
    ``while``, divides only by positive constants and calls only such functions (Warp's integer division by zero is
    the CPU's, which kills the process)."""
    if not isinstance(target, wp.Function) or depth > 8:
        return False
    if target.is_builtin():
        return target.key in _SAFE_BUILTINS
    tree = getattr(getattr(target, "adj", None), "tree", None)
    if tree is None or getattr(target, "native_snippet", None):
        return False
    scope = _names_visible_to(target.func)
    for node in ast.walk(tree):
        if isinstance(node, ast.While) or (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Div, ast.Pow))):
            return False
        if isinstance(node, ast.BinOp) and isinstance(node.op, _SAFE_DIVISORS) and not (
                isinstance(node.right, ast.Constant) and type(node.right.value) is int and node.right.value > 0):
            return False
        if isinstance(node, ast.Call) and not _safe_function(_batched.call_target(node.func, scope), depth + 1):
            return False
    return True


def _shape_of(node: ast.AST, arrays) -> bool:
    """``x.shape[k]`` of an array parameter at a constant dim."""
    return (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "shape"
            and isinstance(node.value.value, ast.Name) and node.value.value.id in arrays
            and _batched._constant_indices([node.slice]) is not None)
