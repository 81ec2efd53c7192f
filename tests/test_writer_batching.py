"""`logger.jit` at `interval=1`: the writes queued behind a busy backend are fetched together,
and their records cut straight from the fetched buffers (`_rows.py`). What is written must be
what the LogDict path writes (same lines, values and order), and a backend that fails inside
such a batch must lose exactly the writes it lost before: the one that raised and those after
it. A JsonlLogger writes the writes of a run fetched together at once (`_write_many`): the
bytes `json.dumps` writes, and a batch that fails is lost whole, none of it in the file."""

import json
import subprocess
import sys
import textwrap
import threading

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import eqx_logs
from eqx_logs.loggers import JsonlLogger, WriterError, WriterWarning, read_jsonl
from eqx_logs.loggers._host import to_python
from eqx_logs.loggers._rows import row_plan

STEPS = 500


class Gate:
    """Hashable by identity (a static field): `_open` waits for `opened`; `_write` raises at
    call `fail_at` (0-based; None: never) and counts its calls."""

    def __init__(self, fail_at: int | None = None):
        self.opened = threading.Event()
        self.fail_at = fail_at
        self.calls = 0


class Gated(JsonlLogger):
    """A JsonlLogger whose first write waits (in `_open`) until the test has queued every
    step's write behind it, so that the writer takes them as one batch."""

    gate: Gate = eqx.field(static=True, kw_only=True)

    def _open(self, run):
        assert self.gate.opened.wait(60)
        return super()._open(run)

    def _write(self, handle, run, records):
        call, self.gate.calls = self.gate.calls, self.gate.calls + 1
        if call == self.gate.fail_at:
            raise OSError("disk on fire")
        super()._write(handle, run, records)


def step(x, i):
    """Several keys and dtypes, a vector, a non-finite value now and then, and every third
    step an event with no value (written as the number of its events, 1)."""
    loss = jnp.where(i % 97 == 5, jnp.nan, x * 0.5)
    eqx_logs.log(
        {
            "loss": loss,
            "big": jnp.where(i % 89 == 7, -jnp.inf, x * 1e30),
            "count": i * 3,
            "flag": i % 2 == 0,
            "half": x.astype(jnp.float16),
            "brain": x.astype(jnp.bfloat16),
            "vec": jnp.stack([x, -x, x * x]),
        },
        step=i,
    )
    jax.lax.cond(i % 3 == 0, lambda: eqx_logs.log("tick", (), step=i), lambda: None)
    return x + 0.25


def reference(steps: int) -> list[dict]:
    """The rows `step` writes for `steps` calls from `x = 1`, worked out in numpy."""
    rows, x = [], np.float32(1.0)
    for i in range(steps):
        values = {
            "big": -np.inf if i % 89 == 7 else float(x * np.float32(1e30)),
            "brain": float(x.astype(ml_dtypes.bfloat16).astype(np.float32)),
            "count": i * 3,
            "flag": i % 2 == 0,
            "half": float(x.astype(np.float16)),
            "loss": np.nan if i % 97 == 5 else float(x * np.float32(0.5)),
            "vec": [float(x), float(-x), float(x * x)],
        }
        rows += [{"run": 0, "key": k, "value": v, "step": i} for k, v in sorted(values.items())]
        if i % 3 == 0:
            rows.append({"run": 0, "key": "tick", "value": 1, "step": i})
        x = np.float32(x + np.float32(0.25))
    return rows


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and g["key"] == w["key"] and g["step"] == w["step"], (g, w)
        np.testing.assert_array_equal(g["value"], w["value"], err_msg=str(g))
        assert type(g["value"]) is type(w["value"]), (g, w)


def _run(logger, steps: int) -> None:
    jitted = logger.jit(step, logger.init(), interval=1)
    x = jnp.float32(1.0)
    for i in range(steps):
        x = jitted(x, jnp.int32(i))
    _, packed = jitted.jitted(x, jnp.int32(0))
    assert row_plan(packed.layout) is not None  # the records are cut from the buffers


