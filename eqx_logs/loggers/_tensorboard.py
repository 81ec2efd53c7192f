import os
from typing import Any

import equinox as eqx
import numpy as np

from ._base import AbstractLogger, Record, finite, flat_items, is_scalar, require


class TensorBoardLogger(AbstractLogger):
    """TensorBoard event files (via tensorboardX, `pip install 'eqx_logs[tensorboard]'`), one
    run directory per run, `logdir/run_<run>`: scalars with `add_scalar`, and arrays with
    `add_histogram` (of their finite entries; the count of non-finite entries is logged as the
    scalar `<key>/nonfinite` when there are any). Pytree values are logged per leaf as
    `<key>/<path>`. The global step is the event's `step` if it was logged with one, else a
    per-key counter. Flushed after every write.

    **Arguments:**

    - `logdir`: the directory (`tensorboard --logdir` it).
    - `step`: the step name to use as the global step.
    """

    logdir: str = eqx.field(converter=os.fspath)
    step: str = "step"

    def __check_init__(self):
        require("tensorboardX", "tensorboard", "TensorBoardLogger")

    def _open(self, run: int) -> tuple[Any, dict[str, int]]:
        tbx = require("tensorboardX", "tensorboard", "TensorBoardLogger")
        return tbx.SummaryWriter(os.path.join(self.logdir, f"run_{run}")), {}

    def _write(self, handle: tuple[Any, dict[str, int]], run: int, records: list[Record]) -> None:
        writer, counters = handle
        for r in records:
            for tag, value in flat_items(r["key"], r["value"]):
                if self.step in r:
                    step = int(np.asarray(r[self.step]))
                else:
                    step = counters.get(tag, 0)
                counters[tag] = step + 1
                if is_scalar(value):
                    writer.add_scalar(tag, float(value.reshape(())), global_step=step)
                    continue
                entries = finite(value)
                if entries.size:
                    writer.add_histogram(tag, entries.astype(np.float64), global_step=step)
                if entries.size != value.size:
                    writer.add_scalar(
                        f"{tag}/nonfinite", value.size - entries.size, global_step=step
                    )
        writer.flush()

    def _close(self, handle: tuple[Any, dict[str, int]]) -> None:
        handle[0].close()
