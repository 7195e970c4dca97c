"""The native launcher: XLA FFI handlers in C that launch Warp kernels with no Python on the hot path.

``PythonLauncher`` (``_launch.py``) re-enters Python, under the GIL and a lock, on every execution of every
Warp call that XLA does not replay from a CUDA graph (~60-110 µs per call on an H200, and always on the
CPU). ``NativeLauncher`` serves the same two FFI targets with handlers compiled from
``_native/warpnn_ffi.c``; Python only runs at trace time, to

* lay out Warp's argument struct with ctypes exactly as Warp's ``invoke`` builds it (one field per kernel
  parameter in signature order: ``array_t`` for arrays, the scalar's ctype for scalars) and register that
  layout, the buffer each parameter comes from, and the launch-bounds layout with the native library,
  which returns an integer *kernel id* (sent with every call as the ``kernel_id`` attribute);
* load the Warp module on each device and register its entry points with the library (per CUDA device
  ordinal: context, CUfunction handles, shared memory, block dim; on the CPU: the compiled functions).

The library reaches Warp's C entry points (``wp_cuda_launch_kernel``, ``wp_memset_device``, ...) through
function pointers handed over here, so it needs neither CUDA headers nor a CUDA link, and the same build
serves CPU-only and GPU processes.

Where the library comes from, first match wins:

1. ``$WARPNN_NATIVE_LIB``: an explicit path (an error if it does not load or is stale);
2. ``warpnn/_native/_warpnn_ffi*.so``: built by ``pip install .`` (``setup.py``), or by
   ``python -m warpnn._native_launch --build-into src/warpnn/_native`` for a source checkout;
3. a per-user cache, ``$WARPNN_CACHE_DIR`` or ``~/.cache/warpnn``, compiled there on first use with the C
   compiler in ``$CC`` (else ``cc``, ``gcc``, ``clang``) against ``jax.ffi.include_dir()``.

A library is used only if it was built from this exact source (its embedded hash matches), so a stale
build can never be paired with a newer Python side, and only if it was compiled against XLA FFI headers no newer
than the running jaxlib's (a handler newer than XLA fails its registration, which takes JAX's CPU backend down
with it: a wheel or a source tree shared by environments with different jax versions). The cache is kept per
FFI API version.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform as _platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Any

import jax
import numpy as np
import warp as wp

from . import _settings
from . import _warp_compat as wc
from ._devices import trace_devices
from ._ffi_attrs import SCALAR_ATTR_PREFIX
from ._kernel_load import load_module
from ._signature import ArgSpec, KernelSignature
from . import _batched

ABI_VERSION = 4  # must equal WARPNN_ABI_VERSION in warpnn_ffi.c
NATIVE_DIR = Path(__file__).resolve().with_name("_native")
SOURCE = NATIVE_DIR / "warpnn_ffi.c"
LIB_ENV = "WARPNN_NATIVE_LIB"
CACHE_ENV = "WARPNN_CACHE_DIR"
DRIVER_LAUNCH_ENV = "WARPNN_DRIVER_LAUNCH"  # "0": always launch through Warp's launcher (see driver_entry_points)
FORWARD_TARGET = "warpnn_native_forward"
ADJOINT_TARGET = "warpnn_native_adjoint"
KERNEL_ID_ATTR = "kernel_id"

# Columns of the parameter table (must match the P_* enum in warpnn_ffi.c).
_P_NCOLS = 15
_KIND_INT, _KIND_UINT, _KIND_FLOAT, _KIND_HALF, _KIND_BOOL, _KIND_BF16 = range(6)

# Warp's array_t as the C side mirrors it: (field, offset); checked against warp's ctypes definition.
_ARRAY_T_LAYOUT = {"data": 0, "grad": 8, "shape": 16, "strides": 32, "ndim": 48, "flags": 50}
_ARRAY_T_SIZE = 56

_RESOLVER_TYPE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int64, ctypes.c_int32, ctypes.c_int32)


class NativeUnavailable(RuntimeError):
    """The native library could not be found, built, or loaded; the message says why."""


# --------------------------------------------------------------------------------------------------
# Building and loading the library


def source_hash() -> str:
    """Identity of the C source; every build embeds it, and only a matching build is loaded."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


