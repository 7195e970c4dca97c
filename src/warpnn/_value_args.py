"""Vector, matrix, quaternion and transform arguments passed by value (``cam_pos: wp.vec3``), as their components.

Warp kernels take such values as arguments (Newton's inverse kinematics objectives, its ray casts and SDF builders,
mujoco_warp's sweep-and-prune broad phase, warp.examples' ray marcher), where Warp's own ``jax_kernel`` accepts
only arrays and scalars. Like every non-array argument they are static in a call (compile-time constants of the
launch: to trace or train one, pass a 1-element array). warpnn launches, in place of such a kernel, a twin whose
parameter ``p: wp.vec3`` is three ``float32`` parameters ``p__wn0``, ``p__wn1``, ``p__wn2``, and whose body starts
with ``p = wp.vec3f(p__wn0, p__wn1, p__wn2)``: the same body, the same key, scalars all the way through the
bridge, its launchers and its twins. :func:`components` turns the value a caller passes (a ``wp.vec3``, a tuple,
a NumPy array of the right size) into those scalars, or names what was expected.

Only Warp's own value types (``wp.vec3f``, ``wp.mat33d``, ``wp.quatf``, ``wp.transformf``,
``wp.spatial_vectorf``, ...) take this path; a kernel with another non-array type keeps the bridge's error.
"""

from __future__ import annotations

import ast
import functools
import math
import threading
from typing import Any

import numpy as np
import warp as wp

from . import _batched, _twins
from . import _warp_compat as wc

_SEPARATOR = "__wn"
_LOCK = threading.Lock()


def value_type_name(warp_type) -> str | None:
    """The name in ``warp`` of a vector / matrix / quaternion / transform type (``"vec3f"``), else None."""
    if not hasattr(warp_type, "_wp_scalar_type_") or wc.matches_array_class(warp_type, wp.array):
        return None
    name = getattr(warp_type, "__name__", "")
    return name if getattr(wp, name, None) is warp_type else None


def value_params(kernel) -> dict[str, Any]:
    """``kernel``'s parameters passed by value as a vector, matrix, quaternion or transform: ``{name: type}`` (none
    for anything but a Warp kernel, which the bridge then names)."""
    if not isinstance(kernel, wp.Kernel):
        return {}
    return {p.label: p.type for p in kernel.adj.args if value_type_name(p.type) is not None}


def component_names(name: str, warp_type) -> list[str]:
    return [f"{name}{_SEPARATOR}{k}" for k in range(math.prod(warp_type._shape_))]


def with_components(kernel):
    """``kernel``, or its twin taking each value parameter as its components (see the module's docstring).

    Raises:
        TypeError: the kernel has value parameters but no source to rewrite, or uses the twin's names.
    """
    params = value_params(kernel)
    if not params:
        return kernel
    return _twin(kernel)


@functools.lru_cache(maxsize=None)
def _twin(kernel):
    with _LOCK:
        params = value_params(kernel)
        fn = _batched.kernel_body(kernel, "wnvalue_")
        taken = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)} if fn is not None else set()
        clash = [c for name, t in params.items() for c in component_names(name, t) if c in taken]
        if fn is None or clash:
            raise TypeError(
                f"Kernel '{kernel.key}' takes {sorted(params)} by value ({', '.join(t.__name__ for t in params.values())}), "
                "which warpnn passes as their components through a twin generated from the kernel's source; "
                + ("it has no source to rewrite (a generic kernel or a kernel without a source tree)." if fn is None
                   else f"its body already uses the names {clash}.")
                + " Fix: pass the value as a 1-element array (wp.array(dtype=...)) and read it at index 0."
            )
        arg_types = {k: v for k, v in kernel.adj.arg_types.items() if k != "return"}
        new_types: dict[str, Any] = {}
        prologue = []
        for name, warp_type in arg_types.items():
            if name not in params:
                new_types[name] = warp_type
                continue
            parts = component_names(name, warp_type)
            new_types.update(dict.fromkeys(parts, warp_type._wp_scalar_type_))
            prologue += ast.parse(f"{name} = {_twins.WP_NAME}.{value_type_name(warp_type)}({', '.join(parts)})").body
        body = _twins.copy_tree(fn, kernel).body
        docstring = body[:1] if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else []
        return _batched.twin_from_body(kernel, list(new_types), [*docstring, *prologue, *body[len(docstring):]],
                                       "warpnn_values", annotations=new_types)


def components(kernel_key: str, name: str, warp_type, value) -> list[Any]:
    """The scalars a value parameter's twin parameters take, from the value a caller passes for it."""
    count = math.prod(warp_type._shape_)
    try:
        flat = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        flat = None
    if flat is None or flat.size != count or isinstance(value, (str, bytes)):
        what = f"{type(value).__name__} {value!r:.60}"
        raise TypeError(
            f"Kernel '{kernel_key}', argument '{name}' is a static wp.{value_type_name(warp_type)} ({count} "
            f"components), but got {what}. Fix: pass a wp.{value_type_name(warp_type)}, or a tuple or NumPy array of "
            f"{count} numbers (row by row for a matrix); to trace or train it, make it a 1-element array."
        )
    if warp_type._wp_scalar_type_ in wc.float_types:
        return [float(v) for v in flat]
    return [int(v) for v in flat]


def expand(kernel, args) -> list[Any]:
    """``args`` (one per parameter of ``kernel``, in order) with each value parameter's value as its components,
    in the order of ``with_components(kernel)``'s parameters."""
    params = value_params(kernel)
    expanded: list[Any] = []
    for p, value in zip(kernel.adj.args, args):
        if p.label in params:
            expanded.extend(components(kernel.key, p.label, p.type, value))
        else:
            expanded.append(value)
    return expanded


__all__ = ["component_names", "components", "expand", "value_params", "value_type_name", "with_components"]
