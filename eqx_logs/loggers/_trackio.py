import contextvars
import os
import sys
from pathlib import Path
from typing import Any

import equinox as eqx
import numpy as np

from ._base import AbstractLogger
from ._host import Record, not_complex, process_suffix, quiet, require, rows_by_step


class _RunIds:
    """The logger runs this logger has opened: reopened after `close()`, they resume their
    trackio run instead of starting another. Hashed by identity, like the writer."""

    def __init__(self):
        self.opened: set[int] = set()


class TrackioLogger(AbstractLogger):
    """[trackio](https://github.com/gradio-app/trackio), the local-first tracker with W&B's
    API (`pip install '.[trackio]'` from the checkout): one trackio run per logger run, named
    `<name>-<run>` and grouped under `name`, in project `project` of trackio's local SQLite
    database. No account and no network: nothing is sent anywhere unless trackio's own
    `TRACKIO_SPACE_ID` or `TRACKIO_SERVER_URL` is set, and no dashboard is started (run
    `trackio show --project <project>` to see the runs). Where a Hugging Face token is set,
    trackio looks up its user name (one request per run; `HF_HUB_OFFLINE=1` prevents it).

    Scalars are logged as numbers, arrays as `trackio.Histogram`s (of their finite entries),
    pytree values per leaf as `<key>/<path>`. NaN and infinities are kept as such. The records
    of one write are grouped by their `step`, in increasing order; each record without one
    gets trackio's next step. Closed and used again, the logger resumes its runs.

    trackio keeps every project in one directory, `TRACKIO_DIR` (by default
    `~/.cache/huggingface/trackio`), which it reads once, when it is first imported. `dir`
    sets it for that import; once trackio is imported, a different `dir` raises.

    **Arguments:**

    - `project`: the trackio project.
    - `name`: the run name prefix and the runs' group.
    - `config`: the run's configuration, recorded as each trackio run's config
        (keyword-only; see [`eqx_logs.loggers.AbstractLogger`][]). Its top-level keys must
        not start with `_`, which trackio reserves.
    - `dir`: trackio's directory (see above); `None` keeps trackio's.
    - `step`: the step name used as trackio's step.
    - `system_metrics`: also let trackio sample CPU and GPU metrics (a thread per run).

    !!! example

        The training loop of [`eqx_logs.loggers.AbstractLogger`][]'s example (`train`) with
        this logger:

        ```python
        from eqx_logs.loggers import TrackioLogger

        with TrackioLogger(project="demo", config={"lr": 0.1}) as logger:
            model, opt_state = train(logger, model, opt_state)
        # trackio show --project demo
        ```
    """

    project: str = "eqx_logs"
    name: str = "eqx_logs"
    dir: str | None = None
    step: str = "step"
    system_metrics: bool = False
    _runs: _RunIds = eqx.field(static=True, default_factory=_RunIds, repr=False, init=False)

    def __check_init__(self):
        _check_reserved(self.config)
        if self.dir is not None and "trackio" not in sys.modules:
            os.environ["TRACKIO_DIR"] = os.path.abspath(self.dir)
        utils = require("trackio.utils", "trackio", "TrackioLogger")
        if self.dir is not None and Path(utils.TRACKIO_DIR).resolve() != Path(self.dir).resolve():
            raise ValueError(
                f"TrackioLogger(dir={self.dir!r}): trackio was already imported in this "
                f"process, with its directory {str(utils.TRACKIO_DIR)!r} (trackio reads "
                "TRACKIO_DIR once, when first imported). Pass dir=None to write there, or set "
                "TRACKIO_DIR before anything imports trackio."
            )

    def _open(self, run: int) -> Any:
        trackio = require("trackio", "trackio", "TrackioLogger")
        _check_reserved(self.config)  # (a config given by a MultiLogger, unchecked till now)
        resume = "allow" if run in self._runs.opened else "never"
        # trackio.init finishes the "current" run of the calling context: each run is made in
        # a context of its own, so that the runs of one logger (one per vmap lane) stay open
        # trackio prints where it writes, how to see the runs and, as a run finishes, that it
        # "uploads" it (to its local database): not here, on the writer thread (the
        # docstring says where the runs are); its warnings pass
        with quiet(stdout=True):
            trackio_run = contextvars.Context().run(
                trackio.init,
                project=self.project,
                name=f"{self.name}-{run}{process_suffix(self.every_process)}",
                group=self.name,
                config=self.config,
                resume=resume,
                embed=False,
                auto_log_cpu=self.system_metrics,
                auto_log_gpu=self.system_metrics,
            )
        self._runs.opened.add(run)
        return trackio_run

    def _unstorable(self, leaf: np.ndarray) -> str | None:
        return not_complex(leaf)

    def _write(self, handle: Any, run: int, records: list[Record]):
        del run
        trackio = require("trackio", "trackio", "TrackioLogger")
        by_step, stepless = rows_by_step(records, self.step, trackio.Histogram)
        for step in sorted(by_step):
            handle.log(by_step[step], step=step)
        for row in stepless:  # at trackio's next step
            handle.log(row)

    def _close(self, handle: Any) -> None:
        with quiet(stdout=True):
            handle.finish()  # waits for trackio's own writer thread


def _check_reserved(config: dict[str, Any] | None) -> None:
    reserved = [k for k in config or {} if k.startswith("_")]
    if reserved:
        raise ValueError(
            f"TrackioLogger: config keys {reserved} start with '_', which trackio reserves "
            "for its own entries; rename them."
        )
