"""Dynamic loops whose trip counts the program's constants fix, unrolled for the adjoint.

Warp's adjoint of a dynamic loop is wrong wherever a later adjoint needs a value the loop changed (see
``_access``'s loop facts); ``_unrolled`` fixes the loops whose bounds are a call's scalars or shapes. Most of
mujoco_warp's loops are bounded by the *model*: ``for j in range(bodyid, bodyid + body_subtreenum[bodyid])``,
``while bodyid > 0: ...; bodyid = body_parentid[bodyid]``. Inside a traced program the model's arrays are
constants (nothing writes them; an input may change per call), so such a loop runs the same number of times in
every replay, and that number can be measured once, at trace time.

The proof, per launch:

1. *Clean values* (``_Clean``): the thread index, the launch's scalars and shapes, literals and module constants,
   loads from arrays the program keeps constant at indices that are clean, and local names every binding of
   which is clean and happens under clean control (every enclosing ``if`` / ``while`` test and loop range clean,
   no early exit under a condition that is not). A loop's trip count is clean if its range (``for``) or its test
   (``while``, with no ``break`` under an unclean condition) is, and whether a thread reaches it is clean if its
   enclosing control is and no early exit before it depends on anything else.
2. *Measured bounds*: a counting twin of the kernel (same code, plus the trip count of each such loop taken at
   its entry, or counted per iteration for a ``while``, maximised over threads) runs once on the launch's
   arguments, its writes going to copies.
3. *The twin*: each such loop becomes a loop over ``range(bound)``, which Warp unrolls (straight-line code, whose
   adjoint is right), with the original iteration guarded (``if i < stop``, ``if test``); ``continue`` and
   ``break`` become flags guarding the rest of the iteration (and the iterations after a ``break``).

The twin runs in the kernel's place; its facts are Warp's own for the new code (a loop Warp still emits dynamic,
one in a ``@wp.func``, an unclean bound: no twin, the refusal stands). The tracer checks at the end that nothing
wrote the arrays the bounds were read from. A loop with a ``return`` inside, a step that is not a literal, or a
loop variable used after the loop is left as it is.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
from typing import Any, Callable

import numpy as np
import warp as wp

from . import _access, _batched, _settings, _twins
from . import _warp_compat as wc
from ._signature import kernel_array_uses
from ._unrolled import MAX_UNROLL_ENV

_PREFIX = "wnbound_"
KEY_MARK = "__wnbounded_"  # a twin's key: its kernel's, this, a digest (the tracer strips it to name the kernel)
_SAFE_CALLS = {"int", "float", "bool", "min", "max", "abs", "int32", "int64", "uint32", "clamp", "where"}


class _NotBounded(Exception):
    """A loop warpnn cannot bound (the reason is for debugging; the kernel's refusal stands)."""


def bounded(kernel, args: list, dims: tuple[int, ...], constant: Callable[[Any], bool],
            accept: Callable[[Any], Any] = lambda twin: True):
    """``(twin, arrays read, accepted)`` for this launch of ``kernel`` (``args`` over ``dims``): the twin with its
    dynamic loops unrolled to their measured bounds, the constant arrays the bounds came from and what
    ``accept(twin)`` returned; None where a loop cannot be bounded so, Warp's adjoint of the twin would still be
    wrong, or ``accept`` returns None (the kernel keeps its refusal)."""
    fn = _batched.kernel_body(kernel, _PREFIX)
    if fn is None:
        return None
    uses = kernel_array_uses(kernel)
    by_name = dict(zip((a.label for a in kernel.adj.args), args))
    constants = frozenset(n for n, a in by_name.items() if isinstance(a, wp.array) and n in uses
                          and not uses[n].writes and constant(a))
    limit = _settings.get(MAX_UNROLL_ENV)
    try:
        plan = _plan(kernel, constants)
        if plan is None:
            return None
        bounds = _measure(plan, kernel, args, dims)
    except _NotBounded:
        return None
    except Exception:  # noqa: BLE001 - a counting twin Warp cannot build or run: no proof, the refusal stands
        return None
    if max(bounds, default=0) > limit:
        return None  # (Warp would emit the loop dynamic again)
    twin = _unrolled_twin(plan, tuple(bounds), limit)
    if twin is None or _access.codegen_facts(twin).adjoint_problems:
        return None
    accepted = accept(twin)
    if accepted is None:
        return None
    return twin, [by_name[n] for n in sorted(plan.loads)], accepted


# --------------------------------------------------------------------------------------------------
# 1. clean values


class _Clean:
    """Which of the kernel's values and loops the program's constants fix (see the module's docstring)."""

    def __init__(self, owner, fn: ast.FunctionDef, constants: frozenset[str], clean_scalars: frozenset[str] | None = None):
        self.fn = fn
        self.globals = _access._names_visible_to(owner.func)
        self.params = {a.label: a.type for a in owner.adj.args}
        self.arrays = {n for n, t in self.params.items() if wc.matches_array_class(t, wp.array)}
        self.constants = constants
        self.parents = _access.parents_of(fn)
        bound = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        self.locals = bound | set(self.params)
        self.unassigned_scalars = {n for n in self.params if n not in self.arrays and n not in bound
                                   and (clean_scalars is None or n in clean_scalars)}
        self.dirty: set[str] = set()
        self.loads: set[str] = set()
        self._found: dict[tuple[int, Any], list[Any]] = {}
        self._settle()

    def _settle(self) -> None:
        """Mark dirty every name with a binding that is not clean, until nothing changes."""
        bindings = [n for n in ast.walk(self.fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For))]
        changed = True
        while changed:
            changed = False
            for node in bindings:
                for name, clean in self._binding(node):
                    if name not in self.dirty and not clean:
                        self.dirty.add(name)
                        changed = True

    def _binding(self, node: Any) -> list[tuple[str, bool]]:
        """The names ``node`` binds and whether that binding is clean."""
        if isinstance(node, ast.For):
            names = _names_in(node.target)
            return [(n, self.control_clean(node) and self.range_clean(node)) for n in names]
        if isinstance(node, ast.Assign):
            if isinstance(node.value, ast.Call) and _call_name(node.value) == "tid":
                return []
            targets, value = node.targets, node.value
        else:
            targets, value = [node.target], node.value
        control = self.control_clean(node) and value is not None and self.expr(value)
        out = []
        for t in targets:
            for target in (t.elts if isinstance(t, ast.Tuple) else [t]):
                if isinstance(target, ast.Name):
                    clean = control and (not isinstance(node, ast.AugAssign) or target.id not in self.dirty)
                    out.append((target.id, clean))
                elif isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) \
                        and target.value.id not in self.arrays:  # a component of a local vector
                    idx = target.slice.elts if isinstance(target.slice, ast.Tuple) else [target.slice]
                    out.append((target.value.id, control and all(self.expr(i) for i in idx)))
                elif isinstance(target, (ast.Subscript, ast.Attribute)):  # an array element or a field: binds
                    root: Any = target  # no local name, unless the field is a local struct's
                    while isinstance(root, (ast.Subscript, ast.Attribute)):
                        root = root.value
                    if isinstance(root, ast.Name) and root.id not in self.arrays and root.id not in self.params:
                        out.append((root.id, False))
                else:
                    out += [(n, False) for n in _names_in(target)]
        return out

    def range_clean(self, loop: Any) -> bool:
        call = loop.iter
        return (isinstance(call, ast.Call) and _call_name(call) == "range" and not call.keywords
                and 1 <= len(call.args) <= 3 and all(self.expr(a) for a in call.args))

    def control_clean(self, node: Any) -> bool:
        """Whether whether ``node`` runs (and how often) is fixed by the constants: its enclosing tests and loop
        ranges are clean, and no early exit that may come before it depends on anything else."""
        child, parent = node, self.parents.get(node)
        while parent is not None and parent is not self.fn:
            if isinstance(parent, (ast.If, ast.While)) and child is not parent.test and not self.expr(parent.test):
                return False
            if isinstance(parent, (ast.For, ast.While)) and any(
                    not self._exit_clean(n) for n in self._within(parent, ast.Return)):
                return False  # (a return in an earlier iteration)
            if isinstance(parent, ast.While) and self._dirty_exits(parent, ast.Break):
                return False
            if isinstance(parent, ast.For) and child is not parent.iter:
                if not self.range_clean(parent) or self._dirty_exits(parent, ast.Break) \
                        or self._dirty_exits(parent, ast.Continue, before=node):
                    return False
            child, parent = parent, self.parents.get(parent)
        return not any(n.lineno < node.lineno and not self._exit_clean(n) for n in self._within(self.fn, ast.Return))

    def _within(self, node: Any, kind) -> list[Any]:
        """The statements of ``kind`` inside ``node`` (a loop's own ``break`` / ``continue`` for those; cached)."""
        key = (id(node), kind)
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = _exits_of(node, kind) if kind in (ast.Break, ast.Continue) else [
                n for n in ast.walk(node) if isinstance(n, kind)]
        return found

    def _dirty_exits(self, loop: Any, kind, before: Any = None) -> bool:
        return any(not self._exit_clean(e) and (before is None or e.lineno < before.lineno)
                   for e in self._within(loop, kind))

    def _exit_clean(self, exit_node: Any) -> bool:
        child, parent = exit_node, self.parents.get(exit_node)
        while parent is not None and parent is not self.fn:
            if isinstance(parent, (ast.If, ast.While)) and child is not parent.test and not self.expr(parent.test):
                return False
            if isinstance(parent, ast.For) and not self.range_clean(parent):
                return False
            child, parent = parent, self.parents.get(parent)
        return True

    def while_clean(self, loop: Any) -> bool:
        return self.expr(loop.test) and not self._dirty_exits(loop, ast.Break)

    def expr(self, e: Any) -> bool:
        if isinstance(e, ast.Constant):
            return isinstance(e.value, (int, float, bool))
        if isinstance(e, ast.Name):
            if e.id in self.locals:
                return (e.id in self.unassigned_scalars or e.id not in self.params) and e.id not in self.dirty
            value = self.globals.get(e.id)
            return isinstance(value, (int, float, bool)) and not isinstance(value, type)
        if isinstance(e, ast.Attribute):  # an enum value (JointType.FREE)
            owner = self.globals.get(e.value.id) if isinstance(e.value, ast.Name) and e.value.id not in self.locals \
                else None
            return owner is not None and isinstance(getattr(owner, e.attr, None), (int, float, bool))
        if isinstance(e, ast.BinOp):
            return self.expr(e.left) and self.expr(e.right)
        if isinstance(e, ast.UnaryOp):
            return self.expr(e.operand)
        if isinstance(e, ast.BoolOp):
            return all(self.expr(v) for v in e.values)
        if isinstance(e, ast.Compare):
            return self.expr(e.left) and all(self.expr(c) for c in e.comparators)
        if isinstance(e, ast.IfExp):
            return all(self.expr(v) for v in (e.test, e.body, e.orelse))
        if isinstance(e, ast.Call):
            return _call_name(e) in _SAFE_CALLS and not e.keywords and all(self.expr(a) for a in e.args)
        if isinstance(e, ast.Subscript):
            indices = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
            base = e.value
            if isinstance(base, ast.Attribute) and base.attr == "shape" and isinstance(base.value, ast.Name) \
                    and base.value.id in self.arrays:
                return all(self.expr(i) for i in indices)
            if isinstance(base, ast.Name) and base.id in self.constants and all(self.expr(i) for i in indices):
                self.loads.add(base.id)
                return True
            if isinstance(base, ast.Name) and base.id in self.locals and base.id not in self.params:
                return self.expr(base) and all(self.expr(i) for i in indices)  # a component of a clean vector
            if isinstance(base, ast.Subscript):  # a component of a loaded vector (actuator_trnid[i][0])
                return self.expr(base) and all(self.expr(i) for i in indices)
        return False


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("wp", _twins.WP_NAME):
        return f.attr
    return f.id if isinstance(f, ast.Name) else None


