"""Batched twins of Warp kernels: a whole ``vmap`` batch, or one slice of a CPU launch, in one launch.

Under ``jax.vmap`` the launchers used to launch a kernel once per batch element (``_launch.py``): correct for
every kernel, since each launch sees exactly the arrays of its element, but the cost grows with the batch at
launch latency (~3.6 µs per element on an H200: 53× pure JAX at 1024 cloths). The *batched twin* of a kernel
is the same kernel generated from its source with one more leading launch dimension that selects the batch
element:

```python
@wp.kernel                                    # the twin of `springs(x, pairs, k, f)`, generated:
def springs__warpnn_batched(x__warpnn_b: wp.array2d(dtype=wp.vec3), pairs__warpnn_b: wp.array3d(dtype=int),
                            k__warpnn_b: wp.array2d(dtype=float), f__warpnn_b: wp.array2d(dtype=wp.vec3),
                            warpnn_first_batch: int, warpnn_first_row: int):
    warpnn_bl, warpnn_r0 = wp.tid()
    warpnn_b = warpnn_bl + warpnn_first_batch
    warpnn_t0 = warpnn_r0 + warpnn_first_row
    s = warpnn_t0                             # was: s = wp.tid()
    d = x__warpnn_b[warpnn_b, pairs__warpnn_b[warpnn_b, s, 1]] - ...   # every array indexed by element first
    wp.atomic_add(f__warpnn_b, warpnn_b, pairs__warpnn_b[warpnn_b, s, 0], k__warpnn_b[warpnn_b, s] * d)
```

Every array parameter gains the leading batch dim. The launcher passes a *shared* (unbatched) argument with
batch stride 0, so it is never copied, and each element still sees only its own arrays: gathers, scatters and
every other access stay exactly what they were per element (the CPU runs the batch elements' threads in the
per-element order, so even atomics add in the same order; the results are bitwise the per-element ones).

That is what a GPU runs for a vmapped call. On the CPU, where a launch costs next to nothing and the twin's
extra coordinate doubles the cost per element, a batch keeps the kernel's per-element launches and spreads them
over the CPU threads (``warpnn_ffi.c``); ``WARPNN_BATCHED_LAUNCH=twin`` forces the twin there too.

The *row twin* (``twin_of(kernel, batched=False)``) is the kernel itself with an offset on its first
``wp.tid()`` coordinate: the CPU handler cuts one big launch into row slices for its threads with it. For a
kernel of rank 2 or more it is also a *row-loop twin*: it launches over all dims but the last and loops over
that one itself (``for warpnn_t1 in range(warpnn_inner)``, the kernel's ``return`` becoming ``continue``),
because Warp's CPU entry unravels every thread's coordinates from a linear index with one 64-bit division per
dim, which is about half the time of a small kernel (``python -m benchmarks cpu_codegen``). CPU launches over
2+ dims run it even on one thread; the forward visits elements in the launch's order (bitwise the kernel's
results), the adjoint in the reverse order (gradients that several elements accumulate agree to rounding).

The two trailing ``int`` parameters let a launch cover a slice: ``warpnn_first_batch`` offsets the batch
index and ``warpnn_first_row`` the first ``wp.tid()`` coordinate, so the native CPU handler can split one
launch across threads (``warpnn_ffi.c``). The twin lives in a Warp module of its own (adding it to the
kernel's module would rebuild and unload the code already loaded), with the original module's options (an
explicit ``-O3`` or ``-march=native`` measured within noise of Warp's default ``-O2`` on the CPU stencil of
``python -m benchmarks heat --opt-levels``, so the defaults stay).

Arrays are indexed directly, not through views of the element (``x = x__warpnn_b[b]``): Warp reaches a
view's adjoint through the view's ``grad`` pointer, with the primal's strides, and zeroes it after the adjoint
of a store, which would write into XLA's cotangent buffers.

Kernels the transformation cannot express keep the per-element launch, with one warning naming the kernel
and the reason (see :func:`twin_of`): ``wp.tid()`` used other than called with no arguments in the kernel's
own body, arrays used other than element by element (passed to a ``wp.func``, row views, slices), 4-D arrays
or launches (Warp allows 4 dims), tile or cooperative-block kernels, generic kernels, kernels without source.
"""

from __future__ import annotations

import ast
import ctypes
import dataclasses
import os
import textwrap
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import warp as wp

from . import _settings
from . import _warp_compat as wc
from ._access import _names_visible_to, parents_of
from ._twins import WP_NAME, copy_tree, kernel_from_source

BATCH_PREFIX = "warpnn_"
FIRST_BATCH = "warpnn_first_batch"
FIRST_ROW = "warpnn_first_row"
INNER = "warpnn_inner"  # the row-loop twin's extent of the last launch dim, which it loops over itself
_ARRAY_SUFFIX = "__warpnn_b"
_MAX_DIMS = 4
BATCHED_ENV = "WARPNN_BATCHED_LAUNCH"  # "0": always launch per batch element

# Names of Warp builtins whose meaning depends on the launch's thread blocks: a leading batch dim changes them.
_BLOCK_BUILTINS = ("block_dim", "tile", "untile", "lane")


class _Refused(Exception):
    """The twin cannot be generated; the message says why (shown once, in the fallback warning)."""


@dataclasses.dataclass(frozen=True)
class Twin:
    """The batched twin of one kernel: its Warp kernel, and what the launchers need to know about it."""

    kernel: Any  # wp.Kernel
    kernel_dim: int  # the original kernel's wp.tid() rank; the batched twin's is one more
    batched: bool = True  # False: the row twin (first coordinate offset by warpnn_first_row)
    inner_loop: bool = False  # the row twin loops over the last launch dim itself (its rank is one less)

    @property
    def module(self):
        return self.kernel.module


_TWINS: dict[tuple[int, bool], tuple[Any, Twin | str]] = {}
_LOCK = threading.RLock()
_WARNED: set[tuple[str, str]] = set()


def batched_mode() -> str:
    """``$WARPNN_BATCHED_LAUNCH`` (read while lowering): ``"auto"`` (default: a vmapped call launches the batched
    twin on a GPU, and on the CPU runs its per-element launches across the CPU threads), ``"off"`` (``0``: one
    launch per element on one thread) or ``"twin"`` (the batched twin on the CPU too; tests use it)."""
    return _settings.get(BATCHED_ENV)


def enabled() -> bool:
    """Whether batched launches are on (``$WARPNN_BATCHED_LAUNCH`` not ``0``)."""
    return batched_mode() != "off"


