"""Every logger backend, end to end: events written through `logger.spool` and `logger.tap`
(called inside `jax.jit`, inside a `lax.scan` over epochs, under `jax.vmap` over logger
states) are read back with the backend's own library (json, numpy, tensorboard's
EventAccumulator, W&B's record protobufs, the MLflow client) and compared with a numpy
reference computed independently of eqx_logs. Also: the background writer (errors surface on
the next call, close drains everything), appending to existing runs, key sanitization,
MultiLogger, ProgressLogger and ConsoleLogger output.

Loggers write on a background thread, so every test closes (or flushes) before reading."""

import functools
import logging
import math
import os
import re
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FIRST,
    FULL,
    LAST,
    MIDDLE,
    WANDB_BLOCK,
    check_aligned,
    read_tensorboard,
    read_wandb,
    run_training,
    wandb_payloads,
    write_leveldb_log,
)
from jax import lax

import eqx_logs
from eqx_logs.loggers import (
    AbstractLogger,
    ArrayLogger,
    ConsoleLogger,
    JsonlLogger,
    MLflowLogger,
    MultiLogger,
    ProgressLogger,
    TensorBoardLogger,
    WandbLogger,
    WriterError,
    WriterWarning,
    read_arrays,
    read_jsonl,
    unique_name,
)

RUNS, EPOCHS, T = 3, 2, 4  # 3 runs (vmap over states), 2 epochs (outer scan) of 4 steps
NAN_LOSS_STEP = 5
XS = np.random.default_rng(0).normal(size=(RUNS, EPOCHS, T)).astype(np.float32)
MODES = ["spool", "tap"]

# --- the program and its numpy reference --------------------------------------------------


def program(xs, start, data_cond):
    """One epoch: a scan over `xs` (shape (T,)) at steps start, start+1, ... Per step t:
    "loss" (a scalar, NaN at step 5), "vec" (5 entries, a NaN when t % 3 == 1 and a -inf
    when t % 3 == 2), "dead" (2 entries, all NaN when t % 4 == 0), "tree" (a pytree with an
    int leaf); "odd" = -x only at odd steps (a cond on the step), "tick", an event with no
    value, where t % 3 == 0 (written as the number of its events at the step: 1), and with
    `data_cond` "pos" = x only where x > 0 (a cond on the data, so batched under vmap)."""

    def step(t, x):
        vec = jnp.stack(
            [
                x,
                -2.0 * x,
                x * t.astype(x.dtype),
                jnp.where(t % 3 == 1, jnp.nan, x),
                jnp.where(t % 3 == 2, -jnp.inf, 0.5),
            ]
        )
        eqx_logs.log(
            {
                "loss": jnp.where(t == NAN_LOSS_STEP, jnp.nan, x * x),
                "vec": vec,
                "dead": jnp.where(t % 4 == 0, jnp.nan, x) * jnp.ones(2),
                "tree": {"a": x + 1.0, "b": (2.0 * x, t)},
            },
            step=t,
        )
        lax.cond(t % 2 == 1, lambda: eqx_logs.log("odd", -x, step=t), lambda: None)
        lax.cond(t % 3 == 0, lambda: eqx_logs.log("tick", (), step=t), lambda: None)
        if data_cond:
            lax.cond(x > 0, lambda: eqx_logs.log("pos", x, step=t), lambda: None)
        return t + 1, None

    return lax.scan(step, start, xs)[0]


def reference(xs_run: np.ndarray, data_cond: bool) -> list[tuple[str, int, Any]]:
    """The events of one run, in execution order: (key, step, value), in numpy."""
    events = []
    for t, x in enumerate(np.asarray(xs_run, np.float32).reshape(-1)):
        f = np.float32
        vec = np.array(
            [x, f(-2.0) * x, x * f(t), np.nan if t % 3 == 1 else x, -np.inf if t % 3 == 2 else 0.5],
            np.float32,
        )
        events += [
            ("loss", t, f(np.nan) if t == NAN_LOSS_STEP else x * x),
            ("vec", t, vec),
            ("dead", t, np.full(2, np.nan if t % 4 == 0 else x, np.float32)),
            ("tree", t, {"a": x + f(1.0), "b": (f(2.0) * x, np.int32(t))}),
        ]
        if t % 2 == 1:
            events.append(("odd", t, -x))
        if t % 3 == 0:
            events.append(("tick", t, np.int32(1)))
        if data_cond and x > 0:
            events.append(("pos", t, x))
    return events


def drive(logger: AbstractLogger, mode: str, xs=XS, runs=None) -> None:
    """`logger.spool` or `logger.tap` of `program`, called in an outer scan over epochs, under
    `jax.vmap` over states for runs 0..len(xs)-1 (or `runs`), all inside `jax.jit`."""
    runs = jnp.arange(len(xs)) if runs is None else jnp.asarray(runs)
    states = jax.vmap(logger.init)(runs)
    fun = functools.partial(program, data_cond=True)

    def one_run(state, xs):
        wrapped = getattr(logger, mode)(fun, state)
        return lax.scan(lambda start, xs_e: (wrapped(xs_e, start), None), jnp.int32(0), xs)[0]

    xs = jnp.asarray(xs)
    last = jax.jit(jax.vmap(one_run))(states, xs)
    assert np.all(np.asarray(last) == xs.shape[1] * xs.shape[2])


