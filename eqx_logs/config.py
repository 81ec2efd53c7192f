"""Hydra structured configs for policies and loggers, registered in Hydra's ConfigStore.

Importing this module registers the schemas, in the ConfigStore, under `eqx_logs/` (so that
they are not offered as options of the groups themselves):

- `eqx_logs/logging/base`: `PolicyConfig`, instantiated by `eqx_logs.config.policy` into an
  `eqx_logs.Policy`;
- `eqx_logs/logger/<backend>`, one per backend: `console`, `jsonl`, `array`, `tensorboard`,
  `wandb`, `mlflow`, `trackio`, `progress` (`ConsoleLoggerConfig`, ...);
- `eqx_logs/instrument/base`: `InstrumentConfig`, instantiated by
  `eqx_logs.config.instrumentation` into an `Instrumentation` (`eqx_logs.instrument` as
  configured: `instrumentation(model)`).

The groups' YAML files (`eqx_logs/conf/`, on every Hydra application's search path once the
package is installed) extend them (`defaults: [/eqx_logs/logging/base@_here_, _self_]`), as an
application's own options can, and `hydra.utils.instantiate(cfg.logging)` returns a Policy,
`instantiate(cfg.logger)` a logger, `instantiate(cfg.instrument)` an Instrumentation.
`instantiate_logger(cfg)` makes the logger and records the whole config with its runs.
Reductions are names (`reduce: mean`) or nested `_target_` nodes (`reduce: {_target_:
eqx_logs.Window, size: 100, inner: mean}`).
"""

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, TypeVar, Unpack

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from ._checks import is_count
from ._reduce import (
    DEFAULTS,
    OPTIONS,
    Policy,
    PolicyOptions,
    as_reduction,
    document_options,
)
from ._spelling import closest
from ._stats import DEFAULT_STATS, STATS, check_stats
from ._watch import as_watch

_M = TypeVar("_M")


@dataclass
class PolicyConfig:
    """The schema of the `logging` group (`eqx_logs/logging/base`): the fields of an
    [`eqx_logs.Policy`][], instantiated by [`eqx_logs.config.policy`][] (`seed` gives the
    policy's `key`; `config_key` names the group in error messages).

    Hydra checks the types when it composes (`logging.interval=abc` is its error). A key that
    is no field (`logging.intervall=10`) is let through to `eqx_logs.config.policy`, which
    refuses it naming the option it is closest to (`did you mean logging.interval?`), as
    OmegaConf's own error would not."""

    _target_: str = "eqx_logs.config.policy"
    _convert_: str = "all"  # plain containers, and nested `_target_` reductions kept as modules
    reduce: Any = "stack"
    interval: int = 1
    window: int | None = None
    # tags, exclude, across: a string or a list of them (`logging.tags=train` is one tag,
    # `'logging.tags=[train,eval]'` two), as spool's
    tags: Any = None
    exclude: Any = field(default_factory=list)
    rules: dict[str, Any] = field(default_factory=dict)
    prefix: str = ""
    seed: int | None = None
    across: Any = field(default_factory=list)
    first_nonfinite: Any = False  # true, false or "any"
    # a primitive or loop name, a list of them, or {names: [...], where: ..., max_depth: ...,
    # stats: [...]} (the arguments of eqx_logs.Watch)
    watch: Any = None
    config_key: str = "logging"


@dataclass
class InstrumentConfig:
    """The schema of the `instrument` group (`eqx_logs/instrument/base`): the options of
    [`eqx_logs.instrument`][] and `enabled`, instantiated by
    [`eqx_logs.config.instrumentation`][]."""

    _target_: str = "eqx_logs.config.instrumentation"
    _convert_: str = "all"
    enabled: bool = False
    stats: list[str] = field(default_factory=lambda: list(DEFAULT_STATS))
    grads: bool = False
    where: Any = None  # a path pattern ("layers[*]"), a list of them, or null: every submodule
    config_key: str = "instrument"


@dataclass
class _LoggerConfig:
    # jax.distributed: every process writes its own copy (`.process<k>`), not process 0 alone
    every_process: bool = False
    # the writer policy (`AbstractLogger`): a full queue waits ("block") or drops ("drop");
    # a backend without progress for `stall_timeout` seconds is reported and its writes dropped
    on_full: str = "block"
    stall_timeout: float | None = 60.0


