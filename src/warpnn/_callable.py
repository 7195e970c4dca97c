"""``warpnn.jax_callable``: a Python function that launches Warp kernels, as a differentiable JAX function.

The forward pass is Warp's own ``jax_callable`` (same parameters, graph modes, staging, vmap methods and
in-out aliasing as Warp 1.19's). Reverse mode is added around it with ``jax.custom_vjp``: the VJP is a
second Warp callable that re-runs the function under ``wp.Tape`` from the saved inputs, seeds the outputs'
adjoints with the cotangents and back-propagates through Warp's adjoint kernels. Nothing is stored between
the two calls but JAX values (the inputs), so the VJP composes with ``jit``, ``vmap``, ``lax.scan`` and
``jax.checkpoint`` like any JAX function. A user-written backward function can replace the tape.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
import threading
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp
from jax.custom_derivatives import SymbolicZero

from . import _equality_guard, _sharding
from . import _warp_compat as wc
from ._bridge import SECOND_ORDER_MESSAGE, _fence, _Static, forward_mode_refused, instantiate_zero, zero_aval
from ._access import ArrayUse, analyse_array_uses, codegen_facts, warp_builds_adjoint
from ._signature import _arg_spec
from ._warp_compat import jax_ffi

CUT_GRADIENT_MESSAGE = (
    "warpnn.jax_callable '{name}': kernel '{reader}' reads the float array '{param}', which kernel '{writer}' "
    "wrote from arrays that have gradients, but the array has none (it was allocated inside the function "
    "without requires_grad=True), so wp.Tape cannot carry the gradient through it and every input before it "
    "would get a zero gradient. Fix: allocate it with requires_grad=True (or wp.zeros_like / wp.empty_like of "
    "an input); if it is meant to stop the gradient, compute it in a separate jax_callable and pass it in "
    "through jax.lax.stop_gradient."
)

NO_ADJOINT_MESSAGE = (
    "warpnn.jax_callable '{name}': kernel '{kernel}' reads arrays that have gradients and writes float arrays, "
    "but it was compiled without an adjoint (enable_backward=False on the kernel or its module), so wp.Tape "
    "would skip it and the gradient through it would be zero. Fix: remove enable_backward=False, or keep its "
    "inputs out of the gradient (jax.lax.stop_gradient on the inputs they come from)."
)

LOOP_ADJOINT_MESSAGE = (
    "warpnn.jax_callable '{name}': kernel '{kernel}' reads arrays that have gradients, and wp.Tape's gradient "
    "through it would be wrong: {problem}. Fix: for a loop, let its carried variables only accumulate (`total += "
    "term`) or unroll a short loop with a constant range; for a builtin without an adjoint, compute that step "
    "in JAX; or keep the kernel's inputs out of the gradient (jax.lax.stop_gradient on the inputs they come from)."
)

FORWARD_MODE_MESSAGE = (
    "warpnn.jax_callable '{name}' is differentiable in reverse mode (jax.grad, jax.vjp, jax.value_and_grad, "
    "jax.jacrev), once: its VJP re-runs the function under wp.Tape and back-propagates through Warp's "
    "adjoint kernels, which have no forward-mode (tangent) rule. jax.jvp, jax.jacfwd, jax.linearize and "
    "jax.hessian are not supported. Fix: use jax.jacrev instead of jax.jacfwd; for second-order information "
    "write the first derivative as its own Warp function (a second jax_callable) or use pure JAX for that part."
)


def _is_float(arg) -> bool:
    """Whether a Warp FFI argument is a float array (float16/32/64, bfloat16), i.e. has a gradient."""
    return arg.is_array and jnp.issubdtype(np.dtype(arg.jax_scalar_type), jnp.inexact)


def _name_of(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _reraise_named(name: str, error: Exception) -> NoReturn:
    """Re-raise a Warp ValueError / TypeError / RuntimeError with the function's name in front."""
    if type(error) in (ValueError, TypeError, RuntimeError):
        raise type(error)(f"warpnn.jax_callable '{name}': {error}") from error
    raise error


