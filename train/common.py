"""What every training task shares: the output folder of a run, the training loop (progress bar, periodic
checkpoints, resume, stop), atomic files, metrics, plots."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
from tqdm.auto import tqdm

# Checkpoints, metrics and figures are written with the library's atomic writer (temp file, fsync, rename).
from warpnn import atomic_write_bytes

from .options import ConfigT, config_from_args  # noqa: F401 - also common's names, as before options.py

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; one run per folder is then the user's to keep
    fcntl = None  # type: ignore[assignment]


T = TypeVar("T")


class UsageError(Exception):
    """A mistake in how warpnn-train was called (or in what its --out holds): printed as one line, exit 2."""


RUN_FILE = "run.json"  # which run a folder holds: task, seed and configuration (written before training)
COMMAND_KEY = "command"  # in run.json, beside the identity: the command that continues the run
CHECKPOINTS = ("checkpoint.eqx", "checkpoint.msgpack")  # a task's resumable state (one per task)
# What an earlier run leaves in its folder that is worth keeping: a folder holding any of them is continued
# (--resume) or replaced (--overwrite), never silently overwritten. run.json alone (a run killed before its
# first checkpoint) holds nothing to keep: a run there starts from step 0, with or without --resume.
RUN_STATE = ("metrics.json", *CHECKPOINTS)
RUN_MARKERS = (RUN_FILE, *RUN_STATE)


@dataclasses.dataclass
class RunDir:
    """The ``--out`` folder of one run: checked, claimed and cleaned before anything trains.

    Attributes:
        path: the folder.
        identity: what makes two runs the same run (task, seed, configuration): a resumed run must match it.
        resume: continue from the checkpoint in the folder (False when there is none yet: see :meth:`open`).
        checkpoint_every: save a resumable checkpoint every this many steps (0: only at the end).
        stop_after: stop after this step, checkpointed, as if interrupted (None: run to the end).
    """

    path: Path
    identity: dict[str, Any]
    resume: bool = False
    checkpoint_every: int = 0
    stop_after: int | None = None
    _lock: Any = dataclasses.field(default=None, repr=False)  # held open for the run: see _claim
    _created: Path | None = dataclasses.field(default=None, repr=False)  # the topmost folder this run created
    _wrote_run_file: bool = dataclasses.field(default=False, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike, identity: dict[str, Any], *, resume: bool = False,
             overwrite: bool = False, checkpoint_every: int = 0, stop_after: int | None = None,
             command: str | None = None) -> RunDir:
        """Claim ``path`` for the run ``identity``, before any training.

        Creates the folder (not under ``resume``: a folder that does not exist holds no run); checks that files
        can be written in it; removes temporary files that an earlier, killed run left behind; refuses a folder
        that holds a different run's checkpoint or results (or any earlier run's, unless ``resume`` continues it
        or ``overwrite`` replaces it). A folder whose run was killed before its first checkpoint holds nothing to
        continue: the run starts from step 0 there, with or without ``resume``. ``command`` (the command that
        continues this run) is recorded for the advice a later refusal gives. Raises :class:`UsageError` with
        the fix, leaving the folder as it was.
        """
        folder = Path(path)
        if resume and not folder.is_dir():
            what = "is not a folder" if folder.exists() else "does not exist"
            raise UsageError(f"--resume: {folder} {what}, so it holds no run to continue; run without --resume to "
                             "start one")
        created = _make_folder(folder)
        run_dir = None
        try:
            _check_writable(folder)
            run_dir = cls(folder, _to_builtin(identity), resume, checkpoint_every, stop_after, _claim(folder), created)
            run_dir._start(overwrite, command)
        except BaseException:
            if run_dir is not None:
                run_dir.close(failed=True)
            else:
                _remove_created(folder, created)
            raise
        return run_dir

    def _start(self, overwrite: bool, command: str | None) -> None:
        folder, identity = self.path, self.identity
        remove_stale_temporaries(folder)
        earlier, earlier_command = self._read_run_file()
        continue_it = (f"continue it with '{earlier_command}'" if earlier_command
                       else "continue it with the options it was started with and --resume")
        has_state = any((folder / name).exists() for name in RUN_STATE)
        if self.resume:
            if earlier is None:
                raise UsageError(f"--resume: {folder} holds no run to continue; run without --resume to start one")
            if earlier != identity:
                raise UsageError(f"--resume: {folder} holds a different run ({_differences(earlier, identity)}); "
                                 f"{continue_it}, or use another --out")
            if not any((folder / name).exists() for name in CHECKPOINTS):
                print(f"warpnn-train: {folder} holds no checkpoint yet (its run stopped before the first one): "
                      "starting the run from step 0", file=sys.stderr)
                self.resume = False
        elif has_state:
            if not overwrite:
                if earlier not in (None, identity):
                    what = f"a different run ({_differences(earlier, identity)})"
                else:
                    what, continue_it = "an earlier run", "add --resume to continue it"
                raise UsageError(f"--out {folder} holds {what}: {continue_it}, --overwrite to replace it, or "
                                 "choose another --out")
            for name in RUN_MARKERS:  # a later --resume must never continue the replaced run's checkpoint
                with contextlib.suppress(FileNotFoundError):
                    (folder / name).unlink()
        if not self.resume:
            record = dict(identity, **({COMMAND_KEY: command} if command else {}))
            write_json(folder / RUN_FILE, record)
            self._wrote_run_file = True

    def _read_run_file(self) -> tuple[dict[str, Any] | None, str | None]:
        try:
            record = json.loads((self.path / RUN_FILE).read_text())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError) as e:
            raise UsageError(f"--out {self.path}: cannot read {RUN_FILE} ({e}); use --overwrite or another --out") from e
        if not isinstance(record, dict):
            raise UsageError(f"--out {self.path}: {RUN_FILE} is not a run record; use --overwrite or another --out")
        command = record.pop(COMMAND_KEY, None)
        return record, command

    def earlier_run(self) -> dict[str, Any] | None:
        """The identity recorded by the run that wrote this folder, or None."""
        return self._read_run_file()[0]

    def close(self, *, failed: bool = False) -> None:
        """Release the folder (the end of the run; a process that exits releases it too) and remove its lock file.

        ``failed``: the run ended in an error. If it left nothing to keep (no checkpoint, no results), the
        folder is left as it was before the run: its run.json removed, and the folder itself if this run created it.
        """
        if failed and not any((self.path / name).exists() for name in RUN_STATE):
            if self._wrote_run_file:
                with contextlib.suppress(FileNotFoundError):
                    (self.path / RUN_FILE).unlink()
                self._wrote_run_file = False
            _release(self.path, self._lock)
            self._lock = None
            _remove_created(self.path, self._created)
            return
        _release(self.path, self._lock)
        self._lock = None

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def __fspath__(self) -> str:
        return os.fspath(self.path)


def _make_folder(folder: Path) -> Path | None:
    """Create ``folder`` (and its missing parents); returns the topmost folder created, or None if it existed."""
    missing = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {folder}: cannot create the folder ({e.strerror}); choose another --out") from e
    if not folder.is_dir():
        raise UsageError(f"--out {folder}: exists and is not a folder; choose another --out")
    return missing[-1] if missing else None


def _remove_created(folder: Path, created: Path | None) -> None:
    """Remove the folders from ``folder`` up to ``created`` that a failed run created, where they are empty."""
    if created is None:
        return
    for p in (folder, *folder.parents):
        try:
            p.rmdir()
        except OSError:  # not empty (the user's files, or another run's), or gone
            return
        if p == created:
            return


# Options that say how to run, not which run: they may differ between a run and its --resume.
CONTROL_OPTIONS = frozenset({"task", "out", "device", "resume", "overwrite", "verbose", "checkpoint_every",
                             "stop_after", "run_dir"})


def run_identity(task: str, args: Any, config: Any = None) -> dict[str, Any]:
    """What makes two runs the same run: the task, its configuration (a dataclass, if the task has one) and
    every other option that is not a :data:`CONTROL_OPTIONS` one (seed, ...)."""
    fields = set(config.__dataclass_fields__) if dataclasses.is_dataclass(config) else set()
    options = {k: v for k, v in sorted(vars(args).items()) if k not in CONTROL_OPTIONS and k not in fields}
    identity: dict[str, Any] = {"task": task, "options": options}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        identity["config"] = dataclasses.asdict(config)
    return _to_builtin(identity)


def run_dir(args: Any, config: Any = None) -> RunDir:
    """The run folder the CLI opened for ``args`` (``args.run_dir``), or, for a task's ``run(args)`` called
    directly, one opened now from ``args.out`` and friends."""
    opened = getattr(args, "run_dir", None)
    if opened is not None:
        return opened
    return RunDir.open(args.out, run_identity(getattr(args, "task", "?"), args, config),
                       resume=getattr(args, "resume", False), overwrite=getattr(args, "overwrite", False),
                       checkpoint_every=getattr(args, "checkpoint_every", 0) or 0,
                       stop_after=getattr(args, "stop_after", None))


def _differences(earlier: dict[str, Any] | None, now: dict[str, Any]) -> str:
    """``"seed 0 there, 1 now; config.lr 0.2 there, 0.1 now"``: where two run identities differ."""
    if earlier is None:
        return "no run.json"
    flat_then, flat_now = _flatten(earlier), _flatten(now)
    keys = sorted(set(flat_then) | set(flat_now))
    diffs = [f"{k} {flat_then.get(k, '(unset)')} there, {flat_now.get(k, '(unset)')} now"
             for k in keys if flat_then.get(k) != flat_now.get(k)]
    return "; ".join(diffs[:4]) + ("; ..." if len(diffs) > 4 else "")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def _check_writable(folder: Path) -> None:
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".warpnn-train-probe.", suffix=".tmp")
    except OSError as e:
        raise UsageError(f"--out {folder}: cannot write there ({e.strerror}); choose another --out") from e
    os.close(fd)
    os.unlink(probe)


LOCK_FILE = ".warpnn-train.lock"
# warpnn.atomic_write's temporary files: "." + the target's name + "." + mkstemp's 8 characters + ".tmp".
_TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")


def _claim(folder: Path):
    """Lock ``folder`` for this process (released when it exits, however it exits): one run per folder."""
    if fcntl is None:
        return None
    path = folder / LOCK_FILE
    for _ in range(10):
        handle = open(path, "a")  # noqa: SIM115 - held for the life of the run
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            handle.close()
            raise UsageError(f"--out {folder}: another warpnn-train is writing there; wait for it, or choose "
                             "another --out") from e
        try:
            if os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino:
                return handle
        except FileNotFoundError:
            pass
        handle.close()  # the run that held it removed the file as we opened it: lock the new one
    raise UsageError(f"--out {folder}: cannot lock {LOCK_FILE}; choose another --out")


def _release(folder: Path, handle) -> None:
    """Remove the lock file (while still holding the lock, so no other run can hold it then) and unlock."""
    if handle is None:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(folder / LOCK_FILE)
    handle.close()


def read_checkpoint(path: Path, load: Callable[[Path], T]) -> T:
    """``load(path)``; a checkpoint that cannot be read (truncated, corrupt, or of another version) is a
    :class:`UsageError` that says so and what to do."""
    try:
        return load(path)
    except FileNotFoundError as e:
        raise UsageError(f"--resume: {path} is missing; rerun with --overwrite instead of --resume to start the run "
                         "again from step 0") from e
    except Exception as e:
        detail = (str(e).strip().splitlines() or [""])[0][:160]
        raise UsageError(f"--resume: the checkpoint {path} is corrupt or truncated (or from another version of "
                         f"warpnn-train), so the run cannot be continued ({type(e).__name__}: {detail}); rerun "
                         "with --overwrite instead of --resume to start it again from step 0") from e


def remove_stale_temporaries(folder: Path) -> list[Path]:
    """Remove the temporary files of atomic writes (``.NAME.XXXXXXXX.tmp``) that a killed run left in ``folder``.

    Called with the folder's lock held, so no other warpnn-train is writing there.
    """
    removed = []
    for tmp in folder.iterdir():
        if _TEMPORARY.match(tmp.name) and tmp.is_file():
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                removed.append(tmp)
    return removed


# --------------------------------------------------------------------------------------------------
# The training loop.


def losses_array(losses: list[float], steps: int) -> np.ndarray:
    """``losses`` padded with NaN to ``steps`` entries: a fixed-shape checkpoint leaf (float64, exact)."""
    out = np.full((steps,), np.nan)
    out[: len(losses)] = losses
    return out


def losses_list(array, step: int) -> list[float]:
    """The first ``step`` losses of a checkpoint's loss array."""
    return [float(v) for v in np.asarray(array)[:step]]


