"""A writer's stall watchdog: when its busy backend counts as stalled, and what it says."""

import contextlib
import math
import threading
import time
from collections.abc import Callable


class Watchdog:
    """The stall clock of one writer's backend. It runs from the backend's last finished item
    (or from when work arrived while it was idle, `progress`), and stops while the writer
    thread waits for the device (`paused`). A busy backend whose clock reaches `timeout`
    seconds is stalled; `None` or `inf`: never. Not locked itself: the writer calls it under its own
    lock, and says whether the backend is busy."""

    def __init__(self, timeout: float | None):
        self.timeout = timeout
        self.progress = time.monotonic()  # the backend's last finished item (or new work)
        self.waiting = False  # the thread waits in an item's `ready` (for the device)
        self.since: float | None = None  # while reported as stalled

    def stalled(self, now: float) -> bool:
        """Whether a busy backend counts as stalled at `now`."""
        if self.timeout is None or self.waiting:
            return False
        return now - self.progress >= self.timeout

    def left(self, now: float) -> float | None:
        """Seconds from `now` until a busy backend counts as stalled (none left: <= 0), or
        None while it cannot stall."""
        if self.timeout is None or self.timeout == math.inf or self.waiting:  # (the device)
            return None  # (an infinite wait: `Condition.wait` takes no `inf`)
        return self.progress + self.timeout - now

    def wait(self, lock: threading.Condition, done: Callable[[], bool]) -> bool:
        """Wait on `lock` (held) until `done()`, at most until the busy backend stalls. True
        if done."""
        while not done():
            left = self.left(time.monotonic())
            if left is not None and left <= 0:
                return False
            lock.wait(left)  # (None: while the backend cannot stall)
        return True

    def stall(self, name: str, now: float, unwritten: int) -> str | None:
        """Mark the backend stalled; the message the first time."""
        if self.since is not None:
            return None
        self.since = self.progress
        return (
            f"{name}: the backend has made no progress for {now - self.progress:.1f} s "
            f"(stall_timeout={self.timeout}): it is stuck inside a write, with "
            f"{unwritten} item(s) not yet written. New writes are dropped "
            "and counted, without waiting, until it makes progress again; flush() and close() "
            "report how many. Raise `stall_timeout` for a backend that is slow but alive."
        )

    def gave_up(self, name: str, during: str, now: float, unwritten: int) -> str:
        """`during` (flush or close) stopped waiting for the backend: mark it stalled. The
        message to warn with, to be completed with what becomes of the unwritten items."""
        self.stall(name, now, unwritten)
        return (
            f"{name}: {during} gave up waiting for a backend that has made no "
            f"progress for {now - self.progress:.1f} s (stall_timeout="
            f"{self.timeout}); {unwritten} item(s) not written"
        )

    def progressed(self, name: str) -> str | None:
        """The backend finished an item: the clock starts anew. The message to warn with if it
        was stalled."""
        now = self.progress = time.monotonic()
        if self.since is None:
            return None
        recovered, self.since = now - self.since, None
        return (
            f"{name}: the backend made progress again after {recovered:.1f} s "
            "stalled; writes are queued again (flush() and close() report how many "
            "were dropped)."
        )

    @contextlib.contextmanager
    def paused(self, lock: threading.Condition):
        """Stop the clock while the writer thread waits for the device (its time is not the
        backend's); it starts anew when the wait ends, and `lock`'s waiters are told."""
        with lock:
            self.waiting = True
        try:
            yield
        finally:
            with lock:
                self.waiting = False
                self.progress = time.monotonic()
                lock.notify_all()  # waiters' stall deadlines start now
