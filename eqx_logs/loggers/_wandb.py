import os
from typing import Any

import equinox as eqx
import numpy as np

from ._base import AbstractLogger, Record, flat_items, is_scalar, require


class WandbLogger(AbstractLogger):
    """Weights & Biases (`pip install 'eqx_logs[wandb]'`): one W&B run per logger run, named
    `<name>-<run>` and grouped under `name`. Scalars are logged as numbers, arrays as
    `wandb.Histogram`s (of their finite entries), pytree values per leaf as `<key>/<path>`.
    Records of one write are grouped by their `step` (W&B needs steps to increase within a
    run). Set `WANDB_MODE=offline` (or `mode="offline"`) to write locally and
    `wandb sync` later.

    **Arguments:**

    - `project`, `name`, `dir`, `mode`, `config`: passed to `wandb.init` (the run name gets a
        `-<run>` suffix).
    - `step`: the step name used as W&B's step.
    """

    project: str | None = None
    name: str = "eqx_logs"
    dir: str | None = None
    mode: str | None = None
    config: dict[str, Any] | None = eqx.field(default=None, static=True)
    step: str = "step"

    def __check_init__(self):
        require("wandb", "wandb", "WandbLogger")

    def _open(self, run: int) -> Any:
        wandb = require("wandb", "wandb", "WandbLogger")
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        return wandb.init(
            project=self.project,
            name=f"{self.name}-{run}",
            group=self.name,
            dir=self.dir,
            mode=self.mode,
            config=self.config,
            reinit="create_new",
        )

    def _write(self, handle: Any, run: int, records: list[Record]) -> None:
        wandb = require("wandb", "wandb", "WandbLogger")
        by_step: dict[int | None, dict[str, Any]] = {}
        for r in records:
            step = int(np.asarray(r[self.step])) if self.step in r else None
            row = by_step.setdefault(step, {})
            for tag, value in flat_items(r["key"], r["value"]):
                if is_scalar(value):
                    row[tag] = value.reshape(()).item()
                else:
                    finite = value[np.isfinite(value)] if value.dtype.kind == "f" else value
                    row[tag] = wandb.Histogram(finite.astype(np.float64))
        for step in sorted(by_step, key=lambda s: -1 if s is None else s):
            handle.log(by_step[step], step=step)

    def _close(self, handle: Any) -> None:
        handle.finish()
