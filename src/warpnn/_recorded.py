"""Values atomics return, recorded by the forward launch for its adjoint.

``slot = wp.atomic_add(count, 0, 1); out[slot] = f(x)`` takes the next free slot (mujoco_warp allocates each
actuator's row of the sparse moment matrix and each contact so). Warp's adjoint kernel runs the forward code again
but not the atomics, so ``slot`` is not there when ``out[slot]`` is replayed and the gradient is wrong (``wp.Tape``
too; ``_access._replayless_value_problem`` refuses it). Which slot a thread got depends on the order the threads
ran in, so it cannot be recomputed; it can be remembered. The twin here writes each such value to an extra
integer array at the thread's own element and reads it back::

    wnrec_v0 = wp.atomic_add(count, 0, 1)
    wnrec_slots[i, 0] = wnrec_v0
    slot = wnrec_slots[i, 0]

In the forward launch the read gives the value just written. Warp's replay skips the atomic and the store but not
the read, and the launch tracer proves that each thread reads only what it wrote, once (``_owned.py``), so the
adjoint replays on the array's values after the launch: the slots the forward took. Handled: an assignment of an
integer array's atomic to one name, in the kernel's body outside loops, with ``wp.tid()`` assigned once at the
top; anything else keeps its refusal.
"""

from __future__ import annotations

import ast
import functools
from typing import Any

import warp as wp

from . import _access, _batched, _twins
from . import _warp_compat as wc

RECORD = "wnrec_slots"
_PREFIX = "wnrec_"
KEY_MARK = "__wnrecorded"  # a twin's key: its kernel's, then this (the tracer strips it to name the kernel)
_ATOMICS = {"atomic_add", "atomic_sub", "atomic_min", "atomic_max", "atomic_and", "atomic_or", "atomic_xor",
            "atomic_exch", "atomic_cas"}


def with_recorded_atomics(kernel, launch_ndim: int) -> tuple[Any, int] | None:
    """``(twin, sites)``: ``kernel`` with the values its atomics return recorded into a last parameter
    ``wnrec_slots`` (shape: the launch's ``launch_ndim`` dimensions, then ``sites``), or None where it has no such
    atomic or one this cannot record."""
    found = _twin(kernel)
    if found is None or found[0].adj.arg_types[RECORD].ndim != launch_ndim + 1:
        return None  # (wp.tid() unpacked into fewer names than the launch has dimensions)
    return found


def uses_atomic_values(kernel) -> bool:
    """Whether ``kernel``'s body assigns the value an atomic returns to a name (a look at the source only)."""
    fn = _batched.kernel_body(kernel, _PREFIX)
    return fn is not None and any(_atomic_value(s) is not None for s in ast.walk(fn) if isinstance(s, ast.stmt))


@functools.lru_cache(maxsize=256)
def _twin(kernel):
    fn = _batched.kernel_body(kernel, _PREFIX)
    if fn is None:
        return None
    fn = _twins.copy_tree(fn, kernel)
    integer_arrays = {a.label for a in kernel.adj.args
                      if wc.matches_array_class(a.type, wp.array) and a.type.dtype in (wp.int32, int)}
    tid = next((s for s in fn.body if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                and isinstance(s.value.func, ast.Attribute) and s.value.func.attr == "tid"), None)
    if tid is None:
        return None
    target: Any = tid.targets[0]
    tid_names = [t.id for t in (target.elts if isinstance(target, ast.Tuple) else [target]) if isinstance(t, ast.Name)]
    assigned = [n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    if any(assigned.count(n) != 1 for n in tid_names):
        return None
    loops = [n for n in ast.walk(fn) if isinstance(n, (ast.For, ast.While))]
    in_loop = {id(m) for loop in loops for m in ast.walk(loop)}
    sites = 0
    for node in list(ast.walk(fn)):
        for field in ("body", "orelse"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for i in range(len(block) - 1, -1, -1):
                statement = block[i]
                call = _atomic_value(statement)
                if call is None:
                    continue
                array = call.args[0] if call.args else None
                if id(statement) in in_loop or not (isinstance(array, ast.Name) and array.id in integer_arrays):
                    return None  # (a value from a loop or a float atomic: no record)
                index = ", ".join([*tid_names, str(sites)])
                value = f"{_access.RECORDED_VALUE_PREFIX}{sites}"
                rewritten = ast.parse(f"{value} = {ast.unparse(call)}\n{RECORD}[{index}] = {value}\n"
                                      f"{statement.targets[0].id} = {RECORD}[{index}]").body
                block[i:i + 1] = rewritten
                sites += 1
    if not sites:
        return None
    ast.fix_missing_locations(fn)
    params = [p.label for p in kernel.adj.args]
    annotations = {**{k: v for k, v in kernel.adj.arg_types.items() if k != "return"},
                   RECORD: wp.array(dtype=wp.int32, ndim=len(tid_names) + 1)}
    try:
        twin = _batched.twin_from_body(kernel, [*params, RECORD], fn.body, "warpnn_recorded", annotations=annotations,
                                       key=f"{kernel.key}{KEY_MARK}")
    except Exception:  # noqa: BLE001 - Warp cannot build the rewritten code: no twin, the refusal stands
        return None
    return twin, sites


def _atomic_value(statement: ast.stmt) -> ast.Call | None:
    """The atomic call whose value ``statement`` assigns to one name, else None."""
    if not (isinstance(statement, ast.Assign) and len(statement.targets) == 1
            and isinstance(statement.targets[0], ast.Name) and isinstance(statement.value, ast.Call)):
        return None
    f = statement.value.func
    name = f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in (
        "wp", _twins.WP_NAME) else None
    return statement.value if name in _ATOMICS else None


__all__ = ["RECORD", "uses_atomic_values", "with_recorded_atomics"]