@dataclass
class ConsoleLoggerConfig(_LoggerConfig):
    """`eqx_logs/logger/console`: a [`eqx_logs.loggers.ConsoleLogger`][]."""

    _target_: str = "eqx_logs.loggers.ConsoleLogger"
    last_only: bool = False
    step_width: int = 5


@dataclass
class JsonlLoggerConfig(_LoggerConfig):
    """`eqx_logs/logger/jsonl`: a [`eqx_logs.loggers.JsonlLogger`][]."""

    _target_: str = "eqx_logs.loggers.JsonlLogger"
    path: str = "logs.jsonl"


@dataclass
class ArrayLoggerConfig(_LoggerConfig):
    """`eqx_logs/logger/array`: an [`eqx_logs.loggers.ArrayLogger`][]."""

    _target_: str = "eqx_logs.loggers.ArrayLogger"
    path: str = "arrays"


@dataclass
class TensorBoardLoggerConfig(_LoggerConfig):
    """`eqx_logs/logger/tensorboard`: a [`eqx_logs.loggers.TensorBoardLogger`][]."""

    _target_: str = "eqx_logs.loggers.TensorBoardLogger"
    logdir: str = "tensorboard"
    step: str = "step"


@dataclass
class WandbLoggerConfig(_LoggerConfig):
    """`eqx_logs/logger/wandb`: a [`eqx_logs.loggers.WandbLogger`][]."""

    _target_: str = "eqx_logs.loggers.WandbLogger"
    project: str | None = None
    name: str = "eqx_logs"
    dir: str | None = "."
    mode: str | None = None  # "offline" writes locally (`wandb sync` later)
    step: str = "step"


@dataclass
class MLflowLoggerConfig(_LoggerConfig):
    """`eqx_logs/logger/mlflow`: an [`eqx_logs.loggers.MLflowLogger`][]."""

    _target_: str = "eqx_logs.loggers.MLflowLogger"
    tracking_uri: str = "sqlite:///mlflow.db"
    experiment: str = "eqx_logs"
    run_name: str = "run"
    step: str = "step"


@dataclass
class TrackioLoggerConfig(_LoggerConfig):
    """`eqx_logs/logger/trackio`: a [`eqx_logs.loggers.TrackioLogger`][]."""

    _target_: str = "eqx_logs.loggers.TrackioLogger"
    project: str = "eqx_logs"
    name: str = "eqx_logs"
    dir: str | None = None  # trackio's directory (TRACKIO_DIR); null: trackio's own
    step: str = "step"
    system_metrics: bool = False


@dataclass
class ProgressLoggerConfig(_LoggerConfig):
    """`eqx_logs/logger/progress`: a [`eqx_logs.loggers.ProgressLogger`][]."""

    _target_: str = "eqx_logs.loggers.ProgressLogger"
    total: int | None = None
    desc: str | None = None
    step: str = "step"
    ncols: int | None = None  # the terminal's width


def _plain(x: Any) -> Any:
    if isinstance(x, DictConfig | ListConfig):
        return OmegaConf.to_container(x, resolve=True)
    return x


def _bad(config_key: str, name: str, value: Any, why: str) -> ValueError:
    """The error for a bad config value, naming its key: `logging.interval=0: ...`."""
    return ValueError(f"{config_key}.{name}={value!r}: {why}")


