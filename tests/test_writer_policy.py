"""The writer policy (`on_full`, `stall_timeout`) and MultiLogger isolation, with real stuck
backends: a `_write` that waits forever (on an Event released at the end of the test), one
that fails intermittently, and a full disk (`RLIMIT_FSIZE`, in a child process). A real jitted
training step runs in a Python loop; each loop must finish within its time without logging
plus the stall timeout, and `close()` must say exactly how many writes were lost (checked
against what the files hold)."""

import re
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_logs
from eqx_logs.loggers import (
    JsonlLogger,
    MultiLogger,
    WriteReport,
    WriterError,
    WriterWarning,
    read_jsonl,
)

STALL = 0.5  # seconds: the stall timeout of these tests
SLACK = 4.0  # seconds: generous, for a loaded machine
SCALAR = 4  # bytes a float32 loss holds: the size of one write below


class Gate:
    """Hashable by identity (a static field). `calls` counts `_write` calls; the call numbered
    `stuck_at` (0-based) waits until `release` is set, then writes normally."""

    def __init__(self, stuck_at: int):
        self.stuck_at = stuck_at
        self.calls = 0
        self.release = threading.Event()
        self.then_raise = False  # the stuck call raises once released


class Stuck(JsonlLogger):
    """A JsonlLogger whose backend gets stuck at write `gate.stuck_at`."""

    gate: Gate = eqx.field(static=True, kw_only=True)

    def _write(self, handle, run, records):
        call, self.gate.calls = self.gate.calls, self.gate.calls + 1
        if call == self.gate.stuck_at:
            self.gate.release.wait()
            if self.gate.then_raise:
                raise OSError("released too late")
        super()._write(handle, run, records)


class Flaky(JsonlLogger):
    """A JsonlLogger whose backend raises on every write of a step `≡ 3 (mod 7)`."""

    def _write(self, handle, run, records):
        if any(int(r["step"]) % 7 == 3 for r in records):
            raise OSError("the tracking server answered 503")
        super()._write(handle, run, records)


def train_step(params, x, step):
    loss = jnp.mean((params * x - jnp.float32(1.0)) ** 2)
    eqx_logs.log("loss", loss, step=step)
    grad = jax.grad(lambda p: jnp.mean((p * x - jnp.float32(1.0)) ** 2))(params)
    return params - jnp.float32(0.1) * grad


spooled_step = jax.jit(eqx_logs.spool(train_step))
X = jnp.linspace(0.5, 1.5, 256, dtype=jnp.float32)


def train(n: int, logger=None, form: str = "write") -> float:
    """`n` steps of a per-step Python loop; returns its wall time (until every write was
    handed over). `form`: "write" (a jitted spool, then `logger.write`) or "spool" (a jitted
    `logger.spool`, writing from a host callback)."""
    params = jnp.ones(256, jnp.float32)
    if form == "spool" and logger is not None:
        step_fn = jax.jit(logger.spool(train_step, logger.init()))
        step_fn(params, X, jnp.int32(-1))  # compile (one write, before the loop)
    start = time.monotonic()
    for i in range(n):
        if form == "spool" and logger is not None:
            params = step_fn(params, X, jnp.int32(i))
        else:
            params, logs = spooled_step(params, X, jnp.int32(i))
            if logger is not None:
                logger.write(logs)
    jax.block_until_ready(params)
    jax.effects_barrier()
    return time.monotonic() - start


def baseline(n: int) -> float:
    train(3)  # compiled
    return train(n)


def steps(path) -> list[int]:
    return [r["step"] for r in read_jsonl(path)]


def messages(caught, pattern: str) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, WriterWarning) and re.search(pattern, str(w.message))
    ]


def release(logger, gate: Gate) -> None:
    """Let the stuck write finish, and the writer thread end (no thread outlives the test)."""
    writer = logger._sink.writer
    thread = writer._thread
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WriterWarning)  # "made progress again"
        gate.release.set()
        with writer._changed:  # a test that failed before closing: the thread ends when idle
            writer._closed = True
            writer._changed.notify_all()
        if thread is not None:
            thread.join(timeout=30)
    assert thread is None or not thread.is_alive()


# -- one stuck backend: the loop waits at most the stall timeout; close counts exactly --------


