"""The documentation site's hooks (mkdocs.yml): the README as the home page, bench/README.md
as the benchmarks page, and the docstrings' Sphinx roles as links of the API reference.

The Markdown keeps the links that work on GitHub (``../bench/README.md`` from a page of docs/,
``docs/tables.md`` from the README); each page's links are rewritten here to the site's pages,
so the strict build checks them like any other link.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from griffe import (
    AliasResolutionError,
    CyclicAliasError,
    Extension,
    NameResolutionError,
    Object,
)
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent

# Site page -> the repository file it is made from; pages not listed are docs/<page>.
OUTSIDE_DOCS = {"index.md": "README.md", "benchmarks.md": "bench/README.md"}
SITE_PAGE = {source: page for page, source in OUTSIDE_DOCS.items()}

LINK = re.compile(r"(\]\()([^)\s]+)(\))")
URL_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    """Add the pages made from files outside docs/."""
    for page, source in OUTSIDE_DOCS.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / source)))
    return files


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Point the page's relative links at the site's pages instead of the repository's files."""
    here = OUTSIDE_DOCS.get(page.file.src_uri, f"docs/{page.file.src_uri}")
    return LINK.sub(lambda m: m[1] + site_link(here, page.file.src_uri, m[2]) + m[3], markdown)


def site_link(source: str, page: str, target: str) -> str:
    """``target``, a link in the repository file ``source``, as a link from site ``page``.

    A link to a file outside docs/ that is no page of the site is left as it is: the strict
    build then reports it.
    """
    if target.startswith(("#", "/")) or URL_SCHEME.match(target):
        return target
    path, hash_, anchor = target.partition("#")
    file = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
    if file in SITE_PAGE:
        file = SITE_PAGE[file]
    elif file.startswith("docs/"):
        file = file.removeprefix("docs/")
    else:
        return target
    return posixpath.relpath(file, posixpath.dirname(page) or ".") + hash_ + anchor


ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")
LITERAL_BLOCK = re.compile(r"::\n(?=\n)")


class SphinxRoles(Extension):
    """Turn ``:class:`~deltaflow.errors.UsageError``` into a link to the object's reference.

    The name is resolved as Python would from where the docstring is (``:class:`Client``` in
    ``deltaflow.client.client``), and written as an optional cross-reference: a link when the
    site documents the object, code otherwise (a private module, the standard library).
    """

    def on_package(self, *, pkg: Object, **kwargs: Any) -> None:
        self._convert(pkg)

    def _convert(self, obj: Object) -> None:
        if obj.docstring is not None:
            text = ROLE.sub(lambda m: self._reference(obj, m[1] == "~", m[2]), obj.docstring.value)
            obj.docstring.value = LITERAL_BLOCK.sub(":\n", text)
        for member in obj.members.values():
            if not member.is_alias:
                self._convert(member)  # type: ignore[arg-type]

    @staticmethod
    def _reference(obj: Object, short: bool, name: str) -> str:
        if name.startswith("."):
            module = obj.module
            package = module if module.is_init_module else module.parent
            path = f"{package.path if package else ''}{name}"
        else:
            first, _, rest = name.partition(".")
            try:
                path = obj.resolve(first) + (f".{rest}" if rest else "")
            except NameResolutionError:
                path = name
        try:  # an object's canonical path: what the site knows it by wherever it is shown
            path = obj.modules_collection[path].canonical_path
        except (KeyError, AliasResolutionError, CyclicAliasError):
            pass
        title = name.rsplit(".", 1)[-1] if short or name.startswith(".") else name
        return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'
