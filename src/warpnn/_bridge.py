"""``warpnn.jax_kernel``: a Warp kernel as a differentiable, vmappable JAX function."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

import warp as wp

from . import _checked, _cuda_graphs, _equality_guard, _measured, _pruned, _sharding, _spread, _twins, _unrolled
from . import _value_args
from . import _warp_compat as wc
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

FORWARD_MODE_MESSAGE = (
    "Kernel '{name}' is differentiable in reverse mode (jax.grad, jax.vjp, jax.value_and_grad, jax.jacrev), "
    "once: warpnn differentiates through Warp's adjoint kernel, and Warp generates no forward-mode (tangent) "
    "kernel. jax.jvp, jax.jacfwd, jax.linearize and jax.hessian are not supported. Fix: use jax.jacrev "
    "instead of jax.jacfwd (same Jacobian); for second-order information write the first derivative as its "
    "own Warp kernel (a second warpnn.jax_kernel) or use pure JAX for that part."
)

# JAX's own message when forward mode meets a custom_vjp; replaced by warpnn's, which names the kernel.
_JAX_JVP_ERROR = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


def _jvp_tracer_type() -> type | None:
    """JAX's JVP tracer type (private), or None for a JAX that moved it (then only the error translation in
    ``forward_mode_refused`` applies)."""
    try:
        from jax._src.interpreters.ad import JVPTracer
    except ImportError:
        return None
    return JVPTracer


_JVP_TRACER = _jvp_tracer_type()


def _direct_linearize() -> bool:
    try:
        from jax._src.config import use_direct_linearize
    except ImportError:  # a JAX without the switch linearizes directly
        return True
    return bool(use_direct_linearize.value)


def _is_forward_mode(operands: Sequence[Any]) -> bool:
    # With direct linearization (JAX's default) only forward mode traces with JVP tracers; without it
    # jax.grad does too, and must not be refused.
    return (_JVP_TRACER is not None and any(isinstance(x, _JVP_TRACER) for x in operands)
            and _direct_linearize())


@contextlib.contextmanager
def forward_mode_refused(message: str, operands: Sequence[Any]):
    """Raises ``message`` instead of JAX's generic error when forward mode meets warpnn's custom VJP.

    Under ``jax.jvp`` / ``jax.jacfwd`` the operands arrive as JVP tracers (``jax.grad`` and ``jax.vjp`` use
    linearize tracers), so the call is refused before it is traced; JAX itself would only fail later, at
    evaluation or lowering, outside warpnn. What slips past (the outer pass of ``jax.hessian``, JAX with
    direct linearization turned off) gets its generic error replaced when it is raised inside the block.
    ``jax.linearize`` looks like ``jax.vjp`` here, and keeps JAX's message when its linear function is called.
    """
    if _is_forward_mode(operands):
        raise TypeError(message)
    try:
        yield
    except TypeError as error:
        if _JAX_JVP_ERROR in str(error):
            raise TypeError(message) from None
        raise


OUTPUT_READ_MESSAGE = (
    "Kernel '{key}' reads its output array(s) {names}, so it has no correct reverse mode: Warp's adjoint "
    "replays the kernel without its stores, sees the outputs' final values instead of the ones the kernel "
    "read, and writes the read's adjoint into the incoming cotangent. Write outputs only, with "
    "`out[i] = value`, `out[i] += value` or wp.atomic_add(out, i, value), accumulating in a local variable "
    "first if needed (the forward pass alone works as it is)."
)


VMAP_METHODS = (None, "sequential", "sequential_unrolled", "broadcast_all", "expand_dims", "legacy_vectorized")

FORWARD_ONLY_MESSAGE = (
    "Kernel '{key}' was wrapped with enable_backward=False, so warpnn built no adjoint for it and it cannot be "
    "differentiated. Wrap it with warpnn.jax_kernel(..., enable_backward=True) (warpnn's default), or keep its "
    "inputs out of the gradient with jax.lax.stop_gradient."
)

REVERSE_PROBLEM_MESSAGE = "Kernel '{key}' cannot be differentiated: {problems}. The forward pass works as it is."
LOOP_ADVICE = (
    " To differentiate, let a dynamic loop's carried variables only accumulate (`total += term`, the term free of "
    "other carried variables), bound the loop by an int argument of the kernel or an array's shape (`range(n)`, "
    "`range(x.shape[0])`: warpnn unrolls such a loop for the adjoint, up to $WARPNN_MAX_UNROLL iterations), or keep "
    "the loop's partial results in an array (one element per iteration) instead of a variable."
)
IN_PLACE_ADVICE = (
    " Warp's adjoint replays the kernel against the values its arrays had before the launch, which is only right "
    "if no thread reads a value written in the same launch. To differentiate, read the old values and write the "
    "new ones at the thread's own wp.tid() element, reading before writing (`y[i] = f(y[i], ...)`), accumulate "
    "with `out[i] += value` / wp.atomic_add, or write the results to a separate output array."
)

INPUT_WRITE_MESSAGE = (
    "Kernel '{key}' writes its input array '{name}' ({where}). Inputs are buffers XLA owns (the caller's arrays, "
    "constants baked into the executable, values other operations still read), so warpnn never lets a kernel "
    "write one. Fix: declare it in-out, warpnn.jax_kernel({key}, num_outputs=..., in_out_argnames=['{name}']) "
    "(the kernel then gets its own copy and the call returns its new values first, and num_outputs counts it), "
    "or write to an output array instead."
)

UNDECIDED_INPUT_MESSAGE = (
    "Kernel '{key}': warpnn cannot tell whether the kernel writes its input array '{name}': {reason}. Inputs are "
    "buffers XLA owns, so warpnn refuses rather than risk a write into one. Fix: declare it in-out, "
    "warpnn.jax_kernel({key}, num_outputs=..., in_out_argnames=['{name}']), which hands the kernel its own copy "
    "(and returns it, counted by num_outputs)."
)

CONSTRUCTOR_MESSAGE = (
    "warpnn.WarpKernel is created by warpnn.jax_kernel(kernel, num_outputs=..., ...), which takes Warp's "
    "arguments and returns the same wrapper for the same arguments. Fix: call warpnn.jax_kernel instead."
)


@dataclasses.dataclass(frozen=True)
class _CallPlan:
    """Everything static about one call: hashable, so it can be a custom_vjp nondiff argument."""

    sig: KernelSignature
    scalars: tuple[tuple[str, Any], ...]
    launch_dims: tuple[int, ...]
    output_shapes: tuple[tuple[int, ...], ...]  # pure outputs; in-out results take their operand's shape
    has_side_effect: bool = False
    differentiable: bool = True
    # (input, output) pairs whose output the forward call writes into the input's buffer (XLA aliases them;
    # see KernelSignature.in_place_pairs). Set only on calls that are not differentiated.
    outputs_in_place: tuple[tuple[str, str], ...] = ()

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


@dataclasses.dataclass(frozen=True)
class _KernelOptions:
    """:func:`jax_kernel`'s arguments after the kernel, in its order (Warp's), with its defaults applied
    (``in_out_argnames`` a tuple, ``enable_backward`` True unless False is given): what a wrapper is built
    from, and what makes two calls of :func:`jax_kernel` return the same wrapper."""

    num_outputs: int
    vmap_method: str | None
    launch_dims: Dims | None
    output_dims: OutputDims | None
    in_out_argnames: tuple[str, ...]
    module_preload_mode: Any
    enable_backward: bool
    has_side_effect: bool
    block_dim: int | None

    def cache_key(self, kernel) -> tuple | None:
        """The :data:`_WRAPPERS` key of ``kernel`` with these options, or None when an option is unhashable."""
        key = (kernel, *(_hashable(getattr(self, f.name)) for f in dataclasses.fields(self)),
               # an explicit block_dim means more than one CPU thread per block only with CPU blocks on
               bool(wp.config.enable_cpu_blocks) if self.block_dim is not None else None)
        try:
            hash(key)
        except TypeError:
            return None
        return key


class WarpKernel:
    """A Warp kernel callable from JAX, differentiable in reverse mode. Create with :func:`jax_kernel`, which
    checks its arguments into the ``options`` this constructor takes and returns the same wrapper for the
    same arguments."""

    def __init__(self, kernel, options: _KernelOptions):
        if not isinstance(options, _KernelOptions):
            raise TypeError(CONSTRUCTOR_MESSAGE)
        # (vector, matrix, quaternion and transform values: passed as their components to a twin, _value_args.py)
        self.signature = signature_of(_value_args.with_components(kernel), options.num_outputs,
                                      options.in_out_argnames, options.block_dim)
        self.kernel = kernel
        # the kernel's own inputs, where the signature has a value parameter's components in its place
        values = _value_args.value_params(kernel)
        extra = sum(len(_value_args.component_names(n, t)) - 1 for n, t in values.items())
        self._value_inputs = [p.label for p in kernel.adj.args[: len(self.signature.inputs) - extra]] if values else None
        self.num_outputs = options.num_outputs
        self.vmap_method = _check_vmap_method(options.vmap_method, self.signature)
        self.in_out_argnames = self.signature.in_out_names
        self.module_preload_mode = options.module_preload_mode
        self.enable_backward = options.enable_backward
        self.has_side_effect = options.has_side_effect
        self.block_dim = options.block_dim
        self.launch_dims = (None if options.launch_dims is None
                            else _normalize_dims(options.launch_dims, "launch_dims", self.signature))
        self.output_dims = options.output_dims
        _check_writes(self.signature)
        if self.output_dims is not None:  # fail now, not at the first call
            _resolve_output_shapes(self.signature, self.output_dims, self.launch_dims or (1,))

    def __repr__(self) -> str:
        sig = self.signature
        return f"warpnn.jax_kernel({sig.key}: inputs {list(sig.input_names)} -> results {list(sig.result_names)})"

    def __call__(self, *args, launch_dims: Dims | None = None, output_dims: OutputDims | None = None,
                 vmap_method: str | None = None) -> tuple[jax.Array, ...]:
        """Launch the kernel.

        Args:
            *args: the kernel's inputs in signature order (in-out arrays included): arrays as JAX (or NumPy)
                arrays whose dtype and rank match the Warp type (a ``wp.array(dtype=wp.vec3)`` is an ``(n, 3)``
                array), or ``None`` for an array the kernel treats as optional (Warp gets a null array);
                scalars as static Python numbers.
            launch_dims: overrides the constructor's; default: the Warp shape of the first array input.
            output_dims: overrides the constructor's; an int, a tuple, or a dict keyed by output name,
                in Warp dims (``(n,)`` for a vec3 array) or full JAX dims (``(n, 3)``). Default: ``launch_dims`` (for an output of another rank: the shape of the first array input of its rank).
            vmap_method: overrides the constructor's (see :func:`jax_kernel`).

        Returns:
            A tuple with the new values of the in-out arrays, then one array per output argument (outputs
            zero-initialised before the kernel ran).
        """
        sig = self.signature
        _check_vmap_method(vmap_method, sig)
        if self._value_inputs is not None:
            if len(args) != len(self._value_inputs):
                raise TypeError(
                    f"Kernel '{sig.key}' takes {len(self._value_inputs)} inputs {self._value_inputs} (its outputs "
                    f"{list(sig.output_names)} are returned, not passed), but was called with {len(args)}."
                )
            args = tuple(_value_args.expand(self.kernel, args))
        arrays, scalars, nulls = _check_inputs(sig, args)
        call_sig = sig.variant(null_inputs=nulls)
        dims = launch_dims if launch_dims is not None else self.launch_dims
        if dims is None:
            first = next((i for i, s in enumerate(sig.inputs) if s.is_array and args[i] is not None), None)
            if first is None:
                raise ValueError(
                    f"Kernel '{sig.key}' has no array argument to take its launch dims from: pass launch_dims=..."
                )
            dims = tuple(np.shape(args[first])[: sig.inputs[first].warp_ndim])
        dims = _normalize_dims(dims, "launch_dims", sig)
        try:
            wc.validate_launch_bounds(dims, sig.kernel, self.block_dim)
        except ValueError as e:  # Warp's message does not say which kernel
            raise ValueError(f"Kernel '{sig.key}': {e}") from None
        out_dims = output_dims if output_dims is not None else self.output_dims
        if out_dims is None:
            out_dims = _default_output_dims(sig, dims, args)
        out_shapes = _resolve_output_shapes(sig, out_dims, dims)
        _check_launch_fits(sig, dims, {s.name: a.shape for s, a in zip(call_sig.array_inputs, arrays)},
                           dict(zip(sig.output_names, out_shapes)))
        _check_platform(sig)
        _preload(sig, self.module_preload_mode)
        plan = _CallPlan(call_sig, scalars, dims, out_shapes, self.has_side_effect, self.enable_backward)
        # Under shard_map, every operand must vary over the same mesh axes before the custom VJP, so that the
        # adjoint of a replicated parameter is psum-ed by JAX's transpose of pvary (a no-op elsewhere).
        with forward_mode_refused(FORWARD_MODE_MESSAGE.format(name=sig.key), arrays):
            if _checked.is_checked():  # index-checked variant of the kernel (warpnn.checked())
                return _checked.call(plan, _sharding.match_vma(arrays), _differentiable_call)
            return tuple(_differentiable_call(plan, *_sharding.match_vma(arrays)))


_WRAPPERS: dict[tuple, WarpKernel] = {}


def jax_kernel(
    kernel,
    num_outputs: int = 1,
    vmap_method: str | None = None,
    launch_dims: Dims | None = None,
    output_dims: OutputDims | None = None,
    in_out_argnames: Sequence[str] | None = None,
    module_preload_mode=None,
    enable_backward: bool | None = None,
    has_side_effect: bool = False,
    block_dim: int | None = None,
) -> WarpKernel:
    """Wrap a Warp kernel as a JAX function that ``jit``, ``grad``, ``vmap`` and ``lax.scan`` understand.

    Warp 1.19's ``wp.jax_kernel`` parameters, in Warp's order and with Warp's meaning, so switching is one
    import: kernel inputs first, ``num_outputs`` results last in the signature (in-out arrays included); call
    the result with the inputs, get a tuple of results. The same arguments return the same wrapper.

    Unlike ``wp.jax_kernel`` it is differentiable by default (reverse mode, through Warp's adjoint kernels,
    with respect to every float array input and in-out array; the adjoint launch computes only those JAX
    differentiates in the call, so constant inputs cost nothing backward), zeroes outputs before launching
    (so ``wp.atomic_add`` accumulators are right), honours ``launch_dims`` / ``output_dims`` per output and
    per call, never lets a kernel write an array it did not declare in-out, and under ``vmap`` launches the
    kernel per batch element, which keeps kernels whose threads touch other elements (gathers, scatters)
    correct.

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
        num_outputs: how many trailing kernel arguments are results, in-out arrays included.
        vmap_method: how the call batches under ``jax.vmap``; any of Warp's names (``"broadcast_all"``,
            ``"sequential"``, ``"sequential_unrolled"``, ``"expand_dims"``, ``"legacy_vectorized"``) or None.
            Every method gives per-element results: warpnn launches the kernel once per batch element with
            batched and shared arguments mixed freely, which is what ``"sequential"`` means and what the others
            mean for every kernel where Warp's folded launch is right (it is wrong for gathers and scatters).
            Also per call.
        launch_dims: default launch dims (1-4 ints); default: the Warp shape of the first array input.
        output_dims: default output dims; an int, a tuple, or a dict keyed by output argument name.
        in_out_argnames: array inputs the kernel reads and writes (e.g. ``y[i] = y[i] + a * x[i]``): the
            kernel updates its own copy (aliased to the result where XLA can), and the call returns the new
            values before the outputs. Differentiable where the kernel reads each element before writing it
            at its own ``wp.tid()`` index, or only accumulates into it; otherwise differentiating is a clear
            error. Any other array input that the kernel writes is an error at construction.
        module_preload_mode: a ``wp.JaxModulePreloadMode``: ``CURRENT_DEVICE`` (default) loads the Warp module
            on the devices the call is traced for, ``ALL_DEVICES`` on every device JAX and Warp share too,
            ``NONE`` defers loading to the launcher (which still loads before the first execution).
        enable_backward: ``True`` (default; Warp's default is False) builds the adjoint; ``False``: forward
            only, differentiating is an error. A kernel compiled without an adjoint (``enable_backward=False``
            on the kernel or its module) is differentiated through a twin warpnn builds with one.
        has_side_effect: keep the call even when its results are unused.
        block_dim: threads per block, for tile kernels (launch over the tile grid times ``block_dim``, as
            ``wp.launch`` with ``block_dim``); default: 256 on CUDA, 1 on the CPU. On the CPU values above one
            are honoured when ``wp.config.enable_cpu_blocks`` is True.
    """
    options = _KernelOptions(num_outputs, vmap_method, launch_dims, output_dims, tuple(in_out_argnames or ()),
                             module_preload_mode, True if enable_backward is None else bool(enable_backward),
                             bool(has_side_effect), _check_block_dim(block_dim))
    key = options.cache_key(kernel)
    wrapper = _WRAPPERS.get(key) if key is not None else None
    if wrapper is None or wrapper.kernel is not kernel:
        wrapper = WarpKernel(kernel, options)
        if key is not None:
            _WRAPPERS[key] = wrapper
    return wrapper


def _hashable(value):
    if isinstance(value, Mapping):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    return value


def _check_block_dim(block_dim):
    if block_dim is None:
        return None
    if isinstance(block_dim, bool) or not isinstance(block_dim, (int, np.integer)):
        raise TypeError(f"jax_kernel(): block_dim must be an integer or None, got {block_dim!r}.")
    if block_dim <= 0:
        raise ValueError(f"jax_kernel(): block_dim must be positive, got {block_dim}.")
    return int(block_dim)


def _check_vmap_method(vmap_method, sig: KernelSignature):
    if vmap_method not in VMAP_METHODS:
        raise ValueError(
            f"Kernel '{sig.key}': vmap_method={vmap_method!r} is not one of {list(VMAP_METHODS)}. (Every method "
            "gives per-element results in warpnn; None is the default.)"
        )
    return vmap_method


def _check_writes(sig: KernelSignature) -> None:
    for name in sig.written_inputs:
        use = sig.uses[name]
        if "." in name:
            raise TypeError(
                f"Kernel '{sig.key}' writes (or may write: {use.undecided or 'see its source'}) the array '{name}' held in a "
                "struct argument. Struct fields are inputs XLA owns and cannot be in-out. Fix: pass that array as its "
                "own kernel argument and declare it in_out_argnames=[...], or write to an output array."
            )
        if use.undecided is not None:
            raise TypeError(UNDECIDED_INPUT_MESSAGE.format(key=sig.key, name=name, reason=use.undecided))
        write = use.first("store", "accumulate", "read-write")
        where = f"line {write.line}" + (f", inside @wp.func '{write.via}'" if write.via else "")
        raise TypeError(INPUT_WRITE_MESSAGE.format(key=sig.key, name=name, where=where))


def _check_launch_fits(sig: KernelSignature, dims, input_shapes: Mapping[str, tuple], output_shapes: Mapping[str, tuple]):
    """Launch dims larger than an array the kernel provably indexes at ``wp.tid()`` would access it out of range.

    Provable: an unconditional access at the thread's own coordinates, in a kernel with no ``return`` (which
    could guard it), whose array rank equals the launch rank.
    """
    if sig.kernel_has_return:
        return
    for name, shape in (*input_shapes.items(), *output_shapes.items()):
        spec = next(s for s in (*sig.input_leaves, *sig.outputs) if s.name == name)
        if spec.warp_ndim != len(dims):
            continue
        access = next((a for a in sig.uses[name].accesses if a.own_element and a.top_level), None)
        warp_shape = tuple(shape[: spec.warp_ndim])
        if access is not None and any(d > n for d, n in zip(dims, warp_shape)):
            role = "output" if name in output_shapes else "input"
            fix = ("pass output_dims covering the launch" if role == "output"
                   else "pass launch_dims no larger than the array, or guard the access with `if i < a.shape[0]:`")
            raise ValueError(
                f"Kernel '{sig.key}': launch_dims={tuple(dims)} exceed the Warp shape {warp_shape} of {role} '{name}', "
                f"which line {access.line} accesses at the thread's own wp.tid() index on every thread: threads "
                f"beyond its shape would {'write' if access.kind != 'read' else 'read'} out of range. Fix: {fix}."
            )


def _check_platform(sig: KernelSignature) -> None:
    if jax.default_backend() == "gpu" and not wc.runtime().is_cuda_enabled:
        raise RuntimeError(
            f"Kernel '{sig.key}': JAX computes on a GPU, but this Warp build does not include CUDA support. Install "
            "a warp-lang wheel built with CUDA, or run the call on the CPU (jax.default_device)."
        )
    if jax.default_backend() == "cpu" and not wp.is_cpu_available():
        raise RuntimeError(
            f"Kernel '{sig.key}': JAX computes on the CPU, but this Warp build does not include CPU support (its CPU "
            "compiler library is missing). Install a warp-lang wheel with CPU support, or run the call on a GPU "
            "(jax.default_device)."
        )


def _preload(sig: KernelSignature, mode) -> None:
    """Warp's module preload modes; the launchers always load on the devices a call is traced for."""
    if mode is None or getattr(mode, "name", mode) in ("CURRENT_DEVICE", "NONE"):
        return
    if getattr(mode, "name", mode) != "ALL_DEVICES":
        raise ValueError(f"Kernel '{sig.key}': module_preload_mode={mode!r} is not a wp.JaxModulePreloadMode.")
    for backend in ("cpu", "gpu"):
        try:
            devices = jax.local_devices(backend=backend)
        except RuntimeError:
            continue
        for device in devices:
            try:
                warp_device = wp.device_from_jax(device)
            except (IndexError, RuntimeError):
                continue
            sig.kernel.module.load(warp_device, wc.resolve_block_dim(warp_device, sig.block_dim))