def twin_of(kernel, batched: bool = True) -> Twin | str:
    """The batched twin of ``kernel`` (``batched=False``: its *row twin*, the kernel itself with an offset on
    its first ``wp.tid()`` coordinate, for CPU slices), generated once, or a sentence saying why there is none."""
    with _LOCK:
        cached = _TWINS.get((id(kernel), batched))
        if cached is not None and cached[0] is kernel:
            return cached[1]
        try:
            result: Twin | str = _make_twin(kernel, batched)
        except _Refused as e:
            result = str(e)
        except Exception as e:  # noqa: BLE001 - any failure of the transformation means: launch per element
            result = f"generating it failed ({type(e).__name__}: {e})"
        _TWINS[(id(kernel), batched)] = (kernel, result)
        return result


def warn_fallback(kernel_key: str, reason: str) -> None:
    """Say once per kernel and reason that a vmapped call launches per batch element."""
    if (kernel_key, reason) in _WARNED:
        return
    _WARNED.add((kernel_key, reason))
    warnings.warn(
        f"warpnn: kernel '{kernel_key}' under jax.vmap launches once per batch element (correct, but slower than "
        f"one launch for the whole batch): {reason}.",
        RuntimeWarning,
        stacklevel=2,
    )


# --------------------------------------------------------------------------------------------------
# The transformation


def _is_tid_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return name == "tid"


class _TidReplacer(ast.NodeTransformer):
    """Replace each ``wp.tid()`` by the twin's per-element coordinates (names ``warpnn_t<k>``)."""

    def __init__(self, kernel_dim: int, variables: frozenset[str] = frozenset()):
        self.kernel_dim = kernel_dim
        # Names the kernel assigns (`tid = wp.tid()` is common): a load of such a name is the variable, not
        # an alias of wp.tid.
        self.variables = variables

    def _names(self):
        return [ast.Name(id=f"{BATCH_PREFIX}t{k}", ctx=ast.Load()) for k in range(self.kernel_dim)]

    def visit_Assign(self, node: ast.Assign):
        # `i, j = wp.tid()` becomes `i = warpnn_t0; j = warpnn_t1` (one name per coordinate).
        call = node.value
        if (isinstance(call, ast.Call) and _is_tid_call(call) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Tuple)):
            targets = node.targets[0].elts
            if len(targets) != self.kernel_dim or not all(isinstance(t, ast.Name) for t in targets):
                raise _Refused("its wp.tid() is unpacked into something other than one name per launch dim")
            if call.args or call.keywords:
                raise _Refused("it calls wp.tid() with arguments")
            return [ast.copy_location(ast.Assign(targets=[t], value=v), node) for t, v in zip(targets, self._names())]
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        if _is_tid_call(node):
            if node.args or node.keywords:
                raise _Refused("it calls wp.tid() with arguments")
            if self.kernel_dim != 1:
                raise _Refused("it uses a multi-dimensional wp.tid() other than as `i, j = wp.tid()`")
            return ast.copy_location(self._names()[0], node)
        return self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute):
        if node.attr == "tid":  # a tid not called (an alias such as `t = wp.tid`): cannot follow it
            raise _Refused("it refers to wp.tid other than by calling it")
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name):
        # (the warp module's name in generated source, e.g. wp.static() expressions restored by copy_tree, is bound
        # by the twin's builder, not a variable of the transformation)
        if (node.id == "tid" and node.id not in self.variables) or (node.id.startswith(BATCH_PREFIX) and node.id != WP_NAME):
            raise _Refused(f"it uses the name '{node.id}', which the transformation needs")
        return node


_ATOMICS = ("atomic_add", "atomic_sub", "atomic_min", "atomic_max")


class _ArrayRewriter(ast.NodeTransformer):
    """Index every array parameter with the batch element first: ``x[i]`` -> ``x__warpnn_b[warpnn_b, i]``,
    ``wp.atomic_add(f, j, v)`` -> ``wp.atomic_add(f__warpnn_b, warpnn_b, j, v)``, ``x.shape[k]`` ->
    ``x__warpnn_b.shape[k + 1]``. No views: Warp reaches a view's adjoint through its ``grad`` pointer (and zeroes
    it after stores), while a direct index uses the adjoint arrays the launcher passes. Any other use of an
    array (passing it to a function, partial indexing, slicing) is refused."""

    def __init__(self, ndims: dict[str, int]):
        self.ndims = ndims

    def _batched(self, name: str) -> ast.Name:
        return ast.Name(id=f"{name}{_ARRAY_SUFFIX}", ctx=ast.Load())

    def _b(self) -> ast.Name:
        return ast.Name(id=f"{BATCH_PREFIX}b", ctx=ast.Load())

    def visit_Subscript(self, node: ast.Subscript):
        value = node.value
        if isinstance(value, ast.Name) and value.id in self.ndims:
            if not _indexes_every_dim(node, self.ndims[value.id]):
                raise _Refused(f"it indexes its array '{value.id}' other than element by element")
            index = [self.visit(i) for i in _subscript_indices(node)]
            new = ast.Subscript(value=self._batched(value.id), slice=ast.Tuple(elts=[self._b(), *index], ctx=ast.Load()), ctx=node.ctx)
            return ast.copy_location(new, node)
        if (isinstance(value, ast.Attribute) and value.attr == "shape" and isinstance(value.value, ast.Name)
                and value.value.id in self.ndims):
            if not (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int) and node.slice.value >= 0):
                raise _Refused(f"it reads '{value.value.id}.shape' other than at a constant index")
            shape = ast.Attribute(value=self._batched(value.value.id), attr="shape", ctx=ast.Load())
            return ast.copy_location(ast.Subscript(value=shape, slice=ast.Constant(node.slice.value + 1), ctx=ast.Load()), node)
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call):
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if name in _ATOMICS and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in self.ndims:
            array = node.args[0].id
            rest = [self.visit(a) for a in node.args[1:]]
            if len(rest) != self.ndims[array] + 1 or node.keywords:
                raise _Refused(f"it calls {name} on '{array}' other than with one index per dim and a value")
            node.args = [self._batched(array), self._b(), *rest]
            return node
        return self.generic_visit(node)

    def visit_Name(self, node: ast.Name):
        if node.id in self.ndims:
            raise _Refused(f"it uses its array '{node.id}' other than by indexing it (e.g. passes it to a function)")
        return node


