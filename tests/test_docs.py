"""The documentation site (mkdocs.yml, docs/): every public name has an API entry, the pages'
examples run and print what they say, and the strict build passes (a broken link or
cross-reference fails it)."""

import html as html_module
import importlib
import importlib.util
import inspect
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml
from helpers import user_env

import eqx_logs
import eqx_logs.config
import eqx_logs.loggers

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"


def _hooks():
    """docs/_hooks.py, which includes README.md's sections in the pages."""
    spec = importlib.util.spec_from_file_location("_docs_hooks", DOCS / "_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _nav_pages(nav=None):
    """The pages of mkdocs.yml's nav, in order."""
    if nav is None:
        nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    for entry in nav:
        if isinstance(entry, str):
            yield entry
        else:
            for value in entry.values():
                yield from ([value] if isinstance(value, str) else _nav_pages(value))


def _page(name):
    """A page's Markdown as the site renders it: README sections included."""
    return _hooks().expand((DOCS / name).read_text(), ROOT)


def _public(module):
    """The public classes and functions of a module: those of eqx_logs it exports (the
    package's `from ._x import Y as Y`), or, for eqx_logs.config, those it defines."""
    names = set()
    for name, obj in vars(module).items():
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        where = obj.__module__
        if where == module.__name__ or (
            module.__name__ != "eqx_logs.config" and where.startswith(module.__name__ + "._")
        ):
            names.add(f"{module.__name__}.{name}")
    return names


def _directives():
    """The `::: eqx_logs.X` entries of the API pages."""
    found = []
    for page in sorted((DOCS / "api").glob("*.md")):
        found += re.findall(r"^::: *([\w.]+)", page.read_text(), flags=re.M)
    return found


@pytest.mark.fast
def test_every_public_name_has_an_api_entry():
    documented = _directives()
    assert len(documented) == len(set(documented)), "a name documented twice"
    public = set()
    for module in (eqx_logs, eqx_logs.loggers, eqx_logs.config):
        public |= _public(module)
    assert len(public) >= 50
    missing = sorted(public - set(documented))
    assert not missing, f"no API entry (docs/api/*.md) for {missing}"
    for name in documented:  # and no entry names what is not there
        module, _, attr = name.rpartition(".")
        try:
            importlib.import_module(name)
        except ImportError:
            assert hasattr(importlib.import_module(module), attr), name
    api = [p for p in _nav_pages() if p.startswith("api/")]
    assert sorted(api) == sorted(f"api/{p.name}" for p in (DOCS / "api").glob("*.md"))


@pytest.mark.fast
def test_every_page_is_in_the_nav_and_includes_what_exists():
    pages = list(_nav_pages())
    on_disk = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk
    for page in pages:
        text = _page(page)  # raises for a missing README section
        assert "--8<--" not in text, page
    # README.md's sections, each included once (the home page shows its loop as it is)
    readme = (ROOT / "README.md").read_text()
    sections = re.findall(r"--8<-- \[start:([\w-]+)\]", readme)
    included = re.findall(
        r'^--8<-- "README.md:([\w-]+)"',
        "\n".join((DOCS / p).read_text() for p in pages),
        flags=re.M,
    )
    assert sorted(included) == sorted(sections)
    assert {"loop", "spool"} <= set(sections)


@pytest.mark.fast
def test_the_readme_is_an_on_ramp():
    """README.md is short, with the per-step loop (`logger.jit`, `interval`, an array step, a
    JSONL file read back and plotted) in its first 150 lines, and a link to every page of the
    guide."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 400, len(lines)
    head = "\n".join(lines[:150])
    for needed in ("logger.jit(", "interval=", "jnp.int32(i)", "read_jsonl(", "plt.plot(", "optax"):
        assert needed in head, needed
    readme = "\n".join(lines)
    for page in _guide()[1:]:
        if page != "index.md":
            assert f"](docs/{page})" in readme, page


@pytest.mark.fast
def test_table_names_link_to_the_api():
    """docs/_hooks.py's `link_names`: code in a table's first column that names an API entry
    becomes a link to it; other code, other columns and code blocks are left as they are."""
    hooks = _hooks()
    names = hooks.api_names(DOCS)
    assert {"eqx_logs.log", "eqx_logs.loggers.JsonlLogger", "eqx_logs.config.policy"} <= names
    text = "\n".join(
        [
            "| name | what |",
            "|---|---|",
            "| `log(data, /, *, tags=())` | `spool` here stays |",
            "| `loggers.JsonlLogger`, `TensorBoardLogger`, ... | x |",
            "| `spool(..., key=None)`, `LogDict.first_nonfinite` | x |",
            "| `jax.jit(f)`, [`tap`](tap.md) | `a | b` |",
            "```",
            "| `log(x)` | in a code block |",
            "```",
        ]
    )
    out = hooks.link_names(text, names).splitlines()
    assert out[2] == "| [`log(data, /, *, tags=())`][eqx_logs.log] | `spool` here stays |"
    assert out[3] == (
        "| [`loggers.JsonlLogger`][eqx_logs.loggers.JsonlLogger], "
        "[`TensorBoardLogger`][eqx_logs.loggers.TensorBoardLogger], ... | x |"
    )
    assert out[4] == (
        "| [`spool(..., key=None)`][eqx_logs.spool], "
        "[`LogDict.first_nonfinite`][eqx_logs.LogDict.first_nonfinite] | x |"
    )
    assert out[5:] == text.splitlines()[5:]


@pytest.mark.fast
def test_log_signature_shows_missing():
    """`log`'s `value` default reads `MISSING` (help(), the API reference), not an object's
    address or a private name."""
    value = inspect.signature(eqx_logs.log).parameters["value"]
    assert repr(value.default) == "MISSING"
    assert str(value).endswith(" = MISSING")


def _expected(code):
    """`print(...)  # expected` comments, in order (text before a ':' only)."""
    return [m.split(":")[0].strip() for m in re.findall(r"print\(.*\)\s+# (.*)", code)]


# Runs the code blocks it reads from stdin (a JSON list of [file name, code]) in order, in one
# namespace, as a reader pasting them into a fresh interpreter would; prints each block's
# output as a JSON list.
_RUNNER = """
import contextlib, io, json, sys
blocks, namespace, printed = json.load(sys.stdin), {"__name__": "__main__"}, []
for name, code in blocks:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, name, "exec"), namespace)
    printed.append(out.getvalue())
