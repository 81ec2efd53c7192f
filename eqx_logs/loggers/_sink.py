"""`AbstractLogger`'s plumbing: logs handed to its writer thread, checked for what the
backend can store, and written there, run by run. The methods are defined here and assigned
in the class body (`_write_logs = _plumbing._write_logs`); what runs for every step calls
them through the class (see there)."""

import functools
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from .._logdict import LogDict
from ._host import Record, flat_items, host_array, records, to_host
from ._packed import Layout, Packed, stand_in
from ._state import LoggerState
from ._transfer import _fetch, _leaves, _nbytes
from ._writer import Writer

_NONFINITE_RUNS = "nonfinite-runs"  # `Writer.memo`'s key: the runs reported non-finite


class NonfiniteWarning(RuntimeWarning):
    """A spooled call's logs held a NaN or an infinity (`first_nonfinite=True`): the message
    names the first such event."""


def _spool_host(self, state: LoggerState, logs: LogDict) -> None:
    # a host callback: raise a pending writer error, so that inside `jax.jit` too it
    # surfaces from the next call (as a JaxRuntimeError naming the WriterError)
    cls = type(self)
    cls._submit_logs(self, state, logs)
    cls._check(self)


def _tap_host(self, state: LoggerState, logs: dict[str, Any], steps: dict[str, Any]) -> None:
    _submit_rows(self, state, _event_rows(logs, steps))


def _tap_block_host(self, state: LoggerState, logs: dict[str, Any], steps: dict[str, Any]) -> None:
    """`_tap_host` for a block of events (`logger.tap(..., buffer=k)`): every value and step
    has a leading axis of events; the block is submitted as one write, event by event."""
    n = len(jax.tree.leaves(logs)[0])
    rows = []
    for i in range(n):
        at_i = jax.tree.map(lambda x, i=i: x[i], (logs, steps))
        rows += _event_rows(*at_i)
    _submit_rows(self, state, rows)


