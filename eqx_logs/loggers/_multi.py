"""MultiLogger: writes to several loggers at once, through a sink that fans out to theirs."""

import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._logdict import LogDict
from .._warn import warn_user
from ._base import AbstractLogger
from ._host import Record
from ._packed import Packed
from ._run_config import as_config
from ._sink import AbstractSink, Backend
from ._state import LoggerState
from ._writer import WriterError, WriterWarning


class MultiLogger(AbstractLogger):
    """Writes to several loggers at once, each on its own writer thread.
    `MultiLogger(ConsoleLogger(), JsonlLogger("run.jsonl"))`; its state is one run index for
    all of them.

    The loggers are isolated from each other: each keeps its own queue, `on_full` and
    `stall_timeout`, so a stuck backend drops only its own writes. A backend that raises does
    not raise here: its `WriterError` becomes a `WriterWarning` (once per logger between two
    `flush`/`close` calls) naming it and the number of writes the failure cost, the other
    loggers keep writing, and the failing one is tried again with the next write. `flush()`
    and `close()` warn, per logger, with the exact number of writes lost. Other errors (a
    value a backend cannot store) are raised after every logger has had the call.

    **Arguments:**

    - `*loggers`: the loggers to write to.
    - `config`: the run's configuration, recorded by each of `loggers` that was not given
        one of its own (see [`eqx_logs.loggers.AbstractLogger`][]); `self.loggers` holds
        those loggers with it (copies that share their writers).

    !!! example

        The training loop of [`eqx_logs.loggers.AbstractLogger`][]'s example (`train`) with
        this logger: printed and written to a file.

        ```python
        from eqx_logs.loggers import ConsoleLogger, JsonlLogger, MultiLogger

        with MultiLogger(ConsoleLogger(), JsonlLogger("run.jsonl")) as logger:
            model, opt_state = train(logger, model, opt_state)
        ```
    """

    loggers: tuple[AbstractLogger, ...]

    def __init__(self, *loggers: AbstractLogger, config: Any = None):
        for logger in loggers:
            if not isinstance(logger, AbstractLogger):
                raise TypeError(f"MultiLogger takes loggers, got {logger!r}.")
        config = as_config(config)
        self.loggers = tuple(logger._with_config(config) for logger in loggers)
        self.config = config
        self.every_process = any(logger.every_process for logger in loggers)
        self._sink = FanOut(self.loggers)

    def _with_config(self, config: Any) -> "MultiLogger":
        if self.config is not None or config is None:
            return self
        return MultiLogger(*self.loggers, config=config)

    # its sink hands everything to its loggers' sinks: it opens no run of its own
    def _open(self, run: int) -> None:
        return None

    def _write(self, handle: None, run: int, records: list[Record]) -> None:
        """Hand `records` to every logger (as a tapped event's are)."""
        self._sink.submit_rows(run, records)

    def flush(self) -> None:
        """Flush every logger (each waits at most its `stall_timeout` for a stuck backend);
        each warns with what it lost, and a failed backend is reported, not raised."""
        AbstractLogger.flush(self)

    def close(self) -> None:
        """Close every logger; each warns with what it lost (see `flush`)."""
        AbstractLogger.close(self)


class FanOut(AbstractSink):
    """MultiLogger's sink: hands everything to its loggers' sinks, each writing on its own
    thread. A failed backend is isolated: its `WriterError` is warned about (once per
    logger between two `flush`/`close` calls), never raised. Other errors (a value a backend
    cannot store) are raised after every logger has had the call."""

    def __init__(self, loggers: Sequence[AbstractLogger]):
        self.sinks = tuple(logger._sink for logger in loggers)
        self.names = tuple(type(logger).__name__ for logger in loggers)
        self.memo = {}
        self.submit = self.submit_logs
        self._lock = threading.Lock()
        # the loggers (by index) whose failure was warned about since the last flush/close
        self._warned: set[int] = set()

    def bind(self, backend: Backend) -> None:
        self.submit = backend.submit_logs or self.submit_logs

    def submit_logs(
        self, state: LoggerState, logs: LogDict | Packed, size: int | None = None
    ) -> None:
        # each fetches on its own thread, and through its logger's `_submit_logs`
        self._each([sink.submit for sink in self.sinks], state, logs, size)

    def submit_rows(self, run: int, rows: list[Record]) -> None:
        # a key one logger rejects still reaches the others
        self._each([sink.submit_rows for sink in self.sinks], run, rows)

    def feed(self, state: LoggerState) -> Callable[[Packed], None]:
        feeds = tuple(sink.feed(state) for sink in self.sinks)
        return functools.partial(self._each, feeds)  # each fetches on its own thread

    def check(self) -> None:
        self._each([sink.check for sink in self.sinks])

    def flush(self) -> None:
        self._each([sink.flush for sink in self.sinks], report=True)

    def close(self) -> None:
        self._each([sink.close for sink in self.sinks], report=True)

    def _each(self, calls: Sequence[Callable[..., None]], *args: Any, report: bool = False) -> None:
        """Call `calls[i](*args)` for every logger `i`; a failed backend is isolated."""
        errors = []
        for index, call in enumerate(calls):  # all of them, then raise the first error
            try:
                call(*args)
            except WriterError as e:  # isolated: reported, never raised
                self._isolate(index, e)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if report:  # a new period: the next failure of each logger is warned about again
            with self._lock:
                self._warned.clear()
        if errors:
            raise errors[0]

    def _isolate(self, index: int, error: WriterError) -> None:
        with self._lock:
            if index in self._warned:
                return
            self._warned.add(index)
        name = self.names[index]
        warn_user(
            f"MultiLogger: logger {index} ({name}) failed and is isolated; the other loggers "
            f"keep writing. {error} This failure lost {error.lost} write(s) of {name}; later "
            "failures of it are counted, and flush() and close() report every write it lost.",
            WriterWarning,
        )
