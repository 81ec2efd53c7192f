"""The background writer: one thread per logger, writing in submission order."""

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_STOP = object()
_live: "weakref.WeakSet[Writer]" = weakref.WeakSet()


class WriterError(RuntimeError):
    """A logger's backend failed on its writer thread. Raised on the next call into the
    logger; events submitted after the failure were not written."""


class Writer:
    """Runs `write(item)` for every submitted item on one daemon thread, in order.

    An exception in `write` is kept and raised (as the cause of a `WriterError`) by the next
    `check`, `submit`, `flush` or `close`; later items are counted and skipped rather than
    written, so nothing is dropped silently. `flush` waits until everything submitted is
    written; `close` also runs `finish` on the thread and stops it. A process that exits
    normally closes every live writer first (`atexit`).
    """

    def __init__(self, name: str):
        self.name = name
        self.finish: Callable[[], None] | None = None  # set by the owner: closes its runs
        self.handles: dict[int, Any] = {}  # per-run backend state, used on the thread only
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._skipped = 0
        _live.add(self)

    def __repr__(self) -> str:
        return f"Writer({self.name!r})"

    def submit(self, write: Callable[[Any], None], item: Any) -> None:
        """Queue `write(item)`. Safe to call from any thread (JAX runs host callbacks on its
        own threads)."""
        with self._lock:
            if self._error is not None:
                self._skipped += 1
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name=f"eqx_logs-{self.name}", daemon=True
                )
                self._thread.start()
        self._queue.put((write, item, False))

    def _loop(self) -> None:
        while True:
            write, item, always = self._queue.get()
            try:
                if write is _STOP:
                    return
                if self._error is None or always:  # closing runs even after an error
                    write(item)
                else:
                    self._skipped += 1
            except BaseException as e:  # kept for the caller; nothing is swallowed
                if self._error is None:
                    self._error = e
            finally:
                self._queue.task_done()

    def check(self) -> None:
        """Raise the writer's error, if its thread has hit one."""
        if self._error is not None:
            error, skipped = self._error, self._skipped
            self._error, self._skipped = None, 0
            raise WriterError(
                f"{self.name} failed while writing: {error!r}. {skipped} later write(s) were "
                "skipped. The logger keeps working for new calls."
            ) from error

    def flush(self) -> None:
        """Wait until everything submitted so far is written, then `check`."""
        self._queue.join()
        self.check()

    def close(self) -> None:
        """Flush, run `finish()` on the writer thread (closing files and runs), stop it."""
        if self._thread is not None and self._thread.is_alive():
            if self.finish is not None:
                self._queue.put((lambda _: self.finish(), None, True))
            self._queue.put((_STOP, None, True))
            self._thread.join()
        self._thread = None
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
