"""Warp calls under JAX's sharding: data-parallel under ``jax.jit`` with sharded inputs, typed under ``shard_map``.

XLA's SPMD partitioner cannot see inside a custom call, so a plain ``jax.ffi.ffi_call`` whose operands are
sharded is run *replicated*: every device all-gathers the whole batch, launches the kernel on all of it and
keeps its slice (measured: ``all-gather`` of every batched operand in the compiled HLO). Correct, but no
faster on N devices than on one, and N times the memory.

This module routes each Warp call through a primitive of its own, ``warpnn_call``, that knows which
dimensions are batch dimensions (those ``jax.vmap`` added; the kernel launches once per batch element,
see ``_launch.py``) and lowers, when the call sits in a partitioned computation, through
``jax.experimental.custom_partitioning`` with a Shardy sharding rule (the pattern of Transformer Engine's
JAX primitives):

* every batch dimension is a factor shared by the operands that carry it and all results, so a sharding
  of the batch propagates through the call; the kernel's own dimensions (particles, springs) are
  ``need_replication`` factors, since one launch reads its whole arrays;
* the partition callback keeps the batch sharding (when the shard count divides the batch; otherwise it
  replicates, never padding a batch of connectivity with garbage indices), replicates everything else, and
  lowers the *local* ``ffi_call``: each device launches its own batch elements on its own stream, with no
  collective in the call. Gradients of replicated parameters are summed by the ``all-reduce`` that XLA
  puts after the adjoint, as for any batched JAX op.

Outside a partitioned computation (one device, inside ``shard_map``, or no vmap batch dimension), the
primitive lowers to the plain ``ffi_call``.

It also fixes the type of Warp outputs under ``shard_map(check_vma=True)``: ``ffi_call`` gives its outputs
no varying manual axes, as if they were the same on every device, so JAX would accept ``out_specs=P()``
for a per-shard result (silently returning one device's value) and reject the custom VJP (cotangent types
differ from the primal's). Here outputs vary over the union of the operands' varying axes, like any
elementwise JAX op; :func:`match_vma` (applied before ``custom_vjp``) makes every operand vary over that
union, so the adjoint of a replicated parameter is ``psum``-ed by JAX's transpose of ``pvary``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from . import _launch_plan

try:  # public JAX APIs for defining a primitive; guarded so that a JAX without them still runs warpnn
    from jax.experimental.custom_partitioning import ArrayMapping, SdyShardingRule, custom_partitioning
    from jax.extend.core import Primitive
    from jax.interpreters import batching, mlir
except ImportError as e:  # pragma: no cover - depends on the JAX version
    _UNAVAILABLE: str | None = f"{type(e).__name__}: {e}"
else:
    _UNAVAILABLE = None

__all__ = ["ffi_call", "match_vma", "vma_of"]


# --------------------------------------------------------------------------------------------------
# Varying manual axes (shard_map's check_vma types), across JAX versions.


def vma_of(x) -> frozenset:
    """The manual mesh axes over which ``x`` varies (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()) or ())


def _pvary(x, axes: tuple):
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # JAX < 0.8


