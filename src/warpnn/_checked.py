"""Checked mode: Warp kernels run with index checks, and an out-of-range access is a Python error, not a crash.

In the default mode an out-of-range index in a Warp kernel reads garbage or writes over memory XLA owns
(heap corruption, SIGSEGV). Warp's own ``wp.config.mode = "debug"`` catches those accesses but aborts the
process. Checked mode (``WARPNN_CHECK=1``, ``warpnn.set_checked(True)`` or ``with warpnn.checked():``) runs a
*checked variant* of every kernel instead, built from the kernel's own source by an AST transform
(``_IndexGuard``, applied through Warp's ``code_transformers``):

* every load, store, augmented store and atomic on an array parameter (or on a row view taken from one,
  ``row = grid[i]``) is guarded by a check of each index against the array's shape (Warp's rule:
  ``-n <= i < n``);
* a failing check skips the access (a load yields zero, a store or atomic does nothing) and records the
  first violation (which access, its indices, the array's shape, the thread) in a small hidden int32 output
  array, ``_warpnn_violation``, that the bridge zeroes before the launch like any output;
* after the call, a nonzero record raises :class:`KernelIndexError` naming the kernel, the array, the
  access, the index and the shape: directly for eager calls, through ``jax.debug.callback`` under ``jit``
  (JAX re-raises it at the call site as a runtime error carrying the same message). The process stays alive.

Adjoint launches run the checked variant's adjoint: Warp's reverse pass takes the same guarded branches, so
the adjoint of a skipped access is skipped too (every adjoint array has its primal's shape, so the adjoint
cannot reach an element the forward did not), and the violation is reported by the forward record. The
recording itself is not replayed in the adjoint (``wp.func_replay``), so the adjoint never writes the record.

Not covered (documented, not silent): accesses inside ``@wp.func`` helpers the kernel calls with an array,
tile loads and stores (Warp's tile functions handle their own bounds), and atomics used inside larger
expressions (assign the result to a variable first, or the checked variant refuses to build).

Cost: one more output array and an index check per access on the device, a device-to-host copy of 64
bytes and a host callback per call (a stream synchronisation on CUDA), and separate compiled modules.
"""

from __future__ import annotations

import ast
import contextlib
import copy
import dataclasses
import functools
import hashlib
import pathlib
import inspect
import sys
import threading
import types
import warnings
from typing import Any

import jax
import numpy as np
import warp as wp

from . import _settings
from ._batched import call_target
from ._access import ArrayUse
from ._signature import KernelSignature, Struct, _arg_spec
from ._twins import twin_of

CHECK_ENV = "WARPNN_CHECK"
RECORD_NAME = "_warpnn_violation"
RECORD_LEN = 16  # flag, site, ndim, (unused), extents[4], indices as (lo, hi) int32 pairs [8]
_HELPERS = "_warpnn_checked"  # how the transformed kernel refers to this module
_MAX_INDICES = 4

_ATOMICS = {"atomic_add", "atomic_sub", "atomic_min", "atomic_max", "atomic_and", "atomic_or", "atomic_xor",
            "atomic_exch", "atomic_cas"}


class KernelIndexError(IndexError):
    """A kernel run in checked mode indexed an array out of range (the access was skipped)."""


# --------------------------------------------------------------------------------------------------
# Switching checked mode on and off


_STATE = threading.local()
_DEFAULT = [bool(_settings.get(CHECK_ENV))]


def set_checked(enabled: bool = True) -> bool:
    """Turn checked mode on or off (process-wide, unless a ``checked()`` block of this thread says otherwise);
    returns the previous setting.

    Checked mode is decided when a call is traced, so switching it clears JAX's caches (``jax.clear_caches()``):
    functions compiled before are traced again, in the new mode, at their next call.
    """
    previous = _DEFAULT[0]
    _DEFAULT[0] = bool(enabled)
    if _DEFAULT[0] != previous:
        jax.clear_caches()
    return previous


def is_checked() -> bool:
    """Whether warpnn calls traced now run checked kernels (``WARPNN_CHECK=1``, set_checked, checked())."""
    override = getattr(_STATE, "override", None)
    return _DEFAULT[0] if override is None else override


