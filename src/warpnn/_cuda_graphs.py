"""Letting XLA capture Warp calls into CUDA graphs.

XLA records FFI calls declared command-buffer compatible (warpnn's forward and adjoint are) into CUDA
graphs, but with its default flags it does so only for runs of at least
``--xla_gpu_graph_min_graph_size`` (5) operations, and it caches at most
``--xla_cmd_buffer_trace_cache_size`` (16) recorded traces of each FFI call, one per set of buffer
addresses. A typical model step (one Warp call between a few fused ops) has shorter runs than that, and
every execution calls back into the handler. ``lax.scan`` bodies are long enough once warpnn's calls sit
behind an optimization barrier (``_bridge._fence``): measured on an H200, a fwd+bwd scan replays from graphs
with the default flags (0.1 handler entries per 1000 launches, 500 before the barrier), and a trace cache
of 16 suffices for it, since each call then sees the same buffers every step.
"""

from __future__ import annotations

import os
import re

CAPTURE_FLAGS = {"xla_gpu_graph_min_graph_size": 1, "xla_cmd_buffer_trace_cache_size": 1024}


def enable_cuda_graph_capture(min_graph_size: int = 1, trace_cache_size: int = 1024) -> str:
    """Set the XLA flags under which Warp calls are replayed from CUDA graphs; call before JAX starts.

    Costs: XLA compiles graphs for short op sequences too (slightly longer first calls), and keeps up to
    ``trace_cache_size`` small recorded graphs per FFI call site in GPU memory, one per set of buffer
    addresses the call has seen (its operands live in new places whenever the caller passes new arrays;
    the default keeps that from ever calling back). On the CPU it changes nothing.

    Args:
        min_graph_size: smallest number of operations XLA puts into a CUDA graph (XLA's default: 5).
        trace_cache_size: recorded traces kept per FFI call site (XLA's default: 16). Raise it if
            ``python -m benchmarks graph_capture``-style counts of handler entries stay high.

    Returns:
        The new value of ``XLA_FLAGS``.

    Raises:
        RuntimeError: if a JAX backend is already running, since XLA reads its flags once at start-up.
    """
    if _backends_started():
        raise RuntimeError(
            "warpnn.enable_cuda_graph_capture() must run before JAX starts a backend (before the first "
            "jax.devices(), jnp array or jitted call), because XLA reads XLA_FLAGS once. Call it at the top "
            "of your script, or set it in the shell: XLA_FLAGS='--xla_gpu_graph_min_graph_size=1 "
            "--xla_cmd_buffer_trace_cache_size=1024'."
        )
    for name, value in (("min_graph_size", min_graph_size), ("trace_cache_size", trace_cache_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"enable_cuda_graph_capture: {name} must be a positive int, got {value!r}.")
    flags = os.environ.get("XLA_FLAGS", "")
    for flag, value in (("xla_gpu_graph_min_graph_size", min_graph_size), ("xla_cmd_buffer_trace_cache_size", trace_cache_size)):
        flags = re.sub(rf"--{flag}=\S*", "", flags)  # ours wins over an earlier setting of the same flag
        flags = f"{flags} --{flag}={value}"
    os.environ["XLA_FLAGS"] = " ".join(flags.split())
    return os.environ["XLA_FLAGS"]


def min_graph_size() -> int:
    """XLA's ``--xla_gpu_graph_min_graph_size`` as this process's ``XLA_FLAGS`` set it (XLA reads them once, at
    start-up; warpnn does not change them after that), else XLA's default, 5."""
    found = re.findall(r"--xla_gpu_graph_min_graph_size=(\d+)", os.environ.get("XLA_FLAGS", ""))
    return int(found[-1]) if found else 5


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX moved its internals; assume not started
        return False
    return bool(getattr(xla_bridge, "backends_are_initialized", lambda: bool(xla_bridge._backends))())
