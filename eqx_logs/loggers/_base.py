"""AbstractLogger, and turning a LogDict into host-side records."""

import abc
import math
import re
from collections.abc import Iterator
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._logdict import LogDict


def records(logs: LogDict) -> Iterator[dict[str, Any]]:
    """One record per event for stacked keys (the real rows only), one per key otherwise:
    `{"key": ..., "value": ..., "count": ..., <step name>: ...}`, all plain Python/numpy."""
    logs = jax.device_get(logs)
    for key, value in logs.items():
        count = np.asarray(logs.count[key])
        steps = {name: per_key[key] for name, per_key in logs.steps.items() if key in per_key}
        reduction = logs.reductions.get(key)
        leaves = jax.tree.leaves(value)
        if reduction in ("Stack", "Window") and count.ndim == 0 and leaves:
            if reduction == "Stack":
                rows = range(min(int(count), leaves[0].shape[0]))
            else:  # windows that saw events; the others are padding (NaN for inexact values)
                rows = [i for i in range(leaves[0].shape[0]) if not _all_nan(value, i)]
            for i in rows:
                row = jax.tree.map(lambda x: x[i], value)
                yield {"key": key, "value": row, **{n: s[i] for n, s in steps.items()}}
        else:
            yield {"key": key, "value": value, "count": count, **steps}


def _all_nan(value: Any, i: int) -> bool:
    rows = [np.asarray(x[i]) for x in jax.tree.leaves(value)]
    return all(np.issubdtype(r.dtype, np.inexact) and np.all(np.isnan(r)) for r in rows)


_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")


def safe_name(key: str) -> str:
    """`key` as a file name that stays inside its directory: `../../x` becomes `x`."""
    parts = [_UNSAFE.sub("_", p) for p in key.split("/")]
    parts = [p for p in parts if p not in ("", ".", "..")]
    return "__".join(parts) or "_"


def to_python(x: Any) -> Any:
    """JSON-friendly: numpy scalars and arrays to Python numbers and lists (NaN kept)."""
    if isinstance(x, dict):
        return {k: to_python(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_python(v) for v in x]
    arr = np.asarray(x)
    if arr.ndim == 0:
        item = arr.item()
        return item if not isinstance(item, float) or math.isfinite(item) else str(item)
    return [to_python(v) for v in arr]


class AbstractLogger(eqx.Module):
    """Writes LogDicts somewhere on the host. Loggers are Equinox modules; use them as
    context managers (or call `close()`) so that everything is flushed."""

    @abc.abstractmethod
    def write(self, logs: LogDict) -> None:
        """Write everything in `logs` (as returned by `spool`)."""

    def close(self) -> None:
        """Flush and release resources."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
