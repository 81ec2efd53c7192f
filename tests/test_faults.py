"""Loggers under real faults: a process killed by the file-size limit in the middle of a
record (a real partial write, as on a full disk), and readers given files that are not what
a logger writes. Every reference is computed here from what the child was asked to write."""

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import read_tensorboard

import eqx_logs
from eqx_logs.loggers import (
    ArrayLogger,
    JsonlLogger,
    MLflowLogger,
    TensorBoardLogger,
    WriterError,
    read_arrays,
    read_jsonl,
    unique_name,
)
from eqx_logs.loggers._mlflow import metric_name

_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import eqx_logs
    from eqx_logs.loggers import JsonlLogger

    logger = JsonlLogger(sys.argv[1], fsync_every=0)
    for i in range(100_000):
        logs = eqx_logs.LogDict({"value": np.float32(i)}, count={"value": np.int32(1)})
        logger.write(logs)
        logger.flush()
    """
)


def _limited(limit: int):
    def set_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def test_jsonl_resumes_after_a_write_cut_short(tmp_path):
    path = tmp_path / "l.jsonl"
    limit = 4000  # bytes: the child's write stops in the middle of a record
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        preexec_fn=_limited(limit),
        capture_output=True,
        timeout=120,
    )
    # Python ignores SIGXFSZ: the write fails with EFBIG, as with ENOSPC on a full disk
    assert child.returncode == 1 and b"File too large" in child.stderr, child.stderr[-2000:]
    data = path.read_bytes()
    assert len(data) == limit and not data.endswith(b"\n")  # a torn last line
    whole = data[: data.rindex(b"\n") + 1].decode().splitlines()
    assert read_jsonl(path) == [json.loads(line) for line in whole]

    with pytest.warns(UserWarning, match="cut short"):
        with JsonlLogger(path) as logger:
            logger.write(eqx_logs.LogDict({"after": np.float32(-1.0)}, count={"after": 1}))
    rows = read_jsonl(path)
    assert [r["value"] for r in rows[:-1]] == [float(i) for i in range(len(whole))]
    assert (rows[-1]["key"], rows[-1]["value"]) == ("after", -1.0)
    assert path.read_bytes().startswith(data[: data.rindex(b"\n") + 1])


@pytest.mark.parametrize(
    "lines, line, message",
    [
        (
            ['{"run": 0, "key": "a", "value": 1}', "{oops", '{"run": 0, "key": "a", "value": 2}'],
            2,
            "not JSON",
        ),
        (['{"run": 0, "key": "a", "value": 1}', "1"], 2, "not a JsonlLogger record"),
        (["null"], 1, "not a JsonlLogger record"),
        (['{"key": "a"}'], 1, "not a JsonlLogger record"),
    ],
)
def test_read_jsonl_names_the_file_and_line(tmp_path, lines, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl, line {line}: {message}"):
        read_jsonl(path)


def test_read_jsonl_names_a_binary_file(tmp_path):
    """Bytes that are not UTF-8 (a binary file given by mistake) raise a ValueError naming the
    file, line and byte, not a bare UnicodeDecodeError; on a last line without a newline too:
    a logger writes ASCII only, so such a line is not a record cut short by a crash."""
    good = b'{"run": 0, "key": "a", "value": 1}\n'
    path = tmp_path / "plot.png"
    path.write_bytes(good * 2 + b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00" + good)
    message = r"plot\.png, line 3: not UTF-8 text \(byte 0x89 at column 1\); not a JSONL file"
    with pytest.raises(ValueError, match=message):
        read_jsonl(path)
    path.write_bytes(good + b'{"run": 0, "key": "\xff')  # last, no newline
    with pytest.raises(ValueError, match=r"line 2: not UTF-8 text \(byte 0xff at column 20\)"):
        read_jsonl(path)
    path.write_bytes(good + '{"run": 0, "key": "é", "value": 2}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"line 2: not UTF-8 text \(byte 0xe9 at column 20\)"):
        read_jsonl(path)
    path.write_bytes(good + '{"run": 0, "key": "é", "value": 2}\n'.encode())  # UTF-8: read
    assert [r["key"] for r in read_jsonl(path)] == ["a", "é"]


def test_read_jsonl_skips_only_a_torn_last_line(tmp_path):
    path = tmp_path / "l.jsonl"
    path.write_text('{"run": 0, "key": "a", "value": 1}\n{"run": 0, "key": "a", "va')
    assert read_jsonl(path) == [{"run": 0, "key": "a", "value": 1}]


@pytest.mark.parametrize("name", ["key", "value", "run", "count"])
def test_reserved_step_names_are_rejected_at_the_call_site(name):
    def f(x):
        eqx_logs.log("loss", x, **{name: 7})
        return x

    with pytest.raises(ValueError, match=rf"step name '{name}' at .*test_faults\.py.*reserved"):
        eqx_logs.spool(f)(np.float32(0.25))


# -- the writer: close() racing host callbacks, and back-pressure -------------------------------


class RaceLogger(JsonlLogger):
    """A JsonlLogger whose writer thread has a name of its own (`eqx_logs-RaceLogger`)."""


def _writer_threads(name: str) -> int:
    return sum(t.name == f"eqx_logs-{name}" for t in threading.enumerate())


def test_close_racing_host_callbacks(tmp_path):
    path = tmp_path / "l.jsonl"
    logger = RaceLogger(path)
    state = logger.init()

    def f(x):
        eqx_logs.log("x", x, step=jnp.int32(x))
        return x

    step = jax.jit(logger.tap(f, state))
    n, threads = 300, []
    done = threading.Event()

    def produce():
        for i in range(n):
            step(jnp.float32(i))
        jax.effects_barrier()
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    while not done.is_set():  # close again and again while callbacks submit
        logger.close()
        threads.append(_writer_threads("RaceLogger"))
    producer.join(timeout=120)
    assert not producer.is_alive()
    logger.close()
    assert max(threads) <= 1  # never two writer threads for one logger
    rows = read_jsonl(path)
    assert sorted(r["step"] for r in rows) == list(range(n))  # each event exactly once
    assert [r["value"] for r in rows] == [float(r["step"]) for r in rows]


class SlowLogger(JsonlLogger):
    """A backend slower than its producer."""

    def _write(self, handle, run, records):
        time.sleep(0.002)
        super()._write(handle, run, records)


def test_a_slow_backend_applies_back_pressure(tmp_path):
    logger = SlowLogger(tmp_path / "l.jsonl")
    logger._sink.writer.max_pending_bytes = bound = 64 * 2**10
    item = np.zeros(1000, np.float32)  # 4000 bytes per write
    pending = []
    for i in range(200):
        logger.write(eqx_logs.LogDict({"a": item + i}, count={"a": np.int32(1)}))
        pending.append(logger._sink.writer.pending_bytes)
    logger.close()
    assert max(pending) <= bound  # the producer waited instead of queueing more
    assert max(pending) > bound // 2  # and the queue was used
    rows = read_jsonl(tmp_path / "l.jsonl")
    assert [r["value"][0] for r in rows] == [float(i) for i in range(200)]  # nothing dropped


# -- TensorBoard: flushed means on disk, a full disk fails loudly, files never overwritten ------


_TB_CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import eqx_logs
    from eqx_logs.loggers import TensorBoardLogger

    logger = TensorBoardLogger(sys.argv[1])
    n = int(sys.argv[2])
    for i in range(n):
        logger.write(eqx_logs.LogDict({"x": np.float32(i)}, count={"x": np.int32(1)},
                                      steps={"step": {"x": np.int32(i)}}))
    logger.flush()
    print("flushed", flush=True)
    time.sleep(60)
    """
)