# --------------------------------------------------------------------------------------------------
# Input checking: every mistake is reported at trace time, naming the argument and the fix.


def _check_inputs(sig: KernelSignature, args: tuple):
    """The operands (array inputs that are not None, struct fields included), the static scalars, and the names
    of None inputs."""
    if len(args) != len(sig.inputs):
        raise TypeError(
            f"Kernel '{sig.key}' takes {len(sig.inputs)} inputs {list(sig.input_names)} (its outputs "
            f"{list(sig.output_names)} are returned, not passed), but was called with {len(args)}."
        )
    arrays, scalars, nulls = [], [], []
    for spec, value in _leaf_values(sig, sig.inputs, args):
        if spec.is_array:
            if value is None:
                if spec.name in sig.in_out_names:
                    raise TypeError(f"Kernel '{sig.key}': in-out argument '{spec.name}' cannot be None: the call returns its new values.")
                nulls.append(spec.name)
                continue
            arrays.append(_check_array(sig, spec, value))
        else:
            scalars.append((spec.name, _check_scalar(sig, spec, value)))
    return arrays, tuple(scalars), frozenset(nulls)


def _leaf_values(sig: KernelSignature, specs, values):
    """(leaf spec, value) for every array and scalar, a struct's fields taken from a dict (or attributes)."""
    for spec, value in zip(specs, values):
        if not spec.is_struct:
            yield spec, value
            continue
        names = [f.name.rsplit(".", 1)[-1] for f in spec.fields]
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(names))
            missing = [n for n in names if n not in value]
            if unknown or missing:
                raise TypeError(
                    f"Kernel '{sig.key}', argument '{spec.name}' is the wp.struct {spec.warp_type.key} with fields "
                    f"{names}; the dict passed for it " + (f"lacks {missing}" if missing else "")
                    + (" and " if missing and unknown else "") + (f"has unknown keys {unknown}" if unknown else "")
                    + ". Pass a dict with exactly its fields (arrays as JAX arrays, scalars as Python numbers)."
                )
            field_values = [value[n] for n in names]
        elif value is not None and all(hasattr(value, n) for n in names):
            field_values = [getattr(value, n) for n in names]
        else:
            raise TypeError(
                f"Kernel '{sig.key}', argument '{spec.name}' is the wp.struct {spec.warp_type.key}: pass a dict of its "
                f"fields {names} (arrays as JAX arrays, scalars as Python numbers), got {type(value).__name__}."
            )
        yield from _leaf_values(sig, spec.fields, field_values)


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


