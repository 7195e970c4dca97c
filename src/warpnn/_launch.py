"""How a Warp kernel runs when XLA executes a warpnn call: the launch mechanism.

The bridge (``_bridge.py``) only needs two FFI target names per kernel signature, one for the
forward launch and one for the adjoint launch; it passes everything that varies per call (static
scalars, launch dims) as FFI *attributes*, so a handler keeps no per-call Python state.

This module implements those targets with a Python (ctypes) handler, the same mechanism as
``wp.jax_kernel``, with three differences that make it correct for training:

* outputs (and adjoint outputs) are zeroed on the XLA stream before the launch, so kernels that
  accumulate with ``wp.atomic_add`` are right;
* leading ``vmap`` batch dimensions are never folded into Warp's launch: the kernel is launched once
  per batch element with per-argument pointer offsets (offset 0 for an unbatched, broadcast
  argument), so kernels whose threads read or write other elements stay correct;
* the adjoint is a direct launch of Warp's generated backward kernel, declared command-buffer
  compatible like the forward, so XLA can capture both into CUDA graphs.

``_native_launch.NativeLauncher`` serves the same interface with handlers compiled from C, so no
Python runs per call. ``LAUNCHER`` (what the bridge calls) picks one on first use: the native one
when its library loads or builds, else this Python one with a warning; ``$WARPNN_LAUNCHER`` =
``python`` | ``native`` | ``auto`` (default) forces the choice, and ``use_launcher`` switches it.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import threading
import traceback
import warnings
from typing import Any

import jax
import warp as wp

from . import _settings
from . import _warp_compat as wc
from ._devices import trace_devices
from ._ffi_attrs import LAUNCH_DIMS_ATTR, SCALAR_ATTR_PREFIX
from ._kernel_load import load_kernel
from ._signature import ArgSpec, KernelSignature

ffi = wc.xla_ffi

_PLATFORMS = ("cpu", "CUDA")  # JAX platform names for register_ffi_target are case-sensitive
# XLA may call handlers from several threads (one per device); Warp's module loading is not thread-safe.
_HANDLER_LOCK = threading.Lock()
_CALLBACK_TYPE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(ffi.XLA_FFI_CallFrame))


class _Buffer:
    """An XLA buffer seen as a batch of Warp arrays of one kernel argument."""

    __slots__ = ("data", "warp_dims", "batch_dims", "item_bytes")

    def __init__(self, xla_buffer, spec: ArgSpec):
        rank = xla_buffer.rank
        dims = xla_buffer.dims[:rank]  # one ctypes slice, not one access per dim
        lead = rank - spec.jax_ndim
        self.data = xla_buffer.data or 0
        self.batch_dims = tuple(dims[:lead])
        self.warp_dims = tuple(dims[lead : lead + spec.warp_ndim])
        self.item_bytes = math.prod(dims[lead:]) * spec.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.item_bytes * math.prod(self.batch_dims)

    def batch_offsets(self, batch_shape: tuple[int, ...]) -> list[int]:
        """Byte offset of each batch element; broadcast (size-1) batch dims get stride 0."""
        if not batch_shape:
            return [0]
        strides, stride = [], self.item_bytes
        for own, full in zip(reversed(self.batch_dims), reversed(batch_shape)):
            strides.append(stride if own == full else 0)
            stride *= own
        strides.reverse()
        return [sum(i * s for i, s in zip(idx, strides)) for idx in itertools.product(*map(range, batch_shape))]


def _array_desc(buf: _Buffer | None, spec: ArgSpec, offset: int, grad: _Buffer | None = None, grad_offset: int = 0):
    if buf is None:  # no buffer (an integer array's adjoint, a None input): Warp skips null arrays
        return wc.array_t()
    strides = wc.strides_from_shape(buf.warp_dims, spec.warp_dtype)
    grad_ptr = grad.data + grad_offset if grad is not None else 0
    # A zero-size array is Warp's null array (as wp.zeros(0) is), so `if arr:` in a kernel is false for it.
    data = buf.data + offset if buf.item_bytes else 0
    return wc.array_t(data, grad_ptr, spec.warp_ndim, buf.warp_dims, strides)


def _scalar_value(spec: ArgSpec, attrs: dict, adjoint_slot: bool):
    ctype = spec.warp_type._type_
    return ctype(0) if adjoint_slot else ctype(attrs[SCALAR_ATTR_PREFIX + spec.name])


class PythonLauncher:
    """Registers and serves the forward/adjoint FFI targets of kernel signatures with Python handlers."""

    def __init__(self):
        self._targets: dict[int, tuple[str, str]] = {}
        # Executions of the handlers (not XLA's metadata queries), by "forward"/"adjoint": how the
        # graph-capture check tells a CUDA-graph replay (no entry) from a call back into the handler.
        self.handler_entries = {"forward": 0, "adjoint": 0}
        # ctypes callbacks must outlive every XLA executable that may call them: keep them forever.
        self._callbacks: list[Any] = []
        self._lock = threading.Lock()

    @property
    def num_registered(self) -> int:
        """Number of kernel signatures with registered targets (each is registered exactly once)."""
        return len(self._targets)

    def targets(self, sig: KernelSignature) -> tuple[str, str]:
        """The (forward, adjoint) FFI target names for ``sig``, registering them on first use."""
        names = self._targets.get(id(sig))
        if names is not None:
            return names
        with self._lock:
            if id(sig) not in self._targets:
                base = f"warpnn_{len(self._targets)}_{sig.key}"
                names = (f"{base}_fwd", f"{base}_adj")
                for name, adjoint in zip(names, (False, True)):
                    self._register(name, sig, adjoint)
                self._targets[id(sig)] = names
        return self._targets[id(sig)]

    def extra_attrs(self, sig: KernelSignature) -> dict[str, Any]:
        """Launcher-specific FFI attributes added to every call of ``sig`` (none: handlers close over ``sig``).

        Called while tracing, it also loads the kernel's Warp module on the devices of this trace, so the
        first XLA execution does not compile.
        """
        for device in trace_devices():
            load_kernel(sig.kernel, device, sig.block_dim)
        return {}

    def _register(self, name: str, sig: KernelSignature, adjoint: bool) -> None:
        for platform in _PLATFORMS:

            def handler(call_frame, platform=platform):
                return _handle(call_frame, sig, adjoint, platform, self.handler_entries)

            callback = _CALLBACK_TYPE(handler)
            self._callbacks.append(callback)
            address = ctypes.cast(callback, ctypes.c_void_p).value
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(address), platform=platform)


def _handle(call_frame, sig: KernelSignature, adjoint: bool, platform: str, entries: dict[str, int]):
    frame = call_frame.contents
    # XLA's first call asks for the handler's API version and traits through the metadata extension.
    extension = frame.extension_start
    if extension and extension.contents.type == ffi.XLA_FFI_Extension_Type.Metadata:
        metadata = ctypes.cast(extension, ctypes.POINTER(ffi.XLA_FFI_Metadata_Extension)).contents.metadata.contents
        metadata.api_version.major_version = 0
        metadata.api_version.minor_version = 1
        if platform == "CUDA":
            # Zeroing and launches are plain stream work, so XLA may record them into CUDA graphs.
            metadata.traits = ffi.XLA_FFI_Handler_TraitsBits.COMMAND_BUFFER_COMPATIBLE
        return None
    try:
        with _HANDLER_LOCK:
            entries["adjoint" if adjoint else "forward"] += 1
            _launch(frame, sig, adjoint, platform)
        return None
    except Exception as e:  # an exception must never unwind through XLA's C++ frames
        traceback.print_exc()
        return ffi.create_ffi_error(
            frame.api, ffi.XLA_FFI_Error_Code.UNKNOWN, f"warpnn: kernel '{sig.key}' failed: {type(e).__name__}: {e}"
        )


def _launch(frame, sig: KernelSignature, adjoint: bool, platform: str) -> None:
    attrs = ffi.decode_attrs(frame.attrs)
    args = ctypes.cast(frame.args.args, ctypes.POINTER(ctypes.POINTER(ffi.XLA_FFI_Buffer)))
    rets = ctypes.cast(frame.rets.rets, ctypes.POINTER(ctypes.POINTER(ffi.XLA_FFI_Buffer)))

    # Buffer order, fixed by _bridge._ffi_call:
    #   forward: args = array inputs; rets = in-out arrays (aliased: they hold the inputs' values), outputs
    #   adjoint: args = array inputs (values before the launch), primal outputs, cotangents of float results;
    #            rets = adjoints of sig.adjoint_inputs, then sig.carried_adjoints (aliased to their cotangent),
    #            then sig.replay_buffers (aliased to their primal operand)
    n_in = len(sig.array_inputs)
    inputs = {s.name: _Buffer(args[i].contents, s) for i, s in enumerate(sig.array_inputs)}
    launch_dims = tuple(int(d) for d in attrs[LAUNCH_DIMS_ATTR])
    grads: dict[str, _Buffer] = {}  # primal arrays whose `grad` is their adjoint buffer (carried adjoints)
    if not adjoint:
        results = {s.name: _Buffer(rets[i].contents, s) for i, s in enumerate(sig.results)}
        primal = {**inputs, **results}
        # An output each thread fully writes over its own shape needs no zeroing (see outputs_fully_written);
        # in-out arrays start as their inputs.
        zeroed = [results[s.name] for s in sig.outputs
                  if not (s.name in sig.outputs_fully_written and results[s.name].warp_dims == launch_dims)]
        adjoints: dict[str, _Buffer] = {}
        result_list = list(results.values())
    else:
        outputs = {s.name: _Buffer(args[n_in + i].contents, s) for i, s in enumerate(sig.outputs)}
        base = n_in + len(sig.outputs)
        cts = {s.name: _Buffer(args[base + i].contents, s) for i, s in enumerate(sig.float_results)}
        returned = (*sig.adjoint_inputs, *sig.carried_adjoints)
        adjoints = {s.name: _Buffer(rets[i].contents, s) for i, s in enumerate(returned)}
        # results Warp's adjoint writes get their own buffers, aliased to (holding) their primal operands
        replayed = {s.name: _Buffer(rets[len(returned) + m].contents, s) for m, s in enumerate(sig.replay_buffers)}
        primal = {**inputs, **outputs, **replayed}
        grads = {s.name: adjoints[s.name] for s in sig.carried_adjoints}
        adjoints.update({x: adjoints[y] for x, y in sig.adjoints_in_place})  # in the output's carried adjoint
        # Warp's adjoint of a struct's array field accumulates into the field's `grad` (as wp.Tape sets it up)
        grads.update({s.name: adjoints[s.name] for s in sig.adjoint_inputs if "." in s.name})
        # ... and so does its adjoint of a row view (`r = a[i]`): into the viewed array's `grad`
        grads.update({s.name: adjoints[s.name] for s in sig.adjoint_inputs if sig.uses[s.name].viewed})
        adjoints = {**cts, **adjoints}  # a result's cotangent, unless its adjoint is carried
        zeroed = [adjoints[s.name] for s in sig.adjoint_inputs]
        result_list = [adjoints[s.name] for s in returned]

    if platform == "cpu":
        device, stream = wp.get_device("cpu"), None
    else:
        wc.runtime()
        device = wp.get_cuda_device(ffi.get_device_ordinal_from_callframe(frame))
        stream = ffi.get_stream_from_callframe(frame)

    loaded = load_kernel(sig.kernel, device, sig.block_dim)
    hooks, block_dim = loaded.hooks, loaded.block_dim
    bounds = loaded.bounds(sig.kernel, launch_dims)

    core = wc.runtime().core
    for buf in zeroed:
        if buf.nbytes:
            if stream is None:
                ctypes.memset(buf.data, 0, buf.nbytes)
            else:
                core.wp_memset_device(device.context, buf.data, 0, buf.nbytes, stream)

    # Every result carries the full vmap batch (XLA's expand_dims batching), so it defines the batch shape.
    batch_shape = result_list[0].batch_dims if result_list else ()
    params_specs = (*sig.inputs, *sig.outputs)
    leaves = (*sig.input_leaves, *sig.outputs)
    primal_slots = {s.name: (primal.get(s.name), grads.get(s.name)) for s in leaves}
    adjoint_slots = {s.name: (adjoints.get(s.name), None) for s in leaves}
    offsets = {}
    for table in (primal_slots, adjoint_slots):
        for buf, grad in table.values():
            for b in (buf, grad):
                if b is not None and id(b) not in offsets:
                    offsets[id(b)] = b.batch_offsets(batch_shape)

    def value(spec, table, is_adjoint, b):
        if spec.is_struct:  # Warp's struct ctype, its fields filled the same way (adjoint: gradient arrays)
            struct = spec.warp_type.ctype()
            for field in spec.fields:
                setattr(struct, field.name.rsplit(".", 1)[-1], value(field, table, is_adjoint, b))
            return struct
        if not spec.is_array:
            return _scalar_value(spec, attrs, adjoint_slot=is_adjoint)
        buf, grad = table[spec.name]
        return _array_desc(buf, spec, offsets[id(buf)][b] if buf is not None else 0,
                           grad, offsets[id(grad)][b] if grad is not None else 0)

    for b in range(math.prod(batch_shape)):
        params = [bounds] + [value(s, primal_slots, False, b) for s in params_specs]
        if adjoint:  # Warp's backward entry takes the primal arguments, then one adjoint per argument
            params += [value(s, adjoint_slots, True, b) for s in params_specs]
        _run(sig.kernel, hooks, params, adjoint, device, stream, block_dim, core)


def _run(kernel, hooks, params, adjoint, device, stream, block_dim, core) -> None:
    if stream is None:
        if block_dim > 1:
            wc.invoke_cpu_blocks(kernel, hooks, params, adjoint=adjoint)
        else:
            wc.invoke_cpu(kernel, hooks, params, adjoint=adjoint)
        return
    entry = hooks.backward if adjoint else hooks.forward
    smem = hooks.backward_smem_bytes if adjoint else hooks.forward_smem_bytes
    ptrs = (ctypes.c_void_p * len(params))(*(ctypes.addressof(p) for p in params))
    failed = core.wp_cuda_launch_kernel(
        device.context, entry, params[0].size, 0, block_dim, int(bool(kernel.grid_stride)),
        hooks.cluster_dim, smem, ptrs, stream, None,
    )
    if failed:
        raise RuntimeError(f"CUDA launch of {'adjoint' if adjoint else 'forward'} kernel '{kernel.key}' failed")


LAUNCHER_ENV = "WARPNN_LAUNCHER"
LAUNCHER_CHOICES = ("auto", "native", "python")


class _SelectedLauncher:
    """The launcher the bridge calls. Resolves the choice on first use, so ``import warpnn`` never compiles.

    Everything else (``num_registered``, ``handler_entries``, ...) is forwarded to the launcher in use.
    """

    def __init__(self):
        self._impl = None
        self._python: PythonLauncher | None = None
        self._lock = threading.Lock()

    @property
    def impl(self):
        if self._impl is None:
            with self._lock:
                if self._impl is None:
                    self._impl = self._make(_settings.get(LAUNCHER_ENV))
        return self._impl

    @property
    def name(self) -> str:
        return "native" if type(self.impl).__name__ == "NativeLauncher" else "python"

    def targets(self, sig: KernelSignature) -> tuple[str, str]:
        return self.impl.targets(sig)

    def extra_attrs(self, sig: KernelSignature) -> dict[str, Any]:
        return self.impl.extra_attrs(sig)

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(self.impl, attr)

    def _make(self, choice: str):
        choice = (choice or "auto").strip().lower()
        if choice not in LAUNCHER_CHOICES:
            raise ValueError(f"{LAUNCHER_ENV}={choice!r}: expected one of {', '.join(LAUNCHER_CHOICES)}")
        if choice == "python":
            return self._python_launcher()
        from . import _native_launch

        try:
            return _native_launch.get_launcher()
        except _settings.SettingError:
            raise  # a mistyped WARPNN_* value is the user's to fix, never a reason to fall back silently
        except Exception as e:
            if choice == "native":
                raise RuntimeError(f"warpnn: {LAUNCHER_ENV}=native, but the native launcher is unavailable: {e}") from e
            warnings.warn(
                f"warpnn: the native launcher is unavailable, using the Python launcher, which re-enters Python "
                f"on every kernel execution (tens of µs per call). Reason: {e}. "
                f"Set {LAUNCHER_ENV}=python to choose it explicitly and silence this warning.",
                RuntimeWarning,
                stacklevel=4,
            )
            return self._python_launcher()

    def _python_launcher(self) -> PythonLauncher:
        if self._python is None:
            self._python = PythonLauncher()
        return self._python

    def select(self, choice: str) -> str:
        """Switch to ``choice`` (``python`` | ``native`` | ``auto``); returns the previous launcher's name.

        Clears JAX's compilation caches: executables already compiled call the previous launcher's targets.
        """
        previous = self.name if self._impl is not None else None
        new = self._make(choice)
        with self._lock:
            self._impl = new
        jax.clear_caches()
        return previous


LAUNCHER = _SelectedLauncher()


@contextlib.contextmanager
def use_launcher(choice: str):
    """Run a block with the ``python`` or ``native`` launcher (tests, benchmarks); restores the previous one."""
    previous = LAUNCHER.name if LAUNCHER._impl is not None else None
    LAUNCHER.select(choice)
    try:
        yield LAUNCHER.impl
    finally:
        if previous is None:
            with LAUNCHER._lock:
                LAUNCHER._impl = None
            jax.clear_caches()
        else:
            LAUNCHER.select(previous)