@contextlib.contextmanager
def checked(enabled: bool = True):
    """Run the block (this thread) in checked mode: out-of-range indices in Warp kernels raise
    :class:`KernelIndexError` naming the kernel, the array and the index, instead of corrupting memory.

    Checked mode is decided when a call is traced, so entering and leaving a block that changes it clears JAX's
    caches: ``jax.jit`` functions compiled outside run checked inside (they are traced again), and the other way
    round. Example:

    ```python
    with warpnn.checked():
        loss = train_step(params, batch)   # a bad index raises here, naming kernel, array and index
    ```
    """
    previous = getattr(_STATE, "override", None)
    before = is_checked()
    _STATE.override = bool(enabled)
    if is_checked() != before:
        jax.clear_caches()
    try:
        yield
    finally:
        _STATE.override = previous
        if is_checked() != bool(enabled):
            jax.clear_caches()


# --------------------------------------------------------------------------------------------------
# Warp helpers the transformed kernels call. Indices are compared as int64, so an int64 or uint64 index
# cannot wrap into range.


@wp.func
def _report(err: wp.array(dtype=wp.int32), site: int, ndim: int, n0: int, n1: int, n2: int, n3: int,
            i0: wp.int64, i1: wp.int64, i2: wp.int64, i3: wp.int64):
    if wp.atomic_cas(err, 0, 0, 1) == 0:  # the first violation of the launch wins
        err[1] = site
        err[2] = ndim
        err[4] = n0
        err[5] = n1
        err[6] = n2
        err[7] = n3
        err[8] = wp.int32(i0 & wp.int64(0xFFFFFFFF))
        err[9] = wp.int32(i0 >> wp.int64(32))
        err[10] = wp.int32(i1 & wp.int64(0xFFFFFFFF))
        err[11] = wp.int32(i1 >> wp.int64(32))
        err[12] = wp.int32(i2 & wp.int64(0xFFFFFFFF))
        err[13] = wp.int32(i2 >> wp.int64(32))
        err[14] = wp.int32(i3 & wp.int64(0xFFFFFFFF))
        err[15] = wp.int32(i3 >> wp.int64(32))


@wp.func
def _inside(n: int, i: wp.int64) -> bool:
    return i >= -wp.int64(n) and i < wp.int64(n)


# The checks are called from the kernel body only (never from another helper), with non-generic types, so that
# they can have a replay and an adjoint of their own: Warp's adjoint launch replays the forward body, and its
# replay of a check must evaluate the same condition without writing the record, which is then an input
# buffer of the adjoint call (the forward's record, already reported).


@wp.func
def ok1(n0: int, i0: wp.int64, err: wp.array(dtype=wp.int32), site: int) -> bool:
    ok = _inside(n0, i0)
    if not ok:
        _report(err, site, 1, n0, 0, 0, 0, i0, wp.int64(0), wp.int64(0), wp.int64(0))
    return ok


@wp.func_replay(ok1)
def _ok1_replay(n0: int, i0: wp.int64, err: wp.array(dtype=wp.int32), site: int):
    return _inside(n0, i0)


@wp.func_grad(ok1)
def _ok1_grad(n0: int, i0: wp.int64, err: wp.array(dtype=wp.int32), site: int, adj_ok: bool):
    pass


@wp.func
def ok2(n0: int, n1: int, i0: wp.int64, i1: wp.int64, err: wp.array(dtype=wp.int32), site: int) -> bool:
    ok = _inside(n0, i0) and _inside(n1, i1)
    if not ok:
        _report(err, site, 2, n0, n1, 0, 0, i0, i1, wp.int64(0), wp.int64(0))
    return ok


@wp.func_replay(ok2)
def _ok2_replay(n0: int, n1: int, i0: wp.int64, i1: wp.int64, err: wp.array(dtype=wp.int32), site: int):
    return _inside(n0, i0) and _inside(n1, i1)


@wp.func_grad(ok2)
def _ok2_grad(n0: int, n1: int, i0: wp.int64, i1: wp.int64, err: wp.array(dtype=wp.int32), site: int, adj_ok: bool):
    pass


@wp.func
def ok3(n0: int, n1: int, n2: int, i0: wp.int64, i1: wp.int64, i2: wp.int64, err: wp.array(dtype=wp.int32),
        site: int) -> bool:
    ok = _inside(n0, i0) and _inside(n1, i1) and _inside(n2, i2)
    if not ok:
        _report(err, site, 3, n0, n1, n2, 0, i0, i1, i2, wp.int64(0))
    return ok