def _default_output_dims(sig: KernelSignature, launch_dims, args) -> dict[str, tuple[int, ...]]:
    """Each output's default Warp shape: the launch dims, or, for an output of another rank (a 3-D launch over a
    4-D array that the kernel loops over, say), the Warp shape of the first array input of the output's rank
    (``wp.jax_kernel``'s rule with ``enable_backward=True``)."""
    dims = {}
    for spec in sig.outputs:
        if spec.warp_ndim == len(launch_dims):
            dims[spec.name] = tuple(launch_dims)
            continue
        same_rank = next((np.shape(a)[: s.warp_ndim] for s, a in zip(sig.inputs, args)
                          if s.is_array and a is not None and s.warp_ndim == spec.warp_ndim), None)
        if same_rank is None:
            raise ValueError(
                f"Kernel '{sig.key}': output '{spec.name}' has {spec.warp_ndim} Warp dims but the launch "
                f"{tuple(launch_dims)} has {len(launch_dims)}, and no array input has its rank to take its shape "
                f"from. Pass output_dims={{'{spec.name}': (...)}}."
            )
        dims[spec.name] = tuple(same_rank)
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
    """The forward or adjoint FFI call of ``plan`` (buffer order: see ``_native/warpnn_ffi.c``).

    forward: operands = array inputs; results = in-out arrays (aliased to their operand), outputs.
    adjoint: operands = array inputs (values before the launch), primal outputs, cotangents of float results;
             results = adjoints of ``sig.adjoint_inputs`` (zeroed), then ``sig.carried_adjoints`` (aliased to
             their cotangent operand and updated in place), then ``sig.replay_buffers`` (aliased to their primal
             operand: Warp's adjoint writes them; discarded).
    """
    sig = plan.sig
    fwd_target, adj_target = LAUNCHER.targets(sig)
    shapes = {s.name: op.shape for s, op in zip(sig.array_inputs, operands)}
    if adjoint:
        n_in, n_out = len(sig.array_inputs), len(sig.outputs)
        cts = dict(zip((s.name for s in sig.float_results), operands[n_in + n_out :]))
        specs = (*sig.adjoint_inputs, *sig.carried_adjoints, *sig.replay_buffers)
        primal_index = {**{s.name: k for k, s in enumerate(sig.array_inputs)},
                        **{s.name: n_in + k for k, s in enumerate(sig.outputs)}}
        result_shapes = ([shapes[s.name] for s in sig.adjoint_inputs] + [cts[s.name].shape for s in sig.carried_adjoints]
                         + [operands[primal_index[s.name]].shape for s in sig.replay_buffers])
        ct_index = {s.name: n_in + n_out + k for k, s in enumerate(sig.float_results)}
        aliases = {ct_index[s.name]: len(sig.adjoint_inputs) + m for m, s in enumerate(sig.carried_adjoints)}
        first_buffer = len(sig.adjoint_inputs) + len(sig.carried_adjoints)
        aliases.update({primal_index[s.name]: first_buffer + m for m, s in enumerate(sig.replay_buffers)})
    else:
        specs = sig.results
        result_shapes = [shapes[s.name] for s in sig.in_out] + list(plan.output_shapes)
        operand_index = {s.name: k for k, s in enumerate(sig.array_inputs)}
        aliases = {operand_index[s.name]: r for r, s in enumerate(sig.in_out)}
        aliases.update({operand_index[x]: len(sig.in_out) + sig.output_names.index(y) for x, y in plan.outputs_in_place})
    out_types = [jax.ShapeDtypeStruct(shape, spec.dtype) for shape, spec in zip(result_shapes, specs)]
    # jax.ffi.ffi_call with vmap_method="expand_dims" (under vmap every operand gets a leading batch dim,
    # size 1 when unbatched, and the launcher launches per batch element instead of folding the batch into
    # Warp's dims), wrapped in a primitive that keeps a sharded vmap batch sharded under jax.jit (each
    # device launches its own batch elements) and types outputs under shard_map: see _sharding.py.
    name = f"warpnn kernel '{plan.sig.key}' ({'adjoint' if adjoint else 'forward'})"
    if adjoint:  # (the name is what jax_debug_nans reports: where a guarded adjoint's NaN comes from)
        name += _equality_guard.nan_hint(plan.sig.kernel)
    results = _sharding.ffi_call(adj_target if adjoint else fwd_target, out_types, _fence(operands), plan.attrs(),
                                 aliases=aliases, has_side_effect=plan.has_side_effect and not adjoint, name=name,
                                 kernel=(plan.sig, adjoint))
    return _fence(results)