def _subscript_indices(node: ast.Subscript) -> list[ast.expr]:
    """The index expressions of ``x[i]`` / ``x[i, j]``, one per indexed dim."""
    return list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]


def _constant_index(node: ast.Subscript) -> tuple[int, ...] | None:
    """The indices of ``x[1]`` / ``x[0, 2]`` when all are non-negative int literals, else None."""
    return _constant_indices(_subscript_indices(node))


def _constant_indices(index: list[ast.expr]) -> tuple[int, ...] | None:
    """``index`` as ints when every expression is a non-negative int literal, else None."""
    if all(isinstance(i, ast.Constant) and type(i.value) is int and i.value >= 0 for i in index):
        return tuple(i.value for i in index)  # type: ignore[attr-defined]
    return None


def _indexes_every_dim(node: ast.Subscript, ndim: int) -> bool:
    index = _subscript_indices(node)
    return len(index) == ndim and not any(isinstance(i, ast.Slice) for i in index)


def _mentions(body: list[ast.stmt], names, parents: dict[ast.AST, ast.AST]) -> Iterator[tuple[ast.Name, ast.AST | None]]:
    """``(name node, its parent)`` for every mention in ``body`` of a name in ``names`` (checked as it goes: a set the
    caller shrinks while iterating)."""
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and node.id in names:
                yield node, parents.get(node)


def _read_only_arrays(body: list[ast.stmt], ndims: dict[str, int]) -> set[str]:
    """Array parameters the body only reads by subscript (or measures): no store, no augmented assignment, no call
    that takes the array itself (an atomic, a ``wp.func`` that may store into it), no view."""
    read_only = set(ndims)
    parents = parents_of(*body)
    for node, parent in _mentions(body, read_only, parents):
        # a read: a load of one element (every dim indexed, no slice); a row view `row = x[k]` may be stored through
        read = (isinstance(parent, ast.Subscript) and parent.value is node and isinstance(parent.ctx, ast.Load)
                and not isinstance(parents.get(parent), ast.Subscript) and _indexes_every_dim(parent, ndims[node.id]))
        measured = isinstance(parent, ast.Attribute) and parent.attr == "shape"
        if not (read or measured):
            read_only.discard(node.id)
    return read_only


class _HoistConstantReads(ast.NodeTransformer):
    """Replace reads of a read-only array at constant indices (``alpha[0]``) by locals the row loop's prologue reads
    once per row (see :func:`_hoisted_reads`)."""

    def __init__(self, names: dict[tuple[str, tuple[int, ...]], str]):
        self.names = names

    def visit_Subscript(self, node: ast.Subscript):
        if isinstance(node.value, ast.Name) and isinstance(node.ctx, ast.Load):
            local = self.names.get((node.value.id, _constant_index(node) or ()))
            if local is not None:
                return ast.copy_location(ast.Name(id=local, ctx=ast.Load()), node)
        return self.generic_visit(node)


def _hoisted_reads(body: list[ast.stmt], ndims: dict[str, int]) -> tuple[list[ast.stmt], list[str]]:
    """The row loop's body with reads of read-only arrays at constant indices (a learnable scalar passed as
    ``alpha[0]``) moved before the loop, and the prologue lines that read them.

    Why: Warp's adjoint adds each thread's contribution to ``alpha``'s adjoint in memory, one element after another,
    a dependency chain through one address; read once before the loop, the loop's adjoint accumulates the local's
    adjoint in a register and adds it to ``alpha``'s once per row (the heat stencil's adjoint: 11.6-12.0 -> 10.3-10.9
    ns per element on one thread). The forward reads the same value either way (bitwise the same results). Only reads
    that every iteration performs are hoisted (a top-level statement before any ``return``/``if``/loop), so the
    hoisted read is one the kernel was going to make; the other reads of the same element then use the local too."""
    read_only = _read_only_arrays(body, ndims)
    unconditional: list[tuple[str, tuple[int, ...]]] = []
    for stmt in body:
        # control flow (a statement, or a conditional expression within one): what follows may not run
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Expr)) or any(
                isinstance(node, (ast.IfExp, ast.BoolOp, ast.Lambda)) for node in ast.walk(stmt)):
            break
        for node in ast.walk(stmt):
            if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in read_only
                    and isinstance(node.ctx, ast.Load)):
                index = _constant_index(node)
                if index is not None and len(index) == ndims[node.value.id] and (node.value.id, index) not in unconditional:
                    unconditional.append((node.value.id, index))
    names = {key: f"{BATCH_PREFIX}h{k}" for k, key in enumerate(unconditional)}
    hoister = _HoistConstantReads(names)
    prologue = [f"{local} = {name}[{', '.join(map(str, index))}]" for (name, index), local in names.items()]
    return [hoister.visit(stmt) for stmt in body], prologue


class _HoistShapes(ast.NodeTransformer):
    """Replace ``x.shape[k]`` of an array parameter by a local the row loop's prologue reads (see
    :func:`_hoisted_shapes`)."""

    def __init__(self, arrays: frozenset[str], prefix: str = f"{BATCH_PREFIX}s"):
        self.arrays = arrays
        self.prefix = prefix
        self.names: dict[tuple[str, int], str] = {}

    def visit_Subscript(self, node: ast.Subscript):
        value = node.value
        if (isinstance(value, ast.Attribute) and value.attr == "shape" and isinstance(value.value, ast.Name)
                and value.value.id in self.arrays and _constant_indices([node.slice]) is not None):
            key = (value.value.id, node.slice.value)  # type: ignore[attr-defined]
            local = self.names.setdefault(key, f"{self.prefix}{len(self.names)}")
            return ast.copy_location(ast.Name(id=local, ctx=ast.Load()), node)
        return self.generic_visit(node)