@wp.func_replay(ok3)
def _ok3_replay(n0: int, n1: int, n2: int, i0: wp.int64, i1: wp.int64, i2: wp.int64, err: wp.array(dtype=wp.int32),
                site: int):
    return _inside(n0, i0) and _inside(n1, i1) and _inside(n2, i2)


@wp.func_grad(ok3)
def _ok3_grad(n0: int, n1: int, n2: int, i0: wp.int64, i1: wp.int64, i2: wp.int64, err: wp.array(dtype=wp.int32),
              site: int, adj_ok: bool):
    pass


@wp.func
def ok4(n0: int, n1: int, n2: int, n3: int, i0: wp.int64, i1: wp.int64, i2: wp.int64, i3: wp.int64,
        err: wp.array(dtype=wp.int32), site: int) -> bool:
    ok = _inside(n0, i0) and _inside(n1, i1) and _inside(n2, i2) and _inside(n3, i3)
    if not ok:
        _report(err, site, 4, n0, n1, n2, n3, i0, i1, i2, i3)
    return ok


@wp.func_replay(ok4)
def _ok4_replay(n0: int, n1: int, n2: int, n3: int, i0: wp.int64, i1: wp.int64, i2: wp.int64, i3: wp.int64,
                err: wp.array(dtype=wp.int32), site: int):
    return _inside(n0, i0) and _inside(n1, i1) and _inside(n2, i2) and _inside(n3, i3)


@wp.func_grad(ok4)
def _ok4_grad(n0: int, n1: int, n2: int, n3: int, i0: wp.int64, i1: wp.int64, i2: wp.int64, i3: wp.int64,
              err: wp.array(dtype=wp.int32), site: int, adj_ok: bool):
    pass


i64 = wp.int64  # the transformed kernels cast indices with it, whatever their own name for warp is


@wp.func
def row(i0: Any, ok: bool):
    """A checked index for taking a view (``grid[i]``): the index, or 0 when it is out of range."""
    result = i0
    if not ok:
        result = i0 - i0
    return result


@wp.func
def load1(a: wp.array(dtype=Any), i0: Any, zero: Any, ok: bool):
    value = zero
    if ok:
        value = a[i0]
    return value


@wp.func
def load2(a: wp.array2d(dtype=Any), i0: Any, i1: Any, zero: Any, ok: bool):
    value = zero
    if ok:
        value = a[i0, i1]
    return value


@wp.func
def load3(a: wp.array3d(dtype=Any), i0: Any, i1: Any, i2: Any, zero: Any, ok: bool):
    value = zero
    if ok:
        value = a[i0, i1, i2]
    return value


@wp.func
def load4(a: wp.array4d(dtype=Any), i0: Any, i1: Any, i2: Any, i3: Any, zero: Any, ok: bool):
    value = zero
    if ok:
        value = a[i0, i1, i2, i3]
    return value


# --------------------------------------------------------------------------------------------------
# The transform


@dataclasses.dataclass(frozen=True)
class Site:
    """One guarded access in a kernel's source."""

    array: str  # the kernel parameter (a view's parent)
    kind: str  # "read", "write", "+= / -=", "wp.atomic_add", "view", ...
    line: int  # in the kernel's source file
    via: str = ""  # the local view name, when the access goes through one


class CheckedBuildError(TypeError):
    """The kernel has an access checked mode cannot guard; the message says which and what to change."""


