import sys
from typing import Any

import numpy as np

from ._base import AbstractLogger, Record, steps_of


def _fmt(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    arr = np.asarray(value)
    if arr.ndim == 0:
        return f"{arr.item():.6g}" if np.issubdtype(arr.dtype, np.floating) else str(arr.item())
    if arr.size <= 6:
        return np.array2string(arr, precision=4, separator=", ")
    mean = np.nanmean(arr) if np.issubdtype(arr.dtype, np.number) else float("nan")
    return f"{arr.dtype}{list(arr.shape)} mean={mean:.4g}"


class ConsoleLogger(AbstractLogger):
    """Prints aligned lines to stdout, `key  value  step=...`, prefixed by `[run r]` for runs
    other than 0.

    **Arguments:**

    - `last_only`: print only the latest event of each key of each spooled call (tapped events
        are always printed one by one).
    """

    last_only: bool = False

    def _open(self, run: int) -> None:
        return None

    def _write(self, handle: None, run: int, records: list[Record]) -> None:
        if self.last_only:
            records = list({r["key"]: r for r in records}.values())
        width = max((len(r["key"]) for r in records), default=0)
        values = [_fmt(r["value"]) for r in records]
        value_width = max((len(v) for v in values), default=0)
        tag = f"[run {run}] " if run else ""
        for r, value in zip(records, values):
            steps = "  ".join(f"{k}={_fmt(v)}" for k, v in steps_of(r).items())
            line = f"{tag}{r['key']:<{width}}  {value:>{value_width}}  {steps}"
            print(line.rstrip(), file=sys.stdout, flush=True)