def flat(key: str, value: Any):
    """(tag, leaf) pairs of a pytree value: `{"a": x, "b": (y, z)}` under "k" gives k/a,
    k/b/0, k/b/1."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from flat(f"{key}/{k}", v)
    elif isinstance(value, tuple):
        for i, v in enumerate(value):
            yield from flat(f"{key}/{i}", v)
    else:
        yield key, np.asarray(value)


def reference_series(events) -> dict[str, list[tuple[int, np.ndarray]]]:
    out = defaultdict(list)
    for key, step, value in events:
        for tag, leaf in flat(key, value):
            out[tag].append((step, leaf))
    return dict(out)


def close(got, want, what) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, equal_nan=True, err_msg=what)


def compare_series(got: dict, want: dict, what: str, compare=close) -> None:
    assert sorted(got) == sorted(want), f"{what}: tags {sorted(got)} != {sorted(want)}"
    for tag in want:
        got_steps = [s for s, _ in got[tag]]
        want_steps = [s for s, _ in want[tag]]
        assert got_steps == want_steps, f"{what} {tag}: steps {got_steps} != {want_steps}"
        for (step, g), (_, w) in zip(got[tag], want[tag]):
            compare(g, w, f"{what} {tag} at step {step}")


def want_events(run: int, mode: str):
    return reference(XS[run], data_cond=True)


# --- JsonlLogger ------------------------------------------------------------------------------


def json_ref(v: Any) -> Any:
    """What `read_jsonl` should give for a numpy reference value (non-finite floats as
    floats: the file spells them as strings, the reader turns them back)."""
    if isinstance(v, dict):
        return {k: json_ref(x) for k, x in v.items()}
    if isinstance(v, tuple | list):
        return [json_ref(x) for x in v]
    a = np.asarray(v)
    if a.ndim:
        return [json_ref(x) for x in a]
    if a.dtype == bool:
        return bool(a)
    if np.issubdtype(a.dtype, np.integer):
        return int(a)
    return float(a)


def assert_json_close(got, want, what) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{what}: {got!r}"
        for k in want:
            assert_json_close(got[k], want[k], f"{what}/{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{what}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_json_close(g, w, f"{what}/{i}")
    elif isinstance(want, str | bool | int):
        assert type(got) is type(want) and got == want, f"{what}: {got!r} != {want!r}"
    else:
        same = math.isclose(got, want, rel_tol=1e-6) or (math.isnan(got) and math.isnan(want))
        assert type(got) is float and same, f"{what}: {got!r} != {want!r}"


@pytest.mark.parametrize("mode", MODES)
def test_jsonl(tmp_path, mode):
    path = tmp_path / "logs.jsonl"
    with JsonlLogger(path) as logger:
        drive(logger, mode)
    rows = read_jsonl(path)
    assert {r["run"] for r in rows} == set(range(RUNS))
    for run in range(RUNS):
        mine = [r for r in rows if r["run"] == run]
        assert all(set(r) == {"run", "key", "value", "step"} for r in mine)
        steps = [r["step"] for r in mine]
        if mode == "tap":  # written as they happen: steps never go back within a run
            assert steps == sorted(steps)
        want = defaultdict(list)
        for key, step, value in want_events(run, mode):
            want[key].append((step, json_ref(value)))
        got = defaultdict(list)
        for r in mine:
            got[r["key"]].append((r["step"], r["value"]))
        compare_series(got, want, f"run {run}", assert_json_close)


# --- ArrayLogger --------------------------------------------------------------------------------


def read_array_series(path, run) -> dict[str, list[tuple[int, np.ndarray]]]:
    out = {}
    for key, events in read_arrays(path, run).items():
        for event in events:
            step = int(event["step/step"])
            for name, value in event.items():
                if name.startswith("value"):
                    out.setdefault(key + name[len("value") :], []).append((step, value))
    return out


def exact(got, want, what) -> None:
    """Same dtype and shape, equal values (NaN equal to NaN)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got!r} != {want!r}"
    np.testing.assert_array_equal(got, want, err_msg=what)


@pytest.mark.parametrize("mode", MODES)
def test_array_logger(tmp_path, mode):
    path = tmp_path / "arrays"
    with ArrayLogger(path) as logger:
        drive(logger, mode)
    assert sorted(os.listdir(path)) == [f"run_{r}" for r in range(RUNS)]
    for run in range(RUNS):
        want = reference_series(want_events(run, mode))
        compare_series(read_array_series(path, run), want, f"run {run}", exact)
    # one file per event, numbered from 0 in order
    files = sorted(os.listdir(path / "run_0" / "vec"))
    assert files == [f"{i:06d}.npz" for i in range(EPOCHS * T)]


