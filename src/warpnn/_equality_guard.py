"""The equality guard: a NaN gradient, never the side taken, where a float ``==`` / ``!=`` branch met equality.

Warp's adjoint of ``if x == 0.0: ... else: ...`` (or ``x != 0.0``, ``wp.where(y != 0.0, y, eps)``) is the adjoint of
the side the forward took. Off the boundary that is the derivative (the comparison is constant nearby). At equality
it is the derivative only if the two sides agree to first order, which the code does not say: mujoco_warp's
``quat_to_vel`` returns zero when ``sin(angle / 2) == 0``, and the gradient of a ball-joint actuator's length at the
identity orientation came out 0 where central differences of ``mj_step`` give 2 per unit of gear (the default pose
of every ball joint). ``_access.CodegenFacts.equality_branches`` lists such comparisons; this module acts on them.

A kernel with such a comparison reaching its adjoint (in itself or in a ``@wp.func`` it calls) is differentiated
through its *guarded twin*: the same source, built in a module of its own with the module option
:data:`GUARD_OPTION`, where Warp's code generator emits, in the reverse pass right where the comparison's adjoint
would be, ``if (a == b) { adj_v = adj_v * NAN; ... }`` for every float value ``v`` the operands were computed from
in that function (``_emit_guard``). The forward is untouched (the kernel itself runs it); the adjoint is Warp's
everywhere else. So a thread that met equality sends NaN to what the compared values depend on, and nothing else
changes: a gradient that may be wrong becomes a NaN that says so. ``WARPNN_EQUALITY_GRADIENT=side`` restores
Warp's adjoint everywhere; :func:`keep_side_taken` keeps it for one function or kernel whose author says the side
taken is the gradient wanted; a :class:`warpnn.StageRule` is how a library gives the right derivative at such a
boundary.

The hooks on Warp's code generator (``Adjoint.build``, ``add_call``, ``add_comp``) are installed once, by the first
guarded twin, and do nothing outside a guarded module: whether to emit is decided by the option of the module being
built (``adj.builder_options``), which Warp hashes with the rest of the module's options, so a guarded module's
compiled code is cached apart from every other (and a change of what is emitted changes :data:`GUARD_VERSION`).
"""

from __future__ import annotations

import threading
from typing import Any

import warp as wp

from . import _settings
from . import _warp_compat as wc
from ._access import codegen_facts, share_codegen_facts

# The module option that makes Warp's code generator emit the guard; its value names the version of what is
# emitted (Warp hashes module options into the module's cache key: a new version never reuses old binaries).
GUARD_OPTION = "warpnn_equality_guard"  # (_twins.twin_module passes warpnn_* options on to twins of twins)
GUARD_VERSION = 4

_INSTALL_LOCK = threading.Lock()
_installed = False

# Functions and kernels whose authors keep the side taken at their float equality branches: {module.qualname: why}
_SIDE_TAKEN: dict[str, str] = {}


def keep_side_taken(function, why: str) -> None:
    """Keep Warp's adjoint of the side taken at every float ``==`` / ``!=`` comparison in ``function`` (a
    ``@wp.func`` or a ``@wp.kernel``) where it meets equality, instead of a NaN gradient (see
    ``WARPNN_EQUALITY_GRADIENT``): the author's statement that the side taken is the gradient wanted there.

    It is one of two things, and ``why`` says which: the two sides agree to first order wherever a derivative exists
    (mujoco_warp's ``_wrap_period`` classifies an actuator as a servo by ``gainprm[0] == -biasprm[1]``, true for
    every position actuator, and the period it returns changes the force only where the servo's error wraps around,
    where the force has no derivative anyway), or equality is a switch, not a limit (a particle with ``inv_mass ==
    0`` is pinned, and a pinned particle's inverse mass is not a parameter: its gradient is 0 by convention).
    Like a :class:`warpnn.StageRule`, it is a claim warpnn cannot check. It covers the comparisons in ``function``'s
    own code (not those of the ``@wp.func``s it calls: declare them themselves), in every kernel that calls it, and
    in the twins warpnn builds from a declared kernel.

    Args:
        function: the ``@wp.func`` (all its overloads) or ``@wp.kernel``.
        why: the reason, one sentence, kept with the declaration.
    """
    python_function = getattr(function, "func", function)
    if not callable(python_function) or not isinstance(why, str) or not why.strip():
        raise TypeError(f"keep_side_taken: expected a @wp.func or @wp.kernel and a reason, got {function!r} and "
                        f"{why!r}.")
    _SIDE_TAKEN[_name(python_function)] = why.strip()