def test_tensorboard_flushed_events_survive_a_kill(tmp_path):
    n = 200
    child = subprocess.Popen(
        [sys.executable, "-c", _TB_CHILD, str(tmp_path), str(n)], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout.readline() == b"flushed\n"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    assert read_tensorboard(tmp_path / "run_0")[0] == {"x": [(i, float(i)) for i in range(n)]}


def test_tensorboard_full_disk_fails_loudly(tmp_path):
    # the writes stop at the file-size limit: the child's flush raises instead of hanging
    child = subprocess.run(
        [sys.executable, "-c", _TB_CHILD, str(tmp_path), "5000"],
        preexec_fn=_limited(20_000),
        capture_output=True,
        timeout=120,
    )
    assert child.returncode == 1, child.stderr[-2000:]
    assert b"WriterError" in child.stderr and b"File too large" in child.stderr
    got = read_tensorboard(tmp_path / "run_0")[0]["x"]  # what fitted reads back, in order
    assert 0 < len(got) < 5000 and got == [(i, float(i)) for i in range(len(got))]


def test_tensorboard_reopening_keeps_every_file(tmp_path):
    def write(logger, i):
        logs = eqx_logs.LogDict({"x": np.float32(i)}, count={"x": np.int32(1)})
        logger.write(logs, logger.init())

    logger = TensorBoardLogger(tmp_path)
    write(logger, 0)
    logger.close()
    write(logger, 1)  # reopened within the same second
    logger.close()
    with TensorBoardLogger(tmp_path) as other:  # another logger on the same logdir
        write(other, 2)
    got = [v for _, v in read_tensorboard(tmp_path / "run_0")[0]["x"]]
    assert got == [0.0, 1.0, 2.0]  # in the order written: each file sorts after the last


def test_tensorboard_keys_stay_distinct(tmp_path):
    keys = ["a:b", "a_b", "x y", "x_y", "v/nonfinite"]
    values = {k: np.float32(i) for i, k in enumerate(keys)}
    values["v"] = np.array([1.0, np.nan, np.inf], np.float32)
    with TensorBoardLogger(tmp_path) as logger:
        logger.write(eqx_logs.LogDict(values, count={k: np.int32(1) for k in values}))
    assert read_tensorboard(tmp_path / "run_0")[0] == {
        k: [(0, float(i))] for i, k in enumerate(keys)
    }
    assert read_tensorboard(tmp_path / "run_0" / "nonfinite")[0] == {"v": [(0, 2.0)]}


# -- keys: every key storable, distinct keys distinct, in every backend -------------------------

HOSTILE = [
    "a/b",
    "a__b",
    unique_name("a/b"),  # another key's file name
    "x" * 300,
    "y" * 300 + "1",
    "y" * 300 + "2",
    "..a",
    "a/../b",
    "./a",
    "/a",
    "a/",
    "a//b",
    ".",
    "a:b",
    "a_b",
    metric_name("a:b"),
]


def _hostile_logs() -> eqx_logs.LogDict:
    values = {k: np.float32(i) for i, k in enumerate(HOSTILE)}
    return eqx_logs.LogDict(values, count={k: np.int32(1) for k in values})


def test_array_logger_stores_every_key_apart(tmp_path):
    with ArrayLogger(tmp_path) as logger:
        logger.write(_hostile_logs())
    got = read_arrays(tmp_path)
    assert {k: [float(e["value"]) for e in got[k]] for k in got} == {
        k: [float(i)] for i, k in enumerate(HOSTILE)
    }
    assert len(os.listdir(tmp_path / "run_0")) == len(HOSTILE)


def test_mlflow_stores_every_key_apart(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    with MLflowLogger(uri, experiment="keys", artifact_location=tmp_path.as_uri()) as logger:
        logger.write(_hostile_logs())
    client = mlflow.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("keys").experiment_id])
    names = [metric_name(k) for k in HOSTILE]
    assert len(set(names)) == len(HOSTILE)
    assert run.data.metrics == {n: float(i) for i, n in enumerate(names)}


