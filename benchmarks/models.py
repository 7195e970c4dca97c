"""Model layers at scale: spring forces (cloth) and Chamfer distance, warpnn vs pure JAX of the same math.

    python -m benchmarks models            # full size on a GPU (4.2M particles / 16.8M springs, 100k points)
    python -m benchmarks models --small    # sizes a 2-core CPU finishes in a minute

Achieved bandwidth is an *effective* number: bytes a spring must move at least (its two indices, three
parameters, two endpoint positions and velocities read, two 3-vector atomic adds) divided by the device
time of the call (from a ``jax.profiler`` trace, so dispatch is not counted; wall time where the trace has
no device events), reported beside the device's copy bandwidth measured the same way.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp

from warpnn.kernels import cloth, pointcloud

from .common import device_time, environment, fmt_ratio, fmt_us, time_call

# per spring: 2 int32 indices + 3 float params + 4 vec3 reads (x_i, x_j, v_i, v_j) + 2 vec3 atomic adds
SPRING_BYTES = 2 * 4 + 3 * 4 + 4 * 12 + 2 * 12


def grid_springs(n: int, order: str = "rows") -> jax.Array:
    """Structural and shear springs of an n x n particle grid: about 4 n^2 springs.

    ``order="rows"``: row by row, every kind of spring of one row before the next row (as
    ``warpnn_models.cloth.make_cloth_grid`` emits them); ``"kinds"``: all horizontal springs, then all
    vertical, then each diagonal, which streams every position and force through L2 once per kind.
    """
    idx = jnp.arange(n * n, dtype=jnp.int32).reshape(n, n)
    pairs = [
        (idx[:, :-1], idx[:, 1:]),  # horizontal
        (idx[:-1, :], idx[1:, :]),  # vertical
        (idx[:-1, :-1], idx[1:, 1:]),  # diagonal
        (idx[:-1, 1:], idx[1:, :-1]),  # anti-diagonal
    ]
    springs = jnp.concatenate([jnp.stack([a.ravel(), b.ravel()], 1) for a, b in pairs])
    if order == "kinds":
        return springs
    if order != "rows":
        raise ValueError(f"grid_springs: order must be 'rows' or 'kinds', got {order!r}")
    return springs[jnp.argsort(springs[:, 0] // n, stable=True)]


def copy_bandwidth() -> float:
    """Bytes read + written per second by the faster of a device-to-device copy (XLA's ``copy``, which
    ``x + 0`` simplifies to) and an elementwise pass over 1 GiB, timed on the device where a trace has device
    events (else wall time): the ceiling the spring kernel is held against."""
    x = jnp.ones((256 * 1024 * 1024,), jnp.float32)  # 1 GiB
    times = []
    for f in (lambda x: x + 0.0, lambda x: x * 1.0000001):
        fn = jax.jit(f)
        times.append(device_time(fn, x) or time_call(fn, x, reps=10))
    return 2 * x.nbytes / min(times)


def spring_problem(n: int, order: str = "rows"):
    """The benchmarked spring problem on an n x n grid: ``(x, v, springs, k, d, r, w)``.

    Positions on a slightly jittered grid, small random velocities, per-spring stiffness ``k``, damping
    ``d`` and rest length ``r``, and ``w``, fixed random weights that turn the forces into a scalar loss.
    """
    gx, gy = jnp.meshgrid(jnp.arange(n, dtype=jnp.float32), jnp.arange(n, dtype=jnp.float32), indexing="ij")
    x = jnp.stack([gx.ravel(), jnp.zeros(n * n), gy.ravel()], 1) * 0.01
    x = x + 1e-3 * jax.random.normal(jax.random.PRNGKey(0), x.shape)
    v = 1e-2 * jax.random.normal(jax.random.PRNGKey(1), x.shape)
    w = jax.random.normal(jax.random.PRNGKey(2), x.shape)
    springs = grid_springs(n, order)
    m = springs.shape[0]
    k, d, r = jnp.full((m,), 100.0), jnp.full((m,), 0.1), jnp.full((m,), 0.01)
    return x, v, springs, k, d, r, w


def bench_springs(n: int) -> list[dict]:
    """Spring forces at n x n particles, springs in row order and (for comparison) in kind-by-kind order."""
    rows = []
    for order, suffix in (("rows", ""), ("kinds", ", kind-by-kind order")):
        x, v, springs, k, d, r, w = spring_problem(n, order)
        m = springs.shape[0]
        for name, fn in (("warpnn", cloth.spring_forces), ("pure JAX", cloth.spring_forces_reference)):
            fwd = jax.jit(lambda x, v, k, d, r, fn=fn, s=springs: fn(x, v, s, k, d, r))
            grad = jax.jit(jax.grad(lambda x, v, k, d, r, fn=fn, s=springs: jnp.vdot(w, fn(x, v, s, k, d, r)),
                                    argnums=(0, 1, 2, 3, 4)))
            for direction, f in (("fwd", fwd), ("fwd+bwd", grad)):
                t = time_call(f, x, v, k, d, r, reps=20)
                on_device = device_time(f, x, v, k, d, r)  # the kernels (and zeroing) alone, without dispatch
                busy = on_device or t
                rows.append({"case": f"springs {direction}{suffix}", "impl": name, "seconds": t,
                             "device_seconds": on_device, "size": f"{n * n} particles / {m} springs",
                             "effective_GBps": SPRING_BYTES * m / busy / 1e9 if direction == "fwd" else None})
    return rows


def bench_chamfer(n: int) -> list[dict]:
    x = jax.random.normal(jax.random.PRNGKey(3), (n, 3))
    y = jax.random.normal(jax.random.PRNGKey(4), (n, 3)) * 1.1 + 0.05
    rows = []
    for name, fn in (("warpnn", pointcloud.chamfer), ("pure JAX", pointcloud.chamfer_reference)):
        for case, f in (("chamfer fwd", jax.jit(fn)), ("chamfer fwd+bwd", jax.jit(jax.grad(fn, argnums=(0, 1))))):
            t = time_call(f, x, y, reps=5, min_time=0.0)
            rows.append({"case": case, "impl": name, "seconds": t, "size": f"{n} + {n} points"})
    return rows


def table(rows: list[dict], copy_bw: float) -> str:
    by = {(r["case"], r["impl"]): r for r in rows}
    lines = [
        f"| case | size | warpnn µs | pure JAX µs | speed-up over pure JAX | warpnn device µs | warpnn effective GB/s "
        f"(copy: {copy_bw / 1e9:.0f} GB/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in dict.fromkeys(r["case"] for r in rows):
        ours, ref = by[(case, "warpnn")], by[(case, "pure JAX")]
        gbps = ours.get("effective_GBps")
        lines.append(
            f"| {case} | {ours['size']} | {fmt_us(ours['seconds'])} | {fmt_us(ref['seconds'])} | "
            f"{fmt_ratio(ref['seconds'], ours['seconds'])} | {fmt_us(ours.get('device_seconds'))} | "
            + (f"{gbps:.0f} ({100 * gbps * 1e9 / copy_bw:.0f}% of copy)" if gbps else "—") + " |"
        )
    if any((r.get("effective_GBps") or 0) * 1e9 > copy_bw for r in rows):
        lines.append("\nAbove 100% of copy: the problem fits in cache, which the 1 GiB copy does not.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="CPU-sized problems")
    args = parser.parse_args(argv)
    small = args.small or jax.default_backend() == "cpu"
    n_grid, n_points = (256, 5000) if small else (2048, 100_000)
    copy_bw = copy_bandwidth()
    rows = bench_springs(n_grid) + bench_chamfer(n_points)
    print(table(rows, copy_bw), file=sys.stderr)
    print(json.dumps({"environment": environment(), "copy_bandwidth_Bps": copy_bw, "models": rows}))


if __name__ == "__main__":
    main()
