import functools
import threading
from collections.abc import Callable
from typing import Any

import equinox as eqx

from .._warn import warn_user
from ._base import AbstractLogger
from ._host import Record
from ._run_config import as_config
from ._state import LoggerState
from ._writer import Writer, WriterError, WriterWarning


class _Isolated:
    """The loggers of a MultiLogger (by index) whose failure was warned about since its last
    `flush`/`close`: each is warned about once per period."""

    def __init__(self):
        self.lock = threading.Lock()
        self.warned: set[int] = set()


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

        A per-step training loop (`train_step` as in [`eqx_logs.loggers.AbstractLogger`][]'s
        example), printed and written to a file:

        ```python
        from eqx_logs.loggers import ConsoleLogger, JsonlLogger, MultiLogger

        with MultiLogger(ConsoleLogger(), JsonlLogger("run.jsonl")) as logger:
            step = logger.jit(train_step, logger.init(), interval=10)
            for i in range(30):  # the step as an array: one compiled step for every i
                model, opt_state = step(model, opt_state, x, y, jnp.int32(i))
        ```
    """

    loggers: tuple[AbstractLogger, ...]
    _isolated: _Isolated = eqx.field(static=True, repr=False, init=False)

    def __init__(self, *loggers: AbstractLogger, config: Any = None):
        for logger in loggers:
            if not isinstance(logger, AbstractLogger):
                raise TypeError(f"MultiLogger takes loggers, got {logger!r}.")
        config = as_config(config)
        self.loggers = tuple(type(logger)._with_config(logger, config) for logger in loggers)
        self.config = config
        self.every_process = any(logger.every_process for logger in loggers)
        self._writer = Writer("MultiLogger")
        self._isolated = _Isolated()

    def _with_config(self, config: Any) -> "MultiLogger":
        if self.config is not None or config is None:
            return self
        return MultiLogger(*self.loggers, config=config)

    def _open(self, run: int) -> None:
        return None

    def _write(self, handle: Any, run: int, records: list[Record]) -> None:
        raise AssertionError("MultiLogger hands records to its loggers")

    def _submit(self, run: int, rows: list[Record]) -> None:
        self._each("_submit", run, rows)  # a key one logger rejects still reaches the others

    def _submit_logs(self, state: LoggerState, logs: Any, size: int | None = None) -> None:
        self._each("_submit_logs", state, logs, size)  # each fetches on its own thread

    def _feed(self, state: LoggerState) -> Callable[[Any], None]:
        feeds = tuple(type(logger)._feed(logger, state) for logger in self.loggers)
        return functools.partial(self._each, feeds)  # each fetches on its own thread

    def _check(self) -> None:
        self._each("_check")

    def flush(self) -> None:
        """Flush every logger (each waits at most its `stall_timeout` for a stuck backend);
        each warns with what it lost, and a failed backend is reported, not raised."""
        self._each("flush", report=True)

    def close(self) -> None:
        """Close every logger; each warns with what it lost (see `flush`)."""
        self._each("close", report=True)

    def _each(
        self, method: str | tuple[Callable[..., None], ...], *args: Any, report: bool = False
    ) -> None:
        """Call `method` of every logger (or `method[i]`, one function per logger) with
        `args`; a failed backend is isolated."""
        errors = []
        for index, logger in enumerate(self.loggers):  # all of them, then raise the first error
            try:
                if isinstance(method, str):
                    getattr(type(logger), method)(logger, *args)  # (see AbstractLogger's plumbing)
                else:
                    method[index](*args)
            except WriterError as e:  # isolated: reported, never raised
                self._isolate(index, logger, e)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if report:  # a new period: the next failure of each logger is warned about again
            with self._isolated.lock:
                self._isolated.warned.clear()
        if errors:
            raise errors[0]

    def _isolate(self, index: int, logger: AbstractLogger, error: WriterError) -> None:
        with self._isolated.lock:
            if index in self._isolated.warned:
                return
            self._isolated.warned.add(index)
        warn_user(
            f"MultiLogger: logger {index} ({type(logger).__name__}) failed and is isolated; the "
            f"other loggers keep writing. {error} This failure lost {error.lost} write(s) of "
            f"{type(logger).__name__}; later failures of it are counted, and flush() and "
            "close() report every write it lost.",
            WriterWarning,
        )
