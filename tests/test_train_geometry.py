"""``warpnn-train geometry``: the loss falls >= 10x, and the CLI writes its checkpoint, metrics and figures."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np

from warpnn_train import geometry
from warpnn_train.cli import main

from .helpers import assert_close

SMALL = dataclasses.replace(geometry.GeometryConfig(), template_points=512, target_points=1024, width=64, steps=150)


def test_chamfer_falls_tenfold():
    task = geometry.make_task(SMALL, seed=0)
    result = geometry.fit(task, seed=0, progress=False)
    losses = result["losses"]
    assert len(losses) == SMALL.steps and np.all(np.isfinite(losses))
    assert losses[0] / losses[-1] >= 10.0, (losses[0], losses[-1])
    # The loss that fell is the true Chamfer distance: the pure-JAX brute force agrees on the fitted cloud.
    final = result["model"](task.template)
    assert_close(geometry.chamfer(final, task.target), geometry.chamfer_reference(final, task.target), rtol=1e-5)
    assert geometry.chamfer_reference(final, task.target) <= 1.1 * losses[-1]


def test_cli_writes_checkpoint_metrics_and_figures(tmp_path):
    out = tmp_path / "geometry"
    argv = ["geometry", "--steps", "20", "--template-points", "256", "--target-points", "512", "--width", "32",
            "--out", str(out)]  # in-process: JAX is already running, on whatever backend the suite uses
    assert main(argv) == 0
    for name in ("checkpoint.eqx", "metrics.json", "loss.png", "clouds.png"):
        assert (out / name).stat().st_size > 0, name
    assert not list(out.glob(".*.tmp")), "atomic writes leave no temporary files"
    for png in ("loss.png", "clouds.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "geometry" and metrics["steps"] == 20
    assert metrics["config"]["template_points"] == 256 and metrics["config"]["width"] == 32
    assert metrics["final_loss"] < metrics["initial_loss"]
    assert_close(metrics["final_chamfer"], metrics["final_chamfer_reference"], rtol=1e-5)

    config = dataclasses.replace(geometry.GeometryConfig(), width=32, steps=20)
    checkpoint = geometry.load_checkpoint(out / "checkpoint.eqx", config)
    assert int(checkpoint["step"]) == 20
    template = jnp.asarray(geometry.sphere_points(256))
    moved = checkpoint["model"](template)
    assert float(jnp.abs(moved - template).max()) > 1e-3  # the trained weights, not the zero-initialised ones