def _find_compiler() -> str | None:
    for candidate in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def compile_library(output: Path | str, *, compiler: str | None = None, include_dir: str | None = None) -> Path:
    """Compile ``warpnn_ffi.c`` into the shared library ``output`` (atomically replaced). Raises NativeUnavailable."""
    output = Path(output)
    compiler = compiler or _find_compiler()
    if compiler is None:
        raise NativeUnavailable("no C compiler found (set $CC, or install cc/gcc/clang)")
    include_dir = include_dir or jax.ffi.include_dir()
    if not (Path(include_dir) / "xla" / "ffi" / "api" / "c_api.h").is_file():
        raise NativeUnavailable(f"XLA FFI headers not found under {include_dir} (jax.ffi.include_dir())")
    output.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a temporary name and rename: concurrent processes (pytest-xdist, several ranks) may build
    # the same cache entry at once, and a reader must never see a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=output.name + ".", suffix=".tmp", dir=output.parent)
    os.close(fd)
    cmd = [
        compiler, "-std=c11", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
        f"-I{include_dir}", f'-DWARPNN_SOURCE_HASH="{source_hash()}"',
        str(SOURCE), "-o", tmp, "-lpthread",
    ]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise NativeUnavailable(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{result.stderr[-2000:]}")
        os.replace(tmp, output)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"compiling {SOURCE.name} failed: {e}") from e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return output


