"""Elements a launch owns, proven from the program's constants: in-place updates at computed indices.

Warp's adjoint differentiates an array a launch both reads and writes only if no thread reads an element another
thread writes (``ArrayUse.in_place_problem``). warpnn's walk proves that where every access is at the thread's own
``wp.tid()`` index. mujoco_warp updates ``qpos`` in place one joint per thread at ``jnt_qposadr[j] + k``, with
``k`` up to 7 by joint type: the elements are the thread's own, but only the model's index arrays say so.

Inside a traced program those index arrays are constants (the program reads them and nothing writes them; an
input may change per call), so the elements each thread touches are the same in every replay and can be
computed once, at trace time: a *probe*, a Warp kernel generated from the kernel's own statements that compute
the indices (top-level assignments from the thread index, scalar arguments, shapes and loads of constant
arrays) and its ``if`` structure where the conditions are of the same kind (a joint's type), records the element
of every access of the array, per thread. Where a condition depends on anything else, the probe records both
sides (a superset, still a proof); where that would make it evaluate a load the kernel may not make, or an index
needs anything else (a value assigned twice or under a branch, a loop, a ``@wp.func`` or atomic taking the array),
there is no proof and the refusal stands. The proof holds if no element a thread writes is touched by another
thread, every index is in range, and on every path through the kernel each read of the array comes before its
writes. The launch then runs a twin of the kernel (same source) whose facts say so (``_access.ArrayUse.elements_owned``),
and the tracer checks at the end of the trace that nothing wrote the index arrays.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
from typing import Any, Callable

import numpy as np
import warp as wp

from . import _access, _twins
from . import _warp_compat as wc
from ._signature import kernel_array_uses

_PREFIX = "wnowned_"
_SAFE_CALLS = {"int", "float", "bool", "min", "max", "abs", "int32", "int64", "uint32", "clamp", "where"}


class _NoProof(Exception):
    """The probe cannot place an access (the reason is for debugging; the launch keeps its refusal)."""


def prove(kernel, args: list, dims: tuple[int, ...], names: list[str], constant: Callable[[Any], bool]):
    """The arrays among ``names`` (read and written by this launch of ``kernel`` with ``args`` over ``dims``)
    whose elements each thread provably owns, and the arrays the proof read (they must stay constant)."""
    owned, read = [], []
    by_name = dict(zip((a.label for a in kernel.adj.args), args))
    constants = frozenset(_constant_params(kernel, args, constant))
    for name in names:
        if isinstance(by_name.get(name), wp.array) and by_name[name].size == 0:
            owned.append(name)  # no elements: none a thread could read after another wrote it (na = 0 actuators)
            continue
        try:
            probe = _probe(kernel, name, constants)
            read_here = _check(probe, kernel, args, dims, name)
        except _NoProof:
            continue
        except Exception:  # noqa: BLE001 - a probe Warp cannot build or run: no proof, the refusal stands
            continue
        owned.append(name)
        read += read_here
    return frozenset(owned), read


def _constant_params(kernel, args, constant) -> list[str]:
    """Array parameters the probe may load from: arrays the kernel does not write and the program keeps
    constant so far (``constant``: not an input, not written by an earlier operation)."""
    uses = kernel_array_uses(kernel)
    return [p.label for p, a in zip(kernel.adj.args, args)
            if isinstance(a, wp.array) and p.label in uses and not uses[p.label].writes and constant(a)]


@dataclasses.dataclass(frozen=True)
class _Probe:
    kernel: Any
    columns: tuple[tuple[str, int], ...]  # per access: ("read" | "write", first column), ndim columns each
    loads: frozenset[str]  # the constant arrays the probe reads


@functools.lru_cache(maxsize=256)
def _probe_cached(kernel, name: str, constants: frozenset[str]) -> _Probe | str:
    try:
        return _ProbeBuilder(kernel, name, constants).build()
    except _NoProof as e:
        return str(e)


def _probe(kernel, name: str, constants: frozenset[str]) -> _Probe:
    probe = _probe_cached(kernel, name, constants)
    if isinstance(probe, str):
        raise _NoProof(probe)
    return probe


class _ProbeBuilder:
    """The probe's source: the kernel's index computations and ``if`` skeleton, each access of ``name`` replaced
    by stores of its indices into ``wnowned_out[thread, column]``."""

    def __init__(self, kernel, name: str, constants: frozenset[str]):
        self.kernel, self.name = kernel, name
        self.fn = _access._function_def(kernel.adj.tree)
        self.globals = _access._names_visible_to(kernel.func)
        self.params = {a.label: a.type for a in kernel.adj.args}
        self.arrays = {n: t for n, t in self.params.items() if wc.matches_array_class(t, wp.array)}
        self.scalars = {n for n, t in self.params.items() if wp.types.type_is_scalar(t) or t in (wp.bool, int, float, bool)}
        self.constants = constants
        self.ndim = self.arrays[name].ndim if name in self.arrays else None
        self.assigned = _assignment_counts(self.fn)
        self.known: set[str] = set()  # top-level names whose values the probe computes as the kernel does
        self.views: dict[str, list[str]] = {}  # row views of the array: name -> the probe's names of its indices
        self.loads: set[str] = set()
        self.columns: list[tuple[str, int]] = []
        self.width = 0
        self.order: list[tuple[str, tuple]] = []  # (kind, path) in program order
        self.counter = itertools.count()
        self.tid: list[str] = []
        self.after_return = False  # a return seen: loads after it may be ones the kernel's thread never makes

    # -- expressions

    def _is_known(self, e: ast.AST, loads: bool) -> bool:
        """Whether the probe computes ``e`` as the kernel does (``loads``: may it load from constant arrays)."""
        if isinstance(e, ast.Constant):
            return isinstance(e.value, (int, float, bool))
        if isinstance(e, ast.Name):
            if e.id in self.known or (e.id in self.scalars and self.assigned.get(e.id) == 1):
                return True
            value = self.globals.get(e.id) if e.id not in self.params and self.assigned.get(e.id, 0) == 0 else None
            return isinstance(value, (int, float, bool)) and not isinstance(value, type)
        if isinstance(e, ast.Attribute):  # an enum value (JointType.FREE)
            owner = self.globals.get(e.value.id) if isinstance(e.value, ast.Name) and e.value.id not in self.params \
                and self.assigned.get(e.value.id, 0) == 0 else None
            return owner is not None and isinstance(getattr(owner, e.attr, None), (int, float, bool))
        if isinstance(e, ast.BinOp):
            return self._is_known(e.left, loads) and self._is_known(e.right, loads)
        if isinstance(e, ast.UnaryOp):
            return self._is_known(e.operand, loads)
        if isinstance(e, (ast.BoolOp,)):
            return all(self._is_known(v, loads) for v in e.values)
        if isinstance(e, ast.Compare):
            return self._is_known(e.left, loads) and all(self._is_known(c, loads) for c in e.comparators)
        if isinstance(e, ast.IfExp):
            return all(self._is_known(v, loads) for v in (e.test, e.body, e.orelse))
        if isinstance(e, ast.Call):
            f = e.func
            name = f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in (
                "wp", _twins.WP_NAME) else f.id if isinstance(f, ast.Name) else None
            return name in _SAFE_CALLS and not e.keywords and all(self._is_known(a, loads) for a in e.args)
        if isinstance(e, ast.Subscript):
            indices = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
            base = e.value
            if isinstance(base, ast.Attribute) and base.attr == "shape" and isinstance(base.value, ast.Name) \
                    and base.value.id in self.arrays:
                return all(self._is_known(i, False) for i in indices)
            if isinstance(base, ast.Name) and base.id in self.known:  # a component of a known vector
                return all(self._is_known(i, False) for i in indices)
            if loads and isinstance(base, ast.Name) and base.id in self.constants and self.assigned.get(base.id) == 1 \
                    and len(indices) == self.arrays[base.id].ndim and all(self._is_known(i, loads) for i in indices):
                self.loads.add(base.id)
                return True
        return False

    # -- the array's accesses

    def _indices_of(self, node: ast.AST) -> list[ast.AST] | None:
        """The full index of an element access of the array through ``node`` (a subscript of it or of a row
        view of it), as expressions over the probe's names; None if ``node`` does not reach the array."""
        if not isinstance(node, ast.Subscript) or not isinstance(node.value, ast.Name):
            return None
        indices = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        base = node.value.id
        if base == self.name:
            prefix: list[ast.AST] = []
        elif base in self.views:
            prefix = [ast.Name(v, ast.Load()) for v in self.views[base]]
        else:
            return None
        full = [*prefix, *indices]
        if len(full) != self.ndim:
            raise _NoProof(f"line {node.lineno}: an access of {len(full)} indices into a {self.ndim}-d array")
        return full

    def _mentions(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Name) and (n.id == self.name or n.id in self.views) for n in ast.walk(node))

    def _record(self, kind: str, full: list[ast.AST], path: tuple, loads: bool, lineno: int) -> list[str]:
        if not all(self._is_known(i, loads) for i in full):
            raise _NoProof(f"line {lineno}: an index the probe cannot compute")
        column = self.width
        self.width += len(full)
        self.columns.append((kind, column))
        self.order.append((kind, path))
        return [f"{_PREFIX}out[{_PREFIX}t, {column + d}] = {_twins.WP_NAME}.int64({ast.unparse(i)})"
                for d, i in enumerate(full)]

    def _accesses(self, stmt: ast.stmt, path: tuple, loads: bool) -> list[str]:
        """Recording statements for the accesses of the array in ``stmt`` (not a compound statement), reads
        (in evaluation order: right-hand side first) before writes."""
        reads, writes = [], []
        targets: list[ast.AST] = []
        if isinstance(stmt, ast.Assign):
            targets, values = list(stmt.targets), [stmt.value]
        elif isinstance(stmt, ast.AugAssign):
            full = self._indices_of(stmt.target)
            if full is not None and not isinstance(stmt.op, (ast.Add, ast.Sub)):
                raise _NoProof(f"line {stmt.lineno}: an update that reads the element")
            targets, values = [stmt.target], [stmt.value]
        elif isinstance(stmt, (ast.Expr, ast.Return)):
            values = [stmt.value] if stmt.value is not None else []
        else:
            values = [c for c in ast.iter_child_nodes(stmt) if isinstance(c, ast.expr)]
        for value in values:
            reads += self._reads(value, path, loads, stmt.lineno)
        for t in targets:
            for target in (t.elts if isinstance(t, ast.Tuple) else [t]):
                full = self._indices_of(target)
                if full is not None:
                    writes += self._record("write", full, path, loads, stmt.lineno)
                elif self._mentions(target):
                    raise _NoProof(f"line {stmt.lineno}: the array rebound")
        return reads + writes

    def _reads(self, value: ast.expr, path: tuple, loads: bool, lineno: int, condition: bool = False) -> list[str]:
        """Recording statements for the elements of the array ``value`` reads. Any other use of the array (passed
        to a function, which may access it where the probe cannot see) means no proof; ``a.shape`` is no access,
        and neither is ``if a:`` (Warp's null-array test: the whole condition)."""
        lines = []
        for n in ast.walk(value):
            full = self._indices_of(n) if isinstance(n, ast.Subscript) else None
            if full is not None:
                lines += self._record("read", full, path, loads, lineno)
            elif isinstance(n, ast.Name) and (n.id == self.name or n.id in self.views) and not (condition and n is value) and not any(
                    isinstance(p, ast.Subscript) and p.value is n for p in ast.walk(value)) and not any(
                    isinstance(p, ast.Attribute) and p.value is n and p.attr == "shape" for p in ast.walk(value)):
                raise _NoProof(f"line {lineno}: the array used whole")
        return lines

    # -- statements

    def _top_level(self, stmt: ast.stmt) -> list[str]:
        """The probe's lines for one statement of the kernel's body."""
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target, value = stmt.targets[0], stmt.value
            names = [t.id for t in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(t, ast.Name)]
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "tid":
                if any(self.assigned.get(n) != 1 for n in names):
                    raise _NoProof(f"line {stmt.lineno}: a thread index assigned again")
                self.tid = names
                self.known |= set(names)
                flat = names[0]
                for k, t in enumerate(names[1:], start=1):
                    flat = f"({flat}) * {_PREFIX}d{k} + {t}"  # (row-major, as the table's rows)
                return [ast.unparse(stmt), f"{_PREFIX}t = {flat}"]
            if isinstance(target, ast.Name) and self.assigned.get(target.id) == 1:
                if isinstance(value, ast.Subscript) and isinstance(value.value, ast.Name) and value.value.id == self.name:
                    indices = value.slice.elts if isinstance(value.slice, ast.Tuple) else [value.slice]
                    if len(indices) < (self.ndim or 0):  # a row view of the array
                        if not all(self._is_known(i, True) for i in indices):
                            raise _NoProof(f"line {stmt.lineno}: a view at an index the probe cannot compute")
                        self.views[target.id] = [f"{_PREFIX}v{next(self.counter)}" for _ in indices]
                        self.known |= set(self.views[target.id])
                        return [f"{v} = {ast.unparse(i)}" for v, i in zip(self.views[target.id], indices)]
                if not self._mentions(value) and self._is_known(value, not self.after_return):
                    self.known.add(target.id)
                    return [ast.unparse(stmt)]
        if isinstance(stmt, ast.If) and self._only_returns(stmt) and self._is_known(stmt.test, not self.after_return):
            return [ast.unparse(stmt)]  # a guard the kernel's threads leave by: the probe's leave too
        if isinstance(stmt, ast.Return) or (isinstance(stmt, ast.If) and self._only_returns(stmt)):
            raise _NoProof(f"line {stmt.lineno}: a return the probe cannot place")
        return self._nested(stmt, (), not self.after_return)

    @staticmethod
    def _only_returns(stmt: ast.If) -> bool:
        return bool(stmt.body) and all(isinstance(s, ast.Return) and s.value is None for s in stmt.body) and not stmt.orelse

    def _nested(self, stmt: ast.stmt, path: tuple, loads: bool) -> list[str]:
        """Lines recording the accesses in ``stmt``, under the kernel's conditions where the probe computes them
        (``loads``: whether the kernel surely evaluates what the probe evaluates here)."""
        if isinstance(stmt, (ast.For, ast.While)):
            if self._mentions(stmt):
                raise _NoProof(f"line {stmt.lineno}: the array accessed in a loop")
            self.after_return |= any(isinstance(n, ast.Return) for n in ast.walk(stmt))
            return []
        if isinstance(stmt, ast.If):
            tested = self._reads(stmt.test, path, loads, stmt.lineno, condition=True)  # (it runs before either side)
            known = self._is_known(stmt.test, loads)  # the kernel's condition, as the kernel evaluates it
            inner = loads and known  # (else both sides are recorded: no load the kernel may not make)
            arms = (self._block(stmt.body, (*path, (id(stmt), 0)), inner),
                    self._block(stmt.orelse, (*path, (id(stmt), 1)), inner))
            if not any(arms):
                return tested
            if known:
                lines = [f"if {ast.unparse(stmt.test)}:", *(f"    {a}" for a in arms[0] or ["pass"])]
                if arms[1]:
                    lines += ["else:", *(f"    {a}" for a in arms[1])]
                return [*tested, *lines]
            return [*tested, *arms[0], *arms[1]]
        if isinstance(stmt, ast.With):
            return self._block(stmt.body, path, loads)
        if isinstance(stmt, ast.Return):
            self.after_return = True
            return []  # (a return inside a branch: the accesses after it are recorded anyway, a superset)
        return self._accesses(stmt, path, loads)

    def _block(self, body: list[ast.stmt], path: tuple, loads: bool) -> list[str]:
        return [line for s in body for line in self._nested(s, path, loads)]

    # --

    def build(self) -> _Probe:
        if self.ndim is None:
            raise _NoProof("not an array parameter")
        lines = [line for stmt in self.fn.body for line in self._top_level(stmt)]
        if not self.tid or not self.columns:
            raise _NoProof("no wp.tid() or no access")
        for (k1, p1), (k2, p2) in itertools.combinations(self.order, 2):  # k1 comes first in program order
            if k1 != "read" and k2 == "read" and _on_one_path(p1, p2):
                raise _NoProof("a read after a write on one path")
        dims = [f"{_PREFIX}d{k}" for k in range(len(self.tid))]
        annotations = {**self.params, **{d: int for d in dims}, f"{_PREFIX}out": wp.array2d(dtype=wp.int64)}
        name = f"{_PREFIX}probe"
        source = f"def {name}({', '.join(annotations)}):\n" + "".join(f"    {line}\n" for line in lines)
        kernel = _twins.kernel_from_source(self.kernel, source, name, annotations,
                                           key=f"{self.kernel.key}__wnowned_{self.name}", kind="warpnn_owned_probe",
                                           options={"enable_backward": False})
        return _Probe(kernel, tuple(self.columns), frozenset(self.loads))


