"""A logger's sink: where its logs go. A plain object per logger, shared by its copies,
holding its writer thread, its runs' handles and what its backend works out once; it checks
logs for what the backend can store, hands them to the writer thread, and writes them there,
run by run, through the backend's methods (`Backend`). `MultiLogger`'s sink fans out to its
loggers' sinks (`_multi.py`).

A logger (an Equinox module) calls its sink; what runs for every step is here, in plain
classes: Equinox hands out each bound method of a module as a module of its own, which costs
about 30 us to build, as much as a small training step."""

import abc
import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any, Literal, Protocol

import jax
import numpy as np

from .._logdict import LogDict
from ._host import Record, event_value, flat_items, host_array, records, to_host
from ._packed import Layout, Packed, stand_in, without_checks
from ._prepared import Many
from ._rows import HostRows
from ._state import LoggerState
from ._transfer import fetch_writes, host_leaves, nbytes_of
from ._writer import Writer

_NONFINITE_RUNS = "nonfinite-runs"  # `Sink.memo`'s key: the runs reported non-finite


class NonfiniteWarning(RuntimeWarning):
    """A spooled call's logs held a NaN or an infinity (`first_nonfinite=True`): the message
    names the first such event."""


class SubmitLogs(Protocol):
    """`AbstractLogger._submit_logs`: hand `logs` (`size` bytes, or None: worked out) to the
    writer thread."""

    def __call__(
        self, state: LoggerState, logs: LogDict | Packed, size: int | None = None
    ) -> None: ...


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a sink calls of its logger: the backend's methods (`open`, `write`, `close`, run
    on the writer thread; `unstorable`, on the caller's), bound through the logger's class,
    and the writer's policy. `write_many(handle, run, [records, ...])`, where the backend has
    one (`_write_many`), writes the records of several writes of a run, in order, at once;
    None: one `write` per write."""

    name: str  # the logger's class, for messages
    on_full: Literal["block", "drop"]
    stall_timeout: float | None
    open: Callable[[int], Any]
    write: Callable[[Any, int, list[Record]], None]
    close: Callable[[Any], None]
    unstorable: Callable[[np.ndarray], str | None] | None  # None: the backend stores any leaf
    submit_logs: SubmitLogs | None  # the logger's own `_submit_logs`, where it overrides it
    write_many: Callable[[Any, int, list[list[Record]]], None] | None = None


class AbstractSink(abc.ABC):
    """Where a logger hands its logs: `submit` (a spooled call's, or a `logger.jit` step's
    packed), `submit_rows` (tapped events), `feed` (every call of a `logger.jit` step);
    `check` raises the writer's error; `flush`, `close`. The host callbacks of `logger.spool`
    and `logger.tap` are its methods too."""

    # `submit_logs`, or the logger's `_submit_logs` where it overrides it (see `bind`)
    submit: SubmitLogs
    # what the backend works out once (which files were given the config), by key
    memo: dict[str, Any]

    @abc.abstractmethod
    def bind(self, backend: Backend) -> None:
        """Write through `backend` (when a logger is made, or copied with a config)."""

    @abc.abstractmethod
    def submit_logs(
        self, state: LoggerState, logs: LogDict | Packed, size: int | None = None
    ) -> None:
        """Hand `logs` (arrays, on the device or not, or packed by `logger.jit`; `size`
        bytes in all) to the writer thread."""

    @abc.abstractmethod
    def submit_rows(self, run: int, rows: list[Record]) -> None:
        """Hand records of host values (tap's events) to the writer thread."""

    @abc.abstractmethod
    def feed(self, state: LoggerState) -> Callable[[Packed], None]:
        """What hands the packed logs of each `logger.jit` call to the writer thread."""

    @abc.abstractmethod
    def check(self) -> None:
        """Issue the writer's warnings; raise its error."""

    @abc.abstractmethod
    def flush(self) -> None:
        """Wait until everything is written (see `AbstractLogger.flush`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush, then close every run (see `AbstractLogger.close`)."""

    def spool_host(self, state: LoggerState, logs: LogDict) -> None:
        """A host callback: `logs` of a spooled call inside compiled code. A pending writer
        error is raised here, so that inside `jax.jit` too it surfaces from the next call
        (as a JaxRuntimeError naming the WriterError)."""
        self.submit(state, logs)
        self.check()

    def tap_host(self, state: LoggerState, logs: dict[str, Any], steps: dict[str, Any]) -> None:
        """A host callback: one tapped event."""
        self.submit_rows(int(state.run), _event_rows(logs, steps))
        self.check()

    def tap_block_host(
        self, state: LoggerState, logs: dict[str, Any], steps: dict[str, Any]
    ) -> None:
        """`tap_host` for a block of events (`logger.tap(..., buffer=k)`): every value and step
        has a leading axis of events; the block is submitted as one write, event by event."""
        leaves = jax.tree.leaves((logs, steps))
        n = len(leaves[0]) if leaves else 1  # (keys with no value, no step: one event)
        rows = []
        for i in range(n):
            at_i = jax.tree.map(lambda x, i=i: x[i], (logs, steps))
            rows += _event_rows(*at_i)
        self.submit_rows(int(state.run), rows)
        self.check()


def _event_rows(logs: dict[str, Any], steps: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one tapped event: one per key, with the event's steps."""
    return [{"key": key, "value": event_value(value), **steps} for key, value in logs.items()]


class Sink(AbstractSink):
    """A backend's sink: its writer thread (`writer`), the handles of its open runs (run ->
    what `Backend.open` returned; used on the writer thread only) and `memo`. One per
    logger, shared by its copies (`AbstractLogger._with_config`), so that they write through
    one queue to the same runs."""

    backend: Backend  # (set by `bind`, when the logger is made)

    def __init__(self):
        self.handles: dict[int, Any] = {}
        self.memo = {}
        self.submit = self.submit_logs
        self.many: Many | None = None  # (set by `bind`)
        self.writer = Writer("logger", finish=self._finish)
        # the writer thread's fetch of the writes queued in a row (`Writer.submit`'s `ready`)
        self._ready = functools.partial(fetch_writes, opened=self.handles)

    def bind(self, backend: Backend) -> None:
        self.backend, self.submit = backend, backend.submit_logs or self.submit_logs
        # the writes of a run cut from their buffers go to the backend at once, where it
        # takes them so
        has_many = backend.write_many is not None
        self.many = Many(_joins, self._write_logs_many) if has_many else None
        writer = self.writer  # (it follows the logger's policy)
        writer.name, writer.on_full = backend.name, backend.on_full
        writer.stall_timeout = backend.stall_timeout

    def check(self) -> None:
        self.writer.check()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def submit_logs(
        self, state: LoggerState, logs: LogDict | Packed, size: int | None = None
    ) -> None:
        """The writer thread fetches `logs` (`fetch_writes`) and writes them (`_write_logs`).
        Values the backend cannot store are named here, from their types and shapes. (The
        checks of `first_nonfinite="any"` are not written: `without_checks`.)"""
        rejected = {}
        if isinstance(logs, LogDict) and (checked := without_checks(logs)) is not logs:
            logs, size = checked, None
        if isinstance(logs, Packed):  # the same for every call of a step
            rejected = self.rejected_layout(logs.layout)
        elif self.backend.unstorable is not None:  # a backend that checks
            rejected = self._rejected_logs(logs)
            if rejected:
                logs, size = logs._without(rejected), None
        if size is None:
            size = nbytes_of(logs)
        drop = tuple(rejected) if isinstance(logs, Packed) else ()
        item = (state.run, logs, drop)
        self.writer.submit(self._write_logs, item, size, ready=self._ready, many=self.many)
        self.reject(rejected)

    def submit_rows(self, run: int, rows: list[Record]) -> None:
        rejected = {}
        if self.backend.unstorable is not None:
            leaves = ((r["key"], x) for r in rows for _, x in flat_items(r["key"], r["value"]))
            rejected = self._rejected(leaves)
            rows = [r for r in rows if r["key"] not in rejected]
        size = sum(np.asarray(x).nbytes for r in rows for x in jax.tree.leaves(r["value"]))
        self.writer.submit(self._write_run, (run, rows), size)
        self.reject(rejected)

    def feed(self, state: LoggerState) -> Callable[[Packed], None]:
        if self.backend.submit_logs is not None:  # the backend's own way, for every call
            return functools.partial(self._submit_packed, state)
        return Feed(self, state)

    def _submit_packed(self, state: LoggerState, packed: Packed) -> None:
        self.check()
        self.submit(state, packed, packed.layout.nbytes)

    # --- what the backend cannot store -------------------------------------------------------

    def rejected_layout(self, layout: Layout) -> dict[str, str]:
        """`_rejected_logs` of the packed logs of `layout` (the same for every call of a step)."""
        if self.backend.unstorable is None:  # a backend that does not check
            return {}
        return self._rejected_logs(stand_in(layout))

    def _rejected_logs(self, logs: LogDict) -> dict[str, str]:
        """`_rejected` of the rows of `logs`, from their leaves' types and shapes alone."""

        def row(key: str, leaf: Any) -> np.ndarray:
            shape = np.shape(leaf)[1:] if key in logs.rows else np.shape(leaf)
            return np.broadcast_to(host_array(np.zeros((), leaf.dtype)), shape)

        leaves = ((k, row(k, x)) for k, v in logs.items() for x in host_leaves(v))
        return self._rejected(leaves)

    def _rejected(self, leaves: Iterable[tuple[str, np.ndarray]]) -> dict[str, str]:
        """The keys among `(key, leaf)` whose leaf the backend cannot store, and why."""
        unstorable = self.backend.unstorable
        assert unstorable is not None
        return {key: why for key, leaf in leaves if (why := unstorable(leaf)) is not None}

    def reject(self, rejected: dict[str, str]) -> None:
        """Raise naming the keys the backend cannot store, if any."""
        if rejected:
            raise ValueError(
                f"{self.backend.name} cannot store "
                + "; ".join(f"key {k!r}: {why}" for k, why in rejected.items())
                + ". The other keys of this write were written."
            )

    # --- on the writer thread ----------------------------------------------------------------

    def _write_logs(self, item: tuple[np.ndarray, LogDict | HostRows | None]) -> None:
        """Write fetched logs (`fetch_writes`), one run per lane of a state under `vmap` (a run
        written nothing is opened all the same); keep the `first_nonfinite` report for the
        caller."""
        runs, logs = item
        writer = self.writer
        for lane in np.ndindex(runs.shape):
            run = int(runs[lane])
            if logs is None:  # no events
                if run not in self.handles:
                    self._write_run((run, []))
                continue
            if isinstance(logs, HostRows):  # (one lane, no `first_nonfinite` report)
                rows = logs.records(writer.notify)
                if rows or run not in self.handles:
                    self._write_run((run, rows))
                continue
            lane_logs = jax.tree.map(lambda x: x[lane], logs) if lane else logs
            rows = list(records(lane_logs, writer.notify))
            if rows or run not in self.handles:
                self._write_run((run, rows))
            if lane_logs._nonfinite is not None and (event := lane_logs.first_nonfinite):
                # one report per run: a NaN carries on through the steps after it
                reported = self.memo.setdefault(_NONFINITE_RUNS, set())
                if run not in reported:
                    reported.add(run)
                    writer.notify(
                        f"{self.backend.name} (run {run}): {event}. Later non-finite "
                        "values of this run are not reported.",
                        NonfiniteWarning,
                    )

    def _write_logs_many(self, items: list[tuple[np.ndarray, HostRows]]) -> None:
        """`_write_logs` of each of `items` (fetched together, of one run, their records
        cut from their buffers: see `_joins`), in order, through the backend's `write_many`
        at once."""
        run, notify = int(items[0][0]), self.writer.notify
        writes = []
        for _, logs in items:
            rows = logs.records(notify)
            if rows or (not writes and run not in self.handles):  # (a write opens its run)
                writes.append(rows)
        if not writes:
            return
        if run not in self.handles:
            self.handles[run] = self.backend.open(run)
        write_many = self.backend.write_many
        assert write_many is not None
        write_many(self.handles[run], run, writes)

    def _write_run(self, item: tuple[int, list[Record]]) -> None:
        run, rows = item
        handles = self.handles
        if run not in handles:
            handles[run] = self.backend.open(run)
        self.backend.write(handles[run], run, rows)

    def _finish(self) -> None:
        """`Writer.close`'s last write: close every run."""
        handles = self.handles
        while handles:
            _, handle = handles.popitem()
            self.backend.close(handle)


def _joins(item: Any) -> int | None:
    """`Many.joins` of a fetched `logger.jit` write (`fetch_writes`): its run where its records
    are cut from its buffers (`HostRows`, one lane); None otherwise (written alone)."""
    runs, logs = item
    return int(runs) if isinstance(logs, HostRows) else None


class Feed:
    """Hands a `logger.jit` step's packed logs to the writer thread (in a single-process run),
    every call: what is the same for each call is worked out once (the run indices on the
    host, the keys the backend cannot store, per layout). A write of a step that logs
    nothing (a layout without leaves) is handed over once, to open the runs, and then not
    at all. A plain class: it runs once per training step, and its cost is the loop's."""

    __slots__ = (
        "sink",
        "state",
        "writer",
        "write",
        "ready",
        "many",
        "runs",
        "layout",
        "rejected",
        "drop",
        "fed",
    )

    def __init__(self, sink: Sink, state: LoggerState):
        self.sink, self.state = sink, state
        self.writer, self.write, self.ready = sink.writer, sink._write_logs, sink._ready
        self.many = sink.many
        self.runs: np.ndarray | None = None
        self.layout: Layout | None = None
        self.rejected: dict[str, str] = {}
        self.drop: tuple[str, ...] = ()
        self.fed = False  # (a write handed over: the runs are opened by it)

    def __call__(self, packed: Packed) -> None:
        writer = self.writer
        if self.runs is None:
            self.runs = to_host(self.state.run)
        writer.check()
        if self.fed and not packed.layout.places:  # (nothing logged: nothing but opening)
            return
        if packed.layout is not self.layout:
            self.rejected = self.sink.rejected_layout(packed.layout)
            self.layout, self.drop = packed.layout, tuple(self.rejected)
        item = (self.runs, packed, self.drop)
        writer.submit(self.write, item, packed.layout.nbytes, ready=self.ready, many=self.many)
        self.fed = True
        if self.rejected:
            self.sink.reject(self.rejected)
