"""``warpnn._settings``: every ``WARPNN_*`` variable read in one place; a bad value is an error that names the
variable, the value and the accepted values (never a silent fallback); the documentation lists exactly the
variables the code reads."""

import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from warpnn import _launch, _native_launch, _settings

from .helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("name", "value", "accepted"), [
    ("WARPNN_CPU_POOL", "foo", "expected warpnn, xla"),
    ("WARPNN_CPU_SLICES_PER_THREAD", "abc", "expected an integer from 1 to 64"),
    ("WARPNN_CPU_SLICES_PER_THREAD", "65", "expected an integer from 1 to 64"),
    ("WARPNN_CPU_PARTIAL_BYTES", "1k", "expected an integer >= 0"),
    ("WARPNN_CPU_THREADS", "0", "expected an integer >= 1"),
    ("WARPNN_CPU_SPIN_US", "-1", "expected an integer >= 0"),
    ("WARPNN_CPU_PROFILE", "yes", "expected 0, 1"),
    ("WARPNN_CHECK", "2", "expected 1, true, yes, on / 0, false, no, off"),
    ("WARPNN_BATCHED_LAUNCH", "twinn", "expected auto, 1, true, on, yes, 0, false, off, no, twin"),
    ("WARPNN_SPREAD", "yes", "expected 0, 1"),
    ("WARPNN_LAUNCHER", "fast", "expected auto, native, python"),
])
def test_a_bad_value_names_the_variable_the_value_and_the_accepted_values(monkeypatch, name, value, accepted):
    monkeypatch.setenv(name, value)
    with pytest.raises(_settings.SettingError) as info:
        _settings.get(name)
    message = str(info.value)
    assert f"{name}={value!r}: {accepted} (" in message, message
    assert "unset it for the default" in message
    with pytest.raises(_settings.SettingError):
        _settings.check_all()


@pytest.mark.parametrize(("name", "values"), [
    # what the readers made of these values before the settings module: unchanged
    ("WARPNN_BATCHED_LAUNCH", {None: "auto", "": "auto", "1": "auto", "0": "off", "off": "off", "twin": "twin",
                               " TWIN ": "twin"}),
    ("WARPNN_CHECK", {None: False, "0": False, "1": True, "true": True, "On": True}),
    ("WARPNN_CPU_ROW_WINDOWS", {None: True, "1": True, "0": False}),
    ("WARPNN_DRIVER_LAUNCH", {None: True, "1": True, "0": False}),
    ("WARPNN_SPREAD", {None: None, "0": False, "1": True}),
    ("WARPNN_CPU_POOL", {None: "warpnn", "xla": "xla", "XLA": "xla"}),
    ("WARPNN_CPU_THREADS", {None: None, "3": 3}),
    ("WARPNN_CPU_MIN_WORK", {None: 4096, "1": 1}),
    ("WARPNN_CPU_SLICES_PER_THREAD", {None: 1, "64": 64}),
    ("WARPNN_CPU_PARTIAL_BYTES", {None: 64, "0": 0}),
    ("WARPNN_CPU_SPIN_US", {None: 100, "0": 0}),
    ("WARPNN_LAUNCHER", {None: "auto", "python": "python"}),
    ("WARPNN_CACHE_DIR", {None: None, "/tmp/x": "/tmp/x"}),
])
def test_valid_values_and_defaults(monkeypatch, name, values):
    for text, expected in values.items():
        if text is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, text)
        assert _settings.get(name) == expected, (name, text)


def test_a_bad_setting_is_not_swallowed_by_the_launcher_fallback(monkeypatch):
    """The native launcher falls back to the Python one (with a warning) when it cannot build; a bad setting read
    while it loads is not such a reason: it reaches the user."""

    def bad_setting():
        return _settings.get("WARPNN_CPU_POOL")

    monkeypatch.setenv("WARPNN_CPU_POOL", "foo")
    monkeypatch.delenv(_launch.LAUNCHER_ENV, raising=False)
    monkeypatch.setattr(_native_launch, "get_launcher", bad_setting)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "native launcher is unavailable" warning either
        with pytest.raises(_settings.SettingError, match="WARPNN_CPU_POOL='foo'"):
            _launch._SelectedLauncher().impl  # noqa: B018


def test_a_bad_cpu_setting_fails_the_first_call_in_a_fresh_process(tmp_path):
    """End to end, as a user meets it: a mistyped WARPNN_CPU_SLICES_PER_THREAD used to send every launch through
    the Python launcher; now the first kernel call raises the setting's error."""
    script = textwrap.dedent("""
        import jax.numpy as jnp, warp as wp, warpnn
        wp.config.log_level = wp.LOG_WARNING

        @wp.kernel
        def double(x: wp.array(dtype=float), y: wp.array(dtype=float)):
            i = wp.tid()
            y[i] = 2.0 * x[i]

        print(warpnn.jax_kernel(double)(jnp.ones(4))[0])
    """)
    (tmp_path / "first_call.py").write_text(script)  # Warp reads a kernel's source from its file
    proc = subprocess.run([sys.executable, str(tmp_path / "first_call.py")], capture_output=True, text=True, timeout=300,
                          env=subprocess_env(WARPNN_CPU_SLICES_PER_THREAD="abc", JAX_PLATFORMS="cpu"))
    assert proc.returncode != 0, proc.stdout
    assert "SettingError: warpnn: WARPNN_CPU_SLICES_PER_THREAD='abc': expected an integer from 1 to 64" in proc.stderr, \
        proc.stderr[-3000:]
    assert "native launcher is unavailable" not in proc.stderr


def test_the_code_reads_its_settings_in_one_place_and_the_docs_list_exactly_those():
    read_elsewhere = []
    for path in sorted((ROOT / "src" / "warpnn").rglob("*.py")):
        if path.name == "_settings.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(environ(\.get)?|getenv)\s*[\[(]\s*[\"']WARPNN_", line):
                read_elsewhere.append(f"{path.name}:{n}: {line.strip()}")
    assert read_elsewhere == [], "read WARPNN_* through warpnn._settings.get"
    native = set(re.findall(r'getenv\("(WARPNN_\w+)"\)', (ROOT / "src/warpnn/_native/warpnn_ffi.c").read_text()))
    assert native and native <= set(_settings.SETTINGS), native  # checked in Python when the library loads

    page = (ROOT / "docs" / "settings.md").read_text()
    documented = set(re.findall(r"^\| `(WARPNN_\w+)`", page, re.M))
    assert documented == set(_settings.SETTINGS)
    for setting in _settings.SETTINGS.values():  # the table's accepted values are the code's
        row = next(line for line in page.splitlines() if line.startswith(f"| `{setting.name}`"))
        assert setting.accepted() in row, (setting.name, row)
    every_page = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
    assert set(re.findall(r"WARPNN_[A-Z_]+[A-Z]", every_page)) <= set(_settings.SETTINGS) | {
        "WARPNN_FUZZ_CASES", "WARPNN_SUBSTITUTE", "WARPNN_SHARDING_PLATFORM"}  # the test suite's own knobs (tests/)
