"""warpnn_models.mujoco: ``mujoco_warp.step`` replayed in JAX, against mujoco_warp itself, ``mujoco.mj_step`` and
central finite differences of ``mj_step`` (float64).

mujoco_warp compiles its kernels on first use (tens of seconds on a CPU, cached by Warp afterwards) and every
traced model costs a JAX compile of ~100 launches (~10 s on 2 CPU cores): each model is built once per module
(module-scoped fixtures) and the rollouts are short.
"""

import copy
import re

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest
import warp as wp

mjw = pytest.importorskip("mujoco_warp")
mujoco = pytest.importorskip("mujoco")
pytestmark = pytest.mark.quick_compile  # (tests/conftest.py)

from .helpers import assert_close, on_one_device  # noqa: E402
from mujoco_warp._src import collision_primitive_core as mjw_core, constraint as mjw_constraint  # noqa: E402
from mujoco_warp._src import math as mjw_math, types as mjw_types, util_misc as mjw_util_misc  # noqa: E402
from warpnn_models.mujoco import (  # noqa: E402
    MujocoStep, _inertia_to_dense, _lu_solve, _spd_solve, equinox_module, nnx_module, rollout)

T = 50

# A 2-link arm in a vertical plane with two motors and joint damping. Contacts are off (the links never touch:
# MuJoCo filters parent-child pairs) and so is everything else that would engage the constraint solver.
ARM = """
<mujoco model="arm">
  <option timestep="0.01" iterations="4"><flag contact="disable"/></option>
  <worldbody>
    <body name="upper">
      <joint name="shoulder" type="hinge" axis="0 1 0" damping="0.1"/>
      <geom type="capsule" fromto="0 0 0 0.5 0 0" size="0.05" mass="1"/>
      <body name="fore" pos="0.5 0 0">
        <joint name="elbow" type="hinge" axis="0 1 0" damping="0.1"/>
        <geom type="capsule" fromto="0 0 0 0.5 0 0" size="0.04" mass="0.5"/>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor joint="shoulder" gear="1"/>
    <motor joint="elbow" gear="1"/>
  </actuator>
</mujoco>
"""

# A cart on a rail with a joint limit it hits after ~30 steps (the constraint solver engages) and a free pole.
CARTPOLE = """
<mujoco model="cartpole">
  <option timestep="0.01" iterations="4"><flag contact="disable"/></option>
  <worldbody>
    <body name="cart">
      <joint name="slider" type="slide" axis="1 0 0" limited="true" range="-0.3 0.3" damping="0.05"/>
      <geom type="box" size="0.1 0.05 0.05" mass="1"/>
      <body name="pole">
        <joint name="hinge" type="hinge" axis="0 1 0" damping="0.01"/>
        <geom type="capsule" fromto="0 0 0 0 0 0.6" size="0.02" mass="0.1"/>
      </body>
    </body>
  </worldbody>
  <actuator><motor joint="slider" gear="10" ctrllimited="true" ctrlrange="-1 1"/></actuator>
</mujoco>
"""

# A free box dropped from 0.2 m onto a plane: lands after ~40 of 80 steps (contacts, the constraint solver).
BOX = """
<mujoco model="box">
  <option timestep="0.005" iterations="8"/>
  <worldbody>
    <geom type="plane" size="2 2 0.1"/>
    <body pos="0 0 0.3"><freejoint/><geom type="box" size="0.1 0.1 0.1" mass="1"/></body>
  </worldbody>
</mujoco>
"""

# A floating torso with three limbs (a two-hinge leg, a ball-jointed arm, a sliding tail), springs on the knee and
# the shoulder: branches of the tree share the torso, so mujoco_warp's tree walks are differentiated by rules
# (warpnn_models.mujoco._tree_rules), and its springs and dampers by another (_passive_rule).
TREE = """
<mujoco model="tree">
  <option timestep="0.01" iterations="4"><flag contact="disable"/></option>
  <worldbody>
    <body name="torso" pos="0 0 1">
      <freejoint/>
      <geom type="box" size="0.1 0.1 0.2" mass="2"/>
      <body name="thigh" pos="0.15 0 0.1">
        <joint name="hip" type="hinge" axis="0 1 0" pos="0 0 0.02" damping="0.1"/>
        <geom type="capsule" fromto="0 0 0 0.3 0 0" size="0.04" mass="0.5"/>
        <body name="shin" pos="0.3 0 0">
          <joint name="knee" type="hinge" axis="0 0 1" damping="0.1" stiffness="1" springref="0.2"/>
          <geom type="capsule" fromto="0 0 0 0.3 0 0" size="0.03" mass="0.3"/>
        </body>
      </body>
      <body name="arm" pos="-0.15 0 0.1">
        <joint name="shoulder" type="ball" pos="0 0 0.01" damping="0.05" stiffness="2"/>
        <geom type="capsule" fromto="0 0 0 -0.3 0 0" size="0.04" mass="0.5"/>
      </body>
      <body name="tail" pos="0 0 -0.2">
        <joint name="slide" type="slide" axis="0 0 1" damping="0.2"/>
        <geom type="sphere" size="0.05" mass="0.2"/>
      </body>
    </body>
  </worldbody>
  <actuator>
    <motor joint="hip" gear="1"/><motor joint="knee" gear="1"/>
    <position joint="shoulder" gear="0.3 1 0.5 0 0 0" kp="5"/>
  </actuator>
</mujoco>
"""


# 1 and 10 steps; the 10-step runs of the tree and the capsules, 18 s each of CI's CPU, are marked slow there (the
# box's gradient test runs contacts through 10 and 100 steps, the arm's smooth dynamics through 100)
ONE_AND_TEN_STEPS = [1, pytest.param(10, marks=pytest.mark.slow)]

# A double pendulum with a fixed tendon coupling its joints (a spring, a damper) and a motor on the tendon
TENDON = """
<mujoco>
  <option timestep="0.01"/>
  <worldbody>
    <body>
      <joint name="a" type="hinge" axis="0 1 0" damping="0.1"/>
      <geom type="capsule" size="0.05" fromto="0 0 0 0 0 -0.5" mass="1"/>
      <body pos="0 0 -0.5">
        <joint name="b" type="hinge" axis="0 1 0" damping="0.1"/>
        <geom type="capsule" size="0.05" fromto="0 0 0 0 0 -0.5" mass="1"/>
      </body>
    </body>
  </worldbody>
  <tendon>
    <fixed name="t" stiffness="2" damping="0.3" springlength="0.1">
      <joint joint="a" coef="1"/><joint joint="b" coef="-0.5"/>
    </fixed>
  </tendon>
  <actuator><motor tendon="t" gear="1.5"/></actuator>
</mujoco>
"""
TENDON_PARAMS = ("tendon_stiffness", "tendon_damping", "tendon_lengthspring", "dof_damping", "actuator_gainprm")


def start(xml, qpos=None, qvel=None):
    mjm = mujoco.MjModel.from_xml_string(xml) if isinstance(xml, str) else xml
    mjd = mujoco.MjData(mjm)
    if qpos is not None:
        mjd.qpos[:] = qpos
    if qvel is not None:
        mjd.qvel[:] = qvel
    mujoco.mj_forward(mjm, mjd)
    return mjm, mjd


def arm_controls(steps=T):
    k = np.arange(steps)[:, None]
    return (np.sin(0.1 * k) * [0.5, -0.3]).reshape(steps, 1, 2).astype(np.float32)


def mujoco_warp_loop(mjm, mjd, ctrls=None, steps=T):
    """mujoco_warp run directly (Python launches every kernel): qpos, qvel after each step."""
    m = mjw.put_model(mjm)
    d = mjw.put_data(mjm, mjd, nworld=1)
    qpos, qvel = [], []
    for k in range(steps):
        if ctrls is not None:
            d.ctrl.assign(ctrls[k])
        mjw.step(m, d)
        qpos.append(d.qpos.numpy().copy())
        qvel.append(d.qvel.numpy().copy())
    return np.stack(qpos), np.stack(qvel)


def mj_step_loop(mjm, mjd, ctrls=None, steps=T):
    """MuJoCo C (float64): qpos, qvel after each step, shaped like mujoco_warp's (steps, 1, n)."""
    d = mujoco.MjData(mjm)
    d.qpos[:], d.qvel[:], d.act[:] = mjd.qpos, mjd.qvel, mjd.act
    qpos, qvel = [], []
    for k in range(steps):
        if ctrls is not None:
            d.ctrl[:] = ctrls[k, 0]
        mujoco.mj_step(mjm, d)
        qpos.append(d.qpos.copy()[None])
        qvel.append(d.qvel.copy()[None])
    return np.stack(qpos), np.stack(qvel)


@pytest.fixture(autouse=True)
def on_cpu():
    """mujoco_warp's arrays and the replay on one platform: the CPU here, the GPU on a GPU host."""
    with on_one_device():
        yield


@pytest.fixture(scope="module")
def arm():
    mjm, mjd = start(ARM, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    with on_one_device():
        step = MujocoStep(mjm, mjd, param_fields=("dof_damping", "actuator_gainprm"))
    return step, step.mjm, mjd


@pytest.fixture(scope="module")
def arm_rollout(arm):
    step, _, _ = arm
    with on_one_device():
        run = jax.jit(lambda s, c, p: rollout(step, s, {"ctrl": c}, p))
        return run, run(step.initial_state(), arm_controls(), step.initial_params())


def test_state_carries_what_the_step_reads_back(arm):
    """The default state holds the named fields and every Data array the step writes and reads back, so that
    state_fields without one is refused (a replay would restart it from its trace-time value every step)."""
    step, mjm, _ = arm
    assert step.state_fields[:4] == ("qpos", "qvel", "ctrl", "time")  # the arm has no activations
    assert "qacc_warmstart" in step.state_fields  # the solver's warm start: read, then written for the next step
    assert step.initial_state()["qpos"].shape == (1, mjm.nq)
    with pytest.raises(ValueError, match="qacc_warmstart"):
        MujocoStep(mjm, state_fields=("qpos", "qvel", "ctrl", "time"))


def test_arm_forward_equals_mujoco_warp_and_mj_step(arm, arm_rollout):
    """50 steps under jit + lax.scan with time-varying controls: equal to mujoco_warp.step run directly (measured
    max error 0.0: bit-equal) and within mujoco_warp's own test tolerance (5e-4) of mujoco.mj_step (measured
    2.1e-7 on qpos)."""
    step, mjm, mjd = arm
    _, (final, traj) = arm_rollout
    qpos, qvel = mujoco_warp_loop(mjm, mjd, arm_controls())
    np.testing.assert_allclose(np.asarray(traj["qpos"]), qpos, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(traj["qvel"]), qvel, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(traj["time"])[:, 0], mjm.opt.timestep * np.arange(1, T + 1), rtol=1e-5)
    ref_qpos, ref_qvel = mj_step_loop(mjm, mjd, arm_controls())
    np.testing.assert_allclose(np.asarray(traj["qpos"]), ref_qpos, rtol=0, atol=5e-4)
    np.testing.assert_allclose(np.asarray(traj["qvel"]), ref_qvel, rtol=0, atol=5e-4)
    assert np.abs(ref_qpos[-1] - ref_qpos[0]).max() > 0.1  # the arm moved


def test_arm_params_flow_as_in_mujoco(arm, arm_rollout):
    """Doubled joint damping and actuator gains as ``params``: the replay follows mj_step on the MjModel changed
    the same way (measured 2.5e-7), and differs from the unchanged run."""
    step, mjm, mjd = arm
    run, (_, traj0) = arm_rollout
    params = step.initial_params()
    params = {"dof_damping": params["dof_damping"] * 2.0,
              "actuator_gainprm": params["actuator_gainprm"].at[..., 0].multiply(2.0)}
    _, traj = run(step.initial_state(), arm_controls(), params)
    changed = mujoco.MjModel.from_xml_string(ARM)
    changed.dof_damping[:] *= 2.0
    changed.actuator_gainprm[:, 0] *= 2.0
    ref_qpos, _ = mj_step_loop(changed, mjd, arm_controls())
    np.testing.assert_allclose(np.asarray(traj["qpos"]), ref_qpos, rtol=0, atol=5e-4)
    assert np.abs(np.asarray(traj["qpos"]) - np.asarray(traj0["qpos"])).max() > 1e-3


def test_arm_vmap_equals_single_runs(arm):
    """vmap over 3 initial states (20 steps) equals each state run alone (measured 0.0)."""
    step, _, _ = arm
    s0 = step.initial_state()
    qpos = jnp.stack([s0["qpos"] + 0.2 * k for k in range(3)])
    qvel = jnp.stack([s0["qvel"] - 0.3 * k for k in range(3)])

    def run(q, v):
        return rollout(step, {**s0, "qpos": q, "qvel": v}, num_steps=20)[0]

    batched = jax.jit(jax.vmap(run))(qpos, qvel)
    for k in range(3):
        single = jax.jit(run)(qpos[k], qvel[k])
        for name in ("qpos", "qvel", "time", "qacc_warmstart"):
            np.testing.assert_allclose(np.asarray(batched[name][k]), np.asarray(single[name]), rtol=0, atol=1e-6)
    assert np.abs(np.asarray(batched["qpos"][0] - batched["qpos"][2])).max() > 0.1


@pytest.mark.slow  # (16 s of CI's CPU: the suite's 10 minutes; the forward's vmap test runs there)
def test_arm_vmap_of_the_gradient_equals_single_gradients(arm):
    """jax.vmap of jax.grad through 5 steps over 3 initial states equals each state's gradient alone (measured 0.0):
    the rules' solves (Warp kernels inside lax.custom_linear_solve) batch under vmap."""
    step, _, _ = arm
    s0 = step.initial_state()
    qvel = jnp.stack([s0["qvel"] - 0.3 * k for k in range(3)])

    def loss(v):
        return jnp.sum(jnp.sin(rollout(step, {**s0, "qvel": v}, num_steps=5)[0]["qpos"]))

    batched = jax.jit(jax.vmap(jax.grad(loss)))(qvel)
    single = jax.jit(jax.grad(loss))
    for k in range(3):
        np.testing.assert_allclose(np.asarray(batched[k]), np.asarray(single(qvel[k])), rtol=1e-6, atol=1e-7)
    assert np.abs(np.asarray(batched[0] - batched[2])).max() > 1e-3


def _implicit_tree():
    mjm = mujoco.MjModel.from_xml_string(with_integrator(TREE, "implicit"))
    mjm, mjd = start(mjm, qpos=tree_pose(mjm, [0.9, 0.2, -0.3, 0.1]), qvel=np.linspace(-1.5, 2.0, mjm.nv))
    mjm.body_sameframe[:] = 0  # (see the tree fixture)
    return mjm, mjd


# Scenes whose rules index Model and Data arrays by world (the implicit integrator's Coriolis derivative and LU
# solve, a spatial tendon's length and Jacobian, cameras, magnetometers, energies): (scene, ctrl)
WORLD_AXIS_SCENES = {
    "implicit tree": (_implicit_tree, [0.2, -0.1, 0.3]),
    "spatial tendon": (lambda: start(SPATIAL_TENDON, qpos=[0.3, -0.5], qvel=[0.5, -1.0]), [0.4, -0.3]),
    "more sensors": (lambda: start(MORE_SENSORS, qpos=[0.3, -0.5], qvel=[0.5, -1.0]), [0.3, -0.2]),
}


@pytest.mark.slow  # (two traces each, ~30 s each of a 2-core CPU; the arm's worlds run in CI)
@pytest.mark.parametrize("case", WORLD_AXIS_SCENES)
def test_the_rules_step_and_differentiate_worlds_together(case):
    """Two worlds in one step (``nworld=2``: the rules over the world axis) equal each world stepped alone, forward
    (qpos, qvel, sensordata where the scene has sensors, after 5 steps) and the gradient of a loss on them w.r.t. each world's initial
    velocity."""
    scene, ctrl = WORLD_AXIS_SCENES[case]
    mjm, mjd = scene()
    mjd.ctrl[:] = ctrl
    mujoco.mj_forward(mjm, mjd)
    together, alone = MujocoStep(mjm, mjd, nworld=2), MujocoStep(mjm, mjd)
    qvel = np.asarray(together.initial_state()["qvel"]) * np.array([[1.0], [-0.5]], np.float32)

    def run(step, qvel):
        final = rollout(step, {**step.initial_state(), "qvel": qvel}, num_steps=5)[0]
        return jnp.sum(jnp.sin(final["qpos"])) + jnp.sum(jnp.sin(final.get("sensordata", 0.0))), final

    (_, final), grad = jax.jit(jax.value_and_grad(lambda q: run(together, q), has_aux=True))(jnp.asarray(qvel))
    one = jax.jit(jax.value_and_grad(lambda q: run(alone, q), has_aux=True))
    for w in range(2):
        (_, final_w), grad_w = one(jnp.asarray(qvel[w:w + 1]))
        for name in ("qpos", "qvel", "sensordata")[:3 if mjm.nsensordata else 2]:
            np.testing.assert_allclose(np.asarray(final[name][w:w + 1]), np.asarray(final_w[name]), rtol=1e-6,
                                       atol=1e-6)
        np.testing.assert_allclose(np.asarray(grad[w:w + 1]), np.asarray(grad_w), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(grad[0] - grad[1])).max() > 1e-3  # (the worlds differ)


def test_worlds_step_together_as_in_mujoco_warp(arm):
    """``nworld=3``: one launch per kernel advances three worlds, equal to mujoco_warp stepping the same three
    worlds, and each world to the ``nworld=1`` step run from its state (measured 0.0 and 0.0); so are its
    gradients, and those of ``jax.vmap`` of the one-world step."""
    single, mjm, mjd = arm
    step = MujocoStep(mjm, mjd, nworld=3)
    state = step.initial_state()
    assert state["qpos"].shape == (3, mjm.nq) and step.nworld == 3
    qvel = np.asarray(state["qvel"]) * np.array([[1.0], [0.5], [-1.0]], np.float32)
    ctrls = np.concatenate([arm_controls(20) * k for k in (1.0, -1.0, 0.5)], axis=1)  # (20, 3, nu)
    final, traj = jax.jit(lambda s, c: rollout(step, s, {"ctrl": c}))({**state, "qvel": jnp.asarray(qvel)}, ctrls)

    m = mjw.put_model(mjm)
    d = mjw.put_data(mjm, mjd, nworld=3)
    d.qvel.assign(qvel)
    for k in range(20):
        d.ctrl.assign(ctrls[k])
        mjw.step(m, d)
    np.testing.assert_allclose(np.asarray(final["qpos"]), d.qpos.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(final["qvel"]), d.qvel.numpy(), rtol=0, atol=1e-6)

    s0 = single.initial_state()
    run = jax.jit(lambda s, c: rollout(single, s, {"ctrl": c}, single.initial_params())[0])
    for w in range(3):
        alone = run({**s0, "qvel": jnp.asarray(qvel[w:w + 1])}, ctrls[:, w:w + 1])
        np.testing.assert_allclose(np.asarray(final["qpos"][w:w + 1]), np.asarray(alone["qpos"]), rtol=0, atol=1e-6)
    assert np.abs(np.asarray(final["qpos"][0] - final["qpos"][2])).max() > 0.05  # the worlds differ

    # Gradients: per world, the three-world step (one launch per kernel, the solver's rules over the world axis),
    # jax.vmap of the one-world step and the one-world step alone agree
    def loss(step, qvel, ctrls):
        state = {**step.initial_state(), "qvel": qvel}
        return jnp.sum(rollout(step, state, {"ctrl": ctrls}, step.initial_params() or None)[0]["qpos"] ** 2)

    together = jax.jit(jax.grad(lambda q: loss(step, q, ctrls)))(jnp.asarray(qvel))
    one = jax.jit(jax.grad(lambda q, c: loss(single, q, c)))
    mapped = jax.vmap(one, in_axes=(0, 1))(jnp.asarray(qvel)[:, None], jnp.asarray(ctrls)[:, :, None])
    for w in range(3):
        alone = one(jnp.asarray(qvel[w:w + 1]), ctrls[:, w:w + 1])
        np.testing.assert_allclose(np.asarray(together[w:w + 1]), np.asarray(alone), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(mapped[w]), np.asarray(alone), rtol=1e-5, atol=1e-6)
    for bad in (0, 2.0):
        with pytest.raises(ValueError, match="nworld must be a positive int"):
            MujocoStep(mjm, mjd, nworld=bad)
    with pytest.raises(ValueError, match="solver_loop must be 'auto', 'while' or 'fixed', got 'never'"):
        MujocoStep(mjm, mjd, solver_loop="never")


def test_modules_equal_the_step(arm):
    """The Equinox and NNX modules hold the params and call the same step."""
    step, _, _ = arm
    s0 = step.initial_state()
    params = {k: v * 1.5 for k, v in step.initial_params().items()}
    expected = step(s0, params)
    for module in (equinox_module(step, params), nnx_module(step, params)):
        got = module(s0)
        np.testing.assert_array_equal(np.asarray(got["qvel"]), np.asarray(expected["qvel"]))


def weighted_state(final, weights, sensors=False):
    """``weights . [qpos; qvel]`` (``sensors``: ``weights . sensordata``) of world 0 of a replayed state: the
    quantity ``mj_step_gradient`` differentiates."""
    observed = final["sensordata"][0] if sensors else jnp.concatenate([final["qpos"][0], final["qvel"][0]])
    return observed @ jnp.asarray(weights, jnp.float32)


def mj_step_gradient(mjm, mjd, steps, weights, where, eps=1e-6, sensors=False):
    """d(weights . [qpos; qvel] after ``steps`` mj_steps) / d(the values ``where(model, data)`` returns, at the
    start): central differences in float64, each entry of the array perturbed on a fresh copy of model and data.
    ``sensors``: of ``weights . sensordata`` instead."""
    def loss(i, delta):
        model = copy.copy(mjm)
        d = mujoco.MjData(model)
        d.qpos[:], d.qvel[:], d.ctrl[:], d.act[:] = mjd.qpos, mjd.qvel, mjd.ctrl, mjd.act
        d.qfrc_applied[:], d.xfrc_applied[:] = mjd.qfrc_applied, mjd.xfrc_applied
        where(model, d).reshape(-1)[i] += delta
        for _ in range(steps):
            mujoco.mj_step(model, d)
        return float((d.sensordata if sensors else np.concatenate([d.qpos, d.qvel])) @ weights)

    size = where(mjm, mjd).size
    return np.array([(loss(i, eps) - loss(i, -eps)) / (2 * eps) for i in range(size)])


def assert_gradients_match_mj_step(step, mjm, mjd, steps, weights, fields, rtol=1e-3, sensors=False):
    """jax.grad of ``weights . [qpos; qvel]`` (``sensors``: ``weights . sensordata``) after ``steps`` replayed steps
    from ``mjd``'s state w.r.t. the controls (where the model has actuators), the initial velocity and the model
    parameters ``fields`` matches central differences of mj_step (``mj_step_gradient``) to ``rtol`` relative.
    Returns the most constraint rows a step had."""
    s0 = {**step.initial_state(), "qpos": jnp.asarray(mjd.qpos[None], jnp.float32)}

    def loss(params, ctrl, qvel):
        controls = {"ctrl": ctrl} if mjm.nu else {}
        final, _ = rollout(step, {**s0, **controls, "qvel": qvel}, params=params, num_steps=steps)
        return weighted_state(final, weights, sensors), final["nefc"]

    (params, ctrl, qvel), rows = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
        step.initial_params(), jnp.asarray(mjd.ctrl[None], jnp.float32), jnp.asarray(mjd.qvel[None], jnp.float32))
    checks = [(ctrl, lambda m, d: d.ctrl)] * bool(mjm.nu) + [(qvel, lambda m, d: d.qvel)]
    checks += [(params[f], lambda m, d, f=f: getattr(m, f)) for f in fields]
    for got, where in checks:
        expected = mj_step_gradient(mjm, mjd, steps, weights, where, sensors=sensors)
        np.testing.assert_allclose(np.ravel(got), expected, rtol=rtol, atol=rtol * np.abs(expected).max())
    return int(np.asarray(rows).max())


