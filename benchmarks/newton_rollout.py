"""Newton's SolverSemiImplicit rollout: warpnn's replay in JAX against Newton's own wp.Tape, per step.

``python -m benchmarks newton_rollout [--sizes 1024 99856 998001] [--steps 50] [--out docs/] [--merge]``

The scene of the issue's anchors: an ``add_cloth_grid`` cloth with springs on a ground plane,
``SolverSemiImplicit(enable_tri_contact=False)``, contacts from the explicit broad phase collided once.
For each size it times one rollout of ``--steps`` steps and reports µs per step:

* warpnn forward: ``jax.jit`` of a ``lax.scan`` over ``NewtonStep`` (``warpnn.trace`` of ``solver.step``);
* warpnn forward + backward: ``jax.value_and_grad`` of a loss on the final state with respect to the
  initial state and the spring stiffnesses;
* Newton forward / forward + backward: Newton's Python loop over ``solver.step`` (under ``wp.Tape`` with
  ``tape.backward`` for the second), and on CUDA the same captured once with ``wp.ScopedCapture`` and
  replayed with ``wp.capture_launch``.

Cases alternate in rounds (``benchmarks.common.time_interleaved``). Writes ``newton-rollout-{gpu,cpu}.{md,json}``
to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import warp as wp

import warpnn

from .common import time_interleaved

wp.config.quiet = True


@wp.kernel
def _weighted_sum(q: wp.array(dtype=wp.vec3), qd: wp.array(dtype=wp.vec3), out: wp.array(dtype=float)):
    i = wp.tid()
    wp.atomic_add(out, 0, q[i][0] + 0.5 * q[i][2] + 0.1 * qd[i][1])


def _scene(particles: int, device: str, requires_grad: bool):
    import newton

    side = max(int(round(math.sqrt(particles))), 2)
    builder = newton.ModelBuilder()
    builder.default_particle_radius = 0.01
    builder.add_cloth_grid(
        pos=wp.vec3(0.0, 0.0, 0.05), rot=wp.quat_identity(), vel=wp.vec3(0.1, 0.0, -0.2), dim_x=side - 1,
        dim_y=side - 1, cell_x=1.0 / side, cell_y=1.0 / side, mass=0.01, add_springs=True, spring_ke=1e3,
        spring_kd=1.0, tri_ke=1e2, tri_ka=1e2, tri_kd=0.1,
    )
    builder.add_ground_plane()
    model = builder.finalize(device=device, requires_grad=requires_grad)
    model.particle_grid = None
    solver = newton.solvers.SolverSemiImplicit(model, enable_tri_contact=False)
    pipeline = newton.CollisionPipeline(model, broad_phase="explicit", soft_contact_gap=10.0, requires_grad=requires_grad)
    contacts = pipeline.contacts()
    pipeline.collide(model.state(), contacts)
    return model, solver, contacts


def _warpnn_cases(scene, steps: int, dt: float, unrolls=(1,)):
    from warpnn_models.newton import NewtonStep, rollout

    model, solver, contacts = scene
    step = NewtonStep(model, solver, dt, contacts=contacts, param_fields=("spring_stiffness",))
    # The model's arrays go in as arguments (device buffers), not as literals embedded in the program.
    args = (step.initial_state(), step.initial_params(), step.constants())
    cases = {}
    for unroll in unrolls:

        def loss(state, params, constants, unroll=unroll):
            final, _ = rollout(step, state, None, params, num_steps=steps, constants=constants, unroll=unroll)
            q, qd = final["particle_q"], final["particle_qd"]
            return (q[:, 0] + 0.5 * q[:, 2] + 0.1 * qd[:, 1]).sum()

        def forward(state, params, constants, unroll=unroll):
            return rollout(step, state, None, params, num_steps=steps, constants=constants, unroll=unroll)[0]["particle_q"]

        suffix = "" if unroll == 1 else f", unroll={unroll}"
        cases[f"warpnn fwd{suffix}"] = (jax.jit(forward), args)
        cases[f"warpnn fwd+bwd{suffix}"] = (jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), args)
    return model.particle_count, cases


class _NewtonRollout:
    """Newton's own loop over pre-allocated states, optionally under wp.Tape with a backward pass."""

    def __init__(self, scene, steps: int, dt: float, device: str):
        self.model, self.solver, self.contacts = scene
        self.steps, self.dt, self.device = steps, dt, device
        self.states = [self.model.state(requires_grad=True) for _ in range(steps + 1)]
        self.loss = wp.zeros(1, dtype=float, requires_grad=True, device=device)
        self.graphs = {}

    def forward(self):
        for t in range(self.steps):
            self.states[t].clear_forces()
            self.solver.step(self.states[t], self.states[t + 1], None, self.contacts, self.dt)
        self.loss.zero_()
        wp.launch(_weighted_sum, self.model.particle_count, inputs=[self.states[-1].particle_q,
                  self.states[-1].particle_qd], outputs=[self.loss], device=self.device)

    def forward_backward(self):
        tape = wp.Tape()
        with tape:
            self.forward()
        tape.backward(self.loss)
        tape.zero()

    def run(self, what: str, captured: bool):
        fn = self.forward if what == "fwd" else self.forward_backward
        if not captured:
            fn()
        else:
            if what not in self.graphs:
                with wp.ScopedCapture(device=self.device) as capture:
                    fn()
                self.graphs[what] = capture.graph
            wp.capture_launch(self.graphs[what])
        wp.synchronize_device(self.device)
        return 0


