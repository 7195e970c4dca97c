"""Timing and reporting shared by the benchmarks."""

from __future__ import annotations

import collections
import glob
import os
import platform
import subprocess
import tempfile
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


def time_interleaved(cases: dict, rounds: int = 20, per_round: int = 3) -> dict:
    """Median wall time of each case (``{key: (fn, args)}``), measured in rounds that visit every case in
    turn, so that slow drifts of the machine (clocks, other tenants of the host) fall on all cases alike and
    their ratios hold still. Cases whose warm-up raises are left out (their key maps to the exception)."""
    ready, results = {}, {}
    for key, (fn, args) in cases.items():
        try:
            jax.block_until_ready(fn(*args))
            jax.block_until_ready(fn(*args))
            ready[key] = (fn, args)
        except Exception as e:  # noqa: BLE001 - a case that cannot run is reported by the caller
            results[key] = e
    samples = {key: [] for key in ready}
    for _ in range(rounds):
        for key, (fn, args) in ready.items():
            for _ in range(per_round):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                samples[key].append(time.perf_counter() - t0)
    results.update({key: float(np.median(s)) for key, s in samples.items()})
    return results


def print_rounds(cases: dict, rounds: int, steps: int, reference: str = "pure JAX") -> None:
    """Time ``cases`` (``{(case, label): (fn, args)}``) in alternating rounds (``time_interleaved``), ``rounds``
    times, printing µs per step (each call runs ``steps`` steps) and the ratio to ``reference``'s label."""
    width = max(len(case) for case, _ in cases), max(len(label) for _, label in cases)
    for r in range(rounds):
        times = time_interleaved(cases, rounds=10)
        for (case, label), t in times.items():
            ratio = t / times[(case, reference)]
            print(f"  round {r}  {case:{width[0]}s} {label:{width[1]}s} {t / steps * 1e6:9.2f}  ({ratio:.2f}×)", flush=True)


def _traced(fn: Callable, args, calls: int) -> tuple[list, float]:
    """Run ``fn(*args)`` ``calls`` times (after two warm-up calls) under ``jax.profiler``; return the trace's events
    as ``(on_device, event)`` pairs, and the wall time in seconds. Host events are XLA executing operations (and
    Python's); device events the kernels, memsets and copies on the GPU's stream lines (none on a CPU)."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            t0 = time.perf_counter()
            for _ in range(calls):
                jax.block_until_ready(fn(*args))
            wall = time.perf_counter() - t0
        data = ProfileData.from_file(sorted(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True))[-1])
    events = []
    for plane in data.planes:
        on_device = plane.name.startswith("/device:")
        if not (on_device or plane.name == "/host:CPU"):
            continue
        for line in plane.lines:
            if on_device and not line.name.startswith("Stream"):
                continue  # the device plane's other lines summarise the streams' events again
            events += [(on_device, e) for e in line.events if not e.name.startswith("end: ")]
    return events, wall


def trace_events(fn: Callable, *args, calls: int = 5) -> tuple[dict, dict, float]:
    """Run ``fn(*args)`` ``calls`` times under ``jax.profiler`` and reduce the trace (see ``_traced``).

    Returns ``(host, device, wall)``: event durations in ns by name, on the host (XLA executing each HLO
    operation; on a GPU that is enqueueing it, a custom call's handler included) and on the device (each
    kernel, memset and copy; empty on a CPU), and the wall time in seconds.
    """
    events, wall = _traced(fn, args, calls)
    host, device = collections.defaultdict(list), collections.defaultdict(list)
    for on_device, event in events:
        (device if on_device else host)[event.name].append(event.duration_ns)
    return dict(host), dict(device), wall


def trace_timeline(fn: Callable, *args, calls: int = 3) -> tuple[list, list]:
    """Run ``fn(*args)`` ``calls`` times under ``jax.profiler`` (see ``_traced``); return the events as
    ``(host, device)`` lists of ``(start_ns, end_ns, name)`` sorted by start, on one clock."""
    events, _ = _traced(fn, args, calls)
    host = sorted((e.start_ns, e.end_ns, e.name) for on_device, e in events if not on_device)
    device = sorted((e.start_ns, e.end_ns, e.name) for on_device, e in events if on_device)
    return host, device


def device_time(fn: Callable, *args, calls: int = 5) -> float | None:
    """Seconds of device work (kernels, memsets, copies) per call of ``fn``; None where no device trace."""
    _, device, _ = trace_events(fn, *args, calls=calls)
    total = sum(sum(d) for d in device.values())
    return total / calls / 1e9 if total else None


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
