"""The public surface: every public module declares ``__all__``, every name in it exists and is documented,
nothing public is left out of it, and ``import warpnn`` is warning-free."""

import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

import warpnn

PUBLIC_MODULES = ["warpnn", "warpnn.equinox", "warpnn.nnx", "warpnn.linen", "warpnn.kernels", "warpnn.kernels.cloth",
                  "warpnn.kernels.mesh", "warpnn.kernels.pointcloud", "warpnn.kernels.tiles", "warpnn_models", "warpnn_models.cloth",
                  "warpnn_models.mesh", "warpnn_models.pointcloud"]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_lists_exactly_the_public_names(name):
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} needs a docstring saying its one job"
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    assert len(set(exported)) == len(exported), f"{name}.__all__ repeats a name"
    for item in exported:
        if not hasattr(module, item):  # a submodule imported on demand (warpnn_models.cloth) is fine too
            importlib.import_module(f"{name}.{item}")
        obj = getattr(module, item)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert inspect.getdoc(obj), f"{name}.{item} has no docstring (the API reference renders it)"
    # Public functions and classes defined in this module (not imported into it) must be exported.
    defined_here = [n for n, obj in vars(module).items() if not n.startswith("_")
                    and (inspect.isfunction(obj) or inspect.isclass(obj)) and obj.__module__ == name]
    missing = sorted(set(defined_here) - set(exported))
    assert not missing, f"{name} defines public {missing} but leaves them out of __all__ (add them, or rename _x)"


def test_package_root_exports_every_public_re_export():
    """Whatever warpnn/__init__.py imports from its private modules under a public name is in __all__ (so the
    reference, which renders __all__, picks up names that other work adds)."""
    reexported = [n for n, obj in vars(warpnn).items() if not n.startswith("_") and not inspect.ismodule(obj)]
    assert sorted(set(reexported) - set(warpnn.__all__)) == []


def test_version_has_one_source():
    from importlib import metadata

    try:
        installed = metadata.version("warpnn")
    except metadata.PackageNotFoundError:  # imported from a source tree on PYTHONPATH (the GPU machine's setup)
        pytest.skip("warpnn is not installed here, so it has no package metadata to compare")
    assert installed == warpnn.__version__


@pytest.mark.parametrize("statement", ["import warpnn", "import warpnn.equinox, warpnn.nnx, warpnn.linen, warpnn.kernels",
                                       "import warpnn_models.cloth, warpnn_models.mesh, warpnn_models.pointcloud"])
def test_import_is_clean_under_warnings_as_errors(statement):
    proc = subprocess.run([sys.executable, "-W", "error", "-c", statement], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]


def test_the_changelog_s_newest_release_is_this_version():
    """A release moves [Unreleased] under a dated heading of the version in warpnn/__init__.py (docs/releasing.md)."""
    import datetime
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    headings = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, flags=re.M)
    assert headings[0] == ("Unreleased", ""), "the changelog starts with an [Unreleased] section"
    version, date = headings[1]
    assert version == warpnn.__version__, f"CHANGELOG.md's newest release is {version}, warpnn.__version__ is {warpnn.__version__}"
    datetime.date.fromisoformat(date)


def test_the_api_reference_lists_every_public_name_once():
    """docs/api/warpnn.md renders the names one by one, in order of importance: none may be missing or repeated."""
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "api" / "warpnn.md").read_text()
    rendered = re.findall(r"^::: warpnn\.(\w+)$", page, re.M)
    assert sorted(rendered) == sorted(warpnn.__all__)
    assert rendered[:3] == ["jax_kernel", "WarpKernel", "jax_callable"]


def _package_imports(package_dir: pathlib.Path) -> dict[str, set[str]]:
    """Each private module of the package -> the sibling modules it imports (at the top or inside a function)."""
    import ast

    graph = {}
    for path in package_dir.glob("*.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        graph[path.stem] = {m for m in imported if (package_dir / f"{m}.py").exists() and m != path.stem}
    return graph


def test_no_import_cycle_between_warpnns_modules():
    # A cycle (even through an import inside a function) means two modules each need the other's internals: the
    # layering (signature and facts -> twins -> launchers -> the launch plan -> the bridge) keeps every module
    # importable and testable on its own.
    graph = _package_imports(pathlib.Path(warpnn.__file__).parent)
    graph.pop("__init__", None)
    for module, imported in graph.items():
        stack, seen = list(imported), set()
        while stack:
            current = stack.pop()
            assert current != module, f"warpnn.{module} reaches itself through its imports: {sorted(imported)}"
            if current not in seen and current in graph:
                seen.add(current)
                stack.extend(graph[current])