@document_options
def policy(
    *, seed: int | None = None, config_key: str = "logging", **options: Unpack[PolicyOptions]
) -> Policy:
    """An [`eqx_logs.Policy`][] from config values (OmegaConf lists become tuples, a string
    of `tags`, `exclude` or `across` one name). A bad value raises a `ValueError` naming the
    config key and the value, e.g. `logging.interval=0`; a key that is no option a `TypeError`
    naming the option it is closest to (`logging.intervall=10`: `did you mean
    logging.interval?`).

    **Arguments:**

    - `seed`: an int; the policy's `key` is `jax.random.key(seed)`.
    - `config_key`: the name of the config group, used in error messages.

    The policy's options, as for [`eqx_logs.Policy`][] (the fields of `PolicyConfig`, but
    `key`, which `seed` gives):

    {policy_options}
    """
    bad = functools.partial(_bad, config_key)
    for name in options:  # a config key that is no option: `logging.intervall=10`
        if name not in OPTIONS:
            known = [n for n in OPTIONS if n != "key"] + ["seed"]
            near = closest(name, known)
            meant = f" Did you mean {config_key}.{near}?" if near else ""
            raise TypeError(
                f"{config_key}.{name}={_plain(options[name])!r}: {config_key} has no option "
                f"{name!r}.{meant} Its options are {known} (eqx_logs.config.PolicyConfig)."
            )
    values = {**DEFAULTS, **{name: _plain(value) for name, value in options.items()}}
    for name, optional in (("interval", False), ("window", True)):
        if not (optional and values[name] is None or is_count(values[name])):
            raise bad(name, values[name], "must be an integer from 1 to 2**31 - 1")
    try:
        values["reduce"] = as_reduction(values["reduce"], where="reduce")
    except ValueError as e:
        raise bad("reduce", options["reduce"], str(e).split(": ", 1)[-1]) from None
    rules = values["rules"] = values["rules"] or {}
    if not isinstance(rules, dict):
        raise bad("rules", rules, "must be a mapping from key pattern to reduction")
    for pattern, value in rules.items():
        try:
            as_reduction(value, allow_drop=True, where="rule")
        except ValueError as e:
            raise bad(f"rules.{pattern}", value, str(e).split(": ", 1)[-1]) from None
    for name in ("tags", "exclude", "across"):
        value = values[name]
        if isinstance(value, str):  # one tag: `logging.tags=train`, as `spool(tags="train")`
            value = [value]
        if value is not None and not (
            isinstance(value, list | tuple) and all(isinstance(t, str) for t in value)
        ):
            raise bad(name, value, "must be a string or a list of strings")
        values[name] = value if value is None and name == "tags" else tuple(value or ())
    if not (isinstance(values["first_nonfinite"], bool) or values["first_nonfinite"] == "any"):
        raise bad("first_nonfinite", values["first_nonfinite"], 'must be true, false or "any"')
    try:
        values["watch"] = as_watch(values["watch"], "eqx_logs.config.policy")
    except (TypeError, ValueError) as e:
        raise bad("watch", options["watch"], str(e)) from None
    if seed is not None:
        if values["key"] is not None:
            raise bad("seed", seed, "give either a seed or a key, not both")
        import jax

        values["key"] = jax.random.key(seed)
    return Policy(**values)


def _check_schema(schema: type, where: str) -> None:
    """`schema` (`PolicyConfig`) has a field for each of the policy's options (`seed` for
    `key`): raised when this module is imported, so a new option is not forgotten here."""
    fields = {f.name for f in dataclasses.fields(schema)}
    wanted = [name for name in OPTIONS if name != "key"] + ["seed"]
    missing = [name for name in wanted if name not in fields]
    if missing:
        raise AssertionError(f"{where} has no field for the policy's options {missing}.")


_check_schema(PolicyConfig, "eqx_logs.config.PolicyConfig")


@dataclass(frozen=True)
class Instrumentation:
    """What `instantiate(cfg.instrument)` returns: `instrumentation(model)` is `model` with
    `eqx_logs.instrument(model, stats=..., grads=..., where=...)` applied, or `model` itself
    when `enabled` is false. Make the optimiser state and the parameters from the result."""

    enabled: bool
    stats: tuple[str, ...]
    grads: bool
    where: tuple[str, ...] | None
    config_key: str = "instrument"

    def __call__(self, model: _M) -> _M:
        if not self.enabled:
            return model
        from ._instrument import instrument

        try:
            return instrument(model, stats=self.stats, grads=self.grads, where=self.where)
        except ValueError as e:  # `where` selects nothing: say which config key
            if self.where is None:
                raise
            raise ValueError(f"{self.config_key}.where={list(self.where)!r}: {e}") from None

    def describe(self) -> str:
        """One line: what is logged, e.g. `mean, rms of every submodule, gradients too`."""
        if not self.enabled:
            return "off"
        where = "every submodule" if self.where is None else f"submodules {list(self.where)}"
        return f"{', '.join(self.stats)} of {where}{', gradients too' if self.grads else ''}"


