"""Elements a launch owns, proven from the program's constants: in-place updates at computed indices.

Warp's adjoint differentiates an array a launch both reads and writes only if no thread reads an element another
thread writes (``ArrayUse.in_place_problem``). warpnn's walk proves that where every access is at the thread's own
``wp.tid()`` index. mujoco_warp updates ``qpos`` in place one joint per thread at ``jnt_qposadr[j] + k``, with
``k`` up to 7 by joint type: the elements are the thread's own, but only the model's index arrays say so.

Inside a traced program those index arrays are constants (the program reads them and nothing writes them; an
input may change per call), so the elements each thread touches are the same in every replay and can be
computed once, at trace time: a *probe*, a Warp kernel generated from the kernel's own statements that compute
values the constants fix (``_bounded._Clean``: the thread index, scalar arguments, shapes, loads of constant
arrays, and names every assignment of which is of that kind under conditions of that kind), its ``if`` structure
and the loops Warp unrolls, records the element of every access of the array and its place in the thread's
sequence of accesses. Where a condition depends on anything else, the probe records both sides in program order
(a superset, still a proof); where that would make it evaluate a load the kernel may not make, or an index needs
anything else (a dynamic loop around the access, a ``@wp.func`` or atomic taking the array), there is no proof
and the refusal stands. (A launch whose dynamic loops the constants bound is probed on its twin with those loops
unrolled: ``_bounded.py``.)

The proof holds if no element a thread writes is touched by another thread, every index is in range, and, for
each element a thread both reads and writes, either every read comes before the first write (Warp's adjoint then
replays on the array's values before the launch, which the bridge passes) or the first access is the only write
(the walk down a chain of bodies that reads the parent it placed: the adjoint then replays on the values after the
launch, ``KernelSignature.replay_on_outputs``). The launch runs a twin of the kernel (same source) whose facts say
so (``_access.ArrayUse.elements_owned``, ``replay_outputs``), and the tracer checks at the end of the trace that
nothing wrote the arrays the probe read.
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
from ._bounded import _Clean
from . import _warp_compat as wc
from ._signature import kernel_array_uses

_PREFIX = "wnowned_"
KEY_MARK = "__owned_"  # a twin's key: its kernel's, this, the arrays proven (the tracer strips it to name the kernel)


class _NoProof(Exception):
    """The probe cannot place an access (the reason is for debugging; the launch keeps its refusal)."""


def prove(kernel, args: list, dims: tuple[int, ...], names: list[str], constant: Callable[[Any], bool]):
    """The arrays among ``names`` (read and written by this launch of ``kernel`` with ``args`` over ``dims``)
    whose elements each thread provably owns, ``{name: replay}`` (``"inputs"``: every read of an element the
    thread writes comes before its writes, so Warp's adjoint replays on the array's values before the launch;
    ``"outputs"``: every such read comes after the thread's one write of it, so the adjoint replays on the values
    after), and the arrays the proof read (they must stay constant)."""
    owned: dict[str, str] = {}
    read: list = []
    by_name = dict(zip((a.label for a in kernel.adj.args), args))
    constants = frozenset(_constant_params(kernel, args, constant))
    for name in names:
        if isinstance(by_name.get(name), wp.array) and by_name[name].size == 0:
            owned[name] = "inputs"  # no elements: none a thread could read after another wrote it (na = 0 actuators)
            continue
        try:
            probe = _probe(kernel, name, constants)
            owned[name], read_here = _check(probe, kernel, args, dims, name)
        except _NoProof:
            continue
        except Exception:  # noqa: BLE001 - a probe Warp cannot build or run: no proof, the refusal stands
            continue
        read += read_here
    return owned, read


def _constant_params(kernel, args, constant) -> list[str]:
    """Array parameters the probe may load from: arrays the kernel does not write and the program keeps
    constant so far (``constant``: not an input, not written by an earlier operation)."""
    uses = kernel_array_uses(kernel)
    return [p.label for p, a in zip(kernel.adj.args, args)
            if isinstance(a, wp.array) and p.label in uses and not uses[p.label].writes and constant(a)]


@dataclasses.dataclass(frozen=True)
class _Probe:
    kernel: Any
    # per access site: ("read" | "write", first column, iterations); each iteration takes ndim index columns and
    # one for the access's place in the thread's sequence of accesses
    columns: tuple[tuple[str, int, int], ...]
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


@dataclasses.dataclass(frozen=True)
class _Where:
    """Where the probe is in the kernel: may it load (the kernel surely evaluates the same there), the flat
    iteration of the static loops around (an expression) and how many there are."""

    loads: bool = True
    iteration: str = "0"
    iterations: int = 1


class _ProbeBuilder:
    """The probe's source: the kernel's statements that compute values the program's constants fix (its indices,
    its ``if`` and loop structure where the constants decide it: ``_bounded._Clean``), each access of ``name``
    replaced by stores of its indices and its place in the thread's accesses into ``wnowned_out[thread, ...]``."""

    def __init__(self, kernel, name: str, constants: frozenset[str]):
        self.kernel, self.name = kernel, name
        self.fn = _twins.copy_tree(_access._function_def(kernel.adj.tree), kernel)
        self.params = {a.label: a.type for a in kernel.adj.args}
        self.arrays = {n: t for n, t in self.params.items() if wc.matches_array_class(t, wp.array)}
        self.ndim = self.arrays[name].ndim if name in self.arrays else None
        self.clean = _Clean(kernel, self.fn, constants)
        self.views: dict[str, list[str]] = {}  # row views of the array: name -> the probe's names of its indices
        self.columns: list[tuple[str, int, int]] = []
        self.width = 0
        self.counter = itertools.count()
        self.tid: list[str] = []
        self.after_return = False  # a return seen: loads after it may be ones the kernel's thread never makes

    # -- expressions

    def _is_known(self, e: ast.AST, loads: bool) -> bool:
        """Whether the probe computes ``e`` as the kernel does (``loads``: may it load from constant arrays)."""
        if not self.clean.expr(e):
            return False
        return loads or not any(isinstance(n, ast.Subscript) and isinstance(n.value, ast.Name)
                                and n.value.id in self.arrays for n in ast.walk(e))

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

    def _record(self, kind: str, full: list[ast.AST], where: _Where, lineno: int) -> list[str]:
        if not all(self._is_known(i, where.loads and not self.after_return) or
                   (isinstance(i, ast.Name) and i.id.startswith(_PREFIX)) for i in full):
            raise _NoProof(f"line {lineno}: an index the probe cannot compute")
        step = len(full) + 1
        column = self.width
        self.width += step * where.iterations
        self.columns.append((kind, column, where.iterations))
        at = f"{column} + ({where.iteration}) * {step}"
        return [*(f"{_PREFIX}out[{_PREFIX}t, {at} + {d}] = {_twins.WP_NAME}.int64({ast.unparse(i)})"
                  for d, i in enumerate(full)),
                f"{_PREFIX}out[{_PREFIX}t, {at} + {len(full)}] = {_twins.WP_NAME}.int64({_PREFIX}seq)",
                f"{_PREFIX}seq = {_PREFIX}seq + 1"]

    def _accesses(self, stmt: ast.stmt, where: _Where) -> list[str]:
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
            reads += self._reads(value, where, stmt.lineno)
        for t in targets:
            for target in (t.elts if isinstance(t, ast.Tuple) else [t]):
                full = self._indices_of(target)
                if full is not None:
                    writes += self._record("write", full, where, stmt.lineno)
                elif self._mentions(target):
                    raise _NoProof(f"line {stmt.lineno}: the array rebound")
        return reads + writes

    def _reads(self, value: ast.expr, where: _Where, lineno: int, condition: bool = False) -> list[str]:
        """Recording statements for the elements of the array ``value`` reads. Any other use of the array (passed
        to a function, which may access it where the probe cannot see) means no proof; ``a.shape`` is no access,
        and neither is ``if a:`` (Warp's null-array test: the whole condition)."""
        lines = []
        for n in ast.walk(value):
            full = self._indices_of(n) if isinstance(n, ast.Subscript) else None
            if full is not None:
                lines += self._record("read", full, where, lineno)
            elif isinstance(n, ast.Name) and (n.id == self.name or n.id in self.views) and not (condition and n is value) and not any(
                    isinstance(p, ast.Subscript) and p.value is n for p in ast.walk(value)) and not any(
                    isinstance(p, ast.Attribute) and p.value is n and p.attr == "shape" for p in ast.walk(value)):
                raise _NoProof(f"line {lineno}: the array used whole")
        return lines

    # -- statements

    def _binds_clean(self, stmt: ast.stmt) -> bool:
        """Whether ``stmt`` is an assignment of names the constants fix (the probe runs it as the kernel does)."""
        if not isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)) or stmt.value is None:
            return False
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        names = [n for t in targets for n in ast.walk(t)]
        return all(isinstance(n, (ast.Name, ast.Tuple, ast.Load, ast.Store)) for n in names) and all(
            n.id not in self.clean.dirty and n.id not in self.params for n in names if isinstance(n, ast.Name)) \
            and not self._mentions(stmt.value) and self._is_known(stmt.value, not self.after_return)

    def _statement(self, stmt: Any, where: _Where) -> list[str]:
        """The probe's lines for one statement of the kernel."""
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) \
                and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "tid":
            target = stmt.targets[0]
            names = [t.id for t in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(t, ast.Name)]
            if self.tid or where.iterations != 1 or self.clean.parents.get(stmt) is not self.fn:
                raise _NoProof(f"line {stmt.lineno}: wp.tid() not once at the top")
            self.tid = names
            flat = names[0]
            for k, t in enumerate(names[1:], start=1):
                flat = f"({flat}) * {_PREFIX}d{k} + {t}"  # (row-major, as the table's rows)
            return [ast.unparse(stmt), f"{_PREFIX}t = {flat}", f"{_PREFIX}seq = int(0)"]
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                and isinstance(stmt.value, ast.Subscript) and isinstance(stmt.value.value, ast.Name) \
                and stmt.value.value.id == self.name:
            indices = stmt.value.slice.elts if isinstance(stmt.value.slice, ast.Tuple) else [stmt.value.slice]
            if len(indices) < (self.ndim or 0):  # a row view of the array
                view: str = stmt.targets[0].id
                if view in self.views or any(isinstance(n, ast.Name) and n.id == view and isinstance(n.ctx, ast.Store)
                                             and n is not stmt.targets[0] for n in ast.walk(self.fn)):
                    raise _NoProof(f"line {stmt.lineno}: a view bound twice")
                if where.iterations != 1 or not all(self._is_known(i, where.loads) for i in indices):
                    raise _NoProof(f"line {stmt.lineno}: a view at an index the probe cannot compute")
                self.views[view] = [f"{_PREFIX}v{next(self.counter)}" for _ in indices]
                return [f"{v} = {ast.unparse(i)}" for v, i in zip(self.views[view], indices)]
        if self._binds_clean(stmt):
            return [ast.unparse(stmt)]
        if isinstance(stmt, ast.If):
            tested = self._reads(stmt.test, where, stmt.lineno, condition=True)  # (it runs before either side)
            known = self._is_known(stmt.test, where.loads and not self.after_return)
            inner = where if known else dataclasses.replace(where, loads=False)
            arms = (self._arm(stmt.body, inner, known, stmt.lineno), self._arm(stmt.orelse, inner, known, stmt.lineno))
            if known:
                lines = [f"if {ast.unparse(stmt.test)}:", *(f"    {a}" for a in arms[0] or ["pass"])]
                if arms[1]:
                    lines += ["else:", *(f"    {a}" for a in arms[1])]
                return [*tested, *lines]
            return [*tested, *arms[0], *arms[1]]  # (both sides: a superset, in program order)
        if isinstance(stmt, ast.For) and _static_range(stmt) is not None and isinstance(stmt.target, ast.Name) \
                and not any(isinstance(n, (ast.Break, ast.Continue, ast.Return)) for n in ast.walk(stmt)):
            count: int = _static_range(stmt) or 0
            var: str = stmt.target.id
            call: Any = stmt.iter
            first = 0 if len(call.args) == 1 else ast.literal_eval(call.args[0])
            index = f"({var} - {first})" if first else var
            inner = dataclasses.replace(where, iteration=f"({where.iteration}) * {count} + {index}",
                                        iterations=where.iterations * count)
            body = self._block(stmt.body, inner)
            return [f"for {var} in {ast.unparse(stmt.iter)}:", *(f"    {a}" for a in body or ["pass"])]
        if isinstance(stmt, (ast.For, ast.While)):
            if self._mentions(stmt):
                raise _NoProof(f"line {stmt.lineno}: the array accessed in a dynamic loop")
            self.after_return |= any(isinstance(n, ast.Return) for n in ast.walk(stmt))
            if any(self._binds_clean(n) for n in ast.walk(stmt) if isinstance(n, ast.stmt)):
                raise _NoProof(f"line {stmt.lineno}: a dynamic loop computing values the probe needs")
            return []
        if isinstance(stmt, ast.With):
            return self._block(stmt.body, where)
        if isinstance(stmt, ast.Return):
            clean = self.clean._exit_clean(stmt) and stmt.value is None
            if clean and not self.after_return:
                return ["return"]  # (the kernel's threads leave here: so do the probe's)
            self.after_return = True
            return []  # (the accesses after it are recorded anyway, a superset)
        if isinstance(stmt, (ast.Break, ast.Continue)):
            raise _NoProof(f"line {stmt.lineno}: an exit of a loop the probe follows")
        return self._accesses(stmt, where)

    def _block(self, body: list[ast.stmt], where: _Where) -> list[str]:
        return [line for s in body for line in self._statement(s, where)]

    def _arm(self, body: list[ast.stmt], where: _Where, decided: bool, lineno: int) -> list[str]:
        """One side of an ``if``. A side the probe cannot follow (an index it cannot compute, the array passed to a
        function) under a condition the constants decide becomes an access at index -1: a thread that takes it
        fails the proof (``_check``: an index out of range), and a launch whose threads never take it (mujoco_warp's
        DC-motor branch in a model without DC motors) keeps its proof. Columns or views the side had begun stay
        unwritten (not reached) or undefined (the probe does not build: no proof)."""
        try:
            return self._block(body, where)
        except _NoProof:
            if not decided:
                raise
            return self._record("write", [ast.Constant(-1)] * (self.ndim or 0), where, lineno)

    # --

    def build(self) -> _Probe:
        if self.ndim is None:
            raise _NoProof("not an array parameter")
        lines = self._block(self.fn.body, _Where())
        if not self.tid or not self.columns:
            raise _NoProof("no wp.tid() or no access")
        dims = [f"{_PREFIX}d{k}" for k in range(len(self.tid))]
        annotations = {**self.params, **{d: int for d in dims}, f"{_PREFIX}out": wp.array2d(dtype=wp.int64)}
        name = f"{_PREFIX}probe"
        source = f"def {name}({', '.join(annotations)}):\n" + "".join(f"    {line}\n" for line in lines)
        kernel = _twins.kernel_from_source(self.kernel, source, name, annotations,
                                           key=f"{self.kernel.key}__wnowned_{self.name}", kind="warpnn_owned_probe",
                                           options={"enable_backward": False},
                                           module_options={"max_unroll": max(self.width, 16)})
        return _Probe(kernel, tuple(self.columns), frozenset(self.clean.loads))