def test_read_arrays_never_unpickles(tmp_path):
    folder = tmp_path / "run_0" / "evil"
    folder.mkdir(parents=True)
    with open(folder / "000000.npz", "wb") as f:
        np.savez(f, __key__=np.asarray("evil"), value=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        read_arrays(tmp_path)


def test_read_arrays_of_runs_without_events(tmp_path):
    """A run the logger wrote nothing to reads back as `{}` (as lox's test of saving empty
    logs expects): empty logs, a spooled call that logged nothing, and, beside a run that was
    written, a tapped call that logged nothing. A directory that does not exist is named,
    and so is the directory of a logger that was never called: it leaves nothing on disk."""
    path = tmp_path / "arrays"
    with ArrayLogger(path) as logger:
        logger.write(eqx_logs.LogDict({}))  # run 0
        logger.spool(lambda x: x + 1, logger.init(1))(jnp.float32(1.0))
        one = eqx_logs.LogDict({"a": np.float32(5.0)}, count={"a": np.int32(1)})
        logger.write(one, logger.init(2))
        logger.tap(lambda x: x + 1, logger.init(3))(jnp.float32(1.0))
    assert sorted(os.listdir(path)) == ["run_0", "run_1", "run_2"]
    assert read_arrays(path) == {} and read_arrays(path, 1) == {} and read_arrays(path, 3) == {}
    (event,) = read_arrays(path, 2)["a"]
    assert event["value"] == np.float32(5.0)

    with ArrayLogger(tmp_path / "never"):
        pass
    for missing in [tmp_path / "never", tmp_path / "nope" / "arrays"]:
        assert not missing.exists()
        with pytest.raises(FileNotFoundError, match=re.escape(f"{missing}: no such directory")):
            read_arrays(missing)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(NotADirectoryError, match=re.escape(f"{tmp_path / 'file'}: not a dir")):
        read_arrays(tmp_path / "file")


# --- TensorBoardLogger -------------------------------------------------------------------------


def finite_of(leaf: np.ndarray) -> np.ndarray:
    return leaf[np.isfinite(leaf)].astype(np.float64)


def tensorboard_reference(events) -> tuple[dict, dict, dict]:
    """Scalars and histograms of `run_<r>`, and the non-finite counts of `run_<r>/nonfinite`."""
    scalars, histograms, nonfinite = defaultdict(list), defaultdict(list), defaultdict(list)
    for tag, series in reference_series(events).items():
        for step, leaf in series:
            if leaf.size == 1:
                scalars[tag].append((step, float(leaf)))
                continue
            finite = finite_of(leaf)
            if finite.size:
                summary = (finite.min(), finite.max(), finite.size, finite.sum(), (finite**2).sum())
                histograms[tag].append((step, summary))
            if finite.size < leaf.size:
                nonfinite[tag].append((step, leaf.size - finite.size))
    return dict(scalars), dict(histograms), dict(nonfinite)


@pytest.mark.parametrize("mode", MODES)
def test_tensorboard(tmp_path, mode):
    with TensorBoardLogger(tmp_path / "tb") as logger:
        drive(logger, mode)
    assert sorted(os.listdir(tmp_path / "tb")) == [f"run_{r}" for r in range(RUNS)]
    for run in range(RUNS):
        scalars, histograms = read_tensorboard(tmp_path / "tb" / f"run_{run}")
        nonfinite, _ = read_tensorboard(tmp_path / "tb" / f"run_{run}" / "nonfinite")
        want_scalars, want_histograms, want_nonfinite = tensorboard_reference(
            want_events(run, mode)
        )
        assert "dead" in want_histograms and "dead" in want_nonfinite  # preconditions
        compare_series(scalars, want_scalars, f"run {run} scalars")
        compare_series(histograms, want_histograms, f"run {run} histograms")
        compare_series(nonfinite, want_nonfinite, f"run {run} non-finite counts")


def test_tensorboard_a_later_logger_sorts_later(tmp_path):
    """TensorBoard reads a run's event files in name order: a logger opened on a logdir
    right after another (within the same second, in the same process) must name its file
    after the other's, so that its events come after the other's. Three loggers one after
    the other, twenty times, each time in a fresh logdir (names that tie on the second and
    end in a random suffix put them out of order most of the time)."""

    for pair in range(20):
        logdir = tmp_path / f"pair{pair}"
        for values in ([0.0, 1.0], [10.0, 11.0], [20.0]):  # each from step 0 (a counter)
            with TensorBoardLogger(logdir) as logger:
                for v in values:
                    logger.write(eqx_logs.LogDict({"x": np.float32(v)}, count={"x": 1}))
        files = sorted(os.listdir(logdir / "run_0"))
        assert len(files) == 3 and all(f.startswith("events.out.tfevents.") for f in files)
        scalars, _ = read_tensorboard(logdir / "run_0")
        assert scalars == {"x": [(0, 0.0), (1, 1.0), (0, 10.0), (1, 11.0), (0, 20.0)]}, files


def test_tensorboard_sorts_after_other_writers(tmp_path):
    """After another writer's event file of this second (tensorboardX's own `SummaryWriter`,
    named `<seconds>.<host>`), or of a later second (a clock set back), a logger's file still
    sorts last."""
    from tensorboardX import SummaryWriter

    for ahead in [0, 1000]:
        run = tmp_path / f"ahead{ahead}" / "run_0"
        with SummaryWriter(os.fspath(run)) as other:
            other.add_scalar("x", -1.0, 0)
        (name,) = os.listdir(run)
        stamp = int(name.split(".")[3])
        os.rename(run / name, run / name.replace(str(stamp), str(stamp + ahead)))
        for v in [1.0, 2.0]:
            with TensorBoardLogger(run.parent) as logger:
                logger.write(eqx_logs.LogDict({"x": np.float32(v)}, count={"x": 1}))
        files = sorted(os.listdir(run))
        assert files[0].startswith(f"events.out.tfevents.{stamp + ahead}."), files
        assert read_tensorboard(run)[0] == {"x": [(0, -1.0), (0, 1.0), (0, 2.0)]}, files


def test_tensorboard_counter_steps_without_a_step(tmp_path):
    """Events logged without `step=` are placed at a per-tag counter: 0, 1, 2, ..."""

    def f(xs):
        def body(c, x):
            eqx_logs.log("a", x)
            lax.cond(x > 1, lambda: eqx_logs.log("b", 2 * x), lambda: None)
            return c, None

        return lax.scan(body, 0.0, xs)[0]

    xs = np.array([0.0, 2.0, 1.0, 3.0, 5.0], np.float32)
    with TensorBoardLogger(tmp_path) as logger:
        state = logger.init()
        logger.tap(f, state)(xs)
        logger.spool(f, state)(xs)  # appended after the tapped events
    scalars, _ = read_tensorboard(tmp_path / "run_0")
    big = 2 * xs[xs > 1]
    want = {
        "a": list(enumerate(np.concatenate([xs, xs]))),
        "b": list(enumerate(np.concatenate([big, big]))),
    }
    compare_series(scalars, want, "counters")


# --- WandbLogger ------------------------------------------------------------------------------


def wandb_runs(root) -> dict[str, dict]:
    """Every offline run under `root`, by display name."""
    runs = {}
    for file in sorted(Path(root).glob("wandb/offline-run-*/run-*.wandb")):
        run = read_wandb(file)
        assert run["name"] not in runs, f"two runs named {run['name']}"
        runs[run["name"]] = run
    return runs


def wandb_series(history: list[dict]) -> dict[str, list[tuple[int, Any]]]:
    """tag -> [(step, value)]: numbers as they are, histograms as (counts, bin edges)."""
    out = defaultdict(list)
    for row in history:
        step = row["_step"]
        hists = {n[: -len("/_type")] for n, v in row.items() if n.endswith("/_type")}
        assert all(row[f"{h}/_type"] == "histogram" for h in hists)
        for name, value in row.items():
            if name.startswith("_"):
                continue
            tag, _, field = name.rpartition("/")
            if tag in hists:
                if field == "values":
                    out[tag].append((step, (row[f"{tag}/values"], row[f"{tag}/bins"])))
            else:
                out[name].append((step, value))
    return dict(out)


def wandb_reference(events) -> dict:
    out = {}
    for tag, series in reference_series(events).items():
        out[tag] = [
            (s, leaf if leaf.size == 1 else np.histogram(finite_of(leaf), bins=64))
            for s, leaf in series
        ]
    return out


def wandb_compare(got, want, what) -> None:
    if isinstance(want, tuple):
        np.testing.assert_array_equal(got[0], want[0], err_msg=f"{what} counts")
        np.testing.assert_allclose(got[1], want[1], rtol=1e-9, err_msg=f"{what} bins")
    elif np.asarray(want).dtype == np.int32:
        assert type(got) is int and got == int(want), f"{what}: {got!r} != {want!r}"
    else:
        close(got, want, what)


@pytest.mark.parametrize("mode", MODES)
def test_wandb(wandb_env, mode):
    with WandbLogger(name="grp", dir=os.fspath(wandb_env)) as logger:
        drive(logger, mode)
    runs = wandb_runs(wandb_env)
    assert sorted(runs) == [f"grp-{r}" for r in range(RUNS)]
    for run in range(RUNS):
        got = runs[f"grp-{run}"]
        assert got["group"] == "grp"
        assert [row["_step"] for row in got["history"]] == list(range(EPOCHS * T))
        want = wandb_reference(want_events(run, mode))
        compare_series(wandb_series(got["history"]), want, f"run {run}", wandb_compare)


def test_wandb_reader_crosses_block_boundaries(wandb_env):
    """A run whose file spans several 32 KiB blocks, with history rows (a pytree of 400
    leaves with long names) longer than two blocks: the reader reassembles them and finds
    every row."""
    n, leaves = 4, 400
    names = [f"{i:04d}" + "p" * 200 for i in range(leaves)]

    def f(xs):
        def body(c, x):
            eqx_logs.log({"x": x, "w": {k: x + i for i, k in enumerate(names)}}, step=c)
            return c + 1, None

        return lax.scan(body, 0, xs)[0]

    xs = np.arange(n, dtype=np.float32) / 7
    logger = WandbLogger(name="big", dir=os.fspath(wandb_env), config={"lr": 0.5})
    with logger:
        logger.tap(f, logger.init())(xs)
    (file,) = Path(wandb_env).glob("wandb/offline-run-*/run-*.wandb")
    assert file.stat().st_size > 3 * WANDB_BLOCK
    fragments = {}
    run = read_wandb(file, fragments)
    assert fragments.get(FIRST, 0) >= n and fragments.get(MIDDLE, 0) >= 1
    assert fragments[LAST] == fragments[FIRST] and fragments[FULL] > n
    assert run["name"] == "big-0" and run["group"] == "big"
    assert run["config"]["lr"] == 0.5
    assert [r["_step"] for r in run["history"]] == list(range(n))
    for row, x in zip(run["history"], xs):
        assert row["x"] == float(x)
        got = [row[f"w/{k}"] for k in names]
        close(got, x + np.arange(leaves, dtype=np.float32), "w")


@pytest.mark.parametrize("sizes", [[1, 2, 3], [WANDB_BLOCK - 7 - 7 - 3, 5, 1], [70000, 0, 40000]])
def test_leveldb_reader_on_chosen_boundaries(tmp_path, sizes):
    """Payloads that end 1..6 bytes before a block boundary (padding), fill a block exactly,
    are empty, or span several blocks come back intact."""
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    payloads = [rng.integers(0, 256, size=s, dtype=np.uint8).tobytes() for s in sizes]
    payloads += [b"x" * (WANDB_BLOCK - 7 - 7), b"tail"]
    file = tmp_path / "log.wandb"
    file.write_bytes(write_leveldb_log(payloads))
    assert wandb_payloads(file) == payloads


def test_leveldb_reader_rejects_a_bad_checksum(tmp_path):
    data = bytearray(write_leveldb_log([b"hello", b"world"]))
    data[-1] ^= 1
    file = tmp_path / "log.wandb"
    file.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="checksum"):
        wandb_payloads(file)


