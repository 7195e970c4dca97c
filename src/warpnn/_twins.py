"""The twins' one builder: a Warp kernel made from another for warpnn's own use, in a module of its own.

Every variant warpnn launches in place of a user's kernel is built here: the batched and row-loop twins, the
measured-first, spread, reordered and merged kernels (``_batched``, ``_measured``, ``_spread``, ``_reach``:
generated source), and the twins that keep the kernel's own code (checked mode's guarded kernel, the pruned
adjoint, the rebuilt adjoint). One rule for all of them: a twin lives in a module named after its kind and its
kernel, never in the kernel's own module (adding a kernel there would make Warp rebuild the module and unload
the code already loaded), and inherits the kernel's and its module's options, less what the kind changes.
"""

from __future__ import annotations

import ast
import hashlib
import threading
import types
from typing import Any

import warp as wp

from ._access import warp_builds_adjoint

WP_NAME = "warpnn_wp"  # the name generated source uses for the warp module (a user's kernel may shadow `wp`)


def copy_tree(node, kernel):
    """A deep copy of (part of) ``kernel``'s AST for a twin to rewrite into generated source.

    When Warp builds a kernel it rewrites each ``wp.static()`` expression in the tree into its value: a Warp
    function becomes a ``__warp_func__`` name carrying the function (holding ctypes pointers, which
    ``copy.deepcopy`` cannot copy), any other object a constant. Those become ``wp.static(<its source>)`` again,
    for the twin's own build to evaluate with the kernel's names (mujoco_warp chooses its collision filters so: a
    kernel built before warpnn asked for its twin had none, and ran once per batch element under vmap)."""
    return _StaticExpressions(kernel).visit(_copy_nodes(node, {}))


def _copy_nodes(value, memo: dict):
    """``copy.deepcopy`` of an AST whose nodes' other attributes (Warp's resolved functions, constants) are kept,
    not copied: nodes and lists of them are new (a node reached twice is copied once), anything else is shared.
    (deepcopy with those attributes in its memo did the same, 3x slower: 0.23 s against 0.08 s over 73 kernels of
    mujoco_warp, Newton and warp.examples.)"""
    if isinstance(value, ast.AST):
        copied = memo.get(id(value))
        if copied is None:
            copied = memo[id(value)] = value.__class__.__new__(value.__class__)
            copied.__dict__.update({k: _copy_nodes(v, memo) for k, v in vars(value).items()})
        return copied
    if isinstance(value, list):
        return [_copy_nodes(v, memo) for v in value]
    return value


class _StaticExpressions(ast.NodeTransformer):
    def __init__(self, kernel):
        resolved = getattr(kernel.adj, "resolved_static_expressions", None) or {}
        self.source = {id(value): code for code, value in resolved.items()}

    def _static(self, node, value):
        code = self.source.get(id(value))
        if code is None:  # (not from wp.static(): left as it is, as before)
            return node
        return ast.copy_location(ast.parse(f"{WP_NAME}.static({code})", mode="eval").body, node)

    def visit_Name(self, node):
        if node.id == "__warp_func__" and hasattr(node, "warp_func"):
            return self._static(node, node.warp_func)
        return node

    def visit_Constant(self, node):
        if isinstance(node.value, (str, bytes, int, float, complex, bool, type(None), type(Ellipsis))):
            return node
        return self._static(node, node.value)


def twin_module(kernel, kind: str, *, module_options: dict | None = None):
    """The module of ``kernel``'s twin of ``kind``: its own, named after both, with the kernel's module's options
    (and ``module_options`` over them)."""
    name = f"{kind}.{kernel.module.name}.{kernel.key}"
    if len(name) > 120:  # (a twin of a twin of ...: Warp's cache directory is named after the module)
        name = f"{kind}.{kernel.key[:40]}.{hashlib.sha1(name.encode()).hexdigest()[:16]}"
    module = wp.get_module(name)
    # (warpnn's own options too, the equality guard's: a twin of a guarded twin, measured or pruned, stays guarded)
    module.options.update({k: v for k, v in kernel.module.options.items()
                           if k in module.options or k.startswith("warpnn_")})
    module.options.update(module_options or {})
    return module


def twin_of(kernel, kind: str, *, key: str, func=None, code_transformers=(), module_options: dict | None = None,
            options: dict | None = None):
    """A twin running ``kernel``'s own source (``func``: the Python function whose signature it takes, default the
    kernel's), rewritten by ``code_transformers``, with the kernel's options (``options`` over them)."""
    return wp.Kernel(func or kernel.func, key=key, module=twin_module(kernel, kind, module_options=module_options),
                     options={**kernel.options, **(options or {})}, code_transformers=list(code_transformers),
                     source=kernel.adj.source)  # the source the kernel was built from (it may be generated)


