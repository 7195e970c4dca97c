"""What a Warp kernel reads and writes: the one source of access facts behind every decision warpnn makes.

Which inputs a kernel would write (refused: XLA owns them), which outputs to zero, which results are in-out,
what an adjoint may assume, which launches a trace must record: all come from ``analyse_array_uses``.

Two analyses meet here. warpnn's walk of the kernel's source (``_UseCollector``) places every access (kind, line,
element, loops, the ``@wp.func`` it happens in), which the twins and the in-place checks need. Warp's own code
generator (``codegen_access``) computes which parameters a kernel reads and writes through views, ``@wp.func``
calls and atomics when it builds the adjoint with ``verify_autograd_array_access``. Where Warp finds a write or a
read the walk does not place, the walk is incomplete for that array: it is *undecided* (treated as read and
written, never differentiated in place), so a construct the walk does not know can only make warpnn more careful.
Warp's facts alone are not enough either: its read tracking drops reads on the left of a binary operator
(``x[i] * 2.0``) and it does not mark tile loads and stores, which the walk does.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import itertools
import re
import threading
import warnings
from typing import Any

import warp as wp

from . import _warp_compat as wc

_ACCUMULATE_BUILTINS = {"atomic_add", "atomic_sub", "tile_atomic_add", "tile_atomic_add_indexed"}  # adjoints read, never write, the array
_READ_WRITE_BUILTINS = {"atomic_min", "atomic_max", "atomic_exch", "atomic_cas", "atomic_and", "atomic_or", "atomic_xor"}
_STORE_BUILTINS = {"tile_store", "tile_store_indexed", "array_store"}


def _builtin_write_kind(name: str) -> str | None:
    """How a Warp builtin called with an array as its first argument changes it ("accumulate", "read-write",
    "store"), or None when it only reads it.

    Warp marks every builtin with a side effect ``skip_replay`` (its adjoint kernel must not run it again); one of
    those that is not on warpnn's lists is taken as a read-write of its array: the most careful reading.
    """
    if name in _ACCUMULATE_BUILTINS:
        return "accumulate"
    if name in _READ_WRITE_BUILTINS:
        return "read-write"
    if name in _STORE_BUILTINS:
        return "store"
    fn = _warp_builtins().get(name)
    if fn is not None and getattr(fn, "skip_replay", False):
        return "read-write"
    return None


def _warp_builtins() -> dict:
    from warp._src import context

    return context.builtin_functions
_NO_ACCESS_BUILTINS = {"len", "tid", "static"}
_NO_ACCESS_ATTRIBUTES = {"shape", "ndim", "strides", "size", "dtype"}


@dataclasses.dataclass(frozen=True)
class Access:
    """One access of an array parameter in a kernel's source."""

    kind: str  # "read" | "store" | "accumulate" | "read-write" (an atomic that returns and replaces)
    line: int  # source line in the kernel (for a call into a @wp.func: the line of the call)
    order: int  # program order (for a call into a @wp.func: the order within that call)
    own_element: bool  # indexed exactly by the thread's wp.tid() coordinates
    top_level: bool  # not under an `if`, a loop or inside a @wp.func
    loops: tuple[int, ...]  # the loops (by id) around it
    via: str | None = None  # the @wp.func it happens in, if any


@dataclasses.dataclass(frozen=True)
class ArrayUse:
    """How a kernel uses one array parameter: every access found in its source and the functions it calls."""

    name: str
    accesses: tuple[Access, ...] = ()
    undecided: str | None = None  # why the analysis could not tell (then assume it is read and written)
    viewed: bool = False  # the kernel takes a row view of it (`r = a[i]` on a 2-D array)
    # Where its adjoint's shape or pointer is reset: `a.shape` read inside a @wp.func after an access of `a`, or
    # `a.ptr` anywhere ("line 12: '.shape' inside @wp.func 'west'"); None if nowhere.
    adjoint_reset: str | None = None
    # A launch-time proof (the launch tracer's, _owned.py) that no thread touches an element another thread of the
    # launch writes, and that each thread reads an element it writes only before its writes or, with
    # replay_outputs, only after its one write (the adjoint then replays on the array's values after the launch,
    # which are what those reads saw): for a twin launched only there.
    elements_owned: bool = False
    replay_outputs: bool = False

    @property
    def reads(self) -> bool:
        return self.undecided is not None or any(a.kind in ("read", "read-write") for a in self.accesses)

    @property
    def writes(self) -> bool:
        return self.undecided is not None or any(a.kind != "read" for a in self.accesses)

    @property
    def written_in_function(self) -> Access | None:
        """The first write inside a ``@wp.func`` (the adjoint replays the call, so its writes happen again), or
        None; an undecided array may be written anywhere."""
        return next((a for a in self.accesses if a.via is not None and a.kind != "read"), None)

    @property
    def stores(self) -> bool:
        return any(a.kind in ("store", "read-write") for a in self.accesses)

    def first(self, *kinds: str) -> Access | None:
        return next((a for a in self.accesses if a.kind in kinds), None)

    @property
    def may_store_twice(self) -> bool:
        """Whether one thread may store to the same element twice (two stores, or a store in a loop)."""
        stores = [a for a in self.accesses if a.kind in ("store", "read-write")]
        return len(stores) > 1 or any(a.loops for a in stores)

    def in_place_problem(self) -> str | None:
        """Why Warp's adjoint cannot differentiate this array as read *and* written by one launch, or None.

        The adjoint replays the kernel against the values the array had before the launch (the launchers pass
        them, and alias the array's gradient so Warp zeroes a stored element's adjoint as ``wp.Tape`` does). That
        is the forward's view only if no thread reads a value any thread wrote in the same launch: every access
        at the thread's own element, every read before every write, and no loop that both reads and writes.
        """
        if self.undecided is not None:
            return f"warpnn cannot tell how the kernel uses it ({self.undecided})"
        if not (self.reads and self.writes):
            return None
        if any(a.kind == "read-write" for a in self.accesses):
            a = self.first("read-write")
            return f"it is updated by an atomic that also reads it (line {a.line})"
        if self.elements_owned:
            # (the proof checked the elements and the order, thread by thread, static loops unrolled; an access
            # through a @wp.func it cannot follow is in a side of an `if` it showed no thread takes)
            return None
        stray = next((a for a in self.accesses if not a.own_element), None)
        if stray is not None:
            where = f" inside @wp.func '{stray.via}'" if stray.via else ""
            return (f"it is both read and written, and line {stray.line}{where} touches an element other than the "
                    "thread's own wp.tid() index, so a thread may read what another thread wrote")
        last_read = max(a.order for a in self.accesses if a.kind == "read")
        first_write = min(a.order for a in self.accesses if a.kind != "read")
        if last_read > first_write:
            read = max((a for a in self.accesses if a.kind == "read"), key=lambda a: a.order)
            return f"line {read.line} reads it after the kernel wrote it, so the adjoint would replay a different value"
        for loop in {l for a in self.accesses for l in a.loops}:
            kinds = {a.kind for a in self.accesses if loop in a.loops}
            if "read" in kinds and kinds - {"read"}:
                return "a loop both reads and writes it"
        return None


def _callee_name(func: ast.AST) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