def _hoisted_shapes(body: list[ast.stmt], arrays: frozenset[str], scope: dict) -> tuple[list[ast.stmt], list[str]] | None:
    """The row loop's body with every ``x.shape[k]`` of an array parameter read once before the loop, and the
    prologue lines that read them; None if the body uses an array parameter in a way a loop would break.

    Why: Warp's adjoint of ``x.shape`` (or ``x.ptr``) *assigns* that field of ``x``'s adjoint array (``adj_x.shape =
    adj_k``, a zeroed shape), after the adjoints of the reads that used it. Run once per thread that is harmless;
    inside the row loop, every later iteration's adjoint then indexes ``x``'s adjoint with a zero shape, so a negative
    index (``x[i - 1, j]`` at ``i = 0``, which Warp wraps) is not wrapped and the adjoint writes before the buffer
    (measured: heap corruption). Read before the loop, the field's adjoint runs after the loop's. A ``@wp.func``
    that takes the array gets its adjoint by reference and may do the same, so such kernels (and any other use of an
    array parameter than indexing it, measuring it at a constant dim, or passing it to a Warp builtin) get no loop."""
    parents = parents_of(*body)
    for node, parent in _mentions(body, arrays, parents):
        indexed = isinstance(parent, ast.Subscript) and parent.value is node
        outer = parents.get(parent) if parent is not None else None
        measured = (isinstance(parent, ast.Attribute) and parent.attr == "shape" and isinstance(outer, ast.Subscript)
                    and outer.value is parent and _constant_indices([outer.slice]) is not None)
        to_builtin = isinstance(parent, ast.Call) and node in parent.args and _is_warp_builtin(parent.func, scope)
        if not (indexed or measured or to_builtin):
            return None
    hoister = _HoistShapes(arrays)
    body = [hoister.visit(stmt) for stmt in body]
    return body, [f"{local} = {name}.shape[{k}]" for (name, k), local in hoister.names.items()]


def _is_warp_builtin(func: ast.expr, scope: dict) -> bool:
    """Whether a call's function is a Warp builtin (``wp.atomic_add``); False for a ``@wp.func`` or anything unresolved."""
    target = call_target(func, scope)
    return isinstance(target, wp.Function) and target.is_builtin()


def call_target(func: ast.expr, scope: dict):
    """What a kernel's call ``func(...)`` names, looked up in ``scope`` (the kernel's globals); None if not a plain
    (dotted) name or not found."""
    root = func
    while isinstance(root, ast.Attribute):
        root = root.value
    if not isinstance(root, ast.Name):  # e.g. make_function()(...)
        return None
    try:
        return eval(compile(ast.Expression(func), "<warpnn>", "eval"), dict(scope))  # noqa: S307 - a name lookup
    except Exception:  # noqa: BLE001 - not resolvable here
        return None


def kernel_body(kernel, reserved_prefix: str) -> ast.FunctionDef | None:
    """``kernel``'s function definition, for a twin generated from its source; None without a source tree, for a
    generic kernel (Warp resolves its overloads at launch), or if the body uses a name starting with
    ``reserved_prefix`` (the names the twin adds)."""
    try:
        fn = kernel.adj.tree.body[0]
    except Exception:  # noqa: BLE001 - no source tree
        return None
    if not isinstance(fn, ast.FunctionDef) or kernel.is_generic:
        return None
    if any(isinstance(n, ast.Name) and n.id.startswith(reserved_prefix) for n in ast.walk(fn)):
        return None
    return fn


def windows_enabled() -> bool:
    """Whether split CPU launches may bound partial buffers (``$WARPNN_CPU_ROW_WINDOWS``, default on)."""
    return _settings.get(WINDOWS_ENV)


