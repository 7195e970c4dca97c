"""GPU probe: MujocoStep on CUDA (forward vs mujoco_warp, speed at nworld=1)."""
import time, sys
import numpy as np, jax, jax.numpy as jnp, warp as wp
sys.path.insert(0, ".")
import mujoco, mujoco_warp as mjw
from warpnn_models.mujoco import MujocoStep, rollout
from tests.test_models_mujoco import BOX, ARM, start, mujoco_warp_loop
print(jax.devices(), wp.get_device())
for name, xml, steps in (("arm", ARM, 200), ("box", BOX, 200)):
    mjm, mjd = start(xml)
    t0 = time.perf_counter(); step = MujocoStep(mjm, mjd); t_trace = time.perf_counter() - t0
    run = jax.jit(lambda s: rollout(step, s, num_steps=steps))
    final, traj = run(step.initial_state()); jax.block_until_ready(traj)
    t0 = time.perf_counter(); final, traj = run(step.initial_state()); jax.block_until_ready(traj); dt = time.perf_counter() - t0
    qpos, _ = mujoco_warp_loop(mjm, mjd, steps=steps)
    err = float(np.abs(np.asarray(traj["qpos"]) - qpos).max())
    print(f"{name}: trace {t_trace:.1f}s, replay {dt/steps*1e6:.1f} us/step, max |qpos - mujoco_warp| over {steps} steps = {err:.2e}")
