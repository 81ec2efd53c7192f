"""What a writer says of the writes it did not write: its error and warning, the counts of a
report, and the accounting that keeps them."""

import collections
import dataclasses


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
    """What became of the writes submitted to one logger since its last `flush` or `close`
    (its last report), and of those still unwritten at that report.

    - `writes`: writes submitted since the last report;
    - `carried`: writes submitted before the last report and not yet written then (a
        `flush` that gave up on a stalled backend): what became of them is counted here;
    - `dropped_full`: dropped because the queue was full (`on_full="drop"`);
    - `dropped_stalled`: dropped because the backend was stalled;
    - `failed`: raised in the backend, or skipped after it raised (`WriterError`);
    - `abandoned`: still queued, or inside the stuck backend call, when `close` gave up.
    """

    writes: int = 0
    carried: int = 0
    dropped_full: int = 0
    dropped_stalled: int = 0
    failed: int = 0
    abandoned: int = 0

    @property
    def lost(self) -> int:
        """Writes not written (at most `total`; each lost write is counted in one report)."""
        return self.dropped_full + self.dropped_stalled + self.failed + self.abandoned

    @property
    def total(self) -> int:
        """The writes this report accounts for: `writes` and `carried`."""
        return self.writes + self.carried

    def __str__(self) -> str:
        parts = [
            (self.dropped_full, "dropped while the queue was full (on_full='drop')"),
            (self.dropped_stalled, "dropped while the backend was stalled"),
            (self.failed, "lost to backend errors (raised or skipped after one)"),
            (self.abandoned, "abandoned in the stalled backend when close gave up"),
        ]
        detail = ", ".join(f"{n} {what}" for n, what in parts if n)
        carried = f" ({self.carried} of them unwritten at the last report)" if self.carried else ""
        return f"{self.lost} of {self.total} write(s) were not written{carried}" + (
            f": {detail}" if detail else ""
        )


class Losses:
    """One writer's accounting: its writes since the last report (`WriteReport`'s fields),
    and the backend's error with the writes it cost until the next `check` raises it. Not
    locked itself: the writer calls it under its own lock (or reads `error` without it)."""

    def __init__(self):
        self.counts = collections.Counter()  # this report's WriteReport fields
        self.warned_full = False
        self.error: BaseException | None = None
        self.error_lost = 0  # writes lost to `error`: the one that raised, then the skipped
        self.skipped = 0

    def admit(self) -> bool:
        """Count a submitted write: False if it is skipped, the backend having failed."""
        self.counts["writes"] += 1
        if self.error is None:
            return True
        self.skip()
        return False

    def skip(self) -> None:
        """A write not written because the backend has failed (and not yet been `check`ed)."""
        self.skipped += 1
        self.error_lost += 1
        self.counts["failed"] += 1

    def fail(self, error: BaseException, *, writes: int) -> None:
        """The backend raised `error`: in `writes` writes (taken together), or (`writes=0`)
        in closing its runs."""
        if self.error is None:
            self.error = error
            self.error_lost = 0
        self.error_lost += writes
        self.counts["failed"] += writes

    def drop_full(self, name: str, pending_bytes: int, max_pending_bytes: int) -> str | None:
        """A write dropped for a full queue (`on_full="drop"`). The message to warn with, the
        first time in a report."""
        self.counts["dropped_full"] += 1
        if self.warned_full:
            return None
        self.warned_full = True
        return (
            f"{name}: the write queue is full ({pending_bytes} bytes waiting, "
            f"max_pending_bytes={max_pending_bytes}) and on_full='drop': writes that do not "
            "fit are dropped and counted; flush() and close() report how many."
        )

    def report(self, unwritten: int) -> WriteReport:
        """The counts since the last report (which this one starts anew); `unwritten` writes
        are still queued or in the backend, and the next report counts them (`carried`)."""
        counts, self.counts = self.counts, collections.Counter(carried=unwritten)
        self.warned_full = False
        return WriteReport(**counts)

    def failure(self, name: str) -> WriterError | None:
        """The `WriterError` (caused by the backend's error) to raise, clearing the error; or
        None if the backend has not failed."""
        error, skipped, lost = self.error, self.skipped, self.error_lost
        if error is None:
            return None
        self.error, self.skipped, self.error_lost = None, 0, 0
        failure = WriterError(
            f"{name} failed while writing: {error!r}. {skipped} later write(s) were "
            "skipped. The logger keeps working for new calls."
        )
        failure.lost = lost
        failure.__cause__ = error
        return failure