class _IndexGuard(ast.NodeTransformer):
    """Rewrites a kernel body so that every array access is index-checked (see the module docstring)."""

    def __init__(self, kernel_key: str, arrays: dict[str, tuple[int, str]], first_line: int, scope: dict):
        self.key = kernel_key
        self.scope = scope  # the kernel function's globals: to tell Warp builtins from user functions
        self.unguarded: list[str] = []  # accesses left unchecked: arrays handed to user functions, struct fields
        self.structs: set[str] = set()  # struct parameters
        self.params = arrays  # array parameter -> (ndim, name of its zero constant)
        self.views: dict[str, tuple[str, int]] = {}  # local view -> (parent parameter, ndim)
        self.sites: list[Site] = []
        self.first_line = first_line

    # -- helpers

    def _array(self, node) -> tuple[str, str, int] | None:
        """(name, parent parameter, ndim) when ``node`` names an array parameter or a tracked view."""
        if isinstance(node, ast.Name):
            if node.id in self.params:
                return node.id, node.id, self.params[node.id][0]
            if node.id in self.views:
                parent, ndim = self.views[node.id]
                return node.id, parent, ndim
        return None

    def _site(self, parent: str, kind: str, node, via: str = "") -> ast.Constant:
        line = self.first_line + getattr(node, "lineno", 1) - 1
        self.sites.append(Site(parent, kind, line, via))
        return ast.Constant(len(self.sites))  # 0 means "no violation"

    @staticmethod
    def _helper(name: str) -> ast.Attribute:
        return ast.Attribute(ast.Name(_HELPERS, ast.Load()), name, ast.Load())

    @staticmethod
    def _err() -> ast.Name:
        return ast.Name(RECORD_NAME, ast.Load())

    # The checks read array extents from variables assigned once, at the top of the body (parameters) or right
    # after a view is taken, not from `a.shape[k]` at each access: Warp's adjoint of reading `a.shape` sets the
    # *adjoint* array's shape to zero at that point of the reverse pass, and an adjoint access after it (earlier
    # in program order) with a negative index would wrap by that zero shape (found by the fuzz: lost gradients).

    @staticmethod
    def _shape_var(name: str, k: int) -> str:
        return f"_warpnn_shape_{name}_{k}"

    def _shape(self, name: str, k: int) -> ast.Name:
        return ast.Name(self._shape_var(name, k), ast.Load())

    def _read_shapes(self, name: str, ndim: int, like) -> list[ast.Assign]:
        reads = []
        for k in range(ndim):
            value = ast.Subscript(ast.Attribute(ast.Name(name, ast.Load()), "shape", ast.Load()), ast.Constant(k), ast.Load())
            reads.append(ast.copy_location(ast.Assign([ast.Name(self._shape_var(name, k), ast.Store())], value), like))
        return reads

    def _flatten(self, node: ast.Subscript):
        """``a[i][j]`` / ``a[i, j]`` on an array -> (array info, [index exprs]); None if not an array access."""
        indices = []
        while isinstance(node, ast.Subscript):
            s = node.slice
            if isinstance(s, ast.Slice) or (isinstance(s, ast.Tuple) and any(isinstance(e, ast.Slice) for e in s.elts)):
                return None
            indices[:0] = list(s.elts) if isinstance(s, ast.Tuple) else [s]
            info = self._array(node.value)
            if info is not None:
                return info, indices
            node = node.value
        return None

    def _check(self, name: str, indices, site) -> ast.Call:
        n = len(indices)
        casts = [ast.Call(self._helper("i64"), [i], []) for i in indices]
        args = [self._shape(name, k) for k in range(n)] + casts + [self._err(), site]
        return ast.Call(self._helper(f"ok{n}"), args, [])

    # -- expressions

    def visit_Subscript(self, node: ast.Subscript):
        measured = self._measurement(node)
        if measured is not None:
            # The kernel's own `a.shape[k]` reads the variable assigned at the top, so that no measurement
            # follows an access in the body (a measurement after `a[i - 1]` crashed the adjoint: the comment above)
            return ast.copy_location(self._shape(*measured), node)
        if isinstance(node.value, ast.Attribute) and self._struct_rooted(node.value):
            # an array field of a struct parameter: Warp knows its shape, this transform does not guard it
            self.unguarded.append(f"{ast.unparse(node.value)}[...] at line {self.first_line + node.lineno - 1}")
        flat = self._flatten(node)
        if flat is None or not isinstance(node.ctx, ast.Load):
            return self.generic_visit(node)
        (name, parent, ndim), indices = flat
        indices = [self.visit(i) for i in indices]
        if len(indices) > ndim:  # indexing into a vector element (a[i][0]): guard the array part only
            inner, rest = indices[:ndim], indices[ndim:]
            load = self._load(name, parent, ndim, inner, node)
            return ast.Subscript(load, rest[0] if len(rest) == 1 else ast.Tuple(rest, ast.Load()), ast.Load())
        if len(indices) < ndim:  # a view: check the indices, clamp them to 0 when out of range
            return self._view(name, parent, indices, node)
        return self._load(name, parent, ndim, indices, node)

    def _measurement(self, node: ast.Subscript) -> tuple[str, int] | None:
        """(array, k) when ``node`` is ``a.shape[k]`` of an array parameter or view, at a constant k in range."""
        value = node.value
        if not (isinstance(value, ast.Attribute) and value.attr == "shape" and isinstance(node.ctx, ast.Load)):
            return None
        found = self._array(value.value)
        k = node.slice.value if isinstance(node.slice, ast.Constant) else None
        if found is None or not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < found[2]:
            return None
        return found[0], k

    def _load(self, name, parent, ndim, indices, node):
        site = self._site(parent, "read", node, via=name if name != parent else "")
        zero = ast.Name(self.params[parent][1], ast.Load())
        check = self._check(name, [copy.deepcopy(i) for i in indices], site)
        return ast.Call(self._helper(f"load{ndim}"), [ast.Name(name, ast.Load()), *indices, zero, check], [])

    def _view(self, name, parent, indices, node):
        if name != parent:
            raise CheckedBuildError(
                f"Kernel '{self.key}', line {self.first_line + node.lineno - 1}: checked mode guards views taken "
                f"from a kernel parameter ({parent}[i]), not views of views ({name}[...]). Index the parameter "
                "with all its indices at once."
            )
        guarded = []
        for k, index in enumerate(indices):
            site = self._site(parent, f"view (index {k})", node)
            check = ast.Call(self._helper("ok1"), [self._shape(name, k), ast.Call(self._helper("i64"), [copy.deepcopy(index)], []),
                                                    self._err(), site], [])
            guarded.append(ast.Call(self._helper("row"), [index, check], []))
        return ast.Subscript(ast.Name(name, ast.Load()), guarded[0] if len(guarded) == 1 else ast.Tuple(guarded, ast.Load()), ast.Load())

    def visit_Call(self, node: ast.Call):
        func = node.func
        fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        line = self.first_line + node.lineno - 1
        if fname in _ATOMICS and (node.args and self._array(node.args[0]) is not None or node.keywords):
            raise CheckedBuildError(
                f"Kernel '{self.key}', line {line}: checked mode guards wp.{fname}(array, indices..., value) with "
                f"positional arguments, as a statement or assigned to a variable (old = wp.{fname}(...)), not "
                "inside a larger expression or with keyword arguments. Rewrite it that way."
            )
        arrays = [self._array(a)[1] for a in node.args if self._array(a) is not None]
        arrays += [ast.unparse(a) for a in node.args if self._struct_rooted(a)]
        if arrays and not self._is_builtin(func):
            # Warp compiles the function's own body: its accesses are not guarded. Say so (once per kernel).
            self.unguarded.append(f"{', '.join(arrays)} passed to {ast.unparse(func)}() at line {line}")
        return self.generic_visit(node)

    def _struct_rooted(self, node) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id in self.structs

    def _is_builtin(self, func) -> bool:
        target = call_target(func, self.scope)  # None: not resolvable here, assume a user function
        return target is not None and (not isinstance(target, wp.Function) or target.is_builtin())

    # -- statements

    def _guarded(self, check, statement, orelse=None):
        return ast.If(check, [statement], orelse or [])

    def visit_Assign(self, node: ast.Assign):
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript):
            flat = self._flatten(node.targets[0])
            if flat is not None:
                return self._store(node, node.targets[0], flat, "write")
        if len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target = node.targets[0].id
            value = node.value
            # a view: row = grid[i]
            if isinstance(value, ast.Subscript):
                flat = self._flatten(value)
                if flat is not None and len(flat[1]) < flat[0][2] and flat[0][0] == flat[0][1]:
                    (name, parent, ndim), indices = flat
                    node.value = self.visit(value)
                    self.views[target] = (parent, ndim - len(indices))
                    return [node, *self._read_shapes(target, ndim - len(indices), node)]
            # old = wp.atomic_add(a, i, v)
            if isinstance(value, ast.Call):
                fname = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", None)
                if fname in _ATOMICS and value.args and self._array(value.args[0]) is not None:
                    guard = self._atomic(value, fname)
                    if guard is not None:
                        check, call = guard
                        # old = zero; if ok: old = wp.atomic_...(...): a skipped atomic yields zero
                        zero = ast.Name(self.params[self._array(value.args[0])[1]][1], ast.Load())
                        init = ast.Assign([ast.Name(target, ast.Store())], zero)
                        ast.copy_location(init, node)
                        assign = ast.Assign([ast.Name(target, ast.Store())], call)
                        ast.copy_location(assign, node)
                        return [init, ast.copy_location(self._guarded(check, assign), node)]
            if target in self.views or target in self.params:
                self.views.pop(target, None)  # rebound: no longer a view we know
        return self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign):
        if isinstance(node.target, ast.Subscript):
            flat = self._flatten(node.target)
            if flat is not None:
                return self._store(node, node.target, flat, "augmented store")
        return self.generic_visit(node)

    def _store(self, node, target, flat, kind):
        (name, parent, ndim), indices = flat
        indices = [self.visit(i) for i in indices]
        node.value = self.visit(node.value)
        array_indices = indices[:ndim]
        if len(array_indices) < ndim:
            raise CheckedBuildError(
                f"Kernel '{self.key}', line {self.first_line + node.lineno - 1}: checked mode cannot guard a store "
                f"into a view ({name} with {len(array_indices)} of {ndim} indices). Index all dims."
            )
        site = self._site(parent, kind, node, via=name if name != parent else "")
        # the store itself, with the (already guarded) index expressions
        store_target = ast.Subscript(ast.Name(name, ast.Load()),
                                     array_indices[0] if ndim == 1 else ast.Tuple(array_indices, ast.Load()), ast.Store())
        rest = indices[ndim:]
        if rest:  # a[i][0] = v: a component of a vector element
            store_target = ast.Subscript(ast.Subscript(ast.Name(name, ast.Load()),
                                                       array_indices[0] if ndim == 1 else ast.Tuple(array_indices, ast.Load()),
                                                       ast.Load()),
                                         rest[0] if len(rest) == 1 else ast.Tuple(rest, ast.Load()), ast.Store())
        if isinstance(node, ast.Assign):
            node.targets = [store_target]
        else:
            node.target = store_target
        check = self._check(name, [copy.deepcopy(i) for i in array_indices], site)
        return ast.copy_location(self._guarded(check, node), node)

    def _atomic(self, call: ast.Call, fname: str):
        name, parent, ndim = self._array(call.args[0])
        rest = [self.visit(a) for a in call.args[1:]]
        call.keywords = [ast.keyword(k.arg, self.visit(k.value)) for k in call.keywords]
        # wp.atomic_op(a, i, [j, ...], value[, value2]): the indices are the arguments before the value(s)
        n_values = 2 if fname == "atomic_cas" else 1
        indices = rest[: len(rest) - n_values]
        if len(indices) != ndim:
            raise CheckedBuildError(
                f"Kernel '{self.key}', line {self.first_line + call.lineno - 1}: checked mode expects wp.{fname} on "
                f"the {ndim}-D array '{name}' with {ndim} indices, got {len(indices)}."
            )
        call.args = [call.args[0], *rest]
        site = self._site(parent, f"wp.{fname}", call, via=name if name != parent else "")
        return self._check(name, [copy.deepcopy(i) for i in indices], site), call

    def visit_Expr(self, node: ast.Expr):
        value = node.value
        if isinstance(value, ast.Call):
            fname = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", None)
            if fname in _ATOMICS and value.args and self._array(value.args[0]) is not None:
                check, call = self._atomic(value, fname)
                node.value = call
                return ast.copy_location(self._guarded(check, node), node)
        return self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef):
        node.args.args.append(ast.arg(RECORD_NAME, None))
        body = [self.visit(s) for s in node.body]
        flat = []
        for name, (ndim, _) in self.params.items():
            flat += self._read_shapes(name, ndim, node.body[0])
        for s in body:
            flat.extend(s if isinstance(s, list) else [s])
        node.body = flat
        return node

    def generic_visit(self, node):
        # statement lists may receive lists (a statement that became two): flatten them
        for field, old in ast.iter_fields(node):
            if isinstance(old, list):
                new = []
                for item in old:
                    if isinstance(item, ast.AST):
                        item = self.visit(item)
                        if item is None:
                            continue
                        if isinstance(item, list):
                            new.extend(item)
                            continue
                    new.append(item)
                old[:] = new
            elif isinstance(old, ast.AST):
                setattr(node, field, self.visit(old))
        return node


