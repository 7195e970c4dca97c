"""warpnn.enable_cuda_graph_capture: flags set before start-up, refused after."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import warpnn


def test_refuses_once_jax_has_started():
    jax.devices()  # this process's backend is running
    with pytest.raises(RuntimeError, match="before JAX starts a backend"):
        warpnn.enable_cuda_graph_capture()


def test_sets_flags_before_start_and_jax_still_runs():
    code = (
        "import os, warpnn, jax, jax.numpy as jnp;"
        "flags = warpnn.enable_cuda_graph_capture(trace_cache_size=64);"
        "print(flags); print(float(jnp.ones(3).sum()))"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_gpu_graph_min_graph_size=7 --xla_backend_optimization_level=2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    flags, total = out.stdout.strip().splitlines()[-2:]
    assert flags.split() == ["--xla_backend_optimization_level=2", "--xla_gpu_graph_min_graph_size=1", "--xla_cmd_buffer_trace_cache_size=64"]
    assert float(total) == 3.0


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_rejects_non_positive_sizes(bad, monkeypatch):
    monkeypatch.setattr("warpnn._cuda_graphs._backends_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "")
    with pytest.raises(ValueError, match="min_graph_size must be a positive int"):
        warpnn.enable_cuda_graph_capture(min_graph_size=bad)
    assert jnp.ones(1).sum() == 1  # nothing was half-applied