def _static_range(loop: Any) -> int | None:
    """The number of iterations of ``for k in range(<literal>)`` / ``range(<literal>, <literal>)``, else None."""
    call = loop.iter
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "range") \
            or not 1 <= len(call.args) <= 2:
        return None
    try:
        bounds = [ast.literal_eval(a) for a in call.args]
    except ValueError:
        return None
    if not all(isinstance(b, int) for b in bounds):
        return None
    return max(0, bounds[-1] - (bounds[0] if len(bounds) == 2 else 0))


def _check(probe: _Probe, kernel, args: list, dims: tuple[int, ...], name: str) -> tuple[str, list]:
    """Run the probe; how the adjoint replays ``name`` (``prove``'s ``"inputs"`` / ``"outputs"``) and the
    constant arrays the probe read, if its elements are owned, else ``_NoProof``."""
    by_name = dict(zip((a.label for a in kernel.adj.args), args))
    array = by_name[name]
    if not isinstance(array, wp.array) or not array.is_contiguous:
        raise _NoProof("not a contiguous array")
    step = array.ndim + 1
    width = max(column + step * iterations for _, column, iterations in probe.columns)
    threads = int(np.prod(dims))
    out = wp.full((threads, width), -1, dtype=wp.int64, device=array.device)
    wp.launch(probe.kernel, dims, inputs=[*args, *dims], outputs=[out], device=array.device)
    table = out.numpy()
    shape = np.asarray(array.shape, dtype=np.int64)
    elements, kinds, threads_of, places = [], [], [], []
    for kind, column, iterations in probe.columns:
        for it in range(iterations):
            at = column + it * step
            index = table[:, at:at + array.ndim]
            reached = table[:, at + array.ndim] >= 0  # (a thread that left early, or an iteration not run: none)
            index = index[reached]
            if ((index < 0) | (index >= shape)).any():
                raise _NoProof("an index out of range")
            elements.append(np.ravel_multi_index(index.T, tuple(array.shape)) if array.ndim else np.zeros(len(index), np.int64))
            kinds.append(np.full(len(index), kind != "read"))
            threads_of.append(np.nonzero(reached)[0])
            places.append(table[reached, at + array.ndim])
    element, written, thread, place = (np.concatenate(v) for v in (elements, kinds, threads_of, places))
    loads = [by_name[n] for n in sorted(probe.loads) if n in by_name]
    if not len(element):
        return "inputs", loads
    order = np.lexsort((place, thread, element))
    element, written, thread = element[order], written[order], thread[order]
    # For each element: the threads that touch it (sorted); one with a write must be the only one.
    starts = np.r_[0, np.nonzero(np.diff(element))[0] + 1]
    counts = np.diff(np.r_[starts, len(element)])
    first_thread = np.repeat(thread[starts], counts)
    shared = np.maximum.reduceat(thread != first_thread, starts)
    any_write = np.maximum.reduceat(written, starts)
    if (shared & any_write).any():
        raise _NoProof("an element one thread writes and another touches")
    # Each written element is one thread's, its accesses in that thread's order: the adjoint may replay on the
    # values before the launch if every read comes before the first write, on those after if the first access is
    # the only write.
    group = np.repeat(np.arange(len(starts)), counts)
    writes = np.add.reduceat(written.astype(np.int64), starts)
    last_write_group = np.maximum.accumulate(np.where(written, group, -1))
    reads_after = np.zeros(len(starts), bool)
    np.logical_or.at(reads_after, group, ~written & (last_write_group == group))
    mixed = any_write & (writes < counts)  # written elements that are also read
    inputs_ok = not (mixed & reads_after).any()
    outputs_ok = not (mixed & ~(written[starts] & (writes == 1))).any()
    if not (inputs_ok or outputs_ok):
        raise _NoProof("a read between two writes, or reads both before and after a write")
    return ("inputs" if inputs_ok else "outputs"), loads


def with_elements_owned(kernel, owned: dict[str, str]):
    """A twin of ``kernel`` (same source) whose facts record that a launch-time proof placed every access of the
    arrays ``owned`` names (``_access.ArrayUse.elements_owned``), and which of them Warp's adjoint replays on their
    values after the launch (``"outputs"``). Use it only for the launch the proof was about."""
    return _with_elements_owned(kernel, tuple(sorted(owned.items())))


@functools.lru_cache(maxsize=256)
def _with_elements_owned(kernel, owned: tuple[tuple[str, str], ...]):
    names = [n for n, _ in owned]
    twin = _twins.twin_of(kernel, "warpnn_owned", key=f"{kernel.key}{KEY_MARK}{'_'.join(names)}")
    _access.share_codegen_facts(twin, kernel)  # (same function, source and options: Warp's facts are the same)
    _access.declare_elements_owned(twin, frozenset(names), frozenset(n for n, how in owned if how == "outputs"))
    return twin