def run(sizes, steps: int, dt: float = 5e-4, unrolls=(1,)) -> list[dict]:
    on_gpu = jax.default_backend() == "gpu"
    device = "cuda:0" if on_gpu else "cpu"
    rows = []
    for particles in sizes:
        t0 = time.perf_counter()
        # One scene for both (Newton's builder is Python: ~5 minutes at 1M particles on a 2-core CPU).
        scene = _scene(particles, device, requires_grad=True)
        count, cases = _warpnn_cases(scene, steps, dt, unrolls)
        newton_loop = _NewtonRollout(scene, steps, dt, device)
        for what in ("fwd", "fwd+bwd"):
            cases[f"Newton {what}"] = (lambda what=what: newton_loop.run(what, False), ())
            if on_gpu:
                cases[f"Newton {what} captured"] = (lambda what=what: newton_loop.run(what, True), ())
        rounds = 5 if count > 200_000 else 10
        times = time_interleaved(cases, rounds=rounds, per_round=1)
        row = {"particles": count, "steps": steps, "setup_s": round(time.perf_counter() - t0, 1)}
        for key, value in times.items():
            row[key] = f"error: {value}" if isinstance(value, Exception) else round(value / steps * 1e6, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del cases, newton_loop, scene
    return rows


_ROW_KEYS = ("particles", "steps", "setup_s")


def _columns(rows: list[dict]) -> list[str]:
    """Timed cases in a stable order: warpnn's forward rows, Newton's forward rows, then the same for fwd+bwd."""
    names = list(dict.fromkeys(k for r in rows for k in r if k not in _ROW_KEYS))
    return sorted(names, key=lambda c: ("fwd+bwd" in c, not c.startswith("warpnn"), names.index(c)))


def markdown(rows: list[dict]) -> str:
    device = jax.devices()[0]
    import newton

    lines = [
        f"# Newton rollout: warpnn vs Newton's wp.Tape ({device.platform}: {device.device_kind})",
        "",
        f"µs per rollout step; jax {jax.__version__}, warp-lang {wp.__version__}, newton {newton.__version__}, "
        f"warpnn launcher {warpnn._launch.LAUNCHER.name}. `python -m benchmarks newton_rollout`.",
        "",
        "| particles | steps | " + " | ".join(_columns(rows)) + " |",
        "|---|---|" + "---|" * len(_columns(rows)),
    ]
    for r in rows:
        cells = [str(r.get(c, "")) for c in _columns(rows)]
        lines.append(f"| {r['particles']:,} | {r['steps']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_gpu = jax.default_backend() == "gpu"
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 99856, 998001] if on_gpu else [1024, 99856])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default="docs")
    parser.add_argument("--merge", action="store_true", help="keep rows of other sizes already in the output file")
    parser.add_argument("--unroll", type=int, nargs="+", default=[1, 10],
                        help="lax.scan unroll factors of warpnn's rollout (one pair of rows each)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"newton-rollout-{'gpu' if on_gpu else 'cpu'}"
    rows = run(args.sizes, args.steps, unrolls=tuple(args.unroll))
    if args.merge and (out / f"{name}.json").exists():
        done = {r["particles"] for r in rows}
        rows = sorted([r for r in json.loads((out / f"{name}.json").read_text()) if r["particles"] not in done] + rows,
                      key=lambda r: r["particles"])
    text = markdown(rows)
    print(text)
    warpnn.atomic_write_bytes(out / f"{name}.md", text.encode())
    warpnn.atomic_write_bytes(out / f"{name}.json", (json.dumps(rows, indent=2) + "\n").encode())


if __name__ == "__main__":
    main()
