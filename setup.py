"""Build hook for warpnn's native launcher; all package metadata lives in pyproject.toml.

``pip install .`` compiles ``src/warpnn/_native/warpnn_ffi.c`` (plain C11, no Python or CUDA headers) against
the XLA FFI C API header that jaxlib ships, into ``warpnn/_native/_warpnn_ffi*.so``, which warpnn loads with
ctypes. The build is optional: if there is no compiler or no jaxlib headers, installation still succeeds, and
warpnn compiles the library on first use or, failing that, warns once and uses its Python launcher
(see ``warpnn._native_launch``).
"""

import hashlib
import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = "src/warpnn/_native/warpnn_ffi.c"


def _source_hash() -> str:
    # Same as warpnn._native_launch.source_hash(): the loader only accepts a library built from this source.
    return hashlib.sha256(Path(SOURCE).read_bytes()).hexdigest()[:16]


def _jaxlib_include_dir():
    """jax.ffi.include_dir() without importing jax: the headers live in jaxlib/include."""
    spec = importlib.util.find_spec("jaxlib")
    for location in (spec.submodule_search_locations or []) if spec else []:
        include = Path(location) / "include"
        if (include / "xla" / "ffi" / "api" / "c_api.h").is_file():
            return str(include)
    return None


class OptionalBuildExt(build_ext):
    """Build the native launcher when possible; never fail the installation because of it."""

    def build_extension(self, ext):
        include = _jaxlib_include_dir()
        if include is None:
            self.warn("warpnn: jaxlib's XLA FFI headers not found; the native launcher will be built on first use")
            return
        ext.include_dirs.append(include)
        ext.define_macros.append(("WARPNN_SOURCE_HASH", f'"{_source_hash()}"'))
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - compiler missing or failing: fall back at run time
            self.warn(f"warpnn: building the native launcher failed ({e}); it will be built on first use, "
                      "or warpnn will use its Python launcher")


setup(
    ext_modules=[
        Extension(
            "warpnn._native._warpnn_ffi",
            sources=[SOURCE],
            extra_compile_args=["-std=c11", "-O2", "-fvisibility=hidden"],
            libraries=["pthread"],
            optional=True,
        )
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
