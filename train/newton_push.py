"""``warpnn-train newton``: an NNX policy learns to drag a cloth across the ground, through Newton's own solver.

The scene is Newton's: a cloth (``add_cloth_grid`` with springs and triangle FEM) lying on a ground plane
with contact and friction, stepped by Newton's **unmodified** ``SolverSemiImplicit``. The solver step is
replayed in JAX by ``warpnn_models.newton.NewtonStep`` (``warpnn.trace`` of ``solver.step``), so a rollout is
a ``lax.scan`` over Newton's kernels and ``jax.grad`` runs their Warp adjoints. A Flax NNX MLP reads the
cloth's centre of mass relative to the target, its mean velocity and the time, and outputs the forces on
the four corners at every step, as four grippers would. The loss is the squared distance of the centre of
mass to the target over the last 10% of the rollout; each training step averages it over a ``jax.vmap``
batch of 8 perturbed initial states (positions and velocities) and takes an optax Adam step.

Success: the held-out loss falls by well over 10x.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import common, nnx_policy, options
from .options import PushConfig  # noqa: F401 - also this task's name, as before options.py
from .nnx_policy import (  # noqa: F401 - also this task's public names, as before they were shared
    CHECKPOINT,
    checkpoint_dict,
    load_checkpoint,
    read_checkpoint,
    restore,
)


add_arguments = options.add_newton_arguments  # the options live in options.py: parsed before JAX loads


def config_from_args(args: argparse.Namespace) -> PushConfig:
    return options.config_from_args(PushConfig, args)


@dataclasses.dataclass
class Task:
    config: PushConfig
    step: Any  # warpnn_models.newton.NewtonStep
    rest: jax.Array  # (n, 3) initial particle positions
    corners: np.ndarray  # (4,) particle indices the policy pushes
    target: jax.Array  # (3,) centre-of-mass target


def make_task(config: PushConfig = PushConfig()) -> Task:
    import newton
    import warp as wp

    from warpnn_models.newton import NewtonStep

    c = config
    builder = newton.ModelBuilder()
    builder.default_particle_radius = c.radius
    builder.add_cloth_grid(
        pos=wp.vec3(0.0, 0.0, c.radius), rot=wp.quat_identity(), vel=wp.vec3(0.0, 0.0, 0.0), dim_x=c.cells,
        dim_y=c.cells, cell_x=c.cell, cell_y=c.cell, mass=c.mass, add_springs=True, spring_ke=c.spring_ke,
        spring_kd=c.spring_kd, tri_ke=c.tri_ke, tri_ka=c.tri_ke, tri_kd=0.1,
    )
    material = newton.ModelBuilder.ShapeConfig(ke=c.contact_ke, kd=c.contact_kd, kf=c.friction_kf, mu=c.friction_mu)
    builder.add_ground_plane(cfg=material)
    model = builder.finalize()
    model.particle_grid = None  # no self-contact: Newton rebuilds its hash grid on the host every step
    model.soft_contact_ke, model.soft_contact_kd = c.contact_ke, c.contact_kd
    model.soft_contact_kf, model.soft_contact_mu = c.friction_kf, c.friction_mu
    solver = newton.solvers.SolverSemiImplicit(model, enable_tri_contact=False)
    # Newton's differentiable examples collide once against a plane with a large gap: every particle gets a
    # contact with the ground, and the contact kernel tests penetration at each step.
    pipeline = newton.CollisionPipeline(model, broad_phase="explicit", soft_contact_gap=10.0)
    contacts = pipeline.contacts()
    pipeline.collide(model.state(), contacts)
    step = NewtonStep(model, solver, c.dt, contacts=contacts, control_fields=("particle_f",))
    rest = step.initial_state()["particle_q"]
    side = c.cells + 1
    corners = np.array([0, c.cells, side * c.cells, side * side - 1])
    target = rest.mean(0) + jnp.asarray([*c.target, 0.0])
    return Task(c, step, rest, corners, target)


class Policy(nnx.Module):
    """MLP: (centre of mass - target, mean velocity, time) -> forces on the four corners, tanh-bounded."""

    def __init__(self, hidden: int, frames: int, max_force: float, *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(7, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        # Zero output layer: the untrained policy applies no force, so training starts from "do nothing".
        self.out = nnx.Linear(hidden, 12, kernel_init=nnx.initializers.zeros, rngs=rngs)
        self.frames, self.max_force = frames, max_force

    def __call__(self, offset: jax.Array, velocity: jax.Array, t: jax.Array) -> jax.Array:
        features = jnp.concatenate([10.0 * offset, velocity, jnp.atleast_1d(t / self.frames)])
        h = jnp.tanh(self.hidden1(features))
        h = jnp.tanh(self.hidden2(h))
        return self.max_force * jnp.tanh(self.out(h)).reshape(4, 3)


def make_policy(task: Task, seed: int) -> Policy:
    c = task.config
    return Policy(c.hidden, c.frames, c.max_force, rngs=nnx.Rngs(seed))


def sample_initial_states(task: Task, key, batch: int) -> tuple[jax.Array, jax.Array]:
    """(batch, n, 3) initial positions (the cloth shifted in the ground plane) and velocities (in-plane)."""
    c = task.config
    in_plane = jnp.asarray([1.0, 1.0, 0.0])
    kx, kv = jax.random.split(key)
    shift = c.position_noise * jax.random.normal(kx, (batch, 1, 3)) * in_plane
    velocity = c.velocity_noise * jax.random.normal(kv, (batch, 1, 3)) * in_plane
    return task.rest + shift, jnp.broadcast_to(velocity, (batch, *task.rest.shape))


def rollout(task: Task, policy: Policy, q0, qd0) -> tuple[jax.Array, jax.Array]:
    """One closed-loop rollout of Newton's solver: positions (T, n, 3) and corner forces (T, 4, 3)."""
    corners = jnp.asarray(task.corners)

    def body(state, t):
        q, qd = state["particle_q"], state["particle_qd"]
        forces = policy(q.mean(0) - task.target, qd.mean(0), t.astype(q.dtype))
        control = {"particle_f": jnp.zeros_like(q).at[corners].set(forces)}
        new = task.step(state, control)
        return new, (new["particle_q"], forces)

    state0 = {"particle_q": q0, "particle_qd": qd0}
    _, (qs, forces) = jax.lax.scan(body, state0, jnp.arange(task.config.frames))
    return qs, forces