def test_batched_rows_equal_the_numpy_reference_and_the_logdict_path(tmp_path):
    gate = Gate()
    logger = Gated(tmp_path / "jit.jsonl", gate=gate)
    _run(logger, STEPS)  # every write queued behind the first, held in `_open`
    assert logger._sink.writer._submitted == STEPS
    gate.opened.set()
    logger.close()
    assert gate.calls == STEPS  # a backend write per call, as before
    got = read_jsonl(tmp_path / "jit.jsonl")
    _same(got, reference(STEPS))

    # the LogDict path (a spooled call's logs, written by `logger.write`) writes the same lines
    with JsonlLogger(tmp_path / "write.jsonl") as logger:
        spooled = eqx.filter_jit(eqx_logs.spool(step, interval=1))
        x = jnp.float32(1.0)
        for i in range(STEPS):
            x, logs = spooled(x, jnp.int32(i))
            logger.write(logs)
    assert (tmp_path / "jit.jsonl").read_text() == (tmp_path / "write.jsonl").read_text()


def test_a_layout_with_a_pytree_value_keeps_the_logdict_path(tmp_path):
    def nested(x, i):
        eqx_logs.log({"tree": {"a": x, "b": 2 * x}, "loss": x}, step=i)
        return x + 1

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(nested, logger.init(), interval=1)
        x = jnp.float32(0.0)
        for i in range(20):
            x = jitted(x, jnp.int32(i))
        _, packed = jitted.jitted(x, jnp.int32(0))
        assert row_plan(packed.layout) is None
    rows = read_jsonl(tmp_path / "a.jsonl")
    assert [(r["key"], r["step"]) for r in rows] == [
        (k, i) for i in range(20) for k in ("loss", "tree")
    ]
    assert [r["value"] for r in rows if r["key"] == "tree"] == [
        {"a": float(i), "b": 2.0 * i} for i in range(20)
    ]


@pytest.mark.parametrize("fail_at", [0, 1, 137, STEPS - 1])
def test_a_write_failing_inside_a_batch_loses_it_and_those_after(tmp_path, fail_at):
    gate = Gate(fail_at)
    logger = Gated(tmp_path / "a.jsonl", gate=gate)
    _run(logger, STEPS)
    assert logger._sink.writer._submitted == STEPS
    gate.opened.set()
    lost = STEPS - fail_at  # the write that raised, then those skipped after it
    with (
        pytest.warns(WriterWarning, match=rf"^Gated: {lost} of {STEPS} write\(s\) were not"),
        pytest.raises(WriterError, match="disk on fire") as raised,
    ):
        logger.flush()
    assert raised.value.lost == lost
    assert gate.calls == fail_at + 1  # the writes after it were skipped, not tried
    _same(read_jsonl(tmp_path / "a.jsonl"), reference(fail_at))  # those before it, whole
    _run(logger, 3)  # the logger keeps working for new calls
    logger.close()
    steps = [r["step"] for r in read_jsonl(tmp_path / "a.jsonl")]
    assert steps[-21:] == [0] * 7 + [1] * 7 + [2] * 7


def test_several_rows_per_call_equal_the_logdict_path(tmp_path):
    def scanned(x, i):  # three events of each key per call: a Stack's rows
        def body(c, k):
            eqx_logs.log({"a": c, "b": (c * 2).astype(jnp.int32)}, step=i * 3 + k)
            return c + 1, None

        return jax.lax.scan(body, x, jnp.arange(3))[0], None

    with JsonlLogger(tmp_path / "jit.jsonl") as logger:
        jitted = logger.jit(lambda x, i: scanned(x, i)[0], logger.init())
        x = jnp.float32(0.0)
        for i in range(50):
            x = jitted(x, jnp.int32(i))
    with JsonlLogger(tmp_path / "write.jsonl") as logger:
        spooled = eqx.filter_jit(eqx_logs.spool(lambda x, i: scanned(x, i)[0]))
        x = jnp.float32(0.0)
        for i in range(50):
            x, logs = spooled(x, jnp.int32(i))
            logger.write(logs)
    rows = read_jsonl(tmp_path / "jit.jsonl")
    assert [r["step"] for r in rows if r["key"] == "a"] == list(range(150))
    assert (tmp_path / "jit.jsonl").read_text() == (tmp_path / "write.jsonl").read_text()