# --------------------------------------------------------------------------------------------------
# Checked variants of kernels and signatures


@dataclasses.dataclass(frozen=True)
class CheckedKernel:
    """A kernel's checked variant and the accesses it guards (record site k is ``sites[k - 1]``)."""

    kernel: Any  # a Warp kernel with one more parameter, the violation record
    sites: tuple[Site, ...]


_VARIANTS: dict[int, tuple[Any, CheckedKernel]] = {}
_VARIANTS_LOCK = threading.RLock()


def checked_kernel(kernel) -> CheckedKernel:
    """The checked variant of ``kernel``, built once, in a Warp module of its own (so that building it does
    not make Warp rebuild the module of the original kernel)."""
    cached = _VARIANTS.get(id(kernel))
    if cached is not None and cached[0] is kernel:
        return cached[1]
    with _VARIANTS_LOCK:
        cached = _VARIANTS.get(id(kernel))
        if cached is None or cached[0] is not kernel:
            cached = _VARIANTS[id(kernel)] = (kernel, _build(kernel))
    return cached[1]


def _build(kernel) -> CheckedKernel:
    func = kernel.func
    arrays, zeros = {}, {}
    for arg in kernel.adj.args:
        if wp.types.is_array(arg.type):
            zero_name = f"_warpnn_zero_{arg.label}"
            arrays[arg.label] = (arg.type.ndim, zero_name)
            zeros[zero_name] = _zero_of(arg.type.dtype)
    guard = _IndexGuard(kernel.key, arrays, kernel.adj.fun_lineno or 1, func.__globals__)
    guard.structs = {arg.label for arg in kernel.adj.args if isinstance(arg.type, Struct)}

    # A copy of the Python function with the record as its last parameter, and a scope that adds the names the
    # transformed body uses (this module, each array's zero). Warp reads parameters from the signature and
    # annotations, the body from the source, transformed by the guard.
    scope = {**func.__globals__, _HELPERS: sys.modules[__name__], **zeros}
    variant = types.FunctionType(func.__code__, scope, func.__name__, func.__defaults__, func.__closure__)
    record_type = wp.array(dtype=wp.int32)
    variant.__annotations__ = {**func.__annotations__, RECORD_NAME: record_type}
    signature = inspect.signature(func)
    variant.__signature__ = signature.replace(parameters=[
        *signature.parameters.values(),
        inspect.Parameter(RECORD_NAME, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=record_type),
    ])
    variant.__qualname__, variant.__module__ = func.__qualname__, func.__module__
    # Warp's module hash covers the kernel's source, not what a code transformer made of it: name the module
    # after this file's contents, so that a changed transform never loads a stale cached build.
    checked = twin_of(kernel, f"warpnn_checked_{_TRANSFORM_VERSION}", key=f"{kernel.key}__checked", func=variant,
                      code_transformers=[guard])
    if guard.unguarded:
        warnings.warn(
            f"warpnn checked mode: kernel '{kernel.key}' has array accesses checked mode does not guard (arrays "
            f"handed to Warp functions, arrays in structs: {'; '.join(guard.unguarded)}). Out-of-range indices there "
            "are not caught.",
            RuntimeWarning,
            stacklevel=5,
        )
    return CheckedKernel(checked, tuple(guard.sites))


