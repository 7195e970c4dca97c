"""Every fenced Python block of README.md and docs/*.md runs as pasted.

The blocks of one file run in order, in one fresh Python process with one namespace (later blocks may use
what earlier ones defined, as a reader pasting them into one session would), in a temporary folder. A
block marked, on the line before its fence, with

- ``<!-- skip-test: why -->`` is not run: it needs a GPU, several hosts, or is deliberately partial (a
  sketch of calls whose data the page does not build); the reason is part of the page's source;
- ``<!-- test: own-process -->`` runs alone in its own fresh process (e.g. code that must run before JAX
  starts).

A block whose only line is a snippet include, ``--8<-- "examples/x.py"`` (how the site renders a whole
file), runs that file. A failure names the file and line of the block (tracebacks point into the Markdown
file).
"""

import importlib.util
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from .helpers import QUICK_COMPILE_LEVEL, subprocess_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where the code comes from (a page, or the file a block includes), for code that builds many kernels and runs them
# briefly (helpers.py): the Newton example took 48 s with Warp's kernel cache empty, 25 s at -O0, the same fit;
# tracer.md (a Newton cloth, Newton's collision modules) 61 s, 22 s at -O0.
QUICK_COMPILE_SOURCES = {"docs/mujoco.md", "docs/tracer.md", "examples/newton_cloth_fit.py"}
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[\w+-]*)\s*$")
INCLUDE = re.compile(r'^--8<--\s+"(?P<path>[^":]+)"\s*$')
MARKER = re.compile(r"^\s*<!--\s*(?P<kind>skip-test|test)\s*:\s*(?P<value>.*?)\s*-->\s*$")


def blocks(page: Path) -> list[dict]:
    """The fenced Python blocks of ``page``: ``{"line", "code", "skip", "own_process"}``."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence or not fence["lang"]:
            i += 1
            continue
        start, indent = i, len(fence["indent"])
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            i += 1
        if fence["lang"] in ("python", "py"):
            previous = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
            marker = MARKER.match(previous)
            code = textwrap.dedent("\n".join(line[indent:] if line[:indent].isspace() else line
                                             for line in lines[start + 1 : i]))
            # Warp reads a kernel's source back from the file and line that the code object names, so code runs
            # compiled as the file it is in: the Markdown page, or the included file.
            include = INCLUDE.match(code.strip())
            source, first_line = (ROOT / include["path"], 1) if include else (page, start + 2)
            if include:
                code = source.read_text()
            found.append({"line": start + 2, "code": code, "source": str(source), "first_line": first_line,
                          "skip": marker["value"] if marker and marker["kind"] == "skip-test" else None,
                          "own_process": bool(marker and marker["kind"] == "test" and marker["value"] == "own-process")})
        i += 1
    return found


def _sessions():
    for page in PAGES:
        runnable = [b for b in blocks(page) if b["skip"] is None]
        shared = [b for b in runnable if not b["own_process"]]
        rel = page.relative_to(ROOT).as_posix()
        if shared:
            yield pytest.param(rel, shared, id=rel)
        for b in runnable:
            if b["own_process"]:
                yield pytest.param(rel, [b], id=f"{rel}:{b['line']}")


def _run(page: str, session: list[dict], cwd: Path) -> subprocess.CompletedProcess:
    script = ["import sys", "namespace = {'__name__': '__main__'}"]
    quick = any(Path(b["source"]).relative_to(ROOT).as_posix() in QUICK_COMPILE_SOURCES for b in session)
    if quick and QUICK_COMPILE_LEVEL is not None:  # (the harness's, not the page's code)
        script.append(f"import warp; warp.config.optimization_level = {QUICK_COMPILE_LEVEL}")
    for b in session:
        script.append(f"print('--- {page}:{b['line']}', flush=True)")
        # Blank lines before the code make the Markdown line numbers the traceback's line numbers.
        script.append(f"exec(compile({chr(10) * (b['first_line'] - 1) + b['code']!r}, {b['source']!r}, 'exec'), "
                      "namespace)")
    env = subprocess_env()
    return subprocess.run([sys.executable, "-c", "\n".join(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


# The optional extras a page may use (pyproject.toml): without one installed, its pages skip, naming the extra.
EXTRAS = {"newton": "newton", "mujoco": "mujoco", "mujoco_warp": "mujoco"}


def _missing_extra(stderr: str) -> str | None:
    missing = re.search(r"ModuleNotFoundError: No module named '(\w+)", stderr)
    if missing and missing[1] in EXTRAS and importlib.util.find_spec(missing[1]) is None:
        return EXTRAS[missing[1]]
    return None


@pytest.mark.parametrize(("page", "session"), list(_sessions()))
def test_page_blocks_run_as_pasted(page, session, tmp_path):
    proc = _run(page, session, tmp_path)
    if proc.returncode != 0 and (extra := _missing_extra(proc.stderr)):
        pytest.skip(f"{page} needs the '{extra}' extra, not installed here (pip install 'warpnn[{extra}]')")
    assert proc.returncode == 0, (
        f"{page}: the block after the last '---' line below failed\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")


def test_every_skipped_block_says_why_and_the_readme_is_tested():
    all_blocks = {page.relative_to(ROOT).as_posix(): blocks(page) for page in PAGES}
    for page, found in all_blocks.items():
        for b in found:
            assert b["skip"] is None or len(b["skip"]) > 10, f"{page}:{b['line']}: say why the block is skipped"
    readme = [b for b in all_blocks["README.md"] if b["skip"] is None]
    assert any("warpnn.jax_kernel(springs)" in b["code"] for b in readme), "the README's Ten lines are run"
    moved = {"docs/modules.md": "warpnn.nnx.WarpLayer(binding", "docs/cuda-graphs.md": "enable_cuda_graph_capture()"}
    for page, code in moved.items():  # the README's other blocks, now on guide pages, run there
        assert any(code in b["code"] and b["skip"] is None for b in all_blocks[page]), page


def test_the_block_finder_finds_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\na = 1\n```\n\n<!-- skip-test: needs a GPU to run -->\n```python\nb\n```\n"
                    "<!-- test: own-process -->\n\n```python\nc = 3\n```\n  ```python\n  d = 4\n  ```\n```bash\nls\n```\n")
    found = blocks(page)
    assert all(b["source"] == str(page) and b["first_line"] == b["line"] for b in found)
    assert [(b["line"], b["code"], b["skip"], b["own_process"]) for b in found] == [
        (4, "a = 1", None, False), (9, "b", "needs a GPU to run", False), (14, "c = 3", None, True),
        (17, "d = 4", None, False)]