def _check_no_block_builtins(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if name and any(name.startswith(p) for p in _BLOCK_BUILTINS):
            raise _Refused(f"it uses '{name}' (tiles and thread blocks see the whole launch, not one element)")


def cpu_thread_safe(kernel) -> bool:
    """Whether two CPU threads may run launches of ``kernel`` at once: not if it uses tiles or thread blocks,
    whose CPU shared memory Warp keeps behind one static pointer per module (``warp/native/tile.h``), nor if its
    source cannot be read to tell."""
    try:
        _check_no_block_builtins(kernel.adj.tree)
    except Exception:  # noqa: BLE001 - _Refused, or no source tree
        return False
    return True


def _array_type(arg_type, extra: int):
    """``arg_type`` with ``extra`` more leading dims."""
    return wp.array(dtype=arg_type.dtype, ndim=arg_type.ndim + extra)


def _make_twin(kernel, batched: bool = True) -> Twin:
    if not isinstance(kernel, wp.Kernel):
        raise _Refused("it is not a wp.Kernel")
    if kernel.is_generic:
        raise _Refused("it is generic (its overloads are resolved by Warp at launch)")
    options = {**kernel.module.options, **kernel.options}
    if options.get("block_dim", 1) not in (1, 256) or kernel.options.get("block_dim") is not None:
        raise _Refused("it sets block_dim (tile or cooperative-block kernel)")
    adj = kernel.adj
    tree = copy_tree(adj.tree, kernel)
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef):
        raise _Refused("its source is not a function definition")
    _check_no_block_builtins(fn)
    # kernel_dim is set by Warp when it hashes the module (the arity of wp.tid()); hash it now if needed.
    kernel_dim = getattr(adj, "kernel_dim", None)
    if kernel_dim is None:
        adj.get_references()
        kernel_dim = adj.kernel_dim
    if batched and kernel_dim >= _MAX_DIMS:
        raise _Refused(f"it launches over {kernel_dim} dims and Warp allows {_MAX_DIMS}, one of them the batch")

    arg_types = dict(adj.arg_types)
    arg_types.pop("return", None)
    params = list(arg_types)
    arrays = [n for n in params if wc.matches_array_class(arg_types[n], wp.array)]
    others = [n for n in params if n not in arrays]
    for name in arrays:
        if batched and arg_types[name].ndim >= _MAX_DIMS:
            raise _Refused(f"its array '{name}' has {arg_types[name].ndim} dims and Warp allows {_MAX_DIMS}")
    for name in others:
        if not (arg_types[name] in wc.value_types or arg_types[name] is wp.uint64):
            raise _Refused(f"its argument '{name}' is not an array or a scalar")
    if any(n.startswith(BATCH_PREFIX) or n.endswith(_ARRAY_SUFFIX) for n in params):
        raise _Refused("an argument name collides with the transformation's names")

    assigned = frozenset(n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    body = [_TidReplacer(kernel_dim, assigned).visit(stmt) for stmt in fn.body]
    if batched:
        rewriter = _ArrayRewriter({n: arg_types[n].ndim for n in arrays})
        body = [[rewriter.visit(x) for x in stmt] if isinstance(stmt, list) else rewriter.visit(stmt) for stmt in body]
    else:
        arrays = []  # the row twin keeps every parameter as it is
    flat_body: list[ast.stmt] = []
    for stmt in body:
        flat_body.extend(stmt if isinstance(stmt, list) else [stmt])

    # The row twin of a kernel of rank >= 2 loops over its last launch dim itself: Warp's CPU code unravels
    # every thread's coordinates from one linear index with a 64-bit division per dim, about half the cost of
    # a small kernel such as a stencil (benchmarks/cpu_codegen.py); a loop has none. Each `return` becomes the
    # branch it implies (_returns_as_branches), never `continue`.
    inner_loop = not batched and kernel_dim >= 2 and _returns_as_branches(flat_body) is not None
    shapes = None
    if inner_loop:
        array_params = frozenset(n for n in params if n not in others)
        shapes = _hoisted_shapes(flat_body, array_params, _names_visible_to(kernel.func))
        inner_loop = shapes is not None
    launched = kernel_dim - inner_loop
    coords = ", ".join(f"{BATCH_PREFIX}r{k}" if k == 0 else f"{BATCH_PREFIX}t{k}" for k in range(launched))
    prologue = [
        f"{BATCH_PREFIX}bl, {coords} = {WP_NAME}.tid()" if batched else f"{coords} = {WP_NAME}.tid()",
        *([f"{BATCH_PREFIX}b = {BATCH_PREFIX}bl + {FIRST_BATCH}"] if batched else []),
        f"{BATCH_PREFIX}t0 = {BATCH_PREFIX}r0 + {FIRST_ROW}",
    ]
    if shapes is not None:
        flat_body, measured = shapes
        flat_body, hoisted = _hoisted_reads(flat_body, {n: arg_types[n].ndim for n in params if n not in others})
        lowered = _returns_as_branches(flat_body)
        assert lowered is not None  # (inner_loop was decided on it)
        flat_body = lowered
        prologue += [*measured, *hoisted, f"for {BATCH_PREFIX}t{kernel_dim - 1} in range({INNER}):"]
    body_source = ast.unparse(ast.Module(body=flat_body, type_ignores=[]))
    annotations = {  # the twin's parameters, in order
        **{f"{n}{_ARRAY_SUFFIX}" if n in arrays else n: (_array_type(arg_types[n], 1) if n in arrays else arg_types[n]) for n in params},
        FIRST_BATCH: int,
        FIRST_ROW: int,
        **({INNER: int} if inner_loop else {}),
    }
    suffix = "__warpnn_batched" if batched else "__warpnn_rows"
    name = f"{fn.name}{suffix}"
    source = "\n".join([
        f"def {name}({', '.join(annotations)}):",
        *("    " + line for line in prologue),
        textwrap.indent(body_source, "        " if inner_loop else "    "),
    ]) + "\n"
    twin = kernel_from_source(kernel, source, name, annotations, key=f"{kernel.key}{suffix}", kind=suffix[2:])
    return Twin(twin, kernel_dim, batched, inner_loop)


_REORDERED: dict[tuple[int, tuple[str, ...]], tuple[Any, Any]] = {}


def twin_from_body(kernel, params: list[str], body: list[ast.stmt], kind: str, *, annotations: dict | None = None,
                   key: str | None = None, **twin_options):
    """A kernel running ``body`` (statements of ``kernel``'s, rewritten) over ``params`` (``kernel``'s parameter
    names, in the twin's order), with ``kernel``'s key, types and options (or ``annotations``' types, ``key`` and
    ``kernel_from_source``'s ``options`` / ``module_options``): see ``_twins.kernel_from_source``."""
    arg_types = {k: v for k, v in kernel.adj.arg_types.items() if k != "return"}
    name = f"{kernel.adj.tree.body[0].name}__{kind}"
    body_source = ast.unparse(ast.Module(body=body, type_ignores=[]))
    source = f"def {name}({', '.join(params)}):\n" + textwrap.indent(body_source, "    ") + "\n"
    types = annotations if annotations is not None else {n: arg_types[n] for n in params}
    return kernel_from_source(kernel, source, name, types, key=key or kernel.key, kind=kind, **twin_options)


def with_parameters_reordered(kernel, order: tuple[str, ...]):
    """``kernel`` with its parameters in ``order`` (a permutation of their names): the same body, same key.

    Warp binds a kernel's arguments by position, and ``warpnn.jax_kernel`` (like ``wp.jax_kernel``) returns the
    trailing ones as pure outputs, which need no operand. The launch tracer moves the arrays a launch stores whole
    to the end with this, so that an array like Newton's ``x_new`` (followed by ``v_new``, which it must pass in
    with its previous value) is a pure output rather than an in-out array: an in-out array's old value is copied
    into the result's buffer whenever it stays live, every step of a rollout.
    """
    with _LOCK:
        cached = _REORDERED.get((id(kernel), order))
        if cached is not None and cached[0] is kernel:
            return cached[1]
        adj = kernel.adj
        arg_types = {k: v for k, v in adj.arg_types.items() if k != "return"}
        if sorted(order) != sorted(arg_types):
            raise ValueError(f"Kernel '{kernel.key}': {list(order)} is not an order of its parameters {list(arg_types)}.")
        reordered = twin_from_body(kernel, list(order), copy_tree(adj.tree.body[0], kernel).body, "warpnn_reordered")
        _REORDERED[(id(kernel), order)] = (kernel, reordered)
        return reordered


_MERGED: dict[tuple[int, tuple[tuple[str, str], ...]], tuple[Any, Any]] = {}


class _Rename(ast.NodeTransformer):
    def __init__(self, names: dict[str, str]):
        self.names = names

    def visit_Name(self, node: ast.Name):
        return ast.copy_location(ast.Name(self.names.get(node.id, node.id), node.ctx), node)


def with_parameters_merged(kernel, merged: tuple[tuple[str, str], ...]):
    """``kernel`` with each parameter ``drop`` of ``merged``'s ``(drop, keep)`` pairs removed and its uses reading
    ``keep``: the kernel a launch runs when it passes one array as both (Warp then reads, through ``drop``, what
    it wrote through ``keep`` in the same launch; a replay giving each parameter its own value would not).

    Refused (ValueError) where the body assigns to either name: then the two names are not one array throughout.
    """
    with _LOCK:
        cached = _MERGED.get((id(kernel), merged))
        if cached is not None and cached[0] is kernel:
            return cached[1]
        adj = kernel.adj
        arg_types = {k: v for k, v in adj.arg_types.items() if k != "return"}
        names = dict(merged)
        fn = adj.tree.body[0]
        bound = {t.id for n in ast.walk(fn) for t in (n.targets if isinstance(n, ast.Assign) else
                 [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.For)) else []) if isinstance(t, ast.Name)}
        rebound = sorted(bound & {*names, *names.values()})
        if rebound:
            raise ValueError(f"Kernel '{kernel.key}' assigns to parameter(s) {rebound}, passed the same array.")
        body = [_Rename(names).visit(stmt) for stmt in copy_tree(fn, kernel).body]
        twin = twin_from_body(kernel, [n for n in arg_types if n not in names], body, "warpnn_merged")
        _MERGED[(id(kernel), merged)] = (kernel, twin)
        return twin