class Recording(JsonlLogger):
    """A JsonlLogger that keeps what it was given to write (`gate.writes`: `(run, [records,
    ...])` per backend call) and, with `gate.fail_at` set, fails its first batch of several
    writes once `gate.fail_at` writes are written. Its first write waits for `gate.opened`
    (in `_open`), so that the writes queued behind it are fetched, and written, together."""

    gate: Gate = eqx.field(static=True, kw_only=True)

    def _open(self, run):
        assert self.gate.opened.wait(60)
        return super()._open(run)

    def _write(self, handle, run, records):
        self.gate.writes.append((run, [records]))
        super()._write(handle, run, records)

    def _write_many(self, handle, run, writes):
        self.gate.writes.append((run, writes))
        written = sum(len(w) for _, w in self.gate.writes[:-1])
        if self.gate.fail_at is not None and len(writes) > 1 and written >= self.gate.fail_at:
            self.gate.failed = len(writes)
            raise OSError("disk on fire")
        super()._write_many(handle, run, writes)


def _gate(fail_at: int | None = None) -> Gate:
    gate = Gate(fail_at)
    gate.writes, gate.failed = [], 0
    return gate


def mixed(x, i):
    """Every dtype a value comes in, NaN and both infinities, a vector (with a NaN: its
    elements one by one), a key JSON escapes, and two keys with three rows per call."""

    def body(c, k):
        eqx_logs.log({"rows": c * 1.5, "irows": (c * 2).astype(jnp.int32)}, step=i * 3 + k)
        return c + 1, None

    x = jax.lax.scan(body, x, jnp.arange(3))[0]
    eqx_logs.log(
        {
            "f32": jnp.where(i % 7 == 3, jnp.nan, x / 3),
            "pinf": jnp.where(i % 5 == 1, jnp.inf, x * 1e-30),
            "ninf": jnp.where(i % 6 == 2, -jnp.inf, -x * 1e38),
            "f16": (x / 7).astype(jnp.float16),
            "bf16": (x / 7).astype(jnp.bfloat16),
            "i32": i * -3,
            "u8": (i % 256).astype(jnp.uint8),
            "i8": (i % 100 - 50).astype(jnp.int8),
            "u32": i.astype(jnp.uint32) * 7919,
            "flag": i % 3 == 0,
            "vec": jnp.stack([x, jnp.where(i % 2 == 0, jnp.nan, x), -x]),
            'odd "key" \u00e9/\n': x,
        },
        step=i,
    )
    return x - 2.9


def _json_lines(writes: list[tuple[int, list[list[dict]]]]) -> str:
    """What `json.dumps` makes of the records the backend was given: the file's text."""
    return "".join(
        json.dumps({"run": run, **to_python(r)}) + "\n"
        for run, calls in writes
        for records in calls
        for r in records
    )


