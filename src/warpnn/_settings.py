"""Every ``WARPNN_*`` environment variable warpnn reads, in one place: its accepted values, default and meaning.

Each reader in the library calls :func:`get` at the moment it reads its setting (some once per process, some
while lowering a call: see ``read``). A value outside the accepted ones raises :class:`SettingError`, which
names the variable, the value and the accepted values, instead of being taken as the default or, worse,
silently sending every launch through a slower path. ``docs/cpu-threads.md`` lists the same table (a test
checks the two agree).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A ``WARPNN_*`` environment variable holds a value warpnn does not accept."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: how its text is read, its default (when unset or empty) and what it does."""

    name: str
    kind: str  # "bool", "choice", "int" or "path"
    default: Any
    meaning: str
    read: str  # when warpnn reads it
    choices: Mapping[str, Any] | None = None  # kind "choice": accepted spelling (lower case) -> value
    minimum: int | None = None  # kind "int"
    maximum: int | None = None

    def accepted(self) -> str:
        """The accepted values, as an error message and the documentation's table write them."""
        if self.kind == "bool":
            return "1, true, yes, on / 0, false, no, off"
        if self.kind == "choice":
            assert self.choices is not None
            return ", ".join(self.choices)
        if self.kind == "int":
            if self.maximum is not None:
                return f"an integer from {self.minimum} to {self.maximum}"
            return f"an integer >= {self.minimum}"
        return "a path"

    def parse(self, text: str) -> Any:
        value = text.strip()
        if self.kind == "path":
            return value
        if self.kind == "bool":
            if value.lower() in _TRUE:
                return True
            if value.lower() in _FALSE:
                return False
        elif self.kind == "choice":
            assert self.choices is not None
            if value.lower() in self.choices:
                return self.choices[value.lower()]
        elif self.kind == "int":
            try:
                number = int(value)
            except ValueError:
                number = None
            if number is not None and (self.minimum is None or number >= self.minimum) and (
                    self.maximum is None or number <= self.maximum):
                return number
        raise SettingError(f"warpnn: {self.name}={text!r}: expected {self.accepted()} ({self.meaning}); unset it "
                           f"for the default ({_shown(self.default)})")


def _shown(default: Any) -> str:
    if default is None:
        return "see the documentation"
    if isinstance(default, bool):
        return "on" if default else "off"
    return str(default)


def _bool(name: str, default: bool, meaning: str, read: str) -> Setting:
    return Setting(name, "bool", default, meaning, read)


_SETTINGS = (
    _bool("WARPNN_CHECK", False, "checked mode: out-of-range indices in kernels raise KernelIndexError",
          "at import"),
    Setting("WARPNN_LAUNCHER", "choice", "auto", "which launcher runs kernels from XLA: the native C handlers, or "
            "Python callbacks (tens of µs per call); auto: native where it builds, else Python with a warning",
            "at the first call", choices={"auto": "auto", "native": "native", "python": "python"}),
    Setting("WARPNN_NATIVE_LIB", "path", None, "an explicit native launcher library to load (an error if it does "
            "not load or is stale); unset: the installed one, else one built into WARPNN_CACHE_DIR",
            "at the first call"),
    Setting("WARPNN_CACHE_DIR", "path", None, "where the native launcher is built on first use; unset: "
            "$XDG_CACHE_HOME/warpnn or ~/.cache/warpnn", "at the first call"),
    _bool("WARPNN_DRIVER_LAUNCH", True, "GPU: launch kernels through the CUDA driver directly; off: through "
          "Warp's launcher on every call", "at the first call"),
    Setting("WARPNN_BATCHED_LAUNCH", "choice", "auto", "a vmapped call: auto launches the batched twin on a GPU "
            "and spreads per-element launches over the CPU threads; off (0) launches per element on one thread; "
            "twin uses the batched twin on the CPU too",
            "while lowering", choices={"auto": "auto", "1": "auto", "true": "auto", "on": "auto", "yes": "auto",
                                       "0": "off", "false": "off", "off": "off", "no": "off", "twin": "twin"}),
    Setting("WARPNN_SPREAD", "choice", None, "spread atomic adds of big GPU launches over copies: 0 never, "
            "1 wherever possible; unset: on a GPU, for launches of at least 1,024 threads",
            "while lowering", choices={"0": False, "1": True}),
    Setting("WARPNN_CPU_THREADS", "int", None, "threads for one CPU launch; unset: the CPUs this process may use",
            "at the first call", minimum=1),
    Setting("WARPNN_CPU_MIN_WORK", "int", 4096, "launch threads (elements) per CPU worker below which a launch is "
            "not split", "at the first call", minimum=1),
    Setting("WARPNN_CPU_POOL", "choice", "warpnn", "whose threads run split CPU launches: warpnn's own pool, or "
            "XLA's intra-op pool (where the jaxlib offers it)", "at the first call",
            choices={"warpnn": "warpnn", "xla": "xla"}),
    Setting("WARPNN_CPU_SLICES_PER_THREAD", "int", 1, "slices per worker of a split CPU launch (threads claim "
            "slices as they come)", "at the first call", minimum=1, maximum=64),
    Setting("WARPNN_CPU_PARTIAL_BYTES", "int", 64, "partial-buffer bytes per launch thread a split CPU launch may "
            "zero and sum; a launch whose scatters need more runs on fewer workers", "at the first call",
            minimum=0),
    _bool("WARPNN_CPU_ROW_WINDOWS", True, "split CPU launches bound their partial buffers to the rows each "
          "slice writes; off: whole partial buffers", "when a kernel is first registered"),
    Setting("WARPNN_CPU_SPIN_US", "int", 100, "microseconds a CPU launch's threads poll for work before sleeping",
            "at the first call", minimum=0),
    Setting("WARPNN_EQUALITY_GRADIENT", "choice", "nan", "reverse mode through a float == / != branch of a "
            "kernel: nan makes the gradient NaN in a thread that met equality (where Warp's adjoint is the side "
            "taken, right only if the two sides agree); side keeps Warp's adjoint there", "while lowering",
            choices={"nan": "nan", "side": "side"}),
    Setting("WARPNN_MAX_UNROLL", "int", 64, "iterations up to which the adjoint of a loop whose bound is a scalar "
            "argument or an array's shape is unrolled (longer loops: reverse mode refuses the kernel)",
            "while lowering", minimum=1, maximum=4096),
    Setting("WARPNN_CPU_PROFILE", "choice", False, "count where the CPU handlers' time goes "
            "(read with warpnn._launch.LAUNCHER.impl.twins.cpu_profile())", "at the first call",
            choices={"0": False, "1": True}),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _SETTINGS}


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The value of the setting ``name`` now: its default when unset or empty, else its parsed value.

    Raises:
        SettingError: the variable holds a value the setting does not accept.
    """
    setting = SETTINGS[name]
    text = (os.environ if environ is None else environ).get(name)
    if text is None or not text.strip():
        return setting.default
    return setting.parse(text)


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Read every setting once (for the ones read outside Python, by the native library): a bad value raises."""
    for name in SETTINGS:
        get(name, environ)


__all__ = ["SETTINGS", "Setting", "SettingError", "check_all", "get"]