@pytest.mark.parametrize("form", ["write", "spool"])
def test_a_stuck_backend_costs_the_loop_at_most_the_timeout(tmp_path, form):
    n, queued = 100, 5  # the queue holds 5 writes
    plain = baseline(n)
    skip = 1 if form == "spool" else 0  # the compiling call writes step -1 first
    gate = Gate(stuck_at=3 + skip)  # steps 0, 1, 2 are written, then the backend hangs
    logger = Stuck(tmp_path / "l.jsonl", gate=gate, stall_timeout=STALL)
    logger._sink.writer.max_pending_bytes = queued * SCALAR
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            took = train(n, logger, form)
            start = time.monotonic()
            logger.close()
            closing = time.monotonic() - start
        # the loop waited for the stuck backend once, for the stall timeout, and no longer
        assert STALL * 0.9 <= took <= plain + STALL + SLACK, (took, plain)
        assert closing <= SLACK  # already stalled: close gives up at once
        assert steps(tmp_path / "l.jsonl")[skip:] == [0, 1, 2]
        (stall,) = messages(caught, "the backend has made no progress")
        assert "stall_timeout=0.5" in stall
        # step 3 inside the stuck call, 4..7 queued behind it: abandoned; 8..99 dropped
        (report,) = messages(caught, "were not written")
        assert report == (
            f"Stuck: 97 of {n + skip} write(s) were not written: 92 dropped while the backend "
            "was stalled, 5 abandoned in the stalled backend when close gave up."
        )
        assert len(messages(caught, "close gave up waiting")) == 1
    finally:
        release(logger, gate)


def test_flush_gives_up_and_a_recovered_backend_writes_again(tmp_path):
    gate = Gate(stuck_at=2)
    logger = Stuck(tmp_path / "l.jsonl", gate=gate, stall_timeout=STALL)
    params = jnp.ones(256, jnp.float32)

    def write(i):
        logger.write(spooled_step(params, X, jnp.int32(i))[1])

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(5):  # 2 hangs; 3 and 4 wait behind it
                write(i)
            start = time.monotonic()
            logger.flush()  # gives up: nothing is lost yet, so no loss report
            assert time.monotonic() - start <= STALL + SLACK
            assert len(messages(caught, r"flush gave up.*3 item\(s\) not written")) == 1
            assert messages(caught, "were not written") == []
            for i in range(5, 8):  # the backend is stalled: dropped, counted, never waited for
                write(i)
            gate.release.set()
            writer = logger._sink.writer
            with writer._changed:  # (`_wait` would give up at once: the backend is stalled)
                assert writer._changed.wait_for(lambda: writer._done >= writer._submitted, 30)
            write(8)  # the recovery, seen on the writer thread, is said at the next call
            recovered = [w for w in caught if "made progress again" in str(w.message)]
            assert len(recovered) == 1 and recovered[0].filename == __file__
            logger.close()
        assert steps(tmp_path / "l.jsonl") == [0, 1, 2, 3, 4, 8]
        # 5..8 since the flush, and 2..4, unwritten when it reported (written since)
        assert messages(caught, "were not written") == [
            "Stuck: 3 of 7 write(s) were not written (3 of them unwritten at the last "
            "report): 3 dropped while the backend was stalled."
        ]
    finally:
        release(logger, gate)


def test_reports_add_up_after_a_flush_gave_up(tmp_path):
    # a flush gives up on the stuck backend with 10 writes queued; 5 more are dropped; close
    # abandons the 10: its report counts them among its writes (it said "15 of 5" before)
    gate = Gate(stuck_at=0)
    logger = Stuck(tmp_path / "l.jsonl", gate=gate, stall_timeout=STALL)
    params = jnp.ones(256, jnp.float32)
    submitted = 0

    def write(i):
        nonlocal submitted
        logger.write(spooled_step(params, X, jnp.int32(i))[1])
        submitted += 1

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(10):
                write(i)
            logger.flush()
            assert len(messages(caught, r"flush gave up.*10 item\(s\) not written")) == 1
            for i in range(10, 15):
                write(i)
            logger.close()
            written = len(steps(tmp_path / "l.jsonl"))  # before the stuck write returns
        reports = messages(caught, "were not written")
        assert reports == [
            "Stuck: 15 of 15 write(s) were not written (10 of them unwritten at the last "
            "report): 5 dropped while the backend was stalled, 10 abandoned in the stalled "
            "backend when close gave up."
        ]
        counts = [re.match(r"Stuck: (\d+) of (\d+) write", r).groups() for r in reports]
        assert all(int(lost) <= int(total) for lost, total in counts)
        assert sum(int(lost) for lost, _ in counts) == submitted - written == 15
        # the stuck write returns, then raises: abandoned already, it is not counted again
        gate.then_raise, thread = True, logger._sink.writer._thread
        gate.release.set()
        thread.join(timeout=30)
        assert logger._sink.writer.report() == WriteReport()
        with (
            pytest.warns(WriterWarning, match="made progress again"),
            pytest.raises(WriterError, match="released too late") as failed,
        ):
            logger._sink.writer.check()
        assert failed.value.lost == 0
    finally:
        release(logger, gate)


