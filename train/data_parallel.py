"""Data-parallel cloth system identification: a batch of independent cloths split over a mesh of devices.

The single-cloth task (:mod:`warpnn_train.cloth_sysid`) identifies stiffness and damping from one
trajectory. Here ``num_cloths`` cloths share the hidden materials but start from different random kicks;
the loss is the mean of their trajectory losses, and the batch of cloths is sharded over ``devices``
devices with ``jax.sharding``. Nothing else changes: the step is ``jax.jit`` of ``value_and_grad`` of a
``jax.vmap`` over cloths, and warpnn's Warp calls keep a sharded vmap batch sharded, so each device
simulates and differentiates its own cloths, and XLA ``all-reduce``\\s the six parameter gradients.

Data (initial velocities and observed trajectories) are arguments of the jitted step, never closure
constants: a constant is replicated on every device, an argument keeps its sharding.
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
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from warpnn_models.cloth import Cloth, ClothGrid

from . import common, options
from .cloth_problem import (
    CHECKPOINT,  # noqa: F401 - this task's checkpoint file, as before the fit was shared
    SysIdConfig,
    checkpoint_tree,
    data_scales,
    error_metrics,
    fit_in,
    fit_start,
    make_optimizer,
    make_scene,
    trajectory_error,
    with_log_params,
)

AXIS = "data"


def device_mesh(devices: int | None = None) -> Mesh:
    """A 1-D mesh named ``"data"`` over the first ``devices`` devices of JAX's default backend (all if None)."""
    available = jax.devices()
    devices = len(available) if devices is None else devices
    if not 1 <= devices <= len(available):
        backend = jax.default_backend()
        hint = ("On the CPU, start with XLA_FLAGS=--xla_force_host_platform_device_count=N (warpnn-train --device "
                "cpu --devices N does it for you)." if backend == "cpu" else "Use a machine with more devices.")
        raise ValueError(f"--devices {devices}: JAX sees {len(available)} {backend} device(s), expected 1 to "
                         f"{len(available)}. {hint}")
    # Auto axes: XLA propagates the batch sharding. (In Explicit mode JAX 0.10 cannot vmap a lax.scan whose
    # initial carry is shared by the batch, as every rollout from the one x0 is.)
    return jax.make_mesh((devices,), (AXIS,), devices=available[:devices], axis_types=(jax.sharding.AxisType.Auto,))


def shard_batch(mesh: Mesh, tree):
    """Place every array of ``tree`` on ``mesh`` with its leading (batch) dim split over the devices."""
    return jax.device_put(tree, NamedSharding(mesh, P(AXIS)))


