"""A real multi-process run: two processes joined by `jax.distributed` over 127.0.0.1, 2 CPU
devices each, gloo collectives (`distributed_worker.py`). Spooled values against numpy;
every logger event written exactly once per run, read back with `read_jsonl`."""

import os

import numpy as np
import pytest
from helpers import read_tensorboard, run_two_processes

from eqx_logs.loggers import read_jsonl

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS, DEVICES = 3, 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    return out, run_two_processes(os.path.join(HERE, "distributed_worker.py"), out)


def test_spooled_values_match_numpy_on_both_processes(run):
    _, results = run
    for r in results:
        np.testing.assert_allclose(r["w"], r["want_w"], rtol=1e-5)
        # (steps, devices): each device's events, laid out over the 4 devices of 2 processes
        np.testing.assert_allclose(r["loss"], r["want_loss"], rtol=1e-5)
        np.testing.assert_allclose(r["grad_norm"], r["want_grad_norm"], rtol=1e-5)
        assert r["count"] == [STEPS] * DEVICES
        # merged over the devices of both processes on device
        np.testing.assert_allclose(r["mean_loss"], np.mean(r["want_loss"]), rtol=1e-5)
    assert results[0]["loss"] == results[1]["loss"]


def test_spooled_logs_are_written_once_by_process_0(run):
    out, results = run
    want = results[0]
    assert sorted(os.listdir(out)) == sorted(
        [
            "every.process0.jsonl",
            "every.process1.jsonl",
            "result0.json",
            "result1.json",
            "spool.jsonl",
            "tap.jsonl",
            "tap.process1.jsonl",
            "tb",
        ]
    )
    records = read_jsonl(out / "spool.jsonl")
    merged = [r for r in records if r["run"] == 0]  # jit, across="d", reduce="mean"
    assert sorted(r["key"] for r in merged) == ["grad_norm", "loss"]
    loss = next(r for r in merged if r["key"] == "loss")
    np.testing.assert_allclose(loss["value"], np.mean(want["want_loss"]), rtol=1e-5)
    stacked = [r for r in records if r["run"] == 1 and r["key"] == "grad_norm"]  # eager
    assert len(stacked) == STEPS  # one record per step, each with the 4 devices' values
    np.testing.assert_allclose([r["value"] for r in stacked], want["want_grad_norm"], rtol=1e-5)
    # logger.jit: its logs are arrays of both processes' devices; process 0 writes them once
    jitted = [{k: v for k, v in r.items() if k != "run"} for r in records if r["run"] == 2]
    assert jitted == [{k: v for k, v in r.items() if k != "run"} for r in records if r["run"] == 1]


def test_every_process_writes_its_own_copy(run):
    out, results = run
    for i in range(2):
        records = read_jsonl(out / f"every.process{i}.jsonl")
        norms = [r["value"] for r in records if r["key"] == "grad_norm"]
        np.testing.assert_allclose(norms, results[0]["want_grad_norm"], rtol=1e-5)


def test_tensorboard_runs_per_process_read_back_with_tensorboard(run):
    out, results = run
    assert sorted(os.listdir(out / "tb")) == ["run_0", "run_0.process1"]
    want = np.asarray(results[0]["want_loss"])  # (steps, devices)
    for run_dir, devices in (("run_0", [0, 1]), ("run_0.process1", [2, 3])):
        scalars, _ = read_tensorboard(out / "tb" / run_dir)
        got = sorted(value for _, value in scalars["loss"])
        np.testing.assert_allclose(got, np.sort(want[:, devices].ravel()), rtol=1e-5)


def test_tapped_events_inside_shard_map_reach_each_devices_process_once(run):
    out, results = run
    seen = {}
    for name, devices in (("tap.jsonl", {0, 1}), ("tap.process1.jsonl", {2, 3})):
        for r in read_jsonl(out / name):
            assert r["d"] in devices  # written by the process that holds the device
            seen.setdefault((r["key"], r["d"]), []).append(r["value"])
    assert sorted(seen) == [(k, d) for k in ("grad_norm", "loss") for d in range(DEVICES)]
    want = np.asarray(results[0]["want_grad_norm"])  # (steps, devices)
    for d in range(DEVICES):
        np.testing.assert_allclose(seen[("grad_norm", d)], want[:, d], rtol=1e-5)