class WarpCallable:
    """A Python function over Warp arrays, callable from JAX and differentiable in reverse mode.

    Create with :func:`jax_callable`. Attributes of Warp's own callable (``graph_mode``, ``num_inputs``,
    ``stage_in_argnames``, ...) read through; ``graph_cache_max`` applies to the forward and the backward
    callable, ``graph_cache_size`` counts the forward's Warp-captured graphs.
    """

    def __init__(self, forward, func: Callable, backward: Callable | None):
        self._forward = forward
        self.func = func
        self.name = _name_of(func)
        self.backward = backward
        self.input_args = tuple(forward.input_args)
        # JAX returns the in-out arguments' new values first, then the pure outputs (Warp's order).
        self.jax_output_args = tuple(a for a in self.input_args if a.in_out) + tuple(forward.output_args)
        self._backward_callables: dict[frozenset[str], Any] = {}  # by the float inputs they differentiate
        self._backward_lock = threading.Lock()
        if backward is not None:
            _check_backward_arity(self)

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_forward":
            raise AttributeError(name)
        return getattr(self._forward, name)

    def __repr__(self) -> str:
        outputs = [a.name for a in self.jax_output_args]
        how = "a user backward" if self.backward is not None else "wp.Tape"
        return (f"warpnn.jax_callable({self.name}: inputs {[a.name for a in self.input_args]} -> outputs {outputs}, "
                f"reverse mode through {how})")

    @property
    def graph_cache_max(self) -> int | None:
        return self._forward.graph_cache_max

    @graph_cache_max.setter
    def graph_cache_max(self, value: int | None) -> None:
        self._forward.graph_cache_max = value
        for backward in self._backward_callables.values():
            backward.graph_cache_max = value

    @property
    def graph_cache_size(self) -> int:
        return self._forward.graph_cache_size

    def clear_graph_cache(self) -> None:
        """Drop the graphs Warp captured for this callable (``JaxCallableGraphMode.WARP``), forward and backward."""
        self._forward.captures.clear()
        for backward in self._backward_callables.values():
            backward.captures.clear()

    def __call__(self, *args, output_dims=None, vmap_method=None) -> tuple[jax.Array, ...]:
        """Call the function.

        Args:
            *args: the function's inputs in signature order (in-out arguments included): arrays as JAX
                arrays whose dtype and rank match the annotation (a ``wp.array(dtype=wp.vec3)`` is an
                ``(n, 3)`` array), scalars as static Python numbers.
            output_dims: overrides the constructor's; an int, a tuple (the same for every output) or a
                dict keyed by output name. Default: the Warp shape of the first array input.
            vmap_method: overrides the constructor's (see :func:`jax_callable`).

        Returns:
            A tuple: the new values of the in-out arguments, then the outputs.
        """
        arrays, scalars = _check_inputs(self, args)
        plan = _Plan(
            self,
            scalars,
            _freeze_dims(self.output_dims if output_dims is None else output_dims),
            self.vmap_method if vmap_method is None else vmap_method,
        )
        # Under shard_map, operands must vary over the same mesh axes before the custom VJP, so that
        # the cotangent of a replicated input is summed over devices by JAX (a no-op elsewhere).
        with forward_mode_refused(FORWARD_MODE_MESSAGE.format(name=self.name), arrays):
            return tuple(_differentiable_call(plan, *_sharding.match_vma(arrays)))

    def differentiated_inputs(self, perturbed: frozenset[str]) -> frozenset[str]:
        """The inputs the VJP computes gradients for, given those JAX differentiates in this call.

        With the tape: the perturbed float arrays, plus every float in-out array (its gradient buffer is also
        the adjoint the tape seeds with its new value's cotangent). A user backward gets all float inputs.
        """
        floats = {a.name for a in self.input_args if _is_float(a)}
        if self.backward is not None:
            return frozenset(floats)
        return frozenset(floats & (perturbed | {a.name for a in self.input_args if a.in_out}))

    def _backward(self, differentiated: frozenset[str]):
        """The Warp callable that computes the VJP for ``differentiated`` inputs (built once for each set).

        Inputs JAX does not differentiate get no gradient array, so Warp's adjoints skip their atomics and
        nothing is zeroed for them.
        """
        with self._backward_lock:
            callable_ = self._backward_callables.get(differentiated)
            if callable_ is None:
                fwd = self._forward
                body, names, annotations, num_outputs = (
                    _user_backward_body(self) if self.backward is not None else _tape_backward_body(self, differentiated)
                )
                body.__signature__ = inspect.Signature(
                    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
                )
                body.__annotations__ = dict(zip(names, annotations))
                # Warp preloads and loads the module named after the function's __module__: the user's kernels.
                body.__module__ = getattr(self.func, "__module__", body.__module__)
                body.__qualname__ = body.__name__ = f"{getattr(self.func, '__name__', 'func')}_warpnn_vjp"
                callable_ = self._backward_callables[differentiated] = jax_ffi.jax_callable(
                    body,
                    num_outputs=num_outputs,
                    graph_mode=fwd.graph_mode,
                    vmap_method=fwd.vmap_method,
                    graph_cache_max=fwd.graph_cache_max,
                    module_preload_mode=fwd.module_preload_mode,
                )
            return callable_


