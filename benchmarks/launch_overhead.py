"""Per-call overhead of warpnn's launchers: one jitted call of a trivial elementwise kernel.

Compares the native launcher, the Python launcher and the same computation in pure JAX (the difference
to pure JAX is what a Warp call costs beyond the work itself). Runnable from the repository root::

    python -m benchmarks launch_overhead [--n 1024] [--reps 200] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

from warpnn import _launch
from warpnn._bridge import jax_kernel


@wp.kernel
def _affine(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = 0.999 * x[i] + 0.001 * x[i] * x[i]


CHAIN = 50


def _pure(x):
    return 0.999 * x + 0.001 * x * x


def measure(
    n: int = 1024, reps: int = 200, rounds: int = 30, launchers: tuple[str, ...] = ("native", "python")
) -> dict[str, float | str]:
    """Seconds per jitted call (forward, and forward+backward) for each launcher and for pure JAX.

    ``chain50`` cases run 50 dependent calls in one executable and report time per call: for a launcher, the
    marginal cost of one Warp call with no dispatch (pure JAX fuses its chain, so its number is not comparable).

    Every variant is compiled ahead of time (so switching launchers does not retrace), warmed up, then timed
    in interleaved rounds of ``reps`` blocking calls; the result is the median over rounds, which keeps a
    noisy, shared machine from biasing one variant. Keys: ``"<impl> fwd"`` and ``"<impl> fwd+bwd"`` for
    ``impl`` in ``jax`` and each available launcher; ``"<launcher> error"`` for one that is unavailable.
    """
    x = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)
    f = jax_kernel(_affine)

    def chain(fn):  # CHAIN dependent calls in one executable: the marginal cost of a call, without dispatch
        def run(x):
            for _ in range(CHAIN):
                x = fn(x)
            return x

        return run

    def variants(fn):
        return {"fwd": fn, "fwd+bwd": jax.grad(lambda x: jnp.sum(fn(x))), f"chain{CHAIN}": chain(fn)}

    compiled: dict[str, Any] = {}
    for case, fn in variants(_pure).items():
        compiled[f"jax {case}"] = jax.jit(fn).lower(x).compile()
    errors: dict[str, str] = {}
    for launcher in launchers:
        try:
            with _launch.use_launcher(launcher):
                for case, fn in variants(lambda x: f(x)[0]).items():
                    compiled[f"{launcher} {case}"] = jax.jit(fn).lower(x).compile()
        except RuntimeError as e:  # e.g. the native launcher is unavailable here
            errors[f"{launcher} error"] = str(e)

    for fn in compiled.values():
        for _ in range(max(20, reps)):
            jax.block_until_ready(fn(x))
    samples: dict[str, list[float]] = {k: [] for k in compiled}
    for _ in range(rounds):
        for name, fn in compiled.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                jax.block_until_ready(fn(x))
            samples[name].append((time.perf_counter() - t0) / reps)
    medians = {k: float(np.median(v)) for k, v in samples.items()}
    for name in list(medians):
        if name.endswith(f"chain{CHAIN}"):  # report per call
            medians[name] /= CHAIN
    return {**medians, **errors}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks launch_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=200, help="calls per timed round")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds (median reported)")
    args = parser.parse_args(argv)
    wp.config.log_level = wp.LOG_WARNING  # Warp 1.19: no banner or module-load lines
    results = measure(args.n, args.reps, args.rounds)
    rows = {k: v for k, v in results.items() if isinstance(v, float)}
    for case in ("fwd", "fwd+bwd", f"chain{CHAIN}"):
        ref = rows.get(f"jax {case}")
        for name in ("jax", "native", "python"):
            t = rows.get(f"{name} {case}")
            if t is not None:
                comparable = name != "jax" and ref is not None and not case.startswith("chain")
                extra = f"  ({(t - ref) * 1e6:+.1f} µs vs pure JAX)" if comparable else ""
                print(f"{case:8s} {name:7s} {t * 1e6:8.1f} µs{extra}")
    print(json.dumps({"backend": jax.default_backend(), "n": args.n, **results}))


if __name__ == "__main__":
    main()