# --- MLflowLogger ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory):
    """One tracking database for the module (creating one takes seconds); every test uses its
    own experiment, whose artifacts go to that test's directory."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"


@pytest.fixture
def mlflow_experiment(mlflow_db, tmp_path, monkeypatch, request):
    import mlflow

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    name = re.sub(r"\W", "_", request.node.name)
    client = mlflow.MlflowClient(mlflow_db)
    client.create_experiment(name, artifact_location=(tmp_path / "artifacts").as_uri())
    return mlflow_db, name


def read_mlflow(uri, experiment, tmp_path) -> dict[str, dict]:
    """run name -> {"status", "metrics": tag -> [(step, value)], "arrays": tag -> [(step,
    array)]} read with the MLflow client."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    out = {}
    for run in client.search_runs([exp.experiment_id]):
        run_id = run.info.run_id
        metrics = {}
        for tag in run.data.metrics:
            history = client.get_metric_history(run_id, tag)
            metrics[tag] = sorted((m.step, m.value) for m in history)
        arrays = {}
        if client.list_artifacts(run_id, "arrays"):
            local = Path(client.download_artifacts(run_id, "arrays", os.fspath(tmp_path)))
            for folder in sorted(local.iterdir()):
                files = sorted(folder.glob("*.npy"), key=lambda p: int(p.stem))
                arrays[folder.name] = [(int(p.stem), np.load(p, allow_pickle=False)) for p in files]
        assert run.info.run_name not in out
        out[run.info.run_name] = {"status": run.info.status, "metrics": metrics, "arrays": arrays}
    return out


def mlflow_reference(events) -> tuple[dict, dict]:
    metrics, arrays = {}, {}
    for tag, series in reference_series(events).items():
        if series[0][1].size == 1:
            metrics[tag] = [(s, float(leaf)) for s, leaf in series]
        else:
            arrays[tag] = series
    return metrics, arrays


@pytest.mark.parametrize("mode", MODES)
def test_mlflow(mlflow_experiment, tmp_path, mode):
    uri, experiment = mlflow_experiment
    with MLflowLogger(uri, experiment=experiment, run_name="r") as logger:
        drive(logger, mode)
    runs = read_mlflow(uri, experiment, tmp_path / "download")
    assert sorted(runs) == [f"r-{r}" for r in range(RUNS)]
    for run in range(RUNS):
        got = runs[f"r-{run}"]
        assert got["status"] == "FINISHED"
        metrics, arrays = mlflow_reference(want_events(run, mode))
        compare_series(got["metrics"], metrics, f"run {run} metrics")
        compare_series(got["arrays"], arrays, f"run {run} arrays", exact)
    assert not (tmp_path / "mlruns").exists()


# --- bfloat16 values (common in JAX) ---------------------------------------------------------


def bf16_program(x):
    eqx_logs.log({"s": x.astype(jnp.bfloat16), "v": jnp.stack([x, jnp.nan]).astype(jnp.bfloat16)})


def test_tensorboard_bfloat16(tmp_path):
    with TensorBoardLogger(tmp_path) as logger:
        logger.spool(bf16_program, logger.init())(jnp.float32(1.5))
    scalars, histograms = read_tensorboard(tmp_path / "run_0")
    assert scalars == {"s": [(0, 1.5)]}
    assert histograms == {"v": [(0, (1.5, 1.5, 1.0, 1.5, 2.25))]}
    assert read_tensorboard(tmp_path / "run_0" / "nonfinite")[0] == {"v": [(0, 1.0)]}


def test_wandb_bfloat16(wandb_env):
    with WandbLogger(dir=os.fspath(wandb_env)) as logger:
        logger.spool(bf16_program, logger.init())(jnp.float32(1.5))
    (run,) = wandb_runs(wandb_env).values()
    assert run["history"][0]["s"] == 1.5


def test_mlflow_bfloat16(mlflow_experiment, tmp_path):
    uri, experiment = mlflow_experiment
    with MLflowLogger(uri, experiment=experiment) as logger:
        logger.spool(bf16_program, logger.init())(jnp.float32(1.5))
    (run,) = read_mlflow(uri, experiment, tmp_path / "download").values()
    assert run["metrics"] == {"s": [(0, 1.5)]}


def test_array_logger_bfloat16(tmp_path):
    with ArrayLogger(tmp_path) as logger:
        logger.spool(bf16_program, logger.init())(jnp.float32(1.5))
    got = read_arrays(tmp_path)
    np.testing.assert_array_equal(got["s"][0]["value"].astype(np.float32), 1.5)


def test_jsonl_bfloat16(tmp_path):
    with JsonlLogger(tmp_path / "l.jsonl") as logger:
        logger.spool(bf16_program, logger.init())(jnp.float32(1.5))
    rows = read_jsonl(tmp_path / "l.jsonl")
    assert [(r["key"], r["value"]) for r in rows] == [
        ("s", 1.5),
        ("v", [1.5, pytest.approx(np.nan, nan_ok=True)]),
    ]


# --- runs: init, vmap over keys, tap under vmap --------------------------------------------


def test_init_runs(tmp_path):
    logger = JsonlLogger(tmp_path / "l.jsonl")
    assert int(logger.init().run) == 0 and int(logger.init(7).run) == 7
    a, b = logger.init(jax.random.key(1)), logger.init(jax.random.key(1))
    assert int(a.run) == int(b.run) >= 0
    keys = jax.random.split(jax.random.key(0), 3)
    states = jax.vmap(logger.init)(keys)
    runs = [int(r) for r in states.run]
    assert len(set(runs)) == 3  # distinct with overwhelming probability
    assert runs == [int(logger.init(k).run) for k in keys]
    with logger:
        drive(logger, "spool", XS, runs=states.run)
    got = {r["run"] for r in read_jsonl(tmp_path / "l.jsonl")}
    assert got == set(runs)
    with pytest.raises(TypeError, match="logger.init"):
        logger.init(jnp.zeros(3))