_TRANSFORM_VERSION = hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest()[:8]


def _zero_of(dtype):
    if hasattr(dtype, "_shape_"):  # vector / matrix / quaternion / transform: zero-initialised
        return wp.constant(dtype())
    return wp.constant(dtype(0))


@dataclasses.dataclass(frozen=True, eq=False)
class _CheckedSignature(KernelSignature):
    """The signature of a checked variant: the original's parameters plus the record output.

    What the kernel reads and writes is the original's (``uses``): the transformed source mentions every array
    in its checks, and the record is written only by the checks.
    """

    original: Any = None

    @property
    def key(self) -> str:
        return self.original.key

    @functools.cached_property
    def uses(self) -> dict[str, ArrayUse]:
        return {**self.original.uses, RECORD_NAME: ArrayUse(RECORD_NAME)}

    @functools.cached_property
    def kernel_has_return(self) -> bool:
        return self.original.kernel_has_return

    @functools.cached_property
    def outputs_fully_written(self) -> tuple[str, ...]:
        return ()  # a skipped store leaves its element unwritten: zero every output

    @functools.cached_property
    def thread_private_arrays(self) -> tuple[frozenset[str], frozenset[str]]:
        """The checked kernel's own (``KernelSignature``'s), with the record among the arrays it assigns: the
        record holds the launch's first violation, stored rather than added, so a CPU launch split into slices
        must not sum the slices' records (two slices' violations would add into a site that does not exist)."""
        private, assigned = KernelSignature.thread_private_arrays.func(self)
        return private - {RECORD_NAME}, assigned | {RECORD_NAME}