class _UseCollector:
    """Walks a kernel's (or @wp.func's) AST and records the accesses of its array parameters."""

    def __init__(self, fn_globals: dict, arrays: dict[str, tuple[str, int]], tid_vars=None, call=None, depth=0,
                 counter=None, line_offset=0, structs=None, struct_arrays=None):
        self.globals = fn_globals
        self.structs: dict[str, str] = dict(structs or {})  # local name -> struct parameter path ("s", "s.inner")
        self.struct_arrays: dict[str, int] = struct_arrays or {}  # "s.x" -> ndim, for every array in a struct
        self.counter = counter if counter is not None else itertools.count()
        self.line_offset = line_offset  # kernel source line numbers -> file line numbers
        self.env = dict(arrays)  # local name -> (kernel parameter, array ndim)
        self.tid_vars: list[str] | None = tid_vars
        self.call = call  # (line, position, loops, function name) of the call into this @wp.func, if any
        self.depth = depth
        self.found: dict[str, list[Access]] = {p: [] for p, _ in arrays.values()}
        self.undecided: dict[str, str] = {}
        self.views: set[str] = set()  # parameters the body takes row views of
        self.measured: dict[str, tuple[int, str]] = {}  # parameter -> (order, where) of a measurement that resets
        self.loops: list[int] = []
        self.conditional = 0

    # -- recording

    def _record(self, param: str, kind: str, node: ast.AST, index: list[ast.AST] | None, ndim: int):
        if self.call is not None:  # inside a @wp.func: place the access at the call
            line, loops, via = self.call
            own, top = False, False
            loops = (*loops, *self.loops)
        else:
            line, via = node.lineno + self.line_offset, None
            own = index is not None and self.tid_vars is not None and len(index) == ndim == len(self.tid_vars) and [
                getattr(i, "id", None) for i in index] == self.tid_vars
            top, loops = not self.conditional and not self.loops, tuple(self.loops)
        self.found.setdefault(param, []).append(Access(kind, line, next(self.counter), own, top, loops, via))

    def _undecide(self, param: str, reason: str):
        self.undecided.setdefault(param, reason)

    def _array_of(self, node: ast.AST):
        """(parameter, ndim, indices) if ``node`` is an array parameter (or alias) or a subscript of one."""
        indices: list[ast.AST] = []
        while isinstance(node, ast.Subscript):
            s = node.slice
            indices = [*(s.elts if isinstance(s, ast.Tuple) else [s]), *indices]
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.env:
            param, ndim = self.env[node.id]
            return param, ndim, indices
        path = self._struct_path(node)
        if path is not None and path in self.struct_arrays:
            return path, self.struct_arrays[path], indices
        return None

    def _struct_path(self, node: ast.AST) -> str | None:
        """``"s.inner.w"`` for ``s.inner.w`` where ``s`` names a struct parameter (or a struct within one)."""
        attrs = []
        while isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.structs:
            return ".".join([self.structs[node.id], *reversed(attrs)])
        return None

    def _struct_arrays_under(self, path: str) -> list[str]:
        return [a for a in self.struct_arrays if a.startswith(path + ".")]

    # -- statements

    def body(self, stmts):
        for stmt in stmts:
            self.stmt(stmt)

    def stmt(self, node: ast.stmt):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            if value is None:
                return
            if (isinstance(value, ast.Call) and _callee_name(value.func) == "tid" and self.tid_vars is None
                    and len(targets) == 1):
                names = targets[0].elts if isinstance(targets[0], ast.Tuple) else [targets[0]]
                if all(isinstance(n, ast.Name) for n in names):
                    self.tid_vars = [n.id for n in names]
                return
            # an alias of a struct (`t = s`, `t = s.inner`), of an array (`b = a`) or a view (`row = a[i]`, 2-D a)
            if len(targets) == 1 and isinstance(targets[0], ast.Name) and self._struct_path(value) is not None \
                    and self._struct_path(value) not in self.struct_arrays:
                self.structs[targets[0].id] = self._struct_path(value)
                return
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                found = self._array_of(value)
                if found is not None and len(found[2]) < found[1]:
                    param, ndim, indices = found
                    for i in indices:
                        self.expr(i)
                    self.env[targets[0].id] = (param, ndim - len(indices))
                    if indices:
                        self.views.add(param)
                    return
            self.expr(value)
            for target in targets:
                self.target(target, "store")
        elif isinstance(node, ast.AugAssign):
            found = self._array_of(node.target)
            if found is not None:
                kind = "accumulate" if isinstance(node.op, (ast.Add, ast.Sub)) else "read-write"
                param, ndim, indices = found
                for i in indices:
                    self.expr(i)
                self._record(param, kind, node, indices[:ndim], ndim)
            elif isinstance(node.target, ast.Name) and node.target.id in self.env:
                self._undecide(self.env[node.target.id][0], f"line {node.lineno} rebinds it")
            self.expr(node.value)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Constant):
            # `if wp.static(flag):` -- Warp's tree holds the value it evaluated, and it generates only that branch
            self.body(node.body if node.test.value else node.orelse)
        elif isinstance(node, ast.If):
            self.expr(node.test)
            self.conditional += 1
            self.body(node.body)
            self.body(node.orelse)
            self.conditional -= 1
        elif isinstance(node, (ast.For, ast.While)):
            self.expr(node.iter if isinstance(node, ast.For) else node.test)
            self.loops.append(id(node))
            self.body(node.body)
            self.body(node.orelse)
            self.loops.pop()
        elif isinstance(node, ast.With):
            self.body(node.body)
        elif isinstance(node, ast.Expr):
            self.expr(node.value)
        elif isinstance(node, ast.Return):
            if node.value is not None:
                self.expr(node.value)
        elif isinstance(node, (ast.FunctionDef,)):
            self.body(node.body)
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child)

    def target(self, node: ast.AST, kind: str):
        if isinstance(node, ast.Tuple):
            for elt in node.elts:
                self.target(elt, kind)
            return
        found = self._array_of(node)
        if found is not None:
            param, ndim, indices = found
            for i in indices:
                self.expr(i)
            if not indices:
                self._undecide(param, f"line {node.lineno} rebinds it")
            else:
                self._record(param, kind, node, indices[:ndim], ndim)
        elif isinstance(node, ast.Subscript):  # v[0] = ... on a local vector
            self.expr(node.slice)
        elif isinstance(node, ast.Attribute):
            self.expr(node.value)

    # -- expressions

    def expr(self, node: ast.AST):
        if node is None:
            return
        found = self._array_of(node) if isinstance(node, (ast.Subscript, ast.Name, ast.Attribute)) else None
        if found is not None:
            param, ndim, indices = found
            for i in indices:
                self.expr(i)
            self._record(param, "read", node, indices[:ndim] if indices else None, ndim)
            return
        if isinstance(node, ast.Attribute):
            inner = self._array_of(node.value) if isinstance(node.value, (ast.Name, ast.Attribute)) else None
            if inner is not None and (node.attr == "ptr" or node.attr == "shape" and self.call is not None):
                # Warp's adjoint of `a.shape` assigns the shape of a's adjoint (and of `a.ptr` its pointer): the
                # kernel's own measurements are hoisted by a twin (_measured.py), a @wp.func's cannot be
                line, loops, via = self.call or (node.lineno + self.line_offset, (), None)
                where = f"line {line}: '.{node.attr}'" + (f" inside @wp.func '{via}'" if via else "")
                # in a loop, a later iteration's measurement follows an earlier iteration's accesses
                order = -1 if loops or self.loops or node.attr == "ptr" else next(self.counter)
                self.measured.setdefault(inner[0], (order, where))
            if inner is not None and node.attr in _NO_ACCESS_ATTRIBUTES | {"ptr"}:
                return
            if self._struct_path(node) is not None:  # a scalar field, or a struct passed on: no array access
                return
            self.expr(node.value)
            return
        if isinstance(node, ast.Call):
            self.call_expr(node)
            return
        for child in ast.iter_child_nodes(node):
            self.expr(child)

    def _resolve(self, func: ast.AST):
        """The Warp function a call names, or None; ``wp.x`` / ``warp.x`` name builtins."""
        if isinstance(func, ast.Name) and getattr(func, "warp_func", None) is not None:
            return func.warp_func  # `wp.static(table[i])(...)`: the function Warp resolved, kept on its tree's node
        if isinstance(func, ast.Name):
            return self.globals.get(func.id, getattr(builtins_module, func.id, None))
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = self.globals.get(func.value.id)
            return getattr(base, func.attr, None) if base is not None else None
        return None

    def call_expr(self, node: ast.Call):
        name = _callee_name(node.func)
        args = list(node.args)
        array_args = [(k, self._array_of(a)) for k, a in enumerate(args)]
        # whole arrays and views (`acc[w]` of a 2-D `acc`) passed: the callee may read or write through either
        array_args = [(k, f) for k, f in array_args if f is not None and len(f[2]) < f[1]]
        for _, (_, _, view) in array_args:
            for i in view:
                self.expr(i)
        struct_args = [(k, self._struct_path(a)) for k, a in enumerate(args)]
        struct_args = [(k, p) for k, p in struct_args if p is not None and p not in self.struct_arrays]
        if name in _NO_ACCESS_BUILTINS and isinstance(node.func, (ast.Name, ast.Attribute)):
            for a in args:
                if self._array_of(a) is None:
                    self.expr(a)
            return
        target = self._resolve(node.func)
        is_warp_function = target is not None and hasattr(target, "is_builtin")
        if struct_args and not (is_warp_function and not target.is_builtin()):
            for _, path in struct_args:
                for leaf in self._struct_arrays_under(path):
                    self._undecide(leaf, f"line {node.lineno} passes its struct to '{ast.unparse(node.func)}'")
        if (array_args or struct_args) and is_warp_function and not target.is_builtin():
            self._call_user_function(node, target, array_args, struct_args)
        elif array_args and (is_warp_function or (target is None and isinstance(node.func, ast.Attribute))):
            kind = _builtin_write_kind(name or "") or "read"
            for k, (param, ndim, view) in array_args:
                if view:
                    self.views.add(param)
                if k == 0 and kind != "read":
                    # an atomic's element: the view's indices, then the call's (wp.atomic_add(acc[w], j, v))
                    index = [*view, *args[1 : 1 + ndim - len(view)]] if name.startswith("atomic") else None
                    self._record(param, kind, node, index, ndim)
                else:
                    self._record(param, "read", node, None, ndim)
        elif array_args:
            for _, (param, _, _) in array_args:
                self._undecide(param, f"line {node.lineno} passes it to '{ast.unparse(node.func)}', which is not a Warp function")
        passed = {k for k, _ in array_args} | {k for k, _ in struct_args}
        for k, a in enumerate(args):
            if k not in passed:
                self.expr(a)
        for kw in node.keywords:
            found = self._array_of(kw.value)
            if found is not None and len(found[2]) < found[1]:
                self._undecide(found[0], f"line {node.lineno} passes it by keyword to '{ast.unparse(node.func)}'")
            else:
                self.expr(kw.value)

    def _call_user_function(self, node: ast.Call, fn, array_args, struct_args=()):
        adj = getattr(fn, "adj", None)
        tree = getattr(adj, "tree", None)
        if tree is None or self.depth > 16 or getattr(fn, "native_snippet", None) or getattr(fn, "custom_grad_func", None):
            for _, (param, _, _) in array_args:
                self._undecide(param, f"line {node.lineno} passes it to @wp.func '{fn.key}', whose body warpnn cannot read")
            for _, path in struct_args:
                for leaf in self._struct_arrays_under(path):
                    self._undecide(leaf, f"line {node.lineno} passes its struct to @wp.func '{fn.key}', whose body warpnn cannot read")
            return
        labels = [a.label for a in adj.args]
        arrays = {}
        for k, (param, ndim, view) in array_args:
            if k < len(labels):
                arrays[labels[k]] = (param, ndim - len(view))
            if view:
                self.views.add(param)
        # accesses inside the function are placed at the outermost call in the kernel
        structs = {labels[k]: path for k, path in struct_args if k < len(labels)}
        call = self.call or (node.lineno + self.line_offset, tuple(self.loops), fn.key)
        inner = _UseCollector(_names_visible_to(fn.func), arrays, tid_vars=None, call=call, depth=self.depth + 1,
                              counter=self.counter, structs=structs, struct_arrays=self.struct_arrays)
        inner.loops = []
        inner.body(_function_def(tree).body)
        for param, accesses in inner.found.items():
            self.found.setdefault(param, []).extend(accesses)
        for param, reason in inner.undecided.items():
            self._undecide(param, reason)
        for param, measured in inner.measured.items():
            self.measured.setdefault(param, measured)
        self.views |= inner.views


