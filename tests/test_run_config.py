"""A run's config (`config=` of every logger, `MultiLogger(..., config=)` and
`eqx_logs.config.instantiate_logger`), read back with each backend's own reader: the JSONL
file's first line (json) and `read_jsonl`, `config.json` beside an ArrayLogger's runs,
TensorBoard's hparams (tensorboard's EventAccumulator and its hparams plugin's metadata
parser), W&B's offline run (its record protobufs), MLflow's params and artifact (the MLflow
client), trackio's run config (`trackio.Api`). The run of examples/train.py that records its
whole Hydra config is checked in tests/test_config.py (`test_default_run_records_its_config`),
which already runs it."""

import atexit
import dataclasses
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import read_tensorboard, read_wandb

import eqx_logs
from eqx_logs.loggers import (
    ArrayLogger,
    ConsoleLogger,
    JsonlLogger,
    MLflowLogger,
    MultiLogger,
    TensorBoardLogger,
    TrackioLogger,
    WandbLogger,
    read_arrays,
    read_jsonl,
)

if "trackio" not in sys.modules:  # trackio reads its directory once, when first imported
    _TRACKIO_DIR = tempfile.mkdtemp(prefix="eqx_logs-trackio-")
    os.environ["TRACKIO_DIR"] = _TRACKIO_DIR
    atexit.register(shutil.rmtree, _TRACKIO_DIR, ignore_errors=True)

CONFIG = {
    "train": {"lr": 0.05, "width": 32, "steps": 3, "tags": ["train", "eval"], "resume": False},
    "logging": {"interval": 10, "reduce": "mean", "window": None, "rules": {}},
    "name": "exp-1",
}
# as MLflow's params and TensorBoard's hparams hold it: flattened, lists as JSON text
FLAT = {
    "train.lr": 0.05,
    "train.width": 32,
    "train.steps": 3,
    "train.tags": '["train", "eval"]',
    "train.resume": False,
    "logging.interval": 10,
    "logging.reduce": "mean",
    "logging.window": "null",
    "logging.rules": "{}",
    "name": "exp-1",
}
LOSSES = [3.0, 2.0, 1.5]


def train(xs):
    def step(c, x):
        eqx_logs.log({"loss": x}, step=c)
        return c + 1, None

    return jax.lax.scan(step, 0, xs)[0]


def write_events(logger, run: int = 0) -> None:
    """Three events of `loss`, at steps 0, 1, 2, spooled into run `run`; closes the logger."""
    with logger:
        logger.spool(train, logger.init(run))(jnp.asarray(LOSSES))


def first_line(path) -> dict:
    with open(path) as f:
        return json.loads(f.readline())


# --- the config itself ------------------------------------------------------------------------


@dataclasses.dataclass
class Optim:
    lr: float = 0.1
    betas: tuple = (0.9, 0.999)


def not_json(x):  # a function: not a JSON value
    return x


def test_config_becomes_plain_json(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"train": {"steps": 10, "total": "${train.steps}"}, "s": [1, 2]})
    logger = JsonlLogger(tmp_path / "l.jsonl", config=cfg)
    assert logger.config == {"train": {"steps": 10, "total": 10}, "s": [1, 2]}  # resolved
    given = {
        "optim": Optim(),
        "sizes": {1: np.float32(0.5), 2: np.int64(3)},
        "a": np.arange(3),
        "path": pathlib.Path("/data/x"),
        "fn": not_json,
        "bad": [float("nan"), float("inf"), complex(1, 2)],
        "ok": (True, None, "x"),
    }
    assert JsonlLogger(tmp_path / "l.jsonl", config=given).config == {
        "optim": {"lr": 0.1, "betas": [0.9, 0.999]},
        "sizes": {"1": 0.5, "2": 3},
        "a": [0, 1, 2],
        "path": "/data/x",
        "fn": str(not_json),
        "bad": ["nan", "inf", "(1+2j)"],
        "ok": [True, None, "x"],
    }
    assert JsonlLogger(tmp_path / "l.jsonl", config=Optim()).config == {
        "lr": 0.1,
        "betas": [0.9, 0.999],
    }
    assert JsonlLogger(tmp_path / "l.jsonl").config is None
    with pytest.raises(TypeError, match=r"config must be a mapping .* got list"):
        JsonlLogger(tmp_path / "l.jsonl", config=[1, 2])


