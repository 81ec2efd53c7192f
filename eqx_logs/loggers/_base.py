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
        leaves = jax.tree.leaves(value)
        if key in logs.rows and leaves:  # an event axis: a record per real event or window
            length = leaves[0].shape[0]
            for i in range(int(np.max(logs.rows[key]))):
                row = jax.tree.map(lambda x: x[i], value)
                # steps line up with the rows, except for Collect (whose rows are elements)
                row_steps = {
                    n: s[i] if np.ndim(s) and np.shape(s)[0] == length else s
                    for n, s in steps.items()
                }
                yield {"key": key, "value": row, **row_steps}
        else:
            yield {"key": key, "value": value, "count": count, **steps}


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
