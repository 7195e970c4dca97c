"""What every training task shares: output folder, progress bar, atomic files, metrics, plots."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

# Checkpoints, metrics and figures are written with the library's atomic writer (temp file, fsync, rename).
from warpnn import atomic_write_bytes


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


def train_loop(
    step: Callable[[Any], tuple[Any, float]],
    state: Any,
    num_steps: int,
    desc: str,
    log_every: int = 1,
) -> tuple[Any, list[float], float]:
    """Run ``state, loss = step(state)`` ``num_steps`` times with a progress bar showing loss and steps/s.

    Returns the final state, the loss history and the steady-state steps per second (first step, which
    compiles, excluded).
    """
    losses: list[float] = []
    bar = tqdm(range(num_steps), desc=desc, dynamic_ncols=True, mininterval=0.5)
    t_start = None
    for i in bar:
        state, loss = step(state)
        if i == 0:
            jax.block_until_ready(loss)
            t_start = time.perf_counter()
        if i % log_every == 0 or i == num_steps - 1:
            losses.append(float(loss))
            bar.set_postfix(loss=f"{losses[-1]:.4g}", refresh=False)  # redraws follow mininterval
    jax.block_until_ready(state)
    elapsed = time.perf_counter() - t_start if t_start is not None else 0.0
    steps_per_s = (num_steps - 1) / elapsed if num_steps > 1 and elapsed > 0 else float("nan")
    return state, losses, steps_per_s


def environment() -> dict[str, Any]:
    """Where and with what a run ran: JAX backend and device, and package versions (for metrics.json)."""
    import platform
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for package in ("jax", "jaxlib", "warp-lang", "flax", "equinox", "optax", "numpy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    device = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": f"{device.platform}:{device.device_kind}", "versions": versions}


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
