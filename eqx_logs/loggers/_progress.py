import sys
from typing import Any

import numpy as np

from ._base import AbstractLogger, Record, flat_items, is_scalar, require


class ProgressLogger(AbstractLogger):
    """A tqdm progress bar per run (`pip install tqdm`), advanced from inside a running
    scan by `logger.tap(...)`, showing the latest scalars. The bar's position is the event's
    `step` plus one where it has one (so with `interval=100` it moves in jumps of 100), else
    the number of writes (one per tapped event, or per spooled call).

    **Arguments:**

    - `total`: the number of steps, for the bar's length and time estimate.
    - `desc`: the bar's label.
    - `step`: the step name that positions the bar.
    """

    total: int | None = None
    desc: str | None = None
    step: str = "step"

    def __check_init__(self):
        require("tqdm", "progress", "ProgressLogger")

    def _open(self, run: int) -> tuple[Any, dict[str, Any]]:
        tqdm = require("tqdm", "progress", "ProgressLogger")
        desc = self.desc if not run else f"{self.desc or 'run'} {run}"
        bar = tqdm.tqdm(total=self.total, desc=desc, file=sys.stderr, dynamic_ncols=True)
        return bar, {}

    def _write(self, handle: tuple[Any, dict[str, Any]], run: int, records: list[Record]):
        bar, latest = handle
        position = bar.n
        for r in records:
            for tag, value in flat_items(r["key"], r["value"]):
                if is_scalar(value):
                    latest[tag] = f"{value.reshape(()).item():.4g}"
            if self.step in r:
                position = max(position, int(np.asarray(r[self.step])) + 1)
        if not any(self.step in r for r in records):
            position += 1
        bar.set_postfix(latest, refresh=False)
        bar.update(position - bar.n)

    def _close(self, handle: tuple[Any, dict[str, Any]]) -> None:
        handle[0].close()
