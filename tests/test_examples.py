"""The examples without Hydra run and print what they promise (examples/train.py, the Hydra
example, is tested by test_config.py)."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

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


def _distributed(tmp_path, name: str, *overrides: str, processes: int = 1) -> list[str]:
    """Run examples/distributed.py (as `processes` processes joined over 127.0.0.1, each
    writing into `tmp_path/<name><i>`); returns each process's stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # the example sets the CPU device count itself
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [f"train.processes={processes}", f"train.coordinator=127.0.0.1:{port}", *overrides]
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "distributed.py"), *args]
            + [f"train.process={i}", f"hydra.run.dir={tmp_path / f'{name}{i}'}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=300)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_distributed_example_one_process_and_two(tmp_path):
    from eqx_logs.loggers import read_jsonl

    (out,) = _distributed(tmp_path, "one")
    assert "4 devices in 1 process(es)" in out
    one = read_jsonl(tmp_path / "one0" / "logs.jsonl")
    norms = [r for r in one if r["key"] == "grad_norm"]
    # every 10th step (conf/logging/default), one value per device
    assert [r["step"] for r in norms] == [[s] * 4 for s in range(0, 200, 10)]
    assert all(len(r["value"]) == 4 for r in norms)
    losses = [r for r in one if r["key"] == "loss"]  # merged over the devices, per chunk
    assert [(r["count"], r["step"]) for r in losses] == [(400, 99), (400, 199)]
    assert losses[1]["value"] < losses[0]["value"]

    # the same run as two processes of 2 devices: the same records, written by process 0
    outs = _distributed(tmp_path, "two", processes=2)
    assert "4 devices in 2 process(es)" in outs[0] and "process(es)" not in outs[1]
    assert "Starting JAX distributed service on 127.0.0.1" in outs[0]  # loopback only
    two = read_jsonl(tmp_path / "two0" / "logs.jsonl")
    assert not (tmp_path / "two1" / "logs.jsonl").exists()
    assert [(r["key"], r.get("step")) for r in two] == [(r["key"], r.get("step")) for r in one]
    for a, b in zip(one, two):
        np.testing.assert_allclose(a["value"], b["value"], rtol=1e-5)