def _names_in(node: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)]


def _exits_of(loop: Any, kind) -> list[Any]:
    """``loop``'s own ``break`` or ``continue`` statements (not those of loops inside it)."""
    found, todo = [], list(loop.body)
    while todo:
        node = todo.pop()
        if isinstance(node, kind):
            found.append(node)
        elif not isinstance(node, (ast.For, ast.While, ast.FunctionDef, ast.Lambda)):
            todo += list(ast.iter_child_nodes(node))
    return found


# --------------------------------------------------------------------------------------------------
# 2. the plan and the measured bounds


@dataclasses.dataclass(eq=False)
class _Body:
    """A kernel's or a ``@wp.func``'s tree (a copy) with the loops to bound (``_loops_of`` order)."""

    owner: Any
    fn: ast.FunctionDef
    loops: int


@dataclasses.dataclass(eq=False)
class _Plan:
    """What to bound: the kernel's loops and those of the ``@wp.func``s it calls (each a ``_Body``: the bounds
    are the kernel's first, then each function's), and the kernel's constant arrays the bounds read."""

    kernel: _Body
    functions: list[_Body]
    loads: frozenset[str]

    @property
    def loops(self) -> int:
        return self.kernel.loops + sum(f.loops for f in self.functions)


def _loops_of(fn: ast.AST) -> list[Any]:
    return [n for n in ast.walk(fn) if isinstance(n, ast.While) or (isinstance(n, ast.For) and not _literal_range(n))]