@functools.cache
def running_ffi_api_version() -> int | None:
    """The XLA FFI API version of the running jaxlib (major * 1000 + minor), read from the headers it ships
    (``jax.ffi.include_dir()``); None where they cannot be read."""
    try:
        header = (Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    except OSError:
        return None
    major, minor = (re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", header) for part in ("MAJOR", "MINOR"))
    return int(major.group(1)) * 1000 + int(minor.group(1)) if major and minor else None


def cache_dir() -> Path:
    root = _settings.get(CACHE_ENV) or os.path.join(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "warpnn")
    return Path(root) / "native" / f"{source_hash()}-ffi{running_ffi_api_version()}-{sys.platform}-{_platform.machine()}"


def _open(path: Path) -> ctypes.CDLL:
    """Load and validate one library file. Raises NativeUnavailable."""
    try:
        lib = ctypes.CDLL(str(path))
        lib.warpnn_abi_version.restype = ctypes.c_int32
        lib.warpnn_source_hash.restype = ctypes.c_char_p
        abi, built_from = lib.warpnn_abi_version(), lib.warpnn_source_hash().decode()
    except (OSError, AttributeError) as e:
        raise NativeUnavailable(f"{path} does not load: {e}") from e
    if abi != ABI_VERSION or built_from != source_hash():
        raise NativeUnavailable(
            f"{path} is stale: built from source {built_from} (ABI {abi}), this warpnn is {source_hash()} (ABI "
            f"{ABI_VERSION}); rebuild it"
        )
    lib.warpnn_ffi_api_version.restype = ctypes.c_int32
    built_for, running = lib.warpnn_ffi_api_version(), running_ffi_api_version()
    if running is not None and built_for > running:
        raise NativeUnavailable(
            f"{path} was compiled against XLA FFI API {built_for // 1000}.{built_for % 1000}, newer than this "
            f"jaxlib's {running // 1000}.{running % 1000} (jax {jax.__version__}), which would refuse its handlers; "
            f"rebuild it against this jax (python -m warpnn._native_launch --build-into DIR)"
        )
    return lib


def _prebuilt() -> list[Path]:
    return sorted(NATIVE_DIR.glob("_warpnn_ffi*.so")) + sorted(NATIVE_DIR.glob("libwarpnn_ffi*.so"))


_LIBRARY: ctypes.CDLL | None = None
_LIBRARY_PATH: Path | None = None
_LIBRARY_LOCK = threading.Lock()


def load_library() -> ctypes.CDLL:
    """The native library for this process (loaded once), building it into the cache if needed."""
    global _LIBRARY, _LIBRARY_PATH
    with _LIBRARY_LOCK:
        if _LIBRARY is not None:
            return _LIBRARY
        explicit = _settings.get(LIB_ENV)
        if explicit:
            path = Path(explicit)
            lib = _open(path)
        else:
            reasons, lib, path = [], None, None
            for candidate in _prebuilt():
                try:
                    lib, path = _open(candidate), candidate
                    break
                except NativeUnavailable as e:
                    reasons.append(str(e))
            if lib is None:
                path = cache_dir() / "libwarpnn_ffi.so"
                try:
                    if not path.exists():
                        compile_library(path)
                    lib = _open(path)
                except NativeUnavailable as e:
                    raise NativeUnavailable("; ".join([*reasons, str(e)])) from None
        _declare(lib)
        if lib.warpnn_array_t_size() != ctypes.sizeof(wc.array_t):
            raise NativeUnavailable("the native library and this Warp disagree on the size of array_t")
        _LIBRARY, _LIBRARY_PATH = lib, path
        return lib


def library_path() -> Path | None:
    """Where the loaded native library came from (None until loaded)."""
    return _LIBRARY_PATH


def _declare(lib: ctypes.CDLL) -> None:
    c = ctypes
    lib.warpnn_array_t_size.restype = c.c_int32
    lib.warpnn_init.argtypes = [c.c_void_p] * 5
    lib.warpnn_init.restype = None
    lib.warpnn_set_driver.argtypes = [c.c_void_p] * 5
    lib.warpnn_set_driver.restype = None
    lib.warpnn_driver_launches.restype = c.c_int64
    lib.warpnn_set_resolve_error.argtypes = [c.c_char_p]
    lib.warpnn_set_resolve_error.restype = None
    lib.warpnn_handler_entries.argtypes = [c.c_int32]
    lib.warpnn_handler_entries.restype = c.c_int64
    lib.warpnn_register_kernel.argtypes = [
        c.c_char_p, c.c_int32, c.c_int64, c.c_int32, c.POINTER(c.c_int64), c.POINTER(c.c_char_p),
        c.c_int32, c.c_int32, c.c_int32, c.c_int32, c.c_int32, c.c_int32, c.c_int32, c.c_int32,
    ]
    lib.warpnn_register_kernel.restype = c.c_int64
    lib.warpnn_set_cpu_serial.argtypes = [c.c_int64]
    lib.warpnn_set_cpu_serial.restype = c.c_int32
    lib.warpnn_set_cpu_entry.argtypes = [c.c_int64, c.c_void_p, c.c_void_p, c.c_int32]
    lib.warpnn_set_cpu_entry.restype = c.c_int32
    lib.warpnn_set_cuda_entry.argtypes = [c.c_int64, c.c_int32, c.c_void_p, c.c_void_p, c.c_void_p] + [c.c_int32] * 5
    lib.warpnn_set_cuda_entry.restype = c.c_int32
    _batched.declare_native(lib)


def _check_array_layout() -> None:
    layout = {name: getattr(wc.array_t, name).offset for name in _ARRAY_T_LAYOUT}
    if layout != _ARRAY_T_LAYOUT or ctypes.sizeof(wc.array_t) != _ARRAY_T_SIZE:
        raise NativeUnavailable(f"Warp's array_t layout changed ({layout}, size {ctypes.sizeof(wc.array_t)})")


def _address(fn) -> int:
    """The address of a ctypes function (pointer), 0 for None."""
    return 0 if fn is None else (ctypes.cast(fn, ctypes.c_void_p).value or 0)


_DRIVER_SYMBOLS = ("cuCtxGetCurrent", "cuLaunchKernel", "cuMemsetD32Async", "cuMemsetD8Async", "cuGetErrorString")


def driver_entry_points() -> list[int] | None:
    """Addresses of the CUDA driver functions the handlers' driver path calls (``_DRIVER_SYMBOLS``), or None
    where there is no CUDA driver or ``WARPNN_DRIVER_LAUNCH=0`` asks for Warp's launcher on every call."""
    if not _settings.get(DRIVER_LAUNCH_ENV) or not wp.is_cuda_available():
        return None
    try:
        cuda = ctypes.CDLL("libcuda.so.1")  # already loaded by Warp: this only looks it up
        return [_address(getattr(cuda, name)) for name in _DRIVER_SYMBOLS]
    except (OSError, AttributeError):
        return None


# --------------------------------------------------------------------------------------------------
# Kernel descriptors


def _scalar_kind(spec: ArgSpec) -> int:
    if spec.warp_type is wp.float16:
        return _KIND_HALF
    if spec.warp_type is wp.bfloat16:
        return _KIND_BF16
    return {"f": _KIND_FLOAT, "i": _KIND_INT, "u": _KIND_UINT, "b": _KIND_BOOL}[spec.dtype.kind]


def describe(sig: KernelSignature) -> dict[str, Any]:
    """The registration arguments for ``sig``: Warp's argument-struct layout and each parameter's buffers.

    Needs the kernel's module hashed (``kernel.adj.kernel_dim``), i.e. loaded on some device.
    """
    kernel = sig.kernel
    # The struct Warp's `invoke` builds: one field per parameter, array_t, the scalar's ctype or the wp.struct's.
    top = (*sig.inputs, *sig.outputs)
    fields = [(s.name, wc.array_t if s.is_array else s.warp_type.ctype if s.is_struct else s.warp_type._type_)
              for s in top]
    args_struct = type("ArgsStruct", (ctypes.Structure,), {"_fields_": fields})
    params = (*sig.input_leaves, *sig.outputs)  # one table row per array or scalar, struct fields included
    first_leaves = {id(a.leaves[0]) for a in top if a.leaves}

    def starts_param(leaf) -> int:
        return int(id(leaf) in first_leaves)  # a struct's first field lies at the struct's own offset

    def field_offset(leaf) -> int:
        # a struct field's offset: its parameter's, plus the offset of each field on its path
        name, *path = leaf.name.split(".")
        offset, ctype = getattr(args_struct, name).offset, dict(fields)[name]
        for attr in path:
            offset += getattr(ctype, attr).offset
            ctype = dict(ctype._fields_)[attr]
        return offset

    # Buffer order (see _bridge._ffi_call): forward args = array inputs, rets = in-out arrays then outputs;
    # adjoint args = array inputs, primal outputs, cotangents of float results; adjoint rets = adjoints of
    # adjoint_inputs, then carried adjoints, then replay buffers (the primal slots of results Warp's adjoint
    # writes, aliased to their operand). Sources: k+1 = operand k, -(k+1) = result k, 0 = none (null).
    n_in, n_out = len(sig.array_inputs), len(sig.outputs)
    operand = {s.name: k for k, s in enumerate(sig.array_inputs)}
    result = {s.name: r for r, s in enumerate(sig.results)}
    cotangent = {s.name: n_in + n_out + f for f, s in enumerate(sig.float_results)}
    returned = (*sig.adjoint_inputs, *sig.carried_adjoints)
    adjoint_result = {s.name: m for m, s in enumerate(returned)}
    carried = {s.name for s in sig.carried_adjoints}
    replay_buffer = {s.name: len(returned) + m for m, s in enumerate(sig.replay_buffers)}
    carrier = dict(sig.adjoints_in_place)
    paired_outputs = set(carrier.values())
    rows, attr_names = [], []
    for i, s in enumerate(params):
        offset = field_offset(s)
        if not s.is_array:
            ctype = s.warp_type._type_
            rows.append([0, offset, 0, 0, 0, 0, 0, 0, 0, _scalar_kind(s), ctypes.sizeof(ctype), 0, 0, 0,
                         starts_param(s)])
            attr_names.append((SCALAR_ATTR_PREFIX + s.name).encode())
            continue
        if s.name in sig.null_inputs:
            fwd = adj = 0
        elif s.name in result:  # in-out array or output: the forward result (in-out: aliased to its operand)
            fwd = -(result[s.name] + 1)
            adj = operand[s.name] + 1 if s.name in operand else n_in + sig.output_names.index(s.name) + 1
            if s.name in replay_buffer:
                adj = -(replay_buffer[s.name] + 1)
        else:
            fwd = adj = operand[s.name] + 1
        if s.name in adjoint_result:
            grad = -(adjoint_result[s.name] + 1)
        elif s.name in carrier:  # an in-place pair's input: its adjoint is the output's carried adjoint
            grad = -(adjoint_result[carrier[s.name]] + 1)
        elif s.name in cotangent and s.name in sig.output_names:
            grad = cotangent[s.name] + 1  # Warp reads an output's adjoint: its cotangent, unmodified
        else:
            grad = 0  # null: no adjoint (integer, constant or None input)
        inner = int(np.prod(s.inner_shape, dtype=np.int64))
        if s.dtype.itemsize * inner != wc.type_size_in_bytes(s.warp_dtype):
            raise NativeUnavailable(f"kernel '{sig.key}', argument '{s.name}': element size mismatch")
        fully_written = int(s.name in sig.outputs_fully_written)
        # preset bit 4: the adjoint never touches this output's primal values (an in-place pair's output, whose
        # slot holds some other buffer of its shape): the handler addresses them as its grad buffer, so that
        # both are batched alike
        preset = ((1 if s.name in sig.in_out_names else 0)
                  | (2 if s.name in carried or s.name in carrier or s.name in replay_buffer else 0)
                  | (4 if s.name in paired_outputs else 0))
        # carried adjoints, and struct fields (Warp's adjoint of a struct's array accumulates into its `grad`)
        # and arrays read through row views (Warp's adjoint of a view accumulates into the viewed array's `grad`)
        grad_alias = int(s.name in carried or (s.name in adjoint_result and ("." in s.name or sig.uses[s.name].viewed)))
        rows.append([1, offset, s.warp_ndim, s.jax_ndim, s.dtype.itemsize, inner, fwd, adj, grad, 0, 0,
                     fully_written, preset, grad_alias, starts_param(s)])
        attr_names.append(None)

    kernel_dim = kernel.adj.kernel_dim
    bounds_type = type(wc.build_launch_bounds((1,) * kernel_dim, kernel))
    tid_limit = wc.tid_extent_limit(kernel)
    return {
        "name": sig.key,
        "kernel_dim": kernel_dim,
        "tid_limit": -1 if tid_limit is None else int(tid_limit),
        "rows": rows,
        "attr_names": attr_names,
        "args_size": ctypes.sizeof(args_struct),
        "bounds_size": ctypes.sizeof(bounds_type),
        "bounds_size_offset": bounds_type.size.offset,
        "bounds_coord_mult_offset": bounds_type.coord_mult.offset,
        "num_args": (n_in, n_in + n_out + len(sig.float_results)),
        "num_rets": (len(sig.results), len(returned) + len(sig.replay_buffers)),
    }


# --------------------------------------------------------------------------------------------------
# The launcher


class NativeLauncher:
    """Serves warpnn's forward/adjoint FFI targets with the native handlers (one instance per process)."""

    name = "native"

    def __init__(self, lib: ctypes.CDLL | None = None):
        _check_array_layout()
        self._lib = lib or load_library()
        self._lock = threading.RLock()
        self._ids: dict[int, int] = {}  # id(signature) -> kernel id
        self._sigs: dict[int, KernelSignature] = {}  # kernel id -> signature (kept alive: ids are never reused)
        # (kernel id, device) -> the ModuleExec whose entry points the library holds now. Keeping it referenced
        # keeps Warp from unloading that code while a compiled XLA executable may still launch it.
        self._execs: dict[tuple[int, str], Any] = {}
        # Every ModuleExec whose entry points the library ever held, kept for the life of the process: when Warp
        # rebuilds a module (a kernel added later to the same Python module) and a retrace registers the new
        # code, a handler on another thread may be running the old code at that very moment, and the last
        # reference to a ModuleExec unloads its code (SIGSEGV in the running handler). The library never
        # frees a replaced entry either. Cost: one retained module per rebuild of a Warp module.
        self._retired: list[Any] = []
        resolver = _RESOLVER_TYPE(self._resolve)
        self._callbacks = [resolver]  # must outlive every executable; never grows per call
        core = wc.runtime().core
        self._lib.warpnn_init(
            _address(core.wp_cuda_launch_kernel), _address(core.wp_memset_device),
            _address(core.wp_get_error_string), _address(core.wp_take_cpu_block_error), _address(resolver),
        )
        self.set_driver_path(True)
        self.twins = _batched.NativeTwins(self._lib, self)
        for platform, fwd, adj in (
            ("cpu", self._lib.warpnn_cpu_forward, self._lib.warpnn_cpu_adjoint),
            ("CUDA", self._lib.warpnn_cuda_forward, self._lib.warpnn_cuda_adjoint),
        ):
            jax.ffi.register_ffi_target(FORWARD_TARGET, jax.ffi.pycapsule(fwd), platform=platform)
            jax.ffi.register_ffi_target(ADJOINT_TARGET, jax.ffi.pycapsule(adj), platform=platform)

    # -- the launcher interface used by _bridge

    @property
    def num_registered(self) -> int:
        """Number of kernel signatures registered with the library (each exactly once)."""
        return len(self._ids)

    @property
    def handler_entries(self) -> dict[str, int]:
        """Executions of the native handlers (not XLA's metadata queries), as PythonLauncher counts them."""
        return {"forward": self._lib.warpnn_handler_entries(0), "adjoint": self._lib.warpnn_handler_entries(1)}

    @property
    def driver_launches(self) -> int:
        """CUDA launches that went straight through the driver rather than through Warp's launcher."""
        return self._lib.warpnn_driver_launches()

    def set_driver_path(self, enabled: bool) -> None:
        """Turn the handlers' CUDA driver path on (where the driver is present) or off (Warp's launcher)."""
        entry_points = driver_entry_points() if enabled else None
        self._lib.warpnn_set_driver(*(entry_points or [None] * len(_DRIVER_SYMBOLS)))

    def targets(self, sig: KernelSignature) -> tuple[str, str]:
        self._kernel_id(sig)
        return FORWARD_TARGET, ADJOINT_TARGET

    def extra_attrs(self, sig: KernelSignature) -> dict[str, Any]:
        """The ``kernel_id`` attribute; also (re)registers the entry points of the devices this trace targets."""
        kid = self._kernel_id(sig)
        with self._lock:
            for device in trace_devices():
                self._set_entry(kid, sig, device)
        return {KERNEL_ID_ATTR: np.int64(kid)}

    def prepare_twin(self, sig: KernelSignature, batched: bool = True) -> str | None:
        """Register the batched (or row) twin of ``sig`` (``_batched.py``); None when ready, else why not."""
        return self.twins.prepare(sig, batched)

    # -- registration

    def _kernel_id(self, sig: KernelSignature) -> int:
        kid = self._ids.get(id(sig))
        if kid is not None:
            return kid
        with self._lock:
            if id(sig) in self._ids:
                return self._ids[id(sig)]
            devices = trace_devices()
            for device in devices:  # hashes the module (kernel_dim, grid_stride) and loads it
                self._load(sig, device)
            d = describe(sig)
            table = np.ascontiguousarray(np.asarray(d["rows"], dtype=np.int64).reshape(-1, _P_NCOLS))
            names = (ctypes.c_char_p * max(1, len(d["attr_names"])))(*d["attr_names"])
            kid = self._lib.warpnn_register_kernel(
                d["name"].encode(), d["kernel_dim"], d["tid_limit"], len(d["rows"]),
                table.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), names, d["args_size"], d["bounds_size"],
                d["bounds_size_offset"], d["bounds_coord_mult_offset"],
                d["num_args"][0], d["num_rets"][0], d["num_args"][1], d["num_rets"][1],  # forward, adjoint
            )
            if kid < 0:
                raise RuntimeError(f"warpnn: the native launcher refused the descriptor of kernel '{sig.key}'")
            if not _batched.cpu_thread_safe(sig.kernel):
                self._lib.warpnn_set_cpu_serial(kid)
            self._sigs[kid] = sig
            for device in devices:
                self._set_entry(kid, sig, device)
            self._ids[id(sig)] = kid
            return kid

    @staticmethod
    def _load(sig: KernelSignature, device):
        # The same module variant as PythonLauncher (_kernel_load.load_kernel), under the same lock.
        return load_module(sig.kernel, device, sig.block_dim)

    def _set_entry(self, kid: int, sig: KernelSignature, device) -> None:
        """Register (or, after Warp reloaded the module, re-register) the entry points of ``sig`` on ``device``."""
        module_exec = self._load(sig, device)
        key = (kid, device.alias)
        if self._execs.get(key) is module_exec:
            return
        hooks = module_exec.get_kernel_hooks(sig.kernel)
        if device.is_cpu:
            rc = self._lib.warpnn_set_cpu_entry(
                kid, _address(hooks.forward), _address(hooks.backward), module_exec.block_dim
            )
        else:
            rc = self._lib.warpnn_set_cuda_entry(
                kid, device.ordinal, device.context, hooks.forward, hooks.backward,
                hooks.forward_smem_bytes, hooks.backward_smem_bytes if hooks.backward else 0,
                module_exec.block_dim, int(bool(sig.kernel.grid_stride)), hooks.cluster_dim,
            )
        if rc != 0:
            raise RuntimeError(f"warpnn: registering kernel '{sig.key}' on {device} with the native launcher failed ({rc})")
        previous = self._execs.get(key)
        if previous is not None:
            self._retired.append(previous)
        self._execs[key] = module_exec

    def _resolve(self, kid: int, platform: int, ordinal: int) -> int:
        """Called by a handler (once) for a device without entry points: load the module there. 0 = done."""
        try:
            with self._lock:
                sig = self._sigs[kid]
                device = wp.get_cuda_device(ordinal) if platform else wp.get_device("cpu")
                self._set_entry(kid, sig, device)
            return 0
        except BaseException as e:  # noqa: BLE001 - must not unwind into C; the handler reports an FFI error
            traceback.print_exc()
            self._lib.warpnn_set_resolve_error(f"{type(e).__name__}: {e}".encode(errors="replace"))
            return 1


_INSTANCE: NativeLauncher | None = None
_INSTANCE_LOCK = threading.Lock()


def get_launcher() -> NativeLauncher:
    """The process-wide native launcher (kernel ids live in the one loaded library). Raises NativeUnavailable."""
    global _INSTANCE
    with _INSTANCE_LOCK:
        if _INSTANCE is None:
            _INSTANCE = NativeLauncher()
    return _INSTANCE


def _main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m warpnn._native_launch",
        description="Build (or locate) warpnn's native XLA FFI launcher library.",
    )
    parser.add_argument("--build-into", metavar="DIR", help="compile into DIR/libwarpnn_ffi.so (e.g. src/warpnn/_native)")
    args = parser.parse_args(argv)
    if args.build_into:
        print(compile_library(Path(args.build_into) / "libwarpnn_ffi.so"))
    else:
        load_library()
        print(library_path())


if __name__ == "__main__":
    _main()