# -- values a backend cannot store: named, and the other keys written ---------------------------


def _mixed_logs() -> eqx_logs.LogDict:
    values = {
        "z": np.complex64(1 + 2j),
        "zs": np.array([1 + 2j, 3 - 4j], np.complex64),
        "tree": {("a", "b"): np.float32(1.0), ("c",): np.float32(2.0)},
        "ok": np.float32(5.0),
    }
    return eqx_logs.LogDict(values, count={k: np.int32(1) for k in values})


def test_jsonl_writes_complex_values_and_any_dict_keys(tmp_path):
    with JsonlLogger(tmp_path / "l.jsonl") as logger:
        logger.write(_mixed_logs())
    got = {r["key"]: r["value"] for r in read_jsonl(tmp_path / "l.jsonl")}
    assert got == {
        "z": [1.0, 2.0],
        "zs": [[1.0, 2.0], [3.0, -4.0]],
        "tree": {"('a', 'b')": 1.0, "('c',)": 2.0},
        "ok": 5.0,
    }


def test_tensorboard_names_the_key_it_cannot_store(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"TensorBoardLogger cannot store key 'z': complex.*"
        r"key 'zs': complex.*other keys of this write were written",
    ):
        logger.write(_mixed_logs())
    logger.close()
    got, _ = read_tensorboard(tmp_path / "run_0")
    assert got == {"tree/('a', 'b')": [(0, 1.0)], "tree/('c',)": [(0, 2.0)], "ok": [(0, 5.0)]}


