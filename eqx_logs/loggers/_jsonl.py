import json
import os

from .._logdict import LogDict
from ._base import AbstractLogger, records, to_python


class JsonlLogger(AbstractLogger):
    """One JSON line per event: `{"key": ..., "value": ..., "step": ...}` (stacked keys give a
    line per real event; other reductions one line per key and write). Appends to an existing
    file and flushes after every write, so a crash loses nothing already written.

    **Arguments:**

    - `path`: the file (its directory is created).
    """

    path: str

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def write(self, logs: LogDict) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            for row in records(logs):
                f.write(json.dumps(to_python(row)) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """The records of a JsonlLogger file (non-finite floats come back as 'nan'/'inf' strings)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
