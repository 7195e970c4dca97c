"""A 2-D periodic heat-diffusion stencil in a 50-step ``lax.scan``: one Warp kernel vs ``jnp.roll`` in pure JAX,
and the CPU-threads scaling of warpnn's CPU launches.

``out[i, j] = u[i, j] + alpha[0] * c * laplacian(u)[i, j]`` with neighbours wrapped by branches (no modulo).
fwd: the scan; fwd+bwd: the gradient of a weighted sum of the final field w.r.t. ``alpha``; bwd: a scan of the
step's VJP alone (the adjoint launches of fwd+bwd without its forward and residuals). Implementations in
alternating rounds of one process: warpnn with every CPU thread (``WARPNN_CPU_THREADS``, default the CPUs this
process may use), warpnn on one thread (the kernel's own module, as before threading), pure JAX.

``--opt-levels`` times the stencil kernel alone (``wp.launch``, recorded commands, one thread) built at Warp's
default ``-O2``, at ``-O3`` and at ``-O3 -march=native``, in alternating rounds: where a CPU element-step goes.

``--threads-table`` adds the scaling table (1, 2, all threads) for the stencil and two large kernels: an
elementwise one (race-free: slices write their own rows) and a spring-forces scatter (slices accumulate
into per-thread partial buffers, summed after the launch).

``--scan-launches`` times a 50-step scan of the elementwise kernel (16k, 64k, 256k elements) on 1 thread and on all:
back-to-back launches, whose hand-over to the pool's workers ``WARPNN_CPU_SPIN_US`` governs.

    python -m benchmarks heat [--sizes 64,256] [--steps 50] [--threads-table [--thread-counts 1,4,16]] [--scan-launches] [--opt-levels] [--json]

``WARPNN_CPU_ROW_WINDOWS=0`` in the environment runs the scatters with whole partial buffers (no row windows).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import warp as wp

import warpnn
from warpnn import _batched, _spread
from warpnn._launch import LAUNCHER
from warpnn.kernels import cloth

# The stencil and its pure-JAX twin are the test suite's (tests/test_batched.py checks the threaded launches
# with them): one definition, benchmarked here as it is tested there. Run from the repository root.
from tests.kernels_for_tests import heat_step, heat_step_ref

from .common import environment, fmt_ratio, fmt_us, time_interleaved
from .models import spring_problem

wp.config.quiet = True
C = 0.2


@wp.kernel
def saxpy_like(x: wp.array(dtype=float), a: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = a[0] * x[i] + wp.sin(x[i])


_HEAT = warpnn.jax_kernel(heat_step)
_SAXPY = warpnn.jax_kernel(saxpy_like)


def _warp_step(u, alpha):
    return _HEAT(u, alpha, C)[0]


def _jax_step(u, alpha):
    return heat_step_ref(u, alpha, C)


def scan_fns(step, steps: int, weights):
    def fwd(u, alpha):
        out, _ = jax.lax.scan(lambda c, _: (step(c, alpha), None), u, None, length=steps)
        return out

    def loss(alpha, u):
        return jnp.vdot(weights, fwd(u, alpha))

    return fwd, jax.grad(loss)


def backward_scan(step, steps: int):
    """``steps`` applications of ``step``'s VJP at one point, the cotangents carried: the backward pass alone."""

    def bwd(u, alpha, cotangent):
        _, vjp = jax.vjp(step, u, alpha)

        def body(carry, _):
            grad_u, grad_alpha = vjp(carry[0])
            return (grad_u, carry[1] + grad_alpha), None

        return jax.lax.scan(body, (cotangent, jnp.zeros_like(alpha)), None, length=steps)[0]

    return bwd


class _Threads:
    """A compiled call that runs with ``threads`` CPU launch threads (set before each call: the pool is global)."""

    def __init__(self, fn, args, threads: int):
        self.threads = threads
        self._set(threads)
        # The twin decision is made while lowering, and JAX reuses a function's lowering: without clearing its
        # caches every thread count would run the first one's program (a 1-thread program never splits).
        jax.clear_caches()
        self.compiled = jax.jit(fn).lower(*args).compile()

    @staticmethod
    def _set(threads: int):
        twins = getattr(LAUNCHER.impl, "twins", None)
        if twins is not None:
            twins.set_cpu_threads(threads)

    def __call__(self, *args):
        self._set(self.threads)
        return self.compiled(*args)


def all_threads() -> int:
    return _batched.cpu_thread_config()[0]


