"""Where a CPU step of the heat-stencil scans goes: the native handler's phases against the step's wall time.

For each direction (``fwd``: the 50-step scan; ``bwd``: a scan of the step's VJP alone; ``fwd+bwd``: the gradient;
with ``--springs``, also the threads table's spring-force scatter, one call = one step) and each thread count, ``--calls`` calls of the compiled scan, then per step (µs): wall time, time in warpnn's CPU
handlers (per handler call: zeroing results, the split launch with the caller's wait for its slices, summing
partial buffers, the rest: argument set-up), and the step's time outside the handlers (XLA's own work: copies,
residual stacking, the loop). Pure JAX's step is timed alongside. Counters from the native library's
``WARPNN_CPU_PROFILE`` (set here before warpnn loads).

``--ab 1:8192,8:8192,1:4096:xla`` instead times the same cases on ``--threads`` threads under each setting of the
split (slices per worker : elements per worker below which a launch is not split [: whose threads], i.e.
``WARPNN_CPU_SLICES_PER_THREAD``, ``WARPNN_CPU_MIN_WORK`` and ``WARPNN_CPU_POOL``), in alternating rounds of one
process with pure JAX, µs per step (medians).

    JAX_PLATFORMS=cpu python -m benchmarks.profile_cpu_heat [--size 256] [--threads 1,2,16] [--calls 40]
    JAX_PLATFORMS=cpu python -m benchmarks.profile_cpu_heat --threads 16 --ab 1:8192,8:8192 [--springs 200]
"""

from __future__ import annotations

import os

os.environ.setdefault("WARPNN_CPU_PROFILE", "1")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from warpnn._launch import LAUNCHER  # noqa: E402

from warpnn.kernels import cloth  # noqa: E402

from .common import environment, time_interleaved  # noqa: E402
from .heat import _jax_step, _Threads, _warp_step, all_threads, backward_scan, scan_fns  # noqa: E402
from .models import spring_problem  # noqa: E402


def _per_step(fn, args, calls: int, steps: int) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls / steps * 1e6


def _springs_cases(cloth_n: int) -> dict:
    """The threads table's spring-force scatter (material as arguments), fwd and fwd+bwd; no pure-JAX twin."""
    px, pv, springs, k, d, r, w = spring_problem(cloth_n)

    def forces(x, v, k, d, r):
        return cloth.spring_forces(x, v, springs, k, d, r)

    grad = jax.grad(lambda x, v, k, d, r: jnp.vdot(w, forces(x, v, k, d, r)), argnums=(0, 1))
    return {f"springs {springs.shape[0]} fwd": (forces, None, (px, pv, k, d, r), 1),
            f"springs {springs.shape[0]} fwd+bwd": (grad, None, (px, pv, k, d, r), 1)}


def _cases(size: int, steps: int, springs: int) -> dict:
    u = jax.random.normal(jax.random.PRNGKey(size), (size, size))
    alpha = jnp.array([0.5])
    weights = jax.random.normal(jax.random.PRNGKey(1), (size, size))
    ours_fwd, ours_grad = scan_fns(_warp_step, steps, weights)
    ref_fwd, ref_grad = scan_fns(_jax_step, steps, weights)
    cases = {"fwd": (ours_fwd, ref_fwd, (u, alpha), steps), "fwd+bwd": (ours_grad, ref_grad, (alpha, u), steps),
             "bwd": (backward_scan(_warp_step, steps), backward_scan(_jax_step, steps), (u, alpha, weights), steps)}
    if springs:
        cases.update(_springs_cases(springs))
    return cases


class _Split:
    """A compiled call run under one split setting (slices per worker, minimum elements per worker, whose pool):
    set before each call, as the pool's settings are global and read at every launch."""

    def __init__(self, call: _Threads, slices: int, min_work: int, pool: str):
        self.call, self.slices, self.min_work, self.pool = call, slices, min_work, pool

    def apply(self) -> None:
        twins = LAUNCHER.impl.twins
        twins.set_cpu_threads(self.call.threads, self.min_work)
        twins.set_cpu_slices_per_worker(self.slices)
        twins.set_cpu_pool(self.pool)

    def __call__(self, *args):
        self.apply()
        return self.call.compiled(*args)


