"""``warpnn.jax_kernel``: a Warp kernel as a differentiable, vmappable JAX function."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from . import _sharding
from ._launch import LAUNCH_DIMS_ATTR, LAUNCHER, SCALAR_ATTR_PREFIX
from ._signature import ArgSpec, KernelSignature, signature_of

Dims = int | Sequence[int]
OutputDims = Dims | Mapping[str, Dims]

_MAX_LAUNCH_DIMS = 4

SECOND_ORDER_MESSAGE = (
    "warpnn kernels are differentiable in reverse mode once (jax.grad, jax.vjp, jax.value_and_grad, "
    "jax.jacrev): Warp generates one adjoint kernel per kernel, and that adjoint has no adjoint of its own. "
    "grad-of-grad, jax.hessian and forward mode (jax.jvp, jax.jacfwd) are not supported. If you need "
    "second-order information, write the first derivative as its own Warp kernel and wrap it with "
    "warpnn.jax_kernel, or use a pure-JAX implementation for that part."
)

OUTPUT_READ_MESSAGE = (
    "Kernel '{key}' reads its output array(s) {names}, so it has no correct reverse mode: Warp's adjoint "
    "replays the kernel without its stores, sees the outputs' final values instead of the ones the kernel "
    "read, and writes the read's adjoint into the incoming cotangent. Write outputs only, with "
    "`out[i] = value`, `out[i] += value` or wp.atomic_add(out, i, value), accumulating in a local variable "
    "first if needed (the forward pass alone works as it is)."
)


@dataclasses.dataclass(frozen=True)
class _CallPlan:
    """Everything static about one call: hashable, so it can be a custom_vjp nondiff argument."""

    sig: KernelSignature
    scalars: tuple[tuple[str, Any], ...]
    launch_dims: tuple[int, ...]
    output_shapes: tuple[tuple[int, ...], ...]

    def attrs(self) -> dict[str, Any]:
        attrs = {LAUNCH_DIMS_ATTR: np.asarray(self.launch_dims, dtype=np.int64), **LAUNCHER.extra_attrs(self.sig)}
        for name, value in self.scalars:
            # int64 / float64 attributes hold every Warp scalar exactly; the handler casts to the kernel's type.
            if isinstance(value, (int, np.integer)):
                # uint64 values (Warp object ids) keep their bits in an int64 attribute; ctypes wraps them back
                attrs[SCALAR_ATTR_PREFIX + name] = np.int64(value - (1 << 64) if value >= (1 << 63) else value)
            else:
                attrs[SCALAR_ATTR_PREFIX + name] = np.float64(value)
        return attrs


class WarpKernel:
    """A Warp kernel callable from JAX, differentiable in reverse mode. Create with :func:`jax_kernel`."""

    def __init__(self, kernel, num_outputs: int = 1, launch_dims: Dims | None = None, output_dims: OutputDims | None = None):
        self.signature = signature_of(kernel, num_outputs)
        self.kernel = kernel
        self.num_outputs = num_outputs
        self.launch_dims = None if launch_dims is None else _normalize_dims(launch_dims, "launch_dims", self.signature)
        self.output_dims = output_dims
        if output_dims is not None:  # fail now, not at the first call
            _resolve_output_shapes(self.signature, output_dims, self.launch_dims or (1,))

    def __repr__(self) -> str:
        sig = self.signature
        return f"warpnn.jax_kernel({sig.key}: inputs {list(sig.input_names)} -> outputs {list(sig.output_names)})"

    def __call__(self, *args, launch_dims: Dims | None = None, output_dims: OutputDims | None = None) -> tuple[jax.Array, ...]:
        """Launch the kernel.

        Args:
            *args: the kernel's inputs in signature order: arrays as JAX (or NumPy) arrays whose dtype and
                rank match the Warp type (a ``wp.array(dtype=wp.vec3)`` is an ``(n, 3)`` array), scalars as
                static Python numbers.
            launch_dims: overrides the constructor's; default: the Warp shape of the first array input.
            output_dims: overrides the constructor's; an int, a tuple, or a dict keyed by output name,
                in Warp dims (``(n,)`` for a vec3 array) or full JAX dims (``(n, 3)``). Default: ``launch_dims``.

        Returns:
            A tuple with one array per output argument, zero-initialised before the kernel ran.
        """
        sig = self.signature
        arrays, scalars = _check_inputs(sig, args)
        dims = launch_dims if launch_dims is not None else self.launch_dims
        if dims is None:
            first = next((i for i, s in enumerate(sig.inputs) if s.is_array), None)
            if first is None:
                raise ValueError(
                    f"Kernel '{sig.key}' has no array input to take its launch dims from: pass launch_dims=..."
                )
            dims = tuple(np.shape(args[first])[: sig.inputs[first].warp_ndim])
        dims = _normalize_dims(dims, "launch_dims", sig)
        out_dims = output_dims if output_dims is not None else self.output_dims
        out_shapes = _resolve_output_shapes(sig, dims if out_dims is None else out_dims, dims)
        plan = _CallPlan(sig, scalars, dims, out_shapes)
        # Under shard_map, every operand must vary over the same mesh axes before the custom VJP, so that the
        # adjoint of a replicated parameter is psum-ed by JAX's transpose of pvary (a no-op elsewhere).
        return tuple(_differentiable_call(plan, *_sharding.match_vma(arrays)))


def jax_kernel(
    kernel,
    num_outputs: int = 1,
    launch_dims: Dims | None = None,
    output_dims: OutputDims | None = None,
) -> WarpKernel:
    """Wrap a Warp kernel as a JAX function that ``jit``, ``grad``, ``vmap`` and ``lax.scan`` understand.

    Same calling convention as ``wp.jax_kernel``: kernel inputs first, ``num_outputs`` output arrays last
    in the signature; call the result with the inputs, get a tuple of outputs.

    Unlike ``wp.jax_kernel`` it is always differentiable (reverse mode, through Warp's adjoint kernels,
    with respect to every float array input; the adjoint launch computes only those JAX differentiates in
    the call, so constant inputs cost nothing backward), zeroes outputs before launching (so
    ``wp.atomic_add`` accumulators are right), honours ``launch_dims`` / ``output_dims`` per output, and
    under ``vmap`` launches the kernel per batch element, which keeps kernels whose threads touch other
    elements (gathers, scatters) correct.

    Example::

        @wp.kernel
        def scale(x: wp.array(dtype=float), s: float, y: wp.array(dtype=float)):
            i = wp.tid()
            y[i] = s * x[i]

        f = warpnn.jax_kernel(scale)
        (y,) = f(jnp.ones(8), 2.0)
        g = jax.grad(lambda x: f(x, 2.0)[0].sum())(jnp.ones(8))   # == 2.0 everywhere

    Args:
        kernel: a ``@wp.kernel`` function.
        num_outputs: how many trailing kernel arguments are outputs.
        launch_dims: default launch dims (1-4 ints); default: the Warp shape of the first array input.
        output_dims: default output dims; an int, a tuple, or a dict keyed by output argument name.
    """
    return WarpKernel(kernel, num_outputs, launch_dims, output_dims)


# --------------------------------------------------------------------------------------------------
# Input checking: every mistake is reported at trace time, naming the argument and the fix.


def _check_inputs(sig: KernelSignature, args: tuple) -> tuple[list[jax.Array], tuple[tuple[str, Any], ...]]:
    if len(args) != len(sig.inputs):
        raise TypeError(
            f"Kernel '{sig.key}' takes {len(sig.inputs)} inputs {list(sig.input_names)} (its outputs "
            f"{list(sig.output_names)} are returned, not passed), but was called with {len(args)}."
        )
    arrays, scalars = [], []
    for spec, value in zip(sig.inputs, args):
        if spec.is_array:
            arrays.append(_check_array(sig, spec, value))
        else:
            scalars.append((spec.name, _check_scalar(sig, spec, value)))
    return arrays, tuple(scalars)


def _check_array(sig: KernelSignature, spec: ArgSpec, value) -> jax.Array:
    where = f"Kernel '{sig.key}', argument '{spec.name}'"
    if isinstance(value, numbers.Number) or not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"{where} expects a {spec.describe()}, got {type(value).__name__} {value!r:.60}.")
    if np.dtype(value.dtype) != spec.dtype:
        raise TypeError(
            f"{where} expects dtype {spec.dtype.name} ({spec.warp_type_name}), got {np.dtype(value.dtype).name}. "
            f"Fix: pass {spec.name}.astype(jnp.{spec.dtype.name})"
            + (" and enable 64-bit JAX (jax.config.update('jax_enable_x64', True))." if spec.dtype.itemsize == 8 else ".")
        )
    shape = tuple(value.shape)
    if len(shape) != spec.jax_ndim:
        raise ValueError(
            f"{where} expects a {spec.describe()}, got shape {shape} ({len(shape)}-D). "
            + (f"A Warp {spec.warp_dtype.__name__} array of Warp shape (n, ...) is a JAX array of shape "
               f"(n, ..., {', '.join(map(str, spec.inner_shape))}). " if spec.inner_shape else "")
            + "To batch a call, use jax.vmap rather than adding leading dims."
        )
    if spec.inner_shape and shape[spec.warp_ndim :] != spec.inner_shape:
        raise ValueError(
            f"{where} expects inner dims {spec.inner_shape} for Warp dtype {spec.warp_dtype.__name__}, "
            f"got shape {shape}."
        )
    return jnp.asarray(value)


def _check_scalar(sig: KernelSignature, spec: ArgSpec, value):
    where = f"Kernel '{sig.key}', argument '{spec.name}'"
    if isinstance(value, jax.core.Tracer) or isinstance(value, jax.Array) or isinstance(value, np.ndarray):
        what = "a traced value" if isinstance(value, jax.core.Tracer) else f"an array of shape {np.shape(value)}"
        raise TypeError(
            f"{where} is a static {spec.dtype.name} scalar, but got {what}. Warp scalars are compile-time "
            "constants of the call. Fix: pass a Python number (mark it static, e.g. "
            "jax.jit(..., static_argnames=...), or an eqx.field(static=True) in a module); to trace or train it, "
            f"declare it in the kernel as a 1-element array ({spec.name}: wp.array(dtype=...)) and read "
            f"{spec.name}[0]."
        )
    if not isinstance(value, (numbers.Number, np.generic)):
        raise TypeError(f"{where} expects a static {spec.dtype.name} number, got {type(value).__name__}.")
    if spec.dtype.kind in "iub":
        if isinstance(value, (float, np.floating)) and not float(value).is_integer():
            raise TypeError(f"{where} is an integer ({spec.dtype.name}) scalar, got the non-integer {value!r}.")
        value = int(value)
        info = np.iinfo(spec.dtype) if spec.dtype.kind != "b" else None
        if info is not None and not info.min <= value <= info.max:
            raise ValueError(f"{where}: {value} does not fit in {spec.dtype.name} [{info.min}, {info.max}].")
        return value
    return float(value)


def _normalize_dims(dims, what: str, sig: KernelSignature) -> tuple[int, ...]:
    if isinstance(dims, (int, np.integer)):
        dims = (int(dims),)
    if isinstance(dims, str):
        raise TypeError(
            f"Kernel '{sig.key}': {what} must be an int or a tuple of ints, got the string {dims!r}. (Layers of "
            "warpnn.equinox / nnx / linen accept an argument name there; jax_kernel needs the numbers.)"
        )
    try:
        dims = tuple(int(d) for d in dims)
    except TypeError:
        raise TypeError(f"Kernel '{sig.key}': {what} must be an int or a tuple of ints, got {dims!r}.") from None
    if not 1 <= len(dims) <= _MAX_LAUNCH_DIMS or any(d < 0 for d in dims):
        raise ValueError(
            f"Kernel '{sig.key}': {what}={dims} must have 1 to {_MAX_LAUNCH_DIMS} non-negative entries."
        )
    return dims


def _resolve_output_shapes(sig: KernelSignature, output_dims: OutputDims, launch_dims) -> tuple[tuple[int, ...], ...]:
    if isinstance(output_dims, Mapping):
        unknown = set(output_dims) - set(sig.output_names)
        missing = [n for n in sig.output_names if n not in output_dims]
        if unknown or missing:
            raise ValueError(
                f"Kernel '{sig.key}': output_dims keys must be exactly the output names {list(sig.output_names)}; "
                + (f"unknown {sorted(unknown)} " if unknown else "")
                + (f"missing {missing}" if missing else "")
            )
        per_output = [output_dims[n] for n in sig.output_names]
    else:
        per_output = [output_dims] * len(sig.outputs)
    return tuple(_output_shape(sig, spec, d) for spec, d in zip(sig.outputs, per_output))


def _output_shape(sig: KernelSignature, spec: ArgSpec, dims) -> tuple[int, ...]:
    dims = _normalize_dims(dims, f"output_dims for '{spec.name}'", sig)
    if len(dims) == spec.warp_ndim:
        return spec.jax_shape(dims)
    if len(dims) == spec.jax_ndim and dims[spec.warp_ndim :] == spec.inner_shape:
        return dims
    raise ValueError(
        f"Kernel '{sig.key}': output '{spec.name}' is a {spec.describe()}, so its output_dims must have "
        f"{spec.warp_ndim} Warp dims" + (f" (or {spec.jax_ndim} JAX dims ending in {spec.inner_shape})" if spec.inner_shape else "")
        + f", got {dims}. Pass output_dims={{'{spec.name}': ...}} to size outputs separately."
    )


# --------------------------------------------------------------------------------------------------
# The differentiable call: forward and adjoint FFI calls joined by custom_vjp.


def _ffi_call(plan: _CallPlan, adjoint: bool, operands) -> list[jax.Array]:
    fwd_target, adj_target = LAUNCHER.targets(plan.sig)
    if adjoint:
        shapes = {s.name: op.shape for s, op in zip(plan.sig.array_inputs, operands)}
        specs, shapes = plan.sig.adjoint_inputs, [shapes[s.name] for s in plan.sig.adjoint_inputs]
    else:
        specs, shapes = plan.sig.outputs, plan.output_shapes
    out_types = [jax.ShapeDtypeStruct(shape, spec.dtype) for shape, spec in zip(shapes, specs)]
    # jax.ffi.ffi_call with vmap_method="expand_dims" (under vmap every operand gets a leading batch dim,
    # size 1 when unbatched, and the launcher launches per batch element instead of folding the batch into
    # Warp's dims), wrapped in a primitive that keeps a sharded vmap batch sharded under jax.jit (each
    # device launches its own batch elements) and types outputs under shard_map: see _sharding.py.
    results = _sharding.ffi_call(adj_target if adjoint else fwd_target, out_types, _fence(operands), plan.attrs(), kernel=(plan.sig, adjoint))
    return _fence(results)


def _fence(values) -> list[jax.Array]:
    """Hide from XLA that an operand is a slice of a bigger buffer, or a result goes into one.

    Inside a loop (``lax.scan`` over ``xs``, a scan's stacked residuals read back by its transpose, a
    trajectory stacked into ``ys``), XLA's GPU compiler otherwise wraps the custom call in a dynamic-slice
    fusion that passes it an address inside the stacked buffer. The thunk behind that fusion computes the
    slice offset on the host every iteration (an HLO evaluation, or a device-to-host copy and a stream
    synchronisation); in the scans we measured it also kept the loop body from being captured as one CUDA
    graph. Behind the barrier XLA copies the slice on the device instead, inside the graph. Measured on an
    H200 (docs/profiles.md, ``python -m benchmarks.profile_fence``): a 200-step scan fwd+bwd step of a
    4096-element kernel went from 21-26 µs to 15 µs (pure JAX in the same process: 12-16 µs). Outside
    loops, and on the CPU, the barrier costs nothing: it only orders operations.
    """
    return list(jax.lax.optimization_barrier(tuple(values))) if values else list(values)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _first_order_only(plan: _CallPlan, adjoint: bool, *operands) -> list[jax.Array]:
    """An FFI call that refuses, with a clear message, to be differentiated (again)."""
    return _ffi_call(plan, adjoint, operands)


def _first_order_only_fwd(plan, adjoint, *operands):
    return _ffi_call(plan, adjoint, operands), None


def _first_order_only_bwd(plan, adjoint, residuals, cotangents):
    raise NotImplementedError(SECOND_ORDER_MESSAGE)


_first_order_only.defvjp(_first_order_only_fwd, _first_order_only_bwd)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _Static:
    """A residual that is not an array: the adjoint's call plan, chosen in the forward pass."""

    value: Any


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable_call(plan: _CallPlan, *arrays) -> list[jax.Array]:
    return _ffi_call(plan, False, arrays)


