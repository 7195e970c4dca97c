"""warpnn-train mujoco: a MuJoCo arm's link masses and joint damping identified through MuJoCo Warp in JAX from
MuJoCo C's recording (mujoco.mj_step, float64): the loss falls >= 10x and the parameters approach the hidden ones."""

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("mujoco_warp")
pytest.importorskip("mujoco")
pytestmark = pytest.mark.quick_compile  # (tests/conftest.py)

from warpnn_train import cli, mujoco_sysid  # noqa: E402


def test_loss_falls_tenfold_and_the_parameters_approach_the_hidden_ones():
    # A shorter recording and fewer steps than the default run (400 steps recover the parameters to ~1e-6)
    config = dataclasses.replace(mujoco_sysid.ArmConfig(), frames=100, steps=120)
    task = mujoco_sysid.make_task(config)
    result = mujoco_sysid.fit(task, progress=False)
    assert result["losses"][0] / result["losses"][-1] >= 10.0, result["losses"][::20]
    fitted = mujoco_sysid.fitted_values(result["theta"])
    for name in mujoco_sysid.PARAMETERS:
        truth, guess = np.asarray(getattr(config, f"true_{name}")), np.asarray(getattr(config, f"guess_{name}"))
        error = np.abs(fitted[name] / truth - 1)
        assert (error < 0.05).all() and (error < np.abs(guess / truth - 1)).all(), (name, fitted[name], truth)


def test_cli_mujoco_end_to_end_with_resume(tmp_path):
    out = tmp_path / "mujoco"
    options = ["mujoco", "--steps", "4", "--frames", "20", "--out", str(out)]
    assert cli.main([*options, "--stop-after", "2"]) == 0  # stopped after 2 steps, checkpointed
    assert not (out / "metrics.json").exists()
    assert cli.main([*options, "--resume"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics) == sorted(metrics)
    assert metrics["steps"] == 4 and metrics["resumed_from_step"] == 2 and metrics["config"]["frames"] == 20
    assert metrics["final_loss"] < metrics["initial_loss"] and metrics["versions"]["mujoco-warp"]
    for name in ("loss.png", "parameters.png", "trajectory.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    assert not list(out.glob(".*.tmp"))
    config = dataclasses.replace(mujoco_sysid.ArmConfig(), steps=4, frames=20)
    checkpoint = mujoco_sysid.load_checkpoint(out / "checkpoint.eqx", config)
    assert int(checkpoint["step"]) == 4 and np.isfinite(checkpoint["losses"]).all()
    np.testing.assert_allclose(np.exp(checkpoint["theta"]["log_mass"]), metrics["fitted"]["mass"], rtol=1e-6)