def parse_settings(text: str) -> list[tuple[int, int, str]]:
    """``K:W[:pool],...`` -> [(slices per worker, min work, pool)] (pool ``warpnn`` unless given)."""
    settings = []
    for item in text.split(","):
        k, w, *pool = item.split(":")
        settings.append((int(k), int(w), pool[0] if pool else "warpnn"))
    return settings


def ab(size: int, threads: int, settings, steps: int, springs: int = 0) -> list[dict]:
    rows, splits = [], []
    for direction, (ours, ref, args, n_steps) in _cases(size, steps, springs).items():
        call = _Threads(ours, args, threads)
        splits = [_Split(call, *setting) for setting in settings]
        cases = {":".join(map(str, setting)): (split, args) for setting, split in zip(settings, splits)}
        if ref is not None:
            cases["pure JAX"] = (jax.jit(ref).lower(*args).compile(), args)
        times = time_interleaved(cases, rounds=10, per_round=3)
        rows.append({"direction": direction, **{k: t / n_steps * 1e6 for k, t in times.items()}})
        print(rows[-1], flush=True)
    splits[0].apply()  # leave the first setting in force
    return rows


def profile(size: int, thread_counts, calls: int, steps: int, springs: int = 0) -> list[dict]:
    twins = LAUNCHER.impl.twins
    rows = []
    for direction, (ours, ref, args, n_steps) in _cases(size, steps, springs).items():
        pure = jax.jit(ref).lower(*args).compile() if ref is not None else None
        for threads in thread_counts:
            call = _Threads(ours, args, threads)
            jax.block_until_ready(call(*args))
            twins.cpu_profile()  # zero the counters
            step = _per_step(call, args, calls, n_steps)
            prof = twins.cpu_profile()
            per = max(prof["calls"], 1)
            handler = prof["handler_ns"] / per / 1e3
            parts = {k: prof[f"{k}_ns"] / per / 1e3 for k in ("zero", "launch", "reduce")}
            handler_per_step = prof["handler_ns"] / 1e3 / (calls + 1) / n_steps
            rows.append({"direction": direction, "threads": threads, "step_us": step,
                         "pure_jax_step_us": _per_step(pure, args, calls, n_steps) if pure else float("nan"),
                         "handler_calls_per_step": prof["calls"] / (calls + 1) / n_steps,
                         "handler_us": handler, **{f"{k}_us": v for k, v in parts.items()},
                         "setup_us": handler - sum(parts.values()),
                         # slices' kernel time over the launch's: how many threads were busy on average
                         "busy_threads": prof["slice_ns"] / max(prof["launch_ns"], 1),
                         "slice_us": prof["slice_ns"] / max(prof["slices"], 1) / 1e3,
                         "outside_handlers_us_per_step": step - handler_per_step})
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all)")
    parser.add_argument("--ab", default=None, metavar="K:W[:POOL],...",
                        help="split settings to compare (slices per worker : min elements per worker [: warpnn|xla])")
    parser.add_argument("--springs", type=int, default=0, metavar="N",
                        help="also the spring-force scatter on an NxN cloth (the threads table's is 282)")
    args = parser.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, all_threads()})
    if args.ab:
        settings = parse_settings(args.ab)
        rows = ab(args.size, counts[-1], settings, args.steps, args.springs)
        names = [k for k in rows[0] if k != "direction"]
        print(f"\nEnvironment: {environment()}\n\n{counts[-1]} threads, µs per step (slices per worker : min work)\n")
        print("| case | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for r in rows:
            print(f"| {r['direction']} | " + " | ".join(f"{r[n]:.1f}" if n in r else "" for n in names) + " |")
        return
    rows = profile(args.size, counts, args.calls, args.steps, args.springs)
    print(f"\nEnvironment: {environment()}\n")
    cols = ["step_us", "pure_jax_step_us", "handler_us", "zero_us", "launch_us", "reduce_us", "setup_us", "busy_threads", "slice_us",
            "outside_handlers_us_per_step"]
    print("| direction | threads | " + " | ".join(c.replace("_", " ") for c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['direction']} | {r['threads']} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