# -- on_full="drop": never waits; drops and counts exactly --------------------------------------


def test_on_full_drop_never_waits_and_counts_exactly(tmp_path):
    n = 50
    plain = baseline(n)
    gate = Gate(stuck_at=0)  # the backend holds the first write until released
    logger = Stuck(tmp_path / "l.jsonl", gate=gate, on_full="drop")
    logger._sink.writer.max_pending_bytes = 10 * SCALAR  # room for 10 writes
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            took = train(n, logger)
            assert took <= plain + SLACK
            (full,) = messages(caught, "queue is full")  # warned once
            assert "on_full='drop'" in full
            gate.release.set()
            logger.close()
            assert messages(caught, "were not written") == [
                "Stuck: 40 of 50 write(s) were not written: 40 dropped while the queue was "
                "full (on_full='drop')."
            ]
            assert steps(tmp_path / "l.jsonl") == list(range(10))
            # a new report starts at close: nothing lost since, nothing said
            del caught[:]
            train(5, logger)
            logger.flush()
            logger.close()
            assert messages(caught, ".") == []
        assert steps(tmp_path / "l.jsonl") == [*range(10), *range(5)]
    finally:
        release(logger, gate)


def test_write_report_counts():
    report = WriteReport(writes=9, dropped_full=1, dropped_stalled=2, failed=3, abandoned=1)
    assert report.lost == 7
    assert str(WriteReport(writes=4)) == "0 of 4 write(s) were not written"
    report = WriteReport(writes=2, carried=3, abandoned=4)
    assert (report.lost, report.total) == (4, 5)
    assert str(report) == (
        "4 of 5 write(s) were not written (3 of them unwritten at the last report): "
        "4 abandoned in the stalled backend when close gave up"
    )