def test_tap_under_vmap_writes_conditional_events_only_in_their_lane(tmp_path):
    def f(x):
        lax.cond(x > 0, lambda: eqx_logs.log("pos", x), lambda: None)

    with JsonlLogger(tmp_path / "l.jsonl") as logger:
        states = jax.vmap(logger.init)(jnp.arange(3))
        jax.vmap(lambda s, x: logger.tap(f, s)(x))(states, jnp.array([1.0, -1.0, 2.0]))
    got = sorted((r["run"], r["value"]) for r in read_jsonl(tmp_path / "l.jsonl"))
    assert got == [(0, 1.0), (2, 2.0)]


def test_tap_under_vmap_writes_while_events_only_while_the_lane_runs(tmp_path):
    """A while loop with a batched predicate runs its body for every lane until all are done;
    each run gets the events of its own iterations only (cond_fun's logs included)."""

    def f(n):
        def cond(i):
            eqx_logs.log("test", i)
            return i < n

        def body(i):
            eqx_logs.log("i", i)
            return i + 1

        return lax.while_loop(cond, body, 0)

    ns = np.array([1, 3, 0, 2])
    with JsonlLogger(tmp_path / "l.jsonl") as logger:
        states = jax.vmap(logger.init)(jnp.arange(4))
        out = jax.vmap(lambda s, n: logger.tap(f, s)(n))(states, jnp.asarray(ns))
    np.testing.assert_array_equal(np.asarray(out), ns)
    rows = read_jsonl(tmp_path / "l.jsonl")
    for run, n in enumerate(ns):
        mine = [(r["key"], r["value"]) for r in rows if r["run"] == run]
        want = [("test", 0)]
        for i in range(n):
            want += [("i", i), ("test", i + 1)]
        assert mine == want, run


def test_tap_of_jit_twice_writes_each_event_twice(tmp_path):
    def f(xs):
        def body(c, x):
            eqx_logs.log("x", x, step=c)
            return c + 1, None

        return lax.scan(body, 0, xs)[0]

    xs = np.arange(3.0, dtype=np.float32)
    with JsonlLogger(tmp_path / "l.jsonl") as logger:
        state = logger.init()
        tapped = logger.tap(jax.jit(f), state)
        tapped(xs)
        tapped(xs + 10)
        jitted = jax.jit(logger.tap(f, state))
        jitted(xs + 20)
        jitted(xs + 30)
    got = [(r["step"], r["value"]) for r in read_jsonl(tmp_path / "l.jsonl")]
    want = [(i, float(x + off)) for off in (0, 10, 20, 30) for i, x in enumerate(xs)]
    assert got == want


def test_tap_interval_under_vmap(tmp_path):
    """interval=k writes events 0, k, 2k, ... of each key, in every run."""

    def f(xs):
        def body(c, x):
            eqx_logs.log("x", x, step=c)
            return c + 1, None

        return lax.scan(body, 0, xs)[0]

    xs = np.arange(14.0, dtype=np.float32).reshape(2, 7)
    with JsonlLogger(tmp_path / "l.jsonl") as logger:
        states = jax.vmap(logger.init)(jnp.arange(2))
        jax.jit(jax.vmap(lambda s, x: logger.tap(f, s, interval=3)(x)))(states, xs)
    rows = read_jsonl(tmp_path / "l.jsonl")
    for run in range(2):
        got = [(r["step"], r["value"]) for r in rows if r["run"] == run]
        assert got == [(i, float(xs[run, i])) for i in (0, 3, 6)]


# --- the writer: errors, draining on close ------------------------------------------------


class Box:
    """A mutable holder, hashable by identity (so a logger holding it can be jit-static);
    with `gate`, the writer waits for `gate.set()` before opening a run."""

    def __init__(self, gate: threading.Event | None = None):
        self.items: list = []
        self.gate = gate


class Failing(AbstractLogger):
    """Records written values in `box.items`; raises on a record whose value is `bad`;
    `box.items` also gets ("open", run) and ("close", run) entries."""

    box: Box = eqx.field(static=True)
    bad: float = 2.0

    def _open(self, run):
        if self.box.gate is not None:
            assert self.box.gate.wait(30)
        self.box.items.append(("open", run))
        return run

    def _write(self, handle, run, records):
        for r in records:
            value = float(np.asarray(r["value"]))
            if value == self.bad:
                raise ValueError(f"cannot write {value}")
            self.box.items.append(value)

    def _close(self, handle):
        self.box.items.append(("close", handle))


def scan_log(xs):
    def body(c, x):
        eqx_logs.log("x", x, step=c)
        return c + 1, None

    return lax.scan(body, 0, xs)[0]


def written(box) -> list[float]:
    return [v for v in box.items if not isinstance(v, tuple)]


def wait_for_writer(logger, box=None):
    """Open `box`'s gate, then wait until the writer thread has handled everything, without
    raising its error (as `flush` would): the error should come from the next call.

    The failing calls run with the gate closed (the writer blocked before its first write), so
    that the error cannot already be raised by the host callback of the very call that causes
    it (which checks for errors right after submitting its write)."""
    jax.effects_barrier()
    if box is not None:
        box.gate.set()
    logger._sink.writer._wait()


@pytest.mark.parametrize("surface", ["spool", "tap", "write", "flush", "close"])
def test_writer_error_surfaces_on_the_next_call(surface):
    box = Box(gate=threading.Event())
    logger = Failing(box)
    state = logger.init()
    logger.spool(scan_log, state)(np.array([0.0, 1.0], np.float32))
    logger.spool(scan_log, state)(np.array([2.0, 3.0], np.float32))  # fails at 2.0
    wait_for_writer(logger, box)
    assert written(box) == [0.0, 1.0]
    calls = {
        "spool": lambda: logger.spool(scan_log, state)(np.array([9.0], np.float32)),
        "tap": lambda: logger.tap(scan_log, state)(np.array([9.0], np.float32)),
        "write": lambda: logger.write(eqx_logs.spool(scan_log)(np.array([9.0], np.float32))[1]),
        "flush": logger.flush,
        "close": logger.close,
    }
    with pytest.raises(WriterError, match="Failing failed while writing") as info:
        calls[surface]()
    assert isinstance(info.value.__cause__, ValueError)
    assert "cannot write 2.0" in str(info.value)
    logger.flush()  # raised once only
    assert 9.0 not in written(box)  # the refused call wrote nothing
    # afterwards the logger works again
    logger.tap(scan_log, state)(np.array([4.0, 5.0], np.float32))
    logger.close()
    assert written(box) == [0.0, 1.0, 4.0, 5.0]