def _fence(values) -> list[jax.Array]:
    """Hide from XLA that an operand is a slice of a bigger buffer, or a result goes into one.

    Inside a loop (``lax.scan`` over ``xs``, a scan's stacked residuals read back by its transpose, a
    trajectory stacked into ``ys``), XLA's GPU compiler otherwise wraps the custom call in a dynamic-slice
    fusion that passes it an address inside the stacked buffer. The thunk behind that fusion computes the
    slice offset on the host every iteration (an HLO evaluation, or a device-to-host copy and a stream
    synchronisation); in the scans we measured it also kept the loop body from being captured as one CUDA
    graph. Behind the barrier XLA copies the slice on the device instead, inside the graph. Measured on an
    H200 (a one-off profile, 2026-11; CHANGELOG, docs/benchmarks-speed-gpu.md "What we measured"): a 200-step scan fwd+bwd step of a
    4096-element kernel went from 21-26 µs to 15 µs (pure JAX in the same process: 12-16 µs). Outside
    loops, and on the CPU, the barrier costs nothing: it only orders operations.
    """
    if not values or jax.config.jax_debug_nans or jax.config.jax_debug_infs:
        # Debugging NaNs runs operations one by one, checking each: a barrier would be blamed for NaNs it passes on.
        return list(values)
    return list(jax.lax.optimization_barrier(tuple(values)))