def _returns_as_branches(body: list[ast.stmt]) -> list[ast.stmt] | None:
    """The kernel body with each ``return`` replaced by the branch structure it implies (``if c: A; return`` then
    ``B`` becomes ``if c: A else: B``), so that it can run as one iteration of the row loop; None where a
    ``return`` is inside a loop or in a branch that does not always return.

    Not ``continue``: Warp's adjoint of a dynamic loop does not reverse an iteration that leaves by ``continue``
    or ``break`` (measured with wp.Tape: the statements before it get no adjoint), so a row loop with
    ``continue`` had silently wrong gradients for such rows.
    """

    def has_return(node: ast.AST) -> bool:
        return any(isinstance(n, ast.Return) for n in ast.walk(node))

    def always_returns(stmts: list[ast.stmt]) -> bool:
        last = stmts[-1] if stmts else None
        return isinstance(last, ast.Return) or (
            isinstance(last, ast.If) and always_returns(last.body) and always_returns(last.orelse))

    def lower(stmts: list[ast.stmt]) -> list[ast.stmt] | None:
        out: list[ast.stmt] = []
        for k, stmt in enumerate(stmts):
            if isinstance(stmt, ast.Return):
                return out if stmt.value is None else None
            if not has_return(stmt):
                out.append(stmt)
                continue
            if not isinstance(stmt, ast.If):
                return None  # a return inside a loop (or another compound statement)
            then, other = lower(stmt.body), lower(stmt.orelse)
            if then is None or other is None:
                return None
            rest = stmts[k + 1:]
            if always_returns(stmt.body) and not always_returns(stmt.orelse):
                other = lower([*stmt.orelse, *rest])
            elif always_returns(stmt.orelse) and not always_returns(stmt.body):
                then = lower([*stmt.body, *rest])
            elif not always_returns(stmt.body):
                return None  # a return on some paths of both branches
            if then is None or other is None:
                return None
            out.append(ast.copy_location(ast.If(test=stmt.test, body=then or [ast.Pass()], orelse=other), stmt))
            return out
        return out

    return lower(body)


# --------------------------------------------------------------------------------------------------
# CPU threads


CPU_THREADS_ENV = "WARPNN_CPU_THREADS"  # threads for one CPU launch (default: the CPUs this process may use)
CPU_MIN_WORK_ENV = "WARPNN_CPU_MIN_WORK"  # launch threads (elements) per CPU worker below which a launch is not split
DEFAULT_MIN_WORK = _settings.SETTINGS[CPU_MIN_WORK_ENV].default  # measured: docs/benchmarks-speed-cpu.md ("What we measured")
ADJOINT_WORK_FACTOR = 4  # must equal kAdjointWorkFactor in warpnn_ffi.c
PARTIAL_BUDGET_ENV = "WARPNN_CPU_PARTIAL_BYTES"  # partial-buffer bytes per launch thread a split may zero and sum
DEFAULT_PARTIAL_BUDGET = _settings.SETTINGS[PARTIAL_BUDGET_ENV].default  # measured: docs/benchmarks-speed-cpu.md ("What we measured")
SLICES_ENV = "WARPNN_CPU_SLICES_PER_THREAD"  # slices per worker of a split launch (windowed or no partial buffers)
DEFAULT_SLICES_PER_WORKER = _settings.SETTINGS[SLICES_ENV].default
POOL_ENV = "WARPNN_CPU_POOL"  # whose threads run split launches: "warpnn" (its own pool) or "xla" (XLA's intra-op pool)
DEFAULT_POOL = _settings.SETTINGS[POOL_ENV].default


def cpu_thread_config() -> tuple[int, int]:
    """(threads, minimum elements per thread) for CPU launches, from the environment."""
    try:
        default = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        default = os.cpu_count() or 1
    threads = _settings.get(CPU_THREADS_ENV) or default
    return threads, _settings.get(CPU_MIN_WORK_ENV)


class _Config:
    """The CPU thread configuration in force (set by the native launcher, changed by ``set_cpu_threads``)."""

    def __init__(self):
        self._value: tuple[int, int] | None = None

    def get(self) -> tuple[int, int]:
        return self._value or cpu_thread_config()

    def set(self, value: tuple[int, int]) -> None:
        self._value = value


_LAUNCH_CONFIG = _Config()


# --------------------------------------------------------------------------------------------------
# The native launcher's side: registering twins with warpnn_ffi.c


def declare_native(lib) -> None:
    """ctypes prototypes of the twin functions of the native library."""
    c = ctypes
    lib.warpnn_set_twin.argtypes = [c.c_int64, c.c_int32, c.c_int32, c.c_int64] + [c.c_int32] * 7
    lib.warpnn_set_twin.restype = c.c_int32
    lib.warpnn_set_twin_entry.argtypes = [c.c_int64, c.c_int32, c.c_int32, c.c_int32, c.c_void_p, c.c_void_p, c.c_void_p] + [c.c_int32] * 5
    lib.warpnn_set_twin_entry.restype = c.c_int32
    lib.warpnn_set_twin_partials.argtypes = [c.c_int64, c.c_int32, c.POINTER(c.c_int32), c.POINTER(c.c_int32),
                                             c.c_int32, c.POINTER(c.c_int32), c.POINTER(c.c_int32)]
    lib.warpnn_set_twin_partials.restype = c.c_int32
    lib.warpnn_set_cpu_threads.argtypes = [c.c_int32, c.c_int64]
    lib.warpnn_set_cpu_threads.restype = None
    lib.warpnn_kernel_launches.argtypes = [c.c_int32]
    lib.warpnn_kernel_launches.restype = c.c_int64
    lib.warpnn_threaded_launches.restype = c.c_int64
    lib.warpnn_partial_rows.restype = c.c_int64
    lib.warpnn_set_cpu_partial_budget.argtypes = [c.c_int64]
    lib.warpnn_set_cpu_partial_budget.restype = None
    lib.warpnn_set_cpu_pool_xla.argtypes = [c.c_int32]
    lib.warpnn_set_cpu_pool_xla.restype = None
    lib.warpnn_xla_pool_tasks.restype = c.c_int64
    lib.warpnn_set_cpu_slices_per_worker.argtypes = [c.c_int32]
    lib.warpnn_set_cpu_slices_per_worker.restype = None
    lib.warpnn_cpu_profile.argtypes = [c.POINTER(c.c_int64)]
    lib.warpnn_cpu_profile.restype = None


