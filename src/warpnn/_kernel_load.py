"""Loading a kernel's Warp module for a launcher, shared by the Python (``_launch``) and native
(``_native_launch``) launchers: one lock, one check of what the Warp build supports, one refusal of code
compiled in Warp's deterministic mode."""

from __future__ import annotations

import threading
from typing import Any

import warp as wp

from . import _warp_compat as wc


DETERMINISTIC_MESSAGE = (
    "Kernel '{key}' was compiled in Warp's deterministic mode ({mode}, from wp.config.deterministic or its "
    "module's 'deterministic' option) and uses atomics (its own, or its adjoint's accumulation into input "
    "gradients). On CUDA, Warp launches such kernels through its own multi-pass launcher, with hidden kernel "
    "parameters (a phase flag, an overflow flag, one scatter-record buffer per atomic target) and a "
    "sort-reduce pass after the launch; warpnn's launchers do not provide them, and launching the kernel "
    "without them would be undefined behaviour, so warpnn refuses. Fix: compile this kernel's module without "
    "deterministic mode (wp.set_module_options({{'deterministic': wp.DeterministicMode.NOT_GUARANTEED}}) in "
    "the Python module that defines it, or @wp.kernel(module_options={{'deterministic': "
    "wp.DeterministicMode.NOT_GUARANTEED}})), or run it on the CPU, where Warp's atomics are sequential and "
    "warpnn's results are bitwise reproducible from run to run."
)


def refuse_deterministic(kernel, hooks, on_cuda: bool) -> None:
    """Raise if ``hooks`` are CUDA code that Warp's deterministic mode gave hidden parameters (see the message)."""
    meta = getattr(hooks, "det_launch_meta", None)
    if on_cuda and meta is not None and meta.needs_deterministic:
        mode = getattr(meta.determinism_mode, "name", meta.determinism_mode)
        raise NotImplementedError(DETERMINISTIC_MESSAGE.format(key=kernel.key, mode=mode))


class _LoadedKernel:
    """A kernel's entry points on one device, plus launch bounds cached per launch dims."""

    __slots__ = ("kernel", "module_exec", "hooks", "block_dim", "_bounds")

    def __init__(self, kernel, device, block_dim=None):
        self.kernel = kernel  # _LOADED is keyed by id(kernel): keep the id from being reused
        # Warp's FFI convention: one thread per block on the CPU (cooperative blocks are far slower
        # for plain kernels; honoured above one with wp.config.enable_cpu_blocks), 256 on CUDA.
        block_dim = wc.resolve_block_dim(device, block_dim)
        module_exec = load_module(kernel, device, block_dim)
        # Keep the module loaded for the life of the process: if Warp rebuilds it (a kernel added to the same
        # Python module later), this launcher goes on launching this ModuleExec's code, and dropping the last
        # reference would unload the code `hooks` points into. (_LOADED entries are never replaced.)
        self.module_exec = module_exec
        self.hooks = module_exec.get_kernel_hooks(kernel)
        self.block_dim = module_exec.block_dim
        self._bounds: dict[tuple[int, ...], Any] = {}

    def bounds(self, kernel, dims: tuple[int, ...]):
        bounds = self._bounds.get(dims)
        if bounds is None:
            if len(self._bounds) > 64:  # many distinct launch sizes: keep the cache bounded
                self._bounds.clear()
            bounds = self._bounds[dims] = wc.build_launch_bounds(dims, kernel, self.block_dim)
        return bounds


_LOADED: dict[tuple[int, Any, Any], _LoadedKernel] = {}
# Tracing threads and handler threads of both launchers may load at once; Warp's module loading is not thread-safe.
_LOAD_LOCK = threading.RLock()


def load_module(kernel, device, block_dim=None):
    """Load the Warp module holding ``kernel`` on ``device`` (Warp's FFI convention: one thread per block on the
    CPU, 256 on CUDA, unless ``block_dim`` says otherwise) and refuse code the launchers cannot run."""
    check_warp_supports(device, kernel.key)
    with _LOAD_LOCK:
        module_exec = kernel.module.load(device, wc.resolve_block_dim(device, block_dim))
    if module_exec is None:
        raise RuntimeError(f"Failed to load Warp module '{kernel.module.name}' on device '{device}' (kernel '{kernel.key}')")
    refuse_deterministic(kernel, module_exec.get_kernel_hooks(kernel), device.is_cuda)
    return module_exec


def check_warp_supports(device, key: str) -> None:
    """A clear error when this Warp build cannot run kernels on ``device`` (a wheel without CPU or CUDA support)."""
    if device.is_cpu and not wp.is_cpu_available():
        raise RuntimeError(f"kernel '{key}': this Warp build does not include CPU support (its CPU compiler is missing)")
    if device.is_cuda and not wc.runtime().is_cuda_enabled:
        raise RuntimeError(f"kernel '{key}': this Warp build does not include CUDA support")


def load_kernel(kernel, device, block_dim=None) -> _LoadedKernel:
    """Load (once per device and block dim) the Warp module holding ``kernel``; also used at trace time to preload."""
    key = (id(kernel), device.context if device.is_cuda else "cpu", wc.resolve_block_dim(device, block_dim))
    loaded = _LOADED.get(key)
    if loaded is None:
        with _LOAD_LOCK:
            loaded = _LOADED.get(key)
            if loaded is None:
                loaded = _LOADED[key] = _LoadedKernel(kernel, device, block_dim)
    return loaded