def zero_aval(ct: SymbolicZero) -> tuple[tuple[int, ...], Any]:
    """Shape and dtype of a symbolic-zero cotangent (its aval is a ShapedArray, typed as any abstract value)."""
    aval: Any = ct.aval
    return tuple(aval.shape), aval.dtype


def _zeros_batched_like(x):
    """Zeros of ``x``'s shape and dtype, batched under ``vmap`` where ``x`` is (a select between them): ``zeros_like``
    makes one array for every batch element, which the batched launcher could then only launch once per element."""
    return jax.lax.select(jnp.zeros(x.shape, bool), x, jnp.zeros_like(x))


def instantiate_zero(ct):
    """A cotangent as an array: a symbolic zero becomes zeros of its shape and dtype (Warp reads every adjoint)."""
    return jnp.zeros(*zero_aval(ct)) if isinstance(ct, SymbolicZero) else ct


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
    # JAX calls this only where nothing differentiates the call (else the fwd rule below runs), so no input
    # is needed after it as a residual: an elementwise pair's output may overwrite its input.
    return _spread_forward(plan, arrays, lambda plan: _ffi_call(_with_outputs_in_place(plan, arrays), False, arrays))


def _spread_forward(plan: _CallPlan, arrays, call) -> list[jax.Array]:
    """``call(plan)``'s results, where small outputs every thread accumulates into at a constant index (a loss
    ``wp.atomic_add(loss, 0, v)``) are accumulated into copies on a GPU and summed here (``_spread.py``): one
    address would make a million threads' atomic adds queue. The adjoint needs nothing of the sort (Warp's adjoint
    of an atomic add only reads the output's adjoint)."""
    shapes = _array_shapes(plan, arrays)
    spread = _spread.spread_outputs(plan.sig, shapes) if _spread.pays(plan.launch_dims) else ()
    if not spread:
        return call(plan)
    slots = _spread.slots_for(plan.launch_dims, sum(math.prod(shapes[n]) for n in spread))
    twin = dataclasses.replace(plan, sig=_spread.with_spread(plan.sig, outputs=spread),
                               output_shapes=(*plan.output_shapes, *((slots, *shapes[n]) for n in spread)))
    results = call(twin)
    n = len(plan.sig.results)
    gathered = list(results[:n])
    position = {s.name: k for k, s in enumerate(plan.sig.results)}
    for k, name in enumerate(spread):
        gathered[position[name]] = results[n + k].sum(axis=0)
    return gathered