def test_a_logger_with_a_config_passes_through_filter_jit(tmp_path):
    """The config is a pytree of plain values, not a static field: a logger handed to
    `eqx.filter_jit` (as examples/train.py does) stays hashable (a dict is not) and is not
    traced again."""
    traces = []

    @eqx.filter_jit
    def f(logger, x):
        traces.append(None)
        return x + 1

    logger = JsonlLogger(tmp_path / "l.jsonl", config=CONFIG)
    f(logger, jnp.float32(1))
    f(logger, jnp.float32(2))
    assert len(traces) == 1


# --- each backend -----------------------------------------------------------------------------


def test_jsonl_header_line_and_readers_skip_it(tmp_path):
    from eqx_logs._plot import load_curves

    path = tmp_path / "l.jsonl"
    logger = JsonlLogger(path, config=CONFIG)
    write_events(logger)
    write_events(logger, run=1)  # reopened, another run: the same logger, no second header
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"config": CONFIG}
    assert sum('"config"' in line for line in lines) == 1
    rows = read_jsonl(path)
    assert [(r["run"], r["step"], r["value"]) for r in rows] == [
        (run, step, x) for run in (0, 1) for step, x in enumerate(LOSSES)
    ]
    # another logger appending, with another config: a line of its own, further down
    write_events(JsonlLogger(path, config={"lr": 1}), run=2)
    lines = path.read_text().splitlines()
    assert json.loads(lines[1 + len(rows)]) == {"config": {"lr": 1}}
    assert [r["run"] for r in read_jsonl(path)] == [0] * 3 + [1] * 3 + [2] * 3
    # the plot command reads the file as read_jsonl does
    curves, skipped, unstepped = load_curves([str(path)])
    assert set(curves["loss"]) == {"run 0", "run 1", "run 2"} and not skipped and not unstepped
    assert curves["loss"]["run 2"] == ([0.0, 1.0, 2.0], LOSSES)
    # without a config, no header (the file is as before)
    plain = tmp_path / "plain.jsonl"
    write_events(JsonlLogger(plain))
    assert [json.loads(line) for line in plain.read_text().splitlines()] == read_jsonl(plain)


def test_array_logger_writes_config_json_beside_its_runs(tmp_path):
    write_events(ArrayLogger(tmp_path / "arr", config=CONFIG))
    assert json.loads((tmp_path / "arr" / "config.json").read_text()) == CONFIG
    events = read_arrays(tmp_path / "arr")["loss"]
    assert [float(e["value"]) for e in events] == LOSSES