def match_vma(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Make every array vary over the union of their varying manual axes (``pvary``; a no-op outside
    ``shard_map``). Done before the custom VJP, so that its cotangents have the primal's type and JAX's
    transpose of ``pvary`` sums the adjoint of a replicated parameter over the devices."""
    vmas = [vma_of(a) for a in arrays]
    union = frozenset().union(*vmas)
    if not union:
        return list(arrays)
    return [a if v == union else _pvary(a, tuple(sorted(union - v, key=str))) for a, v in zip(arrays, vmas)]


# --------------------------------------------------------------------------------------------------
# The call's static description.


@dataclasses.dataclass(frozen=True)
class _CallSpec:
    """Everything static about one Warp FFI call, hashable (a primitive parameter, a custom_partitioning
    static argument).

    ``result_shapes`` are the unbatched (kernel) shapes; operands and results carry ``num_batch``
    leading batch dimensions in addition (size 1 on an operand that is not batched along that dim).
    """

    target: str
    result_shapes: tuple[tuple[int, ...], ...]
    result_dtypes: tuple[np.dtype, ...]  # dtypes, not dtype strings: bfloat16's string is '<V2'
    attrs: tuple[tuple[str, Any], ...]
    batch_shape: tuple[int, ...] = ()
    aliases: tuple[tuple[int, int], ...] = ()  # (operand, result): the result starts as the operand's buffer
    has_side_effect: bool = False
    name: str = ""  # what errors call it, e.g. "warpnn kernel 'springs' (adjoint)"
    kernel: Any = None  # the KernelSignature (compared by identity): lets the lowering launch its batched twin

    @property
    def num_batch(self) -> int:
        return len(self.batch_shape)

    def ffi_attrs(self) -> dict[str, Any]:
        return {name: _thaw(value) for name, value in self.attrs}

    def result_types(self, batch_shape: tuple[int, ...]) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct((*batch_shape, *shape), dtype)
                for shape, dtype in zip(self.result_shapes, self.result_dtypes)]


def _freeze(value):
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, tuple(value.ravel().tolist()))
    if isinstance(value, np.generic):
        return ("scalar", value.dtype.str, value.item())
    return value


def _thaw(value):
    if isinstance(value, tuple) and value and value[0] == "ndarray":
        _, dtype, shape, flat = value
        return np.asarray(flat, dtype=np.dtype(dtype)).reshape(shape)
    if isinstance(value, tuple) and value and value[0] == "scalar":
        return np.dtype(value[1]).type(value[2])
    return value


def ffi_call(
    target: str,
    result_types: Sequence[jax.ShapeDtypeStruct],
    operands: Sequence[jax.Array],
    attrs: dict[str, Any],
    aliases: dict[int, int] | None = None,
    has_side_effect: bool = False,
    name: str = "",
    kernel: Any = None,
) -> list[jax.Array]:
    """``jax.ffi.ffi_call(target, result_types, vmap_method="expand_dims", input_output_aliases=aliases,
    has_side_effect=...)(*operands, **attrs)``, as a primitive that shards its ``vmap`` batch dimensions under
    ``jax.jit`` and types its outputs under ``shard_map``. ``name`` says what the call is in errors
    (``jax_debug_nans``). With ``kernel`` (the call's KernelSignature and whether it is the adjoint), a batch
    launches once, through the kernel's batched twin (``_batched.py``)."""
    spec = _CallSpec(
        target,
        tuple(tuple(int(d) for d in t.shape) for t in result_types),
        tuple(np.dtype(t.dtype) for t in result_types),
        tuple((key, _freeze(value)) for key, value in sorted(attrs.items())),
        aliases=tuple(sorted((aliases or {}).items())),
        has_side_effect=bool(has_side_effect),
        name=name,
        kernel=kernel,
    )
    # A call with a side effect must reach XLA even when its results are unused: jax.ffi.ffi_call carries
    # the effect, this primitive does not (JAX would drop it as dead code), so such calls are not partitioned.
    if _UNAVAILABLE is not None or not operands or has_side_effect:  # nothing to shard without operands
        if _UNAVAILABLE is not None:
            _warn_unavailable()
        return _plain_call(spec, *operands)
    return list(warpnn_call_p.bind(*match_vma([jnp.asarray(op) for op in operands]), spec=spec))


@functools.cache
def _warn_unavailable() -> None:
    warnings.warn(
        f"warpnn: Warp calls cannot be partitioned with this JAX ({jax.__version__}): {_UNAVAILABLE}. They run as "
        "plain jax.ffi.ffi_call: correct, but replicated (not data-parallel) on sharded inputs, and typed as "
        "invariant under shard_map(check_vma=True).",
        RuntimeWarning,
        stacklevel=4,
    )


# --------------------------------------------------------------------------------------------------
# The primitive.


def _plain_call(spec: _CallSpec, *operands, platforms=None):
    """The Warp FFI call itself, on whatever (local) shapes the operands have."""
    batch = _batch_shape(spec, operands)
    attrs = spec.ffi_attrs()
    if spec.kernel is not None:  # one launch for the whole batch (or a CPU launch split across threads)
        operands, extra = _launch_plan.prepare_call(spec.kernel, batch, list(operands), attrs, platforms)
        attrs.update(extra)
    call = jax.ffi.ffi_call(spec.target, spec.result_types(batch), vmap_method="expand_dims",
                            input_output_aliases=dict(spec.aliases) or None, has_side_effect=spec.has_side_effect)
    return list(call(*operands, **attrs))


def _batch_shape(spec: _CallSpec, operands) -> tuple[int, ...]:
    # A batch dim is 1 on operands that are not batched along it; the results carry its full size.
    return tuple(max((op.shape[k] for op in operands), default=1) for k in range(spec.num_batch))


@functools.cache
def _jitted(spec: _CallSpec):
    return jax.jit(lambda *operands: warpnn_call_p.bind(*operands, spec=spec))


def _impl(*operands, spec):
    """Eager execution: the call compiled on its own, as JAX runs any primitive outside ``jit``.

    Under ``jax_debug_nans`` / ``jax_debug_infs`` JAX checks a jitted function's outputs and, on a NaN, calls
    the function again "de-optimised", which for this jit of a bind of the primitive is this impl again:
    ``RecursionError``. So the check is done here instead, with JAX's turned off for the inner call, and
    raises JAX's own error naming the Warp kernel. (A NaN made inside a ``jax.jit`` is found by JAX at the
    jit's outputs; its de-optimised re-run executes this call eagerly and gets here.)
    """
    check = _special_values_checked()
    if not check:
        return _jitted(spec)(*operands)
    with jax.debug_nans(False), jax.debug_infs(False):
        outs = _jitted(spec)(*operands)
    for index, out in enumerate(outs):
        if not jnp.issubdtype(out.dtype, jnp.inexact):
            continue
        values = np.asarray(out)
        for kind in check:
            if (np.isnan(values) if kind == "nan" else np.isinf(values)).any():
                raise FloatingPointError(
                    f"invalid value ({kind}) encountered in {spec.name or spec.target} (result {index}: "
                    f"{np.count_nonzero(np.isnan(values) if kind == 'nan' else np.isinf(values))} of {values.size} "
                    f"values; jax_debug_{kind}s is on)"
                )
    return outs


def _special_values_checked() -> tuple[str, ...]:
    """Which of "nan" / "inf" JAX's debug flags ask every operation's outputs to be checked for."""
    return tuple(k for k, flag in (("nan", jax.config.jax_debug_nans), ("inf", jax.config.jax_debug_infs)) if flag)


def _abstract_eval(*avals, spec: _CallSpec):
    batch = spec.batch_shape
    # Results carry the batch dims' sharding of the operands that have them at full size (an explicitly
    # sharded batch stays sharded); their kernel dims are whole on every device. Operands may mix a mesh
    # with the empty mesh (unsharded constants): take the mesh from the operand the batch sharding came from.
    meshes = [a.sharding.mesh for a in avals if not a.sharding.mesh.empty]
    mesh = meshes[0] if meshes else avals[0].sharding.mesh
    batch_spec = []
    for k, size in enumerate(batch):
        names = [a.sharding.spec[k] for a in avals
                 if a.shape[k] == size and len(a.sharding.spec) > k and a.sharding.mesh == mesh]
        batch_spec.append(next((n for n in names if n is not None), None))
    out = []
    for t in spec.result_types(batch):
        sharding = NamedSharding(mesh, P(*batch_spec, *([None] * (len(t.shape) - len(batch)))))
        # update() keeps the operands' varying manual axes (all equal, see match_vma).
        out.append(avals[0].update(shape=t.shape, dtype=t.dtype, sharding=sharding, weak_type=False))
    return out


def _batching_rule(operands, dims, *, spec: _CallSpec):
    size = next(op.shape[d] for op, d in zip(operands, dims) if d is not None)
    # The new batch dim goes first; unbatched operands get a size-1 dim (expand_dims), so the launcher
    # broadcasts them with stride 0 instead of materialising copies.
    moved = [jnp.expand_dims(op, 0) if d is None else jnp.moveaxis(op, d, 0) for op, d in zip(operands, dims)]
    batched = dataclasses.replace(spec, batch_shape=(size, *spec.batch_shape))
    # An aliased operand becomes its result's buffer, so it must carry the result's full batch.
    for k, _ in spec.aliases:
        full = (*batched.batch_shape, *moved[k].shape[batched.num_batch :])
        moved[k] = jnp.broadcast_to(moved[k], full)
    outs = warpnn_call_p.bind(*moved, spec=batched)
    return outs, [0] * len(outs)


# --------------------------------------------------------------------------------------------------
# Lowering: through custom_partitioning when there is a batch to shard.


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The static argument of the partitioned call: the call, and which operands carry each batch dim."""

    spec: _CallSpec
    operand_ranks: tuple[int, ...]
    operand_batched: tuple[tuple[bool, ...], ...]  # [operand][batch dim]: full size (True) or 1


def _sharding_rule(layout: _Layout, mesh, operand_types, result_types) -> SdyShardingRule:
    spec, operands, replicated = layout.spec, [], []
    for i, (rank, batched) in enumerate(zip(layout.operand_ranks, layout.operand_batched)):
        batch = [f"b{k}" if full else f"o{i}u{k}" for k, full in enumerate(batched)]
        own = [f"o{i}d{j}" for j in range(rank - spec.num_batch)]
        replicated += own
        operands.append(ArrayMapping(*batch, *own))
    results = []
    for i, shape in enumerate(spec.result_shapes):
        own = [f"r{i}d{j}" for j in range(len(shape))]
        replicated += own
        results.append(ArrayMapping(*[f"b{k}" for k in range(spec.num_batch)], *own))
    return SdyShardingRule(tuple(operands), tuple(results), need_replication_factors=tuple(replicated))


def _mesh_axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _partition(layout: _Layout, mesh, arg_shapes, result_shape):
    spec = layout.spec
    results = list(result_shape)
    proposed = results[0].sharding if results else None
    batch_spec = []
    for k, size in enumerate(spec.batch_shape):
        entry = None
        if isinstance(proposed, NamedSharding) and len(proposed.spec) > k:
            entry = proposed.spec[k]
        shards = math.prod(mesh.shape[a] for a in _mesh_axes(entry))
        # Never pad a batch: padded elements would launch on garbage (e.g. out-of-range indices).
        batch_spec.append(entry if shards > 1 and size % shards == 0 else None)

    def sharding(rank, batched):
        batch = [entry if full else None for entry, full in zip(batch_spec, batched)]
        return NamedSharding(mesh, P(*batch, *([None] * (rank - spec.num_batch))))

    arg_shardings = tuple(sharding(r, b) for r, b in zip(layout.operand_ranks, layout.operand_batched))
    all_batched = (True,) * spec.num_batch
    result_shardings = [sharding(spec.num_batch + len(s), all_batched) for s in spec.result_shapes]
    return mesh, functools.partial(_plain_call, spec), result_shardings, arg_shardings


@functools.cache
def _partitioned():
    fn = custom_partitioning(lambda layout, *operands: _plain_call(layout.spec, *operands), static_argnums=(0,))
    fn.def_partition(partition=_partition, sharding_rule=_sharding_rule)
    return fn


def _lowering(ctx, *operands, spec: _CallSpec):
    axis_context = ctx.module_context.axis_context
    manual = getattr(axis_context, "manual_axes", frozenset())
    devices = getattr(axis_context, "device_assignment", None)
    if devices is None and hasattr(axis_context, "mesh"):
        devices = axis_context.mesh.devices.ravel().tolist()
    if spec.num_batch > 0 and not manual and devices is not None and len(devices) > 1:
        layout = _Layout(
            spec,
            tuple(len(a.shape) for a in ctx.avals_in),
            tuple(tuple(a.shape[k] == n for k, n in enumerate(spec.batch_shape)) for a in ctx.avals_in),
        )
        fn = lambda *ops: _partitioned()(layout, *ops)  # noqa: E731
    else:
        fn = functools.partial(_plain_call, spec, platforms=tuple(ctx.module_context.platforms))
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *operands)


def _register():
    prim = Primitive("warpnn_call")
    prim.multiple_results = True
    prim.def_impl(_impl)
    prim.def_abstract_eval(_abstract_eval)
    batching.primitive_batchers[prim] = _batching_rule
    mlir.register_lowering(prim, _lowering)
    # jax.jit hands the device assignment to lowering rules only for primitives that ask for it (as
    # custom_partitioning does); without it the call lowers unpartitioned (replicated: correct, not parallel).
    try:
        from jax._src import dispatch

        dispatch.prim_requires_devices_during_lowering.add(prim)
    except (ImportError, AttributeError):  # pragma: no cover - a JAX without this registry
        pass
    return prim


warpnn_call_p = None
if _UNAVAILABLE is None:
    try:
        warpnn_call_p = _register()
    except Exception as e:  # noqa: BLE001 - pragma: no cover; a JAX whose primitive API changed: fall back
        _UNAVAILABLE = f"{type(e).__name__}: {e}"