def _array_shapes(plan: _CallPlan, arrays) -> dict[str, tuple[int, ...]]:
    """Every array input's and pure output's shape in this call, by name."""
    return {**{s.name: a.shape for s, a in zip(plan.sig.array_inputs, arrays)},
            **dict(zip(plan.sig.output_names, plan.output_shapes))}


# The inputs (by parameter name) whose buffers the calls made in its scope may write their outputs into; ``None``:
# any the kernel's analysis allows. Set by the tracer, which sees the whole program: where a later operation still
# reads an input's value, XLA copies that input before a call that writes over it, and in a step of many launches
# the output's own buffer is what the step's carry wants anyway (measured: 6 of 18 copies per step of a 7-dof
# mujoco_warp arm were such copies).
_IN_PLACE_INPUTS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar("in_place_inputs", default=None)


@contextlib.contextmanager
def outputs_in_place_only_into(inputs: frozenset[str]):
    """Within this scope, a call writes a pure output into an input's buffer only for the ``inputs`` named."""
    token = _IN_PLACE_INPUTS.set(inputs)
    try:
        yield
    finally:
        _IN_PLACE_INPUTS.reset(token)


def _with_outputs_in_place(plan: _CallPlan, arrays, *, differentiated: bool = False) -> _CallPlan:
    """``plan`` with its elementwise pairs' outputs written into their inputs' buffers.

    XLA copies the input first where anything else still reads it (the caller's array among them), so nothing
    the caller holds changes; in a ``lax.scan`` carrying the input it spares the copy of the output into the
    carry. For a call that is not differentiated, unlike the adjoint (``_adjoint_in_place_pays``), this choice
    needs no policy: a one-kernel forward loop body is under XLA's minimum for a CUDA graph either way (three
    operations, or two), and the copy it moves from the loop to a call whose input the caller keeps costs the
    same in both places. Measured on an
    H200 with default flags (docs/benchmarks-speed-gpu.md): a 4096-element forward scan step, 1.05-1.13× pure
    JAX written in place against 1.70-1.72× out of place. Within a program of many launches the copy is not moved
    but added, where a later launch reads the input: the tracer, which sees those reads, narrows the pairs
    (``outputs_in_place_only_into``).

    ``differentiated``: the forward of a differentiated call, whose inputs are residuals of the backward pass. XLA
    then copies the input first unless it is a scan's carry, which the scan stores into its stack of residuals
    before the call: there the output's copy into the carry goes, and the loop body is one operation shorter. So
    that choice follows the in-place adjoint's policy (``_adjoint_in_place_pays``): a body too short for a CUDA
    graph under XLA's default flags would enter the handler every step.
    """
    sig = plan.sig
    if type(sig) is not KernelSignature:
        return plan  # (checked mode's signatures: their outputs are zeroed first, never written in place)
    shapes = _array_shapes(plan, arrays)
    pairs = sig.in_place_pairs_for(shapes, plan.launch_dims)
    allowed = _IN_PLACE_INPUTS.get()
    if allowed is not None:
        pairs = tuple((x, y) for x, y in pairs if x in allowed)
    if pairs and differentiated and not _differentiated_forward_in_place_pays(sig, shapes, pairs):
        return plan
    return dataclasses.replace(plan, outputs_in_place=pairs) if pairs else plan


