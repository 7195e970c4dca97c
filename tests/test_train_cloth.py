"""The cloth training tasks: system identification recovers the hidden parameters, control learns, the CLI runs."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import warp as wp

from warpnn_train import cli, cloth_control, cloth_sysid

FIGURES = ("loss.png", "cloth.png")


def test_sysid_recovers_default_task_within_5_percent():
    config = cloth_sysid.SysIdConfig()  # the default task, default number of steps
    task = cloth_sysid.make_task(config, seed=0)
    result = cloth_sysid.fit(task, progress=False)
    errors = cloth_sysid.relative_errors(result["theta"], config)
    assert errors["stiffness"].max() < 0.05, errors
    assert errors["damping"].max() < 0.05, errors
    # The starting guess was far off: the recovery is the optimiser's doing.
    start = cloth_sysid.relative_errors(cloth_sysid.initial_theta(config), config)
    assert min(start["stiffness"].max(), start["damping"].max()) > 0.5
    assert result["losses"][-1] < 1e-3 * result["losses"][0]


def test_control_loss_falls_tenfold():
    # Fewer steps and a smaller batch than the main job; the held-out loss still falls well over 10x.
    config = dataclasses.replace(cloth_control.ControlConfig(), batch=4, steps=150)
    task = cloth_control.make_task(config)
    policy = cloth_control.make_policy(task, seed=0)
    result = cloth_control.train(task, policy, seed=0, progress=False)
    assert result["eval_initial"] / result["eval_final"] >= 10.0, result
    assert np.isfinite(result["losses"]).all()


def test_cli_task_selection():
    assert cli._split_task([]) == ("cloth", [])
    assert cli._split_task(["--steps", "3"]) == ("cloth", ["--steps", "3"])
    assert cli._split_task(["control", "--seed", "1"]) == ("control", ["--seed", "1"])
    with pytest.raises(SystemExit):
        cli._split_task(["clothes"])
    assert cli._task_parser("cloth").parse_args(["--steps", "3", "--device", "cpu"]).device == "cpu"


def _check_outputs(out: Path, figures, checkpoint: str) -> dict:
    text = (out / "metrics.json").read_text()
    metrics = json.loads(text)
    assert list(metrics) == sorted(metrics), "metrics.json keys must be sorted (diffable runs)"
    for key in ("final_loss", "steps_per_s", "device", "versions", "wall_time_s"):
        assert key in metrics, key
    for name in (*figures, checkpoint):
        data = (out / name).read_bytes()
        assert len(data) > 1000, name
    assert all((out / f).read_bytes().startswith(b"\x89PNG") for f in figures)
    assert not list(out.glob(".*.tmp")), "atomic writes left temporary files behind"
    return metrics


@pytest.mark.skipif(not wp.is_cpu_available(), reason="this Warp build cannot compile CPU kernels")
def test_cli_cloth_end_to_end_on_cpu(tmp_path):
    """`warpnn-train cloth --device cpu` in a fresh process (JAX_PLATFORMS must be set before JAX loads)."""
    out = tmp_path / "cloth"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run(
        [sys.executable, "-m", "warpnn_train.cli", "cloth", "--device", "cpu", "--steps", "20", "--frames", "60",
         "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote" in proc.stdout
    # Quiet by default: the progress bar, not Warp's banner, module loads or CPU-only driver notice.
    for noise in ("Warp 1.", "Module ", "CUDA driver"):
        assert noise not in proc.stdout + proc.stderr, (noise, proc.stdout[-2000:], proc.stderr[-2000:])
    metrics = _check_outputs(out, (*FIGURES, "parameters.png"), "checkpoint.eqx")
    assert metrics["backend"] == "cpu" and metrics["steps"] == 20 and metrics["config"]["frames"] == 60
    assert metrics["final_loss"] < metrics["initial_loss"]

    config = dataclasses.replace(cloth_sysid.SysIdConfig(), steps=20)  # the steps fix the history's shapes
    like = cloth_sysid.make_task(dataclasses.replace(config, frames=2)).true_cloth
    restored = cloth_sysid.load_checkpoint(out / "checkpoint.eqx", like, config)
    np.testing.assert_allclose(restored["cloth"].stiffness, metrics["fitted"]["stiffness"], rtol=1e-6)
    np.testing.assert_allclose(restored["cloth"].damping, metrics["fitted"]["damping"], rtol=1e-6)
    assert int(restored["step"]) == 20


def test_cli_control_end_to_end(tmp_path):
    out = tmp_path / "control"
    assert cli.main(["control", "--steps", "4", "--frames", "40", "--batch", "2", "--out", str(out)]) == 0
    metrics = _check_outputs(out, FIGURES, "checkpoint.msgpack")
    assert metrics["steps"] == 4 and metrics["config"]["batch"] == 2

    config = dataclasses.replace(cloth_control.ControlConfig(), frames=40)
    policy = cloth_control.make_policy(cloth_control.make_task(config), seed=123)
    assert cloth_control.load_checkpoint(out / "checkpoint.msgpack", policy) == 4
    # Trained for 4 steps from a zero output layer: restored weights are no longer zero.
    assert np.abs(np.asarray(policy.out.kernel[...])).max() > 0