def replicate(mesh: Mesh, tree):
    """Place every array of ``tree`` whole on each device of ``mesh`` (parameters, optimiser state)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


@dataclasses.dataclass
class BatchedTask:
    """``num_cloths`` identification problems with shared hidden materials.

    Attributes:
        grid: the cloth grid (shared).
        true_cloth: the cloth with hidden parameters.
        x0: (n, 3) initial positions (shared). v0: (B, n, 3) initial velocities, one random kick per cloth.
        xs_obs, vs_obs: (B, T, n, 3) observed trajectories.
    """

    config: SysIdConfig
    grid: ClothGrid
    true_cloth: Cloth
    x0: jax.Array
    v0: jax.Array
    xs_obs: jax.Array
    vs_obs: jax.Array

    @property
    def num_cloths(self) -> int:
        return self.v0.shape[0]


def make_batched_task(config: SysIdConfig, num_cloths: int, seed: int = 0, mesh: Mesh | None = None) -> BatchedTask:
    """Simulate the observed trajectories of ``num_cloths`` cloths (sharded over ``mesh`` if given)."""
    grid, true_cloth, x0, free = make_scene(config)
    keys = jax.random.split(jax.random.PRNGKey(seed), num_cloths)
    v0 = np.asarray(config.kick * jax.vmap(lambda k: jax.random.normal(k, x0.shape, jnp.float32))(keys) * free)
    if mesh is not None:
        v0 = shard_batch(mesh, v0)
    xs_obs, vs_obs = simulate_batch(true_cloth, x0, v0, config.frames)
    return BatchedTask(config, grid, true_cloth, x0, v0, xs_obs, vs_obs)


@functools.partial(jax.jit, static_argnames="frames")
def simulate_batch(cloth: Cloth, x0, v0, frames: int):
    """Rollouts of ``cloth`` from one ``x0`` (n, 3) and a batch of ``v0`` (B, n, 3): (B, T, n, 3) each."""
    return jax.vmap(lambda v: cloth.rollout(x0, v, num_steps=frames))(v0)


def make_batched_loss(task: BatchedTask):
    """``loss(theta, v0, xs_obs, vs_obs)``: cloth_sysid's trajectory loss, averaged over the batch of cloths.

    Normalisation scales are those of the whole data set (constants), so the loss of a batch split over
    devices is exactly the loss of the whole batch.
    """
    scales, weight = data_scales(task), task.config.velocity_weight
    frames, cloth, x0 = task.config.frames, task.true_cloth, task.x0

    def loss(theta, v0, xs_obs, vs_obs):
        c = with_log_params(cloth, theta)
        xs, vs = jax.vmap(lambda v: c.rollout(x0, v, num_steps=frames))(v0)
        return trajectory_error(xs, vs, xs_obs, vs_obs, scales, weight)

    return loss


def make_update(task: BatchedTask, optimizer: optax.GradientTransformation):
    """The jitted training step ``(theta, opt_state, v0, xs_obs, vs_obs) -> (theta, opt_state, loss)``."""
    loss = make_batched_loss(task)

    @jax.jit
    def update(theta, opt_state, v0, xs_obs, vs_obs):
        value, grads = jax.value_and_grad(loss)(theta, v0, xs_obs, vs_obs)
        updates, opt_state = optimizer.update(grads, opt_state, theta)
        return optax.apply_updates(theta, updates), opt_state, value

    return update


def fit(task: BatchedTask, mesh: Mesh, steps: int, progress: bool = True, *, resume_from: dict | None = None,
        save=None, checkpoint_every: int = 0, stop_after: int | None = None) -> dict[str, Any]:
    """Adam (cosine-decayed) on the log-parameters with the batch of cloths sharded over ``mesh``.

    ``resume_from``, ``save``, ``checkpoint_every`` and ``stop_after`` work as in
    :func:`warpnn_train.cloth_sysid.fit` (same checkpoint format).

    Returns:
        ``theta``, ``opt_state``, ``losses``, ``trail``, ``steps_per_s`` (compile excluded), and throughput:
        ``cloth_frames_per_s`` (simulated and differentiated frames of all cloths per second) and
        ``cloth_frames_per_s_per_device``.
    """
    config = task.config
    optimizer = make_optimizer(config, steps)
    update = make_update(task, optimizer)
    data = shard_batch(mesh, (task.v0, task.xs_obs, task.vs_obs))
    theta, opt_state, start, losses, trail = fit_start(config, optimizer, resume_from)

    def step(state):
        theta, opt_state = state
        theta, opt_state, value = update(theta, opt_state, *data)
        trail.append(theta)
        return (theta, opt_state), value

    def checkpoint(state, done: int, new_losses: list[float]) -> None:
        theta, opt_state = jax.device_get(state)
        save(checkpoint_tree(with_log_params(task.true_cloth, theta), theta, opt_state, done, losses + new_losses,
                             jax.device_get(trail), steps))

    state = (replicate(mesh, theta), replicate(mesh, opt_state))
    state, new_losses, steps_per_s = common.train_loop(
        step, state, steps, f"cloth sysid x{mesh.size} devices", start=start, progress=progress,
        checkpoint=checkpoint if save is not None else None, checkpoint_every=checkpoint_every, stop_after=stop_after)
    frames = steps_per_s * task.num_cloths * config.frames
    return {"theta": state[0], "opt_state": state[1], "losses": losses + new_losses, "trail": jax.device_get(trail),
            "steps_per_s": steps_per_s, "cloth_frames_per_s": frames,
            "cloth_frames_per_s_per_device": frames / mesh.size}


# --------------------------------------------------------------------------------------------------
# As a main-job option: ``warpnn-train cloth --devices N``.


add_arguments = options.add_data_parallel_arguments


def run(args: argparse.Namespace, config: SysIdConfig) -> dict[str, Any]:
    """Fit on ``args.devices * args.cloths_per_device`` cloths; write checkpoint, metrics.json and loss.png."""
    out = common.run_dir(args, config)
    t0 = time.perf_counter()
    mesh = device_mesh(args.devices)
    if args.cloths_per_device < 1:
        raise ValueError(f"--cloths-per-device must be >= 1, got {args.cloths_per_device}.")
    task = make_batched_task(config, args.cloths_per_device * mesh.size, seed=args.seed, mesh=mesh)
    result, resume_from = fit_in(out, task, functools.partial(fit, task, mesh, config.steps))
    metrics = {
        "task": "cloth_sysid_data_parallel",
        "config": dataclasses.asdict(config),
        "seed": args.seed,
        "devices": mesh.size,
        "device_kind": mesh.devices.flat[0].device_kind,
        "cloths": task.num_cloths,
        "cloths_per_device": args.cloths_per_device,
        "initial_loss": result["losses"][0],
        "final_loss": result["losses"][-1],
        **error_metrics(result["theta"], config),
        "steps": config.steps,
        "resumed_from_step": int(resume_from["step"]) if resume_from is not None else None,
        "steps_per_s": result["steps_per_s"],
        "cloth_frames_per_s": result["cloth_frames_per_s"],
        "cloth_frames_per_s_per_device": result["cloth_frames_per_s_per_device"],
        "particles": task.grid.positions.shape[0],
        "springs": task.grid.springs.shape[0],
        "wall_time_s": time.perf_counter() - t0,
        **common.environment(),
    }
    common.write_json(out / "metrics.json", metrics)
    common.plot_loss(out / "loss.png", result["losses"], f"cloth sysid, {task.num_cloths} cloths on {mesh.size} devices")
    return metrics
