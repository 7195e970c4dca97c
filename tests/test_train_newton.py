"""warpnn-train newton: an NNX policy trained through Newton's own SolverSemiImplicit cuts its loss >= 10x."""

import dataclasses
import json

import numpy as np
import pytest

pytest.importorskip("newton")
pytestmark = pytest.mark.quick_compile  # (tests/conftest.py: the 30-step training test, cold: 55 -> 46 s)

from warpnn_train import cli, newton_push  # noqa: E402


def test_loss_falls_tenfold():
    # Fewer steps, a shorter rollout and a smaller batch than the default run; the held-out loss still falls >10x.
    config = dataclasses.replace(newton_push.PushConfig(), steps=20, frames=120, batch=4)  # (measured 28x)
    task = newton_push.make_task(config)
    policy = newton_push.make_policy(task, seed=0)
    result = newton_push.train(task, policy, seed=0, progress=False)
    assert result["eval_initial"] / result["eval_final"] >= 10.0, result
    assert np.isfinite(result["losses"]).all()


def test_cli_newton_end_to_end(tmp_path):
    out = tmp_path / "newton"
    options = ["newton", "--steps", "3", "--frames", "30", "--batch", "2", "--out", str(out)]
    assert cli.main([*options, "--stop-after", "2"]) == 0  # stopped after 2 steps, checkpointed
    assert not (out / "metrics.json").exists()
    assert cli.main([*options, "--resume"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics) == sorted(metrics)
    assert metrics["steps"] == 3 and metrics["config"]["batch"] == 2 and metrics["launches_per_step"] >= 5
    assert metrics["resumed_from_step"] == 2
    for name in ("loss.png", "trajectories.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")
    assert not list(out.glob(".*.tmp"))
    config = dataclasses.replace(newton_push.PushConfig(), frames=30)
    policy = newton_push.make_policy(newton_push.make_task(config), seed=5)
    assert newton_push.load_checkpoint(out / "checkpoint.msgpack", policy) == 3
    assert np.abs(np.asarray(policy.out.kernel[...])).max() > 0  # trained from a zero output layer
