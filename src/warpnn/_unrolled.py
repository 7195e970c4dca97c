"""Adjoint twins with the loops a call fixes unrolled: the right gradient where Warp's adjoint of a dynamic loop is
wrong.

Warp unrolls a ``for`` loop over a ``range`` of constants (up to the module's ``max_unroll`` iterations): each
iteration is straight-line code, and its adjoint is right. Any other loop is dynamic, and Warp's adjoint of it does
not run the loop again before its reverse pass (``end_for`` / ``end_while`` in ``warp/_src/codegen.py``): a value
the loop carries is seen, in the reverse pass, as it was before the loop. ``s = 0.0; for j in range(n): s += x[j] *
x[j]; out[0] = s * s`` gets d/dx = 0 from Warp's tape. warpnn's facts (``_access._loop_problem``) find such loops
and the call is refused, never differentiated wrong.

Many such loops are dynamic only because their bound is an argument: ``range(n)`` over an ``int`` parameter, or
``range(x.shape[0])``. For one call both are known, and fixed: the call's scalar arguments and its arrays' shapes
are static to XLA. This twin of the kernel substitutes them as constants, so that Warp unrolls those loops (its
``max_unroll`` raised to ``$WARPNN_MAX_UNROLL``), and its adjoint launches in place of the kernel's. The forward
keeps launching the kernel itself. The same facts then decide on the twin as on any kernel: a loop the
substitution does not fix (a bound read from an array, a ``while`` loop, one inside a ``@wp.func``, one longer than
the limit) leaves its problem in the twin's facts, and the call is refused with the kernel's own reasons. The
twin of a kernel a launch-time proof placed the accesses of (``_owned.py``: its elements owned) keeps the proof:
its accesses are the kernel's, with this call's values in place of the names.

The twin is generated source (the substituted function, unparsed), so the twins built from it in turn (batched,
row-loop, spread, pruned) keep the unrolling. Substituted: ``int`` (``int32``) parameters the body never assigns,
and ``x.shape[k]`` of array parameters the body never assigns, at a constant ``k`` (both ``int32`` in Warp, like
the literal that replaces them).
"""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Mapping
from typing import Any

import warp as wp

from . import _access, _batched, _settings, _twins
from ._signature import KernelSignature, signature_of

MAX_UNROLL_ENV = "WARPNN_MAX_UNROLL"
_PREFIX = "wnunrolled_"
_SUFFIX = "__wnunrolled"


def adjoint_signature(sig: KernelSignature, scalars: Mapping[str, Any],
                      shapes: Mapping[str, tuple[int, ...]]) -> tuple[KernelSignature, list[str]]:
    """The signature whose adjoint a call of ``sig`` launches, and why reverse mode refuses it (empty: it may).

    ``scalars``: the call's scalar arguments by name; ``shapes``: its arrays' JAX shapes by name. Where the kernel's
    only problems are loops that the twin with these values unrolls (see the module's docstring), that twin's
    signature, with no reason; else ``sig`` and its own reasons.
    """
    reasons = sig.reverse_refusal_reasons()
    if not reasons or sig.reverse_problems or type(sig) is not KernelSignature:
        return sig, reasons
    twin = unrolled(sig, scalars, shapes)
    if twin is None or twin.reverse_refusal_reasons():
        return sig, reasons
    return twin, []


def unrolled(sig: KernelSignature, scalars: Mapping[str, Any],
             shapes: Mapping[str, tuple[int, ...]]) -> KernelSignature | None:
    """The signature of ``sig``'s twin with the call's ``int`` scalars and array shapes as constants (its loops
    over them unrolled), or None where the kernel uses none of them or has no source to rewrite."""
    specs = {s.name: s for s in (*sig.inputs, *sig.outputs)}
    constants: dict[str, int] = {}
    for name, value in scalars.items():
        spec = specs.get(name)
        if spec is not None and not spec.is_array and spec.warp_type in (int, wp.int32):
            constants[name] = int(value)
    dims: dict[tuple[str, int], int] = {}
    for name, shape in shapes.items():
        spec = specs.get(name)
        if spec is not None and spec.is_array and not spec.is_struct:
            dims.update({(name, k): int(d) for k, d in enumerate(tuple(shape)[: spec.warp_ndim])})
    twin = _twin(sig.kernel, tuple(sorted(constants.items())), tuple(sorted(dims.items())),
                 _settings.get(MAX_UNROLL_ENV))
    if twin is None:
        return None
    twin_sig = signature_of(twin, num_outputs=len(sig.outputs) + len(sig.in_out_names),
                            in_out_argnames=sig.in_out_names, block_dim=sig.block_dim)
    return twin_sig.variant(constant_inputs=sig.constant_inputs, null_inputs=sig.null_inputs)


class _Constants(ast.NodeTransformer):
    """Replaces reads of the given parameters, and ``x.shape[k]`` of the given arrays, by their values."""

    def __init__(self, scalars: dict[str, int], dims: dict[tuple[str, int], int]):
        self.scalars, self.dims = scalars, dims
        self.replaced = 0

    def visit_Name(self, node: ast.Name) -> ast.AST:
        if isinstance(node.ctx, ast.Load) and node.id in self.scalars:
            self.replaced += 1
            return ast.copy_location(ast.Constant(self.scalars[node.id]), node)
        return node

    def visit_Subscript(self, node: ast.Subscript) -> ast.AST:
        value, index = node.value, node.slice
        if (isinstance(value, ast.Attribute) and value.attr == "shape" and isinstance(value.value, ast.Name)
                and isinstance(index, ast.Constant) and isinstance(index.value, int)
                and (value.value.id, index.value) in self.dims and isinstance(node.ctx, ast.Load)):
            self.replaced += 1
            return ast.copy_location(ast.Constant(self.dims[(value.value.id, index.value)]), node)
        return self.generic_visit(node)


@functools.lru_cache(maxsize=256)
def _twin(kernel, scalars: tuple[tuple[str, int], ...], dims: tuple[tuple[tuple[str, int], int], ...],
          max_unroll: int):
    fn = _batched.kernel_body(kernel, _PREFIX)
    if fn is None:
        return None
    assigned = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    assigned |= {a.arg for n in ast.walk(fn) if isinstance(n, ast.Lambda) for a in n.args.args}
    transformer = _Constants({n: v for n, v in scalars if n not in assigned},
                             {k: v for k, v in dims if k[0] not in assigned})
    body = [transformer.visit(stmt) for stmt in _twins.copy_tree(fn, kernel).body]
    if not transformer.replaced:
        return None
    params = [p.label for p in kernel.adj.args]
    values = hashlib.sha1(repr((scalars, dims)).encode()).hexdigest()[:10]  # (the same key in every process)
    # A module per twin (values in its name): a kernel added to a module Warp has loaded makes it rebuild the module
    # and unload the code of the twins already launched from it.
    twin = _batched.twin_from_body(kernel, params, body, f"warpnn_unrolled_{values}",
                                   key=f"{kernel.key}{_SUFFIX}_{values}", options={"enable_backward": True},
                                   module_options={"enable_backward": True, "max_unroll": max_unroll})
    owned = _access.declared_elements_owned(kernel)
    if owned is not None:  # (a launch-time proof's twin: the same accesses with this call's values in the bounds)
        _access.declare_elements_owned(twin, *owned)
    return twin


def is_unrolled(kernel) -> bool:
    """Whether ``kernel`` is a twin this module built."""
    return _SUFFIX in kernel.key


__all__ = ["MAX_UNROLL_ENV", "adjoint_signature", "is_unrolled", "unrolled"]
