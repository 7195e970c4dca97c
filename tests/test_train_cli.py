"""``warpnn-train`` as a user meets it: --resume ends where an uninterrupted run ends, --out is claimed (checked
writable, refused when it holds another run, cleaned of a killed run's temporary files) before anything trains,
errors are one line, files keep the umask, --help shows defaults."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import warp as wp

from warpnn_train import cli, common

TIMING = ("steps_per_s", "wall_time_s", "resumed_from_step")  # what may differ between a run and its resumption

TASKS = {  # small versions of each task: seconds on a CPU
    "cloth": ["cloth", "--steps", "12", "--frames", "30", "--rows", "5", "--cols", "5"],
    "control": ["control", "--steps", "5", "--frames", "20", "--batch", "2"],
    "geometry": ["geometry", "--steps", "9", "--template-points", "128", "--target-points", "256", "--width", "16"],
}
CHECKPOINTS = {"cloth": "checkpoint.eqx", "control": "checkpoint.msgpack", "geometry": "checkpoint.eqx"}


def _metrics(out: Path) -> dict:
    return {k: v for k, v in json.loads((out / "metrics.json").read_text()).items() if k not in TIMING}


def _assert_same_run(resumed: Path, whole: Path, checkpoint: str, bitwise: bool) -> None:
    """On the CPU the two runs match bit for bit (checkpoint bytes and metrics); on a GPU, Warp's atomic adds
    sum in a different order in every launch, so two runs of the same steps agree only to rounding."""
    if bitwise:
        assert _metrics(resumed) == _metrics(whole)
        assert (resumed / checkpoint).read_bytes() == (whole / checkpoint).read_bytes()
        return
    a, b = common._flatten(_metrics(resumed)), common._flatten(_metrics(whole))
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], float) or (isinstance(a[key], list) and a[key] and isinstance(a[key][0], float)):
            # atol: a converged run's relative parameter errors sit at ~1e-5, where rounding moved one by 1.07e-6
            # between two H200 runs (rel_error.stiffness_shear 7.6e-6 against 6.6e-6)
            np.testing.assert_allclose(a[key], b[key], rtol=1e-3, atol=1e-5, err_msg=key)
        else:
            assert a[key] == b[key], key


# cloth: the main job; control: the task with a random key in its training state. (geometry resumes through
# the same loop and checkpoint logic; it is checked by hand, not here, to keep the suite short.)
# (cloth's is --slow on a CPU, 7 s of CI's suite: control's resumes a random key as well, through the same loop)
@pytest.mark.parametrize("task", [pytest.param("cloth", marks=pytest.mark.slow), "control"])
def test_resume_ends_where_an_uninterrupted_run_ends(tmp_path, task):
    """Stopped after a few steps and resumed (model, optimiser state, step, random key, loss history from the
    checkpoint), a run writes the same checkpoint bytes and metrics as one that ran straight through."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert cli.main([*TASKS[task], "--out", str(whole)]) == 0
    assert cli.main([*TASKS[task], "--out", str(split), "--stop-after", "3", "--checkpoint-every", "2"]) == 0
    assert not (split / "metrics.json").exists(), "a stopped run writes no final metrics"
    assert cli.main([*TASKS[task], "--out", str(split), "--resume"]) == 0
    assert json.loads((split / "metrics.json").read_text())["resumed_from_step"] == 3
    _assert_same_run(split, whole, CHECKPOINTS[task], bitwise=jax.default_backend() == "cpu")


def test_out_holding_a_run_is_refused_unless_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*TASKS["cloth"], "--out", str(out)]
    assert cli.main(args) == 0
    first = (out / "checkpoint.eqx").read_bytes()
    capsys.readouterr()

    assert cli.main(args) == 2  # same run again: refused, nothing overwritten
    err = capsys.readouterr().err
    assert "holds an earlier run" in err and "--resume" in err and "--overwrite" in err, err
    assert (out / "checkpoint.eqx").read_bytes() == first

    assert cli.main([*args, "--seed", "1", "--resume"]) == 2  # a different run cannot be resumed into
    err = capsys.readouterr().err
    assert "different run" in err and "seed 0 there, 1 now" in err, err

    assert cli.main([*args, "--seed", "1", "--overwrite"]) == 0
    assert json.loads((out / "run.json").read_text())["options"]["seed"] == 1
    assert (out / "checkpoint.eqx").read_bytes() != first

    with pytest.raises(SystemExit):  # contradictory: an argparse error
        cli.main([*args, "--resume", "--overwrite"])


def test_resume_of_an_empty_folder_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main([*TASKS["cloth"], "--out", str(empty), "--resume"]) == 2
    assert "holds no run to continue" in capsys.readouterr().err
    assert list(empty.iterdir()) == [], "no run.json, no lock file"


