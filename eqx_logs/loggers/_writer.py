"""The background writer: one thread per logger, writing in submission order."""

import atexit
import collections
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal

from .._warn import warn_user
from ._losses import (
    Losses,
    WriteReport,
    WriterError as WriterError,
    WriterWarning as WriterWarning,
)
from ._prepared import NOTHING, Many, Prepared, Slot, batch, done, fill, joins, unready
from ._stall import Watchdog

_live: "weakref.WeakSet[Writer]" = weakref.WeakSet()

# What may wait in a writer's queue before `on_full` applies.
MAX_PENDING_BYTES = 256 * 2**20
# A write of arrays waits up to LINGER seconds for BATCH of them, fetched together.
LINGER, BATCH = 0.02, 64
# Seconds without progress after which a busy backend counts as stalled.
STALL_TIMEOUT = 60.0
ON_FULL = ("block", "drop")


class Writer:
    """Runs `write(item)` for every submitted item on one daemon thread, in order.

    - An item may come with `ready(item)`, run on the thread first: waiting there (for the
      device to finish computing the arrays an item holds) is not the backend's time, so it
      never counts towards a stall, and the stall clock starts when it returns. What `ready`
      makes `NOTHING` (a step's logs without events) is done without a write.
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
      producer never waits longer than `stall_timeout` for a stuck backend. `None` (or
      `inf`): never stalled, waited for however long it takes.
    - `flush` waits until everything submitted before it is written (at most until the
      backend stalls); `close` also runs `finish` on the thread (closing files and runs), and
      gives up on a stalled backend (what is still queued is abandoned, counted). Both report
      what was lost since the last report (`WriterWarning`, exact counts; writes the last
      report left unwritten are counted in this one, `carried`), then `check`. Both
      are safe to call from any thread, while other threads submit. A process that exits
      normally closes every live writer first (`atexit`).
    """

    def __init__(
        self,
        name: str,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        *,
        finish: Callable[[], None],
        on_full: Literal["block", "drop"] = "block",
        stall_timeout: float | None = STALL_TIMEOUT,
    ):
        self.name = name
        self.max_pending_bytes = max_pending_bytes
        self.on_full = on_full
        self.finish = finish  # run on the thread by `close` (closes the owner's runs)
        self._prepared: dict[tuple[Any, Any], Prepared] = {}  # one per (write, ready)
        # items made ready, dropped by the next `submit`, `flush` or `close` (see `submit`)
        self._released: collections.deque = collections.deque()
        self._changed = threading.Condition()  # guards everything below
        self._items: collections.deque = collections.deque()
        self._pending_bytes = 0
        self._submitted = 0  # items ever queued; the thread has finished the first `_done`
        self._done = 0
        self._thread: threading.Thread | None = None  # one at a time, set under the lock
        self._closed = False  # the thread exits once idle
        self._writing = 0  # the writes in the backend now (0: none, or `finish`)
        self._hurry = 0  # callers waiting for everything to be written: no lingering
        self._notices: list[tuple[str, type[Warning]]] = []
        self._losses = Losses()  # what was not written; the backend's error
        self._watchdog = Watchdog(stall_timeout)  # when the backend counts as stalled
        _live.add(self)

    def __repr__(self) -> str:
        return f"Writer({self.name!r})"

    @property
    def stall_timeout(self) -> float | None:
        """Seconds without progress after which a busy backend is stalled (None, inf: never)."""
        return self._watchdog.timeout

    @stall_timeout.setter
    def stall_timeout(self, timeout: float | None) -> None:
        self._watchdog.timeout = timeout

    def submit(
        self,
        write: Callable[[Any], None],
        item: Any,
        size: int = 0,
        ready: Callable[[list[Any]], list[Any]] | None = None,
        many: Many | None = None,
    ) -> None:
        """Queue `write(item)`; `size` is roughly how many bytes `item` holds. Safe to call
        from any thread (JAX runs host callbacks on its own threads). Waits for room only
        under `on_full="block"`, and never longer than the backend takes to stall.

        With `ready`, `write` gets what `ready` made of `item` instead: `ready` takes a list
        of items and returns a list, and gets every item queued in a row with the same
        `ready` at once (one transfer from the device for all of them). The items it made
        ready are dropped by the next `submit` (or `flush`, `close`), on the caller's thread:
        freeing device buffers on the writer thread contends with the thread that allocated
        them (the training loop's) for the allocator's locks.

        With `many` too (the same for every submit of `write` and `ready`), the items made
        ready in a row that join (`Many.joins`) are written, in order, by one
        `many.write(list of what ready made of them)` rather than a `write` each; if it
        raises, every one of them is lost (counted)."""
        self._drop_released()
        if ready is not None:
            prepared = self._prepared.get((write, ready))
            if prepared is None:
                prepared = Prepared(write, ready, many)
                prepared = self._prepared.setdefault((write, ready), prepared)
            write, item = prepared, Slot(item)
        self._put(write, item, size, always=False)

    def _drop_released(self) -> None:
        released = self._released
        while released:
            released.popleft()

    def notify(self, message: str, category: type[Warning]) -> None:
        """Keep a warning for the caller's next `check` (from the writer thread)."""
        with self._changed:
            self._notices.append((message, category))

    def _fits(self, size: int) -> bool:
        # an item larger than the bound still goes, alone
        return not self._pending_bytes or self._pending_bytes + size <= self.max_pending_bytes

    def _stalled(self, now: float) -> bool:
        """Busy, with nothing finished for `stall_timeout` seconds (under the lock)."""
        return self._done < self._submitted and self._watchdog.stalled(now)

    def _put(self, write, item, size: int, *, always: bool) -> None:
        message = None
        with self._changed:
            if always:
                self._append(write, item, size, always, time.monotonic())
                return
            if not self._losses.admit():  # the backend has failed: skipped
                return
            now = time.monotonic()
            if self._fits(size) and not self._stalled(now):  # room, and the backend progresses
                self._append(write, item, size, always, now)
                return
            full = not self._fits(size) and not self._stalled(now)
            if full and self.on_full == "drop":
                message = self._losses.drop_full(
                    self.name, self._pending_bytes, self.max_pending_bytes
                )
            else:  # room: under on_full="block", waited for while the backend makes progress
                self._watchdog.wait(self._changed, lambda: self._fits(size))
                if self._stalled(now := time.monotonic()):
                    self._losses.counts["dropped_stalled"] += 1
                    unwritten = self._submitted - self._done
                    message = self._watchdog.stall(self.name, now, unwritten)
                else:
                    self._append(write, item, size, always, now)
        if message is not None:
            warn_user(message, WriterWarning)

    def _append(self, write, item, size: int, always: bool, now: float) -> None:
        if self._done >= self._submitted:  # idle until now: the stall clock starts here
            self._watchdog.progress = now
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
                if self._items and unready(*self._items[0][:2]):
                    # arrays to fetch: let a few more steps' queue up behind them, to fetch
                    # them together, unless someone waits for them (once a batch: those
                    # fetched with an earlier item are written at once)
                    self._changed.wait_for(self._enough, LINGER)
                if not self._items:  # closed and idle: a later submit starts a new thread
                    if self._thread is threading.current_thread():
                        self._thread = None
                    return
                write, item, size, always = self._items.popleft()
                self._writing = int(not always)
                slots = batch(write, item, self._items)
            more: list[tuple[Any, ...]] = []  # queued items written with this one
            try:
                if isinstance(write, Prepared):
                    if slots and self._losses.error is None:
                        # waiting for the device is not the backend's time: no stall clock
                        with self._watchdog.paused(self._changed):
                            self._released.append(fill(write.ready, slots))
                    if (joined := joins(write, item)) is not None:
                        with self._changed:
                            more = self._joining(write, joined)
                    if more:  # one write of them all: if it fails, each of them is lost
                        values = [item.value] + [slot.value for _, slot, *_ in more]
                        write, item = write.many.write, values  # type: ignore[union-attr]
                    else:
                        write, item = write.write, item.get()
                if item is NOTHING:  # (made ready as nothing to write)
                    pass
                elif self._losses.error is None or always:  # closing runs even after an error
                    write(item)
                else:
                    with self._changed:
                        self._losses.skip()
            except BaseException as e:  # kept for the caller; nothing is swallowed
                with self._changed:  # (writes abandoned by `close` are counted already)
                    self._losses.fail(e, writes=0 if always else self._writing)
            finally:
                with self._changed:
                    self._pending_bytes -= size + sum(queued[2] for queued in more)
                    self._done += 1 + len(more)
                    while self._items and done(*self._items[0][:2]):  # made ready with it
                        self._pending_bytes -= self._items.popleft()[2]
                        self._done += 1
                    self._writing = 0
                    recovered = self._watchdog.progressed(self.name)
                    self._changed.notify_all()
            if recovered is not None:
                self.notify(recovered, WriterWarning)

    def _joining(self, write: Prepared, joined: Any) -> list[tuple[Any, ...]]:
        """Take the items queued first that `write` made ready and that join `joined` (under
        the lock): they go to the backend with the one taken, at once. None once the
        backend has failed (those are skipped, one by one)."""
        taken: list[tuple[Any, ...]] = []
        if self._losses.error is not None:
            return taken
        items = self._items
        while items and items[0][0] is write and joins(write, items[0][1]) == joined:
            taken.append(items.popleft())
        self._writing += len(taken)
        return taken

    def _enough(self) -> bool:
        return len(self._items) >= BATCH or self._hurry > 0 or self._closed

    @property
    def pending_bytes(self) -> int:
        """Bytes submitted and not yet written."""
        return self._pending_bytes

    def check(self) -> None:
        """Issue the warnings the thread kept (`notify`); raise the writer's error, if its
        thread has hit one."""
        if not self._notices and self._losses.error is None:  # (called every step: no lock)
            return
        with self._changed:
            notices, self._notices = self._notices, []
        for message, category in notices:
            warn_user(message, category)
        with self._changed:
            failure = self._losses.failure(self.name)
        if failure is not None:
            raise failure from failure.__cause__

    def _wait(self) -> bool:
        """Wait until everything submitted so far is written, or the backend stalls. True if
        everything was written."""
        with self._changed:
            target = self._submitted
            self._hurry += 1
            self._changed.notify_all()
            try:
                return self._watchdog.wait(self._changed, lambda: self._done >= target)
            finally:
                self._hurry -= 1

    def _gave_up(self, during: str, *, abandon: bool) -> str | None:
        """`flush` or `close` stopped waiting for a stalled backend: mark it stalled and, when
        closing, abandon what is queued (counted). The message to warn with."""
        with self._changed:
            if self._done >= self._submitted:  # finished after all
                return None
            unwritten = self._submitted - self._done
            message = self._watchdog.gave_up(self.name, during, time.monotonic(), unwritten)
            if not abandon:
                return message + " (they are written if it recovers)."
            abandoned = sum(not always for *_, always in self._items) + self._writing
            self._losses.counts["abandoned"] += abandoned
            while self._items:
                *_, size, _ = self._items.popleft()
                self._pending_bytes -= size
                self._done += 1
            self._writing = 0  # counted now; if the call ever returns, not again
            self._changed.notify_all()
            return message + f", {abandoned} write(s) of them abandoned."

    def report(self) -> WriteReport:
        """What became of the writes since the last report (which this one starts anew), and
        of those it left unwritten: each lost write is counted in one report, among the
        writes that report accounts for."""
        with self._changed:
            unwritten = sum(not always for *_, always in self._items) + self._writing
            return self._losses.report(unwritten)

    def _report(self) -> None:
        report = self.report()
        if report.lost:
            warn_user(f"{self.name}: {report}.", WriterWarning)

    def flush(self) -> None:
        """Wait until everything submitted so far is written (at most until the backend
        stalls), report what was lost (`WriterWarning`), then `check`."""
        written = self._wait()
        self._drop_released()
        if not written and (message := self._gave_up("flush", abandon=False)):
            warn_user(message, WriterWarning)
        self._report()
        self.check()

    def close(self) -> None:
        """Flush, run `finish()` on the writer thread (closing files and runs), report, `check`.
        A stalled backend is given up on: what it has not written is abandoned and counted,
        and its files are left as they are. Writes submitted later reopen what they need."""
        if self._thread is not None:
            finish = self.finish
            self._put(lambda _: finish(), None, 0, always=True)
        written = self._wait()
        self._drop_released()
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
