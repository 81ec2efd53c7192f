"""Hydra integration: `examples/conf/` (with the package's groups, `eqx_logs/conf/`) composed
with Hydra's compose API (every knob, checked field by field on the instantiated Policy and
logger; bad values), and real command-line runs of
`examples/train.py` in a subprocess, whose files on disk are checked against independent
references (a `logging=debug` run's per-step values, numpy, an in-process training loop)."""

import functools
import importlib.util
import json
import logging
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_aligned
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, InstantiationException
from hydra.utils import instantiate
from omegaconf import OmegaConf

import eqx_logs
import eqx_logs.config  # noqa: F401  (registers the structured configs)
from eqx_logs import Fanout, Max, Mean, Stack, Window
from eqx_logs.config import Instrumentation
from eqx_logs.loggers import (
    AbstractLogger,
    ArrayLogger,
    ConsoleLogger,
    JsonlLogger,
    MLflowLogger,
    MultiLogger,
    ProgressLogger,
    TensorBoardLogger,
    TrackioLogger,
    WandbLogger,
)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "examples" / "conf"
TRAIN = ROOT / "examples" / "train.py"

STEPS, CHUNK = 200, 100
SHORT = (f"train.steps={STEPS}", f"train.chunk={CHUNK}")
TRAIN_KEYS = {"loss", "grad/layer0", "grad/layer1", "grad/layer2"}
DEBUG_KEYS = {"activation/0", "activation/1"}


# --------------------------------------------------------------------------------------------
# The compose API
# --------------------------------------------------------------------------------------------


def compose_cfg(*overrides: str, config_dir: Path = CONF):
    train_module()  # registers the `train` block's schema (`TrainConfig`), as train.py's run does
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def compose_policy(*overrides: str) -> eqx_logs.Policy:
    return instantiate(compose_cfg(*overrides).logging)


# logging/default.yaml, written out by hand.
DEFAULT = dict(
    reduce=Stack(),
    interval=10,
    window=None,
    tags=None,
    exclude=("debug",),
    rules=(),
    prefix="",
    seed=None,
)
DEBUG = {**DEFAULT, "interval": 1, "exclude": ()}
TRAIN_PRESET = {
    **DEFAULT,
    "reduce": Mean(),
    "interval": 1,
    "window": 100,
    "tags": ("train",),
    "exclude": (),
    "rules": (("grad/*", Max()),),
}


def check_policy(policy, *, reduce, interval, window, tags, exclude, rules, prefix, seed):
    """`policy` has exactly these fields (types included: tuples, not OmegaConf lists)."""
    assert type(policy) is eqx_logs.Policy
    assert type(policy.reduce) is type(reduce), policy.reduce
    assert policy.reduce == reduce, f"{policy.reduce} != {reduce}"
    assert type(policy.interval) is int and policy.interval == interval
    if window is None:
        assert policy.window is None
    else:
        assert type(policy.window) is int and policy.window == window
    if tags is None:
        assert policy.tags is None
    else:
        assert type(policy.tags) is tuple and policy.tags == tags
    assert type(policy.exclude) is tuple and policy.exclude == exclude
    assert type(policy.rules) is tuple
    assert [type(pair) for pair in policy.rules] == [tuple] * len(rules)
    assert [p for p, _ in policy.rules] == [p for p, _ in rules], "rule order"
    for (pattern, got), (_, want) in zip(policy.rules, rules):
        assert type(got) is type(want) and got == want, f"rule {pattern!r}: {got} != {want}"
    assert policy.prefix == prefix
    if seed is None:
        assert policy.key is None
    else:
        assert jax.dtypes.issubdtype(policy.key.dtype, jax.dtypes.prng_key)
        np.testing.assert_array_equal(
            jax.random.key_data(policy.key), jax.random.key_data(jax.random.key(seed))
        )


POLICY_CASES = {
    "default preset": ([], DEFAULT),
    "logging=debug": (["logging=debug"], DEBUG),
    "logging=train": (["logging=train"], TRAIN_PRESET),
    # on top of debug (interval 1), so that an ignored override fails
    "logging.interval=10": (["logging=debug", "logging.interval=10"], {**DEBUG, "interval": 10}),
    "logging.interval=7": (["logging.interval=7"], {**DEFAULT, "interval": 7}),
    "logging.reduce=mean": (["logging.reduce=mean"], {**DEFAULT, "reduce": Mean()}),
    "logging.reduce=max on train": (
        ["logging=train", "logging.reduce=max"],
        {**TRAIN_PRESET, "reduce": Max()},
    ),
    "logging.tags=[train]": (["logging.tags=[train]"], {**DEFAULT, "tags": ("train",)}),
    "logging.tags=[train,eval]": (
        ["logging.tags=[train,eval]"],
        {**DEFAULT, "tags": ("train", "eval")},
    ),
    "logging.tags=null on train": (
        ["logging=train", "logging.tags=null"],
        {**TRAIN_PRESET, "tags": None},
    ),
    "logging.exclude=[debug,slow]": (
        ["logging.exclude=[debug,slow]"],
        {**DEFAULT, "exclude": ("debug", "slow")},
    ),
    "logging.window=null on train": (
        ["logging=train", "logging.window=null"],
        {**TRAIN_PRESET, "window": None},
    ),
    "logging.window=50": (["logging.window=50"], {**DEFAULT, "window": 50}),
    "+logging.rules={grad/*: mean}": (
        ["+logging.rules={grad/*: mean}"],
        {**DEFAULT, "rules": (("grad/*", Mean()),)},
    ),
    "rules keep their order": (
        ["+logging.rules={z/*: max, a/*: drop, grad/*: mean}"],
        {**DEFAULT, "rules": (("z/*", Max()), ("a/*", "drop"), ("grad/*", Mean()))},
    ),
    "logging.rules= replaces the train preset's rule": (
        ["logging=train", "logging.rules={grad/*: mean}"],
        {**TRAIN_PRESET, "rules": (("grad/*", Mean()),)},
    ),
    "+logging.rules= adds to the train preset's rules": (
        ["logging=train", "+logging.rules={lr: drop}"],
        {**TRAIN_PRESET, "rules": (("grad/*", Max()), ("lr", "drop"))},
    ),
    "nested reduce by _target_": (
        ["logging.reduce={_target_:eqx_logs.Window,size:100,inner:mean}"],
        {**DEFAULT, "reduce": Window(100, Mean())},
    ),
    "nested Fanout with a nested _target_": (
        ["logging.reduce={_target_:eqx_logs.Fanout,mean:mean,max:{_target_:eqx_logs.Max}}"],
        {**DEFAULT, "reduce": Fanout(mean=Mean(), max=Max())},
    ),
    "logging.prefix=run/": (["logging.prefix=run/"], {**DEFAULT, "prefix": "run/"}),
    "logging.seed=3": (["logging.seed=3"], {**DEFAULT, "seed": 3}),
    "several knobs at once": (
        [
            "logging=debug",
            "logging.reduce=mean",
            "logging.interval=5",
            "logging.window=20",
            "logging.tags=[train]",
            "logging.prefix=a/",
            "logging.seed=0",
        ],
        {
            **DEBUG,
            "reduce": Mean(),
            "interval": 5,
            "window": 20,
            "tags": ("train",),
            "prefix": "a/",
            "seed": 0,
        },
    ),
}