def _differentiable_call_fwd(plan, *primals):
    # symbolic_zeros=True: each primal says whether JAX differentiates with respect to it in this call.
    arrays = tuple(p.value for p in primals)
    results = _spread_forward(plan, arrays, lambda plan: _first_order_only(
        _with_outputs_in_place(plan, arrays, differentiated=True), False, *arrays))
    # Pure outputs are not kept for the backward pass: Warp's adjoint sees a pure output's values before the
    # launch (zeros, for an output it reads) or never touches them. Integer outputs have no cotangent and
    # are kept to fill their slot. The in-out arrays' values before the launch are among `arrays`.
    n_in_out = len(plan.sig.in_out)
    kept = tuple(None if spec.is_float else out for spec, out in zip(plan.sig.outputs, results[n_in_out:]))
    # In-out arrays whose reads of written elements all follow the write (a launch-time proof, _owned.py): Warp's
    # adjoint replays the launch on their values after it, which are what those reads saw. In-out arrays the kernel
    # never reads: their values after it (integers), or none at all (floats: the backward pass passes zeros).
    after = getattr(plan.sig, "replay_on_outputs", ())
    if after:
        unread = getattr(plan.sig, "unread_in_out", ())
        by_name = {spec.name: out for spec, out in zip(plan.sig.in_out, results[:n_in_out])}
        arrays = tuple((None if spec.is_float and spec.name in unread else by_name[spec.name]) if spec.name in after
                       else a for spec, a in zip(plan.sig.array_inputs, arrays))
    # Inputs JAX does not differentiate (constants, stop_gradient, parameters outside the grad) get no
    # adjoint buffer: Warp skips the atomic adds into them, and nothing is zeroed for them.
    constant = frozenset(spec.name for spec, p in zip(plan.sig.array_inputs, primals) if not p.perturbed)
    adjoint_plan = dataclasses.replace(plan, sig=plan.sig.without_adjoints(constant))
    return results, (arrays, kept, _Static(adjoint_plan))


# Pairs whose arrays are at least this big compute adjoints in place on a GPU even with XLA's default flags
# (see _adjoint_in_place_pays). Measured on an H200 (docs/benchmarks-speed-gpu.md, "What we measured"): in place lost at 1 MiB per array (25.5 against 20.1 µs per scan step) and won from 4 MiB (29.2 against 32.6).
IN_PLACE_MIN_BYTES = 1 << 22


def _adjoint_in_place_pays(sig: KernelSignature, shapes: dict[str, tuple[int, ...]], pairs) -> bool:
    """Whether computing the adjoints of ``pairs`` (``KernelSignature.in_place_pairs_for``) in the outputs'
    cotangent buffers can only save time here.

    It saves a buffer, a memset and a copy per call. On a GPU with XLA's default flags it can also
    cost a CUDA graph: the backward body of a ``lax.scan`` over one elementwise kernel drops to four
    operations, under XLA's minimum of five for a graph (``--xla_gpu_graph_min_graph_size``), and then XLA
    enters the handler every step; measured on an H200, a 4096-element scan's fwd+bwd step went from 15.3 to
    20.0 µs. So on a GPU the buffers are shared only when XLA captures short sequences too
    (``enable_cuda_graph_capture``) or when the pairs' arrays are big enough that the saved memory traffic
    outweighs a lost graph (from 4 MiB per array: 29.2 against 32.6 µs at 1M elements, 291.5 against 336.3 at
    16M); on the CPU, which has no graphs, always.
    """
    if jax.default_backend() == "cpu" or _cuda_graphs.min_graph_size() <= 4:
        return True
    by_name = {s.name: s for s in sig.outputs}
    return max(int(np.prod(shapes[y], dtype=np.int64)) * by_name[y].dtype.itemsize for _, y in pairs) >= IN_PLACE_MIN_BYTES


def _differentiated_forward_in_place_pays(sig: KernelSignature, shapes: dict[str, tuple[int, ...]], pairs) -> bool:
    """Whether a differentiated call's forward writes ``pairs``' outputs in place: on a GPU, where its adjoint does.

    Not on the CPU: there XLA's scheduler stores a scan's carry into the stack of residuals after the call, so
    writing in place adds a copy of the carry per step instead of removing one.
    """
    return jax.default_backend() != "cpu" and _adjoint_in_place_pays(sig, shapes, pairs)