sys.stdout.write(json.dumps(printed))
"""


def _guide():
    """README.md and the guide's pages (the API reference's pages have no code of their own, the
    changelog's page is CHANGELOG.md)."""
    return ["README.md"] + [
        p for p in _nav_pages() if not p.startswith("api/") and p != "changelog.md"
    ]


@pytest.mark.fast
@pytest.mark.parametrize("page", _guide())
def test_each_page_runs_alone_and_prints_what_it_claims(page, tmp_path, jax_cache):
    """Each page's Python blocks, in order, in a fresh interpreter of their own (each page
    shows its imports), as the site shows them; every `print(...)  # expected` comment holds."""
    path = ROOT / page if page == "README.md" else DOCS / page
    text = path.read_text() if page == "README.md" else _page(page)
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    if page in ("how-it-works.md", "overhead.md", "testing.md"):
        assert not blocks, f"{page} has code now: take it out of this list"
        return
    assert blocks, page
    result = subprocess.run(
        [sys.executable, "-c", _RUNNER],
        # each block padded to its line in the page, so that a traceback points at it
        input=json.dumps(
            [[str(path), "\n" * text[: text.index(code)].count("\n") + code] for code in blocks]
        ),
        capture_output=True,
        text=True,
        cwd=tmp_path,  # what a page writes stays out of the checkout
        # this checkout's eqx_logs, compiled as a user's is (the printed numbers are theirs)
        env={**user_env(), "PYTHONPATH": str(ROOT), **jax_cache},
        timeout=600,
    )
    assert result.returncode == 0, f"{page}:\n{result.stderr[-4000:]}"
    for code, out in zip(blocks, json.loads(result.stdout)):
        printed, expected = out.splitlines(), _expected(code)
        assert len(printed) >= len(expected), (page, code, out)
        for line, want in zip(printed, expected):
            assert " ".join(line.split()).startswith(" ".join(want.split())), (page, line, want)


# The code column's width in characters at a 1280 px wide window: measured in headless Chromium
# (`chromium --headless --window-size=1280,900`, the theme's monospace font, DejaVu Sans Mono
# there, as wide as Menlo and wider than SF Mono or Consolas) as the content box of a page's
# `pre > code` over the width of one character: 700 px / 8.5 px. A longer line scrolls
# sideways and hides its end (the `# prints` comment). mkdocs.yml's `line_length` (the API's
# signatures) is the same.
CODE_COLUMNS = 82


def _outside_code(markdown):
    """`markdown` with its fenced code blocks left out."""
    return re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)


