"""A run's configuration, as loggers record it: plain JSON values, nested or flattened."""

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

RunConfig = dict[str, Any]
Flat = str | bool | int | float


def as_config(config: Any) -> RunConfig | None:
    """`config` (a mapping, possibly nested; an OmegaConf `DictConfig`, resolved; a dataclass
    instance) as a plain dict of JSON values: keys become strings, tuples and lists lists,
    numpy scalars and arrays numbers and lists, NaN and infinities the strings `"nan"`,
    `"inf"`, `"-inf"`, and anything else (a path, a function, an object) its `str`. `None`
    stays `None`. Anything that is not a mapping raises `TypeError`."""
    if config is None:
        return None
    plain = _plain(config)
    if not isinstance(plain, dict):
        raise TypeError(
            f"a logger's config must be a mapping (a dict, possibly nested, an OmegaConf "
            f"DictConfig or a dataclass instance), got {type(config).__name__}: "
            f"{str(config)[:80]!r}. Wrap it: config={{'value': ...}}."
        )
    return plain


def _plain(x: Any) -> Any:
    if type(x).__module__.startswith("omegaconf"):  # (not imported unless in use)
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(x, DictConfig | ListConfig):
            x = OmegaConf.to_container(x, resolve=True)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = {f.name: getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, Mapping):
        return {k if isinstance(k, str) else str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_plain(v) for v in x]
    if isinstance(x, np.ndarray):
        return _plain(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)
    if x is None or isinstance(x, str | bool | int):
        return x
    return str(x)


def flat_config(config: RunConfig, sep: str = ".") -> dict[str, Flat]:
    """`config` (from `as_config`) flattened, for trackers whose parameters are one level of
    scalars (MLflow's params, TensorBoard's hparams): nested keys joined by `sep`
    (`{"train": {"lr": 0.1}}` gives `{"train.lr": 0.1}`); lists, `None` and empty mappings as
    their JSON text (`'["a", "b"]'`, `"null"`, `"{}"`)."""
    out: dict[str, Flat] = {}

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and (value or not prefix):
            for k, v in value.items():
                visit(f"{prefix}{sep}{k}" if prefix else k, v)
        elif isinstance(value, str | bool | int | float):
            out[prefix] = value
        else:
            out[prefix] = json.dumps(value)

    visit("", config)
    return out
