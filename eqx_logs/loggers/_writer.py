"""The background writer: one thread per logger, writing in submission order."""

import atexit
import collections
import dataclasses
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal

from .._warn import warn_user

_live: "weakref.WeakSet[Writer]" = weakref.WeakSet()

# What may wait in a writer's queue before `on_full` applies.
MAX_PENDING_BYTES = 256 * 2**20
# A write of arrays waits up to LINGER seconds for BATCH of them, fetched together.
LINGER, BATCH = 0.02, 64
# Seconds without progress after which a busy backend counts as stalled.
STALL_TIMEOUT = 60.0
ON_FULL = ("block", "drop")


class WriterError(RuntimeError):
    """A logger's backend failed on its writer thread. Raised on the next call into the
    logger (a `MultiLogger` reports it as a `WriterWarning` instead and keeps writing); events
    submitted after the failure were not written. `lost` is the number of writes it cost: the
    one that raised and those skipped after it."""

    lost: int = 0


class WriterWarning(RuntimeWarning):
    """Writes were not written, or a backend stalled: a full queue under `on_full="drop"`, a
    backend that made no progress for `stall_timeout` seconds, or (in a `MultiLogger`) a
    backend that raised and was isolated. The message gives the exact counts."""


@dataclasses.dataclass(frozen=True)
class WriteReport:
    """What became of the writes submitted to one logger since its last `flush` or `close`.

    - `writes`: writes submitted;
    - `dropped_full`: dropped because the queue was full (`on_full="drop"`);
    - `dropped_stalled`: dropped because the backend was stalled;
    - `failed`: raised in the backend, or skipped after it raised (`WriterError`);
    - `abandoned`: still queued, or inside the stuck backend call, when `close` gave up.
    """

    writes: int = 0
    dropped_full: int = 0
    dropped_stalled: int = 0
    failed: int = 0
    abandoned: int = 0

    @property
    def lost(self) -> int:
        """Writes not written."""
        return self.dropped_full + self.dropped_stalled + self.failed + self.abandoned

    def __str__(self) -> str:
        parts = [
            (self.dropped_full, "dropped while the queue was full (on_full='drop')"),
            (self.dropped_stalled, "dropped while the backend was stalled"),
            (self.failed, "lost to backend errors (raised or skipped after one)"),
            (self.abandoned, "abandoned in the stalled backend when close gave up"),
        ]
        detail = ", ".join(f"{n} {what}" for n, what in parts if n)
        return f"{self.lost} of {self.writes} write(s) were not written" + (
            f": {detail}" if detail else ""
        )