def jax_callable(
    func: Callable,
    num_outputs: int = 1,
    graph_mode: wp.JaxCallableGraphMode = wp.JaxCallableGraphMode.JAX,
    vmap_method: str | None = "sequential",
    output_dims=None,
    in_out_argnames=None,
    stage_in_argnames=None,
    stage_out_argnames=None,
    graph_cache_max: int | None = jax_ffi.JAX_CALLABLE_DEFAULT_GRAPH_CACHE_MAX,
    module_preload_mode: wp.JaxModulePreloadMode = wp.JaxModulePreloadMode.CURRENT_DEVICE,
    has_side_effect: bool = False,
    backward: Callable | None = None,
) -> WarpCallable:
    """Wrap a Python function that launches Warp kernels as a JAX function, differentiable in reverse mode.

    The parameters before ``backward`` are Warp 1.19's ``wp.jax_callable``'s, in its order and with its
    meaning, and the forward pass is Warp's own callable: ``func``'s arguments are annotated like a
    Warp kernel's (inputs, then in-out arrays, then outputs; ``num_outputs`` counts in-out and output
    arrays), it is called with Warp arrays over XLA's buffers, and it must not return a value. Same
    arguments give the same wrapper.

    Reverse mode (``jax.grad``, ``jax.vjp``, ``jax.jacrev``, ...): by default the VJP re-runs ``func``
    under ``wp.Tape`` on the saved inputs (in-out arrays on a copy of their values before the call),
    seeds the outputs' adjoints with the cotangents and runs ``tape.backward()``, so the gradient is the
    one ``wp.Tape`` gives on the same code: ``func`` must be differentiable by a tape as written
    (intermediate arrays allocated with ``requires_grad=True`` or ``wp.zeros_like`` of an input, no array
    overwritten after a kernel read it). Float array inputs get gradients; integer inputs get zero
    (``float0``) cotangents; scalars are static. Forward mode and grad-of-grad raise a clear error. The
    adjoints of every other array the tape touches (arrays ``func`` closes over, say) are zeroed before and
    after each backward pass, so repeated gradients do not accumulate in them.

    Outputs (not in-out arrays) are zeroed before ``func`` runs, as ``jax_kernel`` zeroes its outputs, so a
    function may accumulate into them (``wp.atomic_add``); XLA's output buffers otherwise hold leftovers.

    Example::

        def step(x: wp.array(dtype=float), k: float, y: wp.array(dtype=float)):
            tmp = wp.zeros_like(x, requires_grad=True)
            wp.launch(square, dim=x.shape, inputs=[x], outputs=[tmp])
            wp.launch(scale, dim=x.shape, inputs=[tmp, k], outputs=[y])

        f = warpnn.jax_callable(step)
        g = jax.grad(lambda x: f(x, 3.0)[0].sum())(jnp.arange(4.0))   # 6 x

    Args:
        func: the Python function to call; arguments annotated like a Warp kernel's.
        num_outputs: how many trailing arguments are outputs, in-out arguments included.
        graph_mode: CUDA graph capture (``wp.JaxCallableGraphMode`` or its int): ``JAX`` (default) lets XLA
            capture the call into its graphs; ``WARP`` has Warp capture and replay it for the same buffer
            addresses; ``WARP_STAGED`` / ``WARP_STAGED_EX`` capture against staging buffers; ``NONE``
            disables capture (for functions that synchronise with the host). The backward callable uses
            the same mode. On CPU only ``NONE`` and ``JAX`` run.
        vmap_method: how the call batches under ``jax.vmap``, as in ``jax.ffi.ffi_call``:
            ``"sequential"`` (default; Warp's default is ``"broadcast_all"``) calls ``func`` once per batch
            element, right for every function; ``"broadcast_all"`` broadcasts every input to the batch and Warp
            folds the batch into the first array dimension, right only for functions whose thread ``i`` touches
            element ``i`` alone (a kernel reading a neighbour, ``x[i - 1]``, would read the previous batch
            element's data: measured forward error 0.58 on a stencil);
            ``"expand_dims"`` adds a size-1 batch dim to unbatched inputs (folded like ``broadcast_all``).
            The backward call batches the same way. Per call too.
        output_dims: output shapes (int, tuple or dict keyed by output name); default: the Warp shape of
            the first array input. Per call too.
        in_out_argnames: arrays that are both inputs and outputs (aliased buffers, placed before the
            outputs). Their gradient is with respect to their value before the call.
        stage_in_argnames, stage_out_argnames: the arrays staged on each call in the ``WARP_STAGED`` modes
            (default: all), as in Warp. The backward callable stages all its arrays.
        graph_cache_max: most graphs cached per callable in ``WARP`` mode (``None``: unlimited).
        module_preload_mode: where to preload ``func``'s module (``wp.JaxModulePreloadMode``).
        has_side_effect: run the forward call even when its outputs are unused.
        backward: optional VJP instead of the tape, a Python function over Warp arrays called as
            ``backward(*inputs, *outputs, *output_grads, *input_grads)``: ``inputs`` are ``func``'s inputs
            (arrays and scalars; in-out arrays with their values before the call), ``outputs`` are the
            forward's results (in-out arrays' new values, then the outputs), ``output_grads`` the cotangents
            of the float ones among those outputs, in the same order, and ``input_grads`` one zeroed
            array per float array input, in input order, for the backward to fill with the gradient.
            It runs as a Warp callable (same graph mode and vmap method as the forward); it must not
            write its other arguments.

    Returns:
        A :class:`WarpCallable`; call it with the inputs, get a tuple of the in-out arguments' new values
        and the outputs.
    """
    name = _name_of(func)
    if backward is not None and not callable(backward):
        raise TypeError(
            f"warpnn.jax_callable '{name}': backward must be a Python function over Warp arrays (or None for "
            f"wp.Tape), got {type(backward).__name__}."
        )
    try:
        forward = jax_ffi.jax_callable(
            func,
            num_outputs,
            graph_mode,
            vmap_method,
            output_dims,
            in_out_argnames,
            stage_in_argnames,
            stage_out_argnames,
            graph_cache_max,
            module_preload_mode,
            has_side_effect,
        )
    except (ValueError, TypeError, RuntimeError) as error:
        _reraise_named(name, error)
    _zero_outputs_first(forward)
    with _REGISTRY_LOCK:
        # Warp returns the same forward callable for the same arguments, so this keys on all of them.
        wrapper = _REGISTRY.get((forward, backward))
        if wrapper is None:
            wrapper = _REGISTRY[(forward, backward)] = WarpCallable(forward, func, backward)
        else:
            wrapper.graph_cache_max = graph_cache_max  # Warp applies the latest limit on a cache hit too
    return wrapper