def test_narrow_integers_read_back_as_numbers(tmp_path):
    import ml_dtypes

    x = np.array([-8, -1, 0, 7], ml_dtypes.int4)
    logs = eqx_logs.LogDict({"q": x}, count={"q": np.int32(1)})
    with ArrayLogger(tmp_path) as logger:
        logger.write(logs)
    (event,) = read_arrays(tmp_path)["q"]
    assert event["value"].dtype == np.int8
    np.testing.assert_array_equal(event["value"], [-8, -1, 0, 7])


# -- readers ---------------------------------------------------------------------------------


def _one_event(tmp_path):
    with ArrayLogger(tmp_path / "arr") as logger:
        logger.write(eqx_logs.LogDict({"a": np.float32(1.0)}, count={"a": np.int32(1)}))
    (folder,) = (tmp_path / "arr" / "run_0").iterdir()
    return folder


@pytest.mark.parametrize("where", ["file", "folder"])
def test_read_arrays_refuses_symbolic_links(tmp_path, where):
    folder = _one_event(tmp_path)
    secret = tmp_path / "secret"
    secret.mkdir()
    np.savez(secret / "000000.npz", __key__=np.asarray("stolen"), value=np.float32(7.0))
    if where == "file":
        (folder / "000001.npz").symlink_to(secret / "000000.npz")
    else:
        (folder.parent / "b").symlink_to(secret)
    with pytest.raises(ValueError, match="symbolic link.*secret"):
        read_arrays(tmp_path / "arr")


def test_read_arrays_names_a_bad_file(tmp_path):
    folder = _one_event(tmp_path)
    (folder / "000001.npz").write_bytes(b"garbage, not a zip")
    with pytest.raises(ValueError, match=r"000001\.npz: not an ArrayLogger event"):
        read_arrays(tmp_path / "arr")
    np.savez(folder / "000001.npz", value=np.float32(2.0))  # a real .npz without a key
    with pytest.raises(ValueError, match=r"000001\.npz: not an ArrayLogger event.*no key"):
        read_arrays(tmp_path / "arr")


# -- SIGKILL at random moments: what was flushed is read back, in order -------------------------

