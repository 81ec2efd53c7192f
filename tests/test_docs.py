"""The documentation site (mkdocs.yml, docs/): every public name has an API entry, the pages'
examples run and print what they say, and the strict build passes (a broken link or
cross-reference fails it)."""

import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

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
    # the guide is README.md's sections, each included once
    readme = (ROOT / "README.md").read_text()
    sections = re.findall(r"--8<-- \[start:([\w-]+)\]", readme)
    included = re.findall(
        r'^--8<-- "README.md:([\w-]+)"',
        "\n".join((DOCS / p).read_text() for p in pages),
        flags=re.M,
    )
    assert sorted(included) == sorted(sections)
    assert len(sections) >= 10


def _expected(code):
    """`print(...)  # expected` comments, in order (text before a ':' only), as
    tests/test_readme.py reads them."""
    return [m.split(":")[0].strip() for m in re.findall(r"print\(.*\)\s+# (.*)", code)]


@pytest.mark.fast
def test_page_examples_run_and_print_what_they_claim():
    namespace: dict = {}
    ran = 0
    for page in _nav_pages():
        for code in re.findall(r"```python\n(.*?)```", _page(page), flags=re.S):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code, str(DOCS / page), "exec"), namespace)
            printed = out.getvalue().splitlines()
            expected = _expected(code)
            assert len(printed) >= len(expected), (page, code)
            for line, want in zip(printed, expected):
                assert " ".join(line.split()).startswith(" ".join(want.split())), (page, line)
            ran += 1
    assert ran >= 20


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


def test_strict_build(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    site = tmp_path / "site"
    result = _build(ROOT, site)
    assert result.returncode == 0, result.stdout + result.stderr
    html = {p.relative_to(site).as_posix(): p.read_text() for p in site.rglob("*.html")}
    for name in _directives():
        if name != "eqx_logs.config":
            assert any(f'id="{name}"' in text for text in html.values()), name
    for page, text in html.items():
        # Markdown that did not render: admonitions, cross-references, includes
        assert "!!! example" not in text, page
        assert not re.search(r"\]\[\]", text), page
        assert "--8<--" not in text, page
    assert html["api/core.html"].count('class="admonition example"') >= 5
    assert 'href="hydra.html#configuration-with-hydra"' in html["getting-started.html"]


def test_strict_build_fails_on_a_broken_reference(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra: pip install -e '.[docs]'")
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(DOCS, tmp_path / "docs")
    (tmp_path / "eqx_logs").symlink_to(ROOT / "eqx_logs")  # the API's source (and `watch`)
    page = tmp_path / "docs" / "tap.md"
    page.write_text(page.read_text() + "\nSee [`eqx_logs.no_such_name`][].\n")
    result = _build(tmp_path, tmp_path / "site")
    assert result.returncode != 0
    assert "eqx_logs.no_such_name" in result.stdout + result.stderr
