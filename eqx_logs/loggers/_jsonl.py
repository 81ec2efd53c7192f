import json
import os
from typing import IO

import equinox as eqx

from ._base import AbstractLogger, Record, to_python


class JsonlLogger(AbstractLogger):
    """One JSON line per event: `{"run": 0, "key": ..., "value": ..., "step": ...}` (spooled
    stacked keys give a line per real event; other reductions one line per key and call).
    Appends to an existing file, and flushes and fsyncs after every write, so a crash loses
    only events not yet written. Read it back with `eqx_logs.loggers.read_jsonl`.

    **Arguments:**

    - `path`: the file; its directory is created.
    """

    path: str = eqx.field(converter=os.fspath)

    def _open(self, run: int) -> IO[str]:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        return open(self.path, "a")

    def _write(self, handle: IO[str], run: int, records: list[Record]) -> None:
        for r in records:
            handle.write(json.dumps({"run": run, **to_python(r)}) + "\n")
        handle.flush()
        os.fsync(handle.fileno())

    def _close(self, handle: IO[str]) -> None:
        handle.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JsonlLogger file (non-finite floats come back as 'nan'/'inf' strings).
    A last line cut short by a crash is skipped."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    if line.endswith("\n"):
                        raise
    return out