def _name(python_function) -> str:
    return f"{python_function.__module__}.{python_function.__qualname__}"


def declared_side_taken() -> dict[str, str]:
    """``{module.qualname: why}`` for every function and kernel declared with :func:`keep_side_taken`."""
    return dict(sorted(_SIDE_TAKEN.items()))


def _option_value() -> str:
    """The guard option's value: its version and the declared functions and kernels, so that both are in the module's
    cache key and a module's build sees exactly the declarations it was hashed with."""
    return ";".join([f"v{GUARD_VERSION}", *sorted(_SIDE_TAKEN)])


def _guarded_here(adj) -> bool:
    """Whether the code Warp is generating for ``adj`` gets the guard: its module is a guarded twin's, and neither the
    function nor (for a twin built from generated source) the function it was made from is declared in that
    module's option."""
    value = (getattr(adj, "builder_options", None) or {}).get(GUARD_OPTION)
    if not isinstance(value, str) or value.split(";")[0] != f"v{GUARD_VERSION}":
        return False
    declared, func = set(value.split(";")[1:]), getattr(adj, "func", None)
    while func is not None:
        if _name(func) in declared:
            return False
        func = getattr(func, "__warpnn_made_from__", None)  # (_twins._stub_function: what a generated twin came from)
    return True


def enabled() -> bool:
    """Whether ``WARPNN_EQUALITY_GRADIENT`` is ``nan`` (the default), read now (callers read it while lowering)."""
    return _settings.get("WARPNN_EQUALITY_GRADIENT") == "nan"


def guards(kernel, *, on: bool | None = None) -> bool:
    """Whether reverse mode differentiates ``kernel`` through its guarded twin: a float equality comparison reaches
    its adjoint and the guard is ``on`` (default: :func:`enabled`)."""
    return (enabled() if on is None else on) and bool(codegen_facts(kernel).equality_branches)


_GUARDED: dict[int, tuple[Any, str, Any]] = {}
_GUARDED_LOCK = threading.Lock()


def guarded(kernel):
    """``kernel``'s guarded twin, built with an adjoint (cached per kernel and set of declarations)."""
    from ._twins import twin_of

    _install()
    value = _option_value()
    with _GUARDED_LOCK:
        cached = _GUARDED.get(id(kernel))
        if cached is None or cached[0] is not kernel or cached[1] != value:
            twin = twin_of(kernel, "warpnn_guarded", key=kernel.key,
                           module_options={"enable_backward": True, GUARD_OPTION: value},
                           options={"enable_backward": True})
            share_codegen_facts(twin, kernel)  # (same function, source and options: the same facts)
            cached = _GUARDED[id(kernel)] = (kernel, value, twin)
        return cached[2]


def nan_hint(kernel) -> str:
    """For the name of an adjoint call (what ``jax_debug_nans`` reports): where a guarded twin's adjoint makes NaN on
    purpose, and what to do about it; empty for any other kernel."""
    if GUARD_OPTION not in kernel.module.options:
        return ""
    places = codegen_facts(kernel).equality_branches
    where = f"{places[0]}" + (f" and {len(places) - 1} more" if len(places) > 1 else "") if places else "?"
    return (f"; it gives NaN where a thread met a float ==/!= branch's equality ({where}), where Warp's adjoint "
            "would be the side taken: warpnn.keep_side_taken(function, why) keeps it where that is the gradient "
            "wanted, WARPNN_EQUALITY_GRADIENT=side everywhere")


