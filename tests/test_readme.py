"""The README's examples run, and print what the README says they print."""

import contextlib
import io
import pathlib
import re

import pytest

pytestmark = pytest.mark.fast  # in `make test-fast`

README = pathlib.Path(__file__).parent.parent / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _expected(code):
    """`print(...)  # expected` comments, in order (text before a ':' only)."""
    return [m.split(":")[0].strip() for m in re.findall(r"print\(.*\)\s+# (.*)", code)]


def test_readme_examples_run_and_print_what_they_claim():
    namespace: dict = {}
    blocks = _blocks()
    assert len(blocks) >= 6
    for code in blocks:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), namespace)
        printed = out.getvalue().splitlines()
        expected = _expected(code)
        assert len(printed) >= len(expected), code
        for line, want in zip(printed, expected):
            assert " ".join(line.split()).startswith(" ".join(want.split())), (line, want)