def test_unwritable_out_fails_before_training_in_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    start = time.perf_counter()
    assert cli.main([*TASKS["cloth"], "--out", str(blocker / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert "cannot create the folder" in err and str(blocker / "run") in err, err
    assert time.perf_counter() - start < 5, "the folder is checked before the task is built or trained"

    if os.geteuid() != 0:  # root writes anywhere: the permission check needs an ordinary user
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            assert cli.main([*TASKS["cloth"], "--out", str(locked)]) == 2
            assert "cannot write there" in capsys.readouterr().err
        finally:
            locked.chmod(0o700)


def test_errors_during_the_run_are_one_line_and_leave_nothing(tmp_path, capsys, monkeypatch):
    """An error raised while the task runs (here: more devices than JAX sees) is one line and exit 1; the folders
    the command created are removed again, lock file included."""
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # --devices N sets it in this process
    out = tmp_path / "new" / "x"
    code = cli.main([*TASKS["cloth"], "--devices", "4096", "--out", str(out)])
    assert code == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert "--devices 4096" in err and "--verbose" in err, err
    assert not (tmp_path / "new").exists(), "a failed command leaves no folder behind"
    with pytest.raises(ValueError, match="--devices 4096"):  # --verbose: the exception itself
        cli.main([*TASKS["cloth"], "--devices", "4096", "--out", str(out), "--verbose"])
    assert not (tmp_path / "new").exists()

    kept = tmp_path / "kept"  # a folder that existed keeps the user's files, and loses only what the run wrote
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert cli.main([*TASKS["cloth"], "--devices", "4096", "--out", str(kept)]) == 1
    assert sorted(p.name for p in kept.iterdir()) == ["notes.txt"]


def test_files_keep_the_umask_and_stale_temporaries_go(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    stale = out / ".checkpoint.eqx.k3j9x0qa.tmp"  # what warpnn.atomic_write leaves when a run is SIGKILLed
    stale.write_bytes(b"half a checkpoint")
    unrelated = out / ".notes.tmp"  # not an atomic-write temporary: the user's, kept
    unrelated.write_text("mine")
    previous = os.umask(0o027)
    try:
        assert cli.main([*TASKS["cloth"], "--out", str(out)]) == 0
    finally:
        os.umask(previous)
    assert not stale.exists() and unrelated.exists()
    for name in ("checkpoint.eqx", "metrics.json", "run.json", "loss.png"):
        assert (out / name).stat().st_mode & 0o777 == 0o640, (name, oct((out / name).stat().st_mode))


def test_one_run_per_folder(tmp_path):
    out = tmp_path / "run"
    claimed = common.RunDir.open(out, {"task": "a"})
    with pytest.raises(common.UsageError, match="another warpnn-train is writing there"):
        common.RunDir.open(out, {"task": "a"}, overwrite=True)
    claimed.close()  # the first run ends
    common.RunDir.open(out, {"task": "a"}, resume=True)


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["cloth", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--steps STEPS optimisation steps (default: 250)", "(default: runs/cloth)", "(default: 0.2)",
                  "--checkpoint-every N", "(default: 50)", "--resume", "--overwrite"):
        assert shown in text, shown
    assert "(default: None)" not in text


@pytest.mark.skipif(not wp.is_cpu_available(), reason="this Warp build cannot compile CPU kernels")
def test_sigterm_checkpoints_and_resume_matches(tmp_path):
    """A run sent SIGTERM (a cluster's preemption) stops after its current step with a checkpoint, exits 130 and
    tells how to continue; the resumed run matches an uninterrupted one (run in-process here)."""
    args = ["cloth", "--steps", "400", "--frames", "30", "--rows", "5", "--cols", "5", "--device", "cpu"]
    out = tmp_path / "killed"
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.Popen([sys.executable, "-m", "warpnn_train.cli", *args, "--out", str(out),
                             "--checkpoint-every", "5"], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (out / "checkpoint.eqx").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, (stdout, stderr[-3000:])
    assert "stopped after step" in stdout and "--resume" in stdout, stdout
    assert not (out / "metrics.json").exists()

    assert cli.main([*args[:-2], "--out", str(out), "--resume"]) == 0
    whole = tmp_path / "whole"
    assert cli.main([*args[:-2], "--out", str(whole)]) == 0
    assert 0 < json.loads((out / "metrics.json").read_text())["resumed_from_step"] < 400
    # Started on the CPU (the subprocess), finished on the suite's backend (the CPU in CI, a GPU elsewhere).
    _assert_same_run(out, whole, "checkpoint.eqx", bitwise=jax.default_backend() == "cpu")


# --------------------------------------------------------------------------------------------------
# Mistakes on the command line: answered before JAX or Warp loads, in one line, with nothing left behind.

# Runs warpnn-train's main in a fresh interpreter and reports its exit status and whether JAX or Warp was imported.
_PROBE = """
import json, sys
from warpnn_train import cli
try:
    code = cli.main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": sorted(m for m in ("jax", "warp", "warpnn") if m in sys.modules)}))
"""


def _cli_fresh(*argv: str, cwd: Path) -> tuple[dict, str, str]:
    proc = subprocess.run([sys.executable, "-c", _PROBE, *argv], cwd=cwd, capture_output=True, text=True, timeout=60)
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1]), proc.stderr.strip()


@pytest.mark.parametrize(("argv", "expected"), [
    (["cloth", "--steps", "0"], "argument --steps: expected an integer >= 1, got 0"),
    (["cloth", "--steps", "-5"], "argument --steps: expected an integer >= 1, got -5"),
    (["control", "--batch", "0"], "argument --batch: expected an integer >= 1, got 0"),
    (["geometry", "--lr", "abc"], "argument --lr: expected a number > 0, got 'abc'"),
    (["cloth", "--cloths-per-device", "0"], "argument --cloths-per-device: expected an integer >= 1, got 0"),
    (["cloth", "--checkpoint-every", "-1"], "argument --checkpoint-every: expected an integer >= 0, got -1"),
    (["cloth", "--stepz", "3"], "unrecognized arguments: --stepz 3"),
    (["clth"], "unknown task 'clth'"),
    (["cloth", "--resume", "--overwrite"], "give one of them"),
    (["cloth", "--resume"], "does not exist, so it holds no run to continue"),
])
def test_command_line_mistakes_fail_in_one_line_before_jax_loads(tmp_path, argv, expected):
    out = tmp_path / "runs" / "x"
    result, stdout, stderr = _cli_fresh(*argv, "--out", str(out), cwd=tmp_path)
    assert result == {"code": 2, "heavy": []}, (result, stderr)
    assert stderr.count("\n") == 0 and expected in stderr and "error:" in stderr, stderr
    assert stdout == ""
    assert list(tmp_path.iterdir()) == [], "a failed command creates no folder"


def test_help_answers_before_jax_loads(tmp_path):
    for argv in (["--help"], ["cloth", "--help"], ["newton", "--help"]):
        result, stdout, _ = _cli_fresh(*argv, cwd=tmp_path)
        assert result == {"code": 0, "heavy": []}, (argv, result)
        assert "usage: warpnn-train" in stdout
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "warpnn_train.cli", "cloth", "--help"], capture_output=True,
                          timeout=60)
    assert proc.returncode == 0 and time.perf_counter() - start < 10  # ~0.1 s; loading JAX and Warp takes seconds


# --------------------------------------------------------------------------------------------------
# A run stopped at any moment: one piece of advice, and --resume or a plain rerun works.


def _stopped_run(out: Path, capsys) -> None:
    assert cli.main([*TASKS["cloth"], "--out", str(out), "--stop-after", "3"]) == 0
    capsys.readouterr()


def test_corrupt_checkpoint_is_named_with_what_to_do(tmp_path, capsys):
    out = tmp_path / "run"
    _stopped_run(out, capsys)
    checkpoint = out / "checkpoint.eqx"
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])  # truncated, as by a full disk or a bad copy
    assert cli.main([*TASKS["cloth"], "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert f"checkpoint {checkpoint} is corrupt or truncated" in err and "--overwrite" in err, err
    assert checkpoint.stat().st_size == 100, "the refused resume leaves the folder as it was"
    assert not (out / common.LOCK_FILE).exists()
    assert cli.main([*TASKS["cloth"], "--out", str(out), "--overwrite"]) == 0  # the advice works


@pytest.mark.parametrize("how", ["rerun", "resume"])
def test_run_killed_before_its_first_checkpoint_starts_again(tmp_path, capsys, how):
    """A run killed before its first checkpoint leaves only run.json (and, killed by SIGKILL, the lock file):
    nothing to continue or keep, so a plain rerun and --resume both start it from step 0."""
    out = tmp_path / "run"
    _stopped_run(out, capsys)
    (out / "checkpoint.eqx").unlink()
    (out / common.LOCK_FILE).touch()  # what a SIGKILLed run leaves (its lock itself died with it)
    extra = ["--resume"] if how == "resume" else []
    assert cli.main([*TASKS["cloth"], "--out", str(out), *extra]) == 0
    captured = capsys.readouterr()
    assert ("holds no checkpoint yet" in captured.err) == (how == "resume"), captured.err
    assert json.loads((out / "metrics.json").read_text())["resumed_from_step"] is None
    assert not (out / common.LOCK_FILE).exists()


def test_refusals_give_the_command_that_continues_the_run(tmp_path, capsys):
    """The advice of a refused command is the command the stopped run printed (its own options and --resume)."""
    out = tmp_path / "run"
    assert cli.main([*TASKS["cloth"], "--out", str(out), "--lr", "0.1", "--stop-after", "3"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1].strip()
    assert printed.startswith("warpnn-train cloth") and "--lr 0.1" in printed and printed.endswith("--resume")
    assert "--stop-after" not in printed

    assert cli.main([*TASKS["cloth"], "--out", str(out), "--resume"]) == 2  # forgot --lr 0.1
    err = capsys.readouterr().err
    assert "holds a different run (config.lr 0.1 there, 0.2 now)" in err and f"continue it with '{printed}'" in err
    assert cli.main([*TASKS["cloth"], "--out", str(out)]) == 2
    assert f"continue it with '{printed}'" in capsys.readouterr().err
    assert not (out / common.LOCK_FILE).exists(), "a refused command releases the lock and removes its file"

    assert cli.main(printed.split()[1:]) == 0  # the advice, as printed, continues the run
    assert json.loads((out / "metrics.json").read_text())["resumed_from_step"] == 3
    assert not (out / common.LOCK_FILE).exists()