def _user_function(expr: ast.AST, names: dict):
    """The ``@wp.func`` ``expr`` names (``f`` or ``module.f``), or None."""
    from warp._src.context import Function

    if isinstance(expr, ast.Name):
        value = names.get(expr.id)
    elif isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
        value = getattr(names.get(expr.value.id), expr.attr, None)
    else:
        return None
    return value if isinstance(value, Function) and value.func is not None and getattr(value, "adj", None) is not None \
        else None


def _looped_calls(fn: ast.AST, names: dict, functions: list) -> list[tuple[ast.Call, int]]:
    """The calls in ``fn`` of the given functions, with each one's index."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            f = _user_function(node.func, names)
            for i, g in enumerate(functions):
                if f is g:
                    found.append((node, i))
    return found


def _check_loops(clean: _Clean, fn: Any, where: str) -> None:
    for loop in _loops_of(fn):
        if not clean.control_clean(loop):
            raise _NotBounded(f"{where} line {loop.lineno}: whether a thread reaches the loop depends on more than the constants")
        if isinstance(loop, ast.For):
            if not clean.range_clean(loop):
                raise _NotBounded(f"{where} line {loop.lineno}: a range the constants do not fix")
            if not isinstance(loop.target, ast.Name) or _step(loop) is None:
                raise _NotBounded(f"{where} line {loop.lineno}: a loop target or step warpnn does not rewrite")
            if not _only_loop_targets(fn, loop.target.id, clean.parents):
                raise _NotBounded(f"{where} line {loop.lineno}: the loop variable used outside the loop")
        elif not clean.while_clean(loop):
            raise _NotBounded(f"{where} line {loop.lineno}: a while test the constants do not fix")
        if any(isinstance(n, ast.Return) for n in ast.walk(loop)):
            raise _NotBounded(f"{where} line {loop.lineno}: a return inside the loop")
        if loop.orelse:
            raise _NotBounded(f"{where} line {loop.lineno}: a loop with an else clause")


@functools.lru_cache(maxsize=256)
def _plan_cached(kernel, constants: frozenset[str]) -> _Plan | str | None:
    try:
        fn = _twins.copy_tree(_batched.kernel_body(kernel, _PREFIX), kernel)
        clean = _Clean(kernel, fn, constants)
        _check_loops(clean, fn, f"'{kernel.key}'")
        loads = set(clean.loads)
        functions: list[_Body] = []
        _collect_functions(fn, clean, {n: {n} for n in constants}, loads, functions)
        loops = len(_loops_of(fn))
        if not loops and not functions:
            return None
        return _Plan(_Body(kernel, fn, loops), functions, frozenset(loads))
    except _NotBounded as e:
        return str(e)


def has_dynamic_loops(kernel) -> bool:
    """Whether ``kernel`` or a ``@wp.func`` it calls has a loop this module would bound (a look at the source
    only, before asking Warp's code generator anything)."""
    if _batched.kernel_body(kernel, _PREFIX) is None:
        return False
    try:
        return _needs_twin(kernel)
    except _NotBounded:
        return True


def _needs_twin(f, seen=()) -> bool:
    """Whether ``f`` (a ``@wp.func``, or a kernel) has loops to bound or calls a function that does."""
    if f in seen:
        raise _NotBounded(f"@wp.func '{f.key}' calls itself")
    fn = _access._function_def(f.adj.tree)
    if _loops_of(fn):
        return True
    names = _access._names_visible_to(f.func)
    return any(_needs_twin(g, (*seen, f)) for node in ast.walk(fn) if isinstance(node, ast.Call)
               and (g := _user_function(node.func, names)) is not None)


def _collect_functions(fn: ast.FunctionDef, clean: _Clean, constant_sources: dict[str, set[str]], loads: set[str],
                       functions: list[_Body]) -> None:
    """Append to ``functions`` (callees first) the bodies of the functions ``fn`` calls that need a twin.
    ``constant_sources``: for each constant array of ``fn``, the kernel's arrays it may be."""
    sites: dict[Any, list[Any]] = {}
    for node in ast.walk(fn):
        f = _user_function(node.func, clean.globals) if isinstance(node, ast.Call) else None
        if f is not None and _needs_twin(f):
            sites.setdefault(f, []).append(node)
    for f, calls in sites.items():
        if any(body.owner is f for body in functions):
            raise _NotBounded(f"@wp.func '{f.key}' called from two functions")
        _function_body(f, calls, clean, constant_sources, loads, functions)


def _function_body(f, calls: list[ast.Call], clean: _Clean, constant_sources: dict[str, set[str]], loads: set[str],
                   functions: list[_Body]) -> None:
    """The bounded loops of ``f``, called at ``calls`` by a body ``clean`` describes: its scalar parameters are
    clean where every call passes a clean value, its arrays constant where every call passes a constant array."""
    f_fn = _twins.copy_tree(_access._function_def(f.adj.tree), f)
    if any(isinstance(n, ast.Name) and n.id.startswith(_PREFIX) for n in ast.walk(f_fn)):
        raise _NotBounded(f"@wp.func '{f.key}': a name warpnn reserves")
    params = [a.label for a in f.adj.args]
    arrays = {a.label for a in f.adj.args if wc.matches_array_class(a.type, wp.array)}
    clean_scalars, constants = set(params) - arrays, set(arrays)
    sources: dict[str, set[str]] = {p: set() for p in arrays}
    for call in calls:
        statement = next(p for p in _ancestors(call, clean.parents) if isinstance(p, ast.stmt))
        if call.keywords or len(call.args) != len(params) or any(isinstance(a, ast.Starred) for a in call.args) \
                or not clean.control_clean(statement):
            raise _NotBounded(f"@wp.func '{f.key}': a call warpnn cannot follow (line {call.lineno})")
        for p, arg in zip(params, call.args):
            if p in arrays:
                if isinstance(arg, ast.Name) and arg.id in clean.constants:
                    sources[p] |= constant_sources.get(arg.id, set())
                else:
                    constants.discard(p)
            elif not clean.expr(arg):
                clean_scalars.discard(p)
    f_clean = _Clean(f, f_fn, frozenset(constants), frozenset(clean_scalars))
    _check_loops(f_clean, f_fn, f"@wp.func '{f.key}'")
    _collect_functions(f_fn, f_clean, {p: sources[p] for p in constants}, loads, functions)
    loads |= {name for p in f_clean.loads for name in sources[p]}
    functions.append(_Body(f, f_fn, len(_loops_of(f_fn))))


def _plan(kernel, constants: frozenset[str]) -> _Plan | None:
    plan = _plan_cached(kernel, constants)
    if isinstance(plan, str):
        raise _NotBounded(plan)
    return plan


def _literal_range(loop: Any) -> bool:
    """A loop Warp unrolls itself (a ``range`` of literals) or one over something other than a range."""
    call = loop.iter
    if not (isinstance(call, ast.Call) and _call_name(call) == "range"):
        return True
    return all(isinstance(a, ast.Constant) or (isinstance(a, ast.UnaryOp) and isinstance(a.operand, ast.Constant))
               for a in call.args)


def _step(loop: Any) -> Any:
    args = loop.iter.args
    if len(args) < 3:
        return 1
    step = args[2]
    try:
        value = ast.literal_eval(step)
    except ValueError:
        return None
    return value if isinstance(value, int) and value != 0 else None


def _only_loop_targets(fn, name: str, parents) -> bool:
    """Whether every use of ``name`` outside its loops is as another loop's target (``for _ in ...`` twice)."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Name) and n.id == name:
            owner = next((p for p in _ancestors(n, parents) if isinstance(p, ast.For)
                          and isinstance(p.target, ast.Name) and p.target.id == name), None)
            if owner is None:
                return False
    return True


def _ancestors(node, parents):
    while node is not None:
        yield node
        node = parents.get(node)


def _range_parts(loop: Any) -> tuple[Any, Any]:
    args = loop.iter.args
    return (ast.Constant(0), args[0]) if len(args) == 1 else (args[0], args[1])


def _measure(plan: _Plan, kernel, args: list, dims: tuple[int, ...]) -> list[int]:
    """Each loop's largest trip count over the launch's threads, from a counting twin run on copies."""
    counter = _counting_twin(plan)
    uses = kernel_array_uses(kernel)
    copies = []
    for p, a in zip(kernel.adj.args, args):
        writes = isinstance(a, wp.array) and p.label in uses and uses[p.label].writes
        copies.append(wp.clone(a) if writes else a)
    device = next((a.device for a in args if isinstance(a, wp.array)), None)
    trips = wp.zeros(max(plan.loops, 1), dtype=wp.int32, device=device)
    wp.launch(counter, dims, inputs=[*copies, trips], device=device)
    return [int(t) for t in trips.numpy()[:plan.loops]]


_TRIPS = f"{_PREFIX}trips"


def _count_loops(fn: Any, first: int) -> None:
    """Instrument ``fn``'s loops (ids from ``first``): each records its trip count into ``wnbound_trips``."""
    wp_ = _twins.WP_NAME
    loop: Any
    for j, loop in enumerate(_loops_of(fn), start=first):
        if isinstance(loop, ast.For):
            start, stop = _range_parts(loop)
            step = _step(loop)
            a, b = f"{_PREFIX}a{j}", f"{_PREFIX}b{j}"
            span = f"{b} - {a} + {step - 1}" if step > 0 else f"{a} - {b} + {-step - 1}"
            before = ast.parse(f"{a} = int({ast.unparse(start)})\n{b} = int({ast.unparse(stop)})\n"
                               f"{wp_}.atomic_max({_TRIPS}, {j}, max(0, ({span}) // {abs(step)}))").body
            call: Any = loop.iter
            call.args = [ast.Name(a, ast.Load()), ast.Name(b, ast.Load()), *call.args[2:]]
        else:
            c = f"{_PREFIX}c{j}"
            before = ast.parse(f"{c} = int(0)").body
            loop.body[:0] = ast.parse(f"{c} = {c} + 1\n{wp_}.atomic_max({_TRIPS}, {j}, {c})").body
        _splice(fn, loop, before, keep=True)
    ast.fix_missing_locations(fn)


def _call_twins(body: _Body, fn: ast.FunctionDef, plan: _Plan, twins: list, extra_args: list[str]) -> dict[str, Any]:
    """Point the calls in ``fn`` (``body``'s tree, rewritten) of the planned functions at their twins (those built
    so far, callees first); the names the twin's source needs."""
    names = _access._names_visible_to(body.owner.func)
    found = {}
    for call, i in _looped_calls(fn, names, [f.owner for f in plan.functions[:len(twins)]]):
        call.func = ast.Name(f"{_PREFIX}f{i}", ast.Load())
        call.args = [*call.args, *(ast.Name(a, ast.Load()) for a in extra_args)]
        found[f"{_PREFIX}f{i}"] = twins[i]
    ast.fix_missing_locations(fn)
    return found


def _function_twin(body: _Body, fn: ast.FunctionDef, kind: str, extra: dict, names: dict):
    f = body.owner
    annotations = {**{k: v for k, v in f.adj.arg_types.items() if k != "return"}, **extra}
    if "return" in f.adj.arg_types:
        annotations["return"] = f.adj.arg_types["return"]
    name = f"{fn.name}__{kind}"
    params = [k for k in annotations if k != "return"]
    source = f"def {name}({', '.join(params)}):\n" + "".join(
        f"    {line}\n" for line in ast.unparse(ast.Module(body=fn.body, type_ignores=[])).splitlines())
    return _twins.function_from_source(f, source, name, annotations, key=f"{f.key}__{kind}", names=names)


@functools.lru_cache(maxsize=256)
def _counting_twin(plan: _Plan):
    trips: dict[str, Any] = {_TRIPS: wp.array(dtype=wp.int32)}
    first = plan.kernel.loops
    twins: list[Any] = []
    for body in plan.functions:
        fn = _twins.copy_tree(body.fn, body.owner)
        _count_loops(fn, first)
        first += body.loops
        names = _call_twins(body, fn, plan, twins, [_TRIPS])
        twins.append(_function_twin(body, fn, "wnbound_count", trips, names))
    fn = _twins.copy_tree(plan.kernel.fn, plan.kernel.owner)
    _count_loops(fn, 0)
    names = _call_twins(plan.kernel, fn, plan, twins, [_TRIPS])
    kernel = plan.kernel.owner
    params = [p.label for p in kernel.adj.args]
    annotations = {**{k: v for k, v in kernel.adj.arg_types.items() if k != "return"}, **trips}
    return _batched.twin_from_body(kernel, [*params, _TRIPS], fn.body, "warpnn_bound_count", annotations=annotations,
                                   key=f"{kernel.key}__wnbound_count", options={"enable_backward": False},
                                   names=names)


@functools.lru_cache(maxsize=256)
def _unrolled_twin(plan: _Plan, bounds: tuple[int, ...], limit: int):
    digest = hashlib.sha1(repr(bounds).encode()).hexdigest()[:10]
    kernel = plan.kernel.owner
    try:
        first = plan.kernel.loops
        twins: list[Any] = []
        for body in plan.functions:
            fn = _twins.copy_tree(body.fn, body.owner)
            _unroll_loops(fn, bounds[first:first + body.loops])
            first += body.loops
            names = _call_twins(body, fn, plan, twins, [])
            twins.append(_function_twin(body, fn, f"wnbounded_{digest}", {}, names))
        fn = _twins.copy_tree(plan.kernel.fn, kernel)
        _unroll_loops(fn, bounds[:plan.kernel.loops])
        names = _call_twins(plan.kernel, fn, plan, twins, [])
        params = [p.label for p in kernel.adj.args]
        return _batched.twin_from_body(kernel, params, fn.body, f"warpnn_bounded_{digest}",
                                       key=f"{kernel.key}{KEY_MARK}{digest}", options={"enable_backward": True},
                                       module_options={"enable_backward": True, "max_unroll": limit}, names=names)
    except Exception:  # noqa: BLE001 - Warp cannot build the rewritten code: no twin, the refusal stands
        return None


def _unroll_loops(fn: ast.FunctionDef, bounds: tuple[int, ...]) -> None:
    loops = _loops_of(fn)
    # Innermost first: an outer loop's body then holds the inner loop already rewritten (and its flags).
    depth = {id(loop): sum(1 for other in loops if other is not loop and _contains(other, loop)) for loop in loops}
    for j in sorted(range(len(loops)), key=lambda k: -depth[id(loops[k])]):
        _splice(fn, loops[j], _bounded_loop(loops[j], j, bounds[j]), keep=False)
    ast.fix_missing_locations(fn)


def _contains(outer: ast.AST, inner: ast.AST) -> bool:
    return any(n is inner for n in ast.walk(outer))


def _one(source: str) -> Any:
    """The one statement ``source`` parses to."""
    return ast.parse(source).body[0]


def _splice(fn: ast.FunctionDef, target: Any, statements: list[Any], keep: bool) -> None:
    """Put ``statements`` before ``target`` (``keep``) or in its place, in the block that holds it."""
    for node in ast.walk(fn):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if isinstance(block, list) and any(s is target for s in block):
                i = next(k for k, s in enumerate(block) if s is target)
                block[i:i + (0 if keep else 1)] = statements
                return
    raise _NotBounded("a loop outside any block")


def _bounded_loop(loop: Any, j: int, bound: int) -> list[Any]:
    """``loop`` as ``bound`` guarded iterations of straight-line code (see the module's docstring)."""
    go, run, k = f"{_PREFIX}go{j}", f"{_PREFIX}run{j}", f"{_PREFIX}k{j}"
    breaks, continues = _exits_of(loop, ast.Break), _exits_of(loop, ast.Continue)
    body = _guarded(loop.body, go, run) if breaks or continues else list(loop.body)
    if breaks or continues:
        body = [*ast.parse(f"{go} = True").body, *body]
    if isinstance(loop, ast.For):
        start, stop = _range_parts(loop)
        step = _step(loop)
        target: Any = loop.target
        a, b, v = f"{_PREFIX}a{j}", f"{_PREFIX}b{j}", target.id
        head = ast.parse(f"{a} = int({ast.unparse(start)})\n{b} = int({ast.unparse(stop)})").body
        inside = _one(f"if {v} {'<' if step > 0 else '>'} {b}:\n    pass")
        inside.body = body
        iteration = [*ast.parse(f"{v} = {a} + {k} * {step}").body, inside]
    else:
        head = []
        inside = _one(f"if {ast.unparse(loop.test)}:\n    pass\nelse:\n    {run} = False")
        inside.body = body
        iteration = [inside]
    if breaks or isinstance(loop, ast.While):
        head += ast.parse(f"{run} = True").body
        guard = _one(f"if {run}:\n    pass")
        guard.body = iteration
        iteration = [guard]
    unrolled = _one(f"for {k} in range({bound}):\n    pass")
    unrolled.body = iteration
    return [*head, unrolled]


def _guarded(stmts: list[Any], go: str, run: str) -> list[Any]:
    """``stmts`` with this loop's ``continue`` / ``break`` as flags, and what follows one under ``if go``."""
    out: list[ast.stmt] = []
    for i, s in enumerate(stmts):
        leaves = bool(_exits_of_block([s], ast.Break) or _exits_of_block([s], ast.Continue))
        out += _without_exits(s, go, run)
        rest = stmts[i + 1:]
        if rest and leaves:
            guard = _one(f"if {go}:\n    pass")
            guard.body = _guarded(rest, go, run)
            out.append(guard)
            break
    return out or [ast.Pass()]


def _exits_of_block(stmts, kind) -> list[ast.stmt]:
    holder = ast.While(test=ast.Constant(True), body=list(stmts), orelse=[])
    return _exits_of(holder, kind)


def _without_exits(s: Any, go: str, run: str) -> list[Any]:
    if isinstance(s, ast.Continue):
        return ast.parse(f"{go} = False").body
    if isinstance(s, ast.Break):
        return ast.parse(f"{go} = False\n{run} = False").body
    if isinstance(s, ast.If):
        s.body = _guarded(s.body, go, run)
        s.orelse = _guarded(s.orelse, go, run) if s.orelse else []
        return [s]
    if isinstance(s, ast.With):
        s.body = _guarded(s.body, go, run)
        return [s]
    return [s]


__all__ = ["bounded", "has_dynamic_loops"]
