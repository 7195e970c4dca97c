"""The cloth identification problem that ``warpnn-train cloth`` solves on one device
(:mod:`warpnn_train.cloth_sysid`) and on several (:mod:`warpnn_train.data_parallel`): its configuration,
scene, loss terms, parameters, optimiser and checkpoint format."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from warpnn_models.cloth import SPRING_KINDS, Cloth, ClothGrid, make_cloth_grid

from . import common
from .options import SysIdConfig  # noqa: F401 - also this module's name, as before options.py

CHECKPOINT = "checkpoint.eqx"


def make_scene(config: SysIdConfig) -> tuple[ClothGrid, Cloth, jax.Array, jax.Array]:
    """The cloth of ``config`` at rest: ``(grid, true_cloth, x0 (n, 3), free (n, 1))``; ``free`` masks out pins."""
    grid = make_cloth_grid(config.rows, config.cols, spacing=config.spacing, origin=(0.0, config.height, 0.0),
                           plane="xz", mass=config.mass, pinned="top-corners")
    true_cloth = Cloth.from_grid(grid, stiffness=config.true_stiffness, damping=config.true_damping,
                                 dt=config.dt, drag=config.drag, backend=config.backend)
    free = jnp.asarray(grid.inv_mass > 0, jnp.float32)[:, None]
    return grid, true_cloth, jnp.asarray(grid.positions), free


def with_log_params(cloth: Cloth, theta: dict[str, jax.Array]) -> Cloth:
    """``cloth`` with stiffness = exp(theta['log_stiffness']), damping = exp(theta['log_damping'])."""
    return dataclasses.replace(cloth, stiffness=jnp.exp(theta["log_stiffness"]), damping=jnp.exp(theta["log_damping"]))


def data_scales(task) -> tuple[float, float]:
    """Mean squared displacement and speed of the observations: the loss's normalisers (constants of the data)."""
    return (float(jnp.mean(jnp.sum((task.xs_obs - task.x0) ** 2, -1))), float(jnp.mean(jnp.sum(task.vs_obs**2, -1))))


def trajectory_error(xs, vs, xs_obs, vs_obs, scales: tuple[float, float], velocity_weight: float) -> jax.Array:
    """Normalised position error plus weighted normalised velocity error, averaged over every frame given."""
    position_error = jnp.mean(jnp.sum((xs - xs_obs) ** 2, -1)) / scales[0]
    # Velocities weigh the fast, quickly damped stretch oscillations that positions barely show.
    velocity_error = jnp.mean(jnp.sum((vs - vs_obs) ** 2, -1)) / scales[1]
    return position_error + velocity_weight * velocity_error


def initial_theta(config: SysIdConfig) -> dict[str, jax.Array]:
    return {
        "log_stiffness": jnp.log(jnp.asarray(config.guess_stiffness, jnp.float32)),
        "log_damping": jnp.log(jnp.asarray(config.guess_damping, jnp.float32)),
    }


def relative_errors(theta, config: SysIdConfig) -> dict[str, np.ndarray]:
    """|fitted / true - 1| per material, for stiffness and damping."""
    return {
        "stiffness": np.abs(np.exp(np.asarray(theta["log_stiffness"])) / np.asarray(config.true_stiffness) - 1.0),
        "damping": np.abs(np.exp(np.asarray(theta["log_damping"])) / np.asarray(config.true_damping) - 1.0),
    }


def error_metrics(theta, config: SysIdConfig) -> dict[str, Any]:
    """metrics.json's parameter errors: the largest relative error and each one by parameter and material."""
    errors = relative_errors(theta, config)
    return {
        "max_rel_error": float(max(errors["stiffness"].max(), errors["damping"].max())),
        "rel_error": {f"{name}_{kind}": float(errors[name][m]) for name in ("stiffness", "damping")
                      for m, kind in enumerate(SPRING_KINDS)},
    }


