"""``warpnn-train cloth``: system identification of a mass-spring cloth through a differentiable Warp rollout.

A 10 x 10 cloth pinned at two corners starts flat, with a random (seeded) velocity kick that excites its
fast stretch modes, and falls and swings for 200 steps under hidden ground-truth stiffness and damping of
its three materials (stretch, shear and bend springs). From that trajectory alone (the observed
positions and velocities, plus the known initial state and scene), Adam recovers the six parameters in
log space, starting from the same uninformed guess for every material. The gradient of the trajectory
loss flows through ``lax.scan`` and the Warp adjoint kernels.

The default task recovers all six parameters to well under 1% (5% is the acceptance bar) in 250 steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from warpnn_models.cloth import SPRING_KINDS, Cloth, ClothGrid

from . import common, data_parallel, options
from .cloth_problem import (  # noqa: F401 - also this task's public names, as before the split
    CHECKPOINT,
    SysIdConfig,
    checkpoint_bytes,
    checkpoint_tree,
    data_scales,
    error_metrics,
    fit_in,
    fit_start,
    initial_theta,
    load_checkpoint,
    make_optimizer,
    make_scene,
    relative_errors,
    trail_rows,
    trajectory_error,
    with_log_params,
)


add_arguments = options.add_cloth_arguments  # the options live in options.py: parsed before JAX loads


def config_from_args(args: argparse.Namespace) -> SysIdConfig:
    return options.config_from_args(SysIdConfig, args)


# --------------------------------------------------------------------------------------------------
# The task: data generation, loss, fit.


@dataclasses.dataclass
class Task:
    """A generated identification problem.

    Attributes:
        grid: the cloth grid.
        true_cloth: the cloth with hidden parameters that generated the data.
        x0, v0: (n, 3) known initial state.
        xs_obs, vs_obs: (T, n, 3) observed positions and velocities.
    """

    config: SysIdConfig
    grid: ClothGrid
    true_cloth: Cloth
    x0: jax.Array
    v0: jax.Array
    xs_obs: jax.Array
    vs_obs: jax.Array


def make_task(config: SysIdConfig = SysIdConfig(), seed: int = 0) -> Task:
    """Simulate the observed trajectory under the hidden parameters of ``config``."""
    grid, true_cloth, x0, free = make_scene(config)
    v0 = config.kick * jax.random.normal(jax.random.PRNGKey(seed), x0.shape, jnp.float32) * free
    xs_obs, vs_obs = simulate(true_cloth, x0, v0, config.frames)
    return Task(config, grid, true_cloth, x0, v0, xs_obs, vs_obs)


@eqx.filter_jit
def simulate(cloth: Cloth, x0, v0, frames: int):
    return cloth.rollout(x0, v0, num_steps=frames)


def make_loss(task: Task):
    """Trajectory loss: position and velocity errors over all frames, each normalised by the data's scale."""
    scales, weight = data_scales(task), task.config.velocity_weight

    def loss(theta):
        xs, vs = with_log_params(task.true_cloth, theta).rollout(task.x0, task.v0, num_steps=task.config.frames)
        return trajectory_error(xs, vs, task.xs_obs, task.vs_obs, scales, weight)

    return loss


