"""Bridge overhead: warpnn.jax_kernel vs Warp's own wp.jax_kernel vs pure JAX, one trivial kernel.

Cases: a single jitted call (fwd, fwd+bwd), a ``lax.scan`` step (fwd, fwd+bwd, 200 steps per call) of the
kernel on the carry, and a fwd+bwd scan step of the kernel on ``xs[t]`` whose results are stacked into ``ys``.
Also counts how often warpnn's handlers were entered per scan step: ~0 means XLA replays a CUDA graph,
1 (fwd) or 2 (fwd+bwd) means every step calls back into the handler.

    python -m benchmarks bridge            # this process's XLA_FLAGS
    python -m benchmarks                    # everything, default flags and --xla_gpu_graph_min_graph_size=1
"""


import json
import sys

import jax
import jax.numpy as jnp
import warp as wp

import warpnn
from warpnn import _launch

from .common import environment, fmt_ratio, fmt_us, time_interleaved

wp.config.quiet = True
N = 4096
SCAN_STEPS = 200


@wp.kernel
def affine(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = 0.999 * x[i] + 0.001 * x[i] * x[i]


def pure_jax(x):
    return 0.999 * x + 0.001 * x * x


def _variants():
    ours = warpnn.jax_kernel(affine)
    theirs_fwd = wp.jax_kernel(affine)
    theirs_diff = wp.jax_kernel(affine, enable_backward=True)
    return {
        "warpnn": (lambda x: ours(x)[0], lambda x: ours(x)[0]),
        "wp.jax_kernel": (lambda x: theirs_fwd(x)[0], lambda x: theirs_diff(x)[0]),
        "pure JAX": (pure_jax, pure_jax),
    }


def _scan(step, unroll: int = 1):
    def run(x):
        y, _ = jax.lax.scan(lambda c, _: (step(c), None), x, None, length=SCAN_STEPS, unroll=unroll)
        return y

    return run


def _scan_grad(step):
    """Gradient of the sum of a SCAN_STEPS-step scan of ``step``: the fwd+bwd scan case."""
    return jax.grad(lambda x: _scan(step)(x).sum())


def _trajectory_grad(step):
    """Gradient of a scan that applies ``step`` to each ``xs[t]`` and stacks the results into ``ys``.

    The kernel reads a slice of a stacked buffer and writes into another, in both directions: the pattern
    for which XLA's GPU compiler would compute slice addresses on the host every step (see _bridge._fence).
    """

    def loss(c, xs):
        c, ys = jax.lax.scan(lambda c, x: (lambda y: (c + y, y))(step(x)), c, xs)
        return c.sum() + jnp.vdot(ys, ys)  # nonlinear in ys: the forward calls are needed, not dead code

    return jax.grad(loss, argnums=(0, 1))


def measure() -> list[dict]:
    x = jnp.linspace(0.0, 1.0, N, dtype=jnp.float32)
    xs = jnp.tile(x, (SCAN_STEPS, 1)) * 0.01
    cases = {}
    for name, (fwd, diff) in _variants().items():
        cases[("call fwd", name)] = (jax.jit(fwd), (x,), 1)
        cases[("call fwd+bwd", name)] = (jax.jit(jax.grad(lambda x, diff=diff: diff(x).sum())), (x,), 1)
        cases[("scan step fwd", name)] = (jax.jit(_scan(fwd)), (x,), SCAN_STEPS)
        cases[("scan step fwd+bwd", name)] = (jax.jit(_scan_grad(diff)), (x,), SCAN_STEPS)
        cases[("scan xs→ys step fwd+bwd", name)] = (jax.jit(_trajectory_grad(diff)), (x, xs), SCAN_STEPS)
    # All implementations timed in alternating rounds: their ratios are the point of this table.
    times = time_interleaved({key: (fn, args) for key, (fn, args, _) in cases.items()})
    rows = []
    for (case, name), (fn, args, per) in cases.items():
        t = times[(case, name)]
        if isinstance(t, Exception):  # a variant that cannot run the case is reported, not fatal
            rows.append({"case": case, "impl": name, "seconds": None, "error": f"{type(t).__name__}: {t}"[:200]})
            continue
        entries = None
        if name == "warpnn":
            before = sum(_launch.LAUNCHER.handler_entries.values())
            for _ in range(10):
                jax.block_until_ready(fn(*args))
            entries = (sum(_launch.LAUNCHER.handler_entries.values()) - before) / (10 * per)
        rows.append({"case": case, "impl": name, "seconds": t / per, "handler_entries_per_step": entries})
    return rows


def table(rows: list[dict]) -> str:
    by = {(r["case"], r["impl"]): r for r in rows}
    lines = [
        "| case | warpnn µs | wp.jax_kernel µs | pure JAX µs | warpnn / pure JAX | warpnn / wp.jax_kernel | warpnn handler entries per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        ours, theirs, ref = (by.get((case, k), {}).get("seconds") for k in ("warpnn", "wp.jax_kernel", "pure JAX"))
        entries = by.get((case, "warpnn"), {}).get("handler_entries_per_step")
        lines.append(
            f"| {case} | {fmt_us(ours)} | {fmt_us(theirs)} | {fmt_us(ref)} | {fmt_ratio(ours, ref)} | "
            f"{fmt_ratio(ours, theirs)} | {'—' if entries is None else f'{entries:.3f}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    result = {"environment": environment(), "bridge": measure()}
    print(table(result["bridge"]), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
