"""mkdocs hook: README.md's sections in the pages that include them, and links to the API.

A line `--8<-- "README.md:name"` in a page stands for the lines between README.md's
`<!-- --8<-- [start:name] -->` and `<!-- --8<-- [end:name] -->` comments (invisible on GitHub;
the syntax is pymdownx.snippets'), so the home page shows the README's loop as it is; a line
`--8<-- "CHANGELOG.md"` stands for the whole file (the changelog's page). A missing file or
section fails the build; links are left to mkdocs' validation (strict) to report.

In a table's first column, a code span that names a documented object (`log(data, ...)`,
`loggers.JsonlLogger`, `LogDict.first_nonfinite`: the name before any `(`, looked up among the
API pages' `::: eqx_logs...` entries) becomes a link to its API entry (`link_names`); the
README itself keeps plain code, as GitHub has no API reference to point at.

`tests/test_docs.py` runs each page's code blocks through `expand`, as the site shows them.
"""

import importlib
import inspect
import pathlib
import re

_INCLUDE = re.compile(r'^--8<-- "([^":]+)(?::([\w-]+))?"[ \t]*$', re.M)
_README_DOCS_LINK = re.compile(r"\]\(docs/")
_DIRECTIVE = re.compile(r"^::: *(eqx_logs[\w.]*)", re.M)
_CODE = re.compile(r"(?<!\[)`([^`\n]+)`(?!\])")
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_MODULES = ("eqx_logs", "eqx_logs.loggers", "eqx_logs.config")


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
    """`text` with each `--8<-- "file:name"` line replaced by that section of `root / file`,
    and each `--8<-- "file"` line by the whole file.

    The README links to the guide's pages as `docs/page.md`; included in a page (every page
    that includes sections is in docs/ itself), such a link is `page.md`."""

    def include(m):
        path = root / m.group(1)
        text = section(path, m.group(2)) if m.group(2) else path.read_text(encoding="utf-8")
        return _README_DOCS_LINK.sub("](", text)

    return _INCLUDE.sub(include, text)


def api_names(docs: pathlib.Path) -> set[str]:
    """The objects with an entry of their own in the API pages (`::: eqx_logs.X`)."""
    names = set()
    for page in (docs / "api").glob("*.md"):
        names.update(_DIRECTIVE.findall(page.read_text(encoding="utf-8")))
    return names


def _documented_member(path: str) -> bool:
    """Whether `path` (`eqx_logs.LogDict.first_nonfinite`) is a public member with a docstring
    of the class that defines it, so that mkdocstrings gives it an entry (and an anchor)."""
    owner, _, attr = path.rpartition(".")
    module, _, cls = owner.rpartition(".")
    try:
        obj = vars(getattr(importlib.import_module(module), cls)).get(attr)
    except (ImportError, AttributeError, TypeError):
        return False
    if isinstance(obj, staticmethod | classmethod):
        obj = obj.__func__
    return obj is not None and not attr.startswith("_") and bool(inspect.getdoc(obj))


def _target(code: str, names: set[str]) -> str | None:
    """The API entry that a code span (`spool(fun, ...)`, `loggers.JsonlLogger`) names."""
    m = _NAME.match(code.strip())
    if m is None:
        return None
    name = m.group(0).rstrip(".")
    for module in _MODULES:
        path = name if name.startswith("eqx_logs") else f"{module}.{name}"
        if path in names:
            return path
        owner = path.rpartition(".")[0]
        if owner in names and _documented_member(path):
            return path
    return None


def _first_cell_end(line: str) -> int:
    """The index of the `|` that ends the first cell of a table row (`|` inside code spans
    and escaped `\\|` do not end it), or -1."""
    code = False
    for i, c in enumerate(line[1:], 1):
        if c == "`":
            code = not code
        elif c == "|" and not code and line[i - 1] != "\\":
            return i
    return -1


def link_names(markdown: str, names: set[str]) -> str:
    """`markdown` with the code spans in its tables' first column that name an API entry made
    links to it: `` `log(data, /, ...)` `` becomes `` [`log(data, /, ...)`][eqx_logs.log] ``."""
    out, fence = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        elif not fence and line.startswith("|") and (end := _first_cell_end(line)) > 0:

            def link(m):
                target = _target(m.group(1), names)
                return m.group(0) if target is None else f"[{m.group(0)}][{target}]"

            line = line[:1] + _CODE.sub(link, line[1:end]) + line[end:]
        out.append(line)
    return "\n".join(out)


def _root(config) -> pathlib.Path:
    return pathlib.Path(config["config_file_path"]).parent


def on_page_markdown(markdown, page, config, files):
    markdown = expand(markdown, _root(config))
    return link_names(markdown, api_names(pathlib.Path(config["docs_dir"])))