def _assignment_counts(fn: ast.FunctionDef) -> dict[str, int]:
    """How many times each local name is bound anywhere in the function (2 for a name bound in a loop)."""
    counts: dict[str, int] = {}
    loops = [n for n in ast.walk(fn) if isinstance(n, (ast.For, ast.While))]
    in_loop = {id(m) for loop in loops for m in ast.walk(loop)}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            counts[n.id] = counts.get(n.id, 0) + (2 if id(n) in in_loop else 1)
    for a in fn.args.args:
        counts[a.arg] = counts.get(a.arg, 0) + 1
    return counts


def _on_one_path(p1: tuple, p2: tuple) -> bool:
    """Whether two accesses can both run in one thread: no ``if`` sends them to different sides."""
    arms = dict(p1)
    return all(arms.get(node, arm) == arm for node, arm in p2)


def _check(probe: _Probe, kernel, args: list, dims: tuple[int, ...], name: str) -> list:
    """Run the probe; the constant arrays it read if ``name``'s elements are owned, else ``_NoProof``."""
    by_name = dict(zip((a.label for a in kernel.adj.args), args))
    array = by_name[name]
    if not isinstance(array, wp.array) or not array.is_contiguous:
        raise _NoProof("not a contiguous array")
    width = max(column for _, column in probe.columns) + array.ndim
    threads = int(np.prod(dims))
    out = wp.full((threads, width), -1, dtype=wp.int64, device=array.device)
    wp.launch(probe.kernel, dims, inputs=[*args, *dims], outputs=[out], device=array.device)
    table = out.numpy()
    shape = np.asarray(array.shape, dtype=np.int64)
    elements, kinds, threads_of = [], [], []
    for kind, column in probe.columns:
        index = table[:, column:column + array.ndim]
        reached = ~(index == -1).all(axis=1)  # (a thread that left early records nothing)
        index = index[reached]
        if ((index < 0) | (index >= shape)).any():
            raise _NoProof("an index out of range")
        elements.append(np.ravel_multi_index(index.T, tuple(array.shape)) if array.ndim else np.zeros(len(index), np.int64))
        kinds.append(np.full(len(index), kind != "read"))
        threads_of.append(np.nonzero(reached)[0])
    element, written, thread = (np.concatenate(v) for v in (elements, kinds, threads_of))
    order = np.lexsort((thread, element))
    element, written, thread = element[order], written[order], thread[order]
    # For each element: the threads that touch it (sorted); one with a write must be the only one.
    starts = np.r_[0, np.nonzero(np.diff(element))[0] + 1]
    first_thread = np.repeat(thread[starts], np.diff(np.r_[starts, len(element)]))
    shared = np.maximum.reduceat(thread != first_thread, starts) if len(element) else np.zeros(0, bool)
    any_write = np.maximum.reduceat(written, starts) if len(element) else np.zeros(0, bool)
    if (shared & any_write).any():
        raise _NoProof("an element one thread writes and another touches")
    return [by_name[n] for n in probe.loads]


def with_elements_owned(kernel, names: frozenset[str]):
    """A twin of ``kernel`` (same source) whose facts record that a launch-time proof placed every access of
    ``names`` (``_access.ArrayUse.elements_owned``). Use it only for the launch the proof was about."""
    return _with_elements_owned(kernel, tuple(sorted(names)))


@functools.lru_cache(maxsize=256)
def _with_elements_owned(kernel, names: tuple[str, ...]):
    twin = _twins.twin_of(kernel, "warpnn_owned", key=f"{kernel.key}__owned_{'_'.join(names)}")
    _access.declare_elements_owned(twin, frozenset(names))
    return twin