import builtins as builtins_module  # noqa: E402 - only for resolving `len`, `range`, ... in kernels


def _names_visible_to(fn) -> dict:
    """The globals of a Python function plus its closure (kernels and @wp.func's defined inside functions)."""
    names = dict(getattr(fn, "__globals__", {}))
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars if code else (), cells):
        try:
            names[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return names


def _function_def(tree: ast.AST) -> ast.FunctionDef:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))


def values_only_refill_integer_arrays(tree: ast.AST, name: str, integer_arrays: frozenset[str]) -> bool:
    """Whether every value the kernel reads from the array ``name`` goes, through operators only, straight into a
    store to an element of ``integer_arrays`` (``flags[w] = flags[w] | BIT``), and the array is used nowhere
    else (no view, no call, no condition, no index, no variable).

    Then what Warp's adjoint replays for it does not matter: the replay skips stores, and nothing it
    differentiates reads those values. An integer array read after the launch wrote it (mujoco_warp's
    ``overflow`` flags) is no reason to refuse reverse mode.
    """
    function = _function_def(tree)
    parents = parents_of(function)
    operators = (ast.BinOp, ast.UnaryOp, ast.BoolOp)
    for node in ast.walk(function):
        if not (isinstance(node, ast.Name) and node.id == name):
            continue
        element = parents.get(node)
        if not (isinstance(element, ast.Subscript) and element.value is node):
            return False
        statement = parents.get(element)
        if isinstance(element.ctx, ast.Store) and isinstance(statement, (ast.Assign, ast.AugAssign)) \
                and element in (statement.targets if isinstance(statement, ast.Assign) else [statement.target]):
            continue  # a store to it (`+=`: its read goes into that same store)
        child = element
        while isinstance(statement, operators):
            child, statement = statement, parents.get(statement)
        targets = statement.targets if isinstance(statement, ast.Assign) else \
            [statement.target] if isinstance(statement, ast.AugAssign) else []
        if not (targets and statement.value is child and all(
                isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id in integer_arrays
                for t in targets)):
            return False
    return True


def analyse_array_uses(kernel, specs) -> dict[str, ArrayUse]:
    """How ``kernel`` uses each array parameter in ``specs`` (``ArgSpec`` s): warpnn's walk of its source, made
    undecided wherever Warp's code generator (``codegen_access``) finds an access the walk does not place."""
    uses = reconcile(walk_array_uses(kernel, specs), codegen_access(kernel))
    owned = _ELEMENTS_OWNED.get(id(kernel))
    if owned is not None and owned[0] is kernel:
        uses.update({n: dataclasses.replace(uses[n], elements_owned=True, replay_outputs=n in owned[2])
                     for n in owned[1] if n in uses and uses[n].undecided is None})
    return uses


