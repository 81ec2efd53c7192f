from typing import Any

from ._base import AbstractLogger, Record
from ._writer import Writer


class MultiLogger(AbstractLogger):
    """Writes to several loggers at once, each on its own writer thread.
    `MultiLogger(ConsoleLogger(), JsonlLogger("run.jsonl"))`; its state is one run index for
    all of them."""

    loggers: tuple[AbstractLogger, ...]

    def __init__(self, *loggers: AbstractLogger):
        for logger in loggers:
            if not isinstance(logger, AbstractLogger):
                raise TypeError(f"MultiLogger takes loggers, got {logger!r}.")
        self.loggers = loggers
        self.every_process = any(logger.every_process for logger in loggers)
        self._writer = Writer("MultiLogger")

    def _open(self, run: int) -> None:
        return None

    def _write(self, handle: Any, run: int, records: list[Record]) -> None:
        raise AssertionError("MultiLogger hands records to its loggers")

    def _submit(self, run: int, rows: list[Record]) -> None:
        self._each("_submit", run, rows)  # a key one logger rejects still reaches the others

    def _check(self) -> None:
        for logger in self.loggers:
            logger._check()

    def flush(self) -> None:
        self._each("flush")

    def close(self) -> None:
        self._each("close")

    def _each(self, method: str, *args: Any) -> None:
        errors = []
        for logger in self.loggers:  # all of them, then raise the first error
            try:
                getattr(logger, method)(*args)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        if errors:
            raise errors[0]