def assert_sensordata_equals_mujoco_warps(step, mjm, mjd, steps, rtol=0.0):
    """``sensordata`` after ``steps`` replayed steps from the step's initial state equals mujoco_warp's, run directly
    from ``mjd`` (to ``rtol`` and 1e-6); returns mujoco_warp's."""
    m, d = mjw.put_model(mjm), mjw.put_data(mjm, mjd, nworld=1)
    for _ in range(steps):
        mjw.step(m, d)
    final, _ = jax.jit(lambda s: rollout(step, s, num_steps=steps))(step.initial_state())
    np.testing.assert_allclose(np.asarray(final["sensordata"]), d.sensordata.numpy(), rtol=rtol, atol=1e-6)
    return d.sensordata.numpy()


def assert_ten_steps_equal_mujoco_warps(step, mjm, mjd, atol=1e-6):
    """10 replayed steps from the step's initial state end where mujoco_warp, run directly from ``mjd``, does."""
    final, _ = jax.jit(lambda s: rollout(step, s, num_steps=10))(step.initial_state())
    np.testing.assert_allclose(np.asarray(final["qpos"]), mujoco_warp_loop(mjm, mjd, steps=10)[0][-1], rtol=0,
                               atol=atol)


def tree_pose(mjm, shoulder):
    """The tree's ``qpos0`` with the leg bent, the ball joint turned to the quaternion ``shoulder`` (normalised) and
    the tail slid."""
    qpos = mjm.qpos0.copy()
    qpos[7:14] = [0.3, -0.4, *np.array(shoulder) / np.linalg.norm(shoulder), 0.05]
    return qpos


def test_arm_has_no_refused_kernel_and_differentiates_its_stages_by_rules(arm):
    """Every kernel of the arm's step differentiates (mujoco_warp builds 25 of its modules without adjoints: warpnn
    rebuilds them in modules of its own); the two stages no per-kernel adjoint gets right, the inertia solve and the
    constraint solver, are differentiated by their rules (warpnn.StageRule, checked against the launches when
    traced). Tree walks and loops bounded by the model are proven when the step is traced."""
    step, _, _ = arm
    assert step.reverse_refusals() == {}
    from warpnn._tracer import _Launch

    kernels = {op.kernel.key: op.kernel for op in step.program._ops if isinstance(op, _Launch)}
    without_adjoint = [k for k, kernel in kernels.items()
                       if not kernel.options.get("enable_backward", kernel.module.options.get("enable_backward", True))]
    assert len(without_adjoint) >= 30
    described = step.program.describe()
    assert "stage mujoco_warp._src.smooth.factor_solve_i" in described
    assert "stage mujoco_warp._src.solver.solve" in described
    assert "(wp.capture_while; operations" in described  # the solver's iterations: a lax.while_loop
    assert step.m.opt.graph_conditional and step.solver_loop == "auto"


