"""``warpnn-train mujoco``: identify a MuJoCo arm's link masses and joint damping through MuJoCo Warp in JAX.

A 2-link arm hangs in a vertical plane under gravity, driven by two motors with a known excitation (sums of
sines). MuJoCo C (``mujoco.mj_step``, float64) records its joint angles and velocities over 1.5 s under hidden link
masses and joint damping. From that recording, Adam recovers the four parameters in log space, starting from a
guess off by 2-6x: every rollout is ``mujoco_warp.step`` replayed in JAX (``warpnn_models.mujoco.MujocoStep``,
unmodified mujoco_warp), and the gradient flows through its kernels' adjoints, warpnn's proofs and the rules for
its inertia solve and constraint solver (``warpnn.StageRule``). The arm has no contact or limit, so the solver
passes the smooth acceleration on (``opt.iterations`` is 4: a replay runs every iteration mujoco_warp would).

The default run (400 Adam steps, ~30 s on a 2-core CPU) recovers the four parameters to ~1e-6 relative and
cuts the loss by more than 1e10x: MuJoCo Warp in float32 replays MuJoCo C's float64 recording to ~2e-7 rad.
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

from . import common, options
from .options import ArmConfig

CHECKPOINT = "checkpoint.eqx"
PARAMETERS = ("mass", "damping")

ARM = """
<mujoco model="arm">
  <option timestep="{timestep}" iterations="4"><flag contact="disable"/></option>
  <worldbody>
    <body name="upper">
      <joint name="shoulder" type="hinge" axis="0 1 0"/>
      <geom type="capsule" fromto="0 0 0 0.5 0 0" size="0.05"/>
      <body name="fore" pos="0.5 0 0">
        <joint name="elbow" type="hinge" axis="0 1 0"/>
        <geom type="capsule" fromto="0 0 0 0.5 0 0" size="0.04"/>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor joint="shoulder"/>
    <motor joint="elbow"/>
  </actuator>
</mujoco>
"""
START_QPOS = (0.3, -0.5)

add_arguments = options.add_mujoco_arguments  # the options live in options.py: parsed before JAX loads


def config_from_args(args: argparse.Namespace) -> ArmConfig:
    return options.config_from_args(ArmConfig, args)


@dataclasses.dataclass
class Task:
    """An identification problem: the arm's step, the excitation, and MuJoCo C's recording of it."""

    config: ArmConfig
    step: Any  # warpnn_models.mujoco.MujocoStep
    ctrls: np.ndarray  # (frames, 1, 2) motor torques
    qpos_obs: np.ndarray  # (frames, 2) joint angles after each step
    qvel_obs: np.ndarray  # (frames, 2)


def excitation(config: ArmConfig) -> np.ndarray:
    """Motor torques over the rollout: a few sines per motor, rich enough to separate inertia from damping."""
    t = np.arange(config.frames)[:, None] * config.timestep
    shoulder = 1.5 * np.sin(2 * np.pi * 0.9 * t) + 0.8 * np.sin(2 * np.pi * 2.3 * t)
    elbow = 0.6 * np.sin(2 * np.pi * 1.7 * t + 1.0) + 0.3 * np.sin(2 * np.pi * 3.1 * t)
    return np.concatenate([shoulder, elbow], 1)[:, None, :].astype(np.float32)


def arm_model(config: ArmConfig, mass, damping):
    import mujoco

    mjm = mujoco.MjModel.from_xml_string(ARM.format(timestep=config.timestep))
    mjm.body_mass[1:] = mass
    mjm.dof_damping[:] = damping
    return mjm


def record(config: ArmConfig, ctrls: np.ndarray, mass, damping) -> tuple[np.ndarray, np.ndarray]:
    """MuJoCo C (float64) under the hidden parameters: joint angles and velocities after each step."""
    import mujoco

    mjm = arm_model(config, mass, damping)
    d = mujoco.MjData(mjm)
    d.qpos[:] = START_QPOS
    qpos, qvel = [], []
    for ctrl in ctrls:
        d.ctrl[:] = ctrl[0]
        mujoco.mj_step(mjm, d)
        qpos.append(d.qpos.copy())
        qvel.append(d.qvel.copy())
    return np.stack(qpos), np.stack(qvel)


def make_task(config: ArmConfig = ArmConfig()) -> Task:
    import mujoco

    from warpnn_models.mujoco import MujocoStep

    ctrls = excitation(config)
    qpos_obs, qvel_obs = record(config, ctrls, config.true_mass, config.true_damping)
    mjm = arm_model(config, config.guess_mass, config.guess_damping)  # (its values are inputs of every call)
    mjd = mujoco.MjData(mjm)
    mjd.qpos[:] = START_QPOS
    mujoco.mj_forward(mjm, mjd)
    step = MujocoStep(mjm, mjd, param_fields=("body_mass", "dof_damping"))
    return Task(config, step, ctrls, qpos_obs, qvel_obs)


def initial_theta(config: ArmConfig) -> dict[str, jax.Array]:
    return {f"log_{name}": jnp.log(jnp.asarray(getattr(config, f"guess_{name}"), jnp.float32)) for name in PARAMETERS}


def params_of(task: Task, theta) -> dict[str, jax.Array]:
    """mujoco_warp's Model arrays for the log-parameters ``theta`` (the world body's mass stays 0)."""
    base = task.step.initial_params()
    return {"body_mass": base["body_mass"].at[..., 1:].set(jnp.exp(theta["log_mass"])),
            "dof_damping": jnp.exp(theta["log_damping"]).reshape(base["dof_damping"].shape)}


def simulate(task: Task, theta) -> tuple[jax.Array, jax.Array]:
    """The arm's joint angles and velocities after each step, (frames, 2) each, under ``theta``."""
    from warpnn_models.mujoco import rollout

    _, trajectory = rollout(task.step, task.step.initial_state(), {"ctrl": jnp.asarray(task.ctrls)},
                            params_of(task, theta))
    return trajectory["qpos"][:, 0], trajectory["qvel"][:, 0]