def test_writer_error_surfaces_from_the_next_jitted_call():
    """Inside jit the wrapper's Python code does not run again: the next host callback raises
    the error (as JAX's runtime error naming the WriterError); that call's write is skipped and
    counted; the logger works again afterwards."""
    box = Box(gate=threading.Event())
    logger = Failing(box)
    step = jax.jit(logger.spool(scan_log, logger.init()))
    step(np.array([1.0, 2.0, 3.0], np.float32))  # fails at 2.0 (after writing 1.0)
    wait_for_writer(logger, box)
    with pytest.raises(jax.errors.JaxRuntimeError, match="WriterError") as info:
        step(np.array([4.0, 5.0, 6.0], np.float32))
        jax.effects_barrier()
    assert "cannot write 2.0" in str(info.value)
    assert "1 later write(s) were skipped" in str(info.value)
    logger.flush()  # raised once only
    step(np.array([7.0, 8.0, 9.0], np.float32))
    tapped = jax.jit(logger.tap(scan_log, logger.init()))
    tapped(np.array([10.0], np.float32))
    logger.close()
    assert written(box) == [1.0, 7.0, 8.0, 9.0, 10.0]


def test_writer_error_surfaces_from_the_next_jitted_tap():
    box = Box(gate=threading.Event())
    logger = Failing(box)
    tapped = jax.jit(logger.tap(scan_log, logger.init()))
    tapped(np.array([1.0, 2.0], np.float32))
    wait_for_writer(logger, box)
    with pytest.raises(jax.errors.JaxRuntimeError, match="cannot write 2.0"):
        tapped(np.array([3.0, 4.0], np.float32))
        jax.effects_barrier()
    tapped(np.array([5.0, 6.0], np.float32))
    logger.close()
    # 3.0 raised; 4.0 comes from a later callback of the same call: skipped or written,
    # depending on whether JAX stops at the first failing callback
    assert written(box)[:1] == [1.0] and written(box)[-2:] == [5.0, 6.0]
    assert set(written(box)) <= {1.0, 4.0, 5.0, 6.0}


def test_close_after_an_error_still_closes_every_run():
    box = Box(gate=threading.Event())
    logger = Failing(box)
    states = jax.vmap(logger.init)(jnp.arange(2))
    jax.vmap(lambda s, x: logger.spool(scan_log, s)(x))(states, jnp.array([[1.0], [2.0]]))
    wait_for_writer(logger, box)
    with pytest.raises(WriterError):
        logger.close()
    assert sorted(v for v in box.items if isinstance(v, tuple) and v[0] == "close") == [
        ("close", 0),
        ("close", 1),
    ]