# Twins (made by the launch tracer for one launch each) whose arrays' elements a launch-time proof placed:
# id(kernel) -> (kernel, names, those the adjoint replays on their values after the launch). See _owned.py.
_ELEMENTS_OWNED: dict[int, tuple[object, frozenset[str], frozenset[str]]] = {}


def declare_elements_owned(kernel, names: frozenset[str], replay_outputs: frozenset[str] = frozenset()) -> None:
    """Record that a proof placed every access of ``names`` by the twin ``kernel`` (before its facts are asked),
    and that each read of an element of ``replay_outputs`` the thread writes comes after its one write of it."""
    _ELEMENTS_OWNED[id(kernel)] = (kernel, names, replay_outputs)


def declared_elements_owned(kernel) -> tuple[frozenset[str], frozenset[str]] | None:
    """What ``declare_elements_owned`` recorded for ``kernel``: ``(names, replay_outputs)``, or None."""
    owned = _ELEMENTS_OWNED.get(id(kernel))
    return owned[1:] if owned is not None and owned[0] is kernel else None


def walk_array_uses(kernel, specs) -> dict[str, ArrayUse]:
    """warpnn's walk of ``kernel``'s source alone (``analyse_array_uses`` reconciles it with Warp's facts)."""
    arrays = {s.name: (s.name, s.warp_ndim) for s in specs if s.is_array}
    structs = {s.name: s.name for s in specs if s.is_struct}
    struct_arrays = {leaf.name: leaf.warp_ndim for s in specs if s.is_struct for leaf in s.leaves if leaf.is_array}
    names = [*arrays, *struct_arrays]
    try:
        collector = _UseCollector(_names_visible_to(kernel.func), arrays,
                                  line_offset=int(getattr(kernel.adj, "fun_lineno", 1) or 1) - 1,
                                  structs=structs, struct_arrays=struct_arrays)
        collector.body(_function_def(kernel.adj.tree).body)
    except Exception as e:  # noqa: BLE001 - no source tree, or a construct this walker does not know
        return {n: ArrayUse(n, (), f"its source could not be analysed: {type(e).__name__}: {e}") for n in names}
    def adjoint_reset(name: str) -> str | None:
        # harmful to the adjoints of accesses made before it (they run after it in the reverse pass); `.ptr`
        # (order -1) to every access's
        order, where = collector.measured.get(name, (None, None))
        if order is None:
            return None
        return where if order < 0 or any(a.order < order for a in collector.found.get(name, ())) else None

    return {n: ArrayUse(n, tuple(collector.found.get(n, ())), collector.undecided.get(n), n in collector.views,
                        adjoint_reset(n)) for n in names}


def reconcile(uses: dict[str, ArrayUse], warp_facts: dict[str, tuple[bool, bool]] | None) -> dict[str, ArrayUse]:
    """``uses`` with every array whose access Warp's code generator finds and the walk does not made undecided."""
    if warp_facts is None:
        return uses
    out = dict(uses)
    for name, (warp_reads, warp_writes) in warp_facts.items():
        use = uses.get(name)
        if use is None or use.undecided is not None:
            continue
        missed = ("writes" if warp_writes and not use.writes else "reads" if warp_reads and not use.reads else None)
        if missed is not None:
            out[name] = dataclasses.replace(use, undecided=(
                f"Warp's code generator finds that the kernel {missed} it in a way warpnn's source analysis does not "
                "place (a construct warpnn does not know)"))
    return out


# --------------------------------------------------------------------------------------------------
# Warp's own facts


@dataclasses.dataclass(frozen=True)
class CodegenFacts:
    """What Warp's code generator finds when it builds a kernel's forward and adjoint code.

    ``access``: ``{parameter: (read, written)}`` for the array parameters (None where Warp cannot generate the
    kernel: its launch then reports why). ``adjoint_problems``: why Warp's adjoint of the kernel (or of a
    ``@wp.func`` whose generated adjoint it uses) would be silently wrong, one reason per place: a dynamic loop
    (``_loop_problem``, ``_early_exit_problem``), a call Warp has no adjoint for (``_adjointless_call_problem``) or a
    ``wp.grad`` call (``_grad_call_problem``). ``equality_branches``: where that code compares floats with ``==`` or
    ``!=`` (``_equality_branch``), one place each: its adjoint is right wherever the compared values differ, and at
    equality it is the adjoint of the side taken.
    """

    access: dict[str, tuple[bool, bool]] | None
    adjoint_problems: tuple[str, ...] = ()
    equality_branches: tuple[str, ...] = ()


_CODEGEN_FACTS: dict[int, tuple[Any, CodegenFacts]] = {}
_CODEGEN_FACTS_LOCK = threading.Lock()


class _OneKernel:
    """Stands in for Warp's ``ModuleHasher`` so that a ``ModuleBuilder`` builds one kernel (and what it calls)."""

    unique_kernels: dict = {}

    def __init__(self, kernel):
        self._kernel = kernel

    def get_unique_kernels(self):
        return [self._kernel]


def warp_builds_adjoint(kernel) -> bool:
    """Whether Warp generates ``kernel``'s adjoint (``enable_backward`` of the kernel, else of its module)."""
    option = kernel.options.get("enable_backward")
    if option is None:
        option = kernel.module.options.get("enable_backward", True)
    return bool(option)


def codegen_access(kernel) -> dict[str, tuple[bool, bool]] | None:
    """``{parameter: (read, written)}`` for ``kernel``'s array parameters, as Warp's code generator finds them.

    Warp builds the kernel's forward and adjoint code (Python codegen only, nothing compiled) with
    ``verify_autograd_array_access`` on, which marks a parameter written when the kernel stores to it, updates it
    with an atomic or ``+=``, or passes it (or a view of it) to a ``@wp.func`` that does, and read likewise. Cached
    per kernel. None where Warp's code generator itself fails on the kernel (the launch will then fail in Warp).
    """
    return codegen_facts(kernel).access


def share_codegen_facts(twin, kernel) -> None:
    """Give ``twin`` (built by ``_twins.twin_of`` from ``kernel``'s own function and source, with its options)
    ``kernel``'s facts, so that Warp's code generator does not run again for the same code."""
    _CODEGEN_FACTS[id(twin)] = (twin, codegen_facts(kernel))


def codegen_facts(kernel) -> CodegenFacts:
    """Warp's facts about ``kernel`` (``CodegenFacts``), from one build of its code, cached per kernel."""
    cached = _CODEGEN_FACTS.get(id(kernel))
    if cached is not None and cached[0] is kernel:
        return cached[1]
    from warp._src import codegen, context

    watch = _AdjointWatch()
    try:
        module = kernel.module
        block_dim = module.options.get("block_dim", 256)
        options = module.resolve_options(wp.config, block_dim=block_dim) if hasattr(module, "resolve_options") \
            else dict(module.options)
        options = options | {"output_arch": None, "block_dim": block_dim, "verify_autograd_array_access": True}
        previous = codegen.options
        # Warp logs a warning for every array written after it was read; that is its business, not the user's here.
        with _CODEGEN_FACTS_LOCK, context._codegen_lock, warnings.catch_warnings(), \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
                watch.watching(codegen.Adjoint):
            warnings.simplefilter("ignore")
            try:
                context.ModuleBuilder(module, options, hasher=_OneKernel(kernel), target="cpu")
                access = {a.label: (bool(a.is_read), bool(a.is_write)) for a in kernel.adj.args
                          if wp.types.is_array(a.type)}
            finally:
                codegen.options = previous
    except Exception:  # noqa: BLE001 - Warp cannot generate the kernel: its launch reports why
        facts = CodegenFacts(None)
    else:  # (outside the try: a failure of warpnn's own walk raises, it never passes as "no problems")
        facts = CodegenFacts(access, watch.problems_reaching(kernel.adj), watch.equalities_reaching(kernel.adj))
    _CODEGEN_FACTS[id(kernel)] = (kernel, facts)
    return facts