def kernel_from_source(kernel, source: str, name: str, annotations: dict, key: str, kind: str, *,
                       options: dict | None = None, module_options: dict | None = None, names: dict | None = None):
    """A twin built from ``source`` (a function ``name`` whose parameters are ``annotations``' keys, in order),
    resolving names as ``kernel`` does (plus ``warpnn_wp`` and ``names``), with ``kernel``'s options (``options``
    over them)."""
    func = _stub_function(kernel.func, name, list(annotations), names)
    func.__annotations__ = dict(annotations)
    return wp.Kernel(func, key=key, module=twin_module(kernel, kind, module_options=module_options),
                     options={**kernel.options, **(options or {})}, source=source)


def function_from_source(function, source: str, name: str, annotations: dict, key: str, *,
                         names: dict | None = None):
    """A ``@wp.func`` twin of ``function`` built from ``source`` (``name``, taking ``annotations``' keys; its
    ``"return"`` entry the value type), resolving names as ``function`` does (plus ``warpnn_wp`` and ``names``)."""
    from warp._src.context import Function

    func = _stub_function(function.func, name, [k for k in annotations if k != "return"], names)
    func.__annotations__ = dict(annotations)
    return Function(func=func, key=key, namespace="", module=wp.get_module(f"warpnn_function.{key}"),
                    value_func=None, source=source, scope_locals={})


def _stub_function(original, name: str, params: list[str], names: dict | None = None):
    """A Python function named ``name`` taking ``params``, with ``original``'s globals and closure cells, so
    Warp resolves every name of the generated source as it resolves the original kernel's (plus ``warpnn_wp``
    and ``names``, closure cells over the original's names)."""
    names = dict(names or {})
    # A kernel generated from a generated one (the batched twin of a reordered kernel) already has warpnn_wp.
    freevars = tuple(n for n in original.__code__.co_freevars if n != WP_NAME and n not in names)
    cell_names = (*freevars, WP_NAME, *names)
    inner_refs = "; ".join(cell_names) or "pass"
    factory_src = (
        f"def _factory({', '.join(cell_names)}):\n"
        f"    def {name}({', '.join(params)}):\n"
        f"        {inner_refs}\n"
        f"    return {name}\n"
    )
    namespace: dict[str, Any] = {}
    exec(compile(factory_src, f"<warpnn kernel generated from {original.__qualname__}>", "exec"), namespace)  # noqa: S102
    stub = namespace["_factory"](*([None] * len(cell_names)))
    cells = dict(zip(original.__code__.co_freevars, original.__closure__ or ()))
    cells[WP_NAME] = types.CellType(wp)
    cells.update({n: types.CellType(v) for n, v in names.items()})
    closure = tuple(cells[n] for n in stub.__code__.co_freevars)
    func = types.FunctionType(stub.__code__, original.__globals__, name, None, closure)
    func.__module__ = original.__module__
    func.__qualname__ = name
    # what the twin was made from, which _equality_guard follows to a declared kernel (not __wrapped__, which
    # inspect.signature would follow to the original's parameters)
    setattr(func, "__warpnn_made_from__", original)
    return func


# --------------------------------------------------------------------------------------------------
# The rebuilt adjoint
#
# A kernel compiled with enable_backward=False (on itself or its module: mujoco_warp builds 25 of its modules so)
# has no adjoint in its module. Its twin with the same source and enable_backward=True has Warp's adjoint of the
# same forward code; the forward keeps launching the kernel itself. Whether that adjoint is right is decided as
# for any kernel (the access facts and the loop facts of the same source), and a twin Warp cannot generate or
# compile is an error naming the kernel.

_REBUILT: dict[int, tuple[Any, Any]] = {}
_REBUILT_LOCK = threading.Lock()


def with_adjoint(kernel):
    """``kernel`` itself when Warp builds its adjoint, else its twin built with one (cached per kernel)."""
    if warp_builds_adjoint(kernel):
        return kernel
    with _REBUILT_LOCK:
        cached = _REBUILT.get(id(kernel))
        if cached is None or cached[0] is not kernel:
            twin = twin_of(kernel, "warpnn_adjoint", key=kernel.key, module_options={"enable_backward": True},
                           options={"enable_backward": True})
            cached = _REBUILT[id(kernel)] = (kernel, twin)
        return cached[1]