def test_backend_error_in_a_real_logger(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    logger = JsonlLogger(tmp_path / "file" / "logs.jsonl")
    with pytest.raises(WriterError) as info:  # from write itself if the writer was quick
        logger.write(eqx_logs.spool(scan_log)(np.zeros(2, np.float32))[1])
        logger.flush()
    assert isinstance(info.value.__cause__, OSError)
    logger.close()


def test_close_drains_everything(tmp_path):
    """Many events queued behind a blocked backend, then close: every event is written, in
    order."""
    n = 300
    box = Box(gate=threading.Event())
    slow = Failing(box, bad=-1.0)
    xs = np.arange(n, dtype=np.float32)
    jax.jit(slow.tap(scan_log, slow.init()))(xs)
    jax.effects_barrier()
    assert written(box) == []  # everything is still queued
    threading.Timer(0.2, box.gate.set).start()
    slow.close()
    assert written(box) == xs.tolist()
    assert box.items[0] == ("open", 0) and box.items[-1] == ("close", 0)

    logger = JsonlLogger(tmp_path / "l.jsonl")
    jax.jit(logger.tap(scan_log, logger.init()))(xs)
    logger.close()
    rows = read_jsonl(tmp_path / "l.jsonl")
    assert [(r["step"], r["value"]) for r in rows] == list(enumerate(xs.tolist()))


def test_close_then_reuse_appends(tmp_path):
    logger = JsonlLogger(tmp_path / "l.jsonl")
    logger.spool(scan_log, logger.init())(np.array([1.0], np.float32))
    logger.close()
    logger.spool(scan_log, logger.init())(np.array([2.0], np.float32))
    logger.close()
    assert [r["value"] for r in read_jsonl(tmp_path / "l.jsonl")] == [1.0, 2.0]


# --- appending to an existing run ---------------------------------------------------------


def test_jsonl_appends_across_instances(tmp_path):
    path = tmp_path / "l.jsonl"
    with JsonlLogger(path) as logger:
        drive(logger, "spool", XS[:2, :1])
    with JsonlLogger(path) as logger:
        drive(logger, "tap", XS[:2, 1:])
    rows = read_jsonl(path)
    for run in range(2):
        tree = [r["value"] for r in rows if r["run"] == run and r["key"] == "tree"]
        xs = XS[run].ravel()  # the second instance's steps start again at 0
        want = [{"a": float(x + 1), "b": [float(2 * x), i % T]} for i, x in enumerate(xs)]
        assert_json_close(tree, want, f"run {run}")


def test_array_logger_appends_across_instances(tmp_path):
    for lo, hi in [(0, 3), (3, 5)]:
        with ArrayLogger(tmp_path) as logger:
            states = jax.vmap(logger.init)(jnp.arange(2))
            xs = np.arange(10, dtype=np.float32).reshape(2, 5)[:, lo:hi]
            jax.vmap(lambda s, x: logger.spool(scan_log, s)(x))(states, xs)
    for run in range(2):
        got = read_arrays(tmp_path, run)["x"]
        assert [float(e["value"]) for e in got] == [5.0 * run + i for i in range(5)]
        assert [int(e["step/step"]) for e in got] == [0, 1, 2, 0, 1]
        assert sorted(os.listdir(tmp_path / f"run_{run}" / "x")) == [
            f"{i:06d}.npz" for i in range(5)
        ]


def test_array_logger_keys_with_the_same_safe_name_are_all_kept(tmp_path):
    def f(x):
        eqx_logs.log({"a/b": x, "a__b": -x})

    with ArrayLogger(tmp_path) as logger:
        for i in range(3):
            logger.spool(f, logger.init())(jnp.float32(i + 1))
    got = read_arrays(tmp_path)
    assert [float(e["value"]) for e in got["a/b"]] == [1.0, 2.0, 3.0]
    assert [float(e["value"]) for e in got["a__b"]] == [-1.0, -2.0, -3.0]


# --- key sanitization ---------------------------------------------------------------------

NASTY = ["../../x", "/etc/passwd_eqx", "a/../../b", "..", "~/y"]


def nasty_program(x):
    eqx_logs.log({k: x + i for i, k in enumerate(NASTY)}, step=0)
    eqx_logs.log({k + "/vec": jnp.stack([x, x + 1]) for k in NASTY[:1]}, step=0)


def files_under(root: Path) -> set[Path]:
    return {p.resolve() for p in root.rglob("*") if p.is_file()}


def test_array_logger_keys_stay_inside(tmp_path):
    inside = tmp_path / "a" / "b" / "arrays"
    with ArrayLogger(inside) as logger:
        logger.spool(nasty_program, logger.init())(jnp.float32(1.0))
    files = files_under(tmp_path)
    assert files and all(inside.resolve() in f.parents for f in files), files
    assert not Path("/etc/passwd_eqx").exists()
    got = read_arrays(inside)
    assert sorted(got) == sorted([*NASTY, "../../x/vec"])
    for i, k in enumerate(NASTY):
        assert float(got[k][0]["value"]) == 1.0 + i


def test_tensorboard_keys_stay_inside(tmp_path):
    inside = tmp_path / "a" / "b" / "tb"
    with TensorBoardLogger(inside) as logger:
        logger.spool(nasty_program, logger.init())(jnp.float32(1.0))
    files = files_under(tmp_path)
    assert files and all((inside / "run_0").resolve() in f.parents for f in files), files
    scalars, histograms = read_tensorboard(inside / "run_0")
    # tags are not paths: each key is its tag, exactly
    assert scalars == {k: [(0, 1.0 + i)] for i, k in enumerate(NASTY)}
    assert list(histograms) == ["../../x/vec"]


def test_mlflow_array_keys_stay_inside(mlflow_experiment, tmp_path):
    uri, experiment = mlflow_experiment

    def f(x):
        eqx_logs.log({k: jnp.stack([x, x + i]) for i, k in enumerate(NASTY)}, step=0)

    with MLflowLogger(uri, experiment=experiment) as logger:
        logger.spool(f, logger.init())(jnp.float32(1.0))
    artifacts = tmp_path / "artifacts"
    files = files_under(tmp_path) - files_under(Path(uri.removeprefix("sqlite:///")).parent)
    assert files and all(artifacts.resolve() in f.parents for f in files), files
    (run,) = read_mlflow(uri, experiment, tmp_path / "download").values()
    folders = [unique_name(k) for k in NASTY]  # one folder per key, none a path
    assert len(set(folders)) == len(NASTY)
    assert all("/" not in f and f.strip(".") for f in folders), folders
    assert sorted(run["arrays"]) == sorted(folders)
    for i, folder in enumerate(folders):
        ((step, value),) = run["arrays"][folder]
        assert step == 0
        exact(value, np.array([1.0, 1.0 + i], np.float32), folder)


def test_mlflow_scalar_keys_with_path_parts(mlflow_experiment, tmp_path):
    uri, experiment = mlflow_experiment
    with MLflowLogger(uri, experiment=experiment) as logger:
        logger.spool(nasty_program, logger.init())(jnp.float32(1.0))
    (run,) = read_mlflow(uri, experiment, tmp_path / "download").values()
    values = sorted(v for series in run["metrics"].values() for _, v in series)
    assert values == [1.0 + i for i in range(len(NASTY))]


# --- MultiLogger ------------------------------------------------------------------------------


def test_multi_logger_writes_like_its_children(tmp_path):
    def use(logger):
        drive(logger, "spool", XS[:2])
        drive(logger, "tap", XS[:2])

    multi = MultiLogger(
        JsonlLogger(tmp_path / "m1.jsonl"),
        JsonlLogger(tmp_path / "m2.jsonl"),
        ArrayLogger(tmp_path / "marr"),
    )
    with multi:
        use(multi)
    with JsonlLogger(tmp_path / "alone.jsonl") as alone:
        use(alone)
    with ArrayLogger(tmp_path / "arr") as alone:
        use(alone)
    text = (tmp_path / "alone.jsonl").read_text()
    assert (tmp_path / "m1.jsonl").read_text() == text
    assert (tmp_path / "m2.jsonl").read_text() == text
    for run in range(2):
        got, want = read_arrays(tmp_path / "marr", run), read_arrays(tmp_path / "arr", run)
        assert sorted(got) == sorted(want)
        for key in want:
            assert len(got[key]) == len(want[key])
            for g, w in zip(got[key], want[key]):
                assert sorted(g) == sorted(w)
                for name in w:
                    exact(g[name], w[name], f"{key} {name}")


def test_multi_logger_error_of_one_child(tmp_path):
    box = Box(gate=threading.Event())
    multi = MultiLogger(Failing(box), JsonlLogger(tmp_path / "l.jsonl"))
    state = multi.init()
    multi.spool(scan_log, state)(np.array([1.0, 2.0, 3.0], np.float32))
    box.gate.set()
    # isolated: reported, not raised (tests/test_writer_policy.py tests the counts)
    with pytest.warns(WriterWarning, match=r"logger 0 \(Failing\) failed.*cannot write 2\.0"):
        multi.flush()
    multi.spool(scan_log, state)(np.array([4.0], np.float32))  # works again
    multi.close()
    assert [r["value"] for r in read_jsonl(tmp_path / "l.jsonl")] == [1.0, 2.0, 3.0, 4.0]
    assert written(box) == [1.0, 4.0]
    with pytest.raises(TypeError, match="MultiLogger takes loggers"):
        MultiLogger(JsonlLogger(tmp_path / "x.jsonl"), "not a logger")


# --- ProgressLogger, ConsoleLogger ----------------------------------------------------------


def final_bar(err: str, desc: str) -> str:
    """The last drawn state of the tqdm bar labelled `desc`."""
    states = [s for s in re.split(r"[\r\n]", err) if s.startswith(f"{desc}:")]
    assert states, f"no bar {desc!r} in {err!r}"
    return states[-1]


@pytest.mark.parametrize("mode", MODES)
def test_progress_reaches_the_final_step(capsys, mode):
    n = 20
    xs = np.linspace(0.5, 3.0, 2 * n, dtype=np.float32).reshape(2, n)
    with ProgressLogger(total=n, desc="train") as logger:
        states = jax.vmap(logger.init)(jnp.arange(2))
        jax.jit(jax.vmap(lambda s, x: getattr(logger, mode)(scan_log, s)(x)))(states, xs)
    err = capsys.readouterr().err
    for run, desc in [(0, "train"), (1, "train 1")]:
        bar = final_bar(err, desc)
        assert f"{n}/{n}" in bar and "100%" in bar, bar
        assert f"x={float(xs[run, -1]):.4g}" in bar, bar


def test_progress_without_steps_counts_writes(capsys):
    def f(xs):
        def body(c, x):
            eqx_logs.log("loss", x)
            return c, None

        return lax.scan(body, 0.0, xs)[0]

    xs = np.arange(7.0, dtype=np.float32)
    with ProgressLogger(desc="nostep") as logger:
        logger.tap(f, logger.init())(xs)
    bar = final_bar(capsys.readouterr().err, "nostep")
    assert re.search(r"\b7it\b", bar) and "loss=6" in bar, bar


@pytest.mark.parametrize("steps", [200, 90])
def test_progress_at_80_columns_shows_the_loss_and_ends_at_the_total(capsys, steps):
    """Many scalars at 80 columns: the loss first and a bar still 20+ columns wide; with
    `interval=10` the last logged step is 190 of 200, and the bar ends at 200, unless the run
    stopped early (90 steps of 200 ends at 81/200: the last logged step, 80, plus one)."""
    total, interval = 200, 10

    def f(xs):
        def body(c, i):
            keys = {"grad_norm/" + str(k): c * k for k in range(6)}
            eqx_logs.log({**keys, "lr": 0.05 + 0 * c, "loss": c}, step=i)
            return c * 0.99, None

        return lax.scan(body, 1.0, xs)[0]

    with ProgressLogger(total=total, desc="train", ncols=80) as logger:
        logger.tap(f, logger.init(), policy=eqx_logs.Policy(interval=interval))(jnp.arange(steps))
    bar = final_bar(capsys.readouterr().err, "train")
    last = (steps - 1) // interval * interval
    assert len(bar) <= 80, bar
    assert bar.startswith(f"train: loss={0.99**last:.4g} …"), bar  # the others did not fit
    assert bar.count("█") + bar.count(" ", bar.index("|"), bar.rindex("|")) >= 20, bar
    n = total if steps == total else last + 1
    assert f"{n}/{total}" in bar, bar


def test_console_aligned_per_run(capsys):
    def f(x):
        eqx_logs.log({"loss": x, "a_long_key/name": -1000 * x, "v": jnp.stack([x, 2 * x])}, step=3)

    logger = ConsoleLogger()
    states = jax.vmap(logger.init)(jnp.array([0, 2]))
    xs = jnp.array([0.5, 123.25])
    jax.jit(jax.vmap(lambda s, x: logger.spool(f, s)(x)))(states, xs)
    logger.flush()
    lines = capsys.readouterr().out.splitlines()
    run0 = [line for line in lines if not line.startswith("[")]
    run2 = [line for line in lines if line.startswith("[run 2] ")]
    assert len(run0) == len(run2) == 1 and len(lines) == 2, lines  # a line per step
    for x, group, prefix in [(0.5, run0, ""), (123.25, run2, "[run 2] ")]:
        (row,) = check_aligned(group, prefix)
        assert list(row) == ["step", "a_long_key/name", "loss", "v"], group
        assert row["step"] == "3"
        assert float(row["loss"]) == pytest.approx(x, rel=1e-3)
        assert float(row["a_long_key/name"]) == pytest.approx(-1000 * x, rel=1e-3)
        assert [float(t) for t in row["v"].strip("[]").split(",")] == pytest.approx(
            [x, 2 * x], rel=1e-3
        )


def test_console_tap_prints_each_event(capsys):
    xs = np.array([1.0, 22.5, -3.0], np.float32)
    with ConsoleLogger(last_only=True) as logger:  # tapped events are printed one by one
        logger.tap(scan_log, logger.init())(xs)
    lines = capsys.readouterr().out.splitlines()
    # a line per event; the columns widen as wider values come (`22.5`), then stay
    assert lines == ["step=    0  x=1", "step=    1  x=22.5", "step=    2  x=-3"], lines


# --- quiet backends -------------------------------------------------------------------------


# where each logger writes -> the logger
QUIET = {
    "run.jsonl": 'JsonlLogger("run.jsonl")',
    "arrays": 'ArrayLogger("arrays")',
    "tb": 'TensorBoardLogger("tb", config={"lr": 0.1})',
    "mlflow.db": 'MLflowLogger("sqlite:///mlflow.db", experiment="demo", config={"lr": 0.1})',
}


def test_a_training_loop_prints_what_it_prints(tmp_path):
    """A script's training loop with a logger prints its own line alone: nothing of the
    backend's (MLflow's INFO lines as it makes its database), nothing on stderr. One script
    runs the loop with each logger in turn: what a logger printed would come before its
    "done" line. (trackio's: tests/test_trackio.py.)"""
    out, err = run_training(list(QUIET.values()), tmp_path)
    assert out.splitlines() == [f"done {i}" for i in range(len(QUIET))]
    assert err == ""
    for written in QUIET:
        path = tmp_path / written
        assert path.is_file() or any(p.is_file() for p in path.rglob("*")), written


def test_quiet_drops_the_chatter_of_its_own_thread_only(capsys):
    """`quiet` (around a backend's calls, on the writer thread): that thread's prints and
    records below WARNING are dropped; its warnings, and another thread's prints and records
    at the same time, pass; stdout is put back."""
    from eqx_logs.loggers._host import _QuietStdout, quiet

    chatty = logging.getLogger("eqx_logs_test_chatty")
    handler = logging.StreamHandler(sys.stderr)  # (capsys's stderr)
    chatty.addHandler(handler)
    chatty.setLevel(logging.INFO)
    chatty.propagate = False
    inside, leave = threading.Event(), threading.Event()

    def backend():
        with quiet(stdout=True, loggers=("eqx_logs_test_chatty",)):
            print("* Uploading logs (please wait...)")
            chatty.getChild("store").info("Creating tables...")
            chatty.getChild("store").warning("a real warning")
            inside.set()
            leave.wait(10)

    try:
        thread = threading.Thread(target=backend)
        thread.start()
        assert inside.wait(10)
        print("the user's line")  # while the backend's thread is quiet
        chatty.info("the user's record")
        leave.set()
        thread.join()
    finally:
        chatty.removeHandler(handler)
    out, err = capsys.readouterr()
    assert out == "the user's line\n"
    assert err == "a real warning\nthe user's record\n"
    assert not isinstance(sys.stdout, _QuietStdout)


# --- W&B steps ----------------------------------------------------------------------------


def stepped_and_stepless(xs):
    def body(c, x):
        eqx_logs.log("loss", x, step=c)
        eqx_logs.log("lr", 10 * x)  # no step
        return c + 1, None

    return lax.scan(body, 0, xs)[0]


def test_wandb_stepped_events_next_to_stepless_ones(wandb_env):
    xs = np.arange(1.0, 5.0, dtype=np.float32)
    with WandbLogger(dir=os.fspath(wandb_env)) as logger:
        logger.spool(stepped_and_stepless, logger.init())(xs)
    (run,) = wandb_runs(wandb_env).values()
    got = wandb_series(run["history"])
    assert got["loss"] == [(i, float(x)) for i, x in enumerate(xs)]


def test_wandb_every_stepless_event_is_written(wandb_env):
    xs = np.arange(1.0, 5.0, dtype=np.float32)
    with WandbLogger(dir=os.fspath(wandb_env)) as logger:
        logger.spool(stepped_and_stepless, logger.init())(xs)
    (run,) = wandb_runs(wandb_env).values()
    got = wandb_series(run["history"])
    assert [v for _, v in got["lr"]] == (10 * xs).tolist()


def test_wandb_stepless_tap_events_are_all_written(wandb_env):
    """Tapped, each event is its own write: stepless events get W&B's own steps."""
    xs = np.arange(1.0, 5.0, dtype=np.float32)

    def f(xs):
        def body(c, x):
            eqx_logs.log("lr", 10 * x)
            return c, None

        return lax.scan(body, 0.0, xs)[0]

    with WandbLogger(dir=os.fspath(wandb_env)) as logger:
        logger.tap(f, logger.init())(xs)
    (run,) = wandb_runs(wandb_env).values()
    assert wandb_series(run["history"]) == {"lr": [(i, 10.0 * x) for i, x in enumerate(xs)]}
