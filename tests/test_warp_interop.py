"""Warp's own JAX interop suite, run unmodified with warpnn in place of Warp's bridge: the compatibility bar.

Both runs happen here, on this machine: Warp's ``warp/tests/interop/test_jax.py::TestJax`` once with Warp's
bridge and once with ``wp.jax_kernel`` / ``wp.jax_callable`` replaced by warpnn's (``warp_interop/
warpnn_substitute.py``). Every test that passes with Warp's bridge must pass with warpnn's, except the
differences by design listed in ``DIFFERENCES_BY_DESIGN``, each of which names the warpnn test that covers
warpnn's own behaviour instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import warp

WARP_SUITE = Path(warp.__file__).parent / "tests" / "interop" / "test_jax.py"
PLUGIN_DIR = Path(__file__).parent / "warp_interop"

# test name (without the device suffix) -> why warpnn differs, and which warpnn test covers its behaviour.
DIFFERENCES_BY_DESIGN: dict[str, str] = {
    "test_ffi_jax_kernel_autodiff_per_call_override_rejected": (
        "Warp refuses per-call launch_dims / vmap_method with enable_backward=True (its adjoint is fixed at "
        "construction); warpnn's forward and adjoint share each call's static plan, so per-call overrides are "
        "differentiable: tests/test_parity.py::test_per_call_overrides_work_with_reverse_mode"
    ),
    "test_ffi_jax_kernel_output_dims_autodiff_still_blocked": (
        "Warp refuses output_dims with enable_backward=True; warpnn differentiates outputs of any shape: "
        "tests/test_parity.py::test_output_dims_work_with_reverse_mode"
    ),
}


def _run_suite(tmp_path: Path, substitute: bool) -> dict[str, str]:
    """Outcome ("passed" | "failed" | "skipped") of every test of Warp's suite, by test name."""
    report = tmp_path / ("warpnn.xml" if substitute else "warp.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", f"{WARP_SUITE}::TestJax"]
    if substitute:
        cmd[3:3] = ["-p", "warpnn_substitute"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN_DIR), os.environ.get("PYTHONPATH")]))}
    subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        outcomes[case.get("name")] = outcome
    return outcomes


def _base_name(name: str) -> str:
    for suffix in ("_cpu", "_cuda_0"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


@pytest.mark.skipif(not WARP_SUITE.is_file(), reason="this warp-lang wheel does not ship its interop tests")
def test_warp_interop_suite_passes_with_warpnn(tmp_path):
    with_warp = _run_suite(tmp_path, substitute=False)
    with_warpnn = _run_suite(tmp_path, substitute=True)
    assert with_warp, "Warp's suite collected no tests"
    passing = sorted(n for n, o in with_warp.items() if o == "passed")
    regressions = sorted(
        n for n in passing if with_warpnn.get(n) != "passed" and _base_name(n) not in DIFFERENCES_BY_DESIGN
    )
    print(f"Warp's bridge: {len(passing)} passed; warpnn: "
          f"{sum(with_warpnn.get(n) == 'passed' for n in passing)} of them passed")
    assert not regressions, f"{len(regressions)} of Warp's {len(passing)} passing tests fail with warpnn: {regressions}"
