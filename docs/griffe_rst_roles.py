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
