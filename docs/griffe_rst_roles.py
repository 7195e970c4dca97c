"""A griffe extension for the API reference: Sphinx cross-reference roles in docstrings (:func:`bind`) become
Markdown code spans (`bind`), which is what mkdocstrings renders."""

import re

import griffe

_ROLE = re.compile(r":(?:py:)?(?:func|class|data|mod|meth|attr|obj|exc|const):`(~?)([^`]+)`")


def _plain(match: re.Match) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRolesToCode(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_plain, obj.docstring.value)


def literal_blocks_to_fences(text: str) -> str:
    """reStructuredText literal blocks (a paragraph ending in ``::``, then an indented block) as Markdown fenced
    Python code: ``Example::`` followed by indented code becomes ``Example:`` and a fenced block."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.lstrip().startswith(("..", ">>>", "#")):
            indent = len(line) - len(line.lstrip())
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and len(lines[j]) - len(lines[j].lstrip()) > indent:
                block = len(lines[j]) - len(lines[j].lstrip())
                k = j
                while k < len(lines) and (not lines[k].strip() or len(lines[k]) - len(lines[k].lstrip()) >= block):
                    k += 1
                while k > j and not lines[k - 1].strip():
                    k -= 1
                pad = " " * indent
                intro = line.rstrip()[:-1]
                if intro.strip() == "Example:":  # alone on its line, Google style would read a section title
                    intro = pad + "For example:"
                out += [intro, "", pad + "```python"]
                out += [pad + code[block:] if code.strip() else "" for code in lines[j:k]]
                out.append(pad + "```")
                i = k
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


class LiteralBlocksToFences(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = literal_blocks_to_fences(obj.docstring.value)