def _code_lines(markdown):
    """The lines of `markdown`'s fenced code blocks."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", markdown, flags=re.S | re.M)
    return [line for block in blocks for line in block.splitlines()]


@pytest.mark.fast
def test_guide_pages_have_sections_links_and_code_that_fits():
    """What a reader of the site needs of each guide page: `##` subheadings (the page's table of
    contents, and anchors to link to), a link into the API reference (Markdown links to
    api/*.md, cross-references to `eqx_logs...` entries, or the table names docs/_hooks.py
    links), and code lines no wider than the code column at 1280 px (a `# prints` comment past
    it is hidden). The pages as the site shows them: README sections included."""
    hooks = _hooks()
    names = hooks.api_names(DOCS)
    for page in _guide()[1:]:
        text = hooks.link_names(_page(page), names)
        prose = _outside_code(text)
        assert re.search(r"^## \S", prose, flags=re.M), f"{page}: no `##` subheading"
        links = re.findall(r"\]\((api/[\w.]+)(?:#[^)]*)?\)|\]\[(eqx_logs[\w.()]*)\]", prose)
        links += re.findall(r"\[`(eqx_logs[\w.]*)`\]\[\]", prose)
        assert links, f"{page}: no link into the API reference"
        wide = [line for line in _code_lines(text) if len(line) > CODE_COLUMNS]
        assert not wide, f"{page}: code lines wider than {CODE_COLUMNS} characters: {wide}"
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (mkdocstrings,) = [p["mkdocstrings"] for p in config["plugins"] if "mkdocstrings" in p]
    options = mkdocstrings["handlers"]["python"]["options"]
    assert options["line_length"] == CODE_COLUMNS


@pytest.mark.fast
def test_site_config_and_the_home_pages_way_on():
    """mkdocs.yml names the site's and the repository's addresses (the 404 page's links work
    under a sub-path, the sitemap lists the pages), the changelog is a page of the nav (the
    whole of CHANGELOG.md), and the home page's "Where to go next" links every guide page."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert re.fullmatch(r"https://[\w.-]+/([\w.-]+/)*", config["site_url"]), config["site_url"]
    assert config["repo_url"].startswith("https://")
    assert "changelog.md" in _nav_pages(config["nav"])
    assert "CHANGELOG.md" in config["watch"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert _page("changelog.md").strip() == changelog.strip()
    home = _page("index.md")
    section = home[home.index("## Where to go next") :]
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", section))
    guide = set(_guide()[1:]) - {"index.md"}
    assert guide <= linked, f"not in the home page's list: {sorted(guide - linked)}"


def _build(root, site):
    """`mkdocs build --strict` of `root`'s mkdocs.yml (not `-q`: it hides the warnings that
    strict mode counts, and the build passes)."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site, built once (strict) for the tests that read it: (build result, the built
    folder, its HTML pages by path)."""
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    folder = tmp_path_factory.mktemp("docs") / "site"
    result = _build(ROOT, folder)
    html = {p.relative_to(folder).as_posix(): p.read_text() for p in folder.rglob("*.html")}
    return result, folder, html


def test_strict_build(site):
    result, _, html = site
    assert result.returncode == 0, result.stdout + result.stderr
    for name in _directives():
        if name != "eqx_logs.config":
            assert any(f'id="{name}"' in text for text in html.values()), name
    for page, text in html.items():
        # Markdown that did not render: admonitions, cross-references, includes
        assert "!!! example" not in text, page
        assert not re.search(r"\]\[\]", text), page
        assert "--8<--" not in text, page
    assert html["api/core.html"].count('class="admonition example"') >= 5
    # the README's links to the guide (`docs/semantics.md`) work on the home page that includes
    # them (`semantics.html`)
    assert 'href="semantics.html"' in html["index.html"]
    assert 'href="docs/' not in html["index.html"]


def test_site_lists_the_policy_options_once_and_works_under_a_sub_path(site):
    """The policy's options are described in `Policy`'s entry alone, each under an anchor of its
    own; `spool`, `tap`, the loggers' `spool`, `tap` and `jit` and `eqx_logs.config.policy`
    link to those anchors (`help()` still lists them all). With `site_url` set, the 404 page's
    links start at its path and the sitemap lists every page."""
    from eqx_logs._reduce._options import OPTIONS, TAP_OPTIONS

    result, folder, html = site
    assert result.returncode == 0, result.stdout + result.stderr
    api = {page: text for page, text in html.items() if page.startswith("api/")}
    for name in OPTIONS:
        anchor = f'id="eqx_logs.Policy({name})"'
        assert [p for p, text in api.items() if anchor in text] == ["api/core.html"], name
        assert api["api/core.html"].count(anchor) == 1, name
    # the entries of the options' list (`reduce` (default 'stack'): ...), once in all the API
    assert sum(text.count("(default <code>") for text in api.values()) == len(OPTIONS)
    linking = {
        "api/core.html": ["eqx_logs.spool", "eqx_logs.tap"],
        "api/loggers.html": [
            "eqx_logs.loggers.AbstractLogger.spool",
            "eqx_logs.loggers.AbstractLogger.tap",
            "eqx_logs.loggers.AbstractLogger.jit",
        ],
        "api/config.html": ["eqx_logs.config.policy"],
    }
    for page, entries in linking.items():
        prefix = "" if page == "api/core.html" else "core.html"
        for entry in entries:
            text = api[page]
            start = text.index(f'id="{entry}" class="doc doc-heading"')
            body = text[start : text.index('class="doc doc-heading"', start + len(entry) + 30)]
            names = TAP_OPTIONS if entry.endswith("tap") else tuple(OPTIONS)
            for name in names:
                assert f'href="{prefix}#eqx_logs.Policy({name})"' in body, (entry, name)
            assert "drop events carrying any of these tags" not in body, entry
    assert "drop events carrying any of these tags" in inspect.getdoc(eqx_logs.spool)

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    base = re.sub(r"^https?://[^/]+", "", config["site_url"])
    assert base.startswith("/") and base.endswith("/")
    missing = html["404.html"]
    assert f'href="{base}assets/stylesheets/' in missing and f'href="{base}index.html"' in missing
    sitemap = (folder / "sitemap.xml").read_text()
    locs = set(re.findall(r"<loc>(.*?)</loc>", sitemap))
    pages = {p for p in html if p != "404.html"}
    assert locs == {config["site_url"] + p for p in pages}, sorted(locs)


def _signature(page, name):
    """The text of `name`'s rendered signature in `page` (tags stripped)."""
    start = page.index(f'id="{name}"')
    block = page[start : page.index("</code></pre>", start)]
    return html_module.unescape(re.sub(r"<[^>]+>", "", block))


def test_site_polish(site):
    """No web fonts, meaningful defaults in signatures, no "this README", the API table's
    names linked to their entries, and table code that wraps between names only."""
    result, folder, html = site
    assert result.returncode == 0, result.stdout + result.stderr
    for page, text in html.items():
        # `theme.font: false`: nothing is fetched from a web font host
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, page
        assert "this README" not in text, page
    log = _signature(html["api/core.html"], "eqx_logs.log")
    assert "value: PyTree[ArrayLike] = MISSING," in log and "_MISSING" not in log, log
    instrument = _signature(html["api/config.html"], "eqx_logs.config.InstrumentConfig")
    assert "lambda" not in instrument and "DEFAULT_STATS" not in instrument, instrument
    assert "stats: list[str] = [" in instrument and '"mean"' in instrument, instrument
    # a `field(default_factory=list)` shows the default it makes
    policy_config = _signature(html["api/config.html"], "eqx_logs.config.PolicyConfig")
    assert re.search(r"\bexclude: [\w\[\]]+ = \[\],", policy_config), policy_config
    assert 'class="doc doc-label doc-label-dataclass' in html["api/config.html"]

    # every name of the API table (README.md's `api` section) links to its API entry
    page = html["getting-started.html"]
    start = page.index("<table>")
    table = page[start : page.index("</table>", start)]
    rows = re.findall(r"<tr>\s*<td>(.*?)</td>", table, flags=re.S)
    assert len(rows) >= 14
    links = 0
    for cell in rows:
        codes = re.findall(r"(<a [^>]*>)?<code>([^<]*)</code>", cell)
        for anchor, code in codes:
            if code.strip(".") == "":  # the `...` of `loggers.JsonlLogger`, `...`
                continue
            assert anchor, f"not linked: {code}"
            href = re.search(r'href="(api/\w+\.html)#(eqx_logs\.[\w.]+)"', anchor)
            assert href is not None, anchor
            assert f'id="{href.group(2)}"' in html[href.group(1)], anchor
            links += 1
    assert links >= 25
    assert 'href="api/core.html#eqx_logs.LogDict.first_nonfinite"' in table

    # code in a table cell wraps at spaces, not inside a name (a table wider than the page
    # scrolls sideways in the wrapper the theme's script puts around it)
    css = (folder / "_static" / "custom.css").read_text()
    rule = re.search(r"\.md-typeset td code[^{]*\{([^}]*)\}", css)
    assert rule is not None and "word-break: normal" in rule.group(1), css
    assert "overflow-wrap: normal" in rule.group(1)
    assert 'href="_static/custom.css"' in html["training-loop.html"]


def test_strict_build_fails_on_a_broken_reference(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    for name in ("mkdocs.yml", "README.md", "CHANGELOG.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(DOCS, tmp_path / "docs")
    (tmp_path / "eqx_logs").symlink_to(ROOT / "eqx_logs")  # the API's source (and `watch`)
    page = tmp_path / "docs" / "tap.md"
    page.write_text(page.read_text() + "\nSee [`eqx_logs.no_such_name`][].\n")
    result = _build(tmp_path, tmp_path / "site")
    assert result.returncode != 0
    assert "eqx_logs.no_such_name" in result.stdout + result.stderr