def bench_heat(sizes, steps: int) -> list[dict]:
    rows = []
    full = all_threads()
    for n in sizes:
        u = jax.random.normal(jax.random.PRNGKey(n), (n, n))
        alpha = jnp.array([0.5])
        weights = jax.random.normal(jax.random.PRNGKey(1), (n, n))
        ours_fwd, ours_grad = scan_fns(_warp_step, steps, weights)
        ref_fwd, ref_grad = scan_fns(_jax_step, steps, weights)
        directions = (("fwd", ours_fwd, ref_fwd, (u, alpha)), ("fwd+bwd", ours_grad, ref_grad, (alpha, u)),
                      ("bwd", backward_scan(_warp_step, steps), backward_scan(_jax_step, steps), (u, alpha, weights)))
        for direction, ours, ref, args in directions:
            cases = {f"warpnn {full} threads": (_Threads(ours, args, full), args)}
            if full > 1 and jax.default_backend() == "cpu":
                cases["warpnn 1 thread"] = (_Threads(ours, args, 1), args)
            if jax.default_backend() != "cpu":
                with _spread.override(False):  # Warp's own adjoint: every thread adds into alpha[0]
                    cases["warpnn, adjoint not spread"] = (_Threads(ours, args, full), args)
            cases["pure JAX"] = (jax.jit(ref).lower(*args).compile(), args)
            times = time_interleaved(cases, rounds=8, per_round=3)
            _Threads._set(full)
            rows.append({"size": n, "direction": direction, "steps": steps,
                         **{name: (t if isinstance(t, float) else None) for name, t in times.items()}})
            print(f"{n}^2 {direction}: " + "  ".join(f"{k}: {fmt_us(v if isinstance(v, float) else None)} µs" for k, v in times.items()),
                  file=sys.stderr, flush=True)
    return rows


def bench_threads(n_elementwise: int, cloth_n: int, heat_n: int, counts=None) -> list[dict]:
    full = all_threads()
    counts = sorted(set(counts or (1, 2, full)))
    x = jax.random.normal(jax.random.PRNGKey(0), (n_elementwise,))
    a = jnp.array([0.3])
    px, pv, springs, k, d, r, w = spring_problem(cloth_n)
    u = jax.random.normal(jax.random.PRNGKey(2), (heat_n, heat_n))
    alpha = jnp.array([0.5])
    kernels = {
        f"elementwise, {n_elementwise} elements, fwd": (lambda x, a: _SAXPY(x, a)[0], (x, a)),
        # The springs' material goes in as arguments: closed over, XLA would rebuild its three 158,802-element
        # broadcasts on every call (1.9 MB written outside the kernel, a third of the 16-thread call's time).
        f"springs scatter, {springs.shape[0]} springs, fwd": (
            lambda x, v, k, d, r: cloth.spring_forces(x, v, springs, k, d, r), (px, pv, k, d, r)),
        f"springs scatter, {springs.shape[0]} springs, fwd+bwd": (
            jax.grad(lambda x, v, k, d, r: jnp.vdot(w, cloth.spring_forces(x, v, springs, k, d, r)), argnums=(0, 1)),
            (px, pv, k, d, r)),
        f"heat step {heat_n}^2, fwd": (_warp_step, (u, alpha)),
        f"heat step {heat_n}^2, fwd+bwd": (jax.grad(lambda alpha, u: jnp.sum(_warp_step(u, alpha) ** 2)), (alpha, u)),
    }
    rows = []
    for name, (fn, args) in kernels.items():
        cases = {t: (_Threads(fn, args, t), args) for t in counts}
        times = time_interleaved(cases, rounds=8, per_round=3)
        _Threads._set(full)
        rows.append({"kernel": name, **{f"{t} threads": times[t] for t in counts}})
        print(name, {t: fmt_us(times[t]) for t in counts}, file=sys.stderr, flush=True)
    return rows