_REGISTRY: dict[tuple[Any, Any], WarpCallable] = {}
_REGISTRY_LOCK = threading.Lock()


def _zero_outputs_first(forward) -> None:
    """Have Warp's callable zero ``func``'s pure outputs before each call (XLA hands over uninitialised buffers).

    Warp parses ``func``'s signature when the callable is made and calls ``forward.func`` with Warp arrays over
    XLA's buffers, outputs last; so the zeroing wraps ``forward.func`` in place, once.
    """
    func = forward.func
    if getattr(func, "_warpnn_zeroes_outputs", False):
        return
    num_outputs = len(forward.output_args)

    @functools.wraps(func)
    def zeroed_then_called(*args):
        for out in args[len(args) - num_outputs:] if num_outputs else ():
            if isinstance(out, wp.array) and out.size:
                out.zero_()
        func(*args)

    zeroed_then_called._warpnn_zeroes_outputs = True  # type: ignore[attr-defined]
    forward.func = zeroed_then_called


def clear_jax_callable_graph_cache(callable=None) -> None:
    """Clear the Warp-captured graphs of one callable (warpnn's or Warp's), or of every callable if ``None``."""
    if isinstance(callable, WarpCallable):
        callable.clear_graph_cache()
    else:
        jax_ffi.clear_jax_callable_graph_cache(callable)  # every Warp callable, warpnn's two per wrapper included


register_ffi_callback = jax_ffi.register_ffi_callback


# --------------------------------------------------------------------------------------------------
# Input checking: every mistake is reported at trace time, naming the function, the argument and the fix.


def _check_inputs(wrapper: WarpCallable, args: tuple) -> tuple[list, tuple[tuple[int, Any], ...]]:
    specs = wrapper.input_args
    if len(args) != len(specs):
        in_out = [a.name for a in specs if a.in_out]
        raise TypeError(
            f"warpnn.jax_callable '{wrapper.name}' takes {len(specs)} inputs {[a.name for a in specs]}"
            + (f" (in-out arrays {in_out} included)" if in_out else "")
            + f"; its outputs {[a.name for a in wrapper._forward.output_args]} are returned, not passed. "
            f"It was called with {len(args)}."
        )
    arrays, scalars = [], []
    for i, (spec, value) in enumerate(zip(specs, args)):
        where = f"warpnn.jax_callable '{wrapper.name}', argument '{spec.name}'"
        if spec.is_array:
            arrays.append(_check_array(where, spec, value))
        else:
            scalars.append((i, _check_scalar(where, spec, value)))
    return arrays, tuple(scalars)


def _describe(spec) -> str:
    inner = f", inner dims {tuple(spec.dtype_shape)}" if spec.dtype_ndim else ""
    return f"{spec.jax_ndim}-D {np.dtype(spec.jax_scalar_type).name} array ({spec.warp_ndim} Warp dims{inner})"


