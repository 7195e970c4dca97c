"""Where a Warp CPU kernel's time per element goes: the heat stencil in three spellings, and a copy.

``python -m benchmarks cpu_codegen [--sizes 256,1024]`` launches each kernel with Warp's own ``wp.launch`` on
the CPU (one thread, recorded commands, best of 7) and prints ns per element:

* ``2-D launch``: the stencil as users write it, ``i, j = wp.tid()`` over ``(n, n)``;
* ``flat 1-D, i = t // m``: the same over a flattened array, unravelling the index itself;
* ``row loop``: ``i = wp.tid()`` over ``(n,)`` and ``for j in range(m)`` inside (what warpnn's row-loop twin does);
* ``1-D copy``: ``y[i] = x[i]``, Warp's contiguous fast path, the floor.

Warp's CPU entry computes every thread's coordinates from one linear index with a division per launch dim
(what the flat kernel does by hand); the row loop has none.

``--adjoint`` adds Warp's adjoint launch (``wp.launch(..., adjoint=True)``, gradient w.r.t. ``u`` and ``alpha``) of
the row loop, and the forward and adjoint of the same row loop over flattened 1-D arrays (``u[i * m + j]``, which
Warp's CPU code specialises for unit strides), with the gradients checked equal to the 2-D row loop's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import warp as wp

from .common import environment
from tests.kernels_for_tests import periodic_neighbours

from .heat import C, heat_step

wp.config.quiet = True


@wp.kernel
def heat_step_flat(u: wp.array(dtype=float), alpha: wp.array(dtype=float), c: float, n: int, m: int,
                   out: wp.array(dtype=float)):
    t = wp.tid()
    i = t // m
    j = t - i * m
    ip, im = periodic_neighbours(i, n)
    jp, jm = periodic_neighbours(j, m)
    lap = u[ip * m + j] + u[im * m + j] + u[i * m + jp] + u[i * m + jm] - 4.0 * u[t]
    out[t] = u[t] + alpha[0] * c * lap


@wp.kernel
def heat_step_rows(u: wp.array2d(dtype=float), alpha: wp.array(dtype=float), c: float, out: wp.array2d(dtype=float)):
    i = wp.tid()
    m = u.shape[1]
    ip, im = periodic_neighbours(i, u.shape[0])
    for j in range(m):
        jp, jm = periodic_neighbours(j, m)
        lap = u[ip, j] + u[im, j] + u[i, jp] + u[i, jm] - 4.0 * u[i, j]
        out[i, j] = u[i, j] + alpha[0] * c * lap


@wp.kernel
def heat_step_rows_flat(u: wp.array(dtype=float), alpha: wp.array(dtype=float), c: float, n: int, m: int,
                        out: wp.array(dtype=float)):
    i = wp.tid()
    ip, im = periodic_neighbours(i, n)
    for j in range(m):
        jp, jm = periodic_neighbours(j, m)
        lap = u[ip * m + j] + u[im * m + j] + u[i * m + jp] + u[i * m + jm] - 4.0 * u[i * m + j]
        out[i * m + j] = u[i * m + j] + alpha[0] * c * lap


@wp.kernel
def copy_1d(x: wp.array(dtype=float), y: wp.array(dtype=float)):
    i = wp.tid()
    y[i] = x[i]


def _best_ns_per_element(launch, elements: int, reps: int) -> float:
    """Best of 7 rounds of ``reps`` calls of ``launch`` (after one to warm up), in ns per element."""
    launch()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(reps):
            launch()
        best = min(best, (time.perf_counter() - t0) / reps / elements)
    return best * 1e9


def ns_per_element(kernel, dims, inputs, elements: int) -> float:
    cmd = wp.launch(kernel, dims, inputs=inputs, device="cpu", record_cmd=True)
    return _best_ns_per_element(cmd.launch, elements, max(3, (1 << 22) // elements))


def adjoint_ns_per_element(kernel, dims, inputs, adj_inputs, elements: int) -> float:
    """Warp's adjoint launch (not recordable as a command: timed through wp.launch, best of 7)."""

    def launch():
        wp.launch(kernel, dims, inputs=inputs, adj_inputs=adj_inputs, adjoint=True, device="cpu")

    return _best_ns_per_element(launch, elements, max(3, (1 << 20) // elements))


def adjoint_columns(n: int, host, u, alpha, outs) -> dict:
    """The row loop's adjoint over 2-D arrays and over flattened ones, and the flat forward, in ns per element."""
    seed = np.random.default_rng(1).random((n, n), dtype=np.float32)
    flat_u, flat_out = wp.array(host.ravel(), device="cpu"), wp.zeros(n * n, dtype=float, device="cpu")
    adj = {"2-D": (wp.array(seed, device="cpu"), wp.zeros((n, n), dtype=float, device="cpu")),
           "flat": (wp.array(seed.ravel(), device="cpu"), wp.zeros(n * n, dtype=float, device="cpu"))}
    adj_alpha = {k: wp.zeros(1, dtype=float, device="cpu") for k in adj}
    rows_in, flat_in = [u, alpha, C, outs[1]], [flat_u, alpha, C, n, n, flat_out]
    rows_adj = [adj["2-D"][1], adj_alpha["2-D"], 0.0, adj["2-D"][0]]
    flat_adj = [adj["flat"][1], adj_alpha["flat"], 0.0, 0, 0, adj["flat"][0]]
    row = {
        "row loop adjoint": adjoint_ns_per_element(heat_step_rows, (n,), rows_in, rows_adj, n * n),
        "flat row loop": ns_per_element(heat_step_rows_flat, (n,), flat_in, n * n),
        "flat row loop adjoint": adjoint_ns_per_element(heat_step_rows_flat, (n,), flat_in, flat_adj, n * n),
    }
    # one more adjoint launch each from zeroed gradients: the two spellings differentiate to the same numbers
    for k in adj:
        adj[k][1].zero_()
        adj_alpha[k].zero_()
    wp.launch(heat_step_rows, (n,), inputs=rows_in, adj_inputs=rows_adj, adjoint=True, device="cpu")
    wp.launch(heat_step_rows_flat, (n,), inputs=flat_in, adj_inputs=flat_adj, adjoint=True, device="cpu")
    assert np.array_equal(adj["2-D"][1].numpy().ravel(), adj["flat"][1].numpy())
    assert np.array_equal(adj_alpha["2-D"].numpy(), adj_alpha["flat"].numpy())
    return row


def run(sizes, adjoint: bool = False) -> list[dict]:
    rows = []
    for n in sizes:
        host = np.random.default_rng(0).random((n, n), dtype=np.float32)
        u, alpha = wp.array(host, device="cpu"), wp.array([0.1], dtype=float, device="cpu")
        outs = [wp.zeros((n, n), dtype=float, device="cpu") for _ in range(2)]
        flat_u, flat_out = wp.array(host.ravel(), device="cpu"), wp.zeros(n * n, dtype=float, device="cpu")
        x, y = wp.zeros(n * n, dtype=float, device="cpu"), wp.zeros(n * n, dtype=float, device="cpu")
        row = {
            "size": n,
            "2-D launch": ns_per_element(heat_step, (n, n), [u, alpha, C, outs[0]], n * n),
            "flat 1-D, i = t // m": ns_per_element(heat_step_flat, (n * n,), [flat_u, alpha, C, n, n, flat_out], n * n),
            "row loop": ns_per_element(heat_step_rows, (n,), [u, alpha, C, outs[1]], n * n),
            "1-D copy": ns_per_element(copy_1d, (n * n,), [x, y], n * n),
        }
        # the three stencils compute the same numbers
        assert np.array_equal(outs[0].numpy(), outs[1].numpy()) and np.array_equal(outs[0].numpy().ravel(), flat_out.numpy())
        if adjoint:
            row.update(adjoint_columns(n, host, u, alpha, outs))
        rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,1024")
    parser.add_argument("--adjoint", action="store_true", help="add the row loop's adjoint, 2-D and flattened")
    args = parser.parse_args(argv)
    rows = run([int(s) for s in args.sizes.split(",")], args.adjoint)
    names = [k for k in rows[0] if k != "size"]
    print(f"Environment: {environment()}\n")
    print("| size | " + " | ".join(f"{n} (ns per element)" for n in names) + " |")
    print("|---|" + "---|" * len(names))
    for r in rows:
        print(f"| {r['size']}² | " + " | ".join(f"{r[n]:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