# --------------------------------------------------------------------------------------------------
# Dynamic loops: what Warp's adjoint of a loop assumes
#
# Warp's adjoint kernel runs the forward code again before the adjoints, but not its dynamic loops: a variable a
# dynamic loop changes (Warp "materialises" it, one storage for every iteration) holds its value from *before* the
# loop in every statement after it, and inside the loop's reverse pass each iteration is replayed on whatever the
# variable holds then. A while loop's condition, evaluated again there, is false at once: its reverse pass never
# runs. Measured with wp.Tape: `s += x[i] * x[i]` then `out = wp.sqrt(s)` gives an infinite gradient, a running
# product `p = p * x[i]` a wrong one. The adjoint is right only where no adjoint depends on such a value. Warp notes
# each changed variable while generating the code (``Adjoint.materialize_redefinitions``); warpnn records them
# there and decides per loop (``_loop_problem``).


class _AdjointWatch:
    """Records, while Warp generates code, where each function's generated adjoint would be silently wrong: its
    dynamic loops (the variables they change, early exits), its calls of builtins without an adjoint and its
    ``wp.grad(f)`` calls (forward-only in Warp); and its float equality comparisons."""

    def __init__(self):
        self._problems: dict[int, list[str]] = {}  # id of a kernel's or function's Adjoint: its problems
        self._equalities: dict[int, list[str]] = {}  # likewise: its float equality comparisons
        self._loops: list[ast.AST] = []
        self._dynamic: list[bool] = []  # per loop being generated: whether Warp emits it as a dynamic loop
        self._grad_call_problems: dict[int, list[str]] = {}  # the wp.grad calls among them

    def _note(self, adj, problem: str | None) -> None:
        if problem is not None:
            self._problems.setdefault(id(adj), []).append(problem)

    def problems_reaching(self, kernel_adj) -> tuple[str, ...]:
        """The problems of the kernel's loops and of those of the ``@wp.func``s whose generated adjoint the
        kernel's adjoint runs: the functions it calls, less those with a custom gradient (``@wp.func_grad``,
        their generated adjoint is not used) and their callees reached only through them."""
        return self._reaching(kernel_adj, self._problems, self._grad_call_problems)

    def equalities_reaching(self, kernel_adj) -> tuple[str, ...]:
        """The float equality comparisons in the code whose generated adjoint the kernel's adjoint runs (the
        functions ``problems_reaching`` walks)."""
        return self._reaching(kernel_adj, self._equalities, {})

    @staticmethod
    def _reaching(kernel_adj, per_function: dict[int, list[str]], without_reverse: dict[int, list[str]]):
        found, seen, todo = [], set(), [kernel_adj]
        while todo:
            adj = todo.pop()
            if id(adj) in seen:
                continue
            if adj.skip_reverse_codegen or adj.custom_reverse_mode:
                # Warp makes no reverse call of a function that calls wp.grad, its @wp.func_grad included
                found += without_reverse.get(id(adj), [])
                continue
            seen.add(id(adj))
            found += per_function.get(id(adj), [])
            todo += [f.adj for f in getattr(adj, "called_user_functions", {}) if getattr(f, "adj", None) is not None]
        return tuple(dict.fromkeys(found))

    @contextlib.contextmanager
    def watching(self, adjoint_class):
        visitors = adjoint_class.node_visitors
        emit_for, emit_while = visitors[ast.For], visitors[ast.While]
        materialize = adjoint_class.materialize_redefinitions
        watch = self

        def on_loop(emit):
            def emit_loop(adj, node):
                watch._loops.append(node)
                watch._dynamic.append(False)
                try:
                    return emit(adj, node)
                finally:
                    watch._loops.pop()
                    if watch._dynamic.pop() and not adj.custom_reverse_mode:
                        watch._note(adj, _early_exit_problem(node, adj))
            return emit_loop

        def on_materialize(adj, symbols):
            # Warp's own test for a changed variable (materialize_redefinitions): another Var at loop exit
            changed = {sym: var.type for sym, var in symbols.items()
                       if var != adj.symbols.get(sym, var)
                       and not (adj.is_constant_iter_symbol(sym) and var.constant is not None)}
            if watch._dynamic:
                watch._dynamic[-1] = True  # (Warp materialises only a loop it does not unroll)
            if watch._loops and changed and not adj.custom_reverse_mode:
                try:
                    problem = _loop_problem(watch._loops[-1], changed, adj)
                except Exception as e:  # noqa: BLE001 - a loop warpnn cannot judge is refused, never passed
                    problem = (f"warpnn could not analyse a dynamic loop in '{adj.fun_name}' ({type(e).__name__}: "
                               f"{e}), which changes {', '.join(map(repr, sorted(changed)))}")
                watch._note(adj, problem)
            return materialize(adj, symbols)

        def on_add_call(adj, func, args, kwargs, type_args, min_outputs=None, return_value_used=True,
                        arg_nodes=None, kwarg_nodes=None, return_resolved=False):
            output, resolved, bound = add_call(adj, func, args, kwargs, type_args, min_outputs, return_value_used,
                                               arg_nodes, kwarg_nodes, return_resolved=True)
            if not adj.custom_reverse_mode:
                try:
                    values = list((bound if isinstance(bound, dict) else bound.arguments).values())
                    problem = _adjointless_call_problem(adj, resolved, values, output) \
                        or _replayless_value_problem(adj, resolved, return_value_used)
                except Exception as e:  # noqa: BLE001 - a call warpnn cannot judge is refused, never passed
                    problem = (f"warpnn could not judge the call of '{getattr(resolved, 'key', resolved)}' in "
                               f"'{adj.fun_name}' ({type(e).__name__}: {e})")
                watch._note(adj, problem)
            return (output, resolved, bound) if return_resolved else output

        def on_add_grad_call(adj, func, args, kwargs):
            if not adj.custom_reverse_mode:  # (a @wp.func_grad may call wp.grad: it is an adjoint already)
                problem = _grad_call_problem(adj, func)
                watch._note(adj, problem)
                watch._grad_call_problems.setdefault(id(adj), []).append(problem)
            return add_grad_call(adj, func, args, kwargs)

        def on_add_comp(adj, op_strings, left, comps):
            if not adj.custom_reverse_mode:
                try:
                    place = _equality_branch(adj, op_strings, [left, *comps])
                except Exception as e:  # noqa: BLE001 - a comparison warpnn cannot judge is listed, never passed
                    place = f"{_in_function(adj)[1]}{_at_statement(adj)}: a comparison ({type(e).__name__}: {e})"
                if place is not None:
                    watch._equalities.setdefault(id(adj), []).append(place)
            return add_comp(adj, op_strings, left, comps)

        add_call, add_grad_call, add_comp = adjoint_class.add_call, adjoint_class.add_grad_call, adjoint_class.add_comp
        visitors[ast.For], visitors[ast.While] = on_loop(emit_for), on_loop(emit_while)
        adjoint_class.materialize_redefinitions = on_materialize
        adjoint_class.add_call, adjoint_class.add_grad_call = on_add_call, on_add_grad_call
        adjoint_class.add_comp = on_add_comp
        try:
            yield self
        finally:
            visitors[ast.For], visitors[ast.While] = emit_for, emit_while
            adjoint_class.materialize_redefinitions = materialize
            adjoint_class.add_call, adjoint_class.add_grad_call = add_call, add_grad_call
            adjoint_class.add_comp = add_comp