def _check_array(where: str, spec, value):
    if isinstance(value, numbers.Number) or not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{where} expects a {_describe(spec)}, got {type(value).__name__} {value!r:.60}.")
    expected = np.dtype(spec.jax_scalar_type)
    if np.dtype(value.dtype) != expected:
        raise TypeError(
            f"{where} expects dtype {expected.name}, got {np.dtype(value.dtype).name}. "
            f"Fix: pass {spec.name}.astype(jnp.{expected.name})"
            + (" and enable 64-bit JAX (jax.config.update('jax_enable_x64', True))." if expected.itemsize == 8 else ".")
        )
    shape = tuple(value.shape)
    if len(shape) != spec.jax_ndim:
        raise ValueError(
            f"{where} expects a {_describe(spec)}, got shape {shape} ({len(shape)}-D)."
            + (" A Warp vector/matrix array of Warp shape (n, ...) is a JAX array of shape (n, ..., "
               f"{', '.join(map(str, spec.dtype_shape))})." if spec.dtype_ndim else "")
            + " To batch a call, use jax.vmap rather than adding leading dims."
        )
    if spec.dtype_ndim and shape[spec.warp_ndim :] != tuple(spec.dtype_shape):
        raise ValueError(f"{where} expects inner dims {tuple(spec.dtype_shape)}, got shape {shape}.")
    return value


def _check_scalar(where: str, spec, value):
    if isinstance(value, (jax.core.Tracer, jax.Array, np.ndarray)):
        what = "a traced value" if isinstance(value, jax.core.Tracer) else f"an array of shape {np.shape(value)}"
        raise TypeError(
            f"{where} is a static scalar, but got {what}. Warp scalars are constants of the call. Fix: pass a "
            "Python number (mark it static, e.g. jax.jit(..., static_argnames=...)); to trace or differentiate "
            f"it, annotate it as a 1-element array ({spec.name}: wp.array(dtype=...)) and read {spec.name}[0]."
        )
    if not isinstance(value, (numbers.Number, np.generic)):
        raise TypeError(f"{where} expects a static number, got {type(value).__name__}.")
    return value


def _freeze_dims(dims):
    """output_dims as a hashable value (a dict becomes a sorted tuple of items, marked as such)."""
    if isinstance(dims, Mapping):
        return ("dict", tuple(sorted((k, _freeze_dims(v)) for k, v in dims.items())))
    if isinstance(dims, (list, tuple)):
        return tuple(int(d) for d in dims)
    return dims


def _thaw_dims(dims):
    if isinstance(dims, tuple) and dims[:1] == ("dict",):
        return dict(dims[1])
    return dims