def test_another_mujoco_warp_version_refuses_reverse_mode_naming_both(monkeypatch):
    """The rules transcribe mujoco_warp 4.0's kernels; with another version installed (here: the version they are
    said to transcribe changed) every stage they cover is refused in reverse mode, naming both versions, and the
    forward, which replays the launches, still equals mujoco_warp's."""
    from warpnn_models import mujoco as mujoco_module

    monkeypatch.setattr(mujoco_module, "TRANSCRIBED_MUJOCO_WARP", "9.9.")
    mjm, mjd = start(ARM, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    with on_one_device():
        step = MujocoStep(mjm, mjd)
    refusals = step.reverse_refusals()
    assert "mujoco_warp._src.solver.solve" in refusals and "mujoco_warp._src.smooth.factor_solve_i" in refusals
    assert all("transcribe mujoco_warp 9.9.x; 4.0." in why for key, why in refusals.items())
    state = step.initial_state()
    with pytest.raises(TypeError, match="transcribe mujoco_warp 9.9.x"):
        jax.grad(lambda qvel: jnp.sum(step({**state, "qvel": qvel})["qpos"]))(state["qvel"])
    m, d = mjw.put_model(mjm), mjw.put_data(mjm, mjd)
    mjw.step(m, d)
    np.testing.assert_array_equal(np.asarray(step(state)["qpos"]), d.qpos.numpy())


@pytest.mark.parametrize("steps", [1, 10, 100])
def test_arm_gradient_matches_finite_differences_of_mj_step(arm, steps):
    """jax.grad through 1, 10 and 100 steps w.r.t. the controls, the initial velocity, joint damping and actuator
    gains matches central differences of mj_step (float64) to 1e-3 relative (measured: <= 2e-6 on 2026-12-05,
    CPU): the smooth-dynamics tier of the MuJoCo issue."""
    step, mjm, _ = arm
    weights = np.array([1.0, -0.5, 0.3, 0.7])  # qpos, qvel of the two joints
    mjd = mujoco.MjData(mjm)
    mjd.qpos[:], mjd.qvel[:], mjd.ctrl[:] = [0.3, -0.5], [0.5, -1.0], [0.2, -0.1]
    assert_gradients_match_mj_step(step, mjm, mjd, steps, weights, ("dof_damping", "actuator_gainprm"))


def with_integrator(xml, integrator):
    return xml.replace("<option ", f'<option integrator="{integrator}" ', 1)


@pytest.mark.slow  # (24 s of CI's CPU with Warp's cache empty; implicitfast's servo arm runs there)
def test_rk4_steps_equal_mujoco_warps_and_differentiate():
    """MuJoCo's RK4 integrator (four forward passes a step, the positions of each stage written over the last
    stage's): 10 replayed steps of the arm equal mujoco_warp's, and jax.grad through them w.r.t. the controls, the
    initial velocity, joint damping and actuator gains matches central differences of mj_step's RK4 (1e-3 relative;
    measured <= 5e-6, 2026-12-07, CPU). The position update's rule states that its launch overwrites every entry
    of its output (it refused RK4 before: an output that earlier launches computed and the rule did not read)."""
    mjm, mjd = start(with_integrator(ARM, "RK4"), qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    mjd.ctrl[:] = [0.2, -0.1]
    step = MujocoStep(mjm, mjd, param_fields=("dof_damping", "actuator_gainprm"))
    assert step.reverse_refusals() == {}
    assert_ten_steps_equal_mujoco_warps(step, mjm, mjd)
    assert_gradients_match_mj_step(step, mjm, mjd, 10, np.array([1.0, -0.5, 0.3, 0.7]),
                                   ("dof_damping", "actuator_gainprm"))


@pytest.mark.slow  # (two traced models, 35 s of a 2-core CPU; the arm's RK4 test runs in CI)
@pytest.mark.parametrize("scene", ["tree", "box"])
def test_rk4_differentiates_free_and_ball_joints_and_contacts(scene):
    """RK4 with the stages' rotation-vector correction of free and ball joints (``_rk_correct_velocity``), from a
    turned pose and from rest (zero angular velocity), and with contacts (the box sliding on the plane): jax.grad
    through one step w.r.t. the initial state and masses, damping, inertias or friction matches central differences
    of mj_step's RK4 (measured <= 1.5e-5 relative; 10 steps of the box <= 2.9e-5, 2026-12-07, CPU)."""
    mjm = mujoco.MjModel.from_xml_string(with_integrator(TREE if scene == "tree" else BOX, "RK4"))
    mjm.body_sameframe[:] = 0  # (see the tree fixture)
    mjd = mujoco.MjData(mjm)
    fields = ("body_mass", "dof_damping", "body_inertia") if scene == "tree" else ("geom_friction",)
    step = MujocoStep(mjm, mjd, param_fields=fields)
    assert step.reverse_refusals() == {}
    weights = np.linspace(-1.0, 1.0, mjm.nq + mjm.nv)
    s0 = step.initial_state()

    def loss(qpos, qvel, params):
        final, _ = rollout(step, {**s0, "qpos": qpos, "qvel": qvel}, params=params, num_steps=1)
        return weighted_state(final, weights)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    if scene == "tree":
        starts = [(tree_pose(mjm, [0.9, 0.2, -0.3, 0.1]), np.random.default_rng(0).normal(size=mjm.nv) * 0.5),
                  (mjm.qpos0, np.zeros(mjm.nv))]
    else:
        starts = [([0, 0, 0.1005, 0.995, 0.0998, 0, 0], [0.3, 0.0, -0.2, 0.0, 0.0, 0.0])]  # touching, tilted, sliding
    for qpos, qvel in starts:
        mjd.qpos[:], mjd.qvel[:] = qpos, qvel
        got = grad(jnp.asarray(mjd.qpos[None], jnp.float32), jnp.asarray(mjd.qvel[None], jnp.float32),
                   step.initial_params())
        checks = [(got[0], lambda m, d: d.qpos), (got[1], lambda m, d: d.qvel)]
        checks += [(got[2][name], lambda m, d, name=name: getattr(m, name)) for name in fields]
        for value, where in checks[scene == "box":]:  # (the box's qpos: a quaternion, perturbed off the unit sphere)
            expected = mj_step_gradient(mjm, mjd, 1, weights, where)
            np.testing.assert_allclose(np.ravel(value), expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())


# An arm of servos for implicitfast (the integrator MuJoCo recommends for them): a position servo with velocity
# feedback and a force range on the shoulder, a velocity servo on the elbow, joint damping.
SERVO_ARM = with_integrator(ARM, "implicitfast").replace(
    '<motor joint="shoulder" gear="1"/>', '<position joint="shoulder" kp="20" kv="2" forcerange="-3 3"/>').replace(
    '<motor joint="elbow" gear="1"/>', '<velocity joint="elbow" kv="1.5"/>')
SERVO_FIELDS = ("dof_damping", "actuator_gainprm", "actuator_biasprm")


def servo_arm(ctrl):
    mjm, mjd = start(SERVO_ARM, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    mjd.ctrl[:] = ctrl
    mujoco.mj_forward(mjm, mjd)
    return mjm, mjd


def test_implicitfast_steps_equal_mujoco_warps_and_differentiate():
    """implicitfast solves with ``M - dt qDeriv``, the forces' velocity derivative, which mujoco_warp computes in
    kernels Warp's adjoint gets wrong (``derivative._qderiv_*``: refused before); its rule
    (warpnn_models.mujoco._velocity_derivative_rule) computes it from the servos' ``kv`` and the joints' damping. 10
    steps of the servo arm equal mujoco_warp's, and the gradient through them w.r.t. the controls, the initial velocity,
    damping, gains and biases matches central differences of mj_step's implicitfast (1e-3 relative; measured
    2026-12-07, CPU: within it, also with ``dof_dampingpoly`` set)."""
    mjm, mjd = servo_arm([0.25, -0.1])
    step = MujocoStep(mjm, mjd, param_fields=SERVO_FIELDS)
    assert step.reverse_refusals() == {}
    assert "stage mujoco_warp._src.derivative.deriv_smooth_vel (" in step.program.describe()
    assert_ten_steps_equal_mujoco_warps(step, mjm, mjd)
    assert_gradients_match_mj_step(step, mjm, mjd, 10, np.array([1.0, -0.5, 0.3, 0.7]), SERVO_FIELDS)


@pytest.mark.slow  # (two traced models, ~35 s of a 2-core CPU; the servo arm's test runs in CI)
def test_implicitfast_differentiates_a_clamped_servo_and_free_and_ball_joints():
    """The shoulder servo's force clamped at its range (its ``kv`` then leaves ``qDeriv``, as in the kernel), and the
    tree's free and ball joints under implicitfast (turned and at rest): gradients match mj_step's central
    differences (1e-3 relative; the tree measured <= 8.2e-6, 2026-12-07, CPU)."""
    mjm, mjd = servo_arm([2.0, -0.1])
    assert mjd.actuator_force[0] == 3.0  # (clamped)
    step = MujocoStep(mjm, mjd, param_fields=SERVO_FIELDS)
    assert_gradients_match_mj_step(step, mjm, mjd, 10, np.array([1.0, -0.5, 0.3, 0.7]), SERVO_FIELDS)

    mjm = mujoco.MjModel.from_xml_string(with_integrator(TREE, "implicitfast"))
    mjm.body_sameframe[:] = 0  # (see the tree fixture)
    mjd = mujoco.MjData(mjm)
    step = MujocoStep(mjm, mjd, param_fields=("body_mass", "dof_damping"))
    assert step.reverse_refusals() == {}
    for shoulder, qvel in (([0.9, 0.2, -0.3, 0.1], np.random.default_rng(0).normal(size=mjm.nv) * 0.5),
                           ([1.0, 0.0, 0.0, 0.0], np.zeros(mjm.nv))):
        mjd.qpos[:], mjd.qvel[:], mjd.ctrl[:] = tree_pose(mjm, shoulder), qvel, [0.2, -0.1, 0.3]
        assert_gradients_match_mj_step(step, mjm, mjd, 1, np.linspace(-1.0, 1.0, mjm.nq + mjm.nv),
                                       ("body_mass", "dof_damping"))


@pytest.mark.parametrize("case", ["servo arm", "tree"])
@pytest.mark.slow  # (~40 s each of a 2-core CPU; implicitfast's servo arm runs in CI)
def test_the_implicit_integrator_steps_as_mujoco_warps_and_differentiates(case):
    """``implicit`` solves with ``M - dt (qDeriv - d qfrc_bias / d qvel)``: the actuators' and dampers' derivative
    (``deriv_smooth_vel``, implicitfast's rule), the Coriolis forces' (``deriv_rne_vel``: a tree walk adding each
    body's derivative into its parent's with atomics, refused) and a non-symmetric LU solve (``factor_solve_lu``: its
    kernel reads what it wrote, refused); rules compute the last two (warpnn_models.mujoco._implicit_rules). 10 steps
    of the servo arm and of the moving tree (free, ball, hinge and slide joints) equal mujoco_warp's; gradients
    through 1 and 10 steps match central differences of mj_step's implicit (1e-3 relative; measured 2026-12-07, CPU:
    the arm <= 5.4e-7, the tree <= 1.2e-5). Holding the Coriolis
    rule's inputs constant (stop_gradient) fails the tree's (0.10 relative, tried); leaving its term out fails the
    trace-time value check."""
    if case == "tree":
        mjm, mjd = _implicit_tree()
        mjd.ctrl[:] = [0.2, -0.1, 0.3]
        fields = ("body_mass", "dof_damping")
    else:
        mjm, mjd = start(SERVO_ARM.replace('integrator="implicitfast"', 'integrator="implicit"'), qpos=[0.3, -0.5],
                         qvel=[0.5, -1.0])
        mjd.ctrl[:] = [0.25, -0.1]
        fields = SERVO_FIELDS
    mujoco.mj_forward(mjm, mjd)
    step = MujocoStep(mjm, mjd, param_fields=fields)
    assert step.reverse_refusals() == {}
    assert "stage mujoco_warp._src.derivative.deriv_rne_vel (" in step.program.describe()
    assert_ten_steps_equal_mujoco_warps(step, mjm, mjd)
    for steps in (1, 10):
        assert_gradients_match_mj_step(step, mjm, mjd, steps, np.linspace(-1.0, 1.0, mjm.nq + mjm.nv), fields)


def test_what_implicitfasts_rule_does_not_cover_steps_as_mujoco_warp_and_refuses_reverse_mode():
    """implicitfast with what its rule does not cover (fluid forces here): the forward replays mujoco_warp's
    launches, equal to its steps; reverse mode is refused at trace time, naming the stage and what it does not
    cover, never a silent gradient."""
    xml = with_integrator(ARM, "implicitfast").replace('iterations="4"',
                                                       'iterations="4" density="1.2" viscosity="0.5"')
    mjm, mjd = start(xml, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    step = MujocoStep(mjm, mjd)
    assert "fluid forces" in step.reverse_refusals()["mujoco_warp._src.derivative.deriv_smooth_vel"]
    assert_ten_steps_equal_mujoco_warps(step, mjm, mjd)
    state = step.initial_state()
    with pytest.raises(TypeError, match="deriv_smooth_vel.*fluid forces"):
        jax.grad(lambda qvel: jnp.sum(step({**state, "qvel": qvel})["qpos"]))(state["qvel"])


# MuJoCo options and elements the other tests do not reach, each a small change to a scene above: (scene, how the
# MJCF changes, initial qpos, qvel, the parameters differentiated, tolerance: 1e-3 smooth, 1e-2 with contacts)
OPTIONS = {
    "fluid forces (ellipsoid model, wind)": (
        ARM, lambda xml: xml.replace('iterations="4"', 'iterations="4" density="1.2" viscosity="0.5" wind="0.5 0 0.3"')
        .replace('mass="1"/>', 'mass="1" fluidshape="ellipsoid"/>'), [0.3, -0.5], [0.5, -1.0], ("dof_damping",), 1e-3),
    "gravity compensation": (
        TREE, lambda xml: xml.replace('<body name="thigh" pos="0.15 0 0.1">',
                                      '<body name="thigh" pos="0.15 0 0.1" gravcomp="0.5">'),
        None, None, ("body_mass",), 1e-3),
    "a joint equality": (
        ARM, lambda xml: xml.replace("</worldbody>", '</worldbody><equality><joint joint1="elbow" joint2="shoulder" '
                                     'polycoef="0 -0.5 0 0 0"/></equality>'), [0.3, -0.5], [0.5, -1.0],
        ("dof_damping",), 1e-3),
    "a limited fixed tendon": (
        ARM, lambda xml: xml.replace("</worldbody>", '</worldbody><tendon><fixed name="t" limited="true" '
                                     'range="-0.2 0.2"><joint joint="shoulder" coef="1"/><joint joint="elbow" '
                                     'coef="-1"/></fixed></tendon>'), [0.3, -0.5], [0.5, -1.0], ("dof_damping",), 1e-3),
    "a joint limit's margin and solref": (
        ARM, lambda xml: xml.replace('damping="0.1"/>\n      <geom type="capsule" fromto="0 0 0 0.5 0 0" size="0.05"',
                                     'damping="0.1" limited="true" range="-25 25" margin="0.05" solreflimit="0.03 1"/>'
                                     '\n      <geom type="capsule" fromto="0 0 0 0.5 0 0" size="0.05"'),
        [0.3, -0.5], [0.5, -1.0], ("jnt_solref", "jnt_margin"), 1e-3),
    "Euler without implicit damping": (
        ARM, lambda xml: xml.replace('<flag contact="disable"/>', '<flag contact="disable" eulerdamp="disable"/>'),
        [0.3, -0.5], [0.5, -1.0], ("dof_damping",), 1e-3),
    # (the tendon passive kernel skips a tendon whose coefficients are all 0: its rule's sums, no NaN)
    "a tendon's spring and damper trained from 0": (
        TENDON, lambda xml: xml.replace('stiffness="2" damping="0.3"', 'stiffness="0" damping="0"'),
        [0.3, -0.5], [0.5, -1.0], ("tendon_stiffness", "tendon_damping", "tendon_lengthspring"), 1e-3),
    # (a DC motor's gainprm also holds settings that choose its state's size: not a parameter to perturb)
    "a DC motor (Euler)": (
        ARM, lambda xml: xml.replace('<motor joint="shoulder" gear="1"/>',
                                     '<dcmotor joint="shoulder" motorconst="0.05" resistance="2"/>'),
        [0.3, -0.5], [0.5, -1.0], ("dof_damping", "body_mass"), 1e-3),
    "torsional and rolling friction, pyramidal cones": (
        BOX, lambda xml: xml.replace('mass="1"/>', 'mass="1" condim="6"/>'), [0, 0, 0.1005, 0.995, 0.0998, 0, 0],
        [0.3, 0.0, -0.2, 0.0, 0.0, 1.0], ("geom_friction",), 1e-2),
}


@pytest.mark.slow  # (a traced model each, 15-25 s of a 2-core CPU)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_model_options_differentiate(option):
    """Each option steps as mujoco_warp does (10 steps) and its gradient through 1 and 10 steps w.r.t. the controls,
    the initial velocity and the parameters it brings matches central differences of mj_step (measured, 2026-12-07,
    CPU: <= 2e-5 relative but torsional and rolling friction's 1.7e-3)."""
    scene, change, qpos, qvel, fields, tolerance = OPTIONS[option]
    mjm = mujoco.MjModel.from_xml_string(change(scene))
    assert change(scene) != scene  # (the text the change looks for is there)
    mjm.body_sameframe[:] = 0  # (see the tree fixture)
    mjd = mujoco.MjData(mjm)
    mjd.qpos[:] = mjm.qpos0 if qpos is None else qpos
    if qpos is None:
        mjd.qpos[7:9] = [0.3, -0.4]
    mjd.qvel[:] = 0.3 if qvel is None else qvel
    mjd.ctrl[:] = 0.2
    mujoco.mj_forward(mjm, mjd)
    step = MujocoStep(mjm, mjd, param_fields=fields)
    assert step.reverse_refusals() == {}
    assert_ten_steps_equal_mujoco_warps(step, mjm, mjd, atol=1e-5)
    for steps in (1, 10):
        assert_gradients_match_mj_step(step, mjm, mjd, steps, np.linspace(-1.0, 1.0, mjm.nq + mjm.nv), fields,
                                       rtol=tolerance)


@pytest.mark.slow  # (17 s of CI's CPU: a forward-only check of the sparse layout; the dense one runs there)
def test_cartpole_with_joint_limit_equals_mujoco_warp_with_a_sparse_jacobian():
    """Cart driven into its rail limit (the constraint solver engages from ~step 30), traced with a sparse
    constraint Jacobian: 50 replayed steps equal mujoco_warp run directly (measured max error 0.0) and mj_step
    within 5e-4 (measured 3.5e-6). The solver's rule covers a dense Jacobian: reverse mode through this one is
    refused, naming the stage (and so are the sparse layout's row reservations, atomics inside a @wp.func).
    Traced with mujoco_warp's fixed-count solver loop (``solver_loop="fixed"``): the replay equals mujoco_warp run
    with its default loop all the same."""
    mjm, mjd = start(CARTPOLE, qpos=[0.0, 0.2], qvel=[1.0, 0.0])
    step = MujocoStep(mjm, mjd, sparse_jacobian=True, solver_loop="fixed")  # (mujoco_warp's fixed-count loop)
    assert not step.m.opt.graph_conditional and "wp.capture_while" not in step.program.describe()
    mjm = step.mjm
    ctrls = np.full((T, 1, 1), 0.3, np.float32)
    _, traj = jax.jit(lambda s, c: rollout(step, s, {"ctrl": c}))(step.initial_state(), ctrls)
    qpos, qvel = mujoco_warp_loop(mjm, mjd, ctrls)
    np.testing.assert_allclose(np.asarray(traj["qpos"]), qpos, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(traj["qvel"]), qvel, rtol=0, atol=1e-5)
    assert np.asarray(traj["nefc"]).max() >= 1  # the limit was active
    ref_qpos, _ = mj_step_loop(mjm, mjd, ctrls)
    np.testing.assert_allclose(np.asarray(traj["qpos"]), ref_qpos, rtol=0, atol=5e-4)
    refusals = step.reverse_refusals()
    assert refusals["mujoco_warp._src.solver.solve"].startswith("solver: its rule raised NotImplementedError")
    assert "sparse constraint Jacobian" in refusals["mujoco_warp._src.solver.solve"]
    with pytest.raises(TypeError, match="cannot be differentiated|mujoco_warp._src.solver.solve"):
        jax.grad(lambda c: jnp.sum(rollout(step, step.initial_state(), {"ctrl": c})[0]["qpos"]))(ctrls)


def test_cartpole_with_joint_limit_equals_mujoco_warp_and_differentiates_through_the_solver():
    """The same cart with the model's dense Jacobian. mujoco_warp's line search then writes ctx.jv as 'ctx_jv_out'
    and reads it back as 'ctx_jv_in' in one launch (the replay gave the two parameters separate values and was
    0.09 off from step 24; the tracer runs that kernel with the parameters merged: measured max error 0.0).
    Gradients through 50 steps with the limit active (the solver's implicit rule, see
    warpnn_models.mujoco._stage_rules) match central differences of mj_step: 1e-2 relative asked (the
    constraint tier), measured 5e-5 w.r.t. the control, 7e-7 w.r.t. the initial velocity. The MJCF asks for a
    sparse Jacobian; ``sparse_jacobian=False`` traces a dense one (what a model above 32 dofs needs)."""
    mjm, mjd = start(CARTPOLE.replace('<option timestep', '<option jacobian="sparse" timestep'), qpos=[0.0, 0.2],
                     qvel=[1.0, 0.0])
    assert mjm.opt.jacobian == mujoco.mjtJacobian.mjJAC_SPARSE
    step = MujocoStep(mjm, mjd, sparse_jacobian=False)
    assert not step.m.is_sparse and step.reverse_refusals() == {}
    mjm, mjd = start(step.mjm, qpos=mjd.qpos, qvel=mjd.qvel)  # (the dense copy: what was traced, run below)
    with pytest.raises(ValueError, match="sparse_jacobian must be True, False or None"):
        MujocoStep(mjm, mjd, sparse_jacobian="dense")
    ctrls = np.full((T, 1, 1), 0.3, np.float32)
    _, traj = jax.jit(lambda s, c: rollout(step, s, {"ctrl": c}))(step.initial_state(), ctrls)
    qpos, qvel = mujoco_warp_loop(mjm, mjd, ctrls)
    np.testing.assert_allclose(np.asarray(traj["qpos"]), qpos, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(traj["qvel"]), qvel, rtol=0, atol=1e-5)
    assert np.asarray(traj["nefc"]).max() >= 1

    weights = np.array([1.0, -0.5, 0.3, 0.7])
    mjd.ctrl[:] = 0.3

    def loss(ctrl, qvel):
        final, _ = rollout(step, {**step.initial_state(), "ctrl": ctrl, "qvel": qvel}, num_steps=T)
        return weighted_state(final, weights)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.full((1, 1), 0.3, jnp.float32),
                                                     jnp.asarray(mjd.qvel[None], jnp.float32))
    for got, where in ((grads[0], lambda m, d: d.ctrl), (grads[1], lambda m, d: d.qvel)):
        expected = mj_step_gradient(mjm, mjd, T, weights, where)
        np.testing.assert_allclose(np.ravel(got), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())


@pytest.mark.slow  # (23 s of a 2-core CPU, the CG solver's kernels compiled anew: the suite's 10 minutes)
def test_the_cg_solver_differentiates():
    """mujoco_warp's CG solver preconditions its iterations with the inertia's factor (``qLD``, ``qLDiagInv``),
    which the solver's rule ignores: it steers the iterations, not the solution they converge to, which is what the
    rule differentiates (reverse mode refused CG before: the rule did not account for those arrays). The cart
    driven into its limit with ``solver="CG"``: 50 steps equal mujoco_warp's, and the gradient through them w.r.t.
    the control and the initial velocity matches central differences of mj_step's CG (1e-2 asked, the constraint
    tier)."""
    mjm, mjd = start(CARTPOLE.replace('iterations="4"', 'iterations="50" solver="CG"'), qpos=[0.0, 0.2],
                     qvel=[1.0, 0.0])
    mjd.ctrl[:] = 0.3
    step = MujocoStep(mjm, mjd)
    assert step.reverse_refusals() == {}
    ctrls = np.full((T, 1, 1), 0.3, np.float32)
    _, traj = jax.jit(lambda s, c: rollout(step, s, {"ctrl": c}))(step.initial_state(), ctrls)
    qpos, _ = mujoco_warp_loop(mjm, mjd, ctrls)
    np.testing.assert_allclose(np.asarray(traj["qpos"]), qpos, rtol=0, atol=1e-5)
    assert np.asarray(traj["nefc"]).max() >= 1
    assert assert_gradients_match_mj_step(step, mjm, mjd, T, np.array([1.0, -0.5, 0.3, 0.7]), ()) >= 1


# An arm driven by each kind of actuator: a position servo (kp, kv), a velocity servo, a clamped motor with a gear,
# and a general affine actuator with first-order activation dynamics (a filter: an `act` state); a joint spring,
# and joint friction on two joints (frictionloss: a row of the constraint solver per dof).
ACTUATED = """
<mujoco model="actuated">
  <option timestep="0.005" iterations="50"><flag contact="disable"/></option>
  <worldbody>
    <body name="a"><joint name="j0" type="hinge" axis="0 1 0" damping="0.1" stiffness="0.5" springref="0.2"
                          frictionloss="0.02"/>
      <geom type="capsule" fromto="0 0 0 0.4 0 0" size="0.04" mass="1"/>
      <body name="b" pos="0.4 0 0"><joint name="j1" type="hinge" axis="0 0 1" damping="0.05" armature="0.01"/>
        <geom type="capsule" fromto="0 0 0 0.4 0 0" size="0.03" mass="0.5"/>
        <body name="c" pos="0.4 0 0"><joint name="j2" type="slide" axis="1 0 0" damping="0.2" frictionloss="0.05"/>
          <geom type="box" size="0.05 0.05 0.05" mass="0.3"/>
        </body>
      </body>
    </body>
  </worldbody>
  <actuator>
    <position joint="j0" kp="20" kv="1"/>
    <velocity joint="j1" kv="3"/>
    <motor joint="j2" gear="2" ctrllimited="true" ctrlrange="-1 1" forcelimited="true" forcerange="-1.5 1.5"/>
    <general joint="j1" gaintype="affine" gainprm="1 0.5 0.2" biastype="affine" biasprm="0 -0.3 -0.1"
             dyntype="filter" dynprm="0.05"/>
  </actuator>
</mujoco>
"""
ACTUATOR_PARAMS = ("actuator_gainprm", "actuator_biasprm", "actuator_gear", "actuator_dynprm", "jnt_stiffness",
                   "qpos_spring", "dof_damping", "dof_armature", "dof_frictionloss", "body_mass", "body_inertia")


@pytest.fixture(scope="module")
def actuated():
    mjm, mjd = start(ACTUATED, qpos=[0.3, -0.2, 0.05], qvel=[0.5, -0.4, 0.3])
    mjd.ctrl[:], mjd.act[:] = [0.5, 0.7, 0.6, 0.4], [0.1]
    mujoco.mj_forward(mjm, mjd)
    with on_one_device():
        step = MujocoStep(mjm, mjd, param_fields=ACTUATOR_PARAMS)
    return step, mjm, mjd


@pytest.mark.slow  # (24 s of a 2-core CPU with Warp's kernel cache empty, as in CI: the suite's 10 minutes)
@pytest.mark.parametrize("steps", [1, 10])
def test_actuators_with_activation_dynamics_and_joint_friction_differentiate(actuated, steps):
    """mujoco_warp's ``_actuator_force`` writes ``act_dot`` at each actuator's activation address and reads it back
    only in its DC-motor branch, through a @wp.func: the launch-time proof (``warpnn._owned``) shows no thread of
    this model takes that branch (it was refused for every model with activations before). Joint friction is a
    solver row per dof, LINEARNEG / LINEARPOS while the joint slides: the solver's rule carries
    ``efc.frictionloss`` and ``_friction_dof``'s adjoint takes it back to ``dof_frictionloss``. jax.grad through 1
    and 10 steps w.r.t. controls, activations, actuator gains, biases, gears and dynamics parameters, springs,
    damping, armature, friction, masses and inertias matches central differences of mj_step (measured <= 8.7e-7
    relative, 2026-12-06, CPU).

    At ``frictionloss`` = 0 (here the middle joint's) MuJoCo makes no row (``frictionloss > 0``): the gradient
    there is the side taken, 0, the derivative from below (as ``jax.nn.relu`` at 0), where mj_step's central
    difference is half the one from above; the check skips that entry. To identify friction, start it above 0."""
    step, mjm, mjd = actuated
    assert step.reverse_refusals() == {}
    s0 = step.initial_state()
    weights = np.linspace(-1.0, 1.0, mjm.nq + mjm.nv)

    def loss(params, ctrl, act):
        final, _ = rollout(step, {**s0, "ctrl": ctrl, "act": act}, params=params, num_steps=steps)
        return weighted_state(final, weights), final["nefc"]

    (params, ctrl, act), rows = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
        step.initial_params(), jnp.asarray(mjd.ctrl[None], jnp.float32), jnp.asarray(mjd.act[None], jnp.float32))
    assert int(np.asarray(rows).max()) == 2  # a friction row per joint with friction
    checks = [("ctrl", ctrl, lambda m, d: d.ctrl), ("act", act, lambda m, d: d.act)]
    checks += [(f, params[f], lambda m, d, f=f: getattr(m, f)) for f in ACTUATOR_PARAMS]
    for name, value, where in checks:
        expected = mj_step_gradient(mjm, mjd, steps, weights, where)
        value = np.ravel(value)
        if name == "dof_frictionloss":
            assert value[1] == 0.0 and expected[1] != 0.0  # (no row at 0: the side taken)
            value, expected = value[[0, 2]], expected[[0, 2]]
        np.testing.assert_allclose(value, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
    assert np.abs(np.asarray(act)).max() > 1e-2 and np.abs(np.asarray(params["dof_frictionloss"])).max() > 1e-2




@pytest.fixture(scope="module")
def tendon():
    mjm, mjd = start(TENDON, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    mjd.ctrl[:] = [0.4]
    with on_one_device():
        step = MujocoStep(mjm, mjd, param_fields=TENDON_PARAMS)
    return step, mjm, mjd


# What else implicitfast's rule covers, each on a scene turned implicitfast: (MJCF changes, qpos, qvel, ctrl,
# act, parameters differentiated)
IMPLICITFAST_WIDER = {
    # activation dynamics under an affine gain (filterexact, actearly: the next activation, clamped to actrange),
    # a clamped motor's own damping and damping polynomial (times gear squared)
    "activation dynamics and actuator damping": (
        with_integrator(ACTUATED, "implicitfast").replace(
            'forcerange="-1.5 1.5"/>', 'forcerange="-1.5 1.5" damping="0.3 0.1 0.02"/>').replace(
            'dyntype="filter" dynprm="0.05"/>',
            'dyntype="filterexact" dynprm="0.05" actearly="true" actlimited="true" actrange="-1 1"/>'),
        [0.3, -0.2, 0.05], [0.5, -0.4, 0.3], [0.5, 0.7, 0.6, 0.4], [0.1],
        ("actuator_gainprm", "actuator_biasprm", "actuator_gear", "actuator_dynprm", "actuator_damping",
         "actuator_dampingpoly", "dof_damping")),
    # a fixed tendon's damping and polynomial, its motor's damping (J_t' J_t on M's entries), a servo on a joint;
    # the motor's gear and the tendon's armature at 0 (the armature's bias kernels skip a zero armature: their rules)
    "tendon damping": (
        with_integrator(TENDON, "implicitfast").replace('damping="0.3"', 'damping="0.3 0.2 0.1"').replace(
            '<motor tendon="t" gear="1.5"/>',
            '<motor tendon="t" gear="1.5" damping="0.2 0.1 0.05"/><position joint="a" kp="5" kv="0.5"/>'),
        [0.3, -0.5], [0.5, -1.0], [0.4, 0.1], [],
        ("tendon_damping", "tendon_dampingpoly", "actuator_damping", "actuator_dampingpoly", "dof_damping",
         "actuator_biasprm", "actuator_gear", "tendon_armature")),
    # servos on a joint whose total actuator force is clamped at its actfrcrange (their velocity derivative then 0)
    "a joint's actuator-force limit": (
        with_integrator(ARM, "implicitfast").replace(
            '<motor joint="shoulder" gear="1"/>', '<position joint="shoulder" kp="20" kv="2"/><velocity '
            'joint="shoulder" kv="1"/>').replace(
            '<joint name="shoulder" type="hinge" axis="0 1 0" damping="0.1"/>', '<joint name="shoulder" type="hinge" '
            'axis="0 1 0" damping="0.1" actuatorfrclimited="true" actuatorfrcrange="-2 2"/>'),
        [0.3, -0.5], [0.5, -1.0], [1.5, 0.3, -0.1], [], ("dof_damping", "actuator_gainprm", "actuator_biasprm")),
    # a motor and a velocity servo on a tendon whose total actuator force is clamped at its actfrcrange
    "a tendon's actuator-force limit": (
        with_integrator(TENDON, "implicitfast").replace(
            'springlength="0.1">', 'springlength="0.1" actuatorfrclimited="true" actuatorfrcrange="-0.5 0.5">').replace(
            '<motor tendon="t" gear="1.5"/>', '<motor tendon="t" gear="1.5"/><velocity tendon="t" kv="0.8"/>'),
        [0.3, -0.5], [0.5, -1.0], [2.0, 0.2], [], ("dof_damping", "actuator_biasprm", "tendon_damping")),
    # a muscle on the shoulder (its active force's velocity derivative times its activation), a motor
    "a muscle": (
        with_integrator(ARM, "implicitfast").replace(
            '<motor joint="shoulder" gear="1"/>', '<muscle joint="shoulder" lengthrange="-1 1"/>'),
        [0.3, -0.5], [0.5, -1.0], [0.6, -0.2], [0.4],
        ("actuator_gainprm", "actuator_biasprm", "actuator_dynprm", "dof_damping")),
}


@pytest.mark.slow  # (~20 s each of a 2-core CPU; the servo arm's test runs in CI)
@pytest.mark.parametrize("case", IMPLICITFAST_WIDER)
def test_implicitfast_differentiates_activation_dynamics_actuator_and_tendon_damping(case):
    """implicitfast's rule beyond servos: an affine gain or a muscle's active force times the (next, clamped)
    activation, actuators' damping on their joint or tendon (times gear squared), a tendon's damping ``J_t' J_t``,
    actuators whose joint's or tendon's total force is clamped at its ``actfrcrange`` (no velocity derivative;
    leaving that out fails the trace-time value check, 0.03 and 0.008 off, tried).
    10 steps equal mujoco_warp's and
    gradients through 1 and 10 steps match central differences of mj_step's implicitfast (1e-3 relative; measured
    within it, 2026-12-07, CPU). Leaving out the next activation or the tendon term fails this test (tried)."""
    xml, qpos, qvel, ctrl, act, fields = IMPLICITFAST_WIDER[case]
    mjm, mjd = start(xml, qpos=qpos, qvel=qvel)
    mjd.ctrl[:], mjd.act[:] = ctrl, act
    mujoco.mj_forward(mjm, mjd)
    step = MujocoStep(mjm, mjd, param_fields=fields)
    assert step.reverse_refusals() == {}
    assert_ten_steps_equal_mujoco_warps(step, mjm, mjd)
    for steps in (1, 10):
        assert_gradients_match_mj_step(step, mjm, mjd, steps, np.linspace(-1.0, 1.0, mjm.nq + mjm.nv), fields)


@pytest.mark.slow  # (48 s of CI's CPU for 1 step; test_a_linkage_... covers the tendon's kernels there)
@pytest.mark.parametrize("steps", [1, 10])
def test_a_fixed_tendon_with_its_spring_damper_and_motor_differentiates(tendon, steps):
    """mujoco_warp launches ``_tendon_armature``, ``_tendon_dot`` and ``_friction_tendon`` for every model with
    tendons; their while loops and the value an atomic returns make Warp's adjoint wrong, and reverse mode refused
    every tendon model. Their threads leave at once where no tendon has armature or friction loss, which the
    model's constants decide: the launch-time proof (``warpnn._idle``) replays them as nothing. jax.grad through 1
    and 10 steps w.r.t. the control, the initial velocity, the tendon's stiffness, damping and spring length, joint
    damping and the motor's gain matches central differences of mj_step (measured <= 1.3e-6 relative, 2026-12-06,
    CPU)."""
    step, mjm, mjd = tendon
    assert step.reverse_refusals() == {}
    assert_gradients_match_mj_step(step, mjm, mjd, steps, np.array([1.0, -0.5, 0.3, 0.7]), TENDON_PARAMS)


# The tendon with armature, its motor with armature of its own (the tendon's inertia: a_t J_t' J_t added to M), and
# friction loss (a constraint row of the solver)
ARMATURE_TENDON = TENDON.replace('springlength="0.1"', 'springlength="0.1" armature="0.05" frictionloss="0.1"').replace(
    '<motor tendon="t" gear="1.5"/>', '<motor tendon="t" gear="1.5" armature="0.02"/>')


# (both slow: 17 s of CI's CPU for one step; the fixed tendon's spring, damper and motor run there)
@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 10])
def test_tendon_armature_and_friction_loss_differentiate(steps):
    """``smooth._tendon_armature`` (a while loop over the tendon's sparse Jacobian row, refused) by a rule, the
    friction loss through the solver's rule (its row LINEARNEG / LINEARPOS): jax.grad through 1 and 10 steps w.r.t.
    the control, the initial velocity, the tendon's and the motor's armature, the gear, the tendon's friction loss
    and stiffness matches central differences of mj_step (measured <= 7.8e-7 relative, CPU)."""
    mjm, mjd = start(ARMATURE_TENDON, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    mjd.ctrl[:] = [0.4]
    fields = ("tendon_armature", "actuator_armature", "actuator_gear", "tendon_frictionloss", "tendon_stiffness")
    step = MujocoStep(mjm, mjd, param_fields=fields)
    assert step.reverse_refusals() == {}
    assert_gradients_match_mj_step(step, mjm, mjd, steps, np.array([1.0, -0.5, 0.3, 0.7]), fields)


# The tendon model with a spatial tendon beside the fixed one: from a site on the world body over sites on both links,
# then a pulley halving a second branch (two sites), with a spring, a damper and a motor, and its length and velocity
# as sensors
SPATIAL_TENDON = TENDON.replace('<worldbody>', '<worldbody><site name="w0" pos="0.3 0 0.1"/>').replace(
    '<geom type="capsule" size="0.05" fromto="0 0 0 0 0 -0.5" mass="1"/>\n      <body',
    '<geom type="capsule" size="0.05" fromto="0 0 0 0 0 -0.5" mass="1"/><site name="s0" pos="0.05 0 -0.2"/>'
    '\n      <body', 1).replace(
    '<geom type="capsule" size="0.05" fromto="0 0 0 0 0 -0.5" mass="1"/>\n      </body>',
    '<geom type="capsule" size="0.05" fromto="0 0 0 0 0 -0.5" mass="1"/><site name="s1" pos="0.05 0 -0.3"/>'
    '<site name="s2" pos="-0.05 0 -0.45"/>\n      </body>', 1).replace(
    '<fixed name="t" stiffness="2" damping="0.3" springlength="0.1">',
    '<spatial name="s" stiffness="3" damping="0.2" springlength="0.5"><site site="w0"/><site site="s0"/>'
    '<site site="s1"/><pulley divisor="2"/><site site="s0"/><site site="s2"/></spatial>\n    '
    '<fixed name="t" stiffness="2" damping="0.3" springlength="0.1">').replace(
    '<actuator><motor tendon="t" gear="1.5"/></actuator>', '<actuator><motor tendon="t" gear="1.5"/><motor '
    'tendon="s" gear="2"/></actuator><sensor><tendonpos tendon="s"/><tendonvel tendon="s"/></sensor>')


def assert_the_spatial_tendon_steps_and_differentiates(mjm, mjd):
    """SPATIAL_TENDON (or a variant): nothing refused, 10 steps equal mujoco_warp's, gradients of the state and of
    the tendon's sensors through 1 and 10 steps w.r.t. the controls, the initial velocity and TENDON_PARAMS within
    1e-3 of mj_step's central differences."""
    step = MujocoStep(mjm, mjd, param_fields=TENDON_PARAMS)
    assert step.reverse_refusals() == {}
    assert_ten_steps_equal_mujoco_warps(step, mjm, mjd)
    for steps in (1, 10):
        assert_gradients_match_mj_step(step, mjm, mjd, steps, np.linspace(-1.0, 1.0, mjm.nq + mjm.nv), TENDON_PARAMS)
        assert_gradients_match_mj_step(step, mjm, mjd, steps, np.array([1.0, -0.5]), TENDON_PARAMS, sensors=True)


@pytest.mark.slow  # (three traced models, ~60 s of a 2-core CPU)
def test_a_spatial_tendon_through_sites_and_a_pulley_differentiates():
    """A spatial tendon's length and Jacobian (``smooth._spatial_site_tendon``) and every tendon's velocity
    (``forward._tendon_velocity``) skip a Jacobian term that is exactly 0, whose derivative is not: NaN gradients
    under the equality guard (measured); the path's points (``_spatial_tendon_wrap``, a while loop) are gathered
    sites. Rules compute them (warpnn_models.mujoco._tendon_site_rules, _tendon_path_rule). 10 steps equal
    mujoco_warp's; gradients of the state and of the tendon's sensors through 1 and 10 steps w.r.t. the controls,
    the initial velocity, the tendons' stiffness, damping and spring lengths, joint damping and the motors' gains
    match central differences of mj_step (1e-3 relative). Its armature (with ``actuator_gear`` trained, so nothing
    proves ``_tendon_dot``'s launch idle) is refused naming the kernel."""
    mjm, mjd = start(SPATIAL_TENDON, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    mjd.ctrl[:] = [0.4, -0.3]
    assert_the_spatial_tendon_steps_and_differentiates(mjm, mjd)

    armature = SPATIAL_TENDON.replace('<spatial name="s" ', '<spatial name="s" armature="0.05" ')
    mjm, mjd = start(armature, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    assert mjm.tendon_armature[0] == 0.05  # (the spatial tendon first, then the fixed one)
    step = MujocoStep(mjm, mjd, param_fields=("actuator_gear",))
    assert "while loop" in step.reverse_refusals()["_tendon_dot"]
    s0 = step.initial_state()
    with pytest.raises(TypeError, match="_tendon_dot.*while loop"):
        jax.grad(lambda p: step(s0, p)["qvel"].sum())(step.initial_params())


# The spatial tendon's first stretch (a world site to the upper link) over a geom: a cylinder across the plane of
# motion, or a sphere, with a side site outside it (the wrap's side chosen) or inside it (wrap_inside); or a sphere
# off the path (the stretch does not wrap: straight, its geom points at its ends)
WRAPS = {
    "cylinder": ('<geom name="post" type="cylinder" size="0.04 0.1" pos="0.16 0 -0.03" zaxis="0 1 0"/>', ""),
    "cylinder, the side site's way": (
        '<geom name="post" type="cylinder" size="0.04 0.1" pos="0.16 0 -0.03" zaxis="0 1 0"/>', "0.1 0 0.05"),
    "sphere, a side site": ('<geom name="post" type="sphere" size="0.04" pos="0.16 0 -0.03"/>', "0.22 0 -0.1"),
    "sphere, a side site inside": ('<geom name="post" type="sphere" size="0.04" pos="0.2 0 -0.07"/>',
                                   "0.205 0 -0.075"),
    "sphere, off the path": ('<geom name="post" type="sphere" size="0.04" pos="0.3 0 -0.2"/>', ""),
}


@pytest.mark.slow  # (a traced model each, ~30 s of a 2-core CPU)
@pytest.mark.parametrize("wrap", WRAPS)
def test_a_spatial_tendon_wrapping_a_geom_differentiates(wrap):
    """A spatial tendon over a sphere or a cylinder: its length and Jacobian (``smooth._spatial_geom_tendon``, which
    walks bodies in a while loop and skips exactly-zero Jacobian terms; ``util_misc.wrap``'s Newton iteration for a
    side site inside the geom is a while loop too) and its path's points (which shift where a stretch wraps) are
    computed by rules (warpnn_models.mujoco._tendon_geom_rule, _tendon_path_rule). The stretch wraps through all 10
    steps (two more path points than without the geom, in mj_step), or, off the path, never (the rule's branch
    where it does not wrap: its derivative was NaN before a safe norm); 10 steps equal mujoco_warp's; gradients of
    the state and of the tendon's sensors through 1 and 10 steps match central differences of mj_step (1e-3)."""
    geom, side = WRAPS[wrap]
    geom = geom.replace("/>", ' contype="0" conaffinity="0"/>') + (f'<site name="side" pos="{side}"/>' if side else "")
    sidesite = ' sidesite="side"' if side else ""
    xml = SPATIAL_TENDON.replace('<site name="w0" pos="0.3 0 0.1"/>', '<site name="w0" pos="0.3 0 0.1"/>' + geom).replace(
        '<site site="w0"/><site site="s0"/>', f'<site site="w0"/><geom geom="post"{sidesite}/><site site="s0"/>')
    mjm, mjd = start(xml, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    mjd.ctrl[:] = [0.4, -0.3]
    straight = start(SPATIAL_TENDON, qpos=[0.3, -0.5])[1]
    rolled = copy.copy(mjd)
    for _ in range(10):
        mujoco.mj_step(mjm, rolled)  # (where it wraps, the geom's two points)
        assert rolled.ten_wrapnum[0] == straight.ten_wrapnum[0] + 2 * ("off the path" not in wrap)
    assert_the_spatial_tendon_steps_and_differentiates(mjm, mjd)



@pytest.mark.slow  # (a traced model each, ~30 s of a 2-core CPU)
@pytest.mark.parametrize("name", ["wrap.xml", "pulley_wrap.xml"])
def test_mujoco_warps_wrapping_tendon_models_differentiate(name):
    """mujoco_warp's own test models of tendons over spheres and cylinders (``test_data/tendon``: three spatial
    tendons from world sites over a sphere and a cylinder to two sliding bodies, after sites, before a site, with
    pulleys in the second model), given springs and dampers (their tendons have none) and with contacts off (their
    cylinders collide by GJK, refused): every stretch wraps; 10 steps equal mujoco_warp's; gradients through 1 and
    10 steps w.r.t. the initial velocity, the tendons' coefficients and the masses match mj_step's central
    differences (with MuJoCo's cached masses of simple bodies cleared in the reference)."""
    import os

    mjm = mujoco.MjModel.from_xml_path(os.path.join(os.path.dirname(mjw.__file__), "test_data", "tendon", name))
    mjm.opt.disableflags |= mujoco.mjtDisableBit.mjDSBL_CONTACT
    mjm.tendon_stiffness[:], mjm.tendon_damping[:] = 3.0, 0.5
    mjm.body_simple[:], mjm.dof_simplenum[:] = 0, 0
    mjd = mujoco.MjData(mjm)
    mujoco.mj_resetDataKeyframe(mjm, mjd, 0)
    mjd.qvel[:] = [0.3, -0.4]
    mujoco.mj_forward(mjm, mjd)
    mjm.tendon_lengthspring[:] = mjd.ten_length[:, None] - 0.2  # (each spring stretched)
    straight = np.array([2, 3, 3]) + (name == "pulley_wrap.xml") * np.array([1, 0, 1])  # (path points, no wrap)
    np.testing.assert_array_equal(mjd.ten_wrapnum, straight + 2)  # (each stretch wraps: the geom's two points)
    fields = ("tendon_stiffness", "tendon_damping", "tendon_lengthspring", "body_mass")
    step = MujocoStep(mjm, mjd, param_fields=fields)
    assert step.reverse_refusals() == {}
    assert_ten_steps_equal_mujoco_warps(step, mjm, mjd)
    for steps in (1, 10):
        assert_gradients_match_mj_step(step, mjm, mjd, steps, np.linspace(-1.0, 1.0, mjm.nq + mjm.nv), fields)

LINKAGE = """
<mujoco>
  <option timestep="0.005"><flag contact="disable"/></option>
  <worldbody>
    <body name="upper">
      <joint name="shoulder" type="hinge" axis="0 1 0" damping="0.1"/>
      <geom type="capsule" size="0.04" fromto="0 0 0 0 0 -0.4" mass="1"/>
      <body name="lower" pos="0 0 -0.4">
        <joint name="elbow" type="hinge" axis="0 1 0" damping="0.1"/>
        <geom type="capsule" size="0.04" fromto="0 0 0 0 0 -0.4" mass="0.8"/>
      </body>
    </body>
    <body name="link" pos="0.3 0 0">
      <joint name="pivot" type="hinge" axis="0 1 0" damping="0.05"/>
      <geom type="capsule" size="0.03" fromto="0 0 0 -0.3 0 -0.8" mass="0.5"/>
    </body>
    <body name="flap" pos="-0.3 0 0">
      <joint name="hinge" type="hinge" axis="1 0 0"/>
      <geom type="box" size="0.1 0.02 0.1" pos="0 0 -0.1" mass="0.3"/>
    </body>
  </worldbody>
  <tendon>
    <fixed name="coupling" stiffness="2" damping="0.3" springlength="0.1">
      <joint joint="shoulder" coef="1"/><joint joint="elbow" coef="-0.5"/>
    </fixed>
  </tendon>
  <equality>
    <connect body1="lower" body2="link" anchor="0 0 -0.4"/>
    <weld body1="flap"/>
  </equality>
  <actuator><motor tendon="coupling" gear="1.5"/><motor joint="hinge" gear="1"/></actuator>
</mujoco>
"""
LINKAGE_PARAMS = ("tendon_stiffness", "tendon_lengthspring", "eq_solref", "eq_data", "body_mass", "dof_damping",
                  "actuator_gainprm")


@pytest.mark.slow  # (54 s of a 2-core CPU with Warp's kernel cache empty, as in CI: the tendon's and the
# equality constraints' kernels compile for it alone)
def test_a_linkage_with_a_fixed_tendon_a_connect_and_a_weld_differentiates():
    """A closed chain (a connect constraint), a welded flap and a tendon-driven arm: mujoco_warp's connect and weld
    kernels record the atomics that number their rows and loop over the dofs (``range(nv)``); their adjoint
    launches the twin with that loop unrolled, which keeps the proof that each thread reads back only its own
    record (it was refused before). The tendon kernels are idle (no armature, no friction loss). jax.grad through
    a step from rest w.r.t. the controls, the initial velocity, the tendon's stiffness and spring length, the
    constraints' solref and data (anchors, relative pose), masses, joint damping and gains matches central
    differences of mj_step (measured <= 8.4e-6 relative, 2026-12-06, CPU).

    From rest because mujoco_warp's connect and weld rows subtract ``Jdot qvel`` (``aref_shift``) computed from the
    ``cvel`` and ``cdof_dot`` the state carries from the step before (``make_constraint`` runs before ``com_vel``),
    where MuJoCo C uses this step's: the two steps agree in value, but in motion their derivatives w.r.t. the
    initial velocity and masses differ by up to 1e-2 (measured: mj_step's central differences against the replay's
    gradient, which the replay's own finite differences confirm)."""
    mjm, mjd = start(LINKAGE, qpos=[0.2, -0.3, 0.1, 0.2])
    mjd.ctrl[:] = [0.4, -0.2]
    with on_one_device():
        step = MujocoStep(mjm, mjd, param_fields=LINKAGE_PARAMS)
    assert step.reverse_refusals() == {}
    weights = np.linspace(-1.0, 1.0, mjm.nq + mjm.nv)
    rows = assert_gradients_match_mj_step(step, mjm, mjd, 1, weights, LINKAGE_PARAMS)
    assert rows == 9  # 3 connect rows, 6 weld rows


CONTACT_PARAMS = ("geom_friction", "geom_solref", "geom_solimp", "geom_margin")


def traced_with_friction(xml):
    """A model's step traced with the contact parameters (``geom_friction``, ``geom_solref``, ``geom_solimp``,
    ``geom_margin``) as parameters, its MjModel and starting MjData."""
    mjm, mjd = start(xml)
    with on_one_device():
        step = MujocoStep(mjm, mjd, param_fields=CONTACT_PARAMS)
    return step, mjm, mjd


@pytest.fixture(scope="module")
def box():
    """The box with its contact parameters and geom_pos (the plane's entries: see the gradient test)."""
    mjm, mjd = start(BOX)
    with on_one_device(), pytest.warns(UserWarning, match=r"geoms attached to the world \(\['geom 0'\]\)"):
        step = MujocoStep(mjm, mjd, param_fields=(*CONTACT_PARAMS, "geom_pos"))
    return step, mjm, mjd


def test_box_falling_onto_a_plane(box):
    """A free box landing on a plane (contacts): 80 replayed steps against mujoco_warp and mj_step.

    mujoco_warp's make_constraint reads d.contact.frame (mat33) as a (naconmax, 3) vec3 array over the same
    memory (``wp.array(ptr=d.contact.frame.ptr, ...)``): the tracer replays it as a reshape of one value (it
    refused the trace before)."""
    step, mjm, mjd = box
    steps = 80
    _, traj = jax.jit(lambda s: rollout(step, s, num_steps=steps))(step.initial_state())
    qpos, _ = mujoco_warp_loop(mjm, mjd, steps=steps)
    np.testing.assert_allclose(np.asarray(traj["qpos"]), qpos, rtol=0, atol=1e-5)
    ref_qpos, _ = mj_step_loop(mjm, mjd, steps=steps)
    np.testing.assert_allclose(np.asarray(traj["qpos"]), ref_qpos, rtol=0, atol=5e-4)
    assert abs(float(traj["qpos"][-1, 0, 2]) - 0.1) < 5e-3  # resting on the plane


# (10 and 100: slow, for CI's time; the arm's smooth dynamics run through 100 steps there, contacts through 1)
@pytest.mark.parametrize("steps", [1, pytest.param(10, marks=pytest.mark.slow), pytest.param(100, marks=pytest.mark.slow)])
def test_box_gradient_through_contacts_matches_finite_differences_of_mj_step(box, steps):
    """The contact tier: a tilted box sliding on the plane (4 corner contacts, friction pyramids), jax.grad through
    1, 10 and 100 steps w.r.t. the initial velocity and the contact parameters (geom_friction, and geom_solref,
    geom_solimp, geom_margin: the contacts' stiffness, damping, impedance and margin, mixed by the narrowphase
    rule) against central differences of mj_step (float64): 1e-2 relative asked, measured <= 1.3e-6 for velocity
    and friction (2026-12-05, CPU), <= 7e-6 for the others through one step (2026-12-06). Every stage
    differentiates: the broadphase writes integers only, the narrowphase, the contact Jacobian and the position
    update by their rules (warpnn_models.mujoco._contact_rules, _position_rule), the solver implicitly. And from
    rest in the air (angular velocity exactly 0, where mujoco_warp's quaternion integration has a zero adjoint),
    the first step's gradient w.r.t. the angular velocity is mj_step's too."""
    step, mjm, _ = box
    assert step.reverse_refusals() == {}
    s0 = step.initial_state()
    weights = np.linspace(-1.0, 1.0, mjm.nq + mjm.nv)

    def loss(qpos, qvel, params):
        final, _ = rollout(step, {**s0, "qpos": qpos, "qvel": qvel}, params=params, num_steps=steps)
        return weighted_state(final, weights)

    grad = jax.jit(jax.grad(loss, argnums=(1, 2)))
    starts = [([0, 0, 0.1005, 0.995, 0.0998, 0, 0], [0.3, 0.0, -0.2, 0.0, 0.0, 0.0])]  # touching, tilted, sliding
    if steps == 1:
        starts.append(([0, 0, 1.0, 0.995, 0.0998, 0, 0], [0.3, 0.0, -0.2, 0.0, 0.0, 0.0]))  # in the air, not turning
    for qpos, qvel in starts:
        mjd = mujoco.MjData(mjm)
        mjd.qpos[:], mjd.qvel[:] = qpos, qvel
        got = grad(jnp.asarray(mjd.qpos[None], jnp.float32), jnp.asarray(mjd.qvel[None], jnp.float32),
                   step.initial_params())
        checks = [(got[0], lambda m, d: d.qvel)]
        checks += [(got[1][name], lambda m, d, name=name: getattr(m, name)) for name in CONTACT_PARAMS]
        for value, where in checks:
            expected = mj_step_gradient(mjm, mjd, steps, weights, where)
            np.testing.assert_allclose(np.ravel(value), expected, rtol=1e-2, atol=1e-2 * np.abs(expected).max())
        assert np.abs(np.asarray(got[0])).max() > 1e-3  # (at rest after 100 steps: 7e-3)
        # the box's own geom differentiates (against mj_step with its geom_sameframe shortcut cleared, which
        # otherwise skips geom_pos for a geom at its body's frame); the plane is placed once by put_data
        # (MujocoStep warned): its entries change nothing in mujoco_warp's step, so their gradient is 0
        general = copy.copy(mjm)
        general.geom_sameframe[:] = 0
        moved = mj_step_gradient(general, mjd, steps, weights, lambda m, d: m.geom_pos)
        np.testing.assert_allclose(np.asarray(got[1]["geom_pos"])[0, 1], moved[3:], rtol=1e-2,
                                   atol=1e-2 * np.abs(moved).max())
        assert (np.asarray(got[1]["geom_pos"])[0, 0] == 0).all()


@pytest.fixture(scope="module")
def tree():
    mjm, mjd = start(TREE)
    # MuJoCo's compiler marks a body whose inertial frame is its own frame (body_sameframe) and mj_step then skips
    # body_ipos / body_iquat for it, so central differences see no effect of them; mujoco_warp has no such
    # shortcut. Cleared, mj_step takes the general formula (the same step at these values).
    mjm.body_sameframe[:] = 0
    with on_one_device():
        step = MujocoStep(mjm, mjd, param_fields=("body_mass", "body_pos", "body_inertia", "body_ipos", "body_iquat",
                                                  "dof_damping", "dof_armature", "jnt_stiffness", "actuator_gear"))
    return step, mjm


@pytest.mark.parametrize("steps", ONE_AND_TEN_STEPS)
def test_tree_gradient_matches_finite_differences_of_mj_step(tree, steps):
    """A tree whose branches share a body (the torso): mujoco_warp walks it one thread per root-to-leaf branch, so
    both threads write the shared body, and a per-kernel adjoint would count its cotangent twice. The three walks
    (_kinematics_branch, _comvel_branch, _cacc_branch) are differentiated by rules; jax.grad through 1 and 10
    steps w.r.t. positions, velocities, controls, body masses, positions, inertias and inertial frames, joint
    damping, armature and stiffness (free, hinge, ball and slide joints) matches central differences of mj_step
    (measured <= 7.6e-5 relative, 2026-12-05, CPU), from a pose with the ball joint turned and from one with it at
    its spring's reference orientation.

    mujoco_warp skips what is exactly zero: the free joint's damper (damping 0, ``if damping != 0.0``) and the
    ball's spring at its reference (``quat_to_vel``'s ``if sin == 0``); the per-kernel adjoint gave 0 there (the
    free joint's damping gradient against up to 0.61 over 10 steps). Springs and dampers take a rule
    (warpnn_models.mujoco._passive_rule), so these gradients are mj_step's too. So does the position servo on the
    ball joint: its length is ``gear . quat_to_vel(q)``, whose adjoint at the identity was 0 against up to 47 from
    central differences (``_transmission_rule``)."""
    step, mjm = tree
    assert step.reverse_refusals() == {}
    described = step.program.describe()
    for stage in ("smooth._kinematics_branch", "smooth._comvel_branch", "smooth._cacc_branch",
                  "passive._spring_damper_dof_passive", "smooth._transmission"):
        assert f"stage mujoco_warp._src.{stage} (" in described
    assert (mjm.dof_damping[:6] == 0).all()
    weights = np.linspace(-1.0, 1.0, mjm.nq + mjm.nv)
    s0 = step.initial_state()

    def loss(qpos, qvel, ctrl, params):
        final, _ = rollout(step, {**s0, "qpos": qpos, "qvel": qvel, "ctrl": ctrl}, params=params, num_steps=steps)
        return weighted_state(final, weights)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    for shoulder in ([0.9, 0.2, -0.3, 0.1], [1.0, 0.0, 0.0, 0.0]):  # turned; at the spring's reference
        mjd = mujoco.MjData(mjm)
        mjd.qpos[:] = tree_pose(mjm, shoulder)
        mjd.qvel[:] = np.random.default_rng(0).normal(size=mjm.nv) * 0.5
        mjd.ctrl[:] = [0.2, -0.1, 0.3]
        got = grad(*(jnp.asarray(a[None], jnp.float32) for a in (mjd.qpos, mjd.qvel, mjd.ctrl)),
                   step.initial_params())
        checks = [(got[0], lambda m, d: d.qpos), (got[1], lambda m, d: d.qvel), (got[2], lambda m, d: d.ctrl)]
        checks += [(got[3][name], lambda m, d, name=name: getattr(m, name)) for name in step.param_fields]
        for value, where in checks:
            expected = mj_step_gradient(mjm, mjd, steps, weights, where)
            np.testing.assert_allclose(np.ravel(value), expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())


@pytest.mark.slow  # (a gradient program of its own, 9-12 s of a 2-core CPU: the suite's 10 minutes)
def test_applied_forces_differentiate_where_they_are_zero(tree):
    """The applied forces are in the default state (as ctrl: per step, differentiable). mujoco_warp skips a body
    whose ``xfrc_applied`` is exactly zero (``if ft_body == wp.spatial_vector(): continue``), and Warp's adjoint of
    that branch gave d/d(xfrc_applied) = 0 at zero where central differences of mj_step give up to 8.6. Through the
    rule (``_applied_force_rule``), at zero and away from it; ``qfrc_applied`` too."""
    step, _ = tree
    mjm, mjd = start(TREE)
    assert {"qfrc_applied", "xfrc_applied"} <= set(step.state_fields)
    s0 = step.initial_state()
    weights = np.linspace(-1.0, 1.0, mjm.nq + mjm.nv)

    def loss(qfrc, xfrc):
        final, _ = rollout(step, {**s0, "qfrc_applied": qfrc, "xfrc_applied": xfrc}, num_steps=1)
        return weighted_state(final, weights)

    gradient = jax.jit(jax.grad(loss, argnums=(0, 1)))
    for force in (0.0, 0.5):
        mjd.qfrc_applied[:], mjd.xfrc_applied[1:] = force, force
        got = gradient(*(jnp.asarray(a[None], jnp.float32) for a in (mjd.qfrc_applied, mjd.xfrc_applied)))
        for name, value in zip(("qfrc_applied", "xfrc_applied"), got):
            expected = mj_step_gradient(mjm, mjd, 1, weights, lambda m, d: getattr(d, name))
            np.testing.assert_allclose(np.ravel(value), expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max(),
                                       err_msg=f"{name} at {force}")


@pytest.mark.slow  # (36 s of a 2-core CPU for one more traced model; tests/test_equality_guard.py covers the check)
def test_a_boundary_no_rule_covers_gives_nan_not_the_side_taken():
    """With a site actuator beside the ball joint's servo the transmission rule does not apply (it covers joints
    only), so ``_transmission`` takes Warp's adjoint, whose ``quat_to_vel`` branch at the identity gave 0 against
    up to 48 from central differences. The equality check makes exactly the ball's four qpos entries NaN; every
    other entry is mj_step's (measured 1.5e-6, 2026-12-06, CPU)."""
    xml = TREE.replace('<geom type="sphere" size="0.05" mass="0.2"/>',
                       '<geom type="sphere" size="0.05" mass="0.2"/><site name="tip"/>').replace(
        '<position joint="shoulder"', '<motor site="tip" gear="0 0 1 0 0 0"/>\n    <position joint="shoulder"')
    mjm, mjd = start(xml)
    with on_one_device():
        step = MujocoStep(mjm, mjd)
    assert "stage mujoco_warp._src.smooth._transmission" not in step.program.describe()
    weights = np.linspace(-1.0, 1.0, mjm.nq + mjm.nv)
    s0 = step.initial_state()

    def loss(qpos):
        final, _ = rollout(step, {**s0, "qpos": qpos}, num_steps=1)
        return weighted_state(final, weights)

    got = np.ravel(jax.jit(jax.grad(loss))(jnp.asarray(mjd.qpos[None], jnp.float32)))
    expected = mj_step_gradient(mjm, mjd, 1, weights, lambda m, d: d.qpos)
    np.testing.assert_array_equal(np.isnan(got).nonzero()[0], np.arange(9, 13))  # the ball joint's quaternion
    assert np.abs(expected[10:13]).min() > 20  # (what the side taken gave as 0)
    finite = ~np.isnan(got)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-3, atol=1e-4 * np.abs(expected).max())


def test_float_equality_branches_left_to_warps_adjoint_are_listed(tree):
    """Where the tree's step still takes Warp's adjoint of a float ``==``/``!=`` branch (its gradient there is the
    side taken, exact only off the boundary; NaN in reverse mode where a thread met equality, unless declared),
    ``equality_branches`` names the place. The springs and dampers and the transmissions do not appear: their rules
    have no such branch (``if damping != 0.0`` made d/d(dof_damping) zero at damping 0, ``quat_to_vel``'s ``if sin
    == 0`` the ball joint's servo length's derivative zero at the identity)."""
    step, _ = tree
    listed = step.program.equality_branches()
    assert listed and not any(key.startswith(("_spring_damper_dof_passive", "_transmission")) for key in listed), \
        sorted(listed)
    actuator_force = next(places for key, places in listed.items() if key.startswith("_actuator_force"))
    assert any(place.startswith("@wp.func '_wrap_period'") and "gainprm[0] == -biasprm[1]" in place
               for place in actuator_force)  # (declared: warpnn.keep_side_taken)
    assert all("==" in place or "!=" in place for places in listed.values() for place in places)


# The arm with a site at its tip and sensors of each stage: positions (a joint's, clamped by a cutoff it reaches; an
# actuator's; the tip's in the world and in the upper body's frame, clamped; the forearm's z axis in the upper
# body's frame; a subtree's centre of mass; the clock; the tip's orientation in the upper body's frame), velocities
# and accelerations (a joint's velocity, an actuator's force, the tip's accelerometer, gyro and velocimeter).
SENSORS = ARM.replace('<motor joint="shoulder" gear="1"/>', '<motor name="m0" joint="shoulder" gear="1"/>').replace(
    'size="0.04" mass="0.5"/>', 'size="0.04" mass="0.5"/><site name="tip" pos="0.5 0 0"/>').replace(
    "</actuator>", '</actuator><sensor><jointpos joint="elbow" cutoff="0.4"/><jointvel joint="shoulder"/>'
    '<actuatorfrc actuator="m0"/><actuatorpos actuator="m0"/><framepos objtype="site" objname="tip"/>'
    '<framepos objtype="site" objname="tip" reftype="body" refname="upper" cutoff="0.3"/>'
    '<framezaxis objtype="body" objname="fore" reftype="xbody" refname="upper"/><subtreecom body="fore"/><clock/>'
    '<framequat objtype="site" objname="tip" reftype="body" refname="upper"/>'
    '<accelerometer site="tip"/><gyro site="tip"/><velocimeter site="tip"/></sensor>')


@pytest.mark.slow  # (three traced models, ~60 s of a 2-core CPU)
def test_sensors_step_as_mujoco_warps_and_differentiate():
    """``sensor._sensor_pos`` computes every position sensor kind in one kernel whose geom-distance branch carries
    the nearest distance through a loop Warp's adjoint does not run again (refused whole); its rule
    (warpnn_models.mujoco._sensor_pos_rule) covers the common kinds. ``sensordata`` steps as mujoco_warp's, and the
    gradient of a loss on it through 1 and 10 steps w.r.t. the controls, the initial velocity, damping and masses
    matches central differences of mj_step (1e-3 relative; measured <= 1.1e-5 through 1 step, 2026-12-07, CPU);
    so through 2 steps do a ball joint's quaternion, a free body's position, a geom's axis in a body's frame and a
    subtree's centre of mass and a geom's orientation on the turned tree, and a tendon's length."""
    mjm, mjd = start(SENSORS, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    mjd.ctrl[:] = [0.3, -0.2]
    mujoco.mj_forward(mjm, mjd)
    assert mjd.sensordata[0] == -0.4  # (the elbow's sensor clamped by its cutoff)
    step = MujocoStep(mjm, mjd, param_fields=("dof_damping", "body_mass"))
    assert step.reverse_refusals() == {}
    assert_sensordata_equals_mujoco_warps(step, mjm, mjd, 3)
    for steps in (1, 10):
        assert_gradients_match_mj_step(step, mjm, mjd, steps, np.linspace(-1.0, 1.0, mjm.nsensordata),
                                       ("dof_damping", "body_mass"), sensors=True)

    # a ball joint's quaternion, a free body's position, a geom's axis and orientation (the tree, turned), a
    # tendon's length: 2 steps
    tree_sensors = TREE.replace("</actuator>", '</actuator><sensor><ballquat joint="shoulder"/><framepos '
                                'objtype="xbody" objname="torso"/><framexaxis objtype="geom" objname="arm_geom" '
                                'reftype="body" refname="torso"/><subtreecom body="torso"/><framequat '
                                'objtype="geom" objname="arm_geom"/></sensor>').replace(
        '<geom type="capsule" fromto="0 0 0 -0.3 0 0"', '<geom name="arm_geom" type="capsule" fromto="0 0 0 -0.3 0 0"')
    tendon_sensors = TENDON.replace("</actuator>", '</actuator><sensor><tendonpos tendon="t"/></sensor>')
    for xml, qpos in ((tree_sensors, tree_pose(mujoco.MjModel.from_xml_string(TREE), [0.9, 0.2, -0.3, 0.1])),
                      (tendon_sensors, [0.3, -0.5])):
        mjm, mjd = start(xml, qpos=qpos)
        mjm.body_sameframe[:] = 0  # (see the tree fixture)
        step = MujocoStep(mjm, mjd, param_fields=("dof_damping",))
        assert step.reverse_refusals() == {}
        assert_gradients_match_mj_step(step, mjm, mjd, 2, np.linspace(-1.0, 1.0, mjm.nsensordata), ("dof_damping",),
                                       sensors=True)



# SENSORS with contacts on (mujoco_warp computes geom distances in its collision stage, skipped where contacts are
# off: its distances are then the cutoff, where MuJoCo's are not), a sphere, a box, a floor and a rod in the world
# that nothing collides with, a ball at the forearm's tip, and the forearm's distance to the sphere (and the normal
# and segment between them, the sphere first for the normal), to the floor and (a segment) to the rod, the ball's
# to the box, and the nearest of the forearm body's to the world body's geoms: every pair kind the contact rules
# cover but two boxes (sphere or capsule against a sphere, capsule, box and plane).
DISTANCES = SENSORS.replace('contact="disable"', 'contact="enable"').replace(
    '<geom type="capsule" fromto="0 0 0 0.5 0 0" size="0.04" mass="0.5"/>',
    '<geom name="fore" type="capsule" fromto="0 0 0 0.5 0 0" size="0.04" mass="0.5"/><geom name="ball" '
    'type="sphere" pos="0.5 0 0" size="0.03" mass="0.01"/>').replace(
    "<worldbody>", '<worldbody><geom name="post" type="sphere" pos="0.9 0 -0.45" size="0.1" contype="0" '
    'conaffinity="0"/><geom name="block" type="box" pos="0.2 0 -0.6" size="0.1 0.1 0.1" contype="0" '
    'conaffinity="0"/><geom name="floor" type="plane" pos="0 0 -1.2" size="2 2 0.1" contype="0" conaffinity="0"/>'
    '<geom name="rod" type="capsule" fromto="0.6 0.2 -0.8 1.0 0.2 -0.8" size="0.05" contype="0" '
    'conaffinity="0"/>').replace(
    "<clock/>", '<distance geom1="fore" geom2="post" cutoff="1"/><normal geom1="post" geom2="fore" cutoff="1"/>'
    '<fromto geom1="fore" geom2="post" cutoff="1"/><distance geom1="fore" geom2="floor" cutoff="3"/><fromto '
    'geom1="fore" geom2="rod" cutoff="3"/><distance geom1="ball" geom2="block" cutoff="3"/><distance body1="fore" '
    'body2="world" cutoff="2"/>')


@pytest.mark.slow  # (two traced models, ~60 s of a 2-core CPU)
def test_geom_distance_sensors_differentiate():
    """Geom distance, normal and from-to sensors read the collision stage's nearest points for their geom pairs
    (contacts of type SENSOR, every candidate a pair's collision function makes, made or not); ``_sensor_pos``'s
    rule takes the nearest below the cutoff (``_geom_distance``), the narrowphase's rule computes the points.
    ``sensordata`` steps as mujoco_warp's through 10 steps; gradients through 1 and 10 steps w.r.t. the controls,
    the initial velocity, damping and masses match mj_step's central differences (1e-3). A pair the contact rules
    do not cover (a capsule and a cylinder: GJK) is refused naming the stage. (A capsule-capsule pair writes an
    infinite distance for the second, unmade, contact: the trace-time check takes equal infinities as equal.)"""
    mjm, mjd = start(DISTANCES, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    mjd.ctrl[:] = [0.3, -0.2]
    mujoco.mj_forward(mjm, mjd)
    kinds = [mujoco.mjtSensor(t) for t in mjm.sensor_type]
    first = mjm.sensor_adr[kinds.index(mujoco.mjtSensor.mjSENS_GEOMDIST)]
    assert 0.0 < mjd.sensordata[first] < 1.0  # (the forearm within the cutoff of the sphere)
    step = MujocoStep(mjm, mjd, param_fields=("dof_damping", "body_mass"))
    assert step.reverse_refusals() == {}
    assert_sensordata_equals_mujoco_warps(step, mjm, mjd, 10, rtol=2e-6)
    for steps in (1, 10):
        assert_gradients_match_mj_step(step, mjm, mjd, steps, np.linspace(-1.0, 1.0, mjm.nsensordata),
                                       ("dof_damping", "body_mass"), sensors=True)

    cylinder = DISTANCES.replace('type="sphere" pos="0.9 0 -0.45" size="0.1"', 'type="cylinder" pos="0.9 0 -0.45" '
                                 'size="0.1 0.1"')
    mjm, mjd = start(cylinder, qpos=[0.3, -0.5])
    refusals = MujocoStep(mjm, mjd).reverse_refusals()
    assert any("convex" in stage for stage in refusals), refusals


# SENSORS with a magnetic field, two cameras (one by its field of view, one by its sensor size and focal length), a
# box site the tip and a sphere site the forearm's centre of mass start in and leave by step 9, and energy on: a
# magnetometer, camera projections of the tip, inside-site tests, the potential and kinetic energies.
MORE_SENSORS = SENSORS.replace(
    '<option timestep="0.01" iterations="4">',
    '<option timestep="0.01" iterations="4" magnetic="0.1 -0.3 0.5">').replace(
    '<flag contact="disable"/>', '<flag contact="disable" energy="enable"/>').replace(
    "<worldbody>", '<worldbody><camera name="c" pos="0.4 -2 0.1" xyaxes="1 0 0 0 0 1" resolution="640 480"/>'
    '<camera name="c2" pos="0.2 -2 0.1" xyaxes="1 0 0 0 0 1" resolution="320 240" sensorsize="0.01 0.008" '
    'focal="0.02 0.02"/><site name="zone" type="box" pos="0.8 0 0.02" size="0.3 0.3 0.1"/>'
    '<site name="ball" type="sphere" pos="0.5 0 0" size="0.246"/>').replace(
    "<clock/>", '<magnetometer site="tip"/><camprojection site="tip" camera="c"/><camprojection site="tip" '
    'camera="c2"/><insidesite objtype="site" objname="tip" site="zone"/><insidesite objtype="body" objname="fore" '
    'site="ball"/><e_potential/><e_kinetic/>')


@pytest.mark.slow  # (~60 s of a 2-core CPU)
def test_magnetometers_cameras_inside_sites_and_energies_differentiate():
    """The other position sensor kinds of the rule: a magnetometer, camera projections (pixels), inside-site tests
    (0 or 1, derivative 0) and the energies (the kinetic one summed by ``tile_reduce`` in ``_energy_vel_kinetic``,
    which Warp has no adjoint for: a rule). ``sensordata`` steps as mujoco_warp's; gradients through 1 and 10 steps
    match mj_step's central differences (1e-3 relative). mujoco_warp's kinetic energy sensor reads this step's
    energy where MuJoCo's reads the one its last step left (measured: mj_step's after 2 steps equals mujoco_warp's
    after 1), so it takes part through 1 step only."""
    mjm, mjd = start(MORE_SENSORS, qpos=[0.3, -0.5], qvel=[0.5, -1.0])
    mjd.ctrl[:] = [0.3, -0.2]
    types = [mujoco.mjtSensor(t) for t in mjm.sensor_type]
    inside = [mjm.sensor_adr[i] for i, t in enumerate(types) if t == mujoco.mjtSensor.mjSENS_INSIDESITE]
    mujoco.mj_forward(mjm, mjd)
    assert list(mjd.sensordata[inside]) == [1.0, 1.0]
    step = MujocoStep(mjm, mjd, param_fields=("dof_damping", "body_mass"))
    assert step.reverse_refusals() == {}
    sensordata = assert_sensordata_equals_mujoco_warps(step, mjm, mjd, 10, rtol=2e-6)
    assert list(sensordata[0, inside]) == [0.0, 0.0]  # (both left their sites)
    weights = np.linspace(-1.0, 1.0, mjm.nsensordata)
    assert_gradients_match_mj_step(step, mjm, mjd, 1, weights, ("dof_damping", "body_mass"), sensors=True)
    weights[mjm.sensor_adr[types.index(mujoco.mjtSensor.mjSENS_E_KINETIC)]] = 0.0
    assert_gradients_match_mj_step(step, mjm, mjd, 10, weights, ("dof_damping", "body_mass"), sensors=True)


def test_contacts_the_rules_do_not_cover_are_refused_naming_the_stage():
    """A box on a box, by mujoco_warp's default convex narrowphase (GJK/EPA; its box-box primitive only with
    ``nativeccd`` disabled, as in STACK): the narrowphase rule computes the primitive pairs in ``_PAIR_CONTACTS``, and
    the convex collision kernel is refused, so reverse mode through the step is refused naming the stage, never
    zeros."""
    box_on_box = BOX.replace('<geom type="plane" size="2 2 0.1"/>', '<geom type="box" size="1 1 0.1"/>')
    mjm, mjd = start(box_on_box)
    step = MujocoStep(mjm, mjd)
    refusals = step.reverse_refusals()
    assert "mujoco_warp._src.collision_primitive._primitive_narrowphase" not in refusals
    why = refusals["mujoco_warp._src.collision_convex.ccd_kernel_builder"]
    assert why.startswith("collision_convex: its rule raised NotImplementedError: collision narrowphase (convex")
    assert 'nativeccd=\"disable\"' in why  # (the fix for boxes)
    with pytest.raises(TypeError, match="ccd_kernel_builder.*nativeccd"):
        jax.grad(lambda q: jnp.sum(rollout(step, {**step.initial_state(), "qvel": q}, num_steps=2)[0]["qpos"]))(
            step.initial_state()["qvel"])


@wp.kernel(module="unique")
def _mujoco_warps_contact(pair: int, pos1: wp.array(dtype=wp.vec3), rot1: wp.array(dtype=wp.mat33),
                          size1: wp.array(dtype=wp.vec3), pos2: wp.array(dtype=wp.vec3),
                          rot2: wp.array(dtype=wp.mat33), size2: wp.array(dtype=wp.vec3), cid: wp.array(dtype=int),
                          dist: wp.array(dtype=float), pos: wp.array(dtype=wp.vec3), frame: wp.array(dtype=wp.mat33)):
    """Contact ``cid[i]`` of geoms 1 and 2 as mujoco_warp's narrowphase computes it (its wrappers' calls of
    ``collision_primitive_core``), for the pairs in PAIRS' order."""
    i = wp.tid()
    p1, p2, r1, r2, s1, s2, k = pos1[i], pos2[i], rot1[i], rot2[i], size1[i], size2[i], cid[i]
    n = wp.vec3(r1[0, 2], r1[1, 2], r1[2, 2])  # a plane's normal (geom 1's z axis)
    axis = wp.vec3(r2[0, 2], r2[1, 2], r2[2, 2])  # geom 2's axis
    d = float(0.0)
    p = wp.vec3()
    f = mjw_math.make_frame(n)
    # (each branch its own names: Warp merges a name assigned in several branches, which must then have one type)
    if pair == 0:  # plane-sphere
        d, p = mjw_core.plane_sphere(n, p1, p2, s2[0])
    elif pair == 1:  # plane-capsule
        d2, p2x3, f2 = mjw_core.plane_capsule(n, p1, p2, axis, s2[0], s2[1])
        d, p, f = d2[k], p2x3[k], f2
    elif pair == 2:  # plane-ellipsoid
        d, p, n_ellipsoid = mjw_core.plane_ellipsoid(n, p1, p2, r2, s2)
        f = mjw_math.make_frame(n_ellipsoid)
    elif pair == 3:  # plane-cylinder
        d4, p4x3, n_cylinder = mjw_core.plane_cylinder(n, p1, p2, axis, s2[0], s2[1])
        d, p, f = d4[k], p4x3[k], mjw_math.make_frame(n_cylinder)
    elif pair == 4:  # plane-box
        d8, p8x3, n_box = mjw_core.plane_box(n, p1, p2, r2, s2)
        d, p, f = d8[k], p8x3[k], mjw_math.make_frame(n_box)
    elif pair == 5:  # sphere-sphere
        d, p, n_spheres = mjw_core.sphere_sphere(p1, s1[0], p2, s2[0])
        f = mjw_math.make_frame(n_spheres)
    elif pair == 6:  # sphere-capsule
        d, p, n_sphere_capsule = mjw_core.sphere_capsule(p1, s1[0], p2, axis, s2[0], s2[1])
        f = mjw_math.make_frame(n_sphere_capsule)
    elif pair == 7:  # sphere-cylinder
        d, p, n_sphere_cylinder = mjw_core.sphere_cylinder(p1, s1[0], p2, axis, s2[0], s2[1])
        f = mjw_math.make_frame(n_sphere_cylinder)
    elif pair == 8:  # sphere-box
        d, p, n_sphere_box = mjw_core.sphere_box(p1, s1[0], p2, r2, s2)
        f = mjw_math.make_frame(n_sphere_box)
    elif pair == 9:  # capsule-capsule
        axis1 = wp.vec3(r1[0, 2], r1[1, 2], r1[2, 2])
        dc, pc, nc = mjw_core.capsule_capsule(p1, axis1, s1[0], s1[1], p2, axis, s2[0], s2[1])
        d, p = dc[k], wp.vec3(pc[k, 0], pc[k, 1], pc[k, 2])
        f = mjw_math.make_frame(wp.vec3(nc[k, 0], nc[k, 1], nc[k, 2]))
    elif pair == 11:  # box-box (acceptance band 0)
        nbb, dbb, pbb, normal_bb = mjw_core.box_box(p1, r1, s1, p2, r2, s2, 0.0)
        d, p = wp.where(k < nbb, dbb[k], 1.0e10), wp.vec3(pbb[k, 0], pbb[k, 1], pbb[k, 2])
        f = mjw_math.make_frame(normal_bb)
    elif pair == 10:  # capsule-box
        axis1 = wp.vec3(r1[0, 2], r1[1, 2], r1[2, 2])
        db, pb, nb = mjw_core.capsule_box(p1, axis1, s1[0], s1[1], p2, r2, s2)
        d, p = db[k], wp.vec3(pb[k, 0], pb[k, 1], pb[k, 2])
        f = mjw_math.make_frame(wp.vec3(nb[k, 0], nb[k, 1], nb[k, 2]))
    dist[i] = d
    pos[i] = p
    frame[i] = f


PAIRS = ("plane-sphere", "plane-capsule", "plane-ellipsoid", "plane-cylinder", "plane-box", "sphere-sphere",
         "sphere-capsule", "sphere-cylinder", "sphere-box", "capsule-capsule", "capsule-box", "box-box")
CONTACTS_PER_PAIR = {"plane-capsule": 2, "plane-cylinder": 4, "plane-box": 8, "capsule-capsule": 2, "capsule-box": 2,
                     "box-box": 4}


def random_geom_pairs(pair, count, rng):
    """Poses and sizes of ``count`` geom pairs, spread so that every branch of the pair's collision function is
    taken (spheres inside and outside boxes, beside, above and past cylinders' rims; parallel capsules)."""
    from scipy.spatial.transform import Rotation

    rot = lambda: Rotation.random(count, random_state=rng).as_matrix()  # noqa: E731
    pos1, pos2 = rng.uniform(-0.25, 0.25, (count, 3)), rng.uniform(-0.25, 0.25, (count, 3))
    size1, size2 = rng.uniform(0.04, 0.2, (count, 3)), rng.uniform(0.04, 0.2, (count, 3))
    rot1, rot2 = rot(), rot()
    if pair == "capsule-capsule":
        rot2[: count // 2] = rot1[: count // 2]  # (parallel: the second pair of closest points is a contact too)
    if pair == "box-box":  # (closer: most pairs overlap, by a face or by an edge)
        pos2 = pos1 + rng.uniform(-0.15, 0.15, (count, 3))
    cid = rng.integers(0, CONTACTS_PER_PAIR.get(pair, 1), count)
    return pos1, rot1, size1, pos2, rot2, size2, cid


@pytest.mark.parametrize("pair", PAIRS)
def test_each_pairs_contacts_equal_mujoco_warps_and_differentiate(pair):
    """The narrowphase rule's JAX for each geom pair (``_PAIR_CONTACTS``) against mujoco_warp's own collision
    functions run by Warp, on 512 random poses that take every branch; and its derivative against central
    differences (float64, the pair's JAX alone), since the step's finite-difference tests reach a branch only where
    their scenes put a contact."""
    from warpnn_models.mujoco import _PAIR_CONTACTS

    # (every pair the rule computes is checked here, but plane-mesh, whose vertex is the launch's: a mesh on a plane)
    assert set(PAIRS) | {"plane-mesh"} == set(_PAIR_CONTACTS)
    geoms = random_geom_pairs(pair, 512, np.random.default_rng(PAIRS.index(pair)))
    arrays = [wp.array(a, dtype=t) for a, t in zip(geoms, (wp.vec3, wp.mat33, wp.vec3) * 2 + (int,))]
    out = wp.empty(512, float), wp.empty(512, wp.vec3), wp.empty(512, wp.mat33)
    wp.launch(_mujoco_warps_contact, 512, inputs=[PAIRS.index(pair), *arrays], outputs=list(out))
    # (at the precision rules run at, ``_stage_rules._full_float32``: XLA's GPU default rounds matmuls to TF32)
    with jax.default_matmul_precision("highest"):
        got = _PAIR_CONTACTS[pair](*(jnp.asarray(a, jnp.float32 if a.dtype.kind == "f" else jnp.int32) for a in geoms),
                                   {"band": jnp.zeros(512, jnp.float32)})  # (acceptance band 0, as the kernel above)
    # (a pair of capsules that are not parallel has no second contact, two boxes touching at an edge one: inf)
    made = np.abs(out[0].numpy()) < 1e6
    assert made.mean() > 0.6
    for value, expected in zip(got, out):
        np.testing.assert_allclose(np.asarray(value)[made], expected.numpy()[made], rtol=1e-4, atol=2e-5)

    with jax.enable_x64(True):
        pos1, rot1, size1, pos2, rot2, size2 = (jnp.asarray(a[:8], jnp.float64) for a in geoms[:6])

        def contact(pos1, turn1, size1, pos2, turn2, size2):
            # (orientations vary as rotations, as the step's do: capsule-box puts a second contact exactly on a face
            # plane, which a matrix that is not a rotation moves off, a kink no step reaches)
            dist, pos, frame = _PAIR_CONTACTS[pair](pos1, _turned(rot1, turn1), size1, pos2, _turned(rot2, turn2),
                                                    size2, jnp.asarray(geoms[6][:8]), {"band": jnp.zeros(8)})
            dist = jnp.where(dist < 1e6, dist, 0.0)  # (no contact: MJ_MAXVAL, which would swamp the differences)
            return jnp.concatenate([dist, pos.ravel(), frame.ravel()]) @ jnp.linspace(-1.0, 1.0, 8 * 13)

        turn = jnp.zeros((8, 3), jnp.float64)
        jax.test_util.check_grads(contact, (pos1, turn, size1, pos2, turn, size2), order=1, modes=["rev"], eps=1e-6)


def _turned(rot, w):
    """``rot`` turned by the rotation the Cayley transform makes of ``w``: a rotation for every ``w``, ``rot`` at 0,
    turning about ``w`` by about ``|w|`` near 0."""
    x, y, z = w[:, 0], w[:, 1], w[:, 2]
    zero = jnp.zeros_like(x)
    half_skew = 0.5 * jnp.stack([jnp.stack([zero, -z, y], -1), jnp.stack([z, zero, -x], -1),
                                 jnp.stack([-y, x, zero], -1)], -2)
    eye = jnp.eye(3, dtype=w.dtype)
    return rot @ jnp.linalg.solve(eye - half_skew, eye + half_skew)


# Three free capsules and a ball piled on a plane: two capsules lying side by side (parallel: two contacts between
# them), one across both, the ball on top; all land on the plane within a few steps.
CAPSULES = """
<mujoco model="capsules">
  <option timestep="0.005" iterations="10"/>
  <worldbody>
    <geom type="plane" size="2 2 0.1"/>
    <body pos="0 0 0.0505" euler="0 90 0"><freejoint/><geom type="capsule" size="0.05 0.15" mass="1"/></body>
    <body pos="0.01 0.098 0.0505" euler="0 90 0"><freejoint/><geom type="capsule" size="0.05 0.12" mass="1"/></body>
    <body pos="0.03 0.05 0.137" euler="90 0 10"><freejoint/><geom type="capsule" size="0.04 0.1" mass="0.7"/></body>
    <body pos="0.1 -0.02 0.155"><freejoint/><geom type="sphere" size="0.06" mass="0.5"/></body>
  </worldbody>
</mujoco>
"""


def contact_gradients(step, mjm, mjd, steps, params=("geom_friction",)):
    """jax.grad of weights . [qpos; qvel] after ``steps`` w.r.t. qvel and the model parameters ``params``, each next
    to mj_step's central differences."""
    s0 = step.initial_state()
    weights = np.linspace(-1.0, 1.0, mjm.nq + mjm.nv)

    def loss(qvel, params):
        start_state = {**s0, "qpos": jnp.asarray(mjd.qpos[None], jnp.float32), "qvel": qvel}
        final, _ = rollout(step, start_state, params=params, num_steps=steps)
        return weighted_state(final, weights)

    got = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.asarray(mjd.qvel[None], jnp.float32), step.initial_params())
    return [(np.ravel(got[0]), mj_step_gradient(mjm, mjd, steps, weights, lambda m, d: d.qvel))] + [
        (np.ravel(got[1][name]), mj_step_gradient(mjm, mjd, steps, weights, lambda m, d, name=name: getattr(m, name)))
        for name in params]


def assert_contact_gradients_match_mj_step(step, mjm, mjd, steps, params=CONTACT_PARAMS, speed=0.1):
    """From ``mjd`` set moving (random initial velocities of scale ``speed``), ``contact_gradients`` equal
    ``mj_step``'s central differences to 1e-2 relative (1e-3 of the largest absolute)."""
    mjd = copy.copy(mjd)
    mjd.qvel[:] = np.random.default_rng(0).normal(size=mjm.nv) * speed
    for got, expected in contact_gradients(step, mjm, mjd, steps, params):
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-3 * np.abs(expected).max())


@pytest.fixture(scope="module")
def capsules():
    return traced_with_friction(CAPSULES)


@pytest.mark.parametrize("steps", ONE_AND_TEN_STEPS)
def test_capsule_contacts_differentiate(capsules, steps):
    """Plane-capsule, sphere-capsule and capsule-capsule contacts (parallel capsules: the second closest pair
    too), by the narrowphase rule: jax.grad through 1 and 10 steps w.r.t. the initial velocities and geom_friction
    against central differences of mj_step (measured <= 1.2e-5 relative, 2026-12-05, CPU)."""
    step, mjm, mjd = capsules
    assert step.reverse_refusals() == {}
    pairs = {tuple(sorted((int(mjm.geom_type[c.geom1]), int(mjm.geom_type[c.geom2])))) for c in mjd.contact[:mjd.ncon]}
    assert pairs == {(2, 3), (3, 3)}  # (sphere-capsule, capsule-capsule at the start; the plane within steps)
    assert_contact_gradients_match_mj_step(step, mjm, mjd, steps, ("geom_friction",), speed=0.2)


def test_a_contact_the_rule_computes_otherwise_than_the_launch_has_a_nan_gradient(capsules, monkeypatch):
    """Where the narrowphase rule's JAX takes another branch than the launch did (a tie that float32 rounding breaks
    either way: which end of a capsule, which face of a box), it would differentiate another contact than the one
    the step made: that gradient is NaN, never the other contact's. Simulated by swapping the two contacts of
    parallel capsules in the rule after the step was traced (the trace-time check ran the real function; with it
    the gradients are finite and right: test_capsule_contacts_differentiate)."""
    from warpnn_models import mujoco as mujoco_module

    step, mjm, mjd = capsules
    capsule = mujoco.mjtGeom.mjGEOM_CAPSULE
    side_by_side = [c for c in mjd.contact[:mjd.ncon] if mjm.geom_type[c.geom1] == mjm.geom_type[c.geom2] == capsule]
    assert len(side_by_side) >= 2  # (two parallel capsules: two closest pairs, collision ids 0 and 1)
    start_state = step.initial_state()

    def gradient():
        loss = lambda qpos: jnp.sum(rollout(step, {**start_state, "qpos": qpos}, num_steps=1)[0]["qpos"])  # noqa: E731
        return np.asarray(jax.grad(loss)(start_state["qpos"]))

    capsule_capsule = mujoco_module._PAIR_CONTACTS["capsule-capsule"]

    def swapped(pos1, rot1, size1, pos2, rot2, size2, cid, launch):
        return capsule_capsule(pos1, rot1, size1, pos2, rot2, size2, 1 - cid, launch)

    monkeypatch.setitem(mujoco_module._PAIR_CONTACTS, "capsule-capsule", swapped)
    assert np.isnan(gradient()).any()


def settled_with_friction(xml, settle=200, **options):
    """A scene settled (``settle`` mj_steps), traced from there with the contact parameters (``MujocoStep``'s
    ``options``), its MjModel and the settled MjData."""
    mjm = mujoco.MjModel.from_xml_string(xml)
    mjd = mujoco.MjData(mjm)
    for _ in range(settle):
        mujoco.mj_step(mjm, mjd)
    with on_one_device():
        step = MujocoStep(mjm, mjd, param_fields=CONTACT_PARAMS, **options)
    return step, mjm, mjd


# A mesh (a wedge: six vertices, two triangular and three quadrilateral faces) resting on a plane on one of its
# quadrilateral faces, and tipped onto an edge: mujoco_warp's plane_convex contacts (the support vertex, then the
# incident face's hull), each a mesh vertex. (The wedges do not collide with each other: a mesh pair goes to
# mujoco_warp's convex narrowphase, refused.)
MESH_ON_PLANE = """
<mujoco model="wedge">
  <option timestep="0.005" iterations="10"/>
  <asset><mesh name="wedge" vertex="-0.1 -0.08 0  0.1 -0.08 0  -0.1 0.08 0  0.1 0.08 0  -0.1 0 0.12  0.1 0 0.12"/></asset>
  <worldbody>
    <geom type="plane" size="2 2 0.1" contype="0" conaffinity="1"/>
    <body pos="0 0 0.002"><freejoint/><geom type="mesh" mesh="wedge" mass="1" contype="1" conaffinity="0"/></body>
    <body pos="0.5 0 0.05" euler="30 0 0"><freejoint/>
      <geom type="mesh" mesh="wedge" mass="1" contype="1" conaffinity="0"/></body>
  </worldbody>
</mujoco>
"""


def test_a_mesh_on_a_plane_differentiates():
    """Plane-mesh contacts: each is a mesh vertex, which the rule reads back from the contact the launch wrote and
    moves with the mesh's pose. jax.grad through 3 steps (from the second, the contacts are where the initial
    velocities moved the vertices) w.r.t. the initial velocities and the contact parameters against central
    differences of mj_step (measured <= 2.5e-5 relative through 1 step, 3.1e-5 through 10, CPU)."""
    step, mjm, mjd = settled_with_friction(MESH_ON_PLANE, settle=20)
    mesh = mujoco.mjtGeom.mjGEOM_MESH
    assert sum(mjm.geom_type[c.geom2] == mesh for c in mjd.contact[:mjd.ncon]) >= 5
    assert step.reverse_refusals() == {}
    assert_contact_gradients_match_mj_step(step, mjm, mjd, 3)  # (3: the vertices move with qvel)


# A box resting on a box on a plane, turned 20 degrees about the vertical: MuJoCo's box-box collision (mjc_BoxBox,
# mujoco_warp's box_box), which mujoco_warp uses with nativeccd disabled (else GJK/EPA, refused); the face contact
# clips the upper box's bottom to the lower one's top (five corners).
STACK = """
<mujoco model="stack">
  <option timestep="0.005" iterations="10"><flag nativeccd="disable"/></option>
  <worldbody>
    <geom type="plane" size="2 2 0.1" contype="1" conaffinity="0"/>
    <body pos="0 0 0.1"><freejoint/><geom type="box" size="0.1 0.1 0.1" mass="1" contype="2" conaffinity="3"/></body>
    <body pos="0.02 0.01 0.28" euler="0 0 20"><freejoint/>
      <geom type="box" size="0.08 0.06 0.08" mass="0.5" contype="2" conaffinity="2"/></body>
  </worldbody>
</mujoco>
"""


@pytest.fixture(scope="module")
def stack():
    return settled_with_friction(STACK)


@pytest.mark.parametrize("steps", ONE_AND_TEN_STEPS)
def test_a_box_on_a_box_differentiates(stack, steps):
    """Box-box contacts (the separating axis, the incident face clipped to the reference face, its corners in the
    band): jax.grad through 1 and 10 steps w.r.t. the initial velocities and the contact parameters against central
    differences of mj_step (measured <= 2.1e-5 relative through 1 step, 1.4e-4 through 10, CPU)."""
    step, mjm, mjd = stack
    box = mujoco.mjtGeom.mjGEOM_BOX
    assert sum(mjm.geom_type[c.geom1] == mjm.geom_type[c.geom2] == box for c in mjd.contact[:mjd.ncon]) == 5
    assert step.reverse_refusals() == {}
    assert_contact_gradients_match_mj_step(step, mjm, mjd, steps)


# An ellipsoid and a cylinder (on its side) on a plane, a ball and a capsule on a box, a ball on a cylinder's cap and
# one against its side: the pairs plane-ellipsoid, plane-cylinder, sphere-box, capsule-box (its two contacts, one at
# each end) and sphere-cylinder (and plane-sphere), each only where it is named (contype / conaffinity: the free
# geoms' other pairs would be convex collisions, refused).
SHAPES = """
<mujoco model="shapes">
  <option timestep="0.005" iterations="10"/>
  <worldbody>
    <geom type="plane" size="2 2 0.1" contype="0" conaffinity="1"/>
    <geom type="box" pos="1 0 0.1" size="0.1 0.1 0.1" contype="0" conaffinity="2"/>
    <geom type="cylinder" pos="-0.5 0 0.1" size="0.05 0.1" contype="0" conaffinity="4"/>
    <body pos="0 0 0.05" euler="5 3 0"><freejoint/>
      <geom type="ellipsoid" size="0.1 0.07 0.05" mass="1" contype="1" conaffinity="0"/></body>
    <body pos="0.5 0 0.05" euler="90 0 0"><freejoint/>
      <geom type="cylinder" size="0.05 0.1" mass="1" contype="1" conaffinity="0"/></body>
    <body pos="1.02 0.01 0.25"><freejoint/>
      <geom type="sphere" size="0.05" mass="0.5" contype="2" conaffinity="0"/></body>
    <body pos="-0.5 0.01 0.25"><freejoint/>
      <geom type="sphere" size="0.04" mass="0.5" contype="4" conaffinity="0"/></body>
    <body pos="-0.41 0 0.05"><freejoint/><geom type="sphere" size="0.04" mass="0.5" contype="5" conaffinity="0"/></body>
    <body pos="0.97 -0.06 0.24" euler="0 80 0"><freejoint/>
      <geom type="capsule" size="0.03 0.05" mass="0.3" contype="2" conaffinity="0"/></body>
  </worldbody>
</mujoco>
"""


@pytest.fixture(scope="module")
def shapes():
    # (a dense constraint Jacobian: with 36 dofs mujoco_warp's default would be sparse, which the solver's rule
    # refuses)
    return settled_with_friction(SHAPES, sparse_jacobian=False)


# (slow: 42 s of a 2-core CPU for 1 step, the suite's 10 minutes; each of its pairs is checked alone by
# test_each_pairs_contacts_..., and whole steps with contacts by the box, capsule, stack and mesh scenes)
@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 10])
def test_ellipsoid_cylinder_and_box_contacts_differentiate(shapes, steps):
    """The narrowphase rule's other pairs in one scene, settled and then set moving: jax.grad through 1 and 10 steps
    w.r.t. the initial velocities and the contact parameters against central differences of mj_step (measured
    <= 4.0e-5 relative through 1 step, 6.0e-4 through 10, CPU)."""
    step, mjm, mjd = shapes
    pairs = {(int(mjm.geom_type[c.geom1]), int(mjm.geom_type[c.geom2])) for c in mjd.contact[:mjd.ncon]}
    g = mjw_types.GeomType
    assert pairs == {(g.PLANE, g.SPHERE), (g.PLANE, g.ELLIPSOID), (g.PLANE, g.CYLINDER), (g.SPHERE, g.CYLINDER),
                     (g.SPHERE, g.BOX), (g.CAPSULE, g.BOX)}
    assert step.reverse_refusals() == {}
    assert_contact_gradients_match_mj_step(step, mjm, mjd, steps)


# Two free boxes sliding on a plane under elliptic friction cones, one with sliding friction only (condim 3), one
# with torsional and rolling friction too (condim 6); impratio 1.5 (friction rows stiffer than the normal's). The
# boxes collide with the plane only (contype / conaffinity): box-box contacts are a convex collision, refused.
ELLIPTIC = """
<mujoco model="elliptic">
  <option timestep="0.005" iterations="10" cone="elliptic" impratio="1.5"/>
  <worldbody>
    <geom type="plane" size="2 2 0.1" contype="2" conaffinity="1"/>
    <body pos="0 0 0.1"><freejoint/><geom type="box" size="0.1 0.1 0.1" mass="1" condim="3" conaffinity="2"/></body>
    <body pos="0.5 0 0.1"><freejoint/><geom type="box" size="0.1 0.1 0.1" mass="1" condim="6" conaffinity="2"
      friction="0.8 0.02 0.01"/></body>
  </worldbody>
</mujoco>
"""


@pytest.fixture(scope="module")
def elliptic():
    return traced_with_friction(ELLIPTIC)


@pytest.mark.parametrize("steps", ONE_AND_TEN_STEPS)
def test_elliptic_cones_differentiate(elliptic, steps):
    """Elliptic friction cones: the contact rows' rule (``_elliptic_rows_rule``: mujoco_warp divides a friction
    row's ``efc.D`` in place, which Warp's adjoint gets wrong), the Jacobian's rows along and about the contact
    frame, and the solver's implicit rule with the cone's force (the middle zone, where a contact's rows couple).
    The boxes, settled on the plane, are set sliding and turning: every contact of the first step is in the cone's
    middle zone (state CONE); the slip lifts them off and they land again within 10 steps. jax.grad w.r.t. the
    initial velocities and the contact parameters (friction: sliding, torsional, rolling; solref, solimp, margin)
    matches central differences of mj_step (measured <= 3.9e-5 relative through 1 step, 5.7e-5 through 10, CPU)."""
    step, mjm, mjd = elliptic
    assert step.reverse_refusals() == {}
    mjd = mujoco.MjData(mjm)
    for _ in range(300):  # (settled: 8 contacts, a tenth of a millimetre deep)
        mujoco.mj_step(mjm, mjd)
    mjd.qvel[:] = [0.5, 0.2, 0.0, 0.0, 0.0, 0.0, -0.5, 0.3, 0.0, 0.0, 0.0, 1.0]
    first = copy.copy(mjd)
    mujoco.mj_step(mjm, first)
    assert first.ncon == 8 and (first.efc_state[:first.nefc] == mujoco.mjtConstraintState.mjCNSTRSTATE_CONE).all()
    checks = contact_gradients(step, mjm, mjd, steps, CONTACT_PARAMS)
    for got, expected in checks:
        np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-3 * np.abs(expected).max())
    friction = checks[1 + CONTACT_PARAMS.index("geom_friction")][0].reshape(mjm.ngeom, 3)  # (after qvel's check)
    assert np.abs(friction[2, 1:]).min() > 0  # (the torsional and rolling coefficients reach the loss)


@pytest.mark.parametrize("path", ["selects", "gather"])
def test_each_contact_rows_root_centre_of_mass_and_its_reverse_are_a_gathers(path, monkeypatch):
    """The contact Jacobian rule takes each row's geoms' subtree-root centres of mass by a select per root up to
    ``ROOTS_BY_SELECTS`` roots and by a gather beyond (a scene of many free bodies; no test model has that many
    roots in contact): both equal a plain gather on the contact rows, and so do their reverses."""
    import warpnn_models.mujoco as mujoco_models

    monkeypatch.setattr(mujoco_models, "ROOTS_BY_SELECTS", 8 if path == "selects" else 0)
    rng = np.random.default_rng(0)
    worlds, rows, bodies = 3, 7, 6
    roots = np.array([0, 2, 5])
    root = jnp.asarray(rng.choice(roots, size=(worlds, rows, 2)))
    contact_row = jnp.asarray(rng.random((worlds, rows)) < 0.6)
    subtree_com = jnp.asarray(rng.normal(size=(worlds, bodies, 3)), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(worlds, rows, 2, 3)), jnp.float32)

    def masked(com):
        return jnp.sum(jnp.where(contact_row[..., None, None], com, 0.0) * weights)

    plain = lambda c: masked(c[jnp.arange(worlds)[:, None, None], root])  # noqa: E731
    rule = lambda c: masked(mujoco_models._root_centres_of_mass(c, root, roots, contact_row))  # noqa: E731
    assert_close(rule(subtree_com), plain(subtree_com))
    assert_close(jax.grad(rule)(subtree_com), jax.grad(plain)(subtree_com), rtol=1e-6, atol=1e-7)
    assert np.abs(np.asarray(jax.grad(plain)(subtree_com))).max() > 0


@pytest.mark.slow  # (55 s of CI's CPU; capsule contacts and branching trees: the capsule and tree tests)
def test_humanoid_differentiates():
    """mujoco_warp's test humanoid (27 dofs, capsules on a floor, a branching tree) from its keyframe: jax.grad
    through a step w.r.t. the velocities and geom_friction against central differences of mj_step (measured
    3e-6 and 4e-5 relative, 2026-12-05, CPU). Only the lights are listed as refused (nothing reads them)."""
    import os

    mjm = mujoco.MjModel.from_xml_path(os.path.join(os.path.dirname(mjw.__file__), "test_data", "humanoid",
                                                    "humanoid.xml"))
    mjd = mujoco.MjData(mjm)
    mujoco.mj_resetDataKeyframe(mjm, mjd, 0)
    mujoco.mj_forward(mjm, mjd)
    step = MujocoStep(mjm, mjd, nconmax=32, njmax=128, param_fields=("geom_friction",))
    assert set(step.reverse_refusals()) == {"_light_local_to_global"}
    assert_contact_gradients_match_mj_step(step, mjm, mjd, 1, ("geom_friction",))


@wp.kernel
def _kbimp_by_mujoco_warp(solref: wp.array(dtype=wp.vec2), solimp: wp.array(dtype=mjw_types.vec5),
                          distance: wp.array(dtype=float), flags: int, timestep: float, out: wp.array(dtype=wp.vec3)):
    i = wp.tid()
    out[i] = mjw_constraint._contact_kbimp(flags, timestep, solref[i], solimp[i], distance[i], False)


@pytest.mark.parametrize("refsafe", [True, False])
def test_the_contact_impedance_equals_mujoco_warps(refsafe):
    """``_impedance`` (the elliptic contact rows' rule's stiffness, damping and impedance) against mujoco_warp's
    ``_contact_kbimp`` run by Warp, over time-constant and direct ``solref``, ``solimp`` of every shape (power 1,
    above and below ``mid``, ``dmin == dmax``, a zero width) and distances inside, at and beyond the width."""
    from warpnn_models.mujoco import _impedance

    rng = np.random.default_rng(0)
    n = 400
    solref = np.stack([rng.uniform(0.002, 0.05, n), rng.uniform(0.3, 2.0, n)], 1)
    solref[::4] = -np.abs(solref[::4]) * [1e4, 10.0]  # direct: -stiffness, -damping
    solimp = np.stack([rng.uniform(0.5, 0.9, n), rng.uniform(0.9, 0.999, n), rng.uniform(1e-3, 0.02, n),
                       rng.uniform(0.1, 0.9, n), rng.choice([1.0, 2.0, 3.5], n)], 1)
    solimp[5::7, 1] = solimp[5::7, 0]  # dmin == dmax
    solimp[6::11, 2] = 0.0  # no width
    distance = -rng.uniform(0.0, 0.03, n)
    distance[::9] = 0.0
    timestep, flags = 0.01, 0 if refsafe else int(mjw_types.DisableBit.REFSAFE)
    out = wp.zeros(n, dtype=wp.vec3, device="cpu")
    wp.launch(_kbimp_by_mujoco_warp, n, device="cpu", inputs=[
        wp.array(solref, dtype=wp.vec2, device="cpu"), wp.array(solimp, dtype=mjw_types.vec5, device="cpu"),
        wp.array(distance, dtype=float, device="cpu"), flags, timestep, out])
    got = np.stack([np.asarray(v) for v in _impedance(jnp.asarray(solref, jnp.float32), jnp.asarray(solimp, jnp.float32),
                                                       jnp.asarray(distance, jnp.float32), timestep, refsafe)], 1)
    np.testing.assert_allclose(got, out.numpy(), rtol=2e-5, atol=1e-6)
    assert len(np.unique(np.round(got[:, 2], 4))) > 100  # (the impedance curve, not its ends only)


@wp.kernel
def _wrap_by_mujoco_warp(x0: wp.array(dtype=wp.vec3), x1: wp.array(dtype=wp.vec3), pos: wp.array(dtype=wp.vec3),
                         mat: wp.array(dtype=wp.mat33), radius: wp.array(dtype=float), kind: wp.array(dtype=int),
                         side: wp.array(dtype=wp.vec3), out: wp.array2d(dtype=wp.vec3)):
    i = wp.tid()
    length, point0, point1 = mjw_util_misc.wrap(x0[i], x1[i], pos[i], mat[i], radius[i], kind[i], side[i])
    out[i, 0] = wp.vec3(length, 0.0, 0.0)
    out[i, 1] = point0
    out[i, 2] = point1


def _wrap_cases(n, rng):
    """Tendon stretches around spheres and cylinders of random sizes and orientations: ends outside the geom, no
    side site, one outside, one inside (``wrap_inside``), every fourth."""
    def away(scale):  # (points 1.2 to 4 radii from the centre, each in its own direction)
        direction = rng.standard_normal((n, 3))
        return direction / np.linalg.norm(direction, axis=1, keepdims=True) * scale[:, None]

    radius = rng.uniform(0.05, 0.3, n)
    pos = rng.uniform(-0.5, 0.5, (n, 3))
    mat = np.stack([np.linalg.qr(rng.standard_normal((3, 3)))[0] for _ in range(n)])
    x0, x1 = (pos + away(radius * rng.uniform(1.2, 4.0, n)) for _ in range(2))
    side = np.where((np.arange(n) % 4 == 1)[:, None], pos + away(radius * rng.uniform(1.2, 3.0, n)),
                    np.where((np.arange(n) % 4 == 2)[:, None], pos + away(radius * rng.uniform(0.1, 0.8, n)),
                             mjw_types.MJ_MAXVAL))
    cylinder = rng.random(n) < 0.5
    return x0, x1, pos, mat, radius, cylinder, side


def test_the_tendon_wrap_equals_mujoco_warps():
    """``_tendon_wrap.wrap`` (the geom tendons' rule's wrap around a sphere or cylinder, in JAX) against mujoco_warp's
    ``util_misc.wrap`` run by Warp: lengths and the points where the tendon meets the geom, over random stretches,
    spheres and cylinders, no side site, one outside and one inside (Newton's iteration of ``wrap_inside``)."""
    from warpnn_models._tendon_wrap import wrap

    rng = np.random.default_rng(0)
    n = 800
    x0, x1, pos, mat, radius, cylinder, side = _wrap_cases(n, rng)
    kind = np.where(cylinder, int(mjw_types.WrapType.CYLINDER), int(mjw_types.WrapType.SPHERE))
    out = wp.zeros((n, 3), dtype=wp.vec3, device="cpu")
    vec3 = lambda a: wp.array(a.astype(np.float32), dtype=wp.vec3, device="cpu")  # noqa: E731
    wp.launch(_wrap_by_mujoco_warp, n, device="cpu", inputs=[
        vec3(x0), vec3(x1), vec3(pos), wp.array(mat.astype(np.float32), dtype=wp.mat33, device="cpu"),
        wp.array(radius.astype(np.float32), dtype=float, device="cpu"), wp.array(kind, dtype=int, device="cpu"),
        vec3(side), out])
    want = out.numpy()
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    has_side = jnp.asarray(side[:, 0] < mjw_types.MJ_MAXVAL)
    got = jax.jit(wrap)(f32(x0), f32(x1), f32(pos), f32(mat), f32(radius), jnp.asarray(cylinder), f32(side),
                        has_side)
    wrapped = want[:, 0, 0] >= 0.0
    np.testing.assert_array_equal(np.asarray(got[0]) >= 0.0, wrapped)
    np.testing.assert_allclose(got[0], want[:, 0, 0], rtol=1e-4, atol=1e-5)
    for k in (1, 2):
        np.testing.assert_allclose(np.asarray(got[k])[wrapped], want[wrapped, k], rtol=1e-4, atol=1e-5)
    inside = np.asarray(has_side) & (np.linalg.norm(side - pos, axis=1) < radius)
    for kinds in (~inside & ~np.asarray(has_side), ~inside & np.asarray(has_side), inside):  # (each branch wraps)
        assert (wrapped & kinds & cylinder).sum() > 10 and (wrapped & kinds & ~cylinder).sum() > 10


@pytest.mark.slow  # (~7 s: XLA compiles the wrap's reverse mode)
def test_the_tendon_wraps_derivatives_match_central_differences():
    """``_tendon_wrap.wrap``'s derivatives (the length and both points, with respect to the ends, the geom's position
    and radius and the side site) through every branch taken, ``wrap_inside``'s by the implicit function theorem at
    the root Newton's method found, against central differences in float64, along random directions."""
    from warpnn_models._tendon_wrap import wrap

    rng = np.random.default_rng(0)
    x0, x1, pos, mat, radius, cylinder, side = _wrap_cases(800, rng)
    has_side = jnp.asarray(side[:, 0] < mjw_types.MJ_MAXVAL)
    with jax.enable_x64(True):
        wrapped = np.asarray(jax.jit(wrap)(*(jnp.asarray(a) for a in (x0, x1, pos, mat, radius)),
                                           jnp.asarray(cylinder), jnp.asarray(side), has_side)[0]) >= 0.0
        every = np.flatnonzero(wrapped)[:96]
        args = [jnp.asarray(a[every], jnp.float64) for a in (x0, x1, pos, mat, radius, side)]
        weights = jnp.asarray(rng.standard_normal((3, len(every), 3)))

        def loss(x0, x1, pos, mat, radius, side):
            length, point0, point1 = wrap(x0, x1, pos, mat, radius, jnp.asarray(cylinder[every]), side,
                                          has_side[every])
            return jnp.sum(length * weights[0, :, 0]) + jnp.sum(point0 * weights[1]) + jnp.sum(point1 * weights[2])

        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4, 5)))(*args)
        loss = jax.jit(loss)
        for i, grad in zip((0, 1, 2, 4, 5), grads):
            assert np.isfinite(grad).all()
            for _ in range(3):  # (along random directions: central differences of the same function)
                direction = jnp.asarray(rng.standard_normal(args[i].shape))
                if i == 5:
                    direction = jnp.where(has_side[every][:, None], direction, 0.0)
                eps = 1e-5
                plus = loss(*[a + eps * direction if j == i else a for j, a in enumerate(args)])
                minus = loss(*[a - eps * direction if j == i else a for j, a in enumerate(args)])
                assert_close(jnp.sum(grad * direction), (plus - minus) / (2 * eps), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("symmetric", [True, False], ids=["Cholesky", "LU"])
def test_the_rules_solve_equals_a_dense_solve_with_its_gradient(symmetric):
    """The inertia's and the constraint solver's rules solve by Cholesky (Warp kernels on a CPU), the implicit
    integrator's a non-symmetric matrix by LU without pivoting (in JAX), with the derivative ``custom_linear_solve``
    gives (the transposed solve for LU): against ``jnp.linalg.solve`` (LAPACK's LU with pivoting), values and
    gradients with respect to the matrix and the right-hand side."""
    rng = np.random.default_rng(0)
    B = rng.standard_normal((5, 7, 7))
    A = jnp.asarray((B @ B.transpose(0, 2, 1) if symmetric else B) + 7 * np.eye(7), jnp.float32)
    b = jnp.asarray(rng.standard_normal((5, 7)), jnp.float32)
    solve = _spd_solve if symmetric else _lu_solve

    def dense(A, b):
        return jnp.linalg.solve(A, b[..., None])[..., 0]

    def loss(solve):
        return lambda A, b: jnp.sum(jnp.sin(solve(A, b)))

    assert_close(jax.jit(solve)(A, b), dense(A, b), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.jit(jax.grad(loss(solve), (0, 1)))(A, b), jax.grad(loss(dense), (0, 1))(A, b)):
        assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_dense_inertia_and_its_reverse_equal_the_matrix_built_by_scatters(tree):
    """The rules read the inertia (mujoco_warp's CSR lower triangle) as a dense matrix by one gather whose reverse
    gathers too (a custom VJP; as the gather's transpose, XLA scatter-adds: atomics on a GPU). Against the matrix
    built entry by entry, differentiated by JAX, on the tree's branching inertia (off-diagonal entries, zeros)."""
    m = tree[0].m
    rownnz, rowadr, colind = (np.asarray(a.numpy()) for a in (m.M_rownnz, m.M_rowadr, m.M_colind))
    where = np.concatenate([np.arange(a, a + n) for a, n in zip(rowadr, rownnz)])
    rows, cols = np.repeat(np.arange(m.nv), rownnz), colind[where]
    assert (rows != cols).any() and len(where) < m.nv * (m.nv + 1) // 2  # (off-diagonal entries, and zeros)

    def by_scatters(M):
        D = jnp.zeros((M.shape[0], m.nv, m.nv), M.dtype).at[:, rows, cols].set(M[:, where])
        return D.at[:, cols, rows].set(M[:, where])

    M = jax.random.normal(jax.random.PRNGKey(0), (3, where.max() + 2))  # (a column past the entries: no cotangent)
    weights = jax.random.normal(jax.random.PRNGKey(1), (3, m.nv, m.nv))
    dense = _inertia_to_dense(m)
    np.testing.assert_array_equal(jax.jit(dense)(M), by_scatters(M))
    loss = lambda to_dense: lambda M: jnp.sum(jnp.sin(to_dense(M)) * weights)  # noqa: E731
    np.testing.assert_allclose(jax.jit(jax.grad(loss(dense)))(M), jax.grad(loss(by_scatters))(M), rtol=1e-6, atol=1e-6)


def test_the_rules_solve_calls_no_linear_algebra_library():
    """jaxlib 0.10's batched LAPACK kernels split their batch over XLA's CPU thread pool and wait for the pieces: two
    at once on a two-thread pool waited on each other forever (measured on a 2-core machine with ``jnp.linalg.solve``
    at 512 worlds and Cholesky at 4,096, as in a step's backward, where the inertia's and the constraint solver's
    rules solve independently; CPU runs of the humanoid's backward at 64 and 512 worlds hung). The rules' solve and its
    derivative call no LAPACK (or cuSOLVER) custom call: on a CPU only warpnn's (the Cholesky kernels), and compiled
    for a GPU none (the kernels' one thread per world was slower there than JAX's column by column: measured, the
    humanoid's backward on an H100; ``lowering_platforms`` lowers for a GPU on a CPU-only machine too)."""
    A = jnp.broadcast_to(3.0 * jnp.eye(5), (4, 5, 5))
    b = jnp.ones((4, 5))
    both = jax.grad(lambda A, b: (_spd_solve(A, b) + _spd_solve(2 * A, 3 * b)).sum(), argnums=(0, 1))
    targets = lambda lowered: set(re.findall(r"custom_call @(\w+)", lowered))  # noqa: E731
    lowered = lambda f, platform: f.trace(A, b).lower(lowering_platforms=(platform,)).as_text()  # noqa: E731
    # (for each platform whichever machine runs the test: on a GPU machine a plain lower is the GPU's)
    assert targets(lowered(jax.jit(both), "cpu")) == {"warpnn_native_forward"}
    assert targets(lowered(jax.jit(both), "cuda")) == set()
    lapack = lowered(jax.jit(lambda A, b: jnp.linalg.solve(A, b[..., None])), "cpu")
    assert targets(lapack) - {"warpnn_native_forward"}  # (the check sees a library call where there is one)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_cholesky_kernels_equal_their_references(dtype):
    """The rules' factorization and solve (Warp kernels, one thread per matrix) against the same arithmetic in JAX
    and against NumPy, for a batch of any shape, float32 and float64."""
    from warpnn_models._linear_algebra import cholesky, cholesky_reference, cholesky_solve, cholesky_solve_reference

    rng = np.random.default_rng(3)
    B = rng.standard_normal((2, 3, 9, 9))
    A_np, b_np = B @ np.swapaxes(B, -1, -2) + 9 * np.eye(9), rng.standard_normal((2, 3, 9))
    with jax.enable_x64(dtype == np.float64):
        A, b = jnp.asarray(A_np, dtype), jnp.asarray(b_np, dtype)
        L = jax.jit(cholesky)(A)
        assert L.dtype == dtype and L.shape == A.shape
        assert_close(L, cholesky_reference(A), rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)
        assert_close(L, np.linalg.cholesky(A_np), rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-6)
        x = jax.jit(cholesky_solve)(L, b)
        assert_close(x, cholesky_solve_reference(L, b), rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-7)
        assert_close(x, np.linalg.solve(A_np, b_np[..., None])[..., 0], rtol=1e-4 if dtype == np.float32 else 1e-10,
                     atol=1e-7)
    with pytest.raises(TypeError, match="float32 or float64"):
        cholesky(jnp.asarray(A_np, jnp.bfloat16))