def push_loss(task: Task, qs: jax.Array) -> jax.Array:
    """Mean squared distance (m^2) of the centre of mass to the target over the last 10% of the rollout."""
    settle = max(task.config.frames // 10, 1)
    return jnp.mean(jnp.sum((qs[-settle:].mean(1) - task.target) ** 2, -1))


def batch_loss(task: Task, policy: Policy, q0s, qd0s) -> jax.Array:
    return jnp.mean(jax.vmap(lambda q0, qd0: push_loss(task, rollout(task, policy, q0, qd0)[0]))(q0s, qd0s))


# train(task, policy, seed, steps=None, progress=True, *, resume_from=None, save=None, checkpoint_every=0,
# stop_after=None): Adam on batch_loss over sampled initial states, resumable (warpnn_train.nnx_policy).
train = nnx_policy.task_trainer(sample_initial_states, batch_loss, make_policy, "newton push")


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = config_from_args(args)
    out = common.run_dir(args, config)
    t0 = time.perf_counter()
    task = make_task(config)
    policy, untrained = make_policy(task, args.seed), make_policy(task, args.seed)
    result, resume_from = nnx_policy.train_in(out, policy, config.steps,
                                              functools.partial(train, task, policy, args.seed))

    q0s, qd0s = sample_initial_states(task, jax.random.PRNGKey(nnx_policy.EVAL_KEY_OFFSET + args.seed),
                                       config.eval_batch)
    run_batch = nnx.jit(lambda p: jax.vmap(lambda q, qd: rollout(task, p, q, qd))(q0s, qd0s))
    qs, forces = run_batch(policy)
    qs_untrained, _ = run_batch(untrained)
    final_error = jnp.linalg.norm(qs[:, -1].mean(1) - task.target, axis=-1)
    metrics = {
        "task": "newton_push",
        "config": dataclasses.asdict(config),
        "seed": args.seed,
        "solver": "newton.solvers.SolverSemiImplicit (unmodified), replayed by warpnn.trace",
        **nnx_policy.training_metrics(result, config.steps, resume_from),
        "final_com_error_m": float(final_error.mean()),
        "particles": int(task.rest.shape[0]),
        "launches_per_step": task.step.program.num_launches,
        "wall_time_s": time.perf_counter() - t0,
        **common.environment(),
    }
    metrics["versions"]["newton"] = common.package_version("newton")
    common.write_json(out / "metrics.json", metrics)
    common.plot_loss(out / "loss.png", result["losses"], "Newton cloth pushing: training loss (m$^2$)")
    plot_trajectories(out / "trajectories.png", task, np.asarray(qs), np.asarray(qs_untrained), np.asarray(forces))
    return metrics


def plot_trajectories(path, task: Task, qs: np.ndarray, qs_untrained: np.ndarray, forces: np.ndarray) -> None:
    """Top view of the centre-of-mass paths before/after training, final cloths, and the policy's forces."""
    plt = common.pyplot()
    c = task.config
    target = np.asarray(task.target)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    ax = axes[0]
    for b in range(qs.shape[0]):
        com, com0 = qs[b].mean(1), qs_untrained[b].mean(1)
        ax.plot(com0[:, 0], com0[:, 1], "--", color="tab:red", lw=1, label="untrained (no force)" if b == 0 else None)
        ax.plot(com[:, 0], com[:, 1], "-", color="tab:blue", lw=1.2, label="trained policy" if b == 0 else None)
        ax.plot(com[0, 0], com[0, 1], "o", color="0.5", ms=3, label="start" if b == 0 else None)
    side = c.cells + 1
    for frame, color, label in ((0, "0.5", "cloth at start (state 0)"), (-1, "tab:blue", "cloth at end (state 0)")):
        grid = qs[0, frame].reshape(side, side, 3)
        for k in range(side):
            ax.plot(grid[k, :, 0], grid[k, :, 1], color=color, lw=0.6, alpha=0.6, label=label if k == 0 else None)
            ax.plot(grid[:, k, 0], grid[:, k, 1], color=color, lw=0.6, alpha=0.6)
    ax.plot(target[0], target[1], "x", color="tab:green", ms=12, mew=2, label="target")
    ax.set_aspect("equal")
    ax.set_xlabel("x (m)")
    ax.set_ylabel("y (m)")
    ax.set_title(f"centre of mass over {c.frames} steps, {qs.shape[0]} held-out starts (top view)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    ax = axes[1]
    t = np.arange(1, c.frames + 1) * c.dt
    for axis, color in zip(range(3), ("tab:red", "tab:green", "tab:blue")):
        ax.plot(t, forces[0, :, :, axis].sum(-1), color=color, lw=1.2, label=f"total f{'xyz'[axis]} on corners")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("force (N)")
    ax.set_title("policy forces (held-out start 0)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    common.save_figure(fig, path)
