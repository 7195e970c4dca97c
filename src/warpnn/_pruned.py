"""Adjoint twins of kernels without the outputs whose cotangent is zero, so unused outputs add nothing backward.

Warp's adjoint differentiates every statement of a kernel. When JAX needs the gradient of only some outputs, the
others get a zero cotangent, and ``0 * d(out)/d(x)`` is NaN wherever that partial is infinite or NaN
(``b = x; a = sqrt(x)`` at ``x = 0``: pure JAX gives ``db/dx = 1``, Warp's adjoint ``0 * inf + 1 = nan``). The
twin built here is the same kernel with the stores into those outputs removed, and then every assignment whose
value nothing reads any more (so the unused computation is gone from its adjoint too), compiled from the same
source through Warp's ``code_transformers`` into a module of its own (the user's module is never touched).
Its parameters are the original's, so the adjoint call's buffers do not change.
"""

from __future__ import annotations

import ast
import dataclasses
import functools


from ._access import _ACCUMULATE_BUILTINS, _READ_WRITE_BUILTINS, _STORE_BUILTINS, _callee_name
from ._signature import KernelSignature
from ._twins import twin_of

_WRITING_BUILTINS = _ACCUMULATE_BUILTINS | _READ_WRITE_BUILTINS | _STORE_BUILTINS


class _DropOutputs(ast.NodeTransformer):
    """Removes the stores into ``names``, then assignments nothing reads and that call nothing that may write."""

    def __init__(self, names: frozenset[str], fn_globals: dict):
        self.names = names
        self.globals = fn_globals

    def visit_Module(self, node: ast.Module) -> ast.Module:
        fn = next(n for n in ast.walk(node) if isinstance(n, ast.FunctionDef))
        fn.body = self._prune(fn.body, store=True) or [ast.Pass()]
        while True:  # dead assignments, until none is left
            loaded = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            before = ast.dump(fn)
            fn.body = self._prune(fn.body, store=False, loaded=loaded) or [ast.Pass()]
            if ast.dump(fn) == before:
                return node

    def _prune(self, stmts, store: bool, loaded=frozenset()):
        kept = []
        for stmt in stmts:
            if store and self._stores_dropped(stmt):
                continue
            if not store and self._dead(stmt, loaded):
                continue
            for field in ("body", "orelse"):
                if isinstance(getattr(stmt, field, None), list) and not isinstance(stmt, ast.FunctionDef):
                    setattr(stmt, field, self._prune(getattr(stmt, field), store, loaded) or
                            ([ast.Pass()] if field == "body" else []))
            kept.append(stmt)
        return kept

    def _base_name(self, node):
        while isinstance(node, ast.Subscript):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def _stores_dropped(self, stmt) -> bool:
        if isinstance(stmt, ast.Assign):
            return all(self._base_name(t) in self.names for t in stmt.targets)
        if isinstance(stmt, ast.AugAssign):
            return self._base_name(stmt.target) in self.names
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and stmt.value.args:
            call = stmt.value
            return _callee_name(call.func) in _WRITING_BUILTINS and self._base_name(call.args[0]) in self.names
        return False

    def _dead(self, stmt, loaded) -> bool:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            return False
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        names = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        if not all(isinstance(n, ast.Name) and n.id not in loaded for n in names):
            return False
        return all(self._pure(call) for call in ast.walk(stmt.value) if isinstance(call, ast.Call))

    def _pure(self, call: ast.Call) -> bool:
        """Warp builtins other than the writing ones have no side effects; anything else might."""
        name = _callee_name(call.func)
        if name in _WRITING_BUILTINS or name == "tid":
            return name == "tid"
        target = None
        if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name):
            target = getattr(self.globals.get(call.func.value.id), call.func.attr, None)
        elif isinstance(call.func, ast.Name):
            target = self.globals.get(call.func.id)
        return target is not None and hasattr(target, "is_builtin") and target.is_builtin()


@functools.cache
def _pruned_kernel(kernel, names: frozenset[str]):
    without = "_".join(sorted(names))
    return twin_of(kernel, f"warpnn_pruned_{without}", key=f"{kernel.key}__without_{without}",
                   code_transformers=[_DropOutputs(names, kernel.func.__globals__)])


def without_outputs(sig: KernelSignature, names: frozenset[str]) -> KernelSignature:
    """``sig`` whose adjoint launches the twin of its kernel without the outputs ``names`` (one per set)."""
    names = frozenset(names) & {s.name for s in sig.outputs}
    if not names:
        return sig
    cache = sig.__dict__.setdefault("_pruned", {})
    found = cache.get(names)
    if found is None:
        found = cache[names] = dataclasses.replace(sig, kernel=_pruned_kernel(sig.kernel, names))
        found.__dict__["_base"] = sig._base  # the original's analysis (uses) and variants
    return found
