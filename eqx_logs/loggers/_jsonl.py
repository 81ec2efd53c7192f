import json
import os
import time
from typing import IO

import equinox as eqx

from ._base import AbstractLogger, Record, to_python


class JsonlLogger(AbstractLogger):
    """One JSON line per event: `{"run": 0, "key": ..., "value": ..., "step": ...}` (spooled
    stacked keys give a line per real event; other reductions one line per key and call).
    Appends to an existing file. Every write is flushed to the operating system, so a crash of
    the process loses only events not yet written; the file is also fsynced at most every
    `fsync_every` seconds and on close, so a crash of the machine loses at most that long.
    Read it back with `eqx_logs.loggers.read_jsonl`.

    **Arguments:**

    - `path`: the file; its directory is created.
    - `fsync_every`: seconds between fsyncs (0: after every write).
    """

    path: str = eqx.field(converter=os.fspath)
    fsync_every: float = 1.0

    def _open(self, run: int) -> tuple[IO[str], list[float]]:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        return open(self.path, "a"), [time.monotonic()]

    def _write(self, handle: tuple[IO[str], list[float]], run: int, records: list[Record]):
        file, synced = handle
        file.write("".join(json.dumps({"run": run, **to_python(r)}) + "\n" for r in records))
        file.flush()
        if time.monotonic() - synced[0] >= self.fsync_every:
            os.fsync(file.fileno())
            synced[0] = time.monotonic()

    def _close(self, handle: tuple[IO[str], list[float]]) -> None:
        file, _ = handle
        file.flush()
        os.fsync(file.fileno())
        file.close()


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