@pytest.mark.parametrize("overrides, want", POLICY_CASES.values(), ids=list(POLICY_CASES))
def test_compose_policy(overrides, want):
    check_policy(compose_policy(*overrides), **want)


def test_compose_nested_window_fields():
    policy = compose_policy("logging.reduce={_target_:eqx_logs.Window,size:100,inner:mean}")
    assert type(policy.reduce) is Window
    assert policy.reduce.size == 100
    assert type(policy.reduce.inner) is Mean
    assert policy.reduce.capacity is None


def test_compose_rules_choose_reductions():
    """The instantiated rules act: the first matching pattern wins; others get `reduce`."""
    policy = compose_policy("logging.reduce=last", "+logging.rules={grad/b: drop, grad/*: max}")
    assert policy.reduction("grad/w") == Max()
    assert policy.reduction("grad/b") == "drop"
    assert policy.reduction("loss") == eqx_logs.Last()
    windowed = compose_policy("logging=train")
    assert windowed.reduction("grad/layer0") == Window(100, Max())
    assert windowed.reduction("loss") == Window(100, Mean())


def test_yaml_preset_with_quoted_rules_and_nested_target(tmp_path):
    """A user's own YAML preset: quoted rule patterns, a nested `_target_` reduction,
    `window: null`, lists for tags/exclude."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "logging").mkdir()  # an option of the application's, beside the package's
    (conf / "logging" / "mine.yaml").write_text(
        "defaults:\n"
        "  - /eqx_logs/logging/base@_here_\n"
        "  - _self_\n"
        "reduce:\n"
        "  _target_: eqx_logs.Window\n"
        "  size: 25\n"
        "  inner: max\n"
        "interval: 2\n"
        "window: null\n"
        "tags: [train, eval]\n"
        "exclude: [debug]\n"
        'rules: {"grad/*": mean, "lr": drop}\n'
        "prefix: mine/\n"
        "seed: 7\n"
    )
    cfg = compose_cfg("logging=mine", config_dir=conf)
    check_policy(
        instantiate(cfg.logging),
        reduce=Window(25, Max()),
        interval=2,
        window=None,
        tags=("train", "eval"),
        exclude=("debug",),
        rules=(("grad/*", Mean()), ("lr", "drop")),
        prefix="mine/",
        seed=7,
    )


def test_compose_rule_with_nested_target():
    policy = compose_policy("+logging.rules={grad/*: {_target_:eqx_logs.Window,size:10,inner:max}}")
    check_policy(policy, **{**DEFAULT, "rules": (("grad/*", Window(10, Max())),)})


def test_train_preset_in_a_spool():
    """`logging=train` instantiated and used: train-tagged keys only, windowed means of 100
    events (the last one partial), gradient norms' windowed max; against numpy."""
    policy = compose_policy("logging=train")
    xs = jnp.sin(jnp.arange(250.0)) + 2.0

    def f(xs):
        def step(c, x):
            eqx_logs.log({"loss": x, "grad/w": x**2}, tags="train", step=c)
            eqx_logs.log("activation", 3 * x, tags="debug", step=c)
            return c + 1, None

        return jax.lax.scan(step, 0, xs)[0]

    _, logs = eqx_logs.spool(f, policy=policy)(xs)
    assert set(logs) == {"loss", "grad/w"}
    x = np.asarray(xs)
    windows = [x[0:100], x[100:200], x[200:250]]
    np.testing.assert_allclose(logs["loss"], [w.mean() for w in windows], rtol=1e-5)
    np.testing.assert_allclose(logs["grad/w"], [(w**2).max() for w in windows], rtol=1e-5)


LOGGER_CASES = {
    "default (jsonl)": ([], JsonlLogger, {"path": "logs.jsonl"}),
    "logger=jsonl": (["logger=jsonl"], JsonlLogger, {"path": "logs.jsonl"}),
    "logger.path=x.jsonl": (["logger.path=x.jsonl"], JsonlLogger, {"path": "x.jsonl"}),
    "logger=console": (["logger=console"], ConsoleLogger, {"last_only": True}),
    "logger=console last_only=false": (
        ["logger=console", "logger.last_only=false"],
        ConsoleLogger,
        {"last_only": False},
    ),
    "logger=array": (["logger=array"], ArrayLogger, {"path": "arrays"}),
    "logger=tensorboard": (
        ["logger=tensorboard", "logger.logdir=tb"],
        TensorBoardLogger,
        {"logdir": "tb", "step": "step"},
    ),
    "logger=wandb": (
        ["logger=wandb", "logger.mode=offline"],
        WandbLogger,
        {"project": "eqx_logs", "name": "train", "mode": "offline", "dir": "."},
    ),
    "logger=mlflow": (
        ["logger=mlflow"],
        MLflowLogger,
        {"tracking_uri": "sqlite:///mlflow.db", "experiment": "train"},
    ),
    "logger=trackio": (
        ["logger=trackio"],
        TrackioLogger,
        {"project": "train", "name": "train", "dir": None, "step": "step"},
    ),
    "logger=progress": (
        ["logger=progress", "train.steps=300"],
        ProgressLogger,
        {"total": 300, "desc": "train", "ncols": None},
    ),
}


def test_compose_multi_logger():
    logger = instantiate(compose_cfg("logger=multi").logger)
    assert type(logger) is MultiLogger
    assert [type(child) for child in logger.loggers] == [ConsoleLogger, JsonlLogger]
    assert logger.loggers[0].last_only is True and logger.loggers[1].path == "logs.jsonl"


@pytest.mark.parametrize("overrides, cls, fields", LOGGER_CASES.values(), ids=list(LOGGER_CASES))
def test_compose_logger(overrides, cls, fields):
    cfg = compose_cfg(*overrides)
    logger = instantiate(cfg.logger)
    assert type(logger) is cls
    assert isinstance(logger, AbstractLogger)
    for name, value in fields.items():
        got = getattr(logger, name)
        assert type(got) is type(value) and got == value, f"{name}: {got!r}"
    # the logging group is untouched by logger overrides
    check_policy(instantiate(cfg.logging), **DEFAULT)


