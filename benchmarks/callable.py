"""warpnn.jax_callable against Warp run directly, on a three-kernel spring function.

The function gathers spring tensions into an intermediate, scatters them into forces and reads the forces
back into an energy. Timed per iteration, interleaved: Warp's forward alone and forward + ``wp.Tape``
backward on preallocated arrays (the cotangents given as ``tape.backward(grads=...)``), against a jitted
``warpnn.jax_callable`` forward and ``jax.value_and_grad`` of a loss over both outputs::

    python -m benchmarks callable [--small]
"""

from __future__ import annotations

import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

import warpnn
from tests.kernels_for_tests import springs_function

from .common import environment, fmt_ratio, fmt_us, time_interleaved


# The spring function and its kernels are the test suite's (tests/test_callable.py checks it in float64):
# one definition, timed here in float32. Run from the repository root.
springs = springs_function(wp.float32)


def _problem(n: int):
    rng = np.random.default_rng(0)
    pairs = np.stack([np.arange(n - 1), np.arange(1, n)], axis=1).astype(np.int32)
    pairs = np.concatenate([pairs, rng.integers(0, n, size=(n, 2), dtype=np.int32)])
    x = np.cumsum(rng.uniform(0.5, 1.5, n)).astype(np.float32) / n
    k = rng.uniform(0.5, 2.0, len(pairs)).astype(np.float32)
    wf, we = rng.normal(size=n).astype(np.float32), rng.normal(size=1).astype(np.float32)
    return x, k, pairs, wf, we


def cases(n: int) -> dict:
    x, k, pairs, wf, we = _problem(n)
    device = wp.device_from_jax(jax.devices()[0])
    xw, kw = (wp.array(a, device=device, requires_grad=True) for a in (x, k))
    pw = wp.array(pairs, dtype=wp.int32, device=device)
    fw = wp.zeros(n, dtype=float, device=device, requires_grad=True)
    ew = wp.zeros(1, dtype=float, device=device, requires_grad=True)
    seeds = {fw: wp.array(wf, device=device), ew: wp.array(we, device=device)}

    def warp_forward():
        springs(xw, kw, pw, 0.01, fw, ew)
        wp.synchronize_device(device)

    def warp_tape():
        xw.grad.zero_()
        kw.grad.zero_()
        tape = wp.Tape()
        with tape:
            springs(xw, kw, pw, 0.01, fw, ew)
        tape.backward(grads=seeds)
        wp.synchronize_device(device)

    call = functools.partial(warpnn.jax_callable(springs, num_outputs=2), output_dims={"f": n, "e": 1})
    pj, wfj, wej = jnp.asarray(pairs), jnp.asarray(wf), jnp.asarray(we)

    def loss(x, k):
        f, e = call(x, k, pj, 0.01)
        return jnp.dot(wfj, f) + jnp.dot(wej, e)

    forward = jax.jit(lambda x, k: call(x, k, pj, 0.01))
    value_and_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    xj, kj = jnp.asarray(x), jnp.asarray(k)
    return {
        "warp fwd": (warp_forward, ()),
        "warp fwd + wp.Tape bwd": (warp_tape, ()),
        "warpnn.jax_callable fwd": (forward, (xj, kj)),
        "warpnn.jax_callable fwd+bwd": (value_and_grad, (xj, kj)),
    }


def table(rows: list[dict]) -> str:
    """The markdown table of ``main``'s rows (µs per iteration)."""
    lines = ["| particles | springs | Warp fwd | warpnn fwd | Warp fwd + wp.Tape bwd | warpnn fwd+bwd | fwd+bwd ratio |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['particles']} | {r['springs']} | {fmt_us(r.get('warp fwd'))} | {fmt_us(r.get('warpnn.jax_callable fwd'))} | "
            f"{fmt_us(r.get('warp fwd + wp.Tape bwd'))} | {fmt_us(r.get('warpnn.jax_callable fwd+bwd'))} | "
            f"{fmt_ratio(r.get('warpnn.jax_callable fwd+bwd'), r.get('warp fwd + wp.Tape bwd'))} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    sizes = [1024, 16384] if "--small" in argv else [1024, 16384, 262144]
    rows = []
    for n in sizes:
        t = time_interleaved(cases(n), rounds=10)
        rows.append({"particles": n, "springs": 2 * n - 1, **{key: t[key] for key in t}})
    print(table(rows), file=sys.stderr)
    print(json.dumps({"environment": environment(), "callable": rows}))


if __name__ == "__main__":
    main()