def make_loss(task: Task):
    """Squared joint-angle error plus weighted squared velocity error, averaged over the rollout, each normalised
    by the recording's mean square."""
    qpos_obs, qvel_obs = jnp.asarray(task.qpos_obs, jnp.float32), jnp.asarray(task.qvel_obs, jnp.float32)
    scales = float(np.mean(task.qpos_obs**2)), float(np.mean(task.qvel_obs**2))

    def loss(theta):
        qpos, qvel = simulate(task, theta)
        return (jnp.mean((qpos - qpos_obs) ** 2) / scales[0]
                + task.config.velocity_weight * jnp.mean((qvel - qvel_obs) ** 2) / scales[1])

    return loss


def make_optimizer(config: ArmConfig, steps: int) -> optax.GradientTransformation:
    return optax.adam(optax.cosine_decay_schedule(config.lr, max(steps, 1), alpha=0.05))


def checkpoint_tree(theta, opt_state, step: int, losses: list[float], trail: list, steps: int) -> dict:
    """What a checkpoint holds: log-parameters, optimiser state, steps done, and the loss and parameter history so
    far (fixed shapes: ``steps`` losses, ``steps + 1`` parameter rows, NaN-padded)."""
    return {"theta": theta, "opt_state": opt_state, "step": jnp.asarray(step),
            "losses": common.losses_array(losses, steps), "trail": common.trail_arrays(theta, trail, steps)}


def load_checkpoint(path, config: ArmConfig = ArmConfig()) -> dict:
    theta = initial_theta(config)
    like = checkpoint_tree(theta, make_optimizer(config, config.steps).init(theta), 0, [], [], config.steps)
    with open(path, "rb") as f:
        return eqx.tree_deserialise_leaves(f, like)


def fit(task: Task, progress: bool = True, *, resume_from: dict | None = None, save=None, checkpoint_every: int = 0,
        stop_after: int | None = None) -> dict[str, Any]:
    """Adam on the log-parameters for ``config.steps`` steps (continuing ``resume_from``, a checkpoint dict);
    ``save(checkpoint_tree)`` every ``checkpoint_every`` steps and when stopped early. Returns ``theta``,
    ``opt_state``, ``losses``, ``trail`` (parameters after each step) and ``steps_per_s``."""
    config = task.config
    optimizer = make_optimizer(config, config.steps)
    update = common.adam_update(make_loss(task), optimizer)
    if resume_from is None:
        theta = initial_theta(config)
        opt_state, start, losses, trail = optimizer.init(theta), 0, [], [theta]
    else:
        start = int(resume_from["step"])
        theta, opt_state = resume_from["theta"], resume_from["opt_state"]
        losses = common.losses_list(resume_from["losses"], start)
        trail = [{n: jnp.asarray(rows[k]) for n, rows in resume_from["trail"].items()} for k in range(start + 1)]

    def step(state):
        theta, opt_state, value = update(*state)
        trail.append(theta)
        return (theta, opt_state), value

    def checkpoint(state, done: int, new_losses: list[float]) -> None:
        save(checkpoint_tree(*state, done, losses + new_losses, trail, config.steps))

    (theta, opt_state), new_losses, steps_per_s = common.train_loop(
        step, (theta, opt_state), config.steps, "mujoco arm sysid", start=start, progress=progress,
        checkpoint=checkpoint if save is not None else None, checkpoint_every=checkpoint_every, stop_after=stop_after)
    theta, opt_state = jax.device_get((theta, opt_state))
    return {"theta": theta, "opt_state": opt_state, "losses": losses + new_losses, "trail": trail,
            "steps_per_s": steps_per_s}


