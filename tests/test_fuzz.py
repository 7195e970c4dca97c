"""Fuzz: shapes, dtypes, launch and output dims, index arrays and static scalars for an elementwise, a gather
and a scatter kernel (``tests/fuzz_cases.py``), eager and jit, forward and gradient.

Every case must end as a correct result (against NumPy) or a clear Python error naming the kernel. In
checked mode that holds for every case, out-of-range indices included: zero crashes, zero silently wrong
results. In the default mode it must hold for every case the default mode claims to catch (valid calls, wrong
dtypes and ranks, traced scalars, launches provably beyond an array or beyond Warp's 32-bit limit); the rest
(data-dependent out-of-range indices) is undefined there and is not run. Cases run in subprocesses, so a crash
is counted (and the remaining cases of its batch run in a fresh process), not fatal.
"""

import collections
import json
import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from . import fuzz_cases
from .helpers import ROOT, subprocess_env

CHECKED_CASES = int(os.environ.get("WARPNN_FUZZ_CASES", "120"))  # more: WARPNN_FUZZ_CASES=1000
DEFAULT_CASES = CHECKED_CASES // 2
BATCH = 200  # cases per subprocess: one process per test at the default size (a crash restarts the rest in a new one)

@st.composite
def _mostly(draw, good, *others, weight: int = 6):
    """``good`` about ``weight`` times as often as each of ``others``."""
    choice = draw(st.sampled_from([0] * weight + list(range(1, len(others) + 1))))
    return draw(good if choice == 0 else others[choice - 1])


@st.composite
def case(draw, checked: bool):
    kernel = draw(st.sampled_from(["elementwise", "gather", "scatter"]))
    n = draw(st.integers(0, 16))
    launch = draw(_mostly(st.none(), st.integers(0, 24), st.just(n), st.just(2**32), weight=3))  # 2**32: beyond wp.tid()
    base = launch if launch is not None else n
    c = {
        "kernel": kernel,
        "n": n,
        "x_dtype": draw(_mostly(st.just("float32"), st.sampled_from(["float16", "int32"]), weight=12)),
        "launch": launch,
        "out": draw(_mostly(st.none(), st.integers(0, 24), st.just(base), weight=3)),
        "s": draw(st.floats(-4, 4, allow_nan=False, width=32)),
        "scalar_ok": kernel == "scatter" or draw(_mostly(st.just(True), st.just(False), weight=12)),
        "jit": draw(st.booleans()),
        "grad": draw(st.booleans()),
        "checked": checked,
    }
    if kernel == "elementwise":
        c["shift"] = draw(_mostly(st.just(0), st.integers(-3, 3), weight=2))
    else:
        c["idx_dtype"] = draw(_mostly(st.just("int32"), st.sampled_from(["int16", "float32", "uint32"]), weight=12))
        c["idx_rank_ok"] = draw(_mostly(st.just(True), st.just(False), weight=12))
        m = draw(_mostly(st.just(min(base, 24)), st.integers(0, 16), weight=3))
        if kernel == "gather":
            inside = st.integers(-n, n - 1) if n else st.just(0)
            c["idx"] = draw(st.lists(_mostly(inside, st.integers(-n - 3, n + 3), weight=5), min_size=m, max_size=m))
        else:
            out = min(c["out"] if c["out"] is not None else base, 24)
            inside = st.integers(-out, out - 1) if out else st.just(0)
            pair = st.tuples(_mostly(inside, st.integers(-out - 3, out + 3), weight=8),
                             _mostly(inside, st.integers(-out - 3, out + 3), weight=8))
            c["pairs"] = [list(p) for p in draw(st.lists(pair, min_size=m, max_size=m))]
    if c["x_dtype"] != "float32":
        c["grad"] = False  # the gradient of a non-float input is not defined; the forward call must refuse
    return c


def _generate(checked: bool, count: int) -> list[dict]:
    found = []

    @settings(max_examples=count, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case(checked))
    def collect(c):
        found.append(c)

    collect()
    return found


def _run_all(cases: list[dict]) -> list[dict]:
    """Run ``cases`` in subprocesses of up to BATCH cases; a case that kills its process is a "crash"."""
    results: list[dict | None] = [None] * len(cases)
    start = 0
    env = subprocess_env()
    with tempfile.TemporaryDirectory() as tmp:
        while start < len(cases):
            batch = cases[start : start + BATCH]
            path = os.path.join(tmp, "cases.json")
            with open(path, "w") as fh:
                json.dump(batch, fh)
            out = subprocess.run([sys.executable, "-m", "tests.fuzz_cases", path], capture_output=True, text=True,
                                 env=env, cwd=ROOT, timeout=900)
            done = 0
            for line in out.stdout.splitlines():
                if line.startswith("RESULT "):
                    r = json.loads(line[len("RESULT "):])
                    results[start + r["i"]] = r
                    done = r["i"] + 1
            if done < len(batch):  # the process died on case `done`
                results[start + done] = {"outcome": "crash", "message": f"exit {out.returncode}: {out.stderr[-600:]}"}
                done += 1
            start += done
    return results


def _report(cases, results) -> collections.Counter:
    counts = collections.Counter(r["outcome"] for r in results)
    by_kind = collections.Counter((c["kernel"], r["outcome"]) for c, r in zip(cases, results))
    print(f"\nfuzz ({'checked' if cases[0]['checked'] else 'default'} mode): {dict(counts)}; by kernel: {dict(by_kind)}")
    return counts


def _failures(cases, results):
    return [(c, r) for c, r in zip(cases, results) if r["outcome"] not in ("correct", "error")]


def test_fuzz_checked_mode_every_case_is_correct_or_a_clear_error():
    cases = _generate(True, CHECKED_CASES)
    results = _run_all(cases)
    counts = _report(cases, results)
    assert not _failures(cases, results), _failures(cases, results)[:3]
    # The fuzz exercises both sides: valid calls and out-of-range ones that only checked mode catches.
    assert counts["correct"] > 0 and counts["error"] > 0
    unclaimed = sum(not fuzz_cases.expected(c)["claimed"] for c in cases)
    assert unclaimed > 0


def test_fuzz_default_mode_catches_what_it_claims():
    cases = [c for c in _generate(False, DEFAULT_CASES * 3) if fuzz_cases.expected(c)["claimed"]][:DEFAULT_CASES]
    results = _run_all(cases)
    counts = _report(cases, results)
    assert not _failures(cases, results), _failures(cases, results)[:3]
    assert counts["correct"] > 0 and counts["error"] > 0