def fit(
    task: Task,
    steps: int | None = None,
    progress: bool = True,
    *,
    resume_from: dict | None = None,
    save: Any = None,
    checkpoint_every: int = 0,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Recover stiffness and damping from ``task``'s trajectory with Adam (cosine-decayed) in log space.

    Args:
        task: from :func:`make_task`.
        steps: optimisation steps (default: the config's).
        progress: show a progress bar.
        resume_from: a checkpoint (:func:`load_checkpoint`) to continue from: its parameters, optimiser
            state, step and history.
        save: ``save(checkpoint_tree)``, called every ``checkpoint_every`` steps and when the fit stops early.
        stop_after: stop after this step (raises :class:`warpnn_train.common.Stopped` once saved).

    Returns:
        A dict with ``theta`` (final log-parameters), ``opt_state``, ``losses`` (per step),
        ``history`` (per-step parameters, {'stiffness': (steps + 1, m), 'damping': (steps + 1, m)}) and
        ``steps_per_s`` (of the steps run in this call).
    """
    config = task.config
    steps = config.steps if steps is None else steps
    optimizer = make_optimizer(config, steps)
    update = common.adam_update(make_loss(task), optimizer)

    theta, opt_state, start, losses, trail = fit_start(config, optimizer, resume_from)

    def step(state):
        theta, opt_state = state
        theta, opt_state, value = update(theta, opt_state)
        trail.append(theta)  # device arrays; read back once at the end
        return (theta, opt_state), value

    def checkpoint(state, done: int, new_losses: list[float]) -> None:
        theta, opt_state = state
        save(checkpoint_tree(with_log_params(task.true_cloth, theta), theta, opt_state, done, losses + new_losses,
                             trail, steps))

    (theta, opt_state), new_losses, steps_per_s = common.train_loop(
        step, (theta, opt_state), steps, "cloth sysid", start=start, progress=progress,
        checkpoint=checkpoint if save is not None else None, checkpoint_every=checkpoint_every, stop_after=stop_after)
    losses = losses + new_losses
    history = {
        "stiffness": np.exp(np.stack([np.asarray(t["log_stiffness"]) for t in trail])),
        "damping": np.exp(np.stack([np.asarray(t["log_damping"]) for t in trail])),
    }
    return {"theta": theta, "opt_state": opt_state, "losses": losses, "history": history, "steps_per_s": steps_per_s,
            "trail": trail}


# --------------------------------------------------------------------------------------------------
# The main job: fit (or continue a fit), then checkpoint, metrics.json and figures.


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = config_from_args(args)
    if getattr(args, "devices", None):  # a batch of cloths split over devices: warpnn_train.data_parallel
        return data_parallel.run(args, config)
    out = common.run_dir(args, config)
    t0 = time.perf_counter()
    task = make_task(config, seed=args.seed)
    result, resume_from = fit_in(out, task, functools.partial(fit, task))
    theta = result["theta"]
    fitted = with_log_params(task.true_cloth, theta)

    guess = with_log_params(task.true_cloth, initial_theta(config))
    xs_guess, _ = simulate(guess, task.x0, task.v0, config.frames)
    xs_fit, _ = simulate(fitted, task.x0, task.v0, config.frames)
    fitted_stiffness = np.exp(np.asarray(theta["log_stiffness"]))
    fitted_damping = np.exp(np.asarray(theta["log_damping"]))
    metrics = {
        "task": "cloth_sysid",
        "config": dataclasses.asdict(config),
        "seed": args.seed,
        "initial_loss": result["losses"][0],
        "final_loss": result["losses"][-1],
        **error_metrics(theta, config),
        "fitted": {"stiffness": fitted_stiffness, "damping": fitted_damping},
        "true": {"stiffness": config.true_stiffness, "damping": config.true_damping},
        "final_position_rmse": float(jnp.sqrt(jnp.mean(jnp.sum((xs_fit - task.xs_obs) ** 2, -1)))),
        "initial_position_rmse": float(jnp.sqrt(jnp.mean(jnp.sum((xs_guess - task.xs_obs) ** 2, -1)))),
        "steps": config.steps,
        "resumed_from_step": int(resume_from["step"]) if resume_from is not None else None,
        "steps_per_s": result["steps_per_s"],
        "particles": task.grid.positions.shape[0],
        "springs": task.grid.springs.shape[0],
        "wall_time_s": time.perf_counter() - t0,
        **common.environment(),
    }
    common.write_json(out / "metrics.json", metrics)
    common.plot_loss(out / "loss.png", result["losses"], "cloth sysid: trajectory loss")
    plot_parameters(out / "parameters.png", result["history"], config)
    plot_cloth(out / "cloth.png", task, np.asarray(xs_guess), np.asarray(xs_fit))
    return metrics


# --------------------------------------------------------------------------------------------------
# Figures.

_KIND_COLORS = ("tab:blue", "tab:orange", "tab:green")


def plot_parameters(path, history: dict[str, np.ndarray], config: SysIdConfig) -> None:
    """Stiffness and damping of each material against the step (hidden values dashed), and relative errors."""
    plt = common.pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, name, truth in ((axes[0], "stiffness", config.true_stiffness), (axes[1], "damping", config.true_damping)):
        for m, kind in enumerate(SPRING_KINDS):
            ax.semilogy(history[name][:, m], color=_KIND_COLORS[m], label=f"{kind} fit")
            ax.axhline(truth[m], color=_KIND_COLORS[m], ls="--", lw=1, label=f"{kind} true")
        ax.set_xlabel("step")
        ax.set_ylabel(name + (" (N/m)" if name == "stiffness" else " (N s/m)"))
        ax.set_title(f"{name} per material: fit vs hidden truth")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, ncol=3, loc="best")
    ax = axes[2]
    for name, truth, ls in (("stiffness", config.true_stiffness, "-"), ("damping", config.true_damping, "--")):
        rel = np.abs(history[name] / np.asarray(truth) - 1.0)
        for m, kind in enumerate(SPRING_KINDS):
            ax.semilogy(np.maximum(rel[:, m], 1e-7), color=_KIND_COLORS[m], ls=ls, label=f"{kind} {name}")
    ax.axhline(0.05, color="gray", lw=1, ls=":", label="5% bar")
    ax.set_xlabel("step")
    ax.set_ylabel("|fit / true - 1|")
    ax.set_title("relative parameter error")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    common.save_figure(fig, path)


def plot_cloth(path, task: Task, xs_guess: np.ndarray, xs_fit: np.ndarray) -> None:
    """The cloth at two frames (3-D wireframes) and the height of a free corner over time."""
    plt = common.pyplot()

    config, grid = task.config, task.grid
    xs_obs = np.asarray(task.xs_obs)
    rows, cols = grid.rows, grid.cols
    frames = [config.frames // 2 - 1, config.frames - 1]
    runs = (("initial guess", xs_guess, "tab:red", ":"), ("ground truth", xs_obs, "black", "-"),
            ("fitted", xs_fit, "tab:blue", "--"))

    # One box for both 3-D panels, with equal scale on every axis, so shapes are not distorted.
    everything = np.concatenate([xs[frames].reshape(-1, 3) for _, xs, _, _ in runs] + [grid.positions])
    lo, hi = everything.min(0), everything.max(0)

    fig = plt.figure(figsize=(15, 5))
    for k, frame in enumerate(frames):
        ax = fig.add_subplot(1, 3, k + 1, projection="3d")
        for label, xs, color, ls in runs:
            p = xs[frame].reshape(rows, cols, 3)
            # Plot (x, z, y) so that y, the up axis of the simulation, is drawn vertically.
            for r in range(rows):
                ax.plot(p[r, :, 0], p[r, :, 2], p[r, :, 1], color=color, ls=ls, lw=0.9, label=label if r == 0 else None)
            for c in range(cols):
                ax.plot(p[:, c, 0], p[:, c, 2], p[:, c, 1], color=color, ls=ls, lw=0.9)
        pins = np.flatnonzero(grid.inv_mass == 0)
        ax.scatter(grid.positions[pins, 0], grid.positions[pins, 2], grid.positions[pins, 1], color="k", s=25,
                   marker="^", label="pins")
        ax.set_xlabel("x")
        ax.set_ylabel("z")
        ax.set_zlabel("y (up)")
        ax.set_title(f"t = {(frame + 1) * config.dt:.2f} s (frame {frame + 1})")
        ax.set_xlim(lo[0], hi[0])
        ax.set_ylim(lo[2], hi[2])
        ax.set_zlim(lo[1], hi[1])
        ax.set_box_aspect((hi[0] - lo[0], hi[2] - lo[2], hi[1] - lo[1]))
        for axis in (ax.xaxis, ax.yaxis, ax.zaxis):
            axis.set_major_locator(plt.MaxNLocator(4))
        ax.view_init(elev=18, azim=-60)
        if k == 0:
            ax.legend(fontsize=8, loc="upper left")

    ax = fig.add_subplot(1, 3, 3)
    corner = rows * cols - 1  # the free corner opposite a pin
    t = np.arange(1, config.frames + 1) * config.dt
    for label, xs, color, ls in runs:
        ax.plot(t, xs[:, corner, 1], color=color, ls=ls, label=label)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("height y of free corner (m)")
    ax.set_title("free corner trajectory")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    common.save_figure(fig, path)
