"""``warpnn-train geometry``: deform a template point cloud (a sphere) into a target shape (a torus).

An Equinox MLP displacement field ``x -> x + mlp(x)`` (:class:`warpnn_models.pointcloud.PointDeformer`,
starting at the identity) moves the points of a unit sphere; Adam minimises the symmetric Chamfer
distance between the moved points and points sampled on a torus. The Chamfer distance is the Warp kernel
:func:`warpnn_models.pointcloud.chamfer`: both clouds get a spatial index built inside the jitted step
(the template moves every step), and the gradient reaches the MLP through the nearest-neighbour gathers.

The sphere (genus 0) cannot become a torus (genus 1) continuously, so a few points stay stretched across
the hole; Chamfer still falls about 50x with the defaults (the acceptance bar is 10x), in ~15 s on CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import time
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from warpnn_models.pointcloud import (
    PointDeformer,
    chamfer,
    chamfer_reference,
    nearest_neighbors,
    sphere_points,
    torus_points,
)

from . import common, options
from .options import GeometryConfig  # noqa: F401 - also this task's name, as before options.py


add_arguments = options.add_geometry_arguments  # the options live in options.py: parsed before JAX loads


def config_from_args(args: argparse.Namespace) -> GeometryConfig:
    return options.config_from_args(GeometryConfig, args)


# --------------------------------------------------------------------------------------------------
# The task.


@dataclasses.dataclass
class Task:
    """Template and target clouds: (n, 3) and (m, 3) float32."""

    config: GeometryConfig
    template: jax.Array
    target: jax.Array


def make_task(config: GeometryConfig = GeometryConfig(), seed: int = 0) -> Task:
    template = jnp.asarray(sphere_points(config.template_points))
    target = jnp.asarray(torus_points(config.target_points, config.major, config.minor, seed=seed))
    return Task(config, template, target)


def make_optimizer(config: GeometryConfig, steps: int) -> optax.GradientTransformation:
    """Adam with a cosine-decayed learning rate over ``steps`` steps."""
    return optax.adam(optax.cosine_decay_schedule(config.lr, max(steps, 1), alpha=0.05))


def fit(task: Task, seed: int = 0, steps: int | None = None, progress: bool = True, *,
        resume_from: dict | None = None, save=None, checkpoint_every: int = 0,
        stop_after: int | None = None) -> dict[str, Any]:
    """Train a :class:`PointDeformer` on ``task`` with Adam (cosine-decayed learning rate).

    ``resume_from`` (a :func:`load_checkpoint` dict) continues an earlier fit: model, optimiser state, step
    and losses; ``save(checkpoint_tree)`` is called every ``checkpoint_every`` steps and when the fit stops
    early (after step ``stop_after``).

    Returns:
        A dict with ``model``, ``opt_state``, ``losses`` (one per step) and ``steps_per_s``.
    """
    config = task.config
    steps = config.steps if steps is None else steps
    loss_fn = chamfer if config.loss == "warp" else chamfer_reference
    optimizer = make_optimizer(config, steps)

    @eqx.filter_jit
    def update(model, opt_state):
        value, grads = eqx.filter_value_and_grad(lambda m: loss_fn(m(task.template), task.target))(model)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, value

    def step(state):
        model, opt_state = state
        model, opt_state, value = update(model, opt_state)
        return (model, opt_state), value

    if resume_from is None:
        model = PointDeformer(jax.random.PRNGKey(seed), width=config.width, depth=config.depth)
        state, start, losses = (model, optimizer.init(eqx.filter(model, eqx.is_array))), 0, []
    else:
        state, start = (resume_from["model"], resume_from["opt_state"]), int(resume_from["step"])
        losses = common.losses_list(resume_from["losses"], start)

    def checkpoint(state, done: int, new_losses: list[float]) -> None:
        save(checkpoint_tree(*state, done, losses + new_losses, steps))

    (model, opt_state), new_losses, steps_per_s = common.train_loop(
        step, state, steps, "geometry", start=start, progress=progress,
        checkpoint=checkpoint if save is not None else None, checkpoint_every=checkpoint_every, stop_after=stop_after)
    return {"model": model, "opt_state": opt_state, "losses": losses + new_losses, "steps_per_s": steps_per_s}


# --------------------------------------------------------------------------------------------------
# The main job: fit (or continue a fit), then checkpoint, metrics.json and figures.

CHECKPOINT = "checkpoint.eqx"


def checkpoint_tree(model: PointDeformer, opt_state, step: int, losses: list[float], steps: int) -> dict[str, Any]:
    """What a checkpoint holds: model, optimiser state, steps done and the losses so far (NaN-padded)."""
    return {"model": model, "opt_state": opt_state, "step": jnp.asarray(step),
            "losses": common.losses_array(losses, steps)}


def checkpoint_bytes(tree: dict[str, Any]) -> bytes:
    """A :func:`checkpoint_tree` as Equinox-serialised bytes."""
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, tree)
    return buf.getvalue()


def load_checkpoint(path, config: GeometryConfig = GeometryConfig()) -> dict[str, Any]:
    """Read a checkpoint written by :func:`run` for ``config`` (which gives the model's shape and the steps)."""
    model = PointDeformer(jax.random.PRNGKey(0), width=config.width, depth=config.depth)
    optimizer = make_optimizer(config, config.steps)
    like = checkpoint_tree(model, optimizer.init(eqx.filter(model, eqx.is_array)), 0, [], config.steps)
    with open(path, "rb") as f:
        return eqx.tree_deserialise_leaves(f, like)


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = config_from_args(args)
    out = common.run_dir(args, config)
    t0 = time.perf_counter()
    task = make_task(config, seed=args.seed)
    resume_from = (common.read_checkpoint(out / CHECKPOINT, lambda path: load_checkpoint(path, config))
                   if out.resume else None)
    save = lambda tree: common.atomic_write_bytes(out / CHECKPOINT, checkpoint_bytes(tree))  # noqa: E731
    result = fit(task, seed=args.seed, resume_from=resume_from, save=save, checkpoint_every=out.checkpoint_every,
                 stop_after=out.stop_after)
    model = result["model"]
    save(checkpoint_tree(model, result["opt_state"], config.steps, result["losses"], config.steps))

    final = eqx.filter_jit(lambda m, x: m(x))(model, task.template)
    losses = result["losses"]
    metrics = {
        "task": "geometry",
        "config": dataclasses.asdict(config),
        "seed": args.seed,
        "initial_loss": losses[0],
        "final_loss": losses[-1],
        "loss_reduction": losses[0] / losses[-1],
        # The fitted cloud's Chamfer distance from the Warp kernels and from the pure-JAX brute force: they agree.
        "final_chamfer": float(chamfer(final, task.target)),
        "final_chamfer_reference": float(chamfer_reference(final, task.target)),
        "steps": config.steps,
        "resumed_from_step": int(resume_from["step"]) if resume_from is not None else None,
        "steps_per_s": result["steps_per_s"],
        "wall_time_s": time.perf_counter() - t0,
        **common.environment(),
    }
    common.write_json(out / "metrics.json", metrics)
    common.plot_loss(out / "loss.png", losses, "geometry: Chamfer distance, sphere -> torus")
    plot_clouds(out / "clouds.png", np.asarray(task.template), np.asarray(task.target), np.asarray(final), losses)
    return metrics


def plot_clouds(path, template: np.ndarray, target: np.ndarray, final: np.ndarray, losses: list[float]) -> None:
    """Template, target and fitted clouds as 3-D scatters (shared equal-scale axes), and a top view.

    Fitted points are coloured by their distance to the nearest target point, so misfits stand out.
    """
    plt = common.pyplot()
    from matplotlib.colors import LogNorm

    _, d2 = nearest_neighbors(jnp.asarray(final), jnp.asarray(target))
    error = np.sqrt(np.maximum(np.asarray(d2), 1e-8))
    norm = LogNorm(vmin=max(error.min(), 1e-3), vmax=max(error.max(), 1e-2))
    everything = np.concatenate([template, target, final])
    lo, hi = everything.min(0) - 0.05, everything.max(0) + 0.05

    fig = plt.figure(figsize=(20, 5.2))
    panels = (("template: sphere", template), ("target: torus", target),
              (f"fitted (Chamfer {losses[0]:.3g} -> {losses[-1]:.3g})", final))
    for k, (title, points) in enumerate(panels):
        ax = fig.add_subplot(1, 4, k + 1, projection="3d")
        if k == 2:
            ax.scatter(*target.T, s=1, color="0.7", alpha=0.3, depthshade=False)
            sc = ax.scatter(*points.T, s=3, c=error, cmap="plasma", norm=norm, depthshade=False)
        else:
            # Coloured by height so the 3-D shape reads on paper.
            ax.scatter(*points.T, s=3, c=points[:, 2], cmap="viridis", vmin=lo[2], vmax=hi[2], depthshade=False)
        ax.set_title(title)
        ax.set_xlim(lo[0], hi[0])
        ax.set_ylim(lo[1], hi[1])
        ax.set_zlim(lo[2], hi[2])
        ax.set_box_aspect(hi - lo)  # equal scale on every axis: shapes are not distorted
        ax.set_xlabel("x")
        ax.set_ylabel("y")
        ax.set_zlabel("z")
        for axis in (ax.xaxis, ax.yaxis, ax.zaxis):
            axis.set_major_locator(plt.MaxNLocator(5))
        ax.view_init(elev=30, azim=-60)

    ax = fig.add_subplot(1, 4, 4)
    ax.scatter(target[:, 0], target[:, 1], s=2, color="0.7", label="target")
    sc = ax.scatter(final[:, 0], final[:, 1], s=3, c=error, cmap="plasma", norm=norm, label="fitted")
    ax.set_aspect("equal")
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.set_title("fitted over target, seen from +z")
    ax.legend(fontsize=8, loc="upper right", markerscale=3)
    fig.colorbar(sc, ax=ax, label="distance to nearest target point")
    common.save_figure(fig, path)
