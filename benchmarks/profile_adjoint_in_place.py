"""A/B of adjoints computed in place (``KernelSignature.in_place_pairs``) in scans, against pure JAX.

For an elementwise kernel ``y[i] = f(x[i])`` warpnn's adjoint call writes ``x``'s adjoint into ``y``'s
cotangent buffer, where it used to zero a buffer of its own and XLA then copied that into the backward loop's
carry. This times the two scan cases of ``benchmarks.bridge`` and a loop of single differentiated calls with the
adjoint in place (the library's behaviour), in place with the forward out of place (on a GPU the forward of a
differentiated call is written in place where the adjoint is: ``_bridge._differentiated_forward_in_place_pays``)
and out of place, and pure JAX, in alternating rounds of one process, under this process's XLA_FLAGS; with the
ops of each compiled loop body and warpnn's handler entries per step:

    python -m benchmarks.profile_adjoint_in_place [--n 4096 16777216]
    XLA_FLAGS="--xla_gpu_graph_min_graph_size=1 --xla_cmd_buffer_trace_cache_size=1024" python -m benchmarks.profile_adjoint_in_place
"""

from __future__ import annotations

import argparse
import contextlib
import os

import jax
import jax.numpy as jnp

import warpnn
from warpnn import _bridge, _launch
from warpnn._signature import KernelSignature

from .bridge import N, SCAN_STEPS, _scan_grad, _trajectory_grad, affine, pure_jax
from .common import print_rounds
from .profile_scan import loop_body_ops


@contextlib.contextmanager
def _in_place(mode: str):
    """Trace with the library's choice, the adjoint always in place (with or without the differentiated forward),
    or nothing in place; compiled functions keep what they saw."""
    saved = KernelSignature.in_place_pairs_for, _bridge._adjoint_in_place_pays, _bridge._differentiated_forward_in_place_pays
    if mode == "in place":
        _bridge._adjoint_in_place_pays = lambda sig, shapes, pairs: True
    elif mode == "in place, forward out of place":
        _bridge._adjoint_in_place_pays = lambda sig, shapes, pairs: True
        _bridge._differentiated_forward_in_place_pays = lambda sig, shapes, pairs: False
    elif mode == "out of place":
        KernelSignature.in_place_pairs_for = lambda self, shapes, dims: ()  # type: ignore[method-assign]
    try:
        yield
    finally:
        (KernelSignature.in_place_pairs_for, _bridge._adjoint_in_place_pays,  # type: ignore[method-assign]
         _bridge._differentiated_forward_in_place_pays) = saved


def _call_grad(step):
    """Gradients of SCAN_STEPS single calls in a loop, each call's input computed from the previous gradient
    (so that XLA cannot hoist it) and needed again by its backward pass: a layer's, not a scan carry's."""
    grad = jax.grad(lambda x: (lambda y: jnp.vdot(y, y))(step(x)))  # nonlinear: the forward is not dead code
    return lambda x: jax.lax.fori_loop(0, SCAN_STEPS, lambda _, g: g + grad(x + 1e-30 * g), jnp.zeros_like(x))


def _entries_per_step(fn, args, calls: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    before = sum(_launch.LAUNCHER.handler_entries.values())
    for _ in range(calls):
        jax.block_until_ready(fn(*args))
    return (sum(_launch.LAUNCHER.handler_entries.values()) - before) / (calls * SCAN_STEPS)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[N], help="elements of the kernel's arrays")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dump", metavar="DIR", help="also write each compiled program's optimised HLO here")
    args = parser.parse_args(argv)
    kernel = warpnn.jax_kernel(affine)
    ours = lambda c: kernel(c)[0]  # noqa: E731
    variants = (("warpnn", ours, "library"), ("warpnn, adjoint in place", ours, "in place"),
                ("warpnn, adjoint in place, forward out of place", ours, "in place, forward out of place"),
                ("warpnn, adjoint out of place", ours, "out of place"), ("pure JAX", pure_jax, "library"))
    cases = {}
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for n in args.n:
        x = jnp.linspace(0.0, 1.0, n, dtype=jnp.float32)
        builders = {f"scan step fwd+bwd, n={n}": (_scan_grad, (x,)),
                    f"single call fwd+bwd, n={n}": (_call_grad, (x,))}
        if n == N:
            xs = jnp.tile(x, (SCAN_STEPS, 1)) * 0.01
            builders[f"scan xs→ys step fwd+bwd, n={n}"] = (_trajectory_grad, (x, xs))
        for case, (build, call_args) in builders.items():
            for label, step, mode in variants:
                with _in_place(mode):
                    compiled = jax.jit(build(step)).lower(*call_args).compile()
                cases[(case, label)] = (compiled, call_args)
                if args.dump:
                    name = "".join(c if c.isalnum() else "_" for c in f"{case}_{label}")
                    os.makedirs(args.dump, exist_ok=True)
                    with open(os.path.join(args.dump, f"{name}.hlo.txt"), "w") as f:
                        f.write(compiled.as_text())
                ops = ", ".join(f"{op} {k}" for op, k in sorted(loop_body_ops(compiled.as_text()).items()))
                entries = _entries_per_step(compiled, call_args) if label != "pure JAX" else 0.0
                print(f"  {case:32s} {label:46s} handler entries/step {entries:.3f}; loop bodies: {ops}")
    print(f"µs per scan step (× pure JAX), {args.rounds} rounds")
    print_rounds(cases, args.rounds, SCAN_STEPS)


if __name__ == "__main__":
    main()