_KILL_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import eqx_logs
    from eqx_logs.loggers import ArrayLogger, JsonlLogger, TensorBoardLogger

    make = {"jsonl": lambda p: JsonlLogger(p + "/l.jsonl"), "array": ArrayLogger,
            "tensorboard": TensorBoardLogger}[sys.argv[1]]
    logger = make(sys.argv[2])
    print("ready", flush=True)
    for i in range(10**6):
        logger.write(eqx_logs.LogDict({"x": np.float32(i)}, count={"x": np.int32(1)},
                                      steps={"step": {"x": np.int32(i)}}))
        logger.flush()
        print(i, flush=True)
    """
)


def _read_back(backend: str, path) -> list[float]:
    if backend == "jsonl":
        return [r["value"] for r in read_jsonl(path / "l.jsonl")]
    if backend == "array":
        return [float(e["value"]) for e in read_arrays(path).get("x", [])]
    return [v for _, v in read_tensorboard(path / "run_0")[0].get("x", [])]


@pytest.mark.parametrize("backend", ["jsonl", "array", "tensorboard"])
def test_sigkill_loses_nothing_flushed(tmp_path, backend):
    rng = np.random.default_rng(0)
    flushed, read = [], []
    for kill in range(2):
        child = subprocess.Popen(
            [sys.executable, "-c", _KILL_CHILD, backend, str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert child.stdout.readline() == "ready\n"
            assert child.stdout.readline() == "0\n"  # writing: kill it at a random moment
            time.sleep(rng.uniform(0.05, 0.5))
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
            done = [0, *(int(line) for line in child.stdout.read().split())]
        finally:
            child.kill()
        flushed.append(len(done))
        read.append(_read_back(backend, tmp_path))
    assert min(flushed) > 1, flushed  # killed mid-run
    # each run appends its 0, 1, 2, ...: every flushed event is there, whole and in order
    assert read[0][: flushed[0]] == [float(i) for i in range(flushed[0])]
    first = len(read[0])
    assert read[1][:first] == read[0]
    assert read[1][first : first + flushed[1]] == [float(i) for i in range(flushed[1])]


# -- a real full disk: a 64 KiB tmpfs (mounting one needs root; the RLIMIT_FSIZE tests above
# cover the same failure without it) ------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path):
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (not root?): {done.stderr.decode()[:200]}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("backend", ["jsonl", "array", "tensorboard"])
def test_full_disk_raises_and_keeps_what_was_written(tiny_disk, backend):
    make = {
        "jsonl": lambda: JsonlLogger(tiny_disk / "l.jsonl"),
        "array": lambda: ArrayLogger(tiny_disk),
        "tensorboard": lambda: TensorBoardLogger(tiny_disk),
    }[backend]
    logger = make()
    written = 0
    with pytest.raises(WriterError, match="No space left on device"):
        for i in range(100_000):
            logs = eqx_logs.LogDict(
                {"x": np.float32(i)},
                count={"x": np.int32(1)},
                steps={"step": {"x": np.int32(i)}},
            )
            logger.write(logs)
            logger.flush()
            written += 1
    assert written > 10
    try:
        logger.close()
    except WriterError:
        pass  # closing may fail on the full disk too; it must return
    got = _read_back(backend, tiny_disk)
    assert got[:written] == [float(i) for i in range(written)]  # whole, in order
    if backend == "jsonl":  # room again: a new logger appends after the last whole record
        for f in tiny_disk.glob("*"):
            if f.name != "l.jsonl":
                f.unlink()
        (tiny_disk / "l.jsonl").write_bytes((tiny_disk / "l.jsonl").read_bytes()[:4000])
        with JsonlLogger(tiny_disk / "l.jsonl") as resumed:
            resumed.write(eqx_logs.LogDict({"y": np.float32(-1)}, count={"y": np.int32(1)}))
        rows = read_jsonl(tiny_disk / "l.jsonl")
        assert rows[-1]["key"] == "y" and [r["value"] for r in rows[:-1]] == list(
            map(float, range(len(rows) - 1))
        )