def _install() -> None:
    """Wrap Warp's code generator (once): in a guarded module, note which values each call's results are computed
    from (``Adjoint.add_call``), and emit each float equality's guard (``Adjoint.add_comp``)."""
    global _installed
    from warp._src import codegen

    # (under Warp's code-generation lock too: _access's watch swaps the same methods while it holds it, and would
    # otherwise put back the ones from before these hooks)
    with _INSTALL_LOCK, codegen._codegen_lock:
        if _installed:
            return

        build, add_call, add_comp = codegen.Adjoint.build, codegen.Adjoint.add_call, codegen.Adjoint.add_comp

        def build_tracked(adj, *args, **kwargs):
            adj._warpnn_computed_from = {}  # (Var labels restart with every build of a function)
            return build(adj, *args, **kwargs)

        def add_call_tracked(adj, func, args, kwargs, *rest, **options):
            result = add_call(adj, func, args, kwargs, *rest, **options)
            inputs = getattr(adj, "_warpnn_computed_from", None)
            if inputs is not None and _guarded_here(adj):
                out = result[0] if options.get("return_resolved") else result
                sources = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, codegen.Var)]
                for var in out if isinstance(out, (list, tuple)) else [out]:
                    if isinstance(var, codegen.Var):
                        inputs[var.label] = sources
            return result

        def add_comp_guarded(adj, op_strings, left, comps):
            if not any(op in ("==", "!=") for op in op_strings) or not _guarded_here(adj):
                return add_comp(adj, op_strings, left, comps)
            # Load references first (Warp's add_comp loads each operand; a loaded value loads as itself), so that
            # the guard compares the very values the comparison reads.
            given = [left, *comps]
            loaded = [adj.load(v) for v in given]
            output = add_comp(adj, op_strings, loaded[0], loaded[1:])
            for i, op in enumerate(op_strings):
                if op in ("==", "!="):
                    _emit_guard(adj, loaded[i], loaded[i + 1])
            return output

        for name, wrapper, original in (("build", build_tracked, build), ("add_call", add_call_tracked, add_call),
                                        ("add_comp", add_comp_guarded, add_comp)):
            setattr(wrapper, "__wrapped__", original)
            setattr(codegen.Adjoint, name, wrapper)
        _installed = True


def _emit_guard(adj, a, b) -> None:
    """In the reverse pass at the comparison of the values ``a`` and ``b``: where they are equal, every float value
    they are computed from in this function (its backward slice: calls' results, references, loads, parameters)
    gets a NaN adjoint. Poisoning the operands alone is not enough: an adjoint on the way can pass nothing on
    (Warp's adjoint of ``wp.length`` at the zero vector, which ``quat_to_vel`` compares with 0), and each value
    upstream of it is poisoned in its own right. A value whose origin the guard did not see (neither a call's
    result, a parameter nor a constant) is poisoned with, in a ``@wp.func``, every float parameter."""
    from warp._src.codegen import Var, strip_reference

    computed_from = getattr(adj, "_warpnn_computed_from", {})
    parameters = {v.label for v in adj.args}
    poisoned: dict[str, Any] = {}
    todo, unknown = [a, b], False
    while todo:
        var = todo.pop()
        if var.constant is not None or var.label in poisoned:
            continue
        poisoned[var.label] = var
        if var.label in computed_from:
            todo += computed_from[var.label]
        elif var.label not in parameters:
            unknown = True
    if unknown and getattr(adj, "is_user_function", False):
        poisoned.update({v.label: v for v in adj.args})
    scalars = [(v, _float_scalar(strip_reference(v.type))) for v in poisoned.values()]
    body = " ".join(f"{v.emit_adj()} = wp::mul({v.emit_adj()}, {Var.type_to_ctype(scalar)}(NAN));"
                    for v, scalar in scalars if scalar is not None)
    if body:
        adj.add_reverse(f"if ({a.emit()} == {b.emit()}) {{ {body} }}")


def _float_scalar(t):
    """The float scalar type of a Warp value type (a float, or a vector, matrix, quaternion ... of floats), else
    None (integers, booleans, arrays, structs)."""
    if wp.types.is_array(t):
        return None
    scalar = wc.type_scalar_type(t)  # (a struct, an integer or a bool is its own: not a float)
    return scalar if scalar in wc.float_types else None
