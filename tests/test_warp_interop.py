"""Warp's own JAX interop suite, run unmodified with warpnn in place of Warp's bridge: the compatibility bar.

The runs happen here, on this machine, in one test (so that ``-n auto`` never runs Warp's suite twice on two
workers): Warp's ``warp/tests/interop/test_jax.py::TestJax`` once with ``wp.jax_kernel`` / ``wp.jax_callable``
replaced by warpnn's (``warp_interop/warpnn_substitute.py``), once with only ``wp.jax_callable`` replaced, over the
tests whose code reaches ``jax_callable`` (the others run Warp's own bridge in that run), and then with Warp's own
bridge over the tests that did not pass in those runs. Every test that passes with Warp's bridge must pass with
warpnn's, except the differences by design listed in ``DIFFERENCES_BY_DESIGN``, each of which names the warpnn
test that covers warpnn's own behaviour instead. Tests whose code starts a subprocess (``test_ffi_jax_cpu_subprocess``,
``test_device_lookup_jax_distributed_*``: about half of each run's time) are left out of every run: the
subprocess is a fresh Python without the substitution, so it runs Warp's own bridge whichever run starts it.
"""

from __future__ import annotations

import ast
import os
import re
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


def _run_suite(tmp_path: Path, substitute: str | None, only: list[str] | None = None) -> dict[str, str]:
    """Outcome ("passed" | "failed" | "skipped") of every test of Warp's suite that runs in this process, by
    test name.

    ``substitute``: None (Warp's bridge), "all" (warpnn's jax_kernel and jax_callable) or "jax_callable"
    (warpnn's jax_callable only, so that part is checked on its own). ``only``: run the tests whose names start
    with one of these (pytest ``-k``), not all.
    """
    report = tmp_path / f"{substitute or 'warp'}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", f"{WARP_SUITE}::TestJax"]
    keywords = f"not ({' or '.join(starting_subprocesses(WARP_SUITE.read_text()))})"
    if only:
        keywords = f"({' or '.join(only)}) and {keywords}"
    cmd += ["-k", keywords]
    if substitute:
        cmd[3:3] = ["-p", "warpnn_substitute"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN_DIR), os.environ.get("PYTHONPATH")])),
           "WARPNN_SUBSTITUTE": substitute or ""}
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


def reaching_jax_callable(source: str) -> list[str]:
    """Names of the test functions (module level, or methods of TestJax) of Warp's suite whose code mentions
    ``jax_callable``, directly or through a function of the file it calls."""
    return _reaching(source, "jax_callable")


def starting_subprocesses(source: str) -> list[str]:
    """Names of the test functions of Warp's suite whose code (or a function of the file it calls) uses
    ``subprocess``."""
    return _reaching(source, "subprocess")


def _reaching(source: str, word: str) -> list[str]:
    tree = ast.parse(source)
    defs = {n.name: ast.get_source_segment(source, n) or "" for n in tree.body if isinstance(n, ast.FunctionDef)}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TestJax"):
        defs.update({m.name: ast.get_source_segment(source, m) or "" for m in cls.body if isinstance(m, ast.FunctionDef)})

    def reaches(name: str, seen: frozenset = frozenset()) -> bool:
        code = defs[name]
        return re.search(rf"\b{word}\b", code) is not None or any(
            reaches(g, seen | {name}) for g in set(re.findall(r"\b\w+\b", code)) if g in defs and g not in seen | {name})

    return sorted(n for n in defs if n.startswith("test_") and reaches(n))


def _regressions(with_warpnn: dict[str, str], with_warp: dict[str, str], what: str) -> list[str]:
    """The tests that pass with Warp's bridge (``with_warp``: run over every test that did not pass with warpnn's)
    and not with warpnn's, less the differences by design."""
    regressions = sorted(n for n, o in with_warp.items() if o == "passed" and with_warpnn.get(n) != "passed"
                         and _base_name(n) not in DIFFERENCES_BY_DESIGN)
    print(f"{what}: {sum(o == 'passed' for o in with_warpnn.values())} of {len(with_warpnn)} passed; "
          f"{len(regressions)} of the others pass with Warp's bridge")
    if not regressions:
        return []
    return [f"{len(regressions)} tests that pass with Warp's bridge fail with {what}: {regressions}"]


@pytest.mark.skipif(not WARP_SUITE.is_file(), reason="this warp-lang wheel does not ship its interop tests")
def test_warp_interop_suite_passes_with_warpnn(tmp_path):
    """Every test of Warp's suite passes with warpnn in place of Warp's bridge, or fails (or skips) with Warp's own
    bridge too on this machine. Warp's bridge runs only the tests that did not pass with warpnn's (a test that
    passes with warpnn needs no baseline): one run of Warp's whole suite fewer."""
    with_warpnn = _run_suite(tmp_path, substitute="all")
    assert len(with_warpnn) >= 50, f"Warp's suite ran {len(with_warpnn)} tests: {with_warpnn}"
    # warpnn.jax_callable on its own, next to Warp's jax_kernel: the tests whose code reaches jax_callable.
    only = reaching_jax_callable(WARP_SUITE.read_text())
    with_callable = _run_suite(tmp_path, substitute="jax_callable", only=only)
    assert any("jax_callable" in n for n, o in with_callable.items() if o == "passed"), "no jax_callable test ran"
    others = sorted({_base_name(n) for runs in (with_warpnn, with_callable) for n, o in runs.items() if o != "passed"})
    with_warp = _run_suite(tmp_path, substitute=None, only=others) if others else {}
    problems = _regressions(with_warpnn, with_warp, "warpnn")
    problems += _regressions(with_callable, {n: o for n, o in with_warp.items() if n.startswith(tuple(only))},
                             "warpnn.jax_callable in place of wp.jax_callable")
    assert not problems, "\n".join(problems)


def test_the_jax_callable_run_selects_what_reaches_jax_callable():
    source = '''
def helper(x):
    return wp.jax_callable(x)

def test_direct(test, device):
    wp.jax_callable(f)

def test_through_helper(test, device):
    helper(1)

def test_kernel_only(test, device):
    wp.jax_kernel(k)

class TestJax:
    def test_method(self):
        helper(2)

    def test_other(self):
        pass
'''
    assert reaching_jax_callable(source) == ["test_direct", "test_method", "test_through_helper"]
    assert starting_subprocesses(source) == []
    assert starting_subprocesses(source + "\ndef test_spawn(test, device):\n    subprocess.run(cmd)\n") == ["test_spawn"]
    names = starting_subprocesses(WARP_SUITE.read_text()) if WARP_SUITE.is_file() else ["test_ffi_jax_cpu_subprocess"]
    assert "test_ffi_jax_cpu_subprocess" in names and not any("callable" in n or "kernel" in n for n in names), names