def _event_rows(logs: dict[str, Any], steps: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one tapped event: one per key, with the event's steps."""
    return [{"key": key, "value": value, **steps} for key, value in logs.items()]


def _submit_rows(self, state: LoggerState, rows: list[dict[str, Any]]) -> None:
    cls = type(self)
    cls._submit(self, int(state.run), rows)
    cls._check(self)


def _unstorable(self, leaf: np.ndarray) -> str | None:
    """Why this backend cannot store `leaf` (a value's array, as by `host_array`), or
    None. Checked before writing: a key it rejects is named, and the others are written."""
    del leaf
    return None


def _started(self) -> Writer:
    writer = self._writer
    if writer.finish is None:
        writer.name = type(self).__name__
        writer.finish = functools.partial(type(self)._finish, self)
        writer.write_logs = functools.partial(type(self)._write_logs, self)
        writer.fetch = functools.partial(_fetch, opened=writer.handles)
    return writer


def _submit_logs(self, state: LoggerState, logs: LogDict | Packed, size: int | None = None) -> None:
    """Hand `logs` (arrays, on the device or not, or packed by `logger.jit`; `size`
    bytes in all) to the writer thread, which fetches them (`_fetch`) and writes them
    (`_write_logs`). Values the backend cannot store are named here, from their types
    and shapes."""
    cls = type(self)
    writer = cls._started(self)
    rejected = {}
    if isinstance(logs, Packed):  # the same for every call of a step
        rejected = _rejected_layout(self, logs.layout)
    elif cls._unstorable is not _unstorable:  # a backend that checks
        rejected = cls._rejected_logs(self, logs)
        if rejected:
            logs, size = logs._without(rejected), None
    if size is None:
        size = _nbytes(logs)
    drop = tuple(rejected) if isinstance(logs, Packed) else ()
    writer.submit(writer.write_logs, (state.run, logs, drop), size, ready=writer.fetch)
    _reject(self, rejected)


def _rejected_layout(self, layout: Layout) -> dict[str, str]:
    """`_rejected_logs` of the packed logs of `layout` (the same for every call of a step)."""
    if type(self)._unstorable is _unstorable:  # a backend that does not check
        return {}
    return type(self)._rejected_logs(self, stand_in(layout))


class Feed:
    """Hands a `logger.jit` step's packed logs to the writer thread (in a single-process run),
    every call: what is the same for each call is worked out once (the writer, the run
    indices on the host, the keys the backend cannot store, per layout). A plain class: it
    runs once per training step, and its cost is the loop's."""

    __slots__ = ("logger", "state", "writer", "runs", "layout", "rejected", "drop")

    def __init__(self, logger: Any, state: LoggerState):
        self.logger, self.state = logger, state
        self.writer = self.runs = self.layout = None
        self.rejected: dict[str, str] = {}
        self.drop: tuple[str, ...] = ()

    def __call__(self, packed: Packed) -> None:
        writer = self.writer
        if writer is None:
            writer = self.writer = type(self.logger)._started(self.logger)
            self.runs = to_host(self.state.run)
        writer.check()
        if packed.layout is not self.layout:
            self.rejected = _rejected_layout(self.logger, packed.layout)
            self.layout, self.drop = packed.layout, tuple(self.rejected)
        item = (self.runs, packed, self.drop)
        writer.submit(writer.write_logs, item, packed.layout.nbytes, ready=writer.fetch)
        if self.rejected:
            _reject(self.logger, self.rejected)


def _rejected_logs(self, logs: LogDict) -> dict[str, str]:
    """`_rejected` of the rows of `logs`, from their leaves' types and shapes alone."""

    def row(key: str, leaf: Any) -> np.ndarray:
        shape = np.shape(leaf)[1:] if key in logs.rows else np.shape(leaf)
        return np.broadcast_to(host_array(np.zeros((), leaf.dtype)), shape)

    leaves = ((k, row(k, x)) for k, v in logs.items() for x in _leaves(v))
    return type(self)._rejected(self, leaves)


def _submit(self, run: int, rows: list[Record]) -> None:
    """Hand records of host values (tap's events) to the writer thread."""
    cls = type(self)
    writer = cls._started(self)
    rejected = {}
    if cls._unstorable is not _unstorable:
        leaves = ((r["key"], x) for r in rows for _, x in flat_items(r["key"], r["value"]))
        rejected = cls._rejected(self, leaves)
        rows = [r for r in rows if r["key"] not in rejected]
    size = sum(np.asarray(x).nbytes for r in rows for x in jax.tree.leaves(r["value"]))
    writer.submit(functools.partial(cls._write_run, self), (run, rows), size)
    _reject(self, rejected)


def _rejected(self, leaves: Iterable[tuple[str, np.ndarray]]) -> dict[str, str]:
    """The keys among `(key, leaf)` whose leaf the backend cannot store, and why."""
    unstorable = type(self)._unstorable
    return {key: why for key, leaf in leaves if (why := unstorable(self, leaf)) is not None}


def _write_logs(self, item: tuple[np.ndarray, LogDict | None]) -> None:
    """On the writer thread: write fetched logs (`_fetch`), one run per lane of a state
    under `vmap` (a run written nothing is opened all the same); keep the
    `first_nonfinite` report for the caller."""
    runs, logs = item
    writer = self._writer
    for lane in np.ndindex(runs.shape):
        run = int(runs[lane])
        if logs is None:  # no events
            if run not in writer.handles:
                type(self)._write_run(self, (run, []))
            continue
        lane_logs = jax.tree.map(lambda x: x[lane], logs) if lane else logs
        rows = list(records(lane_logs, writer.notify))
        if rows or run not in writer.handles:
            type(self)._write_run(self, (run, rows))
        if lane_logs._nonfinite is not None and (event := lane_logs.first_nonfinite):
            # one report per run: a NaN carries on through the steps after it
            reported = writer.memo.setdefault(_NONFINITE_RUNS, set())
            if run not in reported:
                reported.add(run)
                writer.notify(
                    f"{type(self).__name__} (run {run}): {event}. Later non-finite "
                    "values of this run are not reported.",
                    NonfiniteWarning,
                )


def _write_run(self, item: tuple[int, list[Record]]) -> None:
    run, rows = item
    handles = self._writer.handles
    if run not in handles:
        handles[run] = self._open(run)
    self._write(handles[run], run, rows)


def _finish(self) -> None:
    handles = self._writer.handles
    while handles:
        _, handle = handles.popitem()
        self._close(handle)


def _reject(logger: Any, rejected: dict[str, str]) -> None:
    if rejected:
        raise ValueError(
            f"{type(logger).__name__} cannot store "
            + "; ".join(f"key {k!r}: {why}" for k, why in rejected.items())
            + ". The other keys of this write were written."
        )