def _differentiable_call_fwd(plan, *primals):
    # symbolic_zeros=True: each primal says whether JAX differentiates with respect to it in this call.
    arrays = tuple(p.value for p in primals)
    outputs = _first_order_only(plan, False, *arrays)
    # Warp's adjoint never touches primal outputs of a kernel that only writes them (see
    # KernelSignature.outputs_read), so float outputs are not kept: their cotangents stand in, unread.
    # Integer outputs have no cotangent and are kept to fill their slot.
    kept = tuple(None if spec.is_float else out for spec, out in zip(plan.sig.outputs, outputs))
    # Inputs JAX does not differentiate (constants, stop_gradient, parameters outside the grad) get no
    # adjoint buffer: Warp skips the atomic adds into them, and nothing is zeroed for them.
    constant = frozenset(spec.name for spec, p in zip(plan.sig.array_inputs, primals) if not p.perturbed)
    adjoint_plan = dataclasses.replace(plan, sig=plan.sig.without_adjoints(constant))
    return outputs, (arrays, kept, _Static(adjoint_plan))


def _differentiable_call_bwd(plan, residuals, cotangents):
    arrays, kept, adjoint_plan = residuals
    plan = adjoint_plan.value
    sig = plan.sig
    float_cts = [ct for ct, spec in zip(cotangents, sig.outputs) if spec.is_float]
    if not sig.adjoint_inputs or all(isinstance(ct, SymbolicZero) for ct in float_cts):
        return (None,) * len(sig.array_inputs)  # nothing to differentiate, or a zero cotangent: zero adjoints
    if sig.outputs_read:
        raise TypeError(OUTPUT_READ_MESSAGE.format(key=sig.key, names=list(sig.outputs_read)))
    if not sig.has_adjoint:
        raise TypeError(
            f"Kernel '{sig.key}' was compiled without an adjoint (enable_backward=False on the kernel or its "
            "module), so it cannot be differentiated. Remove enable_backward=False, or keep its inputs out of "
            "the gradient with jax.lax.stop_gradient if you only need its forward pass."
        )
    # Integer outputs have float0 cotangents; Warp gets no adjoint buffer for them. A symbolic-zero cotangent
    # of one float output among others becomes a zero array: Warp's adjoint reads every output's adjoint.
    float_cts = [jnp.zeros(ct.aval.shape, ct.aval.dtype) if isinstance(ct, SymbolicZero) else ct for ct in float_cts]
    float_cts_iter = iter(float_cts)
    outputs = [next(float_cts_iter) if out is None else out for out in kept]
    adjoints = dict(zip((s.name for s in sig.adjoint_inputs), _first_order_only(plan, True, *arrays, *outputs, *float_cts)))
    return tuple(adjoints.get(spec.name) for spec in sig.array_inputs)


_differentiable_call.defvjp(_differentiable_call_fwd, _differentiable_call_bwd, symbolic_zeros=True)
