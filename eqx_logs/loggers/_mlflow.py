import os
import re
import tempfile
import time
from typing import Any

import numpy as np

from ._base import AbstractLogger
from ._host import (
    Record,
    distinct_name,
    flat_items,
    is_scalar,
    process_suffix,
    quiet,
    require,
    unique_name,
)
from ._run_config import RunConfig, flat_config

_BAD = re.compile(r"[^\w./\- ]+")
_LEADING_DOTS = re.compile(r"^\.+")


def metric_name(tag: str) -> str:
    """`tag` as a name MLflow accepts (it treats names as paths): characters it rejects
    become `_`, and so do empty path parts and the leading dots of a part; made distinct for
    distinct tags, within MLflow's 250 characters, by `distinct_name`."""
    parts = [_BAD.sub("_", p) for p in tag.split("/")]
    name = "/".join(_LEADING_DOTS.sub("_", p) or "_" for p in parts)
    return distinct_name(name, tag, 250)


class MLflowLogger(AbstractLogger):
    """MLflow (`pip install '.[mlflow]'` from the checkout): one MLflow run per logger run, named
    `<run_name>-<run>` in `experiment`. Scalars become metrics (at the event's `step`, or a
    per-key counter); arrays are saved as `.npy` artifacts under `arrays/<key>/<step>.npy`.
    Pytree values are logged per leaf as `<key>/<path>`; names MLflow would reject are made
    safe by `metric_name`.

    **Arguments:**

    - `tracking_uri`: for example `"file:./mlruns"` or `"sqlite:///mlflow.db"`.
    - `experiment`: the experiment name (created if missing).
    - `run_name`: the run name prefix.
    - `artifact_location`: where a new experiment keeps its artifacts (MLflow's default is
        `./mlruns` for a database store).
    - `step`: the step name used as MLflow's step.
    - `config`: the run's configuration (keyword-only; see
        [`eqx_logs.loggers.AbstractLogger`][]), recorded as the run's params, flattened with
        dotted keys (`train.lr`; lists as JSON text), in batches of 100. A value longer than
        500 characters (what older MLflow servers keep) is cut to 500, ending in `...`; the
        whole config is also saved as the run's artifact `config.json`.

    !!! example

        The training loop of [`eqx_logs.loggers.AbstractLogger`][]'s example (`train`) with
        this logger, tracked in a local database:

        ```python
        from eqx_logs.loggers import MLflowLogger

        uri = "sqlite:///mlflow.db"
        with MLflowLogger(uri, experiment="demo", config={"lr": 0.1}) as logger:
            model, opt_state = train(logger, model, opt_state)
        # mlflow ui --backend-store-uri sqlite:///mlflow.db
        ```
    """

    tracking_uri: str
    experiment: str = "eqx_logs"
    run_name: str = "run"
    step: str = "step"
    artifact_location: str | None = None

    def __check_init__(self):
        require("mlflow", "mlflow", "MLflowLogger")

    def _open(self, run: int) -> tuple[Any, str, dict[str, int]]:
        with _quiet():
            return self._open_run(run)

    def _open_run(self, run: int) -> tuple[Any, str, dict[str, int]]:
        mlflow = require("mlflow", "mlflow", "MLflowLogger")
        client = mlflow.MlflowClient(tracking_uri=self.tracking_uri)
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is None:
            experiment_id = client.create_experiment(
                self.experiment, artifact_location=self.artifact_location
            )
        else:
            experiment_id = experiment.experiment_id
        mlflow_run = client.create_run(
            experiment_id, run_name=f"{self.run_name}-{run}{process_suffix(self.every_process)}"
        )
        run_id = mlflow_run.info.run_id
        if self.config is not None:
            _log_config(client, run_id, self.config)
        return client, run_id, {}

    def _unstorable(self, leaf: np.ndarray) -> str | None:
        if np.iscomplexobj(leaf) and is_scalar(leaf):  # arrays are .npy artifacts
            return "complex scalars (log `jnp.real(x)` and `jnp.imag(x)` under keys of their own)"
        return None

    def _write(self, handle: tuple[Any, str, dict[str, int]], run: int, rows: list[Record]):
        with _quiet():
            self._write_rows(handle, rows)

    def _write_rows(self, handle: tuple[Any, str, dict[str, int]], rows: list[Record]):
        entities = require("mlflow.entities", "mlflow", "MLflowLogger")
        client, run_id, counters = handle
        now = int(time.time() * 1000)
        metrics = []
        for r in rows:
            for tag, value in flat_items(r["key"], r["value"]):
                step = int(np.asarray(r[self.step])) if self.step in r else counters.get(tag, 0)
                counters[tag] = step + 1
                if is_scalar(value):
                    name = metric_name(tag)
                    metrics.append(entities.Metric(name, float(value.reshape(())), now, step))
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    file = os.path.join(tmp, f"{step}.npy")
                    np.save(file, value, allow_pickle=False)
                    client.log_artifact(run_id, file, f"arrays/{unique_name(tag)}")
        for i in range(0, len(metrics), 1000):  # MLflow's batch limit
            client.log_batch(run_id, metrics=metrics[i : i + 1000])

    def _close(self, handle: tuple[Any, str, dict[str, int]]) -> None:
        client, run_id, _ = handle
        with _quiet():
            client.set_terminated(run_id)


def _quiet():
    """MLflow's INFO records (`Creating initial MLflow database tables...` as a database is
    made), not printed from the writer thread; its warnings pass."""
    return quiet(loggers=("mlflow", "alembic"))


# What every MLflow server accepts: 500 characters a param value (6000 on recent servers), 100
# params a `log_batch`.
_PARAM_VALUE, _PARAMS_PER_BATCH = 500, 100


def _log_config(client: Any, run_id: str, config: RunConfig) -> None:
    """`config` as the params of run `run_id` (flattened, names made safe by `metric_name`,
    values cut to `_PARAM_VALUE` characters), and whole as the artifact `config.json`."""
    entities = require("mlflow.entities", "mlflow", "MLflowLogger")
    params = []
    for key, value in flat_config(config).items():
        text = value if isinstance(value, str) else str(value)
        if len(text) > _PARAM_VALUE:
            text = text[: _PARAM_VALUE - 3] + "..."
        params.append(entities.Param(metric_name(key), text))
    for i in range(0, len(params), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[i : i + _PARAMS_PER_BATCH])
    client.log_dict(run_id, config, "config.json")
