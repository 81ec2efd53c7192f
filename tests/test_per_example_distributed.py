"""Issue 53's reductions across two real processes: `jax.distributed` over 127.0.0.1, 2 CPU
devices each, gloo collectives (`per_example_worker.py`). Each device logs its own events into
`Quantiles`, `TopK` (with ids and steps) and `NoiseScale`; per device and merged `across="d"`
over the 4 devices of both processes, against numpy."""

import os

import numpy as np
import pytest
from helpers import ROOT, run_two_processes
from test_quantiles import check

HERE = os.path.dirname(os.path.abspath(__file__))
QS = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)
K, DECAY = 6, 0.8  # as the worker's


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("per_example_distributed")
    worker = os.path.join(HERE, "per_example_worker.py")
    return run_two_processes(worker, out, timeout=240, PYTHONPATH=ROOT)


def test_quantiles_per_device_and_merged_across_both(results):
    for r in results:
        xs = np.asarray(r["xs"], np.float32)
        for d in range(4):  # each device's own events, on either process
            check({k: np.asarray(v)[d] for k, v in r["per"].items()}, xs[d], qs=QS)
        check(r["merged"], xs, qs=QS, what="across both processes")
        per = np.asarray(r["per_counts"])
        assert per.shape[0] == 4
        np.testing.assert_array_equal(np.asarray(r["merged_counts"]), per.sum(0))
    assert results[0]["merged"] == results[1]["merged"]


def _top(values, ids, steps):
    """numpy: the K largest of `values` (all events in order), with their ids and steps."""
    order = np.argsort(-values, kind="stable")[:K]
    return values[order], ids[order], steps[order]


def test_topk_names_each_devices_examples_and_the_best_of_all(results):
    for r in results:
        xs, ids = np.asarray(r["xs"], np.float32), np.asarray(r["ids"])
        steps = np.broadcast_to(np.arange(xs.shape[1])[:, None], xs.shape[1:])
        for d in range(4):
            value, id_, step = _top(xs[d].ravel(), ids[d].ravel(), steps.ravel())
            np.testing.assert_array_equal(np.asarray(r["top_per"]["value"])[d], value)
            np.testing.assert_array_equal(np.asarray(r["top_per"]["id"])[d], id_)
            np.testing.assert_array_equal(np.asarray(r["top_per"]["step"])[d], step)
        all_steps = np.broadcast_to(steps, xs.shape).ravel()
        value, id_, step = _top(xs.ravel(), ids.ravel(), all_steps)
        np.testing.assert_array_equal(np.asarray(r["top_merged"]["value"]), value)
        np.testing.assert_array_equal(np.asarray(r["top_merged"]["id"]), id_)
        np.testing.assert_array_equal(np.asarray(r["top_merged"]["step"]), step)
    assert results[0]["top_merged"] == results[1]["top_merged"]


def _ema(xs):
    n = len(xs)
    weights = (1 - DECAY) * DECAY ** np.arange(n - 1, -1, -1)
    return np.sum(weights * xs) / (1 - DECAY**n)


def _noise(small, big, b_small=1.0, b_big=8.0):
    grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1 / b_small - 1 / b_big)
    t, g = _ema(trace), _ema(grad_sq)
    return {"b_simple": t / g, "trace": t, "grad_sq": g}


def test_noise_scale_per_device_and_averaged_over_devices(results):
    for r in results:
        terms = np.asarray(r["terms"], np.float64)  # (device, step, [small, big])
        for d in range(4):
            want = _noise(terms[d, :, 0], terms[d, :, 1])
            for name, w in want.items():
                got = np.asarray(r["noise_per"][name])[d]
                np.testing.assert_allclose(got, w, rtol=2e-4, err_msg=f"device {d} {name}")
        # lanes="mean": the per-step terms averaged over the 4 devices of both processes
        mean = terms.mean(0)
        want = _noise(mean[:, 0], mean[:, 1])
        for name, w in want.items():
            got = np.asarray(r["noise_merged"][name])
            np.testing.assert_allclose(got, w, rtol=2e-4, err_msg=f"merged {name}")