def adam_update(loss: Callable[[Any], Any], optimizer) -> Callable[[Any, Any], tuple[Any, Any, Any]]:
    """``update(params, opt_state) -> (params, opt_state, loss value)``: one jitted optax step on ``loss``."""
    import optax

    @jax.jit
    def update(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return update


def trail_arrays(params: dict[str, Any], trail: list[dict[str, Any]], steps: int) -> dict[str, np.ndarray]:
    """The per-step values of ``params`` (1-D arrays by name), ``trail``, as fixed-shape checkpoint leaves:
    ``steps + 1`` rows each, NaN past the steps done."""
    rows = {name: np.full((steps + 1, len(np.asarray(value))), np.nan, np.float32) for name, value in params.items()}
    for k, params in enumerate(trail):
        for name in rows:
            rows[name][k] = np.asarray(params[name])
    return rows


# Set by the CLI's SIGINT / SIGTERM handler: the loop finishes the step it is in, checkpoints and stops.
STOP_REQUESTED = threading.Event()


class Stopped(Exception):
    """A run stopped before its last step (``--stop-after``, Ctrl-C, SIGTERM), with a checkpoint to resume from."""

    def __init__(self, step: int, total: int, reason: str):
        super().__init__(f"stopped after step {step} of {total} ({reason})")
        self.step, self.total, self.reason = step, total, reason


def train_loop(
    step: Callable[[Any], tuple[Any, float]],
    state: Any,
    num_steps: int,
    desc: str,
    log_every: int = 1,
    *,
    start: int = 0,
    progress: bool = True,
    checkpoint: Callable[[Any, int, list[float]], None] | None = None,
    checkpoint_every: int = 0,
    stop_after: int | None = None,
) -> tuple[Any, list[float], float]:
    """Run ``state, loss = step(state)`` for steps ``start .. num_steps - 1`` with a progress bar showing the
    loss and steps/s.

    ``checkpoint(state, steps_done, losses)`` (``losses``: those of the steps run here so far) is called every
    ``checkpoint_every`` steps and, if the loop stops early (after step ``stop_after``, on Ctrl-C or SIGTERM),
    once more before :class:`Stopped` is raised.

    Returns the final state, the losses of the steps run here, and the steady-state steps per second (the
    first step run here, which compiles, excluded).
    """
    losses: list[float] = []
    stop = num_steps if stop_after is None else min(stop_after, num_steps)
    bar = tqdm(range(start, stop), desc=desc, dynamic_ncols=True, mininterval=0.5, initial=start,
               total=num_steps, disable=not progress)
    t_start = None
    done = start
    for i in bar:
        state, loss = step(state)
        done = i + 1
        if i == start:
            jax.block_until_ready(loss)
            t_start = time.perf_counter()
        if i % log_every == 0 or i == num_steps - 1:
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.4g}", refresh=False)  # redraws follow mininterval
        if STOP_REQUESTED.is_set():
            break
        if checkpoint is not None and checkpoint_every and done % checkpoint_every == 0 and done < num_steps:
            checkpoint(state, done, losses)
    bar.close()
    jax.block_until_ready(state)
    elapsed = time.perf_counter() - t_start if t_start is not None else 0.0
    ran = done - start
    steps_per_s = (ran - 1) / elapsed if ran > 1 and elapsed > 0 else float("nan")
    if done < num_steps:
        if checkpoint is not None:
            checkpoint(state, done, losses)
        raise Stopped(done, num_steps, "interrupted" if STOP_REQUESTED.is_set() else f"--stop-after {stop_after}")
    return state, losses, steps_per_s


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as sorted, indented JSON (so runs can be diffed), atomically."""
    atomic_write_bytes(path, (json.dumps(_to_builtin(obj), indent=2, sort_keys=True) + "\n").encode())


def _to_builtin(obj):
    if isinstance(obj, dict):
        return {str(k): _to_builtin(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_builtin(v) for v in obj]
    if isinstance(obj, (np.ndarray, jax.Array)):
        return _to_builtin(np.asarray(obj).tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def environment() -> dict[str, Any]:
    """Where and with what a run ran: JAX backend and device, and package versions (for metrics.json)."""
    import platform

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "warp-lang", "flax", "equinox", "optax", "numpy"):
        versions[package] = package_version(package)
    device = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": f"{device.platform}:{device.device_kind}", "versions": versions}


def package_version(package: str) -> str | None:
    """The installed version of ``package`` (a distribution name), or None if it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (runs headless, e.g. in CI)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss(path: str | os.PathLike, losses: list[float], title: str) -> None:
    """Save a log-scale loss curve as PNG (atomically)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogy(np.arange(len(losses)), losses)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, path)


def save_figure(fig, path: str | os.PathLike) -> None:
    """Save a matplotlib figure as PNG atomically and close it."""
    import io

    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
