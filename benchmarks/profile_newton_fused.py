"""Is the small Newton step's forward gap per FFI call? The step as ONE ``warpnn.jax_callable`` against the replay.

``warpnn.trace`` replays Newton's ``SolverSemiImplicit.step`` as one FFI call per kernel (five per step here).
This wraps the whole step instead as one ``jax_callable`` (graph mode JAX: XLA captures its launches once), runs
both in a 50-step ``lax.scan`` with ``unroll=10`` next to Newton's own captured loop, checks they agree, and
prints µs per step (alternating rounds, one process; GPU only; the callable is forward-only here: it hands
Newton's states XLA's buffers and so leaves inactive particles' velocities undefined).

    python -m benchmarks.profile_newton_fused
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import warp as wp

import warpnn

from .common import time_interleaved
from .newton_rollout import _NewtonRollout, _scene

STEPS, DT = 50, 5e-4


def main() -> None:
    from warpnn_models.newton import NewtonStep, rollout

    for particles in (1024, 99856):
        scene = _scene(particles, "cuda:0", requires_grad=False)
        model, solver, contacts = scene
        s_in, s_out = model.state(), model.state()

        def step_fn(q: wp.array(dtype=wp.vec3), qd: wp.array(dtype=wp.vec3), q_out: wp.array(dtype=wp.vec3), qd_out: wp.array(dtype=wp.vec3)):
            s_in.particle_q, s_in.particle_qd, s_out.particle_q, s_out.particle_qd = q, qd, q_out, qd_out
            s_in.clear_forces()
            solver.step(s_in, s_out, None, contacts, DT)

        fused = warpnn.jax_callable(step_fn, num_outputs=2)
        step = NewtonStep(model, solver, DT, contacts=contacts)
        state = step.initial_state(); consts = step.constants()

        def fused_rollout(q, qd):
            def body(c, _):
                return fused(*c), None
            return jax.lax.scan(body, (q, qd), None, length=STEPS, unroll=10)[0]

        def traced(state, consts):
            return rollout(step, state, None, None, num_steps=STEPS, constants=consts, unroll=10)[0]

        jf, jt = jax.jit(fused_rollout), jax.jit(traced)
        a = jf(state["particle_q"], state["particle_qd"]); b = jt(state, consts)
        print("max |fused - traced| q:", float(jnp.abs(a[0] - b["particle_q"]).max()))
        loop = _NewtonRollout(_scene(particles, "cuda:0", requires_grad=True), STEPS, DT, "cuda:0")
        cases = {"one callable per step": (jf, (state["particle_q"], state["particle_qd"])),
                 "traced (per-kernel calls)": (jt, (state, consts)),
                 "Newton captured": (lambda: loop.run("fwd", True), ())}
        times = time_interleaved(cases, rounds=10, per_round=1)
        print(particles, {k: round(v / STEPS * 1e6, 1) for k, v in times.items()}, flush=True)


if __name__ == "__main__":
    main()
