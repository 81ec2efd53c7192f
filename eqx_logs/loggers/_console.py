import math
import re
import sys
from typing import Any

import numpy as np

from ._base import AbstractLogger
from ._host import Record, steps_of


def _float(x: Any) -> str:
    return f"{x:.4g}"


def _fmt(value: Any) -> str:
    """A value as text: a scalar with 4 significant digits (integers in full), a small array
    as its entries, a larger one as its type and mean, a dict as its items."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    arr = np.asarray(value)
    if arr.ndim == 0:
        return _float(arr.item()) if np.issubdtype(arr.dtype, np.floating) else str(arr.item())
    if arr.size <= 6:
        return np.array2string(arr, separator=", ", formatter={"float_kind": _float})
    mean = np.nanmean(arr) if np.issubdtype(arr.dtype, np.number) else float("nan")
    return f"{arr.dtype}{list(arr.shape)} mean={mean:.4g}"


# Room after a float's decimal point, from its column's first fraction on: 4 significant
# digits of any number from 0.001 up (`.001234`) fit, so that the points line up at once.
_FRACTION = 7


def _cell(value: Any) -> tuple[str, str, int]:
    """A value's text split at its decimal point (or exponent), for aligning the points of a
    column: `0.1667` -> (`0`, `.1667`), `500` -> (`500`, ``), `1e-05` -> (`1`, `e-05`); other
    text (arrays, `nan`) is all left part, so it is right-aligned. Also the least room after
    the point (`_FRACTION` where there is a fraction)."""
    text = _fmt(value)
    m = re.fullmatch(r"(-?[0-9]+)([.e].*)?", text)
    if m is None:
        return text, "", 0
    return m[1], m[2] or "", _FRACTION if m[2] else 0


def _identity(value: Any) -> tuple[Any, ...]:
    """A step value as a dict key (exactly, for any array)."""
    arr = np.asarray(value)
    return (arr.dtype.str, arr.shape, arr.tobytes())


def _position(value: Any) -> float:
    """Where a line with this step value goes among the others (unordered values last)."""
    arr = np.asarray(value)
    if arr.size == 1 and (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        x = float(np.real(arr.reshape(())))
        return x if not math.isnan(x) else math.inf
    return math.inf


def _lines(records: list[Record]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Records as lines, `(steps, values)`: the events of one step (the same step values, and
    the same `count` for reduced keys) on one line, a key at most once per line (a key's
    second event at a step, or its second event without a step, starts another), lines in
    step order, those without a step last."""
    groups: dict[tuple[Any, ...], tuple[dict[str, Any], dict[str, Any]]] = {}
    seen: dict[tuple[Any, ...], int] = {}
    for r in records:
        steps = steps_of(r)
        at = tuple((name, _identity(v)) for name, v in steps.items())
        n = seen[at, r["key"]] = seen.get((at, r["key"]), -1) + 1
        groups.setdefault((at, n), (steps, {}))[1][r["key"]] = r["value"]

    def order(item: tuple[tuple[Any, ...], tuple[dict[str, Any], dict[str, Any]]]) -> Any:
        (_, n), (steps, _) = item
        names = tuple(name for name in steps if name != "count")
        return (not names, names, [_position(steps[name]) for name in names], n)

    out = []
    for _, (steps, values) in sorted(groups.items(), key=order):
        # the step names first, then the count (of reduced keys), then the keys
        ordered = {k: v for k, v in steps.items() if k != "count"}
        if "count" in steps:
            ordered["count"] = steps["count"]
        out.append((ordered, values))
    return out


class ConsoleLogger(AbstractLogger):
    """Prints a line per step to stdout, `step=5  loss=0.1667  grad/layer0=500`: the step
    values, the count of reduced keys, then every key logged at that step, prefixed by
    `[run r]` for runs other than 0. Numbers have 4 significant digits and a column per
    name, so that their decimal points line up from one line to the next (the columns widen
    as wider values come). The step values take at least `step_width` columns, so that the
    keys' columns stay where they are as the step grows a digit. Events without a step go on
    lines of their own, after the others.

    ```
    step=    0  grad/layer0=0.06229   grad/layer1=0.4106    loss=0.2783
    step=  100  grad/layer0=0.04327   grad/layer1=0.07802   loss=0.1876
    step= 1000  grad/layer0=0.009021  grad/layer1=0.009544  loss=0.009483
    ```

    **Arguments:**

    - `last_only`: print only the latest event of each key of each spooled call (tapped events
        are always printed one by one): a line per call where the keys share their step.
    - `step_width`: the least width of the step values (and of the `count` of reduced keys),
        right-aligned: 5 holds steps up to 99999 (a wider step widens its column, and moves
        the keys' columns, once).

    !!! example

        The training loop of [`eqx_logs.loggers.AbstractLogger`][]'s example (`train`) with
        this logger: a line every 10 steps.

        ```python
        from eqx_logs.loggers import ConsoleLogger

        with ConsoleLogger() as logger:
            model, opt_state = train(logger, model, opt_state)
        ```
    """

    last_only: bool = False
    step_width: int = 5

    def __check_init__(self):
        if type(self.step_width) is not int or self.step_width < 0:
            raise ValueError(
                f"ConsoleLogger(step_width={self.step_width!r}): the least width of the step "
                "values is an integer >= 0 (0: as wide as each step is)."
            )

    def _open(self, run: int) -> dict[str, tuple[int, int]]:
        # each name's column: the widths of the parts before and after the decimal point
        return {}

    def _write(self, handle: dict[str, tuple[int, int]], run: int, records: list[Record]) -> None:
        if self.last_only:
            records = list({r["key"]: r for r in records}.values())
        rows = [
            [(name, _cell(v), self.step_width) for name, v in steps.items()]
            + [(name, _cell(v), 0) for name, v in values.items()]
            for steps, values in _lines(records)
        ]
        for row in rows:  # widen the columns first, so that this write's lines line up too
            for name, (left, right, room), least in row:
                width = handle.get(name, (least, 0))
                handle[name] = (max(width[0], len(left)), max(width[1], len(right), room))
        tag = f"[run {run}] " if run else ""
        for row in rows:
            fields = []
            for name, (left, right, _), _ in row:
                before, after = handle[name]
                fields.append(f"{name}={left:>{before}}{right:<{after}}")
            print((tag + "  ".join(fields)).rstrip(), file=sys.stdout, flush=True)