# Builtins Warp marks as having no adjoint whose zero derivative is the right one (piecewise constant in their
# float arguments): calling them on differentiable values is no reason to refuse.
_PIECEWISE_CONSTANT = {"floor", "ceil", "round", "rint", "trunc", "sign", "step", "nonzero", "floordiv", "isfinite",
                       "isinf", "isnan"}


# Warp's own plumbing for references, indexing and iteration: their adjoints are generated elsewhere (an array
# read's `load` through `address`'s adjoint).
_PLUMBING = {"load", "store", "index", "indexref", "iter_next", "range", "reversed", "slice", "tuple"}


def _float_valued(value) -> bool:
    """Whether a call's argument or result holds floats a gradient could flow in (a ``Var`` of a float type, or a
    tile of floats; anything else, such as a function passed to ``tile_map``, does not)."""
    from warp._src.codegen import Var, strip_reference

    if not isinstance(value, Var):
        return False
    value_type = strip_reference(value.type)
    if wp.types.is_tile(value_type):  # (a tile type is an instance of `tile`)
        value_type = value_type.dtype
    return _carries_gradient(value_type)


def _adjointless_call_problem(adj, func, args: list, output) -> str | None:
    """Why a call makes Warp's adjoint silently wrong, or None: Warp generates no reverse call for a builtin it
    marks ``is_differentiable=False`` (``tile_cholesky_inplace``, ``tile_cholesky_solve``, ``tile_reduce``,
    ``tile_max``, ``tile_sort``, ``frac``, ``mod``, ``select``, ...) or one handed a function without an adjoint
    (``wp.tile_map(f, t)``), so a gradient through it is zero. Measured: mujoco_warp's Newton solver step
    (``tile_cholesky_solve``) gave a zero gradient where finite differences give 0.09."""
    from warp._src.context import Function

    if not func.is_builtin() or func.key in _PLUMBING:
        return None
    callable_without_adjoint = next((a for a in args if isinstance(a, Function) and not a.is_differentiable), None)
    if func.is_differentiable and callable_without_adjoint is None:
        return None
    if func.key in _PIECEWISE_CONSTANT or not any(_float_valued(a) for a in args):
        return None
    outputs = output if isinstance(output, (list, tuple)) else [output]
    changes_a_tile = func.key.endswith("_inplace") or (output is None and any(
        _float_valued(a) and wp.types.is_tile(a.type) for a in args))
    if not changes_a_tile and not any(_float_valued(o) for o in outputs):
        return None  # integer, boolean or query results: nothing to differentiate
    function, where = _in_function(adj)[1], _at_statement(adj)
    what = (f"wp.{func.key}" if callable_without_adjoint is None
            else f"wp.{func.key} with '{getattr(callable_without_adjoint, 'key', '?')}'")
    return (f"{function} calls {what}{where} on differentiable values, and Warp has no adjoint "
            "for it: the gradient through it would be zero")


# The names _recorded.py's twins give an atomic's value (the prefix, then a number), whose only use is a store into
# the twin's record; and the words of the problem such a value is otherwise.
RECORDED_VALUE_PREFIX = "wnrec_v"
ATOMIC_VALUE_PROBLEM = "uses the value wp.atomic"
_RECORDED_VALUE = re.compile(rf"\s*{RECORDED_VALUE_PREFIX}\d+\s*=")


def stores_only_into_the_record(source_line: str) -> bool:
    """Whether a statement of generated source assigns an atomic's value to one of a recording twin's names."""
    return bool(_RECORDED_VALUE.match(source_line))


def _replayless_value_problem(adj, func, return_value_used: bool) -> str | None:
    """Why using what a call returns makes Warp's adjoint silently wrong, or None: Warp's adjoint kernel runs the
    forward code again but not the atomics (``skip_replay``: their call is commented out there), so the value an
    atomic returned is not there when the statements after it are replayed (measured: ``slot =
    wp.atomic_add(count, 0, 1); out[slot] = 2.0 * x[i]`` gives d/dx = [2, 0, 0, 0] from wp.Tape, not 2 at each
    thread's own slot). mujoco_warp allocates contacts and sparse rows so."""
    if not (func.is_builtin() and func.skip_replay and return_value_used and func.key.startswith(
            ("atomic_", "tile_atomic_"))):
        return None
    lines, line = getattr(adj, "source_lines", None), getattr(adj, "lineno", None)
    if "__warpnn_recorded" in str(getattr(adj, "fun_name", "")) and isinstance(line, int) and lines \
            and 0 <= line < len(lines) and stores_only_into_the_record(lines[line]):
        return None  # (a twin that records the value for its adjoint: _recorded.py)
    return (f"{_in_function(adj)[1]} uses the value wp.{func.key} returns{_at_statement(adj)}: Warp's adjoint does "
            "not run the atomic again, so what follows it replays with another value")


def _equality_branch(adj, op_strings, operands: list) -> str | None:
    """Where a comparison compares floats with ``==`` or ``!=`` (``if d != 0.0:``, ``wp.where(y == 0.0, ...)``), as
    ``@wp.func 'name' (line N): source``; None for other comparisons.

    Off its boundary such a comparison is constant in a neighbourhood of the values, so the adjoint of the side taken
    is the derivative there. At equality it is still the side taken, which is the derivative only if the two sides
    agree to first order: mujoco_warp's ``if damping != 0.0: qfrc -= damping * qvel`` gives d/d(damping) = 0 at
    damping 0, where the derivative is -qvel (measured: 0 where central differences of mj_step give 7.7e-2). Whether
    the sides agree is beyond what the code says, so this is a fact reported (``WarpProgram.equality_branches``), and
    the refusal is made at run time, per thread, by the equality guard (``_equality_guard``)."""
    if not any(op in ("==", "!=") for op in op_strings) or not any(_float_valued(v) for v in operands):
        return None
    lines, line = getattr(adj, "source_lines", None), getattr(adj, "lineno", None)
    source = lines[line].strip() if lines and isinstance(line, int) and 0 <= line < len(lines) else "?"
    return f"{_in_function(adj)[1]}{_at_statement(adj)}: {source}"


def _grad_call_problem(adj, func) -> str:
    """``wp.grad(f)(x)`` inside a function is forward-only in Warp (``Adjoint.add_grad_call``): no gradient flows
    through it, and a ``@wp.func`` that makes one gets no reverse call at all. Measured with wp.Tape: the gradient of
    ``wp.grad(f)(x)[0]`` for ``f(d) = 1 / (|d| + 0.1)`` was 0 where central differences give 0.76 (warp.examples'
    particle repulsion computes its forces so)."""
    function, where = _in_function(adj)[1], _at_statement(adj)
    return (f"{function} calls wp.grad({getattr(func, 'key', func)}){where}: Warp's adjoint does not differentiate "
            "a gradient call (it is forward-only), so the gradient through it would be zero")