@pytest.mark.parametrize(
    "options, message",
    [
        ({"on_full": "wait"}, r"JsonlLogger\(on_full='wait'\): on_full must be 'block'"),
        ({"stall_timeout": 0}, r"JsonlLogger\(stall_timeout=0\): stall_timeout must be"),
        ({"stall_timeout": float("nan")}, r"stall_timeout=nan\)"),
        ({"stall_timeout": "60"}, r"stall_timeout='60'\)"),
        ({"stall_timeout": -float("inf")}, r"stall_timeout=-inf\): .*None \(or inf\)"),
    ],
)
def test_bad_policy_names_the_option(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        JsonlLogger(tmp_path / "l.jsonl", **options)


def test_policy_defaults(tmp_path):
    logger = JsonlLogger(tmp_path / "l.jsonl")
    assert (logger.on_full, logger.stall_timeout) == ("block", 60.0)
    assert (logger._sink.writer.on_full, logger._sink.writer.stall_timeout) == ("block", 60.0)
    logger = JsonlLogger(tmp_path / "l.jsonl", on_full="drop", stall_timeout=None)
    assert (logger._sink.writer.on_full, logger._sink.writer.stall_timeout) == ("drop", None)


def test_an_infinite_stall_timeout_never_gives_up(tmp_path):
    # the backend holds its first write for 1 s, with 2 writes of room behind it: the loop
    # waits for room, flush for the end, however long; nothing is dropped or said
    gate = Gate(stuck_at=0)
    logger = Stuck(tmp_path / "l.jsonl", gate=gate, stall_timeout=float("inf"))
    assert logger.stall_timeout == logger._sink.writer.stall_timeout == float("inf")
    logger._sink.writer.max_pending_bytes = 2 * SCALAR
    timer = threading.Timer(1.0, gate.release.set)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (a WriterWarning, or an OverflowError before)
            timer.start()
            start = time.monotonic()
            train(10, logger)
            logger.flush()
            took = time.monotonic() - start
            logger.close()
        assert took >= 0.9  # waited for the backend rather than dropping
        assert steps(tmp_path / "l.jsonl") == list(range(10))
        assert logger._sink.writer.report() == WriteReport()
    finally:
        timer.cancel()
        release(logger, gate)


# -- MultiLogger: a stuck and a failing backend, isolated from a healthy one -------------------


@pytest.mark.parametrize("form", ["write", "spool"])
def test_multi_logger_isolates_stuck_and_failing_backends(tmp_path, form):
    n = 60
    plain = baseline(n)
    skip = 1 if form == "spool" else 0  # the compiling call writes step -1 first
    gate = Gate(stuck_at=3 + skip)
    stuck = Stuck(tmp_path / "stuck.jsonl", gate=gate, stall_timeout=STALL)
    stuck._sink.writer.max_pending_bytes = 5 * SCALAR
    flaky, healthy = Flaky(tmp_path / "flaky.jsonl"), JsonlLogger(tmp_path / "healthy.jsonl")
    multi = MultiLogger(stuck, flaky, healthy)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            took = train(n, multi, form)  # nothing raised
            multi.close()
        assert took <= plain + STALL + SLACK, (took, plain)
        everything = list(range(n))
        assert steps(tmp_path / "healthy.jsonl")[skip:] == everything  # kept writing
        assert steps(tmp_path / "stuck.jsonl")[skip:] == [0, 1, 2]
        got = steps(tmp_path / "flaky.jsonl")[skip:]
        assert got == sorted(got) and not {s for s in got if s % 7 == 3}
        # exactly what was lost, as the files say; the healthy logger lost nothing
        lost = n - len(got)
        assert sorted(messages(caught, "were not written")) == [
            f"Flaky: {lost} of {n + skip} write(s) were not written: {lost} lost to backend "
            "errors (raised or skipped after one).",
            f"Stuck: {n - 3} of {n + skip} write(s) were not written: {n - 3 - 5} dropped "
            "while the backend was stalled, 5 abandoned in the stalled backend when close "
            "gave up.",
        ]
        isolated = messages(caught, r"logger 1 \(Flaky\) failed and is isolated")
        assert 1 <= len(isolated) <= 2  # once per period: the loop, and possibly close
        assert "503" in isolated[0] and "the other loggers keep writing" in isolated[0]
        assert not messages(caught, "logger 2|JsonlLogger:")
    finally:
        release(stuck, gate)


# -- a full disk (RLIMIT_FSIZE in a child process): isolated in a MultiLogger -------------------

_FULL_DISK_CHILD = textwrap.dedent(
    """
    import resource, sys
    import jax, jax.numpy as jnp
    import eqx_logs
    from eqx_logs.loggers import ConsoleLogger, JsonlLogger, MultiLogger

    def train_step(params, step):
        loss = jnp.mean(params ** 2)
        eqx_logs.log("loss", loss, step=step)
        return params * jnp.float32(0.99)

    step_fn = jax.jit(eqx_logs.spool(train_step))
    params = jnp.ones(8, jnp.float32)
    step_fn(params, jnp.int32(0))  # compiled before the limit
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    logger = MultiLogger(JsonlLogger(sys.argv[1], fsync_every=0), ConsoleLogger())
    for i in range(int(sys.argv[3])):
        params, logs = step_fn(params, jnp.int32(i))
        logger.write(logs)
    logger.close()
    print("finished", flush=True)
    """
)


def test_a_full_disk_is_isolated_and_counted(tmp_path):
    path, n = tmp_path / "l.jsonl", 300
    child = subprocess.run(
        [sys.executable, "-c", _FULL_DISK_CHILD, str(path), "3000", str(n)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    lines = child.stdout.splitlines()
    assert lines[-1] == "finished"
    # the console's lines, `step=<i>  loss=<value>`: every step
    assert [int(line.split("step=")[1].split()[0]) for line in lines[:-1]] == list(range(n))
    got = steps(path)
    assert 0 < len(got) < n and got == list(range(len(got)))  # a whole prefix, in order
    lost = n - len(got)
    assert (
        f"JsonlLogger: {lost} of {n} write(s) were not written: {lost} lost to backend errors"
        in child.stderr
    ), child.stderr[-3000:]
    assert "logger 0 (JsonlLogger) failed and is isolated" in child.stderr
    assert "File too large" in child.stderr
    assert "ConsoleLogger:" not in child.stderr