def make_optimizer(config: SysIdConfig, steps: int) -> optax.GradientTransformation:
    """Adam on the log-parameters with a cosine-decayed learning rate over ``steps`` steps."""
    return optax.adam(optax.cosine_decay_schedule(config.lr, max(steps, 1), alpha=0.01))


def checkpoint_tree(cloth: Cloth, theta, opt_state, step: int, losses: list[float], trail: list, steps: int) -> dict:
    """What a checkpoint holds: the fitted cloth, log-parameters, optimiser state, steps done, and the loss and
    parameter history so far (fixed shapes: ``steps`` losses, ``steps + 1`` parameter rows, NaN-padded)."""
    return {"cloth": cloth, "theta": theta, "opt_state": opt_state, "step": jnp.asarray(step),
            "losses": common.losses_array(losses, steps), "trail": common.trail_arrays(theta, trail, steps)}


def checkpoint_bytes(tree: dict) -> bytes:
    """A :func:`checkpoint_tree` as Equinox-serialised bytes."""
    buf = io.BytesIO()
    eqx.tree_serialise_leaves(buf, tree)
    return buf.getvalue()


def load_checkpoint(path, like_cloth: Cloth, config: SysIdConfig = SysIdConfig()) -> dict:
    """Read a checkpoint of a run of ``config`` (its ``steps`` fix the history's shapes); ``like_cloth`` gives
    the cloth's pytree structure (any cloth of the same grid).

    Returns the :func:`checkpoint_tree` dict; ``trail`` rows past ``step`` are NaN.
    """
    theta = initial_theta(config)
    optimizer = make_optimizer(config, config.steps)
    like = checkpoint_tree(like_cloth, theta, optimizer.init(theta), 0, [], [], config.steps)
    with open(path, "rb") as f:
        return eqx.tree_deserialise_leaves(f, like)


def fit_start(config: SysIdConfig, optimizer: optax.GradientTransformation, resume_from: dict | None):
    """Where a fit starts: ``(theta, opt_state, start, losses, trail)``, from the initial guess or from the
    checkpoint ``resume_from`` (its parameters, optimiser state, step, losses and parameter history)."""
    if resume_from is None:
        theta = initial_theta(config)
        return theta, optimizer.init(theta), 0, [], [theta]
    start = int(resume_from["step"])
    return (resume_from["theta"], resume_from["opt_state"], start, common.losses_list(resume_from["losses"], start),
            trail_rows(resume_from))


def fit_in(out: common.RunDir, task, fit: Callable[..., dict[str, Any]]) -> tuple[dict[str, Any], dict | None]:
    """Fit in the run folder ``out``: resume from its checkpoint under ``--resume``, checkpoint there as
    ``--checkpoint-every`` and ``--stop-after`` say, and write the final checkpoint after ``config.steps``.

    ``fit(resume_from=, save=, checkpoint_every=, stop_after=)`` is the task's fit with ``task`` bound.
    Returns its result, with ``theta`` and ``opt_state`` on the host, and the checkpoint it resumed from (None
    for a fresh run).
    """
    config = task.config
    resume_from = (common.read_checkpoint(out / CHECKPOINT, lambda path: load_checkpoint(path, task.true_cloth, config))
                   if out.resume else None)

    def save(tree: dict) -> None:
        common.atomic_write_bytes(out / CHECKPOINT, checkpoint_bytes(tree))

    result = fit(resume_from=resume_from, save=save, checkpoint_every=out.checkpoint_every, stop_after=out.stop_after)
    result["theta"], result["opt_state"] = jax.device_get((result["theta"], result["opt_state"]))
    save(checkpoint_tree(with_log_params(task.true_cloth, result["theta"]), result["theta"], result["opt_state"],
                         config.steps, result["losses"], result["trail"], config.steps))
    return result, resume_from


def trail_rows(checkpoint: dict) -> list[dict[str, jax.Array]]:
    """The per-step log-parameters of a checkpoint, steps 0 .. step (inclusive): the history to continue."""
    step = int(checkpoint["step"])
    return [{name: jnp.asarray(rows[k]) for name, rows in checkpoint["trail"].items()} for k in range(step + 1)]
