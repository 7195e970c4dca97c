"""When does XLA replay warpnn's Warp calls from a CUDA graph, and when does it call the handler?

Counts handler entries (Python handler executions) per executed Warp call over many jitted calls:
0 means every launch came from a replayed CUDA graph; 1 means XLA called back every time.

    python -m benchmarks graph_capture          # run under the current XLA_FLAGS
"""

import json
import sys

import jax
import jax.numpy as jnp
import warp as wp

import warpnn
from warpnn import _launch

from .bridge import affine

wp.config.quiet = True
CALLS = 200
STEPS = 50


def cases():
    f = warpnn.jax_kernel(affine)
    one = lambda x: f(x)[0]  # noqa: E731

    def chain(x):
        for _ in range(8):
            x = one(x) * 1.0001
        return x

    def scan(x):
        return jax.lax.scan(lambda c, _: (one(c), None), x, None, length=STEPS)[0]

    # (name, jitted function, Warp launches per call)
    return [
        ("single call fwd", jax.jit(one), 1),
        ("chain of 8 calls fwd", jax.jit(chain), 8),
        ("single call fwd+bwd", jax.jit(jax.grad(lambda x: one(x).sum())), 2),
        (f"lax.scan fwd ({STEPS} steps)", jax.jit(scan), STEPS),
        (f"lax.scan fwd+bwd ({STEPS} steps)", jax.jit(jax.grad(lambda x: scan(x).sum())), 2 * STEPS),
    ]


def measure() -> list[dict]:
    x = jnp.linspace(0.0, 1.0, 4096, dtype=jnp.float32)
    rows = []
    for name, fn, launches in cases():
        jax.block_until_ready(fn(x))  # compile (and, when XLA captures, record the graph)
        jax.block_until_ready(fn(x))
        before = sum(_launch.LAUNCHER.handler_entries.values())
        for _ in range(CALLS):
            out = fn(x)
        jax.block_until_ready(out)
        entries = sum(_launch.LAUNCHER.handler_entries.values()) - before
        rows.append({"case": name, "entries_per_1000_launches": 1000.0 * entries / (CALLS * launches)})
    return rows


def main() -> None:
    rows = measure()
    for r in rows:
        print(f"{r['case']:32s} handler entries per 1000 Warp launches: {r['entries_per_1000_launches']:.1f}", file=sys.stderr)
    print(json.dumps({"xla_flags": __import__("os").environ.get("XLA_FLAGS", ""), "graph_capture": rows}))


if __name__ == "__main__":
    main()