def test_the_batched_lines_are_the_bytes_json_dumps_writes(tmp_path):
    gate = _gate()
    logger = Recording(tmp_path / "a.jsonl", gate=gate)
    runs = {0: logger.init(0), 3: logger.init(3)}
    jitted = {r: logger.jit(mixed, state, interval=1) for r, state in runs.items()}
    x = {r: jnp.float32(r + 0.1) for r in runs}
    for i in range(300):  # in blocks of a run's writes (those of a run are written together)
        r = 3 if i % 50 >= 40 else 0
        x[r] = jitted[r](x[r], jnp.int32(i))
    gate.opened.set()
    logger.close()
    assert {run for run, _ in gate.writes} == {0, 3}
    assert max(len(calls) for _, calls in gate.writes) > 1  # writes taken together
    assert sum(len(calls) for _, calls in gate.writes) == 300  # every call, once
    text = (tmp_path / "a.jsonl").read_text()
    assert text == _json_lines(gate.writes)
    rows = read_jsonl(tmp_path / "a.jsonl")
    assert len(rows) == 300 * (6 + 12)
    assert all(f': "{v}"' in text for v in ("nan", "inf", "-inf"))  # as `to_python` spells them
    assert {r["value"] for r in rows if r["key"] == "flag"} == {True, False}
    assert {type(r["value"]) for r in rows if r["key"] in ("i32", "u8", "irows")} == {int}


def test_a_failing_batch_loses_every_write_in_it(tmp_path):
    gate = _gate(fail_at=1)  # the first batch written once a write is written fails
    logger = Recording(tmp_path / "a.jsonl", gate=gate)
    _run(logger, STEPS)
    gate.opened.set()
    with pytest.raises(WriterError, match="disk on fire") as raised, pytest.warns(WriterWarning):
        logger.flush()
    assert gate.failed > 1  # a batch of several writes failed
    written = [calls for _, calls in gate.writes[:-1]]
    done = sum(map(len, written))
    assert 0 < done and done + gate.failed <= STEPS
    assert raised.value.lost == STEPS - done  # the batch's writes, then those after it
    # the writes before the batch whole, nothing of the batch
    _same(read_jsonl(tmp_path / "a.jsonl"), reference(done))
    assert (tmp_path / "a.jsonl").read_text() == _json_lines(gate.writes[:-1])
    gate.fail_at = None
    _run(logger, 3)  # the logger keeps working for new calls
    logger.close()
    steps = [r["step"] for r in read_jsonl(tmp_path / "a.jsonl")]
    assert steps[-21:] == [0] * 7 + [1] * 7 + [2] * 7


_CUT_SHORT_CHILD = textwrap.dedent(
    """
    import os, resource, sys, threading
    import equinox as eqx, jax.numpy as jnp
    import eqx_logs
    from eqx_logs.loggers import JsonlLogger, WriterError

    opened = threading.Event()

    class Held(JsonlLogger):  # a run's first write waits: the writes behind it queue up
        def _open(self, run):
            assert run == 0 or opened.wait(60)
            return super()._open(run)

    def step(x, i):
        eqx_logs.log({"a": x, "b": i}, step=i)
        return x + 1

    path = sys.argv[1]
    logger = Held(path, fsync_every=0)
    first = logger.jit(step, logger.init(0), interval=1)
    for i in range(20):
        first(jnp.float32(i), jnp.int32(i))
    logger.flush()
    size = os.path.getsize(path)
    # room for one call's lines: any batch of several calls is cut short by the limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 150, size + 150))
    second = logger.jit(step, logger.init(1), interval=1)
    for i in range(200):
        second(jnp.float32(i), jnp.int32(i))
    opened.set()
    try:
        logger.flush()
    except WriterError as e:
        print(repr(e.__cause__), "lost", e.lost)
    """
)


def test_a_batch_cut_short_leaves_nothing_of_it_in_the_file(tmp_path):
    path = tmp_path / "a.jsonl"
    child = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT_CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0 and "File too large" in child.stdout, child.stderr[-3000:]
    lost = int(child.stdout.split("lost")[1])
    data = path.read_bytes()
    assert data.endswith(b"\n")  # no line cut short: the failed batch was cut off whole
    rows = read_jsonl(path)
    firsts = [(r["run"], r["step"]) for r in rows if r["key"] == "a"]
    done = len(firsts) - 20  # the second run's writes before the batch that failed
    assert firsts == [(0, i) for i in range(20)] + [(1, i) for i in range(done)]
    assert len(rows) == 2 * len(firsts) and 0 < lost == 200 - done
