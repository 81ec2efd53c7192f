import os
from typing import Any

import numpy as np

from ._base import AbstractLogger
from ._host import Record, not_complex, process_suffix, require, rows_by_step


class WandbLogger(AbstractLogger):
    """Weights & Biases (`pip install '.[wandb]'` from the checkout): one W&B run per logger
    run, named `<name>-<run>` and grouped under `name`. Scalars are logged as numbers, arrays as
    `wandb.Histogram`s (of their finite entries), pytree values per leaf as `<key>/<path>`.
    W&B needs steps to increase within a run: the records of one write are grouped by their
    `step`, in increasing order, and each record without one gets the next step; a step
    below one already written raises (W&B would drop it). Set `WANDB_MODE=offline` (or
    `mode="offline"`) to write locally and `wandb sync` later.

    **Arguments:**

    - `project`, `name`, `dir`, `mode`: passed to `wandb.init` (the run name gets a
        `-<run>` suffix).
    - `config`: the run's configuration, passed to `wandb.init` as the W&B run's config
        (keyword-only; see [`eqx_logs.loggers.AbstractLogger`][]).
    - `step`: the step name used as W&B's step.

    !!! example

        The training loop of [`eqx_logs.loggers.AbstractLogger`][]'s example (`train`) with
        this logger, written offline:

        ```python
        from eqx_logs.loggers import WandbLogger

        with WandbLogger(project="demo", mode="offline", config={"lr": 0.1}) as logger:
            model, opt_state = train(logger, model, opt_state)
        # wandb sync wandb/offline-run-*
        ```
    """

    project: str | None = None
    name: str = "eqx_logs"
    dir: str | None = None
    mode: str | None = None
    step: str = "step"

    def __check_init__(self):
        wandb = require("wandb", "wandb", "WandbLogger")
        mode = self.mode or os.environ.get("WANDB_MODE") or "online"
        # online without credentials: W&B would fail at the first write, after a chunk of
        # training; say so now (no network: the key is looked up, not verified)
        if mode == "online" and not wandb.login(prompt=False, verify=False):
            raise RuntimeError(
                "WandbLogger: W&B's online mode needs a login (`wandb login`, or the "
                "WANDB_API_KEY environment variable), and none was found. To log locally and "
                "`wandb sync` later, pass mode='offline' (Hydra: logger.mode=offline, or "
                "WANDB_MODE=offline)."
            )

    def _open(self, run: int) -> tuple[Any, dict[str, int]]:
        wandb = require("wandb", "wandb", "WandbLogger")
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        wandb_run = wandb.init(
            project=self.project,
            name=f"{self.name}-{run}{process_suffix(self.every_process)}",
            group=self.name,
            dir=self.dir,
            mode=self.mode,
            config=self.config,
            reinit="create_new",
        )
        return wandb_run, {"last": -1}

    def _unstorable(self, leaf: np.ndarray) -> str | None:
        return not_complex(leaf)

    def _write(self, handle: tuple[Any, dict[str, int]], run: int, records: list[Record]):
        wandb = require("wandb", "wandb", "WandbLogger")
        # W&B drops rows whose step is below its current one, so every row gets an explicit,
        # increasing step: a write's stepped records grouped by step in increasing order, then
        # each stepless record as its own row at the next step.
        wandb_run, progress = handle
        last = progress["last"]
        for r in records:
            if self.step in r and (step := int(np.asarray(r[self.step]))) < last:
                raise ValueError(
                    f"WandbLogger: key {r['key']!r} was logged at {self.step}={step}, but run "
                    f"{run} has already written {self.step}={last}; W&B would drop it. Log "
                    f"with increasing {self.step!r} values, or pass another `step=` name."
                )
        by_step, stepless = rows_by_step(records, self.step, wandb.Histogram)
        for step in sorted(by_step):
            wandb_run.log(by_step[step], step=step)
            last = step
        for row in stepless:
            last += 1
            wandb_run.log(row, step=last)
        progress["last"] = last

    def _close(self, handle: tuple[Any, dict[str, int]]) -> None:
        handle[0].finish()
