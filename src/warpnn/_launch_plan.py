"""What a call asks of the launcher, decided while lowering, when the batch and the platform are known:
whether it launches the kernel's twin (``_batched``: one launch for a vmapped batch, or a CPU launch split
across threads) and, for a split CPU adjoint, the rows each thread reaches (``_reach``).

It sits above the launchers and the twins, so neither imports the other back."""

from __future__ import annotations

import numpy as np

from . import _batched, _reach
from ._ffi_attrs import SCALAR_ATTR_PREFIX
from ._launch import LAUNCHER

TWIN_ATTR = "twin_launch"
REACH_ATTR = "row_reach"  # see _reach.py


def prepare_call(kernel, batch_shape: tuple[int, ...], operands: list, attrs: dict, platforms) -> tuple[list, dict]:
    """Decide whether this call launches the kernel's twin, and prepare its operands.

    Returns the operands (mixed batch broadcasts materialised) and the extra FFI attributes: ``twin_launch=1``
    for a vmapped call with more than one batch element (one launch for the batch), and for a CPU call big
    enough to split across threads. Anything else, or a kernel without a twin, is left to the per-element loop.
    """
    sig, adjoint = kernel
    split = False

    num_batch = 1
    for n in batch_shape:
        num_batch *= n
    launch = tuple(int(d) for d in attrs.get("launch_dims", ()))
    total = num_batch
    for n in launch:
        total *= n
    batched = num_batch > 1
    on_cpu = bool(platforms) and all(str(p).lower() == "cpu" for p in platforms)
    mode = _batched.batched_mode()
    if batched:
        # The CPU runs a batch's per-element launches on its threads (warpnn_ffi.c): launches cost nothing
        # there, and the kernel's own code indexes faster than the twin's extra batch coordinate.
        if mode == "off" or (on_cpu and mode != "twin"):
            return operands, {}
    else:
        threads, min_work = _batched._LAUNCH_CONFIG.get()  # the native launcher's, else the settings'
        # an adjoint launch splits at a quarter of the forward's work per worker (warpnn_ffi.c, kAdjointWorkFactor):
        # the attribute goes on both directions' calls, and the handler decides per launch
        split = on_cpu and threads > 1 and total >= 2 * max(1, min_work // _batched.ADJOINT_WORK_FACTOR)
        # A CPU launch over 2+ dims gains from the row-loop twin on one thread too (see _make_twin).
        loops = on_cpu and mode != "off" and len(launch) >= 2 and launch[-1] >= 2 and _loops_rows(sig.kernel)
        if not (split or loops):
            return operands, {}
    prepare = getattr(LAUNCHER.impl, "prepare_twin", None)
    reason = "the Python launcher launches per element" if prepare is None else prepare(sig, batched)
    twin = _batched.twin_of(sig.kernel, batched)
    if reason is None and len(launch) > getattr(twin, "kernel_dim", 0):
        reason = f"its launch dims {launch} have more entries than its wp.tid() returns"
    if reason is not None:
        if batched:
            _batched.warn_fallback(sig.key, reason)
        return operands, {}
    if batched:
        operands = [_flat_batch(op, batch_shape) for op in operands]
    extra = {TWIN_ATTR: np.int64(1)}
    if adjoint and split and _batched.windows_enabled():
        reach = _adjoint_reach(sig, launch, [op.shape[len(batch_shape):] for op in operands], attrs)
        if reach is not None:
            extra[REACH_ATTR] = reach
    return operands, extra


def _adjoint_reach(sig, launch: tuple[int, ...], shapes: list, attrs: dict):
    """The ``row_reach`` attribute of an adjoint CPU launch (``_reach.py``), from its operands' shapes (array
    inputs, primal outputs, cotangents) and its scalar attributes."""
    named = [*sig.array_inputs, *sig.outputs]
    if len(shapes) < len(named):
        return None
    by_name = {spec.name: tuple(int(d) for d in shape) for spec, shape in zip(named, shapes)}
    scalars = {k[len(SCALAR_ATTR_PREFIX):]: v.item() for k, v in attrs.items() if k.startswith(SCALAR_ATTR_PREFIX)}
    results = [s.name for s in sig.adjoint_inputs] + [""] * (len(sig.carried_adjoints) + len(sig.replay_buffers))
    return _reach.attribute(sig, launch, by_name, scalars, results)


def _loops_rows(kernel) -> bool:
    twin = _batched.twin_of(kernel, False)
    return isinstance(twin, _batched.Twin) and twin.inner_loop


def _flat_batch(op, batch_shape):
    """An operand whose batch dims are neither all broadcast nor all full becomes full (the twin takes one
    batch stride per array): rare, from nested vmaps that batch it along some of their axes only."""
    import jax.numpy as jnp

    dims = op.shape[: len(batch_shape)]
    broadcast = all(d == 1 for d, full in zip(dims, batch_shape) if full > 1)
    if broadcast or tuple(dims) == tuple(batch_shape):
        return op
    return jnp.broadcast_to(op, (*batch_shape, *op.shape[len(batch_shape):]))
