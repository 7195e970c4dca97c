"""The benchmark tables in docs/ regenerate from the JSON rows beside them (device, versions and command kept in
each row), so a table is never edited by hand."""

import json
import shutil
from pathlib import Path

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
