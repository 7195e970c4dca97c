"""Timing and reporting shared by the benchmarks."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from collections.abc import Callable

import jax
import numpy as np


def time_call(fn: Callable, *args, reps: int = 50, min_time: float = 0.2) -> float:
    """Median wall time of ``fn(*args)`` in seconds, after a warm-up call, blocking on the result."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    samples = []
    t_end = time.perf_counter() + min_time
    while len(samples) < reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
        if len(samples) >= 20 * reps:
            break
    return float(np.median(samples))


def environment() -> dict:
    import warp as wp

    info = {
        "jax": jax.__version__,
        "warp": wp.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "python": platform.python_version(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "date": time.strftime("%Y-%m-%d"),
    }
    if info["backend"] == "gpu":
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip().splitlines()
            info["nvidia_smi"] = f"{len(out)} x {out[0]}" if len(out) > 1 else out[0]
        except Exception:  # noqa: BLE001 - informational only
            pass
    else:
        info["cpu_count"] = os.cpu_count()
    return info


def fmt_us(seconds: float | None) -> str:
    return "—" if seconds is None or not np.isfinite(seconds) else f"{seconds * 1e6:.1f}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not (np.isfinite(a) and np.isfinite(b)) or b == 0:
        return "—"
    return f"{a / b:.2f}×"