# warpnn_ffi.c's g_profile counters, in order (kProfCalls ... kProfReduce)
_PROFILE_PHASES = ("calls", "handler_ns", "zero_ns", "launch_ns", "reduce_ns", "slices", "slice_ns")

# Partial-buffer kinds (warpnn_ffi.c: kPartialPrivate, kPartialNone, K_INT, K_UINT, K_FLOAT).
_PRIVATE, _NO_REDUCTION, _K_INT, _K_UINT, _K_FLOAT = -2, -1, 0, 1, 2
_MAX_WINDOW_SOURCES = 4  # warpnn_ffi.c: kMaxWindowSources
WINDOWS_ENV = "WARPNN_CPU_ROW_WINDOWS"  # "0": whole partial buffers for every threaded scatter (read per kernel)


def _read_results(sig) -> tuple[str, ...]:
    """Results whose values the kernel reads: pure outputs it reads, and in-out arrays it reads (most do)."""
    return (*sig.outputs_read, *(s.name for s in sig.in_out if sig.uses[s.name].reads))


def _partial_kind(spec, private: frozenset, assigned: frozenset, read: tuple) -> int:
    if spec.name in private:
        return _PRIVATE
    if spec.name in assigned or spec.name in read:
        return _NO_REDUCTION
    if spec.dtype.kind == "f" and spec.dtype.itemsize in (4, 8):
        return _K_FLOAT
    if spec.dtype.kind in "iu":
        return _K_INT if spec.dtype.kind == "i" else _K_UINT
    return _NO_REDUCTION


