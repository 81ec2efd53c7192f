"""The examples without Hydra run and print what they promise (examples/train.py, the Hydra
example, is tested by test_config.py)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parent.parent


def _run(script: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_reductions_example():
    out = _run("reductions.py")
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    means = [float(v) for v in lines["loss, mean per 100 steps"].strip("[]").split()]
    assert len(means) == 3 and means[0] > means[1] > means[2]  # training reduces the loss
    assert "'max'" in lines["|grad w| over all steps"]
    assert lines["kept keys"] == "['grad/w', 'loss', 'refine/w']"


def test_quickstart_example():
    out = _run("quickstart.py")
    assert "logged keys: ['dpred', 'grad_norm', 'loss']" in out
    assert "500 events" in out
