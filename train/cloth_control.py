"""``warpnn-train control``: learn to fold a cloth, training an NNX MLP policy through a Warp cloth rollout.

A 6 x 6 cloth lies on the ground (penalty contact with Coulomb friction on ``y = 0``). A Flax NNX MLP reads
the whole state (positions relative to rest, velocities, time) and outputs the forces applied to the two
corners of the far edge, as a robot gripper would. The loss is the squared distance of the far edge to
the near edge (lifted by a cloth thickness) over the last 10% of the rollout: a fold in half. Each step
trains on a batch of perturbed initial states (``jax.vmap`` over rollouts); the gradient flows from the
loss through ``lax.scan``, the Warp spring / contact kernels' adjoints and the policy into its weights.

Success: the loss on a fixed held-out batch of initial states falls by well over 10x (about 100x by default).
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

from warpnn_models.cloth import Cloth, ClothGrid, make_cloth_grid

from . import common, nnx_policy, options
from .options import ControlConfig  # noqa: F401 - also this task's name, as before options.py
from .nnx_policy import (  # noqa: F401 - also this task's public names, as before they were shared
    CHECKPOINT,
    checkpoint_bytes,
    checkpoint_dict,
    load_checkpoint,
    read_checkpoint,
    restore,
)


add_arguments = options.add_control_arguments  # the options live in options.py: parsed before JAX loads


def config_from_args(args: argparse.Namespace) -> ControlConfig:
    return options.config_from_args(ControlConfig, args)


class Policy(nnx.Module):
    """MLP state-feedback policy: whole cloth state -> forces on the grasped particles.

    Args:
        num_particles: n. num_grasped: g. hidden: width of the two hidden layers.
        rest: (n, 3) rest positions (inputs are positions relative to them).
        frames: rollout length (time is fed as t / frames).
        max_force: bound on each force component (tanh-squashed).
    """

    def __init__(self, num_particles: int, num_grasped: int, hidden: int, rest, frames: int, max_force: float,
                 *, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(6 * num_particles + 1, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        # Zero output layer: the untrained policy applies no force, so training starts from "do nothing".
        self.out = nnx.Linear(hidden, 3 * num_grasped, kernel_init=nnx.initializers.zeros, rngs=rngs)
        self.rest = nnx.Variable(jnp.asarray(rest))
        self.frames = frames
        self.max_force = max_force
        self.num_grasped = num_grasped

    def __call__(self, x: jax.Array, v: jax.Array, t: jax.Array) -> jax.Array:
        """Forces (g, 3) from positions x (n, 3), velocities v (n, 3) and the int step index t."""
        features = jnp.concatenate([
            (x - self.rest[...]).ravel(),
            0.1 * v.ravel(),  # ~unit scale: speeds are a few 0.1 m/s
            jnp.atleast_1d(t.astype(x.dtype) / self.frames),
        ])
        h = jnp.tanh(self.hidden1(features))
        h = jnp.tanh(self.hidden2(h))
        return self.max_force * jnp.tanh(self.out(h)).reshape(self.num_grasped, 3)


@dataclasses.dataclass
class Task:
    """The folding problem: cloth, grasped corners, far edge and its target positions."""

    config: ControlConfig
    grid: ClothGrid
    cloth: Cloth
    rest: jax.Array  # (n, 3)
    grasped: np.ndarray  # (g,) particle indices the policy pushes
    edge: np.ndarray  # (cols,) far-edge particles
    target: jax.Array  # (cols, 3) where the far edge should end


def make_task(config: ControlConfig = ControlConfig()) -> Task:
    grid = make_cloth_grid(config.rows, config.cols, spacing=config.spacing, plane="xz", mass=config.mass)
    cloth = Cloth.from_grid(
        grid, stiffness=config.stiffness, damping=config.damping, dt=config.dt, drag=config.drag,
        ground_ke=config.ground_ke, ground_kd=config.ground_kd, friction=config.friction, backend=config.backend,
    )
    index = np.arange(config.rows * config.cols).reshape(config.rows, config.cols)
    rest = jnp.asarray(grid.positions)
    target = rest[index[0]] + jnp.asarray([0.0, config.lift, 0.0])
    return Task(config, grid, cloth, rest, index[-1, [0, -1]], index[-1], target)


def make_policy(task: Task, seed: int) -> Policy:
    c = task.config
    return Policy(task.rest.shape[0], len(task.grasped), c.hidden, task.rest, c.frames, c.max_force,
                  rngs=nnx.Rngs(seed))


def sample_initial_states(task: Task, key, batch: int) -> tuple[jax.Array, jax.Array]:
    """(batch, n, 3) perturbed initial positions and velocities (in-plane, so the cloth starts on the ground)."""
    c = task.config
    in_plane = jnp.asarray([1.0, 0.0, 1.0])
    kx, kv = jax.random.split(key)
    x0 = task.rest + c.position_noise * jax.random.normal(kx, (batch, *task.rest.shape)) * in_plane
    v0 = c.velocity_noise * jax.random.normal(kv, (batch, *task.rest.shape)) * in_plane
    return x0, v0


def rollout(task: Task, policy: Policy, x0, v0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One closed-loop rollout: ``(xs, vs, forces)`` of shapes (T, n, 3), (T, n, 3), (T, g, 3)."""
    grasped = jnp.asarray(task.grasped)

    def apply(x, v, t):
        return jnp.zeros_like(x).at[grasped].set(policy(x, v, t))

    xs, vs = task.cloth.rollout(x0, v0, policy=apply, num_steps=task.config.frames)
    # Recomputed from the states rather than carried through scan: only needed for plots.
    ts = jnp.arange(task.config.frames, dtype=jnp.int32)
    x_prev = jnp.concatenate([x0[None], xs[:-1]])
    v_prev = jnp.concatenate([v0[None], vs[:-1]])
    forces = jax.vmap(policy)(x_prev, v_prev, ts)
    return xs, vs, forces


