import sys
from typing import Any

import numpy as np

from ._base import AbstractLogger
from ._host import Record, flat_items, is_scalar, require

# With a total: the scalars first (so a narrow terminal still shows the loss), then the bar.
_FORMAT = "{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]"
_MIN_BAR = 20  # columns the bar keeps, whatever the scalars


class _Bar:
    """One run's bar, the latest scalars, and the steps seen (for where the run ended)."""

    def __init__(self, bar: Any, desc: str | None):
        self.bar = bar
        self.desc = desc  # the bar's own description holds the scalars too
        self.latest: dict[str, str] = {}
        self.last_step: int | None = None
        self.spacing: int | None = None  # between the last two steps logged

    def label(self) -> str:
        """The run's label and the latest scalars, loss-like names first (then the others in
        the order they were first logged): the first always, the others while the bar keeps
        `_MIN_BAR` columns."""
        names = sorted(self.latest, key=lambda k: "loss" not in k.rsplit("/", 1)[-1])
        items = [f"{k}={self.latest[k]}" for k in names]
        head = f"{self.desc}: " if self.desc else ""
        width = self.bar.ncols  # None where tqdm follows the terminal
        if width is not None and self.bar.total is not None:
            # around the bar: " 100%|" and "| <n>/<total> [00:00<00:00]" (times of an hour
            # or more take 2 columns each more)
            fixed = len(head) + 6 + 2 * len(str(self.bar.total)) + 17 + 4
            room = width - fixed - _MIN_BAR
            kept = min(len(items), 1)  # the first (the loss) shows, whatever the bar keeps
            while kept < len(items) and len(" ".join(items[: kept + 1])) + 2 <= room:
                kept += 1
            items = items[:kept] + (["…"] if kept < len(items) else [])
        text = " ".join(items)
        return head + text


class ProgressLogger(AbstractLogger):
    """A tqdm progress bar per run (`pip install '.[progress]'` from the checkout), advanced
    from inside a running scan by `logger.tap(...)`, showing the latest scalars. The bar's
    position is the event's `step` plus one where it has one (so with `interval=100` it moves
    in jumps of 100), else the number of writes (one per tapped event, or per spooled call).

    The scalars are shown before the bar, names with `loss` in them first, cut to leave the
    bar at least 20 columns (an 80-column terminal shows the loss and a usable bar). When the
    logger is closed after the last logged step, one logging interval before `total` (steps
    999 with `interval=10` and `total=1000`), the bar ends at the total.

    **Arguments:**

    - `total`: the number of steps, for the bar's length and time estimate.
    - `desc`: the bar's label.
    - `step`: the step name that positions the bar.
    - `ncols`: the bar's width in columns; `None` follows the terminal.

    !!! example

        The training loop of [`eqx_logs.loggers.AbstractLogger`][]'s example (`train`) with
        this logger; the bar ends at `total` when the logger is closed:

        ```python
        from eqx_logs.loggers import ProgressLogger

        with ProgressLogger(total=30, desc="train") as logger:
            model, opt_state = train(logger, model, opt_state)
        ```
    """

    total: int | None = None
    desc: str | None = None
    step: str = "step"
    ncols: int | None = None

    def __check_init__(self):
        require("tqdm", "progress", "ProgressLogger")

    def _open(self, run: int) -> _Bar:
        tqdm = require("tqdm", "progress", "ProgressLogger")
        desc = self.desc if not run else f"{self.desc or 'run'} {run}"
        bar = tqdm.tqdm(
            total=self.total,
            desc=desc,
            file=sys.stderr,
            ncols=self.ncols,
            dynamic_ncols=self.ncols is None,
            bar_format=None if self.total is None else _FORMAT,
        )
        return _Bar(bar, desc)

    def _write(self, handle: _Bar, run: int, records: list[Record]):
        bar = handle.bar
        position = bar.n
        for r in records:
            for tag, value in flat_items(r["key"], r["value"]):
                if is_scalar(value):
                    handle.latest[tag] = f"{value.reshape(()).item():.4g}"
            if self.step in r:
                step = int(np.asarray(r[self.step]))
                if handle.last_step is not None and step > handle.last_step:
                    handle.spacing = step - handle.last_step
                handle.last_step = step if handle.last_step is None else max(step, handle.last_step)
                position = max(position, step + 1)
        if not any(self.step in r for r in records):
            position += 1
        bar.set_description_str(handle.label(), refresh=False)
        bar.update(position - bar.n)

    def _close(self, handle: _Bar) -> None:
        bar, total = handle.bar, self.total
        # the last step logged is the last one before the total that the logging kept: the
        # steps after it ran too
        if total is not None and handle.last_step is not None and bar.n < total:
            if handle.last_step + (handle.spacing or 1) >= total:
                bar.update(total - bar.n)
        bar.close()
