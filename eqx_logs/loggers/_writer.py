"""The background writer: one thread per logger, writing in submission order."""

import atexit
import collections
import threading
import weakref
from collections.abc import Callable
from typing import Any

_live: "weakref.WeakSet[Writer]" = weakref.WeakSet()

# What may wait in a writer's queue before producers wait for it (back-pressure).
MAX_PENDING_BYTES = 256 * 2**20


class WriterError(RuntimeError):
    """A logger's backend failed on its writer thread. Raised on the next call into the
    logger; events submitted after the failure were not written."""


class Writer:
    """Runs `write(item)` for every submitted item on one daemon thread, in order.

    - An exception in `write` is kept and raised (as the cause of a `WriterError`) by the next
      `check`, `submit`, `flush` or `close`; later items are counted and skipped rather than
      written, so nothing is dropped silently.
    - The queue is bounded by size: `submit` waits while the items not yet written hold more
      than `max_pending_bytes` (training waits for a slow backend; nothing is dropped).
    - `flush` waits until everything submitted before it is written; `close` also runs
      `finish` on the thread (closing files and runs). Both are safe to call from any thread,
      while other threads submit. A process that exits normally closes every live writer
      first (`atexit`).
    """

    def __init__(self, name: str, max_pending_bytes: int = MAX_PENDING_BYTES):
        self.name = name
        self.max_pending_bytes = max_pending_bytes
        self.finish: Callable[[], None] | None = None  # set by the owner: closes its runs
        self.handles: dict[int, Any] = {}  # per-run backend state, used on the thread only
        self._changed = threading.Condition()  # guards everything below
        self._items: collections.deque = collections.deque()
        self._pending_bytes = 0
        self._submitted = 0  # items ever queued; the thread has finished the first `_done`
        self._done = 0
        self._thread: threading.Thread | None = None  # one at a time, set under the lock
        self._closed = False  # the thread exits once idle
        self._error: BaseException | None = None
        self._skipped = 0
        _live.add(self)

    def __repr__(self) -> str:
        return f"Writer({self.name!r})"

    def submit(self, write: Callable[[Any], None], item: Any, size: int = 0) -> None:
        """Queue `write(item)`; `size` is roughly how many bytes `item` holds. Safe to call
        from any thread (JAX runs host callbacks on its own threads)."""
        self._put(write, item, size, always=False)

    def _put(self, write, item, size: int, *, always: bool) -> None:
        with self._changed:
            if self._error is not None and not always:
                self._skipped += 1
                return
            # back-pressure; an item larger than the bound still goes, alone
            self._changed.wait_for(
                lambda: (
                    not self._pending_bytes or self._pending_bytes + size <= self.max_pending_bytes
                )
            )
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"eqx_logs-{self.name}", daemon=True
                )
                self._thread.start()
            self._closed = False
            self._items.append((write, item, size, always))
            self._pending_bytes += size
            self._submitted += 1
            self._changed.notify_all()

    def _loop(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._items or self._closed)
                if not self._items:  # closed and idle: a later submit starts a new thread
                    self._thread = None
                    return
                write, item, size, always = self._items.popleft()
            try:
                if self._error is None or always:  # closing runs even after an error
                    write(item)
                else:
                    with self._changed:
                        self._skipped += 1
            except BaseException as e:  # kept for the caller; nothing is swallowed
                with self._changed:
                    if self._error is None:
                        self._error = e
            finally:
                with self._changed:
                    self._pending_bytes -= size
                    self._done += 1
                    self._changed.notify_all()

    @property
    def pending_bytes(self) -> int:
        """Bytes submitted and not yet written."""
        return self._pending_bytes

    def check(self) -> None:
        """Raise the writer's error, if its thread has hit one."""
        with self._changed:
            error, skipped = self._error, self._skipped
            if error is None:
                return
            self._error, self._skipped = None, 0
        raise WriterError(
            f"{self.name} failed while writing: {error!r}. {skipped} later write(s) were "
            "skipped. The logger keeps working for new calls."
        ) from error

    def _wait(self) -> None:
        """Wait until everything submitted so far is written."""
        with self._changed:
            target = self._submitted
            self._changed.wait_for(lambda: self._done >= target)

    def flush(self) -> None:
        """Wait until everything submitted so far is written, then `check`."""
        self._wait()
        self.check()

    def close(self) -> None:
        """Flush, run `finish()` on the writer thread (closing files and runs), `check`.
        Writes submitted later reopen what they need."""
        if self._thread is not None and self.finish is not None:
            finish = self.finish
            self._put(lambda _: finish(), None, 0, always=True)
        self._wait()
        with self._changed:
            self._closed = True
            self._changed.notify_all()
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