def bench_scan_launches(sizes=(16384, 65536, 262144), steps: int = 50) -> list[dict]:
    """µs per step of a ``steps``-step ``lax.scan`` of the elementwise kernel, 1 thread against all: back-to-back
    launches, where handing each one over to the pool's workers costs what waking them costs
    (``WARPNN_CPU_SPIN_US``: how long they poll before they sleep)."""
    full = all_threads()
    a = jnp.array([0.3])
    rows = []
    for n in sizes:
        x = jax.random.normal(jax.random.PRNGKey(0), (n,))

        def scan(x, a):
            return jax.lax.scan(lambda c, _: (_SAXPY(c, a)[0], None), x, None, length=steps)[0]

        cases = {t: (_Threads(scan, (x, a), t), (x, a)) for t in sorted({1, full})}
        times = time_interleaved(cases, rounds=8, per_round=3)
        _Threads._set(full)
        rows.append({"kernel": f"elementwise scan, {n} elements, µs per step",
                     **{f"{t} threads": times[t] / steps for t in sorted({1, full})}})
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def bench_opt_levels(sizes) -> list[dict]:
    import inspect
    import textwrap
    import time

    import numpy as np

    source = textwrap.dedent(inspect.getsource(heat_step.func)).split("\n", 1)[1]  # without the decorator
    variants = {"-O2 (default)": (2, ""), "-O3": (3, ""), "-O3 -march=native": (3, "-march=native")}
    kernels = {}
    for k, (name, (level, flags)) in enumerate(variants.items()):
        module = wp.get_module(f"benchmarks_heat_opt_{k}")
        module.options["optimization_level"] = level
        if flags:
            module.options["cpu_compiler_flags"] = flags
        kernels[name] = wp.Kernel(heat_step.func, key=f"heat_step_opt_{k}", module=module, source=source)
    rows = []
    for n in sizes:
        u = wp.array(np.random.default_rng(0).random((n, n), dtype=np.float32), device="cpu")
        a = wp.array([0.1], dtype=float, device="cpu")
        cmds = {}
        for name, kernel in kernels.items():
            out = wp.zeros((n, n), dtype=float, device="cpu")
            cmds[name] = wp.launch(kernel, (n, n), inputs=[u, a, C, out], device="cpu", record_cmd=True)
            cmds[name].launch()
        reps = max(3, (1 << 22) // (n * n))
        samples = {name: [] for name in kernels}
        for _ in range(7):
            for name, cmd in cmds.items():
                t0 = time.perf_counter()
                for _ in range(reps):
                    cmd.launch()
                samples[name].append((time.perf_counter() - t0) / reps / (n * n))
        rows.append({"size": n, **{name: float(np.median(v)) for name, v in samples.items()}})
        print(n, {k: f"{v * 1e9:.2f} ns" for k, v in rows[-1].items() if k != "size"}, file=sys.stderr, flush=True)
    return rows


def opt_table(rows) -> str:
    names = [k for k in rows[0] if k != "size"]
    lines = ["| size | " + " | ".join(f"{n} (ns per element)" for n in names) + " |", "|---|" + "---|" * len(names)]
    for row in rows:
        lines.append(f"| {row['size']}² | " + " | ".join(f"{row[n] * 1e9:.2f}" for n in names) + " |")
    return "\n".join(lines)


def heat_table(rows) -> str:
    names = [k for k in rows[0] if k not in ("size", "direction", "steps")]
    lines = ["| size | direction | " + " | ".join(f"{n} (ms)" for n in names) + " | " +
             " | ".join(f"{n} / pure JAX" for n in names if n != "pure JAX") + " |",
             "|---|---|" + "---|" * (2 * len(names) - 1)]
    for row in rows:
        ms = [("—" if row[n] is None else f"{row[n] * 1e3:.2f}") for n in names]
        ratios = [fmt_ratio(row[n], row["pure JAX"]) for n in names if n != "pure JAX"]
        lines.append(f"| {row['size']}² | {row['direction']} | " + " | ".join(ms) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def threads_table(rows) -> str:
    counts = [k for k in rows[0] if k != "kernel"]
    lines = ["| kernel | " + " | ".join(f"{c} (µs)" for c in counts) + f" | speed-up at {counts[-1]} |",
             "|---|" + "---|" * (len(counts) + 1)]
    for row in rows:
        lines.append(f"| {row['kernel']} | " + " | ".join(fmt_us(row[c]) for c in counts) + f" | {fmt_ratio(row[counts[0]], row[counts[-1]])} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads-table", action="store_true")
    parser.add_argument("--thread-counts", default=None, help="for --threads-table, e.g. 1,4,8,16 (default 1, 2, all)")
    parser.add_argument("--opt-levels", action="store_true")
    parser.add_argument("--scan-launches", action="store_true",
                        help="a 50-step scan of the elementwise kernel at 16k, 64k, 256k elements, 1 thread vs all")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]  # --sizes "": the other tables only
    opt = bench_opt_levels(sizes) if args.opt_levels else None
    heat = bench_heat(sizes, args.steps)
    counts = [int(c) for c in args.thread_counts.split(",")] if args.thread_counts else None
    threads = bench_threads(1 << 22, 200, 1024, counts) if args.threads_table else None
    launches = bench_scan_launches(steps=args.steps) if args.scan_launches else None
    if args.json:
        print(json.dumps({"environment": environment(), "heat": heat, "threads": threads, "opt_levels": opt,
                          "scan_launches": launches}))
        return
    print(f"Environment: {environment()}\n")
    if heat:
        print(heat_table(heat))
    if threads:
        print()
        print(threads_table(threads))
    if launches:
        print()
        print(threads_table(launches))
    if opt:
        print()
        print(opt_table(opt))


if __name__ == "__main__":
    main()