def read_hparams(rundir) -> dict:
    """A TensorBoard run's hparams, read with tensorboard's EventAccumulator and its hparams
    plugin's own parser of the session start info."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(os.fspath(rundir))
    acc.Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    info = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    out = {}
    for name, value in info.hparams.items():
        out[name] = getattr(value, value.WhichOneof("kind"))
    return out


def test_tensorboard_hparams(tmp_path):
    write_events(TensorBoardLogger(tmp_path / "tb", config=CONFIG), run=1)
    assert read_hparams(tmp_path / "tb" / "run_1") == FLAT
    scalars, _ = read_tensorboard(tmp_path / "tb" / "run_1")
    assert scalars == {"loss": list(enumerate(LOSSES))}


def test_wandb_run_config(wandb_env):
    pytest.importorskip("wandb")
    write_events(WandbLogger(name="cfg", dir=os.fspath(wandb_env), config=CONFIG))
    (file,) = wandb_env.glob("wandb/offline-run-*/run-*.wandb")
    run = read_wandb(file)
    assert run["name"] == "cfg-0"
    assert {k: v for k, v in run["config"].items() if k != "_wandb"} == CONFIG
    assert [row["loss"] for row in run["history"]] == LOSSES


def test_mlflow_params_and_config_artifact(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    config = {
        **CONFIG,
        "long": "x" * 700,  # over the 500 characters some servers keep: cut
        "many": {f"k{i}": i for i in range(150)},  # over the 100 params of one log_batch
    }
    logger = MLflowLogger(uri, experiment="cfg", artifact_location=(tmp_path / "art").as_uri())
    write_events(logger._with_config(config))  # (as MultiLogger and instantiate_logger do)
    client = mlflow.MlflowClient(uri)
    (found,) = client.search_runs([client.get_experiment_by_name("cfg").experiment_id])
    run = client.get_run(found.info.run_id)
    want = {k: str(v) for k, v in FLAT.items()}
    want |= {"long": "x" * 497 + "..."} | {f"many.k{i}": str(i) for i in range(150)}
    assert run.data.params == want
    assert [m.value for m in client.get_metric_history(found.info.run_id, "loss")] == LOSSES
    local = client.download_artifacts(found.info.run_id, "config.json", os.fspath(tmp_path))
    assert json.loads(pathlib.Path(local).read_text()) == config


def test_trackio_run_config(monkeypatch, tmp_path):
    """(trackio's directory: this module's temporary one, or test_trackio's where that module
    imported trackio first.)"""
    pytest.importorskip("trackio")
    import huggingface_hub.constants

    for name in ["TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]:
        monkeypatch.delenv(name, raising=False)  # local only: no user name looked up
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    import trackio

    project = f"eqx_logs-run-config-{os.getpid()}"
    write_events(TrackioLogger(project=project, name="cfg", config=CONFIG))
    (run,) = trackio.Api().runs(project)
    assert run.name == "cfg-0"
    assert {k: v for k, v in run.config.items() if not k.startswith("_")} == CONFIG
    with pytest.raises(ValueError, match=r"config keys \['_x'\] start with '_'"):
        TrackioLogger(config={"_x": 1})


def test_console_prints_no_config(tmp_path, capsys):
    write_events(ConsoleLogger())
    plain = capsys.readouterr().out
    write_events(ConsoleLogger(config=CONFIG))
    assert capsys.readouterr().out == plain and "exp-1" not in plain


# --- values that are not JSON; MultiLogger ----------------------------------------------------


def test_values_that_are_not_json_are_recorded_as_their_str(tmp_path):
    config = {"data": pathlib.Path("/data/mnist"), "init": not_json, "eps": float("-inf")}
    want = {"data": "/data/mnist", "init": str(not_json), "eps": "-inf"}
    write_events(JsonlLogger(tmp_path / "l.jsonl", config=config))
    assert first_line(tmp_path / "l.jsonl") == {"config": want}
    write_events(TensorBoardLogger(tmp_path / "tb", config=config))
    assert read_hparams(tmp_path / "tb" / "run_0") == want


def test_multi_logger_passes_its_config_to_each(tmp_path):
    jsonl, array = JsonlLogger(tmp_path / "a.jsonl"), ArrayLogger(tmp_path / "arr")
    own = JsonlLogger(tmp_path / "own.jsonl", config={"mine": 1})
    logger = MultiLogger(jsonl, array, own, config=CONFIG)
    assert [child.config for child in logger.loggers] == [CONFIG, CONFIG, {"mine": 1}]
    assert (
        logger.loggers[0]._sink.writer is jsonl._sink.writer
    )  # a copy writing through the same queue
    write_events(logger)
    assert first_line(tmp_path / "a.jsonl") == {"config": CONFIG}
    assert json.loads((tmp_path / "arr" / "config.json").read_text()) == CONFIG
    assert first_line(tmp_path / "own.jsonl") == {"config": {"mine": 1}}  # its own is kept
    for name in ("a.jsonl", "own.jsonl"):
        assert [r["value"] for r in read_jsonl(tmp_path / name)] == LOSSES


# --- Hydra ------------------------------------------------------------------------------------


def test_instantiate_logger_records_the_whole_hydra_config(tmp_path, monkeypatch):
    """`eqx_logs.config.instantiate_logger(cfg)` with examples/conf, `logger=multi` (console
    and JSONL): the JSONL file's first line is the whole config, resolved."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import eqx_logs.config

    conf = pathlib.Path(__file__).resolve().parents[1] / "examples" / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose("config", overrides=["logger=multi", "train.lr=0.25"])
    monkeypatch.chdir(tmp_path)  # the multi option's JSONL path is relative
    logger = eqx_logs.config.instantiate_logger(cfg)
    assert isinstance(logger, MultiLogger)
    want = OmegaConf.to_container(cfg, resolve=True)
    assert want["train"]["lr"] == 0.25 and "hydra" not in want
    assert [child.config for child in logger.loggers] == [want, want]
    write_events(logger)
    assert first_line(tmp_path / "logs.jsonl") == {"config": want}
    bad = OmegaConf.create({"logger": {"_target_": "builtins.dict"}})
    with pytest.raises(TypeError, match=re.escape("`logger` made a dict, not an eqx_logs")):
        eqx_logs.config.instantiate_logger(bad)