def fold_loss(task: Task, xs: jax.Array) -> jax.Array:
    """Mean squared distance (m^2) of the far edge to its target over the last 10% of the frames of xs (T, n, 3)."""
    settle = max(task.config.frames // 10, 1)
    return jnp.mean(jnp.sum((xs[-settle:, task.edge] - task.target) ** 2, -1))


def batch_loss(task: Task, policy: Policy, x0s, v0s) -> jax.Array:
    def one(x0, v0):
        xs, _, _ = rollout(task, policy, x0, v0)
        return fold_loss(task, xs)

    return jnp.mean(jax.vmap(one)(x0s, v0s))


# train(task, policy, seed, steps=None, progress=True, *, resume_from=None, save=None, checkpoint_every=0,
# stop_after=None): Adam on batch_loss over sampled initial states, resumable (warpnn_train.nnx_policy).
train = nnx_policy.task_trainer(sample_initial_states, batch_loss, make_policy, "cloth control")


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = config_from_args(args)
    out = common.run_dir(args, config)
    t0 = time.perf_counter()
    task = make_task(config)
    policy = make_policy(task, args.seed)
    untrained = make_policy(task, args.seed)  # zero output layer: applies no force
    result, resume_from = nnx_policy.train_in(out, policy, config.steps,
                                              functools.partial(train, task, policy, args.seed))

    # A held-out initial state for the figures.
    x0, v0 = (a[0] for a in sample_initial_states(task, jax.random.PRNGKey(20_000 + args.seed), 1))
    run_trained = nnx.jit(lambda p: rollout(task, p, x0, v0))
    xs, _, forces = run_trained(policy)
    xs_untrained, _, _ = run_trained(untrained)
    final_edge_error = float(jnp.sqrt(jnp.mean(jnp.sum((xs[-1, task.edge] - task.target) ** 2, -1))))
    metrics = {
        "task": "cloth_control",
        "config": dataclasses.asdict(config),
        "seed": args.seed,
        **nnx_policy.training_metrics(result, config.steps, resume_from),
        "final_edge_rmse_m": final_edge_error,
        "particles": task.grid.positions.shape[0],
        "springs": task.grid.springs.shape[0],
        "wall_time_s": time.perf_counter() - t0,
        **common.environment(),
    }
    common.write_json(out / "metrics.json", metrics)
    common.plot_loss(out / "loss.png", result["losses"], "cloth folding: training loss (m$^2$)")
    plot_fold(out / "cloth.png", task, np.asarray(x0), np.asarray(xs), np.asarray(xs_untrained), np.asarray(forces))
    return metrics


def plot_fold(path, task: Task, x0: np.ndarray, xs: np.ndarray, xs_untrained: np.ndarray, forces: np.ndarray) -> None:
    """Initial, target and final cloth in 3-D; the fold seen from the side over time; the policy's forces."""
    plt = common.pyplot()
    c = task.config
    rows, cols = c.rows, c.cols
    target = np.asarray(task.target)

    fig = plt.figure(figsize=(16, 4.8))
    ax = fig.add_subplot(1, 3, 1, projection="3d")
    for label, p, color, ls in (("initial", x0, "0.6", ":"), ("no control (final)", xs_untrained[-1], "tab:red", "--"),
                                ("trained policy (final)", xs[-1], "tab:blue", "-")):
        g = p.reshape(rows, cols, 3)
        for r in range(rows):  # plotted as (x, z, y) so that up is up
            ax.plot(g[r, :, 0], g[r, :, 2], g[r, :, 1], color=color, ls=ls, lw=1, label=label if r == 0 else None)
        for k in range(cols):
            ax.plot(g[:, k, 0], g[:, k, 2], g[:, k, 1], color=color, ls=ls, lw=1)
    ax.scatter(target[:, 0], target[:, 2], target[:, 1], color="tab:green", marker="x", s=40, label="far-edge target")
    ax.scatter(xs[-1, task.grasped, 0], xs[-1, task.grasped, 2], xs[-1, task.grasped, 1], color="k", s=20,
               label="grasped corners")
    ax.set_xlabel("x")
    ax.set_ylabel("z")
    ax.set_zlabel("y (up)")
    ax.set_xlim(-0.05, 0.55)
    ax.set_ylim(-0.05, 0.55)
    ax.set_zlim(0.0, 0.2)
    ax.set_box_aspect((0.6, 0.6, 0.2))  # equal scale on all axes
    for axis in (ax.xaxis, ax.yaxis, ax.zaxis):
        axis.set_major_locator(plt.MaxNLocator(3))
    ax.view_init(elev=30, azim=-55)
    ax.set_title(f"fold at t = {c.frames * c.dt:.2f} s")
    ax.legend(fontsize=7, loc="upper left")

    ax = fig.add_subplot(1, 3, 2)
    column = cols // 2
    cmap = plt.get_cmap("viridis")
    snapshots = np.linspace(0, c.frames - 1, 6).astype(int)
    for k, frame in enumerate(snapshots):
        g = xs[frame].reshape(rows, cols, 3)[:, column]
        ax.plot(g[:, 2], g[:, 1], "o-", ms=3, color=cmap(k / (len(snapshots) - 1)), label=f"t = {(frame + 1) * c.dt:.2f} s")
    ax.plot(target[column, 2], target[column, 1], "x", color="tab:green", ms=10, mew=2, label="target")
    ax.axhline(0.0, color="k", lw=1)
    ax.set_xlabel("z (m)")
    ax.set_ylabel("y (m)")
    ax.set_aspect("equal")
    ax.set_title(f"side view of column {column} (trained policy)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)

    ax = fig.add_subplot(1, 3, 3)
    t = np.arange(1, c.frames + 1) * c.dt
    for g, style in zip(range(forces.shape[1]), ("-", "--")):
        for axis, color in zip(range(3), ("tab:red", "tab:green", "tab:blue")):
            ax.plot(t, forces[:, g, axis], style, color=color, lw=1.2, label=f"corner {g} f{'xyz'[axis]}")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("force (N)")
    ax.set_title("policy forces on the grasped corners")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, alpha=0.3)
    common.save_figure(fig, path)
