"""The mutation check: deliberate bugs in the engine, each of which the suite must catch.

    python tests/mutations/run.py [--rev REV] [--only ID ...] [--timeout S] [--out FILE]
                                  [-- PYTEST SELECTION ...]

Copies the repository at REV (default HEAD; `git archive`, so uncommitted edits play no
part) into a temporary directory, checks that the selection passes there unmutated, then for
each mutation of `mutations.json` (a file, an exact snippet found once in it, its replacement,
what it breaks) applies it alone and runs `python -m pytest -x -v -n 2 <selection>` with a
timeout: caught (the run fails), missed (it passes) or timeout, and the seconds to the
verdict. A caught mutation is stopped at its first failing test (the run is killed there:
with -n 2, -x alone waits for each worker's queue); Hypothesis does not shrink
(`noshrink.py`). The selection defaults to the engine's tests without the golden jaxprs
(`DEFAULT_SELECTION`); pass `-- tests/test_golden_jaxprs.py` to see what the goldens alone
catch. Slow: a pytest run per mutation (about a minute each for a caught one on two idle
cores; a missed one runs the whole selection). `--part I/N` runs every N-th mutation.

The tests run under this interpreter (`sys.executable`: run it with `.venv/bin/python`),
importing the copy's `eqx_logs` (`python -m pytest` puts the copy first on the path; the
tests' subprocesses get the copy's root from their own file's path).
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# The engine's tests: what runs spool, tap, plant, masking, reductions and statistics on
# programs, the oracles last. Not the loggers' backends, the docs, the package's metadata,
# the Hydra example's runs (test_config, test_examples) or the goldens.
UNIT = [
    "tests/test_reductions.py",
    "tests/test_core.py",
    "tests/test_interval.py",
    "tests/test_masking.py",
    "tests/test_tap.py",
    "tests/test_tap_interval.py",
    "tests/test_tap_buffer.py",
    "tests/test_policy.py",
    "tests/test_dtypes.py",
    "tests/test_key_plan.py",
    "tests/test_primitives.py",
    "tests/test_hi_primitives.py",
    "tests/test_custom_rules.py",
    "tests/test_equinox_loops.py",
    "tests/test_instrument.py",
    "tests/test_elimination.py",
    "tests/test_sharding.py",
    "tests/test_wrappers.py",
    "tests/test_fuzz_inputs.py",
    "tests/test_nnx.py",
    "tests/test_real_libraries.py",
]
ORACLES = ["tests/test_oracle.py", "tests/test_tap_oracle.py"]
# the reductions' own tests first: they catch a broken reduction in seconds
DEFAULT_SELECTION = UNIT[:1] + ORACLES + UNIT[1:]


def run_pytest(root: Path, selection: list[str], timeout: float) -> tuple[str, float, str]:
    """Runs the selection under a mutation: "caught" at the first failing test (the run is
    stopped there: with -n 2, -x alone waits for each worker's queue), "missed" if it
    passes, "timeout" past `timeout` seconds."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=path)
    # -v: xdist prints each result as it comes ("[gw0] ... FAILED tests/...::test")
    cmd = [sys.executable, "-m", "pytest", "-x", "-v", "-n", "2", "-p", "no:cacheprovider"]
    cmd += ["-p", "noshrink"]  # a failing program is reported as found (noshrink.py)
    start = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, *selection],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    verdict, first, last = None, "", ""
    try:
        for line in proc.stdout:
            last = line.strip() or last
            if re.search(r"\b(FAILED|ERROR) tests/", line):
                verdict, first = "caught", line.strip()
                os.killpg(proc.pid, signal.SIGKILL)
                break
        proc.wait()
    finally:
        timer.cancel()
    seconds = time.monotonic() - start
    if verdict is None:
        if seconds >= timeout:
            verdict = "timeout"
        else:
            verdict = "missed" if proc.returncode == 0 else "caught"
    return verdict, seconds, (first or last)[:300]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", default="HEAD")
    parser.add_argument("--tests-rev", default=None, help="tests/ from this rev instead")
    parser.add_argument("--unit", action="store_true", help="select the engine's unit tests")
    parser.add_argument("--oracles", action="store_true", help="select the oracles")
    parser.add_argument("--only", nargs="*", default=None, help="mutation ids")
    parser.add_argument("--part", default=None, help="I/N: the I-th of N parts (from 1)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=None, help="results as JSON lines")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    parser.add_argument("selection", nargs="*")
    args = parser.parse_args()
    selection = args.selection or (
        (UNIT if args.unit else []) + (ORACLES if args.oracles else []) or DEFAULT_SELECTION
    )
    mutations = json.loads((HERE / "mutations.json").read_text())
    if args.only:
        mutations = [m for m in mutations if m["id"] in args.only]
    if args.part:
        i, n = map(int, args.part.split("/"))
        mutations = mutations[i - 1 :: n]

    with tempfile.TemporaryDirectory(prefix="eqx-logs-mutations-") as tmp:
        root = Path(tmp) / "repo"
        root.mkdir()
        archive = subprocess.run(
            ["git", "archive", args.rev], cwd=ROOT, capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
        if args.tests_rev:  # the engine at --rev, the tests at --tests-rev
            shutil.rmtree(root / "tests")
            tests = subprocess.run(
                ["git", "archive", args.tests_rev, "tests"], cwd=ROOT, capture_output=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(root)], input=tests, check=True)
        rev = subprocess.run(
            ["git", "rev-parse", "--short", args.rev], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        if args.tests_rev:
            rev += "+tests@" + args.tests_rev
        print(f"rev {rev}, {len(mutations)} mutations, selection: {' '.join(selection)}")
        out = open(args.out, "a") if args.out else None
        if not args.no_baseline:
            verdict, seconds, tail = run_pytest(root, selection, args.timeout)
            print(f"unmutated: {verdict} ({seconds:.0f}s) {tail}", flush=True)
            if verdict != "missed":
                print("the selection fails without a mutation: fix that first")
                return 2
        for m in mutations:
            path = root / m["file"]
            original = path.read_text()
            if original.count(m["old"]) != 1:
                verdict, seconds, tail = "n/a", 0.0, "snippet not found once at this rev"
            else:
                path.write_text(original.replace(m["old"], m["new"]))
                try:
                    verdict, seconds, tail = run_pytest(root, selection, args.timeout)
                finally:
                    path.write_text(original)
                    shutil.rmtree(root / "eqx_logs" / "__pycache__", ignore_errors=True)
            print(f"{m['id']:40s} {verdict:8s} {seconds:6.0f}s  {tail}", flush=True)
            if out:
                record = dict(id=m["id"], rev=rev, verdict=verdict, seconds=round(seconds, 1))
                out.write(json.dumps({**record, "selection": selection, "first": tail}) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