class NativeTwins:
    """The batched twins the native library knows, per kernel id (signature variant) and device."""

    def __init__(self, lib, launcher):
        self._lib = lib
        self._launcher = launcher
        # (kernel id, batched) -> None (registered) or why there is no twin
        self._reasons: dict[tuple[int, bool], str | None] = {}
        self._execs: dict[tuple[int, str, bool], Any] = {}  # (kernel id, device, batched): keeps twin code alive
        # WARPNN_CPU_SPIN_US and WARPNN_CPU_PROFILE are read by the native library itself: checked here.
        _settings.get("WARPNN_CPU_SPIN_US")
        _settings.get("WARPNN_CPU_PROFILE")
        self.set_cpu_threads(*cpu_thread_config())
        self.set_cpu_partial_budget(_settings.get(PARTIAL_BUDGET_ENV))
        self.set_cpu_slices_per_worker(_settings.get(SLICES_ENV))
        self.set_cpu_pool(_settings.get(POOL_ENV))

    def set_cpu_threads(self, threads: int, min_work: int | None = None) -> None:
        """Threads for one CPU launch (1: every launch on XLA's calling thread) and the elements per thread
        below which a launch is not split. Executables compiled before, and lowerings JAX reuses from its caches,
        keep their twin decision (jax.clear_caches() drops the latter)."""
        min_work = min_work or _LAUNCH_CONFIG.get()[1]
        self._lib.warpnn_set_cpu_threads(int(threads), int(min_work))
        _LAUNCH_CONFIG.set((int(threads), int(min_work)))

    def set_cpu_partial_budget(self, bytes_per_thread: int) -> None:
        """The partial-buffer bytes (all workers together) a split CPU launch may zero and sum per launch thread:
        a launch whose scatters need more runs on fewer workers (``$WARPNN_CPU_PARTIAL_BYTES``)."""
        self._lib.warpnn_set_cpu_partial_budget(int(bytes_per_thread))

    def set_cpu_pool(self, pool: str) -> None:
        """Whose threads run the slices of split CPU launches: ``"warpnn"`` (a pool of its own) or ``"xla"`` (XLA's
        intra-op pool, through the FFI's ``ThreadPool_Schedule``, where the running jaxlib offers it; else
        warpnn's). ``$WARPNN_CPU_POOL``; read at every launch."""
        if pool not in ("warpnn", "xla"):
            raise ValueError(f"warpnn: CPU pool {pool!r} (${POOL_ENV}): expected 'warpnn' or 'xla'")
        self.cpu_pool = pool
        self._lib.warpnn_set_cpu_pool_xla(int(pool == "xla"))

    def set_cpu_slices_per_worker(self, slices: int) -> None:
        """Slices per worker of a split CPU launch (1 to 64; ``$WARPNN_CPU_SLICES_PER_THREAD``): threads claim
        slices as they come, so finer slices let a slowed-down thread take fewer. Read at every launch."""
        self.cpu_slices_per_worker = max(1, min(64, int(slices)))
        self._lib.warpnn_set_cpu_slices_per_worker(self.cpu_slices_per_worker)

    def kernel_launches(self) -> dict[str, int]:
        return {"forward": self._lib.warpnn_kernel_launches(0), "adjoint": self._lib.warpnn_kernel_launches(1)}

    def threaded_launches(self) -> int:
        return self._lib.warpnn_threaded_launches()

    def xla_pool_tasks(self) -> int:
        """Slice runners handed to XLA's intra-op thread pool (``$WARPNN_CPU_POOL=xla``), since the start."""
        return self._lib.warpnn_xla_pool_tasks()

    def partial_rows(self) -> int:
        """Rows of per-worker partial buffers that threaded CPU launches zeroed and summed, since the start."""
        return self._lib.warpnn_partial_rows()

    def cpu_profile(self) -> dict[str, int]:
        """Where the CPU handler's time went since the last call (counters then zeroed): handler calls, and ns in
        the handler, zeroing results, a twin's launches (a split one with the caller's wait for its slices) and
        summing their partial buffers; the launches' slices (an unsplit launch is one) and the ns their kernels
        ran, summed over threads. Counted only when ``$WARPNN_CPU_PROFILE`` is set (non-zero) in the process."""
        counters = (ctypes.c_int64 * len(_PROFILE_PHASES))()
        self._lib.warpnn_cpu_profile(counters)
        return dict(zip(_PROFILE_PHASES, counters))

    def prepare(self, sig, batched: bool = True) -> str | None:
        """Register the batched (or row) twin of ``sig`` on this trace's devices; None when ready, else the
        reason there is none."""
        from ._devices import trace_devices

        kid = self._launcher._kernel_id(sig)
        key = (kid, batched)
        with _LOCK:
            if self._reasons.get(key, None) is not None:
                return self._reasons[key]
            twin = twin_of(sig.kernel, batched)
            if isinstance(twin, str):
                self._reasons[key] = twin
                return twin
            try:
                for device in trace_devices():
                    self._set_entry(kid, twin, device)
                if key not in self._reasons:
                    self._register_layout(kid, sig, twin)
            except Exception as e:  # noqa: BLE001 - a twin that does not build or load: launch per element
                self._reasons[key] = f"its batched twin could not be built or loaded ({type(e).__name__}: {e})"
                return self._reasons[key]
            self._reasons[key] = None
            return None

    def _set_entry(self, kid: int, twin: Twin, device) -> None:
        module_exec = twin.kernel.module.load(device, wc.resolve_block_dim(device, None))
        if module_exec is None:
            raise RuntimeError(f"Warp could not build module '{twin.kernel.module.name}' for {device}")
        key = (kid, device.alias, twin.batched)
        if self._execs.get(key) is module_exec:
            return
        hooks = module_exec.get_kernel_hooks(twin.kernel)
        if device.is_cpu:
            args = (0, 0, None, _address(hooks.forward), _address(hooks.backward), 0, 0, module_exec.block_dim, 0, 1)
        else:
            args = (
                1, device.ordinal, device.context, hooks.forward, hooks.backward, hooks.forward_smem_bytes,
                hooks.backward_smem_bytes if hooks.backward else 0, module_exec.block_dim,
                int(bool(twin.kernel.grid_stride)), hooks.cluster_dim,
            )
        rc = self._lib.warpnn_set_twin_entry(kid, int(twin.batched), *args)
        if rc != 0:
            raise RuntimeError(f"registering the twin entry points failed ({rc})")
        self._execs[key] = module_exec

    def _register_layout(self, kid: int, sig, twin: Twin) -> None:
        params = (*sig.inputs, *sig.outputs)
        fields = [(s.name, wc.array_t if s.is_array else s.warp_type._type_) for s in params]
        original = type("ArgsStruct", (ctypes.Structure,), {"_fields_": fields})
        extra = [(FIRST_BATCH, ctypes.c_int32), (FIRST_ROW, ctypes.c_int32), *([(INNER, ctypes.c_int32)] if twin.inner_loop else [])]
        extended = type("TwinArgsStruct", (ctypes.Structure,), {"_fields_": [*fields, *extra]})
        if any(getattr(original, n).offset != getattr(extended, n).offset for n, _ in fields):
            raise RuntimeError("the twin's argument struct does not extend the kernel's")
        kernel = twin.kernel
        bounds_type: Any = type(wc.build_launch_bounds((1,) * kernel.adj.kernel_dim, kernel))  # a ctypes struct
        tid_limit = wc.tid_extent_limit(kernel)
        rc = self._lib.warpnn_set_twin(
            kid, int(twin.batched), kernel.adj.kernel_dim, -1 if tid_limit is None else int(tid_limit), ctypes.sizeof(bounds_type),
            bounds_type.size.offset, bounds_type.coord_mult.offset, ctypes.sizeof(extended),
            getattr(extended, FIRST_BATCH).offset, getattr(extended, FIRST_ROW).offset,
            getattr(extended, INNER).offset if twin.inner_loop else -1,
        )
        if rc != 0:
            raise RuntimeError(f"the native library refused the twin's layout ({rc})")
        private, assigned = sig.thread_private_arrays
        # One kind per result of each mode, in the handler's order: forward, in-out arrays then outputs;
        # adjoint, input adjoints then carried adjoints (the in-out arrays' grads, aliased to their cotangents).
        fwd = [_partial_kind(s, private, assigned, _read_results(sig)) for s in sig.results]
        adj = [_K_FLOAT if s.name not in private and s.dtype.itemsize in (4, 8) else _PRIVATE if s.name in private else _NO_REDUCTION
               for s in sig.adjoint_inputs]
        # A carried adjoint starts as the cotangent, which the adjoint reads: a zeroed partial would miss it.
        adj += [_PRIVATE if s.name in private else _NO_REDUCTION for s in sig.carried_adjoints]
        # A replay buffer holds primal values the replayed @wp.func calls store and read: never a partial sum.
        adj += [_PRIVATE if s.name in private else _NO_REDUCTION for s in sig.replay_buffers]
        fwd_arr = (ctypes.c_int32 * max(1, len(fwd)))(*fwd)
        adj_arr = (ctypes.c_int32 * max(1, len(adj)))(*adj)
        fwd_windows = _window_table(sig, original, sig.results)
        adj_windows = _window_table(sig, original, (*sig.adjoint_inputs, *sig.carried_adjoints, *sig.replay_buffers))
        rc = self._lib.warpnn_set_twin_partials(kid, len(fwd), fwd_arr, fwd_windows, len(adj), adj_arr, adj_windows)
        if rc != 0:
            raise RuntimeError(f"the native library refused the twin's partial kinds ({rc})")


def _window_table(sig, args_struct, results) -> Any:
    """Per result, the index arrays bounding the rows a CPU slice touches (``KernelSignature.thread_row_windows``):
    for each of ``_MAX_WINDOW_SOURCES`` slots, (args-struct offset, integer bytes, element bytes), offset -1 for
    none. A result with more sources than that keeps whole partial buffers, as every result does with
    ``$WARPNN_CPU_ROW_WINDOWS=0`` (read when a kernel is first registered)."""
    by_name = {s.name: s for s in sig.inputs}
    windows = sig.thread_row_windows if windows_enabled() else {}
    table = []
    for spec in results:
        sources = windows.get(spec.name, ())
        rows = [(getattr(args_struct, name).offset, by_name[name].dtype.itemsize,
                 wp.types.type_size_in_bytes(by_name[name].warp_type.dtype))
                for name in sources] if len(sources) <= _MAX_WINDOW_SOURCES else []
        rows += [(-1, 0, 0)] * (_MAX_WINDOW_SOURCES - len(rows))
        table += [v for row in rows for v in row]
    return (ctypes.c_int32 * max(1, len(table)))(*table)


def _address(fn) -> int:
    return 0 if fn is None else (ctypes.cast(fn, ctypes.c_void_p).value or 0)