_SIGNATURES: dict[int, tuple[KernelSignature, KernelSignature, CheckedKernel]] = {}


def checked_signature(sig: KernelSignature) -> tuple[KernelSignature, CheckedKernel]:
    """The signature of ``sig``'s checked variant (one per signature, so the launchers register it once)."""
    cached = _SIGNATURES.get(id(sig))
    if cached is not None and cached[0] is sig:
        return cached[1], cached[2]
    with _VARIANTS_LOCK:
        cached = _SIGNATURES.get(id(sig))
        if cached is None or cached[0] is not sig:
            variant = checked_kernel(sig.kernel)
            record = _arg_spec(RECORD_NAME, wp.array(dtype=wp.int32), variant.kernel.key)
            fields = {f.name: getattr(sig, f.name) for f in dataclasses.fields(sig)}
            fields.update(kernel=variant.kernel, outputs=(*sig.outputs, record), original=sig)
            cached = _SIGNATURES[id(sig)] = (sig, _CheckedSignature(**fields), variant)
    return cached[1], cached[2]


# --------------------------------------------------------------------------------------------------
# The call


def call(plan, arrays, differentiable_call) -> tuple[jax.Array, ...]:
    """Run ``plan`` (a ``_bridge._CallPlan``) with the checked variant; raise on a recorded violation."""
    sig, variant = checked_signature(plan.sig)
    checked_plan = dataclasses.replace(plan, sig=sig, output_shapes=(*plan.output_shapes, (RECORD_LEN,)))
    *outputs, record = differentiable_call(checked_plan, *arrays)
    raise_on_violation(record, variant, plan.sig.key)
    return tuple(outputs)