def fitted_values(theta) -> dict[str, np.ndarray]:
    return {name: np.exp(np.asarray(theta[f"log_{name}"])) for name in PARAMETERS}


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = config_from_args(args)
    out = common.run_dir(args, config)
    t0 = time.perf_counter()
    task = make_task(config)
    resume_from = (common.read_checkpoint(out / CHECKPOINT, lambda path: load_checkpoint(path, config))
                   if out.resume else None)

    def save(tree: dict) -> None:
        buffer = io.BytesIO()
        eqx.tree_serialise_leaves(buffer, tree)
        common.atomic_write_bytes(out / CHECKPOINT, buffer.getvalue())

    result = fit(task, resume_from=resume_from, save=save, checkpoint_every=out.checkpoint_every,
                 stop_after=out.stop_after)
    save(checkpoint_tree(result["theta"], result["opt_state"], config.steps, result["losses"], result["trail"],
                         config.steps))
    fitted = fitted_values(result["theta"])
    errors = {name: np.abs(fitted[name] / np.asarray(getattr(config, f"true_{name}")) - 1.0) for name in PARAMETERS}
    run_jit = jax.jit(lambda theta: simulate(task, theta))
    qpos_guess, _ = run_jit(initial_theta(config))
    qpos_fit, _ = run_jit(result["theta"])
    metrics = {
        "task": "mujoco_sysid",
        "config": dataclasses.asdict(config),
        "seed": args.seed,
        "initial_loss": result["losses"][0],
        "final_loss": result["losses"][-1],
        "loss_reduction": result["losses"][0] / max(result["losses"][-1], 1e-30),
        "fitted": fitted,
        "true": {name: getattr(config, f"true_{name}") for name in PARAMETERS},
        "max_rel_error": float(max(e.max() for e in errors.values())),
        "initial_qpos_rmse_rad": float(np.sqrt(np.mean((np.asarray(qpos_guess) - task.qpos_obs) ** 2))),
        "final_qpos_rmse_rad": float(np.sqrt(np.mean((np.asarray(qpos_fit) - task.qpos_obs) ** 2))),
        "steps": config.steps,
        "resumed_from_step": int(resume_from["step"]) if resume_from is not None else None,
        "steps_per_s": result["steps_per_s"],
        "launches_per_step": task.step.program.num_launches,
        "simulator": "mujoco_warp.step (unmodified), replayed by warpnn.trace; data from mujoco.mj_step",
        "wall_time_s": time.perf_counter() - t0,
        **common.environment(),
    }
    for package in ("mujoco", "mujoco-warp"):
        metrics["versions"][package] = common.package_version(package)
    common.write_json(out / "metrics.json", metrics)
    common.plot_loss(out / "loss.png", result["losses"], "MuJoCo arm identification: trajectory loss")
    plot_parameters(out / "parameters.png", result["trail"], config)
    plot_trajectory(out / "trajectory.png", task, np.asarray(qpos_guess), np.asarray(qpos_fit))
    return metrics


def plot_parameters(path, trail: list, config: ArmConfig) -> None:
    """Each parameter against the optimisation step, with its hidden value dashed."""
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, name, unit in ((axes[0], "mass", "kg"), (axes[1], "damping", "N m s/rad")):
        history = np.exp(np.stack([np.asarray(t[f"log_{name}"]) for t in trail]))
        for k, (label, color) in enumerate((("upper arm / shoulder", "tab:blue"), ("forearm / elbow", "tab:orange"))):
            ax.plot(history[:, k], color=color, label=f"{label}: fit")
            ax.axhline(getattr(config, f"true_{name}")[k], color=color, ls="--", lw=1, label=f"{label}: hidden")
        ax.set_xlabel("step")
        ax.set_ylabel(f"{name} ({unit})")
        ax.set_title(f"{name}: fit vs hidden value")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    common.save_figure(fig, path)


def plot_trajectory(path, task: Task, qpos_guess: np.ndarray, qpos_fit: np.ndarray) -> None:
    """Joint angles over time: MuJoCo C's recording, the initial guess and the fit (MuJoCo Warp in JAX)."""
    plt = common.pyplot()
    t = np.arange(1, task.config.frames + 1) * task.config.timestep
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k, (ax, joint) in enumerate(zip(axes, ("shoulder", "elbow"))):
        ax.plot(t, task.qpos_obs[:, k], color="black", label="recorded (mujoco.mj_step, hidden parameters)")
        ax.plot(t, qpos_guess[:, k], ":", color="tab:red", label="initial guess (MuJoCo Warp in JAX)")
        ax.plot(t, qpos_fit[:, k], "--", color="tab:blue", label="fitted (MuJoCo Warp in JAX)")
        ax.set_xlabel("time (s)")
        ax.set_ylabel(f"{joint} angle (rad)")
        ax.set_title(f"{joint} joint")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    common.save_figure(fig, path)