# --------------------------------------------------------------------------------------------------
# The differentiable call: Warp's forward callable and a backward callable joined by custom_vjp.


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """Everything static about one call (a custom_vjp nondiff argument)."""

    wrapper: WarpCallable
    scalars: tuple[tuple[int, Any], ...]  # (input position, value)
    output_dims: Any
    vmap_method: str | None
    output_shapes: tuple[tuple[int, ...], ...] | None = None  # the forward's, known when differentiating
    differentiated: frozenset[str] = frozenset()  # the inputs the VJP computes gradients for

    def arguments(self, arrays) -> list:
        """The function's inputs in signature order: the traced arrays with the static scalars put back."""
        scalars, arrays = dict(self.scalars), iter(arrays)
        return [scalars[i] if i in scalars else next(arrays) for i in range(len(self.wrapper.input_args))]

    def forward(self, arrays) -> tuple:
        try:
            # Behind an optimization barrier, like jax_kernel's calls (see _bridge._fence): inside lax.scan the
            # call then sees the same buffers every step, so XLA's CUDA graphs replay it without Python.
            outputs = self.wrapper._forward(*self.arguments(_fence(arrays)), output_dims=_thaw_dims(self.output_dims),
                                            vmap_method=self.vmap_method)
            return tuple(_fence(outputs))
        except (ValueError, TypeError) as error:
            _reraise_named(self.wrapper.name, error)

    def backward(self, arrays, outputs, cotangents) -> tuple:
        """The gradients of the inputs in ``self.differentiated`` (in input order), from the VJP callable."""
        wrapper = self.wrapper
        inputs = self.arguments(arrays)
        shape_of = {a.name: tuple(x.shape) for a, x in zip(wrapper.input_args, inputs) if a.is_array}
        assert self.output_shapes is not None, "the VJP's plan carries the forward's output shapes"
        out_shape_of = {a.name: shape for a, shape in zip(wrapper.jax_output_args, self.output_shapes)}
        grad_dims = {f"grad_{a.name}": shape_of[a.name] for a in wrapper.input_args if a.name in self.differentiated}
        if wrapper.backward is not None:
            operands = [*inputs, *outputs, *cotangents]
            dims = grad_dims
        else:
            operands = [*inputs, *cotangents]
            pure_outputs = wrapper._forward.output_args
            dims = {
                **grad_dims,
                **{f"work_{a.name}": shape_of[a.name] for a in wrapper.input_args if a.in_out},
                **{f"value_{a.name}": out_shape_of[a.name] for a in pure_outputs},
                **{f"seed_{a.name}": out_shape_of[a.name] for a in pure_outputs if _is_float(a)},
            }
        scalars = dict(self.scalars)  # static: kept out of the barrier
        arrays_at = [i for i, x in enumerate(operands) if i not in scalars]
        fenced = iter(_fence([operands[i] for i in arrays_at]))
        operands = [operands[i] if i in scalars else next(fenced) for i in range(len(operands))]
        results = wrapper._backward(self.differentiated)(*operands, output_dims=dims, vmap_method=self.vmap_method)
        return tuple(_fence(results[: len(grad_dims)]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable_call(plan: _Plan, *arrays):
    return plan.forward(arrays)


def _differentiable_call_fwd(plan: _Plan, *primals):
    # symbolic_zeros=True: each primal says whether JAX differentiates with respect to it in this call.
    arrays = tuple(p.value for p in primals)
    array_args = [a for a in plan.wrapper.input_args if a.is_array]
    perturbed = frozenset(a.name for a, p in zip(array_args, primals) if p.perturbed)
    outputs = _first_order_only(plan, False, *arrays)
    # The tape re-runs the function from its inputs; only a user backward reads the forward's outputs.
    saved = outputs if plan.wrapper.backward is not None else None
    return outputs, (arrays, saved, _Static(perturbed))


def _differentiable_call_bwd(plan: _Plan, residuals, cotangents):
    arrays, outputs, perturbed = residuals
    wrapper = plan.wrapper
    array_args = [a for a in wrapper.input_args if a.is_array]
    differentiated = wrapper.differentiated_inputs(perturbed.value)
    float_outputs = [i for i, a in enumerate(wrapper.jax_output_args) if _is_float(a)]
    cts = [cotangents[i] for i in float_outputs]
    if not (differentiated & perturbed.value) or all(isinstance(ct, SymbolicZero) for ct in cts):
        return (None,) * len(arrays)  # nothing differentiable, or zero cotangents: zero (float0 for integers)
    # A zero cotangent among others becomes a zero array: the VJP callable's signature is fixed.
    cts = [instantiate_zero(ct) for ct in cts]
    shapes = tuple(zero_aval(ct)[0] if isinstance(ct, SymbolicZero) else tuple(np.shape(ct)) for ct in cotangents)
    plan = dataclasses.replace(plan, output_shapes=shapes, differentiated=differentiated)
    # jax.hessian / jacfwd(jacrev): forward mode through the backward call.
    with forward_mode_refused(FORWARD_MODE_MESSAGE.format(name=wrapper.name), ()):
        grads = dict(zip(
            [a.name for a in wrapper.input_args if a.name in differentiated],
            _first_order_only(plan, True, arrays, () if outputs is None else outputs, tuple(cts)),
        ))
    return tuple(grads.get(a.name) if a.name in perturbed.value else None for a in array_args)


_differentiable_call.defvjp(_differentiable_call_fwd, _differentiable_call_bwd, symbolic_zeros=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _first_order_only(plan: _Plan, backward: bool, *operands):
    """The forward or VJP callable inside the VJP, refusing with a clear message to be differentiated again."""
    return _run(plan, backward, operands)


def _run(plan: _Plan, backward: bool, operands):
    if not backward:
        return plan.forward(operands)
    arrays, outputs, cotangents = operands
    return plan.backward(arrays, outputs, cotangents)


def _first_order_only_fwd(plan, backward, *operands):
    return _run(plan, backward, operands), None


def _first_order_only_bwd(plan, backward, residuals, cotangents):
    raise NotImplementedError(f"warpnn.jax_callable '{plan.wrapper.name}': {SECOND_ORDER_MESSAGE}")


_first_order_only.defvjp(_first_order_only_fwd, _first_order_only_bwd)


# --------------------------------------------------------------------------------------------------
# The backward callables' bodies. Each returns (body, parameter names, annotations, number of outputs);
# Warp's jax_callable reads the annotations as it reads func's.


def _tape_backward_body(wrapper: WarpCallable, differentiated: frozenset[str]):
    """VJP through wp.Tape: re-run func on the inputs, seed its outputs' adjoints, tape.backward().

    Parameters: func's inputs; a cotangent per float output. Outputs: a gradient per float array input,
    then scratch the tape works in (so nothing is allocated here, and graph capture sees only copies,
    memsets and launches): a working copy of each in-out array, each output's recomputed value, and each
    float output's adjoint (given the cotangent after the replay; Warp's adjoints may update it in place,
    which the cotangent itself, an XLA input, must not be).
    """
    func = wrapper._forward.func  # (zeroes the outputs first, as the forward did)
    inputs = wrapper.input_args
    pure_outputs = tuple(wrapper._forward.output_args)
    cts = [a for a in wrapper.jax_output_args if _is_float(a)]
    grads = [a for a in inputs if a.name in differentiated]
    works = [a for a in inputs if a.in_out]
    seeds = [a for a in pure_outputs if _is_float(a)]
    params = (
        [(f"in_{a.name}", a) for a in inputs]
        + [(f"ct_{a.name}", a) for a in cts]
        + [(f"grad_{a.name}", a) for a in grads]
        + [(f"work_{a.name}", a) for a in works]
        + [(f"value_{a.name}", a) for a in pure_outputs]
        + [(f"seed_{a.name}", a) for a in seeds]
    )
    names = [n for n, _ in params]
    checked = set()  # the call layouts whose recorded launches passed _check_gradient_chain
    guard = _equality_guard.enabled()  # (WARPNN_EQUALITY_GRADIENT, read when this backward is first lowered)

    def vjp(*warp_args):
        given = dict(zip(names, warp_args))
        call, seeded = [], {}
        for a in inputs:
            x = given[f"in_{a.name}"]
            if a.in_out:  # the tape runs on a copy holding the value before the call
                x_work = given[f"work_{a.name}"]
                wp.copy(x_work, x)
                if _is_float(a):  # its adjoint: seeded with the new value's cotangent, ends as the old value's
                    x_work.grad = given[f"grad_{a.name}"]
                    seeded[x_work] = given[f"ct_{a.name}"]
                x = x_work
            elif a.name in differentiated:
                x.grad = given[f"grad_{a.name}"]
            call.append(x)
        for a in pure_outputs:
            y = given[f"value_{a.name}"]
            if _is_float(a):
                y.grad = given[f"seed_{a.name}"]
                seeded[y] = given[f"ct_{a.name}"]
            call.append(y)
        # Every adjoint starts at zero, and the cotangents go in only after the forward replay, as with
        # wp.Tape: Warp's forward writes some adjoints itself (wp.copy copies the source's into the target's).
        for x in call:
            if isinstance(x, wp.array) and x.grad is not None:
                x.grad.zero_()
        tape = wp.Tape()
        with tape:
            func(*call)
        # The launches depend on the shapes and scalars (host code may branch on them), not on the values.
        layout = tuple(x.shape if isinstance(x, wp.array) else x for x in call)
        if layout not in checked:
            _check_gradient_chain(wrapper.name, tape, call)
            checked.add(layout)
        if guard:
            _guard_equalities(tape)
        # Arrays func reaches other than its arguments (closure state, its own allocations) keep their adjoints
        # between calls: zeroed before this backward pass (else each call adds to the last one's) and after it.
        own = {x.ptr for x in warp_args if isinstance(x, wp.array)}
        others = _tape_arrays(tape, own)
        for x in others:
            x.grad.zero_()
        tape.backward(grads=seeded)  # copies each cotangent into its array's adjoint, then runs backward
        for x in others:
            x.grad.zero_()

    num_outputs = len(grads) + len(works) + len(pure_outputs) + len(seeds)
    return vjp, names, [a.type for _, a in params], num_outputs


def _guard_equalities(tape) -> None:
    """Each recorded kernel with a float ``==`` / ``!=`` branch runs its adjoint from its equality-guarded twin (same
    parameters; NaN in a thread that met equality, where Warp's adjoint is the side taken: ``_equality_guard``)."""
    for i, launch in enumerate(tape.launches):
        if not callable(launch) and isinstance(launch[0], wp.Kernel) and _equality_guard.guards(launch[0], on=True):
            tape.launches[i] = [_equality_guard.guarded(launch[0]), *launch[1:]]


def _tape_arrays(tape, own: set) -> list:
    """The arrays ``tape``'s launches touched whose adjoint buffer is not one of the VJP's own (``own``: ptrs)."""
    found: dict[int, Any] = {}
    for launch in tape.launches:
        if callable(launch):
            continue
        for value in (*launch[3], *launch[4]):
            if (isinstance(value, wp.array) and value.grad is not None and value.grad.ptr
                    and value.grad.ptr not in own and value.ptr not in own):
                found.setdefault(value.grad.ptr, value)
    return list(found.values())


def _backward_parameters(wrapper: WarpCallable):
    cts = [a for a in wrapper.jax_output_args if _is_float(a)]
    grads = [a for a in wrapper.input_args if _is_float(a)]
    return (
        [(f"in_{a.name}", a) for a in wrapper.input_args]
        + [(f"out_{a.name}", a) for a in wrapper.jax_output_args]
        + [(f"ct_{a.name}", a) for a in cts]
        + [(f"grad_{a.name}", a) for a in grads]
    ), len(grads)


def _user_backward_body(wrapper: WarpCallable):
    """VJP by the user's function: zero the gradient arrays, then call it with everything."""
    params, num_grads = _backward_parameters(wrapper)
    user_backward = wrapper.backward

    def vjp(*warp_args):
        for grad in warp_args[len(warp_args) - num_grads :]:
            grad.zero_()
        user_backward(*warp_args)

    return vjp, [n for n, _ in params], [a.type for _, a in params], num_grads


def _check_backward_arity(wrapper: WarpCallable) -> None:
    assert wrapper.backward is not None, "only a user backward has an arity to check"
    params, _ = _backward_parameters(wrapper)
    try:
        inspect.signature(wrapper.backward).bind(*range(len(params)))
    except TypeError:
        expected = ", ".join(n for n, _ in params)
        raise TypeError(
            f"warpnn.jax_callable '{wrapper.name}': backward is called with {len(params)} positional arguments "
            f"({expected}): the inputs, the forward's outputs, the cotangents of its float outputs and one "
            f"gradient array per float array input. Its signature {inspect.signature(wrapper.backward)} cannot "
            "take them."
        ) from None
    except ValueError:  # no signature to inspect (a builtin): trust it
        pass


@functools.lru_cache(maxsize=None)
def _array_uses(kernel) -> dict[str, ArrayUse]:
    """How ``kernel`` reads and writes each array parameter: warpnn's one analysis (``_signature``)."""
    specs = []
    for a in kernel.adj.args:
        try:
            specs.append(_arg_spec(a.label, a.type, kernel.key))
        except TypeError:  # a parameter JAX could not pass (a mesh id, an array of structs): not analysed
            pass
    return analyse_array_uses(kernel, specs)


def _is_float_array(value) -> bool:
    return isinstance(value, wp.array) and wc.type_scalar_type(value.dtype) in wc.float_types


def _check_gradient_chain(name: str, tape, call_arrays) -> None:
    """Refuse a recorded function whose gradient the tape would silently cut.

    The case: a float array allocated inside ``func`` without a gradient, written by one kernel from
    arrays with gradients and read by a later one. ``wp.Tape`` gives every input upstream of it a zero
    gradient; a wrong gradient is worse than an error. Decided from the kernels' sources by warpnn's array-use
    analysis; where it cannot tell how a kernel uses an array, that use does not count (no refusal on a guess).
    """
    passed_in = {a.ptr for a in call_arrays if isinstance(a, wp.array)}
    written: dict[int, Any] = {}  # ptr of a gradient-less intermediate -> the kernel that wrote it from differentiable arrays
    for launch in tape.launches:
        if callable(launch):
            continue
        kernel, values = launch[0], [*launch[3], *launch[4]]
        if not isinstance(kernel, wp.Kernel):
            continue
        uses = _array_uses(kernel)
        params = [a.label for a in kernel.adj.args]
        # Only uses the analysis is sure of count here, so that nothing is refused on a guess.
        decided = {p: u for p, u in uses.items() if u.undecided is None}
        differentiable = any(
            isinstance(v, wp.array) and v.requires_grad and p in decided and decided[p].reads
            for p, v in zip(params, values)
        )
        writes_floats = any(_is_float_array(v) and p in uses and uses[p].writes for p, v in zip(params, values))
        if differentiable and writes_floats and not warp_builds_adjoint(kernel):
            raise RuntimeError(NO_ADJOINT_MESSAGE.format(name=name, kernel=kernel.key))
        adjoint_problems = codegen_facts(kernel).adjoint_problems if differentiable and writes_floats else ()
        if adjoint_problems:
            raise RuntimeError(LOOP_ADJOINT_MESSAGE.format(name=name, kernel=kernel.key, problem=adjoint_problems[0]))
        for param, value in zip(params, values):
            use = decided.get(param)
            if use is None or not _is_float_array(value) or value.requires_grad or value.ptr in passed_in or not value.ptr:
                continue
            writer = written.get(value.ptr)
            if writer is not None and use.reads:
                raise RuntimeError(CUT_GRADIENT_MESSAGE.format(name=name, reader=kernel.key, param=param, writer=writer))
            if differentiable and use.writes:
                written[value.ptr] = kernel.key