def raise_on_violation(record, variant: CheckedKernel, key: str) -> None:
    """Raise :class:`KernelIndexError` if ``record`` holds a violation: now for a concrete record, when the
    computation runs for a traced one (under ``jit`` JAX re-raises it at the call as a runtime error)."""
    if isinstance(record, jax.core.Tracer):
        jax.debug.callback(functools.partial(_check_record, variant, key), record)
    else:
        _check_record(variant, key, record)


def _check_record(variant: CheckedKernel, key: str, record) -> None:
    message = violation_message(variant, key, np.asarray(record))
    if message is not None:
        raise KernelIndexError(message)


def violation_message(variant: CheckedKernel, key: str, record: np.ndarray) -> str | None:
    """The error for a nonzero record (one record per launch: a vmapped call has one per batch element)."""
    rows = np.asarray(record).reshape(-1, RECORD_LEN)
    hit = np.flatnonzero(rows[:, 0])
    if hit.size == 0:
        return None
    row = rows[hit[0]]
    site = variant.sites[int(row[1]) - 1]
    ndim = int(row[2])
    extents = tuple(int(n) for n in row[4 : 4 + ndim])
    lo, hi = row[8:16:2].astype(np.int64) & 0xFFFFFFFF, row[9:16:2].astype(np.int64)
    index = tuple(int(v) for v in ((hi << 32) | lo)[:ndim])
    where = f" (through its view '{site.via}')" if site.via else ""
    batch = f" in vmap batch element {int(hit[0])}" if rows.shape[0] > 1 else ""
    return (
        f"warpnn checked mode: kernel '{key}' indexed array '{site.array}'{where} out of range{batch}: {site.kind} "
        f"at index {index[0] if ndim == 1 else index}, but its shape is {extents[0] if ndim == 1 else extents} "
        f"(valid: -n <= i < n; line {site.line} of {variant.kernel.adj.filename}). The access was skipped, so the "
        "call's results are not valid. Check the index arrays, launch_dims and output_dims of this call."
    )