@pytest.mark.parametrize(
    "name", ["console", "jsonl", "array", "tensorboard", "wandb", "mlflow", "trackio", "progress"]
)
def test_every_process_is_a_logger_key(name):
    # a key of every logger config (multi-process runs), off by default
    extra = ["logger.mode=offline"] if name == "wandb" else []  # no W&B login here
    assert instantiate(compose_cfg(f"logger={name}", *extra).logger).every_process is False
    cfg = compose_cfg(f"logger={name}", "logger.every_process=true", *extra)
    assert instantiate(cfg.logger).every_process is True


@pytest.mark.parametrize(
    "name",
    ["console", "jsonl", "array", "tensorboard", "wandb", "mlflow", "trackio", "progress", "multi"],
)
def test_writer_policy_is_a_logger_key(name):
    # `on_full` and `stall_timeout` (eqx_logs.loggers.AbstractLogger): keys of every logger
    # config; for `logger=multi`, of each of its loggers
    extra = ["logger.mode=offline"] if name == "wandb" else []  # no W&B login here

    def policies(*overrides):
        logger = instantiate(compose_cfg(f"logger={name}", *extra, *overrides).logger)
        children = logger.loggers if isinstance(logger, MultiLogger) else (logger,)
        return {(child.on_full, child.stall_timeout) for child in children}

    assert policies() == {("block", 60.0)}
    assert policies("logger.on_full=drop", "logger.stall_timeout=2.5") == {("drop", 2.5)}
    assert policies("logger.stall_timeout=null") == {("block", None)}


def test_bad_writer_policy_names_the_key():
    with pytest.raises(InstantiationException, match=r"on_full='sometimes'.*'block'.*'drop'"):
        instantiate(compose_cfg("logger.on_full=sometimes").logger)
    with pytest.raises(InstantiationException, match=r"stall_timeout=-1\.0\): stall_timeout"):
        instantiate(compose_cfg("logger.stall_timeout=-1").logger)
    with pytest.raises(ConfigCompositionException, match="logger.stall_timeout=soon"):
        compose_cfg("logger.stall_timeout=soon")