def _differentiable_call_bwd(plan, residuals, cotangents):
    arrays, kept, adjoint_plan = residuals
    plan = adjoint_plan.value
    sig = plan.sig
    cts = dict(zip(sig.result_names, cotangents))
    float_cts = [cts[s.name] for s in sig.float_results]
    perturbed = bool(sig.adjoint_inputs) or any(s.is_float for s in sig.in_out)
    if not perturbed or all(isinstance(ct, SymbolicZero) for ct in float_cts):
        return (None,) * len(sig.array_inputs)  # nothing to differentiate, or a zero cotangent: zero adjoints
    # (an in-out float array the kernel never reads was not kept: any values do, zeros of its cotangent's shape)
    arrays = tuple(_zeros_batched_like(instantiate_zero(cts[spec.name])) if a is None else a
                   for spec, a in zip(sig.array_inputs, arrays))
    if not plan.differentiable:
        raise TypeError(FORWARD_ONLY_MESSAGE.format(key=sig.key))
    # A kernel whose only problems are loops over its scalar arguments or its arrays' shapes differentiates
    # through its twin with this call's values as constants, where Warp unrolls those loops (_unrolled.py).
    sig, reasons = _unrolled.adjoint_signature(sig, dict(plan.scalars), _array_shapes(plan, arrays))
    if reasons:
        in_place = any(sig.uses[n].in_place_problem() is not None for n in sig.reverse_problems)
        loops = any("loop" in problem for problem in sig.adjoint_problems)
        raise TypeError(REVERSE_PROBLEM_MESSAGE.format(key=sig.key, problems="; ".join(reasons))
                        + (IN_PLACE_ADVICE if in_place else "") + (LOOP_ADVICE if loops else ""))
    plan = dataclasses.replace(plan, sig=sig)
    if _equality_guard.guards(sig.kernel):
        # A float == / != branch reaches the adjoint: its twin makes the gradient NaN in a thread that met
        # equality, where Warp's adjoint is the side taken (_equality_guard.py). Built with an adjoint.
        plan = dataclasses.replace(plan, sig=_with_guarded_adjoint(sig))
        sig = plan.sig
    elif not sig.has_adjoint:
        # Compiled without an adjoint (enable_backward=False on the kernel or its module, as mujoco_warp builds
        # most of its modules): the adjoint comes from a twin of the same source built with one (_twins.py).
        plan = dataclasses.replace(plan, sig=_with_rebuilt_adjoint(sig))
        sig = plan.sig
    # A kernel that measures an array after using it gets its adjoint from a twin that measures first: Warp's
    # adjoint of x.shape resets the shape of x's adjoint, which unwraps negative indices (_measured.py).
    plan = dataclasses.replace(plan, sig=_measured.measured_first(sig))
    sig = plan.sig
    # Small parameters every thread reads at a constant index (alpha[0]) get their adjoint spread over copies on a
    # GPU, so that a million threads do not add into one address: _spread.py.
    spread = _spread.spread_inputs(sig, _array_shapes(plan, arrays)) if _spread.pays(plan.launch_dims) else ()
    differentiated = sig.array_inputs  # what JAX gets adjoints for (the twin has more inputs)
    if spread:
        by_input = dict(zip((s.name for s in sig.array_inputs), arrays))
        plan = dataclasses.replace(plan, sig=_spread.with_spread(sig, inputs=spread))
        sig = plan.sig
        slots = _spread.slots_for(plan.launch_dims, sum(math.prod(by_input[n].shape) for n in spread))
        arrays = (*arrays, *(_spread.spread_copies(by_input[n], slots) for n in spread))
    unused = frozenset(s.name for s in sig.outputs if s.is_float and isinstance(cts[s.name], SymbolicZero))
    if unused and type(sig) is not KernelSignature:
        unused = frozenset()  # (checked mode's signatures keep their own kernel)
    # Elementwise input -> output pairs compute the input's adjoint in the output's cotangent buffer (no zeroed
    # adjoint, no copy into a scan's carry): see KernelSignature.in_place_pairs.
    shapes = {name: shape for name, shape in _array_shapes(plan, arrays).items() if name not in unused}
    in_place = sig.in_place_pairs_for(shapes, plan.launch_dims)
    if in_place and _adjoint_in_place_pays(sig, shapes, in_place):
        plan = dataclasses.replace(plan, sig=sig.variant(adjoints_in_place=in_place))
        sig = plan.sig
    if unused:
        # Outputs with a zero cotangent are left out of the adjoint (their 0 * inf would be NaN): _pruned.py.
        plan = dataclasses.replace(plan, sig=_pruned.without_outputs(sig, unused))
        sig = plan.sig
    # Integer results have float0 cotangents; Warp gets no adjoint buffer for them. A symbolic-zero cotangent
    # of one float result among others becomes a zero array: Warp's adjoint reads every result's adjoint.
    float_cts = [instantiate_zero(ct) for ct in float_cts]
    ct_of = dict(zip((s.name for s in sig.float_results), float_cts))
    carried = {s.name for s in sig.carried_adjoints}
    # The primal slot of a pure output: its value before the launch where the kernel reads it (zeros: outputs
    # are zeroed first), else any buffer of its shape that is not aliased: Warp does not read it (the cotangent,
    # or for an in-place pair the input's value: the handler addresses that output as its grad instead).
    # An output Warp's adjoint writes (sig.replay_buffers) gets zeros, as the forward launch started from.
    input_of = {y: x for x, y in sig.adjoints_in_place}
    array_of = dict(zip((s.name for s in sig.array_inputs), arrays))
    replayed = {s.name for s in sig.replay_buffers}
    outputs = [out if out is not None else array_of[input_of[s.name]] if s.name in input_of
               else jnp.zeros_like(ct_of[s.name]) if s.name in carried or s.name in replayed else ct_of[s.name]
               for s, out in zip(sig.outputs, kept)]
    adjoints = _first_order_only(plan, True, *arrays, *outputs, *float_cts)
    by_name = dict(zip((s.name for s in (*sig.adjoint_inputs, *sig.carried_adjoints)), adjoints))
    by_name.update({x: by_name[y] for x, y in sig.adjoints_in_place})
    for name in spread:
        by_name[name] = by_name[name] + by_name[_spread.spread_name(name)].sum(axis=0)
    constant = sig.constant_inputs
    return tuple(None if spec.name in constant else by_name.get(spec.name) for spec in differentiated)


def _with_guarded_adjoint(sig: KernelSignature) -> KernelSignature:
    """``sig`` launching, for its adjoint, its kernel's equality-guarded twin (cached on ``sig`` while the twin is
    the same: a later ``warpnn.keep_side_taken`` makes another)."""
    twin = _equality_guard.guarded(sig.kernel)
    guarded = sig.__dict__.get("_guarded")
    if guarded is None or guarded.kernel is not twin:
        guarded = sig.__dict__["_guarded"] = dataclasses.replace(sig, kernel=twin)
    return guarded


def _with_rebuilt_adjoint(sig: KernelSignature) -> KernelSignature:
    """``sig`` launching, for its adjoint, the twin of its kernel that Warp builds with an adjoint."""
    rebuilt = sig.__dict__.get("_rebuilt")
    if rebuilt is None:  # (a twin Warp cannot generate is one of sig.reverse_refusal_reasons(), checked before)
        # (a base of its own: its variants, e.g. adjoints in place, must keep the twin)
        rebuilt = sig.__dict__["_rebuilt"] = dataclasses.replace(sig, kernel=_twins.with_adjoint(sig.kernel))
    return rebuilt


_differentiable_call.defvjp(_differentiable_call_fwd, _differentiable_call_bwd, symbolic_zeros=True)
