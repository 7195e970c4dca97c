"""Where a ``lax.scan`` fwd+bwd step of a trivial kernel spends its time: warpnn vs pure JAX.

For each implementation: the operations XLA runs per step (instructions of the compiled while-loop
bodies: fusions by kind, custom calls by target, copies), the per-step time, and, from a ``jax.profiler``
trace, the per-step host time XLA spends executing each operation (on a GPU: enqueueing it, warpnn's
handler included) and the device time of each kernel, memset and copy. Device busy time far below the step
time means the step is bound by the host launching work, not by the device.

    python -m benchmarks.profile_scan
"""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp

from .bridge import N, SCAN_STEPS, _scan_grad, _variants
from .common import time_call, trace_events

IMPLS = ("warpnn", "pure JAX")

# Instructions that only name or regroup buffers: no work on the device.
_FREE = {"parameter", "get-tuple-element", "tuple", "constant", "bitcast"}
_WHILE = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+)")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\((.*)$")


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.splitlines():
        header = _HEADER.match(line)
        if header and "=" not in line.split("{")[0]:
            name = header.group(1)
            comps[name] = []
        elif name is not None and line.strip() and line.strip() != "}":
            comps[name].append(line.strip())
    return comps


def loop_body_ops(hlo: str) -> collections.Counter:
    """Opcodes (fusions as ``fusion:<kind>``, custom calls by target) in every while body of ``hlo``."""
    comps = _computations(hlo)
    counts = collections.Counter()
    for body in _WHILE.findall(hlo):
        for line in comps.get(body, []):
            match = _INSTRUCTION.search(line)
            if not match or match.group(1) in _FREE:
                continue
            op, rest = match.groups()
            if op == "fusion":
                kind = re.search(r"kind=(\w+)", rest)
                op = f"fusion:{kind.group(1) if kind else '?'}"
            elif op == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', rest)
                op = f"custom-call:{target.group(1) if target else '?'}"
            counts[op] += 1
    return counts


def _step_fn(impl: str):
    return jax.jit(_scan_grad(_variants()[impl][1]))


def traced_breakdown(impl: str, calls: int = 10) -> str:
    """Per-step host and device time by operation, from a ``jax.profiler`` trace of ``calls`` calls."""
    x = jnp.linspace(0.0, 1.0, N, dtype=jnp.float32)
    host, device, wall = trace_events(_step_fn(impl), x, calls=calls)
    steps = calls * SCAN_STEPS
    busy = sum(sum(d) for d in device.values())
    lines = [f"  traced {steps} steps: {wall / steps * 1e6:.2f} µs per step (profiler on); device busy "
             f"{busy / steps / 1e3:.2f} µs per step"]
    for title, events in (("host: XLA operations executed", host), ("device: kernels, memsets, copies", device)):
        per_step = {k: v for k, v in events.items() if len(v) >= steps // 2}  # per-step work, not per-call
        lines.append(f"  {title} per step (count × mean µs):")
        for name, durations in sorted(per_step.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"    {len(durations) / steps:5.2f} × {sum(durations) / len(durations) / 1e3:6.2f}  {name[:90]}")
    return "\n".join(lines)


def main() -> None:
    x = jnp.linspace(0.0, 1.0, N, dtype=jnp.float32)
    for impl in IMPLS:
        fn = _step_fn(impl)
        ops = loop_body_ops(fn.lower(x).compile().as_text())
        step = time_call(fn, x, reps=20) / SCAN_STEPS
        print(f"{impl}: {step * 1e6:.1f} µs per scan step (fwd+bwd); ops per step in the loop bodies: "
              f"{sum(ops.values())}")
        for op, count in sorted(ops.items()):
            print(f"    {count:3d}  {op}")
        print(traced_breakdown(impl))


if __name__ == "__main__":
    main()