class Writer:
    """Runs `write(item)` for every submitted item on one daemon thread, in order.

    - An item may come with `ready(item)`, run on the thread first: waiting there (for the
      device to finish computing the arrays an item holds) is not the backend's time, so it
      never counts towards a stall, and the stall clock starts when it returns.
    - `notify(message, category)` (from the thread) keeps a warning for the next `check`,
      which issues it on the caller's thread, attributed to the user's call.

    - An exception in `write` is kept and raised (as the cause of a `WriterError`) by the next
      `check`, `submit`, `flush` or `close`; later items are counted and skipped rather than
      written, so nothing is dropped silently.
    - The queue is bounded by size (`max_pending_bytes`). When an item does not fit,
      `on_full="block"` waits for room while the backend makes progress, and
      `on_full="drop"` drops the item at once (counted; warned once per report).
    - The backend is *stalled* when it has work and has finished nothing for `stall_timeout`
      seconds (measured from its last finished item, or from when work arrived while it was
      idle). A stalled backend is reported with a `WriterWarning`, and every item submitted
      while it stays stalled is dropped (counted) instead of waiting or queueing. So a
      producer never waits longer than `stall_timeout` for a stuck backend. `None`: never.
    - `flush` waits until everything submitted before it is written (at most until the
      backend stalls); `close` also runs `finish` on the thread (closing files and runs), and
      gives up on a stalled backend (what is still queued is abandoned, counted). Both report
      what was lost since the last report (`WriterWarning`, exact counts), then `check`. Both
      are safe to call from any thread, while other threads submit. A process that exits
      normally closes every live writer first (`atexit`).
    """

    def __init__(
        self,
        name: str,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        *,
        on_full: Literal["block", "drop"] = "block",
        stall_timeout: float | None = STALL_TIMEOUT,
    ):
        self.name = name
        self.max_pending_bytes = max_pending_bytes
        self.on_full = on_full
        self.stall_timeout = stall_timeout
        self.finish: Callable[[], None] | None = None  # set by the owner: closes its runs
        self.write_logs: Callable[[Any], None] | None = None  # set by the owner
        self.memo: dict[Any, Any] = {}  # the owner's, for what it works out once
        self.handles: dict[int, Any] = {}  # per-run backend state, used on the thread only
        self._changed = threading.Condition()  # guards everything below
        self._items: collections.deque = collections.deque()
        self._pending_bytes = 0
        self._submitted = 0  # items ever queued; the thread has finished the first `_done`
        self._done = 0
        self._thread: threading.Thread | None = None  # one at a time, set under the lock
        self._closed = False  # the thread exits once idle
        self._error: BaseException | None = None
        self._error_lost = 0  # writes lost to `_error`: the one that raised, then the skipped
        self._skipped = 0
        self._progress = time.monotonic()  # the backend's last finished item (or new work)
        self._writing = False  # the item in the backend now is a write (not `finish`)
        self._stalled_since: float | None = None  # while reported as stalled
        self._counts = collections.Counter()  # this report's WriteReport fields
        self._warned_full = False
        self._waiting = False  # the thread waits in an item's `ready` (for the device)
        self._hurry = 0  # callers waiting for everything to be written: no lingering
        self._notices: list[tuple[str, type[Warning]]] = []
        _live.add(self)

    def __repr__(self) -> str:
        return f"Writer({self.name!r})"

    def submit(
        self,
        write: Callable[[Any], None],
        item: Any,
        size: int = 0,
        ready: Callable[[list[Any]], list[Any]] | None = None,
    ) -> None:
        """Queue `write(item)`; `size` is roughly how many bytes `item` holds. Safe to call
        from any thread (JAX runs host callbacks on its own threads). Waits for room only
        under `on_full="block"`, and never longer than the backend takes to stall.

        With `ready`, `write` gets what `ready` made of `item` instead: `ready` takes a list
        of items and returns a list, and gets every item queued in a row with the same
        `ready` at once (one transfer from the device for all of them)."""
        if ready is not None:
            write, item = _Prepared(write, ready), _Slot(item)
        self._put(write, item, size, always=False)

    def notify(self, message: str, category: type[Warning]) -> None:
        """Keep a warning for the caller's next `check` (from the writer thread)."""
        with self._changed:
            self._notices.append((message, category))

    def _fits(self, size: int) -> bool:
        # an item larger than the bound still goes, alone
        return not self._pending_bytes or self._pending_bytes + size <= self.max_pending_bytes

    def _stalled(self, now: float) -> bool:
        """Busy, with nothing finished for `stall_timeout` seconds (under the lock)."""
        if self.stall_timeout is None or self._done >= self._submitted or self._waiting:
            return False
        return now - self._progress >= self.stall_timeout

    def _stall_message(self, now: float) -> str | None:
        """Mark the backend stalled; the message the first time (under the lock)."""
        if self._stalled_since is not None:
            return None
        self._stalled_since = self._progress
        return (
            f"{self.name}: the backend has made no progress for {now - self._progress:.1f} s "
            f"(stall_timeout={self.stall_timeout}): it is stuck inside a write, with "
            f"{self._submitted - self._done} item(s) not yet written. New writes are dropped "
            "and counted, without waiting, until it makes progress again; flush() and close() "
            "report how many. Raise `stall_timeout` for a backend that is slow but alive."
        )

    def _put(self, write, item, size: int, *, always: bool) -> None:
        message = None
        with self._changed:
            if not always:
                self._counts["writes"] += 1
                if self._error is not None:
                    self._skipped += 1
                    self._error_lost += 1
                    self._counts["failed"] += 1
                    return
                now = time.monotonic()
                while not self._stalled(now) and not self._fits(size):
                    if self.on_full == "drop":
                        self._counts["dropped_full"] += 1
                        if not self._warned_full:
                            self._warned_full = True
                            message = (
                                f"{self.name}: the write queue is full ({self._pending_bytes} "
                                f"bytes waiting, max_pending_bytes={self.max_pending_bytes}) "
                                "and on_full='drop': writes that do not fit are dropped and "
                                "counted; flush() and close() report how many."
                            )
                        break
                    # on_full="block": wait for room while the backend makes progress
                    left = (
                        None
                        if self.stall_timeout is None or self._waiting  # (for the device)
                        else (self._progress + self.stall_timeout - now)
                    )
                    self._changed.wait(left)
                    now = time.monotonic()
                else:
                    if self._stalled(now):
                        self._counts["dropped_stalled"] += 1
                        message = self._stall_message(now)
                    else:
                        self._append(write, item, size, always, now)
            else:
                self._append(write, item, size, always, time.monotonic())
        if message is not None:
            warn_user(message, WriterWarning)

    def _append(self, write, item, size: int, always: bool, now: float) -> None:
        if self._done >= self._submitted:  # idle until now: the stall clock starts here
            self._progress = now
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._loop, name=f"eqx_logs-{self.name}", daemon=True
            )
            self._thread.start()
        self._closed = False
        self._items.append((write, item, size, always))
        self._pending_bytes += size
        self._submitted += 1
        if len(self._items) in (1, BATCH) or always:  # the thread waits for one, or a batch
            self._changed.notify_all()

    def _loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._items or self._closed)
                head = self._items[0] if self._items else None
                if head and isinstance(head[0], _Prepared) and head[1].value is _UNSET:
                    # arrays to fetch: let a few more steps' queue up behind them, to fetch
                    # them together, unless someone waits for them (once a batch: those
                    # fetched with an earlier item are written at once)
                    self._changed.wait_for(self._enough, LINGER)
                if not self._items:  # closed and idle: a later submit starts a new thread
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                write, item, size, always = self._items.popleft()
                self._writing = not always
                batch = []
                if isinstance(write, _Prepared) and item.value is _UNSET:
                    batch = [item]  # with those queued behind it that the same `ready` makes
                    for w, slot, *_ in self._items:
                        if w != write or slot.value is not _UNSET:
                            break
                        batch.append(slot)
            recovered = None
            try:
                if isinstance(write, _Prepared):
                    if batch and self._error is None:
                        self._ready(write.ready, batch)
                    write, item = write.write, item.get()
                if self._error is None or always:  # closing runs even after an error
                    write(item)
                else:
                    with self._changed:
                        self._skipped += 1
                        self._error_lost += 1
                        self._counts["failed"] += 1
            except BaseException as e:  # kept for the caller; nothing is swallowed
                with self._changed:
                    if self._error is None:
                        self._error = e
                        self._error_lost = 0
                    if not always:
                        self._error_lost += 1
                        self._counts["failed"] += 1
            finally:
                with self._changed:
                    self._pending_bytes -= size
                    self._done += 1
                    self._writing = False
                    now = self._progress = time.monotonic()
                    if self._stalled_since is not None:
                        recovered = now - self._stalled_since
                        self._stalled_since = None
                    self._changed.notify_all()
            if recovered is not None:
                self.notify(
                    f"{self.name}: the backend made progress again after {recovered:.1f} s "
                    "stalled; writes are queued again (flush() and close() report how many "
                    "were dropped).",
                    WriterWarning,
                )

    def _enough(self) -> bool:
        return len(self._items) >= BATCH or self._hurry > 0 or self._closed

    def _ready(self, ready: Callable[[list[Any]], list[Any]], slots: list["_Slot"]) -> None:
        """Fill `slots` with `ready` of their items, outside the stall clock, which starts
        anew when it returns. An error is the first slot's (the others are tried again)."""
        with self._changed:
            self._waiting = True
        try:
            for slot, value in zip(slots, ready([slot.item for slot in slots]), strict=True):
                slot.item, slot.value = None, value  # (the device's buffers are let go)
        except BaseException as e:  # noqa: BLE001 (raised by the first slot's write)
            slots[0].value = _Failed(e)
        finally:
            with self._changed:
                self._waiting = False
                self._progress = time.monotonic()
                self._changed.notify_all()  # waiters' stall deadlines start now

    @property
    def pending_bytes(self) -> int:
        """Bytes submitted and not yet written."""
        return self._pending_bytes

    def check(self) -> None:
        """Issue the warnings the thread kept (`notify`); raise the writer's error, if its
        thread has hit one."""
        if not self._notices and self._error is None:  # (called every step: no lock)
            return
        with self._changed:
            notices, self._notices = self._notices, []
        for message, category in notices:
            warn_user(message, category)
        with self._changed:
            error, skipped, lost = self._error, self._skipped, self._error_lost
            if error is None:
                return
            self._error, self._skipped, self._error_lost = None, 0, 0
        failure = WriterError(
            f"{self.name} failed while writing: {error!r}. {skipped} later write(s) were "
            "skipped. The logger keeps working for new calls."
        )
        failure.lost = lost
        raise failure from error

    def _wait(self) -> bool:
        """Wait until everything submitted so far is written, or the backend stalls. True if
        everything was written."""
        with self._changed:
            target = self._submitted
            self._hurry += 1
            self._changed.notify_all()
            try:
                return self._wait_for(target)
            finally:
                self._hurry -= 1

    def _wait_for(self, target: int) -> bool:
        """(`_wait`, under the lock.)"""
        while self._done < target:
            if self.stall_timeout is None or self._waiting:  # (for the device)
                self._changed.wait()
                continue
            left = self._progress + self.stall_timeout - time.monotonic()
            if left <= 0:
                return False
            self._changed.wait(left)
        return True

    def _gave_up(self, during: str, *, abandon: bool) -> str | None:
        """`flush` or `close` stopped waiting for a stalled backend: mark it stalled and, when
        closing, abandon what is queued (counted). The message to warn with."""
        with self._changed:
            if self._done >= self._submitted:  # finished after all
                return None
            now = time.monotonic()
            self._stall_message(now)
            waiting = self._submitted - self._done
            message = (
                f"{self.name}: {during} gave up waiting for a backend that has made no "
                f"progress for {now - self._progress:.1f} s (stall_timeout="
                f"{self.stall_timeout}); {waiting} item(s) not written"
            )
            if not abandon:
                return message + " (they are written if it recovers)."
            abandoned = sum(not always for *_, always in self._items) + self._writing
            self._counts["abandoned"] += abandoned
            while self._items:
                *_, size, _ = self._items.popleft()
                self._pending_bytes -= size
                self._done += 1
            self._writing = False  # counted now; if the call ever returns, not again
            self._changed.notify_all()
            return message + f", {abandoned} write(s) of them abandoned."

    def report(self) -> WriteReport:
        """What became of the writes since the last report (which this one starts anew)."""
        with self._changed:
            counts, self._counts = self._counts, collections.Counter()
            self._warned_full = False
        return WriteReport(**counts)

    def _report(self) -> None:
        report = self.report()
        if report.lost:
            warn_user(f"{self.name}: {report}.", WriterWarning)

    def flush(self) -> None:
        """Wait until everything submitted so far is written (at most until the backend
        stalls), report what was lost (`WriterWarning`), then `check`."""
        if not self._wait() and (message := self._gave_up("flush", abandon=False)):
            warn_user(message, WriterWarning)
        self._report()
        self.check()

    def close(self) -> None:
        """Flush, run `finish()` on the writer thread (closing files and runs), report, `check`.
        A stalled backend is given up on: what it has not written is abandoned and counted,
        and its files are left as they are. Writes submitted later reopen what they need."""
        if self._thread is not None and self.finish is not None:
            finish = self.finish
            self._put(lambda _: finish(), None, 0, always=True)
        written = self._wait()
        if not written and (message := self._gave_up("close", abandon=True)):
            warn_user(message, WriterWarning)
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if written and thread is not None and thread is not threading.current_thread():
            # an idle thread ends now: none is left inside JAX (fetching arrays) when the
            # interpreter exits, which jaxlib may abort on
            thread.join(timeout=10)
        self._report()
        self.check()


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A write whose item is first made ready (`Writer.submit(..., ready=)`)."""

    write: Callable[[Any], None]
    ready: Callable[[list[Any]], list[Any]]


_UNSET = object()


@dataclasses.dataclass(frozen=True)
class _Failed:
    error: BaseException


@dataclasses.dataclass
class _Slot:
    """The item of a `_Prepared` write, and (once made) what `ready` made of it."""

    item: Any
    value: Any = _UNSET

    def get(self) -> Any:
        if isinstance(self.value, _Failed):
            raise self.value.error
        return self.value


@atexit.register
def _flush_all() -> None:
    if not _live:
        return
    try:  # host callbacks still queued in JAX submit their writes first
        import jax

        jax.effects_barrier()
    except Exception:  # noqa: BLE001, S110 (the backend may be gone at exit)
        pass
    for writer in list(_live):
        try:
            writer.close()
        except Exception:  # noqa: BLE001, S110 (reported already, or the process is exiting)
            pass
