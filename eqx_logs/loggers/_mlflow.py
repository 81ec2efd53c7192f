import os
import re
import tempfile
import time
from typing import Any

import numpy as np

from ._base import AbstractLogger, Record, flat_items, is_scalar, require, safe_name

_BAD = re.compile(r"[^\w./\- ]+")


class MLflowLogger(AbstractLogger):
    """MLflow (`pip install 'eqx_logs[mlflow]'`): one MLflow run per logger run, named
    `<run_name>-<run>` in `experiment`. Scalars become metrics (at the event's `step`, or a
    per-key counter); arrays are saved as `.npy` artifacts under `arrays/<key>/<step>.npy`.
    Pytree values are logged per leaf as `<key>/<path>`; characters MLflow rejects in metric
    names become `_`.

    **Arguments:**

    - `tracking_uri`: for example `"file:./mlruns"` or `"sqlite:///mlflow.db"`.
    - `experiment`: the experiment name (created if missing).
    - `run_name`: the run name prefix.
    - `step`: the step name used as MLflow's step.
    """

    tracking_uri: str
    experiment: str = "eqx_logs"
    run_name: str = "run"
    step: str = "step"

    def __check_init__(self):
        require("mlflow", "mlflow", "MLflowLogger")

    def _open(self, run: int) -> tuple[Any, str, dict[str, int]]:
        mlflow = require("mlflow", "mlflow", "MLflowLogger")
        client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            experiment_id = client.create_experiment(self.experiment)
        else:
            experiment_id = experiment.experiment_id
        mlflow_run = client.create_run(experiment_id, run_name=f"{self.run_name}-{run}")
        return client, mlflow_run.info.run_id, {}

    def _write(self, handle: tuple[Any, str, dict[str, int]], run: int, rows: list[Record]):
        entities = require("mlflow.entities", "mlflow", "MLflowLogger")
        client, run_id, counters = handle
        now = int(time.time() * 1000)
        metrics = []
        for r in rows:
            for tag, value in flat_items(r["key"], r["value"]):
                tag = _BAD.sub("_", tag)
                step = int(np.asarray(r[self.step])) if self.step in r else counters.get(tag, 0)
                counters[tag] = step + 1
                if is_scalar(value):
                    metrics.append(entities.Metric(tag, float(value.reshape(())), now, step))
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    file = os.path.join(tmp, f"{step}.npy")
                    np.save(file, value, allow_pickle=False)
                    client.log_artifact(run_id, file, f"arrays/{safe_name(tag)}")
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            client.log_batch(run_id, metrics=metrics[i : i + 1000])

    def _close(self, handle: tuple[Any, str, dict[str, int]]) -> None:
        client, run_id, _ = handle
        client.set_terminated(run_id)