def instrumentation(
    enabled: bool = False,
    stats: Any = DEFAULT_STATS,
    grads: bool = False,
    where: Any = None,
    config_key: str = "instrument",
) -> Instrumentation:
    """An `Instrumentation` from config values. A bad value raises a `ValueError` naming the
    config key and the value, e.g. `instrument.stats=['foo']: unknown statistic(s) ...`.

    **Arguments:** as [`eqx_logs.instrument`][] (`where`: a path pattern or a list of them, not a
    function), plus `enabled` (false: the model is left as it is) and `config_key`, the name
    used in error messages.
    """

    bad = functools.partial(_bad, config_key)

    stats, where = _plain(stats), _plain(where)
    for name, value in (("enabled", enabled), ("grads", grads)):
        if not isinstance(value, bool):
            raise bad(name, value, "must be true or false")
    if not isinstance(stats, list | tuple) or not stats:
        raise bad("stats", stats, f"must be a non-empty list of statistics from {list(STATS)}")
    try:
        stats = check_stats(tuple(stats), "stats")
    except (TypeError, ValueError) as e:
        raise bad("stats", stats, str(e).split(": ", 1)[-1]) from None
    if isinstance(where, str):
        where = [where]
    if where is not None and not (
        isinstance(where, list | tuple) and where and all(isinstance(w, str) for w in where)
    ):
        raise bad(
            "where", where, "must be null (every submodule), a path pattern or a list of them"
        )
    return Instrumentation(
        enabled=enabled,
        stats=stats,
        grads=grads,
        where=None if where is None else tuple(where),
        config_key=config_key,
    )


def multi_logger(*loggers: Any, on_full: str = "block", stall_timeout: float | None = 60.0) -> Any:
    """An [`eqx_logs.loggers.MultiLogger`][] from logger configs (with `_recursive_: false`, so
    that OmegaConf does not turn the instantiated loggers, which are dataclasses, back into
    dicts).

    **Arguments:**

    - `*loggers`: the loggers' configs (each with its `_target_`).
    - `on_full`, `stall_timeout`: the writer policy of every logger whose config does not set
        its own (`logger.on_full=drop` on the command line; see
        [`eqx_logs.loggers.AbstractLogger`][]).
    """
    from hydra.utils import instantiate

    from .loggers import MultiLogger

    policy = {"on_full": on_full, "stall_timeout": stall_timeout}
    return MultiLogger(
        *(instantiate(cfg, **{k: v for k, v in policy.items() if k not in cfg}) for cfg in loggers)
    )


def instantiate_logger(cfg: Any, key: str = "logger") -> Any:
    """`hydra.utils.instantiate(cfg[key])`, recording the whole of `cfg`, resolved, as the
    logger's run config (its `config`; see [`eqx_logs.loggers.AbstractLogger`][]): W&B's and
    trackio's run config, MLflow's params, TensorBoard's hparams, the JSONL file's first line.
    A logger given a `config` of its own (in its node) keeps it; a
    [`eqx_logs.loggers.MultiLogger`][] passes `cfg` to each of its loggers.

    ```python
    @hydra.main(config_path="conf", config_name="config", version_base="1.3")
    def main(cfg):
        # records cfg with its runs, as instantiate(cfg.logger) does not
        with eqx_logs.config.instantiate_logger(cfg) as logger:
            ...
    ```

    **Arguments:**

    - `cfg`: the application's config (what `@hydra.main` hands the task function; Hydra's
        own `hydra` node is not part of it).
    - `key`: the node of `cfg` that configures the logger.

    **Returns:** the logger.
    """
    from hydra.utils import instantiate

    from .loggers import AbstractLogger

    logger = instantiate(cfg[key])
    if not isinstance(logger, AbstractLogger):
        raise TypeError(
            f"instantiate_logger: `{key}` made a {type(logger).__name__}, not an eqx_logs "
            "logger (its `_target_` should name one, e.g. eqx_logs.loggers.JsonlLogger)."
        )
    return logger._with_config(cfg)


def register_configs() -> None:
    """Store the schemas above in Hydra's ConfigStore (done when `eqx_logs.config` is
    imported)."""
    cs = ConfigStore.instance()
    # under eqx_logs/: schemas to extend (`- /eqx_logs/logging/base@_here_`), not options of
    # the groups `logging`, `logger` and `instrument` themselves
    # open to keys that are no field, so that `policy` names the closest (`PolicyConfig`)
    logging = OmegaConf.structured(PolicyConfig)
    OmegaConf.set_struct(logging, False)
    cs.store(group="eqx_logs/logging", name="base", node=logging)
    cs.store(group="eqx_logs/instrument", name="base", node=InstrumentConfig)
    for name, node in (
        ("console", ConsoleLoggerConfig),
        ("jsonl", JsonlLoggerConfig),
        ("array", ArrayLoggerConfig),
        ("tensorboard", TensorBoardLoggerConfig),
        ("wandb", WandbLoggerConfig),
        ("mlflow", MLflowLoggerConfig),
        ("trackio", TrackioLoggerConfig),
        ("progress", ProgressLoggerConfig),
    ):
        cs.store(group="eqx_logs/logger", name=name, node=node)


register_configs()
