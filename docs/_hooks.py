"""mkdocs hook: the guide's pages are README.md's sections, included, not copied.

A line `--8<-- "README.md:name"` in a page stands for the lines between README.md's
`<!-- --8<-- [start:name] -->` and `<!-- --8<-- [end:name] -->` comments (invisible on GitHub;
the syntax is pymdownx.snippets'). A missing file or section fails the build.

The README's links to its own sections (`[Configuration with Hydra](#configuration-with-hydra)`)
are pointed at the page that holds that heading (`hydra.md#configuration-with-hydra`) when it
is not on the page they land on. Anything else is left as it is, for mkdocs' link validation
(strict) to report.

`tests/test_docs.py` runs the pages' code blocks through `expand`, as the site shows them.
"""

import os
import pathlib
import re

from markdown.extensions.toc import slugify

_INCLUDE = re.compile(r'^--8<-- "([^":]+):([\w-]+)"[ \t]*$', re.M)
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$")
_LOCAL_LINK = re.compile(r"\]\(#([\w-]+)\)")

_pages: dict[str, set[str]] = {}  # page (relative to docs_dir) -> the anchors of its headings


def section(path: pathlib.Path, name: str) -> str:
    """The lines of `path` between its `[start:name]` and `[end:name]` markers."""
    text = path.read_text(encoding="utf-8")
    m = re.search(rf"--8<-- \[start:{name}\][^\n]*\n(.*?)\n[^\n]*--8<-- \[end:{name}\]", text, re.S)
    if m is None:
        raise ValueError(
            f"{path} has no section {name!r} (`--8<-- [start:{name}]` ... `[end:...]`)"
        )
    return m.group(1).strip("\n")


def expand(text: str, root: pathlib.Path) -> str:
    """`text` with each `--8<-- "file:name"` line replaced by that section of `root / file`."""
    return _INCLUDE.sub(lambda m: section(root / m.group(1), m.group(2)), text)


def _anchors(text: str) -> set[str]:
    found, fence = set(), False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        elif not fence and (m := _HEADING.match(line)):
            found.add(slugify(re.sub(r"[`*]", "", m.group(1)), "-"))
    return found


def _root(config) -> pathlib.Path:
    return pathlib.Path(config["config_file_path"]).parent


def on_config(config):
    docs = pathlib.Path(config["docs_dir"])
    _pages.clear()
    for page in docs.rglob("*.md"):
        text = expand(page.read_text(encoding="utf-8"), _root(config))
        _pages[page.relative_to(docs).as_posix()] = _anchors(text)
    return config


def on_page_markdown(markdown, page, config, files):
    here = page.file.src_uri

    def relink(m):
        anchor = m.group(1)
        if anchor in _pages.get(here, ()):
            return m.group(0)
        for other, anchors in _pages.items():
            if anchor in anchors:
                target = os.path.relpath(other, os.path.dirname(here) or ".")
                return f"]({pathlib.PurePath(target).as_posix()}#{anchor})"
        return m.group(0)

    return _LOCAL_LINK.sub(relink, expand(markdown, _root(config)))
