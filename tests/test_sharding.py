"""Data parallelism through JAX's sharding: Warp calls on a batch sharded over 4 CPU devices (and over 2
processes) give the single-device result, and run per device on the local batch only.

XLA reads ``--xla_force_host_platform_device_count`` once per process and this pytest process has already
started JAX with one device, so the checks run in ``tests/sharding_check.py`` subprocesses that report JSON.
On a GPU machine, ``WARPNN_SHARDING_PLATFORM=gpu pytest tests/test_sharding.py`` runs the same checks on every
GPU instead (one GPU: the sharded path degenerates to one device, and still must match).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import warp as wp

import warpnn._bridge

from .helpers import once_per_run

CHECK = Path(__file__).with_name("sharding_check.py")
ROOT = CHECK.parent.parent
PLATFORM = os.environ.get("WARPNN_SHARDING_PLATFORM", "cpu")
TOL = 2e-6  # float32 sums over the batch in a different order on 4 devices than on one
# The same kernel on the same inputs: bit-identical on the CPU, equal up to the order of atomic adds on a GPU.
ATOMIC_ORDER_TOL = 0.0 if PLATFORM == "cpu" else 1e-5


def _needs_partitioning():
    if not hasattr(warpnn._bridge, "_sharding"):
        pytest.skip("the bridge does not route Warp calls through warpnn._sharding yet (see docs/distributed.md)")
    _needs_cpu_kernels()


def _needs_cpu_kernels():
    if PLATFORM == "cpu" and not wp.is_cpu_available():
        pytest.skip("this Warp build cannot compile CPU kernels; on GPUs run WARPNN_SHARDING_PLATFORM=gpu")


def _run(*args: str) -> subprocess.Popen:
    # (sharding_check sets the device count itself; the other XLA flags, conftest's -O0 on a CPU machine, stay)
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "host_platform_device_count" not in f)
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"} | {"XLA_FLAGS": flags}
    return subprocess.Popen([sys.executable, str(CHECK), *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc: subprocess.Popen, timeout: float = 240) -> dict:
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"sharding_check failed (rc {proc.returncode}):\n{err[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    _needs_partitioning()
    return once_per_run(tmp_path_factory, f"sharding_check_{PLATFORM}",
                        lambda: _result(_run("--devices", "4", "--platform", PLATFORM)))


def _data_parallel(r: dict, devices: int) -> None:
    """No all-gather; the only collective (on several devices) is the all-reduce of shared gradients; each
    device launches the Warp kernels on its share of the batch."""
    assert r["collectives"] == (["all-reduce"] if devices > 1 else []), r
    assert r["local_batch"] == [r["global_batch"] // devices], r


@pytest.fixture(scope="module")
def two_processes():
    _needs_partitioning()
    if PLATFORM != "cpu":
        pytest.skip("the two-process check runs on CPU devices")
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    checks = "spring_layer_explicit,equinox"
    procs = [_run("--devices", "2", "--num-processes", "2", "--process-id", str(i), "--port", str(port),
                  "--checks", checks) for i in range(2)]
    try:
        return [_result(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def test_runs_on_the_devices_asked_for(single_process):
    assert single_process["platform"] == PLATFORM
    assert single_process["devices"] == 4 or PLATFORM != "cpu"


def test_every_device_computes_the_same_gradient(single_process):
    r = single_process["per_device"]
    assert len(r["errors"]) == single_process["devices"] and min(r["norms"]) > 0
    # same kernel, same inputs, on each device alone: equal up to the order of atomic adds on a GPU
    assert max(r["errors"]) <= ATOMIC_ORDER_TOL, r


@pytest.mark.parametrize("mesh", ["explicit", "auto"])
def test_sharded_springs_match_one_device_and_run_data_parallel(single_process, mesh):
    r, devices = single_process[f"spring_layer_{mesh}"], single_process["devices"]
    assert r["forward_error"] < TOL and r["grad_error"] < TOL, r
    assert r["grad_reference_error"] < 1e-5, r  # and one device matches the pure-JAX reference
    # Data-parallel, not replicated: no all-gather of the batch, each device launches its 2 of 8 cloths,
    # the output stays sharded, and the only collective is the sum of the shared stiffness' gradient.
    assert r["forward_collectives"] == [], r
    _data_parallel({**r, "collectives": r["grad_collectives"], "local_batch": r["grad_local_batch"]}, devices)
    assert r["forward_local_batch"] == r["grad_local_batch"], r
    assert r["output_spec"].startswith("P('data'"), r


def test_first_operand_shared_by_the_batch(single_process):
    r = single_process["shared_first_operand"]
    assert r["error"] < TOL and r["output_spec"].startswith("P('data'"), r
    assert r["collectives"] == [] and r["local_batch"] == [r["global_batch"] // single_process["devices"]], r


def test_elementwise_pairs_share_buffers_on_a_sharded_batch(single_process):
    r = single_process["in_place_pair"]
    assert max(r["forward_error"], r["scan_error"], r["grad_error"]) < TOL, r
    assert r["aliased"] and r["input_unchanged"], r  # written in place, yet the caller's array is intact
    assert r["output_spec"].startswith("P('data'"), r
    assert r["local_batch"] == [r["global_batch"] // single_process["devices"]], r


def test_shard_map_types_outputs_as_varying(single_process):
    r = single_process["shard_map"]
    assert r["value_error"] < TOL and r["grad_error"] < TOL, r
    assert r["output_vma"] == ["data"], r
    assert r["invariant_out_spec_refused"], r  # a per-device value cannot pass as replicated


def test_cloth_rollout_gradient(single_process):
    r = single_process["cloth_rollout"]
    assert r["error"] < 1e-5, r  # 10 steps of lax.scan through Warp springs and integrator
    _data_parallel(r, single_process["devices"])


@pytest.mark.parametrize("framework", ["equinox", "nnx", "linen"])
def test_training_steps_match_one_device(single_process, framework):
    r = single_process[framework]
    assert r["param_error"] < 1e-5 and r["loss_error"] < 1e-5, r  # three Adam steps
    if "collectives" in r:  # nnx.jit steps are not lowered by the check
        _data_parallel(r, single_process["devices"])


def test_indivisible_batch_is_replicated_not_padded(single_process):
    r = single_process["indivisible"]
    assert r["error"] <= ATOMIC_ORDER_TOL and r["local_batch"] == [r["global_batch"]], r


def test_eager_call_on_sharded_arrays(single_process):
    r = single_process["eager"]
    assert r["error"] <= ATOMIC_ORDER_TOL and r["output_spec"].startswith("P('data'"), r


def test_two_processes_with_gloo_collectives(two_processes):
    for r in two_processes:
        assert r["processes"] == 2 and r["devices"] == 4, r
        s = r["spring_layer_explicit"]
        assert s["forward_error"] < TOL and s["grad_error"] < TOL, s
        assert s["forward_collectives"] == [] and s["forward_local_batch"] == [s["global_batch"] // 4], s
        e = r["equinox"]
        assert e["param_error"] < 1e-5 and e["collectives"] == ["all-reduce"], e


def test_main_job_devices_option(tmp_path):
    """``warpnn-train cloth --devices 2``: 4 cloths split over 2 CPU devices fit exactly as on one device."""
    if PLATFORM != "cpu":
        pytest.skip("runs the CLI on CPU devices")
    _needs_cpu_kernels()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    common = ["--device", "cpu", "--steps", "6", "--rows", "5", "--cols", "5", "--frames", "20"]
    runs = {n: subprocess.Popen([sys.executable, "-m", "warpnn_train.cli", "cloth", *common, "--devices", str(n),
                                 "--cloths-per-device", str(4 // n), "--out", str(tmp_path / str(n))],
                                cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            for n in (1, 2)}
    metrics = {}
    for n, proc in runs.items():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        metrics[n] = json.loads((tmp_path / str(n) / "metrics.json").read_text())
        assert (tmp_path / str(n) / "checkpoint.eqx").stat().st_size > 0
    one, two = metrics[1], metrics[2]
    assert two["devices"] == 2 and two["cloths"] == one["cloths"] == 4, two
    assert two["cloth_frames_per_s_per_device"] > 0 and two["final_loss"] < two["initial_loss"], two
    for key in ("initial_loss", "final_loss"):
        assert abs(two[key] - one[key]) <= 1e-5 * abs(one[key]), (key, one[key], two[key])
    for key, value in one["rel_error"].items():
        assert abs(two["rel_error"][key] - value) < 1e-4, (key, value, two["rel_error"][key])
