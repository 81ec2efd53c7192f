import sys

import numpy as np

from .._logdict import LogDict
from ._base import AbstractLogger, records


def _fmt(value) -> str:
    arr = np.asarray(value) if not isinstance(value, dict) else None
    if arr is None:
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if arr.ndim == 0:
        return f"{arr.item():.6g}" if np.issubdtype(arr.dtype, np.floating) else str(arr.item())
    if arr.size <= 6:
        return np.array2string(arr, precision=4, separator=", ")
    return f"{arr.dtype}{list(arr.shape)} mean={np.nanmean(arr):.4g}"


class ConsoleLogger(AbstractLogger):
    """Prints aligned lines: `key  value  step=...`. With `last_only`, only the latest event of
    each key in each write."""

    last_only: bool = True

    def write(self, logs: LogDict) -> None:
        rows = list(records(logs))
        if self.last_only:
            latest = {}
            for row in rows:
                latest[row["key"]] = row
            rows = list(latest.values())
        width = max((len(r["key"]) for r in rows), default=0)
        for row in rows:
            steps = "  ".join(f"{k}={v}" for k, v in row.items() if k not in ("key", "value"))
            print(f"{row['key']:<{width}}  {_fmt(row['value'])}  {steps}".rstrip(), file=sys.stdout)
