"""Where a small Newton rollout step goes on the GPU: device work against wall time, warpnn vs Newton captured.

For the ``benchmarks.newton_rollout`` scene at ``--particles`` (default 1024), one ``jax.profiler`` trace each of
warpnn's forward rollout (``lax.scan``, ``--unroll``) and of Newton's own forward loop replayed from one
``wp.ScopedCapture`` graph, over ``--steps`` steps. Per rollout step it prints the wall time, the device time
(kernels, memsets and copies on the GPU's streams) and the device operations by name (count and µs). The wall
time less the device time is what launching costs: gaps between graph nodes, the loop's bookkeeping. It also
times back-to-back calls without the profiler, and counts warpnn's handler entries per rollout call, keeping each call's result alive until the next call returns
and dropping it first: 0 means XLA replayed the whole rollout from its recorded CUDA graphs; every re-recording
of a command buffer enters the handler of each FFI call in it again.

``--direction fwd+bwd`` profiles the gradient of the rollout instead (warpnn's ``jax.value_and_grad`` against
Newton's ``wp.Tape`` forward and backward, captured), with the device operations per step only.

    python -m benchmarks.profile_newton_step [--particles 1024] [--steps 50] [--unroll 10] [--direction fwd+bwd]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import warp as wp

from warpnn import _launch

from .common import time_call, trace_events, trace_timeline
from .newton_rollout import _NewtonRollout, _scene, _warpnn_cases

wp.config.quiet = True
DT = 5e-4  # the step of every rollout here: warpnn's, chained or not, and Newton's own


def _per_step(device: dict, calls: int, steps: int) -> dict[str, tuple[float, float]]:
    """(operations, µs) per rollout step for each device operation name, the busiest first."""
    rows = {name: (len(d) / calls / steps, sum(d) / calls / steps / 1e3) for name, d in device.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][1]))


def idle_gaps(fn, calls: int = 3, top: int = 8, min_gap_us: float = 3.0) -> None:
    """Print where the device waits within one call of ``fn``: per call the span from the first device operation
    to the last, its busy time and its idle gaps; then the longest gaps, with the device operations on either
    side and the host events (XLA executing operations) that overlap each."""
    host, device = trace_timeline(fn, calls=calls)
    if not device:
        print("no device events (CPU): no gaps to show")
        return
    # one call's device operations: split where the device idles longer than any gap inside a call could be
    # (block_until_ready returns to Python between calls), i.e. at the calls - 1 longest gaps
    gaps = [(device[k + 1][0] - device[k][1], k) for k in range(len(device) - 1)]
    cuts = sorted(k for _, k in sorted(gaps, reverse=True)[: calls - 1])
    bounds = [0, *[k + 1 for k in cuts], len(device)]
    found = []
    for c in range(calls):
        ops = device[bounds[c]:bounds[c + 1]]
        span = (ops[-1][1] - ops[0][0]) / 1e3
        busy = sum(e - s for s, e, _ in ops) / 1e3
        inner = [((ops[k + 1][0] - ops[k][1]) / 1e3, ops[k], ops[k + 1]) for k in range(len(ops) - 1)]
        idle = [g for g in inner if g[0] >= min_gap_us]
        print(f"call {c}: {len(ops)} device operations over {span:.1f} µs, busy {busy:.1f} µs; "
              f"{len(idle)} gaps of ≥ {min_gap_us:g} µs, {sum(g for g, _, _ in idle):.1f} µs in all")
        found += idle
    for gap, before, after in sorted(found, key=lambda g: -g[0])[:top]:
        overlapping = [(min(e, after[0]) - max(s, before[1]), name) for s, e, name in host
                       if s < after[0] and e > before[1]]
        busiest = ", ".join(f"{name[:60]} ({o / 1e3:.1f} µs)" for o, name in sorted(overlapping, reverse=True)[:4])
        print(f"  gap {gap:6.1f} µs after `{before[2][:50]}`, before `{after[2][:50]}`; host: {busiest or '—'}")


def chained_rollouts(scene, steps: int, unroll: int, calls: int = 20) -> None:
    """Time rollouts that continue each other (``state = rollout(state)``, the way a simulation is stepped on in
    chunks), with the state donated to XLA and without: a donated state's buffers become the next call's, so
    XLA need not copy the inputs into the loop, and the loop runs over the same buffers every call."""
    from warpnn_models.newton import NewtonStep, rollout

    model, solver, contacts = scene
    step = NewtonStep(model, solver, DT, contacts=contacts, param_fields=("spring_stiffness",))
    params, constants = step.initial_params(), step.constants()
    for donate in (False, True):
        fn = jax.jit(lambda s, p, c: rollout(step, s, None, p, num_steps=steps, constants=c, unroll=unroll)[0],
                     donate_argnums=(0,) if donate else ())
        state = [jax.tree.map(jnp.copy, step.initial_state())]

        def call(fn=fn, state=state):
            state[0] = fn(state[0], params, constants)
            return state[0]

        label = f"warpnn fwd, unroll={unroll}, chained calls, state {'donated' if donate else 'not donated'}"
        print(f"{label}: {time_call(call, reps=calls) / steps * 1e6:.1f} µs per step", flush=True)
        print(f"{label}: where the device idles", flush=True)
        idle_gaps(call)


def profile(particles: int, steps: int, unroll: int, calls: int = 5, direction: str = "fwd") -> dict[str, dict]:
    on_gpu = jax.default_backend() == "gpu"
    device = "cuda:0" if on_gpu else "cpu"
    scene = _scene(particles, device, requires_grad=True)
    _, cases = _warpnn_cases(scene, steps, DT, (unroll,))
    if direction == "fwd+bwd":
        return _device_ops_fwd_bwd(scene, cases, steps, unroll, calls, on_gpu)
    forward, args = cases[f"warpnn fwd{'' if unroll == 1 else f', unroll={unroll}'}"]
    runs = {f"warpnn fwd, unroll={unroll}": lambda: forward(*args)}
    if on_gpu:
        newton_loop = _NewtonRollout(scene, steps, DT, device)
        runs["Newton fwd captured"] = lambda: newton_loop.run("fwd", True)
    report = {}
    for keep in (True, False):
        out = jax.block_until_ready(forward(*args))
        before = sum(_launch.LAUNCHER.handler_entries.values())
        for _ in range(calls):
            if not keep:
                out = None  # the previous result's buffers are free for this call
            out = jax.block_until_ready(forward(*args))
        del out
        entries = (sum(_launch.LAUNCHER.handler_entries.values()) - before) / calls
        print(f"warpnn fwd, unroll={unroll}: {entries:.1f} handler entries per rollout call "
              f"({'previous result alive' if keep else 'previous result dropped'})", flush=True)
    # Back-to-back calls, each result dropped before the next call (time_call): the steady state of a loop
    # that calls one rollout again and again, where XLA finds the same buffers each time.
    for name, fn in runs.items():
        print(f"{name}: {time_call(fn, reps=20) / steps * 1e6:.1f} µs per step, back-to-back calls", flush=True)
    for name, fn in runs.items():
        print(f"\n{name}: where the device idles", flush=True)
        idle_gaps(fn)
    chained_rollouts(scene, steps, unroll)
    for name, fn in runs.items():
        report[name] = _traced_step(fn, calls, steps)
    return report


def _traced_step(fn, calls: int, steps: int) -> dict:
    """Wall time and device operations per rollout step of ``calls`` traced calls of ``fn``."""
    _, events, wall = trace_events(fn, calls=calls)
    ops = _per_step(events, calls, steps)
    return {"wall_us": wall / calls / steps * 1e6, "device_us": sum(us for _, us in ops.values()),
            "device_ops": sum(n for n, _ in ops.values()), "ops": ops}


def _device_ops_fwd_bwd(scene, cases, steps: int, unroll: int, calls: int, on_gpu: bool) -> dict[str, dict]:
    """Per rollout step of the gradient: wall time back to back, and the device operations of a traced call."""
    grad, args = cases[f"warpnn fwd+bwd{'' if unroll == 1 else f', unroll={unroll}'}"]
    runs = {f"warpnn fwd+bwd, unroll={unroll}": lambda: grad(*args)}
    if on_gpu:
        newton_loop = _NewtonRollout(scene, steps, DT, "cuda:0")
        runs["Newton fwd+bwd captured"] = lambda: newton_loop.run("fwd+bwd", True)
    report = {}
    for name, fn in runs.items():
        print(f"{name}: {time_call(fn, reps=20) / steps * 1e6:.1f} µs per step, back-to-back calls", flush=True)
        report[name] = _traced_step(fn, calls, steps)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--particles", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--unroll", type=int, default=10)
    parser.add_argument("--direction", choices=("fwd", "fwd+bwd"), default="fwd")
    args = parser.parse_args(argv)
    for name, r in profile(args.particles, args.steps, args.unroll, direction=args.direction).items():
        print(f"\n## {name}: wall {r['wall_us']:.1f} µs per step, device {r['device_us']:.1f} µs in "
              f"{r['device_ops']:.1f} operations (the profiler's own overhead is in the wall time)")
        print("| device operation | per step | µs per step |\n|---|---|---|")
        for op, (count, us) in r["ops"].items():
            print(f"| `{op[:90]}` | {count:.2f} | {us:.2f} |")


if __name__ == "__main__":
    main()
