"""Adjoint twins that measure arrays first, for kernels whose Warp adjoint would index an array's adjoint unwrapped.

Warp's adjoint of ``x.shape`` *assigns* the shape of ``x``'s adjoint array (``adj_x.shape = adj_k``, a zeroed shape:
``emit_Attribute`` in ``warp/_src/codegen.py``), at the measurement's place in the reverse pass. The adjoints of the
accesses the forward made before the measurement run after it and index ``x``'s adjoint with a zero shape, which
only matters for Warp's wrap of negative indices (``x[i - 1]`` at ``i = 0`` is the last element): unwrapped, the
adjoint adds before the buffer. Through warpnn, a kernel as plain as ``out[i] = x[i - 1] * float(x.shape[0])`` died
of heap corruption when differentiated (``tests/test_measured.py``); so does Warp's own tape. A measurement inside a
loop does the same to the accesses of the loop's earlier iterations.

For such a kernel the bridge launches the adjoint of a twin (compiled from the kernel's source into a module of its
own, like the other twins) that reads each ``x.shape[k]`` once before the body: the forward is the same, and the
measurement's adjoint runs after every other. The kernel's own forward launches are unchanged.

Not covered (Warp's behaviour, as with its tape): a ``@wp.func`` that measures an array it is given (its adjoint
gets ``adj_x`` by reference), ``x.shape`` other than at a constant index, and ``x.ptr`` (whose adjoint resets the
adjoint's data pointer).
"""

from __future__ import annotations

import ast
import functools

import warp as wp

from . import _batched
from . import _twins
from . import _warp_compat as wc
from ._signature import KernelSignature, signature_of

_PREFIX = "wnmeasure_"
_SUFFIX = "__wnmeasured"


def measured_first(sig: KernelSignature) -> KernelSignature:
    """``sig``, or the signature of its twin that measures arrays before anything else where Warp's adjoint of the
    kernel would measure an array after using it (see the module's docstring)."""
    if type(sig) is not KernelSignature:  # checked mode's signatures keep their own kernel
        return sig
    twin = _measuring_twin(sig.kernel)
    if twin is None:
        return sig
    twin_sig = signature_of(twin, num_outputs=len(sig.outputs) + len(sig.in_out_names),
                            in_out_argnames=sig.in_out_names, block_dim=sig.block_dim)
    return twin_sig.variant(constant_inputs=sig.constant_inputs, null_inputs=sig.null_inputs)


def measures_after_use(fn: ast.FunctionDef, arrays: frozenset[str]) -> frozenset[str]:
    """The arrays of ``arrays`` that the body measures (``x.shape``) in a statement at or after one that uses them
    otherwise, or inside a loop's body: those whose adjoint Warp resets before the adjoints of some of their
    accesses. Conservative at the granularity of top-level statements (a ``for`` loop's range, evaluated once
    before the loop, counts as a statement of its own)."""

    def measured(node: ast.AST) -> set[str]:
        return {n.value.id for n in ast.walk(node)
                if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in arrays}

    def used(node: ast.AST) -> set[str]:
        measurements = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Attribute)}
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in arrays and id(n) not in measurements}

    units: list[tuple[ast.AST, bool]] = []  # (code in evaluation order, whether it repeats)
    for stmt in fn.body:
        if isinstance(stmt, ast.For):
            units += [(stmt.iter, False), (ast.Module(body=[*stmt.body, *stmt.orelse], type_ignores=[]), True)]
        else:
            units.append((stmt, isinstance(stmt, ast.While) or any(isinstance(n, (ast.For, ast.While)) for n in ast.walk(stmt))))
    before: set[str] = set()
    late: set[str] = set()
    for code, repeats in units:
        here = used(code)
        late |= {x for x in measured(code) if repeats or x in before or x in here}
        before |= here
    return frozenset(late)


@functools.cache
def _measuring_twin(kernel):
    fn = _batched.kernel_body(kernel, _PREFIX)
    if fn is None:
        return None
    arg_types = dict(kernel.adj.arg_types)
    arg_types.pop("return", None)
    # float arrays only: Warp's adjoint adds nothing into an integer array's adjoint
    arrays = frozenset(n for n, t in arg_types.items()
                       if wc.matches_array_class(t, wp.array) and wc.type_scalar_type(t.dtype) in wc.float_types)
    late = measures_after_use(fn, arrays)
    if not late:
        return None
    hoister = _batched._HoistShapes(late, prefix=_PREFIX)
    body = [hoister.visit(stmt) for stmt in _twins.copy_tree(fn, kernel).body]
    docstring = body[:1] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else []
    remaining = {n.value.id for stmt in body for n in ast.walk(stmt)
                 if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in late}
    if remaining:  # measured other than at a constant dim (x.shape passed on, x.ptr): cannot be moved
        return None
    prologue = [f"{local} = {name}.shape[{k}]" for (name, k), local in hoister.names.items()]
    name = f"{fn.name}{_SUFFIX}"
    lines = lambda stmts: ast.unparse(ast.Module(body=stmts, type_ignores=[])).splitlines()  # noqa: E731
    source = "\n".join([f"def {name}({', '.join(arg_types)}):",
                        *("    " + line for line in [*lines(docstring), *prologue, *lines(body[len(docstring):])])])
    return _twins.kernel_from_source(kernel, source + "\n", name, dict(arg_types), key=f"{kernel.key}{_SUFFIX}",
                                        kind="warpnn_measured")