def _in_function(adj) -> tuple[int, str]:
    """``(offset, name)`` for problems found in the function ``adj`` builds: the offset turns a line of its parsed
    source into a line of its file; the name is ``'<kernel>'`` or ``@wp.func '<name>'``."""
    offset = int(getattr(adj, "fun_lineno", 1) or 1) - 1
    kind = "@wp.func " if getattr(adj, "is_user_function", False) else ""
    return offset, f"{kind}'{adj.fun_name}'"


def _at_statement(adj) -> str:
    """`` (line N)`` for the statement Warp is generating in ``adj``'s function (its file's line), or ``""``."""
    line = getattr(adj, "lineno", None)  # (0-based, one below the parsed source's)
    return f" (line {_in_function(adj)[0] + 1 + line})" if isinstance(line, int) else ""


def _early_exit_problem(loop: ast.AST, adj) -> str | None:
    """Why Warp's adjoint of the dynamic ``loop`` is wrong if an iteration can leave it early: measured with wp.Tape,
    an iteration that leaves by ``continue`` or ``break`` gets no adjoint for what it did before (the gradient of
    ``if c: s += x * x; continue`` is lost), and after a ``return`` the reverse pass still runs the iterations the
    forward never reached. A constant-range loop with ``continue`` that Warp unrolls is right."""
    def exits_of(node: ast.AST) -> list[ast.stmt]:  # this loop's breaks and continues, not those of inner loops
        if isinstance(node, (ast.Break, ast.Continue)):
            return [node]
        return [e for child in ast.iter_child_nodes(node) if not isinstance(child, (ast.For, ast.While))
                for e in exits_of(child)]

    # (a `return` anywhere in the loop leaves it too: the reverse pass then runs iterations the forward never did)
    returns = [n for statement in loop.body for n in ast.walk(statement) if isinstance(n, ast.Return)]
    exits = [e for statement in loop.body for e in exits_of(statement)] + returns
    if not exits:
        return None
    offset, function = _in_function(adj)
    kind = "while loop" if isinstance(loop, ast.While) else "dynamic for loop"
    first = min(exits, key=lambda n: n.lineno)
    return (f"the {kind} at line {offset + loop.lineno} in {function} leaves an iteration early "
            f"(`{ast.unparse(first)}`, line {offset + first.lineno}): Warp's adjoint of such an iteration loses the "
            "adjoints of what it did before leaving")


def _loop_problem(loop: ast.AST, changed: dict[str, Any], adj) -> str | None:
    """Why Warp's adjoint of ``loop`` (a dynamic ``for`` or a ``while`` of the function ``adj`` builds) would be
    wrong, given the variables it changes and their Warp types, or None when it is right.

    Right means, for a ``for`` loop: in the body, each changed variable is read only after an assignment earlier
    in a block that holds the read (a value of the same iteration, which the adjoint's replay of the iteration
    computes again) or as the running value of its own sum (``v += e``, ``v = v + e``, ``v -= e``, every
    assignment of it in that form: the adjoint of an addition does not depend on the running value); after the
    loop, each changed variable only flows, through additions, into an array store, ``+=`` into an array,
    ``wp.atomic_add``/``atomic_sub`` or a ``return`` (adjoints that do not depend on its value). Measured with
    wp.Tape against pure JAX on each form. For a ``while`` loop, whose reverse pass never runs: no changed float
    variable, no array written or ``@wp.func`` called in it, no changed variable read after it.
    """
    offset, function = _in_function(adj)
    where = f"line {offset + loop.lineno}"
    arrays = {a.label for a in getattr(adj, "args", ()) if wp.types.is_array(a.type)}
    try:
        function_def = _function_def(adj.tree)
        parents = parents_of(function_def)
        outside = _loads_outside(function_def, loop, parents)
    except Exception:  # noqa: BLE001 - no tree: nothing can be shown
        return f"the loop at {where} in {function} changes {', '.join(map(repr, sorted(changed)))}"
    if isinstance(loop, ast.While):
        carried = sorted(sym for sym, t in changed.items() if _carries_gradient(t))
        effect = _side_effect(loop, adj, offset)
        read_after = next((n for n in outside if n.id in changed), None)
        if carried:
            what = f"carries {', '.join(map(repr, carried))}"
        elif effect is not None:
            what = effect
        elif read_after is not None:
            what = f"changes {read_after.id!r}, read after it (line {offset + read_after.lineno})"
        else:
            return None
        return (f"the while loop at {where} in {function} {what}: Warp's adjoint does not run a while loop again before "
                "its reverse pass, so the loop's reverse pass never runs and the values after it are those from "
                "before it")
    for sym in sorted(changed):
        how = _how_changed(loop, sym, offset)
        if how is None:
            read = next((n for n in outside if n.id == sym and not _flows_into_a_stored_sum(n, parents, arrays)),
                        None)
            if read is not None:
                how = f"and line {offset + read.lineno} uses its value after the loop"
        if how is not None:
            return (f"the dynamic for loop at {where} in {function} changes {sym!r} {how}: Warp's adjoint does not run "
                    "dynamic loops again before their adjoints, so it would see the value from before the loop")
    return None


def _carries_gradient(warp_type) -> bool:
    """Whether a variable of ``warp_type`` can carry a gradient (anything but integers, booleans and queries)."""
    if warp_type is bool or warp_type in wc.int_types or "Query" in getattr(warp_type, "__name__", ""):
        return False
    try:
        return wc.type_scalar_type(warp_type) in wc.float_types
    except Exception:  # noqa: BLE001 - a struct or another type without one scalar type: assume it can
        return True


def parents_of(*roots: ast.AST) -> dict[ast.AST, ast.AST]:
    """Every node under ``roots`` mapped to the node that contains it (AST nodes hash by identity)."""
    return {child: node for root in roots for node in ast.walk(root) for child in ast.iter_child_nodes(node)}


def _loads_outside(function: ast.FunctionDef, loop: ast.AST, parents: dict[ast.AST, ast.AST]) -> list[ast.Name]:
    """Loads of names in ``function`` outside ``loop`` that may run after it: all of them, less those before it
    when it is not inside another loop (they run once, before it)."""
    inside = {id(n) for n in ast.walk(loop)}
    node, nested = loop, False
    while node in parents:
        node = parents[node]
        nested = nested or isinstance(node, (ast.For, ast.While))
    augmented = {id(n.target) for n in ast.walk(function) if isinstance(n, ast.AugAssign)}  # `v /= m` reads v
    return [n for n in ast.walk(function) if isinstance(n, ast.Name)
            and (isinstance(n.ctx, ast.Load) or id(n) in augmented)
            and id(n) not in inside and (nested or n.lineno >= loop.lineno)]


def _flows_into_a_stored_sum(name: ast.Name, parents: dict[ast.AST, ast.AST], arrays: set[str]) -> bool:
    """Whether ``name`` is a term of a sum (``+``, ``-``) that is stored to an array element, added into one
    (``a[i] += ...``, ``wp.atomic_add``/``atomic_sub``) or returned: adjoints that do not depend on its value."""
    node: ast.AST = name
    parent = parents.get(node)
    while isinstance(parent, ast.BinOp) and isinstance(parent.op, (ast.Add, ast.Sub)) or \
            isinstance(parent, ast.UnaryOp) and isinstance(parent.op, (ast.USub, ast.UAdd)):
        node, parent = parent, parents.get(parent)

    def array_element(target: ast.AST) -> bool:
        return isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id in arrays

    if isinstance(parent, ast.Return):
        return True
    if isinstance(parent, (ast.Assign, ast.AugAssign)) and parent.value is node:
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        return all(array_element(t) for t in targets)
    if isinstance(parent, ast.Call) and _callee_name(parent.func) in ("atomic_add", "atomic_sub") \
            and len(parent.args) >= 3 and parent.args[-1] is node and isinstance(parent.args[0], ast.Name) \
            and parent.args[0].id in arrays:
        return True
    return False


