"""MkDocs hooks: links inside files that a page includes from outside docs/ (``--8<-- "path"``), made right for the
site; Sphinx roles in docstrings shown as plain code.

A file such as ``src/tformer/engine/kernels/README.md`` links relative to its own folder (``../../../../BENCHMARKS.md``,
``gemv.cpp``). Included into a page of docs/, those links would point nowhere, and the strict build would fail. This
hook resolves each relative link of an included file against that file's folder: a link to a document the site
holds (``BENCHMARKS.md`` is the page ``benchmarks.md``; anything under docs/) becomes a link to that page; a link to
another file of the repository (a source file) becomes its path as code, since the site does not serve it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = re.compile(r'^--8<-- "([^"]+)"\s*$', re.MULTILINE)
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")
PAGES = {"BENCHMARKS.md": "benchmarks.md"}  # repository files that the site shows as a page


def _relink(text: str, source: str, page: str) -> str:
    folder = posixpath.dirname(source)

    def replace(match: re.Match) -> str:
        label, target = match.groups()
        if "://" in target or target.startswith(("#", "mailto:")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        resolved = posixpath.normpath(posixpath.join(folder, path))
        doc = PAGES.get(resolved) or (resolved[len("docs/") :] if resolved.startswith("docs/") else None)
        if doc is None:
            return f"{label} (`{resolved}`)" if label.strip("`") != posixpath.basename(resolved) else f"`{resolved}`"
        link = posixpath.relpath(doc, posixpath.dirname(page) or ".")
        return f"[{label}]({link}{'#' + anchor if anchor else ''})"

    return LINK.sub(replace, text)


def on_page_read_source(page, config):
    """Expand the page's includes here (before pymdownx.snippets sees them), with their links made right."""
    source = Path(page.file.abs_src_path).read_text(encoding="utf-8")
    if not INCLUDE.search(source):
        return None

    def expand(match: re.Match) -> str:
        included = match.group(1)
        text = (ROOT / included).read_text(encoding="utf-8")  # a missing file fails the build
        return _relink(text, included, page.file.src_uri)

    return INCLUDE.sub(expand, source)


ROLE = re.compile(r":(?:func|mod|class|meth|data|attr|exc|obj):(?=<code>)")


def on_page_content(html, page, config, files):
    """The docstrings write Sphinx roles (``:func:`name```); Markdown shows the name as code: drop the role's prefix."""
    return ROLE.sub("", html)
