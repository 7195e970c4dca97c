"""The benchmark tables in docs/ regenerate from the JSON rows beside them (device, versions and command kept in
each row), so a table is never edited by hand."""

import json
import shutil
from pathlib import Path

import jax

from .helpers import ROOT


def test_mujoco_step_table_regenerates_from_its_rows(tmp_path):
    from benchmarks import mujoco_step

    shutil.copy(Path(ROOT) / "docs" / "mujoco-step-gpu.json", tmp_path)
    mujoco_step.main(["--table-only", "gpu", "--out", str(tmp_path)])
    table = (tmp_path / "mujoco-step-gpu.md").read_text()
    assert table == (Path(ROOT) / "docs" / "mujoco-step-gpu.md").read_text()
    rows = json.loads((Path(ROOT) / "docs" / "mujoco-step-gpu.json").read_text())
    for row in rows:  # every row says where it was measured, and the table says it too
        assert row["setup"].startswith("gpu: NVIDIA ") and "jax " in row["setup"] and row["setup"] in table
    assert "--models arm7" in table and "--models humanoid" in table
    assert all(row["commit"] and f"| {row['commit']} |" in table for row in rows)  # which code each row timed


def test_a_merged_run_cut_short_keeps_the_earlier_rows_it_did_not_reach(tmp_path, monkeypatch):
    """``--merge`` replaces the rows a run measures and keeps the others, also the ones it meant to measure but did
    not get to (a run stopped by its time limit dropped arm7's 8,192-world row once)."""
    from benchmarks import mujoco_step

    def earlier(model, nworld):
        return {"model": model, "nv": 7, "nworld": nworld, "steps": 20, "warpnn fwd": 1, "commit": "old"}

    table = tmp_path / f"mujoco-step-{'gpu' if jax.default_backend() == 'gpu' else 'cpu'}.json"
    table.write_text(json.dumps([earlier("arm7", 1), earlier("arm7", 16)]))
    fresh = {"model": "arm7", "nv": 7, "nworld": 1, "steps": 20, "trace_s": 0.0, "warpnn fwd": 2}
    monkeypatch.setattr(mujoco_step, "run", lambda *args: iter([fresh]))  # (measures arm7 at 1 world, then stops)
    monkeypatch.setattr(mujoco_step, "_setup", lambda: "cpu: test")
    monkeypatch.setattr(mujoco_step, "_commit", lambda: "new")
    mujoco_step.main(["--models", "arm7", "--nworld", "1", "16", "--merge", "--out", str(tmp_path)])
    rows = json.loads(table.read_text())
    assert [(r["nworld"], r["warpnn fwd"], r["commit"]) for r in rows] == [(1, 2, "new"), (16, 1, "old")]
