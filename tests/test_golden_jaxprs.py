"""The golden jaxprs (tests/golden/README.md): the programs that spool, tap, plant and the
masking interpreter emit for the oracle's recorded random programs and for the README's and
documentation's examples are those recorded for the running JAX version, exactly.

`tests/golden/record.py --check` runs in a process of its own: it fixes the environment JAX
reads at import (the CPU, one device) and wraps the `__call__` of the transforms' wrappers to
record the examples, neither of which may leak into the other tests. The fast subset runs in
the default suite; all cases with `pytest -m golden` (or `python tests/golden/record.py
--check`)."""

import gzip
import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).parent.parent
RECORD = ROOT / "tests" / "golden" / "record.py"
VERSION = ".".join(jax.__version__.split(".")[:2])
GOLDEN = RECORD.parent / f"jaxprs-jax{VERSION}.json.gz"


def _check(*args: str, timeout: int) -> None:
    if not GOLDEN.exists():
        pytest.skip(f"no golden jaxprs for jax {VERSION}: python {RECORD.relative_to(ROOT)}")
    with gzip.open(GOLDEN, "rt") as f:
        recorded = json.load(f)
    if recorded["jax"] != jax.__version__:  # the printed programs are a JAX release's
        pytest.skip(
            f"the golden jaxprs are of jax {recorded['jax']}, this is {jax.__version__}: "
            f"record them with python {RECORD.relative_to(ROOT)}, or install jax "
            f"{recorded['jax']}"
        )
    result = subprocess.run(
        [sys.executable, str(RECORD), "--check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        pytest.fail(result.stdout[-20000:] + result.stderr[-5000:], pytrace=False)


@pytest.mark.fast
def test_golden_jaxprs_fast_subset():
    """Two oracle cases of each kind and the README's examples (about 8 s)."""
    _check("--subset", "fast", timeout=300)


@pytest.mark.golden
def test_golden_jaxprs(request):
    """Every recorded case (about a minute): run with `pytest -m golden`."""
    if "golden" not in (request.config.option.markexpr or "") and not os.environ.get(
        "EQX_LOGS_GOLDEN"
    ):
        pytest.skip(
            "all golden jaxprs: pytest -m golden (or python tests/golden/record.py --check)"
        )
    _check(timeout=900)