def _side_effect(loop: ast.AST, adj, offset: int) -> str | None:
    """The first statement in ``loop`` that writes an array or calls a ``@wp.func``, as a phrase, or None."""
    from warp._src.context import Function

    scope = _names_visible_to(adj.func) if getattr(adj, "func", None) is not None else {}
    for node in ast.walk(loop):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, (ast.Subscript, ast.Attribute)) for t in targets):
                return f"writes an element (line {offset + node.lineno})"
        if isinstance(node, ast.Call):
            name = _callee_name(node.func)
            if name is not None and _builtin_write_kind(name) is not None:
                return f"calls wp.{name} (line {offset + node.lineno})"
            callee = scope.get(name) if isinstance(node.func, ast.Name) else None
            if isinstance(callee, Function) and not callee.is_builtin():
                return f"calls @wp.func '{name}' (line {offset + node.lineno})"
    return None


def _how_changed(loop: ast.AST, sym: str, offset: int) -> str | None:
    """None when each iteration of ``loop`` that Warp's adjoint replays computes with ``sym`` what the forward pass
    did: every read of it in the body follows an assignment earlier in a block that holds the read (a value of
    this iteration), is inside an inner ``for`` that sets it, or is the running value of ``sym += e`` / ``sym = sym + e``
    / ``sym -= e`` / ``sym = e + sym`` when every assignment of it in the loop has that form (the adjoint of a sum
    does not depend on its running value). Else the read, as a phrase."""
    body = ast.Module(body=list(loop.body), type_ignores=[])
    parents = parents_of(body)
    assignments, running_reads = 0, set()
    for node in ast.walk(body):
        if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == sym:
            assignments += 1
            if isinstance(node.op, (ast.Add, ast.Sub)):
                running_reads.add(id(node.target))
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and any(
                isinstance(n, ast.Name) and n.id == sym and isinstance(n.ctx, ast.Store)
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) for n in ast.walk(t)):
            assignments += 1
            value = node.value
            if isinstance(value, ast.BinOp) and isinstance(value.left, ast.Name) and value.left.id == sym \
                    and isinstance(value.op, (ast.Add, ast.Sub)):
                running_reads.add(id(value.left))
            elif isinstance(value, ast.BinOp) and isinstance(value.right, ast.Name) and value.right.id == sym \
                    and isinstance(value.op, ast.Add):
                running_reads.add(id(value.right))
    accumulates = assignments == len(running_reads)

    def set_earlier_in_its_block(node: ast.AST) -> bool:
        """Whether a statement before the read, in a block that holds it (up to the loop's body), sets ``sym``."""
        child = node
        while child in parents:
            parent = parents[child]
            for block in (getattr(parent, "body", None), getattr(parent, "orelse", None)):
                if not isinstance(block, list):
                    continue
                k = next((i for i, statement in enumerate(block) if statement is child), None)
                if k is not None and any(_assigns_name(statement, sym) for statement in block[:k]):
                    return True
            child = parent
        return False

    def set_by_inner_for(node: ast.AST) -> bool:
        while node in parents:
            node = parents[node]
            if isinstance(node, ast.For) and any(isinstance(n, ast.Name) and n.id == sym for n in ast.walk(node.target)):
                return True
        return False

    for node in ast.walk(body):
        reads = isinstance(node, ast.Name) and node.id == sym and isinstance(node.ctx, ast.Load) \
            or isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name) and node.target.id == sym
        if not reads:
            continue
        read = node.target if isinstance(node, ast.AugAssign) else node
        if set_earlier_in_its_block(node) or set_by_inner_for(node) \
                or accumulates and id(read) in running_reads:
            continue
        return f"and line {offset + node.lineno} reads the value an earlier iteration left in it"
    return None


def _assigns_name(statement: ast.stmt, sym: str) -> bool:
    """Whether ``statement`` is ``sym = ...`` (or ``sym: T = ...``): it sets ``sym`` whenever it runs."""
    if isinstance(statement, ast.Assign):
        return len(statement.targets) == 1 and isinstance(statement.targets[0], ast.Name) \
            and statement.targets[0].id == sym
    return isinstance(statement, ast.AnnAssign) and statement.value is not None \
        and isinstance(statement.target, ast.Name) and statement.target.id == sym


def _fully_written(tree: ast.AST, name: str) -> bool:
    """Whether every path through the kernel stores ``name[tid...]`` (the thread's own element) before it ends,
    and the kernel never mentions ``name`` otherwise.

    Paths: an ``if`` whose branches both store covers the paths through it; an early ``return`` must come after
    a store on its path (``if inactive: x_new[tid] = x0; return`` then ``x_new[tid] = x1``, as Newton writes
    it); a store inside a loop, or a ``return`` inside one, does not count.
    """
    fn = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), None)
    if fn is None:
        return False
    tid_at = next((k for k, stmt in enumerate(fn.body) if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                   and isinstance(stmt.value, ast.Call)
                   and getattr(stmt.value.func, "attr", getattr(stmt.value.func, "id", None)) == "tid"), None)
    if tid_at is None:
        return False
    target = fn.body[tid_at].targets[0]
    names = target.elts if isinstance(target, ast.Tuple) else [target]
    if not all(isinstance(n, ast.Name) for n in names):
        return False
    tid_vars = [n.id for n in names]
    assigned = []  # plain names bound anywhere (not names used inside subscript targets)
    for n in ast.walk(fn):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign, ast.For)) else []
        for t in targets:
            assigned += [e.id for e in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(e, ast.Name)]
    if any(assigned.count(v) != 1 for v in tid_vars):  # a reassigned tid variable no longer names this thread's element
        return False

    def is_store(stmt: ast.stmt) -> bool:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Subscript)):
            return False
        sub = stmt.targets[0]
        if not (isinstance(sub.value, ast.Name) and sub.value.id == name):
            return False
        index = sub.slice.elts if isinstance(sub.slice, ast.Tuple) else [sub.slice]
        return [getattr(i, "id", None) for i in index] == tid_vars

    stores = 0

    def covers(stmts: list[ast.stmt], stored: bool) -> str:
        """"stored": every path through ``stmts`` has stored when it leaves them; "open": some have not;
        "fail": one returns unstored."""
        nonlocal stores
        for stmt in stmts:
            if is_store(stmt):
                stores += 1
                stored = True
            elif isinstance(stmt, ast.Return):
                return "stored" if stored else "fail"  # (what follows in this block never runs)
            elif isinstance(stmt, ast.If):
                body, orelse = covers(stmt.body, stored), covers(stmt.orelse, stored)
                if "fail" in (body, orelse):
                    return "fail"
                stored = stored or body == orelse == "stored"
            elif not stored and any(isinstance(n, ast.Return) for n in ast.walk(stmt)):
                return "fail"  # a return inside a loop, before any store on its path
        return "stored" if stored else "open"

    if covers(fn.body[tid_at + 1:], False) != "stored":
        return False
    mentions = sum(isinstance(n, ast.Name) and n.id == name for n in ast.walk(fn))
    return mentions == stores
