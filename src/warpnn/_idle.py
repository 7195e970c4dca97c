"""Launches the program's constants keep idle: every thread leaves before it does anything.

mujoco_warp launches some kernels whatever the model holds, and their threads leave at once where the model gives
them nothing to do: ``_friction_tendon`` where no tendon has friction loss, ``_tendon_armature`` and ``_tendon_dot``
where no tendon has armature. Such a launch writes nothing, but its kernel may be one whose adjoint Warp gets
wrong (a ``while`` loop, a value an atomic returned), and reverse mode would refuse the program for it.

The proof, per launch: the kernel's leading statements, those every thread runs in order before anything else
(``wp.tid()``, assignments of values the program's constants fix, and ``if <such a test>: return``), run as a
*probe* over the launch's threads, which counts the threads that get past them. The values are those of
``_bounded._Clean`` (the thread index, scalar arguments, shapes, literals, loads of constant arrays at such
indices), plus calls of ``@wp.func``\\ s that take only such values and constant arrays (an array the kernel
does not write, through any function, and nothing wrote before this launch or takes as an input: the function
computes the same value in every replay). The probe runs only those statements, as the kernel does, so it loads
nothing the kernel would not.

No thread past them: no launch of this kernel with these constants does anything in any replay, and it replays as
a twin with the kernel's parameters and an empty body, whose adjoint passes every array through unchanged. The
tracer checks at the end of the trace that nothing wrote the arrays the probe read; where something did, the
launch keeps its kernel (and its refusal).
"""

from __future__ import annotations

import ast
import functools
from typing import Any, Callable

import warp as wp

from . import _batched, _twins
from ._bounded import _Clean, _user_function
from ._owned import _constant_params

_PREFIX = "wnidle_"
KEY_MARK = "__wnidle"  # an idle twin's key: its kernel's, then this (the tracer strips it to name the kernel)


class _Prefix(_Clean):
    """The values the kernel's leading statements compute that the constants fix, followed in order: a name is
    known where its last assignment so far was of a known value (a later rebinding does not matter there)."""

    def __init__(self, kernel, fn: ast.FunctionDef, constants: frozenset[str]):
        self.known: set[str] = set()
        super().__init__(kernel, fn, constants)
        self.known = {n for n, t in self.params.items() if wp.types.type_is_value(t)}  # (the launch's scalars)
        self.loads = set()  # (those of the prefix alone)

    def expr(self, e: Any) -> bool:
        if isinstance(e, ast.Name) and e.id in self.locals:
            return e.id in self.known
        if isinstance(e, ast.Call) and _user_function(e.func, self.globals) is not None:
            arrays = {a.id for a in e.args if isinstance(a, ast.Name) and a.id in self.constants}
            if e.keywords or not all((isinstance(a, ast.Name) and a.id in arrays) or self.expr(a) for a in e.args):
                return False
            self.loads |= arrays  # (the function may read them anywhere)
            return True
        return super().expr(e)


def _is_tid(stmt: ast.stmt) -> bool:
    value = getattr(stmt, "value", None)
    return isinstance(stmt, ast.Assign) and isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) \
        and value.func.attr == "tid"


def _guard_prefix(kernel, constants: frozenset[str]) -> tuple[list[str], frozenset[str]] | None:
    """The probe's lines for ``kernel``'s leading statements up to its last guard, and the constant arrays they
    load; None where the kernel does not begin with such a guard."""
    fn = _batched.kernel_body(kernel, _PREFIX)
    if fn is None:
        return None
    fn = _twins.copy_tree(fn, kernel)
    values = _Prefix(kernel, fn, constants)
    lines: list[str] = []
    guarded, loads = 0, frozenset[str]()
    for stmt in fn.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring
        if _is_tid(stmt):
            names = [t.id for t in ast.walk(stmt.targets[0]) if isinstance(t, ast.Name)]
            if len(stmt.targets) != 1 or not names:
                break
            values.known |= set(names)
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            plain = all(isinstance(t, ast.Name) or (isinstance(t, ast.Tuple) and all(
                isinstance(e, ast.Name) for e in t.elts)) for t in targets)
            if not plain or not values.expr(stmt.value):
                break
            values.known |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1 \
                and isinstance(stmt.body[0], ast.Return) and stmt.body[0].value is None and values.expr(stmt.test):
            guarded, loads = len(lines) + 1, frozenset(values.loads)
        else:
            break
        lines.append(ast.unparse(stmt))
    if not guarded:
        return None
    return lines[:guarded], loads


@functools.lru_cache(maxsize=256)
def _probe(kernel, constants: frozenset[str]) -> tuple[Any, frozenset[str]] | None:
    """A kernel that runs ``kernel``'s guard prefix and counts the threads past it, and the arrays it loads."""
    found = _guard_prefix(kernel, constants)
    if found is None:
        return None
    lines, loads = found
    annotations = {**{a.label: a.type for a in kernel.adj.args}, f"{_PREFIX}past": wp.array(dtype=wp.int32)}
    name = f"{_PREFIX}probe"
    body = [*lines, f"{_twins.WP_NAME}.atomic_add({_PREFIX}past, 0, 1)"]
    source = f"def {name}({', '.join(annotations)}):\n" + "".join(
        f"    {line}\n" for statement in body for line in statement.splitlines())
    probe = _twins.kernel_from_source(kernel, source, name, annotations, key=f"{kernel.key}__wnidle_probe",
                                      kind="warpnn_idle_probe", options={"enable_backward": False})
    return probe, loads


def idle(kernel, args: list, dims: tuple[int, ...], constant: Callable[[Any], bool]):
    """The arrays the proof read where no thread of this launch of ``kernel`` (``args`` over ``dims``) gets past
    the guards the constants decide (the launch then replays as ``idle_twin(kernel)`` while those arrays stay
    constant); None otherwise (no such guard, a thread past it, a probe Warp cannot build)."""
    by_name = dict(zip((a.label for a in kernel.adj.args), args))
    constants = frozenset(_constant_params(kernel, args, constant))
    device = next((a.device for a in args if isinstance(a, wp.array)), None)
    try:
        found = _probe(kernel, constants)
        if found is None:
            return None
        probe, loads = found
        past = wp.zeros(1, dtype=wp.int32, device=device)
        wp.launch(probe, dims, inputs=[*args], outputs=[past], device=device)
        if int(past.numpy()[0]) != 0:
            return None
    except Exception:  # noqa: BLE001 - a probe Warp cannot build or run: no proof, the refusal stands
        return None
    return [by_name[n] for n in sorted(loads)]


@functools.lru_cache(maxsize=256)
def idle_twin(kernel):
    """``kernel``'s parameters, an empty body: a launch that writes nothing, whose adjoint passes arrays through."""
    annotations = {a.label: a.type for a in kernel.adj.args}
    name = f"{_PREFIX}kernel"
    source = f"def {name}({', '.join(annotations)}):\n    pass\n"
    return _twins.kernel_from_source(kernel, source, name, annotations, key=f"{kernel.key}{KEY_MARK}",
                                     kind="warpnn_idle")