def test_wandb_online_without_a_login_fails_before_training(tmp_path, jax_cache):
    """`logger=wandb` (online) where W&B has no credentials: the run stops when the logger is
    made, before the first step, and says how to log offline."""
    env = _env(jax_cache)
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_MODE", None)
    env.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))
    proc = subprocess.run(
        [sys.executable, str(TRAIN), *SHORT, f"hydra.run.dir='{tmp_path / 'run'}'"]
        + ["logger=wandb"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "needs a login" in output and "logger.mode=offline" in output, output
    assert not re.search(r"^loss ", proc.stdout, re.M)  # failed before training
    assert not (tmp_path / "run" / "wandb").exists()


def test_jsonl_logger_path_override_writes_there(tmp_path):
    logger = instantiate(compose_cfg(f"logger.path='{tmp_path / 'sub' / 'x.jsonl'}'").logger)
    _, logs = eqx_logs.spool(lambda x: eqx_logs.log("a", x))(jnp.float32(1.5))
    with logger:
        logger.write(logs)
    assert [
        json.loads(line) for line in (tmp_path / "sub" / "x.jsonl").read_text().splitlines()
    ] == [{"run": 0, "key": "a", "value": 1.5}]


WATCH_CASES = {
    "logging.watch=while": (["logging.watch=while"], eqx_logs.Watch("while")),
    "logging.watch=[while,cholesky]": (
        ["logging.watch=[while,cholesky]"],
        eqx_logs.Watch("while", "cholesky"),
    ),
    "logging.watch={names, where, max_depth, stats}": (
        ["logging.watch={names: [scan], where: 'watch/scan*', max_depth: 1, stats: [rms]}"],
        eqx_logs.Watch("scan", where="watch/scan*", max_depth=1, stats=("rms",)),
    ),
}


@pytest.mark.parametrize("overrides, want", WATCH_CASES.values(), ids=list(WATCH_CASES))
def test_compose_watch(overrides, want):
    assert compose_policy().watch is None
    assert compose_policy(*overrides).watch == want


def test_a_bad_watch_names_the_key():
    cfg = compose_cfg("logging.watch={names: [while], max_dept: 1}")
    with pytest.raises(InstantiationException, match=r"logging.watch=.*max_dept"):
        instantiate(cfg.logging)


# Bad values fail when the config is instantiated, before anything runs, naming key and value.
BAD_VALUES = {
    "logging.interval=0": ("logging.interval=0", "logging.interval=0"),
    "logging.interval=-1": ("logging.interval=-1", "logging.interval=-1"),
    "logging.window=0": ("logging.window=0", "logging.window=0"),
    "logging.reduce=meen": ("logging.reduce=meen", "logging.reduce='meen'"),
    "logging.reduce=drop": ("logging.reduce=drop", "logging.reduce='drop'"),
    "unknown rule reduction": ("+logging.rules={grad/*: meen}", "logging.rules.grad/*='meen'"),
}


@pytest.mark.parametrize("override, message", BAD_VALUES.values(), ids=list(BAD_VALUES))
def test_bad_value_names_key_and_value(override, message):
    cfg = compose_cfg(override)
    with pytest.raises(InstantiationException) as info:
        instantiate(cfg.logging)
    assert message in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def test_across_is_a_config_key():
    assert compose_policy("logging.across=[d]").across == ("d",)
    assert compose_policy("logging.across=[a,b]").across == ("a", "b")
    assert compose_policy().across == ()


def test_bad_reduce_lists_the_valid_names():
    with pytest.raises(InstantiationException) as info:
        compose_policy("logging.reduce=meen")
    for name in ("mean", "stack", "max", "last"):
        assert repr(name) in str(info.value)


def test_bad_nested_reduce_names_the_key():
    with pytest.raises(InstantiationException) as info:
        compose_policy("logging.reduce={_target_:eqx_logs.Window,size:0,inner:mean}")
    assert "Window(size=0)" in str(info.value)
    assert "logging.reduce" in str(info.value)


# Values of the wrong type are Hydra's own errors, at composition.
TYPE_ERRORS = {
    "logging.interval=abc": ("logging.interval=abc", "abc"),
    "logging.interval=1.5": ("logging.interval=1.5", "1.5"),
    "logging.window=abc": ("logging.window=abc", "abc"),
    "logging.seed=abc": ("logging.seed=abc", "abc"),
}


@pytest.mark.parametrize("override, value", TYPE_ERRORS.values(), ids=list(TYPE_ERRORS))
def test_wrong_type_is_hydras_error(override, value):
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg(override)
    assert override in str(info.value)
    assert value in str(info.value.__cause__)


# A key that is no option of the group: Hydra lets it through (`PolicyConfig`'s node is open)
# and `eqx_logs.config.policy` refuses it, naming the option it is closest to.
MISSPELT = {
    "intervall": ("logging.intervall=10", "logging.interval", 10),
    "tag": ("logging.tag=train", "logging.tags", ("train",)),
    "case": ("logging.Reduce=mean", "logging.reduce", Mean()),
    "in a preset": ("logging=train logging.windw=10", "logging.window", 10),
    "nothing close": ("+logging.frobnicate=1", None, None),
}


@pytest.mark.fast
@pytest.mark.parametrize("overrides, meant, value", MISSPELT.values(), ids=list(MISSPELT))
def test_a_misspelt_logging_key_names_the_closest_option(overrides, meant, value):
    *preset, override = overrides.split()
    key, given = override.lstrip("+").split("=")
    with pytest.raises(InstantiationException) as info:
        compose_policy(*preset, override)
    message = str(info.value.__cause__)
    assert isinstance(info.value.__cause__, TypeError)
    assert re.match(rf"{re.escape(key)}='?{given}'?: logging has no option '{key[8:]}'\.", message)
    assert "Its options are ['reduce', 'interval', 'window', 'tags'," in message, message
    if meant is None:
        assert "Did you mean" not in message, message
    else:
        assert f"Did you mean {meant}?" in message, message
        # the option meant, written instead, is a real one and takes the value
        got = getattr(compose_policy(*preset, f"{meant}={given}"), meant.split(".")[1])
        assert got == value


@pytest.mark.fast
def test_one_tag_is_a_list_of_one():
    """`logging.tags=train` is `spool(tags="train")`'s one tag (as `logging.tags=[train]`);
    so for `exclude` and `across`. Anything else is still refused, naming the key, and a
    misspelt tag is still said after the trace (the policy's own check, as in a spool)."""
    for key in ("tags", "exclude", "across"):
        one = compose_policy(f"logging.{key}=train")
        assert getattr(one, key) == ("train",) == getattr(eqx_logs.Policy(**{key: "train"}), key)
        assert getattr(compose_policy(f"logging.{key}=[train]"), key) == ("train",)
    assert compose_policy("logging=train", "logging.tags=eval").tags == ("eval",)
    for bad in ("logging.tags=3", "logging.tags=[train,3]", "logging.tags={a: 1}"):
        with pytest.raises(InstantiationException) as info:
            compose_policy(bad)
        assert f"{bad.split('=')[0]}=" in str(info.value.__cause__), bad
        assert "must be a string or a list of strings" in str(info.value.__cause__), bad

    def f(x):
        eqx_logs.log({"loss": x}, tags="train")
        return x

    with pytest.warns(UserWarning, match=r"tags=\('trian',\).*Did you mean 'train' for 'trian'"):
        eqx_logs.spool(f, policy=compose_policy("logging.tags=trian"))(jnp.float32(1.0))


# examples/train.py's `train` block has a schema (`TrainConfig`): a value of the wrong type is
# Hydra's error at composition, naming the key, before anything runs.
TRAIN_TYPE_ERRORS = {
    "lr": ("train.lr=abc", "could not be converted to Float"),
    "steps": ("train.steps=1.5", "could not be converted to Integer"),
    "stream": ("train.stream=maybe", "is not a valid bool"),
    "misspelt": ("train.lrr=0.1", "Key 'lrr' not in 'TrainConfig'"),
}


@pytest.mark.fast
@pytest.mark.parametrize("override, why", TRAIN_TYPE_ERRORS.values(), ids=list(TRAIN_TYPE_ERRORS))
def test_the_train_block_has_a_schema(override, why):
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg(override)
    assert why in str(info.value.__cause__)
    assert f"full_key: {override.split('=')[0]}" in str(info.value.__cause__)
    cfg = compose_cfg("train.lr=5")  # an int where a float goes: converted, as a float
    assert cfg.train.lr == 5.0 and isinstance(cfg.train.lr, float)


# --------------------------------------------------------------------------------------------
# logging.first_nonfinite and the instrument group (eqx_logs.config.InstrumentConfig)
# --------------------------------------------------------------------------------------------


@pytest.mark.fast
def test_first_nonfinite_is_a_logging_key():
    assert compose_policy().first_nonfinite is False
    assert compose_policy("logging.first_nonfinite=true").first_nonfinite is True
    assert compose_policy("logging=train", "logging.first_nonfinite=true").first_nonfinite is True
    assert compose_policy("logging.first_nonfinite=any").first_nonfinite == "any"
    with pytest.raises(InstantiationException) as info:
        compose_policy("logging.first_nonfinite=abc")
    assert "logging.first_nonfinite='abc'" in str(info.value.__cause__)


def compose_instrumentation(*overrides: str) -> Instrumentation:
    return instantiate(compose_cfg(*overrides).instrument)


ALL_STATS = ("mean", "std", "rms", "absmax", "nonfinite")  # instrument/all.yaml
INSTRUMENT_CASES = {
    "default: off": ([], dict(enabled=False, stats=ALL_STATS, grads=False, where=None)),
    "instrument=all": (["instrument=all"], dict(enabled=True, stats=ALL_STATS, grads=True)),
    "instrument=norms": (["instrument=norms"], dict(enabled=True, stats=("norm",), grads=True)),
    "instrument=off": (["instrument=off"], dict(enabled=False, stats=ALL_STATS, grads=False)),
    "instrument.enabled=true": (
        ["instrument.enabled=true"],
        dict(enabled=True, stats=ALL_STATS, grads=False),
    ),
    "instrument.stats=[rms,absmax]": (
        ["instrument=all", "instrument.stats=[rms,absmax]"],
        dict(enabled=True, stats=("rms", "absmax"), grads=True),
    ),
    "repeated statistics once": (
        ["instrument=norms", "instrument.stats=[norm,max,norm]"],
        dict(enabled=True, stats=("norm", "max"), grads=True),
    ),
    "instrument.grads=false": (
        ["instrument=all", "instrument.grads=false"],
        dict(enabled=True, stats=ALL_STATS, grads=False),
    ),
    "instrument.where=[...]": (
        ["instrument=all", "instrument.where=['layers[0]','layers[2]']"],
        dict(enabled=True, stats=ALL_STATS, grads=True, where=("layers[0]", "layers[2]")),
    ),
    "instrument.where one pattern": (
        ["instrument=norms", "instrument.where='layers[*]'"],
        dict(enabled=True, stats=("norm",), grads=True, where=("layers[*]",)),
    ),
}


@pytest.mark.fast
@pytest.mark.parametrize("overrides, want", INSTRUMENT_CASES.values(), ids=list(INSTRUMENT_CASES))
def test_compose_instrument(overrides, want):
    got = compose_instrumentation(*overrides)
    assert type(got) is Instrumentation
    assert got.enabled is want["enabled"] and got.grads is want["grads"]
    assert type(got.stats) is tuple and got.stats == want["stats"]
    where = want.get("where")
    assert got.where == where and (where is None or type(got.where) is tuple)


class _Net(eqx.Module):
    layers: tuple

    def __call__(self, x):
        for layer in self.layers:
            x = jnp.tanh(layer(x))
        return jnp.sum(x)


def _net():
    k1, k2 = jax.random.split(jax.random.key(0))
    return _Net((eqx.nn.Linear(3, 4, key=k1), eqx.nn.Linear(4, 2, key=k2)))


@pytest.mark.fast
def test_instrumentation_applies_instrument():
    net, x = _net(), jnp.arange(3.0)
    assert compose_instrumentation()(net) is net  # off: the model itself
    inst = compose_instrumentation("instrument=norms", "instrument.where=['layers[1]']")
    model = inst(net)
    grads, logs = eqx_logs.spool(eqx.filter_grad(lambda m: m(x)))(model)
    assert set(logs) == {"layers[1]/norm", "layers[1]/grad/norm"}
    h = jnp.tanh(net.layers[0](x))
    np.testing.assert_allclose(logs["layers[1]/norm"], [jnp.linalg.norm(net.layers[1](h))], 1e-6)
    # the same arrays: parameters and gradients of the instrumented model are the model's
    np.testing.assert_array_equal(model.layers[1].weight, net.layers[1].weight)
    want = eqx.filter_grad(lambda m: m(x))(net)
    np.testing.assert_allclose(grads.layers[0].weight, want.layers[0].weight, rtol=1e-6)
    all_keys = set(eqx_logs.spool(_net_call)(compose_instrumentation("instrument=all")(net), x)[1])
    assert all_keys == {f"layers[{i}]/{s}" for i in (0, 1) for s in ALL_STATS}  # forward only
    assert "every submodule, gradients too" in compose_instrumentation("instrument=all").describe()
    assert compose_instrumentation().describe() == "off"


def _net_call(model, x):
    return model(x)


# Bad values fail when the config is instantiated, naming key and value (as logging's do).
BAD_INSTRUMENT_VALUES = {
    "unknown statistic": (
        ["instrument.stats=[foo]"],
        "instrument.stats=['foo']: unknown statistic(s) ['foo']; choose from ('mean', ",
    ),
    "one unknown among known": (
        ["instrument=all", "instrument.stats=[rms,meen]"],
        "instrument.stats=['rms', 'meen']: unknown statistic(s) ['meen']",
    ),
    "a number": (["instrument.stats=[1.5]"], "instrument.stats=['1.5']: unknown statistic"),
    "no statistic": (
        ["instrument=all", "instrument.stats=[]"],
        "instrument.stats=[]: must be a non-empty list of statistics from ['mean', 'std', ",
    ),
    "where not strings": (
        ["instrument=all", "instrument.where=[1,2]"],
        "instrument.where=[1, 2]: must be null (every submodule), a path pattern or a list",
    ),
    "where empty": (["instrument=all", "instrument.where=[]"], "instrument.where=[]: must be"),
    "where a mapping": (["instrument=all", "instrument.where={a: 1}"], "instrument.where={'a': 1}"),
}


@pytest.mark.fast
@pytest.mark.parametrize(
    "overrides, message", BAD_INSTRUMENT_VALUES.values(), ids=list(BAD_INSTRUMENT_VALUES)
)
def test_bad_instrument_value_names_key_and_value(overrides, message):
    cfg = compose_cfg(*overrides)
    with pytest.raises(InstantiationException) as info:
        instantiate(cfg.instrument)
    assert message in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.fast
def test_instrument_where_that_selects_nothing_names_the_key():
    inst = compose_instrumentation("instrument=all", "instrument.where=[layer,'layer[*']")
    match = re.escape("instrument.where=['layer', 'layer[*']: ")
    with pytest.raises(ValueError, match=match) as info:
        inst(_net())
    assert "['layers[0]', 'layers[1]']" in str(info.value)  # what there is to select


# Values of the wrong type are Hydra's own errors, at composition.
INSTRUMENT_TYPE_ERRORS = {
    "instrument.grads=abc": ("instrument.grads=abc", "abc"),
    "instrument.enabled=abc": ("instrument.enabled=abc", "abc"),
    "instrument.stats=rms": ("instrument.stats=rms", "full_key: instrument.stats"),  # a list
}


@pytest.mark.fast
@pytest.mark.parametrize(
    "override, value", INSTRUMENT_TYPE_ERRORS.values(), ids=list(INSTRUMENT_TYPE_ERRORS)
)
def test_instrument_wrong_type_is_hydras_error(override, value):
    with pytest.raises(ConfigCompositionException) as info:
        compose_cfg(override)
    assert override in str(info.value)
    assert value in str(info.value.__cause__)


# --------------------------------------------------------------------------------------------
# Real command-line runs of examples/train.py
# --------------------------------------------------------------------------------------------


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, out: Path):
        self.rc, self.stdout, self.stderr, self.out = proc.returncode, proc.stdout, proc.stderr, out

    def ok(self) -> "Run":
        assert self.rc == 0, f"exit {self.rc}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        return self


def _env(jax_cache: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("HYDRA_FULL_ERROR", None)  # the message a user sees, not a traceback
    env.update(jax_cache or {})  # (conftest.py's `jax_cache`)
    return env


@pytest.fixture(scope="module")
def train_run(tmp_path_factory, jax_cache):
    """`train_run(name, *overrides, multirun=False)`: runs examples/train.py once per name in
    this module (the short 200-step, 2-chunk version) and returns the Run."""
    base = tmp_path_factory.mktemp("train")
    done: dict[str, Run] = {}

    def run(name: str, *overrides: str, multirun: bool = False) -> Run:
        if name not in done:
            (base / name).mkdir()
            out = base / name / ("sweep" if multirun else "run")
            # quoted: a temporary directory's path may hold characters Hydra's grammar reserves
            where = f"hydra.{'sweep' if multirun else 'run'}.dir='{out}'"
            args = [sys.executable, str(TRAIN), *(["--multirun"] if multirun else [])]
            proc = subprocess.run(
                [*args, *SHORT, where, *overrides],
                capture_output=True,
                text=True,
                cwd=base / name,
                env=_env(jax_cache),
                timeout=300,
            )
            done[name] = Run(proc, out)
        return done[name]

    return run


def read_lines(path: Path) -> list[dict]:
    """Every line of a JSONL file, parsed (a line that is not JSON fails the test), but the
    first: the run's config (`test_default_run_records_its_config`)."""
    text = path.read_text()
    assert text.endswith("\n")
    header, *lines = [json.loads(line) for line in text.splitlines()]
    assert header.keys() == {"config"}, header
    return lines


def by_key(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(r["key"], []).append(r)
    return out


def series(records: list[dict], key: str) -> tuple[list[int], np.ndarray]:
    rows = by_key(records)[key]
    return [r["step"] for r in rows], np.array([r["value"] for r in rows], np.float64)


@pytest.fixture(scope="module")
def debug(train_run):
    """The reference: `logging=debug` keeps every step's value of every key."""
    run = train_run("debug", "logging=debug").ok()
    records = read_lines(run.out / "logs.jsonl")
    ref = {}
    for key in TRAIN_KEYS:
        steps, values = series(records, key)
        assert steps == list(range(STEPS)), key
        assert np.all(np.isfinite(values)), key
        ref[key] = values
    return run, records, ref


def reference_losses() -> tuple[float, float]:
    """The first and final loss of the example's training, by an SGD loop written here
    (one jitted step at a time, no scan, no spool), using the example's model and data."""
    mod = train_module()
    kdata, kmodel = jax.random.split(jax.random.key(0))
    # each made by one jitted call (the same values, bit for bit, as op by op, and one
    # compilation instead of one per operation)
    x, y = jax.jit(mod.dataset, static_argnums=1)(kdata, 64)
    model = eqx.filter_jit(mod.MLP)(32, kmodel)
    loss = jax.jit(mod.loss_fn)

    @jax.jit
    def sgd(model):
        grads = jax.grad(mod.loss_fn)(model, x, y)
        return jax.tree.map(lambda p, g: p - 0.05 * g, model, grads)

    first = float(loss(model, x, y))
    for _ in range(STEPS):
        model = sgd(model)
    return first, float(loss(model, x, y))


def test_default_run(train_run, debug):
    run = train_run("default").ok()
    _, _, ref = debug
    path = run.out / "logs.jsonl"
    assert path.is_file()

    # the summary: first and final loss, what was logged, where it went
    m = re.search(r"^loss (\d+\.\d{4}) -> (\d+\.\d{4}) after (\d+) steps$", run.stdout, re.M)
    assert m, run.stdout
    first, final = reference_losses()
    assert abs(float(m[1]) - first) < 1.5e-4 and abs(float(m[1]) - ref["loss"][0]) < 1.5e-4
    assert abs(float(m[2]) - final) < 1.5e-4, (m[2], final)
    assert int(m[3]) == STEPS
    assert final < ref["loss"][-1] < first  # it trained
    m = re.search(r"^written to (.+)$", run.stdout, re.M)
    assert m and os.path.samefile(m[1], path), run.stdout
    assert re.search(r"^logged with Stack, interval=10, ", run.stdout, re.M), run.stdout

    records = read_lines(path)
    assert {r["key"] for r in records} == TRAIN_KEYS  # debug-tagged keys excluded
    assert len(records) == len(TRAIN_KEYS) * STEPS // 10
    for key in TRAIN_KEYS:
        steps, values = series(records, key)
        assert steps == list(range(0, STEPS, 10)), key
        np.testing.assert_allclose(values, ref[key][::10], rtol=1e-5, err_msg=key)


def test_default_run_records_its_config(train_run):
    """examples/train.py makes its logger with `eqx_logs.config.instantiate_logger(cfg)`: the
    JSONL file's first line is the whole Hydra config, resolved, as Hydra saved it."""
    run = train_run("default").ok()
    with open(run.out / "logs.jsonl") as f:
        header = json.loads(f.readline())
    saved = OmegaConf.load(run.out / ".hydra" / "config.yaml")
    assert header == {"config": OmegaConf.to_container(saved, resolve=True)}
    config = header["config"]
    assert config["train"]["steps"] == STEPS and config["train"]["lr"] == 0.05
    assert config["logging"]["interval"] == 10 and config["logger"]["path"] == "logs.jsonl"


def multirun(train_run) -> "Run":
    """`--multirun logging.interval=1,10`: one job per interval (`job_logs`)."""
    return train_run("multirun", "logging.interval=1,10", multirun=True).ok()


def job_logs(run: "Run", interval: int) -> Path:
    """The logs.jsonl of the multirun's job with `logging.interval=<interval>`."""
    for path in sorted(run.out.glob("*/logs.jsonl")):
        overrides = OmegaConf.to_container(
            OmegaConf.load(path.parent / ".hydra" / "overrides.yaml")
        )
        if f"logging.interval={interval}" in overrides:
            return path
    raise AssertionError(f"no job with logging.interval={interval}: {sorted(run.out.rglob('*'))}")


@pytest.mark.parametrize("interval", [10, 1])
def test_interval(train_run, debug, interval):
    """Every interval-th step's value, equal to the debug run's (the multirun's jobs: the
    command line `logging.interval=<interval>` each)."""
    run = multirun(train_run)
    assert f"interval={interval}," in run.stdout
    records = read_lines(job_logs(run, interval))
    _, _, ref = debug
    counts = {key: len(rows) for key, rows in by_key(records).items()}
    assert counts == {key: STEPS // interval for key in TRAIN_KEYS}
    for key in TRAIN_KEYS:
        steps, values = series(records, key)
        assert steps == list(range(0, STEPS, interval)), key
        np.testing.assert_allclose(values, ref[key][::interval], rtol=1e-5, err_msg=key)


def test_interval_not_dividing_chunk(train_run):
    """Every 30th step, not every 30th step of each chunk: the interval follows the step."""
    run = train_run("interval30", "logging.interval=30").ok()
    steps, _ = series(read_lines(run.out / "logs.jsonl"), "loss")
    assert steps == list(range(0, STEPS, 30))


def test_reduce_mean(train_run, debug):
    """`logging.reduce=mean` (on the default preset, interval 10): one line per key per chunk,
    the mean of that chunk's every-10th per-step value of the debug run."""
    run = train_run("mean", "logging.reduce=mean").ok()
    assert "with Mean, interval=10," in run.stdout
    _, _, ref = debug
    records = read_lines(run.out / "logs.jsonl")
    assert len(records) == len(TRAIN_KEYS) * STEPS // CHUNK
    for key, rows in by_key(records).items():
        assert key in TRAIN_KEYS
        assert [r["step"] for r in rows] == [CHUNK - 10, 2 * CHUNK - 10]
        assert [r["count"] for r in rows] == [CHUNK // 10] * 2
        want = [ref[key][c : c + CHUNK : 10].mean() for c in range(0, STEPS, CHUNK)]
        np.testing.assert_allclose([r["value"] for r in rows], want, rtol=1e-5, err_msg=key)
        # not the mean of every step (the interval is applied before the reduction)
        every = [ref[key][c : c + CHUNK].mean() for c in range(0, STEPS, CHUNK)]
        assert not np.allclose([r["value"] for r in rows], every, rtol=1e-4), key


def test_debug_keeps_debug_tagged_keys(debug):
    run, records, _ = debug
    assert {r["key"] for r in records} == TRAIN_KEYS | DEBUG_KEYS
    assert "tags=None, exclude=()" in run.stdout
    assert len(by_key(records)["loss"]) == STEPS


def test_tags_train(train_run):
    """`logging.tags=train` (one tag, as `spool(tags="train")`; `'logging.tags=[train]'`
    composes the same, `test_one_tag_is_a_list_of_one`) on top of `logging=debug` (which
    excludes nothing): the debug-tagged activations are gone because of the tag filter alone."""
    run = train_run("tags", "logging=debug", "logging.tags=train").ok()
    assert "tags=('train',), exclude=()" in run.stdout
    records = read_lines(run.out / "logs.jsonl")
    assert {r["key"] for r in records} == TRAIN_KEYS
    for key in TRAIN_KEYS:
        steps, _ = series(records, key)
        assert steps == list(range(STEPS)), key


def test_console_logger(train_run, debug):
    """`logger=console` (`last_only: true`): a line per jitted chunk, `step=<its last kept
    step>  <key>=<value> ...` with every key."""
    run = train_run("console", "logger=console").ok()
    _, _, ref = debug
    assert not list(run.out.rglob("*.jsonl"))
    assert re.search(r"^written to the console$", run.stdout, re.M), run.stdout
    lines = [line for line in run.stdout.splitlines() if line.startswith("step=")]
    assert len(lines) == STEPS // CHUNK, run.stdout
    for i, line in enumerate(lines):
        (row,) = check_aligned([line])
        last_step = i * CHUNK + CHUNK - 10
        assert row.pop("step") == str(last_step), line
        assert set(row) == TRAIN_KEYS, line
        for key, value in row.items():
            assert math.isclose(float(value), ref[key][last_step], rel_tol=1e-3), (key, line)


def test_stream_writes_every_kept_event_as_it_happens(train_run, debug):
    """`train.stream=true`: logger.tap instead of spool; with interval 10 (the default preset)
    the same records as the spooled default run."""
    run = train_run("stream", "train.stream=true").ok()
    assert re.search(r"^logged with tap, interval=10, ", run.stdout, re.M), run.stdout
    _, _, ref = debug
    records = read_lines(run.out / "logs.jsonl")
    assert {r["key"] for r in records} == TRAIN_KEYS
    for key in TRAIN_KEYS:
        steps, values = series(records, key)
        assert steps == list(range(0, STEPS, 10)), key
        np.testing.assert_allclose(values, ref[key][::10], rtol=1e-5, err_msg=key)


def test_tensorboard_run_reads_back(train_run, debug):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train_run("tensorboard", "logger=tensorboard").ok()
    _, _, ref = debug
    m = re.search(r"^written to (.+)$", run.stdout, re.M)
    assert m and os.path.samefile(m[1], run.out / "tensorboard"), run.stdout
    acc = EventAccumulator(str(run.out / "tensorboard" / "run_0"), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == TRAIN_KEYS
    for key in TRAIN_KEYS:
        events = acc.Scalars(key)
        assert [e.step for e in events] == list(range(0, STEPS, 10)), key
        np.testing.assert_allclose([e.value for e in events], ref[key][::10], rtol=1e-5)


def test_trackio_run_reads_back(train_run, debug, tmp_path):
    """`logger=trackio` with `logger.dir`: the run's values, read back with trackio's reader
    (in a process of its own: trackio reads its directory once, at import)."""
    pytest.importorskip("trackio")
    where = tmp_path / "trackio"
    run = train_run("trackio", "logger=trackio", f"logger.dir='{where}'").ok()
    assert re.search(r"^written by TrackioLogger in ", run.stdout, re.M), run.stdout
    _, _, ref = debug
    read = (
        "import json, trackio; from trackio.sqlite_storage import SQLiteStorage as S; "
        "runs = list(trackio.Api().runs('train')); "
        "print(json.dumps([(r.name, S.get_logs('train', r.name, run_id=r.id)) for r in runs]))"
    )
    env = {**_env(), "TRACKIO_DIR": str(where)}
    proc = subprocess.run(
        [sys.executable, "-c", read], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    ((name, rows),) = json.loads(proc.stdout.splitlines()[-1])
    assert name == "train-0"
    assert {k for r in rows for k in r} == TRAIN_KEYS | {"step", "timestamp"}
    for key in TRAIN_KEYS:
        steps = [r["step"] for r in rows if key in r]
        assert steps == list(range(0, STEPS, 10)), key
        values = [r[key] for r in rows if key in r]
        np.testing.assert_allclose(values, ref[key][::10], rtol=1e-5, err_msg=key)


def test_the_summary_is_logged_and_names_the_next_step(train_run):
    """The run's summary is the first thing printed (not JAX's search for a TPU), and Hydra's
    `train.log` holds it too; it ends with the plot command, which the plot test runs."""
    run = train_run("default").ok()
    lines = run.stdout.splitlines()
    assert lines[0].startswith("loss "), run.stdout
    assert "tpu" not in (run.stdout + run.stderr).lower()
    # the image goes into the run's directory, not into the directory the user is in
    plot = f"next: {sys.executable} -m eqx_logs plot {run.out} -o {run.out / 'curves.png'}"
    assert lines[-1] == plot, run.stdout
    log = (run.out / "train.log").read_text()
    for line in lines:  # each with Hydra's time and logger name in the file
        assert re.search(rf"\]\[__main__\]\[INFO\] - {re.escape(line)}$", log, re.M), log


def test_help_lists_the_groups_to_pick_not_the_schemas():
    """`examples/train.py --help` (no training): the groups a user picks from, each with what
    it is for, and the same options as Hydra's own list (which starts with the schemas,
    `eqx_logs/logger: ...`: listed here as what they are, not as groups); the config too."""

    def help_text(*overrides: str) -> str:
        proc = subprocess.run(
            [sys.executable, str(TRAIN), "--help", *overrides],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    shown = help_text()
    groups = dict(re.findall(r"^([\w/]+): (.+)$", shown, re.M))
    # Hydra's own list, as its default template would show it
    hydras = dict(
        re.findall(r"^([\w/]+): (.+)$", help_text("hydra.help.template=$APP_CONFIG_GROUPS"), re.M)
    )
    assert {g for g in hydras if g.startswith("eqx_logs/")} == {
        "eqx_logs/logging", "eqx_logs/logger", "eqx_logs/instrument"
    }  # fmt: skip
    assert hydras["schema"] == "train"  # train.py's `TrainConfig`, the `train` block's types
    schemas = ("eqx_logs/", "schema")
    user = {g: options for g, options in hydras.items() if not g.startswith(schemas)}
    assert groups == user, shown  # every group to pick, with every option, and nothing else
    assert set(user) == {"logging", "logger", "instrument"}
    for group, what in [("logging", "eqx_logs.Policy"), ("logger", "eqx_logs.loggers")]:
        line = shown.splitlines()[shown.splitlines().index(f"{group}: {user[group]}") + 1]
        assert line.startswith("    ") and what in line, shown
    assert "eqx_logs/logger/<backend>" in shown and "schemas" in shown, shown
    assert "schema/train is the schema of `train`" in shown, shown
    assert re.search(r"^== Config ==$", shown, re.M) and "  steps: 2000" in shown, shown


def test_plot_cli_draws_the_default_run(train_run, tmp_path):
    """The command the run's last line names, run where the user is: the image goes into the
    run's directory, nothing into the working directory."""
    run = train_run("default").ok()
    out = run.out / "curves.png"
    command = shlex.split(run.stdout.splitlines()[-1].removeprefix("next: "))
    assert command[:4] == [sys.executable, "-m", "eqx_logs", "plot"], command
    proc = subprocess.run(
        command, capture_output=True, text=True, env=_env(), timeout=120, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.iterdir())
    assert f"wrote {out}: {len(TRAIN_KEYS)} keys, {len(TRAIN_KEYS)} curves" in proc.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert image.shape[0] > 200 and image.shape[1] > 400
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_multirun(train_run):
    run = multirun(train_run)
    files = sorted(run.out.glob("*/logs.jsonl"))
    assert len(files) == 2, sorted(run.out.rglob("*"))
    seen = set()
    for path in files:
        overrides = OmegaConf.to_container(
            OmegaConf.load(path.parent / ".hydra" / "overrides.yaml")
        )
        (interval,) = [int(o.split("=")[1]) for o in overrides if o.startswith("logging.interval=")]
        seen.add(interval)
        records = read_lines(path)
        counts = {key: len(rows) for key, rows in by_key(records).items()}
        assert counts == {key: STEPS // interval for key in TRAIN_KEYS}, (interval, counts)
        steps, _ = series(records, "loss")
        assert steps == list(range(0, STEPS, interval))
    assert seen == {1, 10}
    # each job's last line names the sweep's directory for the plot command, not its own
    plot = f"next: {sys.executable} -m eqx_logs plot {run.out} -o {run.out / 'curves.png'}"
    nexts = [line for line in run.stdout.splitlines() if line.startswith("next: ")]
    assert nexts == [plot, plot], run.stdout
    # the plot command names each run by the overrides that differ (not `0/logs.jsonl`); -k
    # takes one pattern, so the run directory after it is not taken for a second one; the
    # image goes into the sweep's directory
    image = run.out / "curves.png"
    proc = subprocess.run(
        [sys.executable, "-m", "eqx_logs", "plot", "-k", "loss", str(run.out), "--logy"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {image}: 1 keys, 2 curves from 2 file(s)" in proc.stdout, proc.stdout
    assert "runs: logging.interval=1, logging.interval=10" in proc.stdout, proc.stdout
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_writer_policy_on_the_command_line(train_run):
    """`logger.on_full=drop logger.stall_timeout=5`: a healthy backend loses nothing, so the
    run writes what the default run writes."""
    run = train_run("writer_policy", "logger.on_full=drop", "logger.stall_timeout=5").ok()
    default = train_run("default").ok()
    assert "were not written" not in run.stderr
    assert read_lines(run.out / "logs.jsonl") == read_lines(default.out / "logs.jsonl")


# One bad override on the real command line: what a user sees is Hydra's one-line message (no
# traceback), a failed exit, and nothing trained or written. The same failure for every other
# bad value is checked in-process above (`test_bad_value_names_key_and_value`,
# `test_wrong_type_is_hydras_error`): what Hydra's command line adds is the same for all.
def test_bad_override_exits_with_message(train_run):
    run = train_run("bad_reduce", "logging.reduce=meen")
    assert run.rc != 0
    output = run.stdout + run.stderr
    assert "logging.reduce='meen'" in output, output
    assert "Traceback" not in output, output
    assert not re.search(r"^loss ", run.stdout, re.M)  # failed before training
    assert not (run.out / "logs.jsonl").exists()


# The mistakes of the issue on the real command line: a failed exit, Hydra's few lines naming
# the key (no traceback, nothing traced or trained), with what to write instead.
BAD_COMMAND_LINES = {
    "lr": ("train.lr=abc", ["train.lr=abc", "full_key: train.lr", "to Float"]),
    "intervall": ("logging.intervall=10", ["logging.intervall=10", "logging.interval?"]),
}


@pytest.mark.parametrize("override, said", BAD_COMMAND_LINES.values(), ids=list(BAD_COMMAND_LINES))
def test_a_newcomers_bad_override_is_said_in_a_few_lines(train_run, override, said):
    run = train_run(f"bad_{override}", override)
    assert run.rc == 1
    output = run.stdout + run.stderr
    for text in said:
        assert text in output, output
    # 6 lines for train.lr=abc and 5 for logging.intervall=10 (Hydra's advice on
    # HYDRA_FULL_ERROR included), where train.lr=abc was a 52-line traceback from the jitted step
    assert len(output.strip().splitlines()) <= 7, output
    assert "Traceback" not in output and "jit" not in output, output
    assert not (run.out / "logs.jsonl").exists()


@functools.cache
def train_module():
    """examples/train.py as a module (its `main` is Hydra's: called with a composed config,
    it runs on that config in this process)."""
    spec = importlib.util.spec_from_file_location("eqx_logs_example_train", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train_main(*overrides: str, config_dir: Path = CONF):
    """examples/train.py's `main`, in this process, on the config that the command line
    `train.py <SHORT> <overrides>` composes (`compose_cfg`)."""
    cfg = compose_cfg(*SHORT, *overrides, config_dir=config_dir)
    jax_logger = logging.getLogger("jax")
    level = jax_logger.level  # main quiets JAX's logger: as it was, after
    try:
        return train_module().main(cfg)
    finally:
        jax_logger.setLevel(level)


SPOOL_ONLY_RUNS = {
    "reduce": ("logging.reduce=mean", "logging.reduce=mean (window=None) needs the logs spooled"),
    "first_nonfinite": ("logging.first_nonfinite=true", "first_nonfinite=true needs the logs"),
}


@pytest.mark.parametrize("override, message", SPOOL_ONLY_RUNS.values(), ids=list(SPOOL_ONLY_RUNS))
def test_a_spool_option_under_stream_is_refused(override, message):
    """`train.stream=true` taps: what only a spool does is an error (raised by train.py's
    main before it trains), not ignored."""
    with pytest.raises(ValueError) as info:
        train_main(override, "train.stream=true")
    assert message in str(info.value) and "train.stream=true" in str(info.value)
