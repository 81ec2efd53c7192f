"""The reductions by name (`reduce="mean"`), which the buffers, the policy and `log`'s
`reduce=` accept, and `"drop"`; `as_reduction`, which every option taking a reduction goes
through (`Policy`, `spool`, a logger's `spool`, `tap` and `jit`, `rules`, `log(...,
reduce=)`, `Window`'s `inner`, `Fanout`, the Hydra schema), and so its errors."""

import inspect
import sys
from typing import Any

from .._spelling import closest
from ._buffers import Collect, Stack
from ._noise_scale import NoiseScale
from ._quantiles import Quantiles
from ._reductions import AbstractReduction, Count, First, Last, Max, Mean, Min, Std, Sum, Var
from ._topk import TopK

_NAMES = {
    "stack": Stack,
    "append": Stack,
    "last": Last,
    "replace": Last,
    "first": First,
    "sum": Sum,
    "mean": Mean,
    "min": Min,
    "max": Max,
    "var": Var,
    "std": Std,
    "count": Count,
    "collect": Collect,
    "quantiles": Quantiles,
    "topk": TopK,
    "noise_scale": NoiseScale,
}
DROP = "drop"


def as_reduction(reduce: Any, *, allow_drop: bool = False, where: str = "reduce") -> Any:
    """A reduction from a name (`"mean"`) or a reduction; `"drop"` too where allowed.

    Anything else is a `ValueError` that starts `{where}={reduce}` (`where` names the option:
    `"Policy(reduce)"`, `"eqx_logs.log at <site>: reduce"`) and says what to write: a
    reduction's class (`reduce=eqx_logs.Mean`) is told to call it (`eqx_logs.Mean()`), a
    misspelt name (`"meen"`) is told the name it is closest to, and every other value the
    names there are.
    """
    if isinstance(reduce, AbstractReduction):
        return reduce
    if isinstance(reduce, str):
        if allow_drop and reduce == DROP:
            return DROP
        if reduce in _NAMES:
            return _NAMES[reduce]()
    names = sorted(_NAMES) + ([DROP] if allow_drop else [])
    if isinstance(reduce, type) and issubclass(reduce, AbstractReduction):
        name = public_name(reduce)
        raise ValueError(
            f"{where}={name} is a class, not a reduction: did you mean "
            f"`{name}({_arguments(reduce)})`? A reduction is an instance of one (or a name "
            "such as 'mean')."
        )
    near = closest(reduce, names) if isinstance(reduce, str) else None
    meant = f"did you mean {near!r}? Use" if near else "use"
    raise ValueError(
        f"{where}={reduce!r} is not a reduction: {meant} one of {names} or an "
        "eqx_logs.AbstractReduction such as eqx_logs.Window(100, 'mean')."
    )


def is_reduction_like(value: Any) -> bool:
    """Whether `value` is a reduction's name, a reduction or a reduction's class: to tell
    arguments given in the wrong order (`Window("mean", 100)`)."""
    if isinstance(value, str):
        return value in _NAMES
    return isinstance(value, AbstractReduction) or (
        isinstance(value, type) and issubclass(value, AbstractReduction)
    )


def public_name(cls: type) -> str:
    """`eqx_logs.Mean` for a class the package exports, else the class's own name (a
    reduction of the user's)."""
    package = sys.modules.get("eqx_logs")
    if package is not None and getattr(package, cls.__name__, None) is cls:
        return f"eqx_logs.{cls.__name__}"
    return cls.__qualname__


def _arguments(cls: type) -> str:
    """The arguments a call of `cls` needs, as `decay=...` (none for `Mean`)."""
    try:
        parameters = list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):
        return "..."
    needed = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if not needed and any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return "..."  # Fanout(**named): at least one
    return ", ".join(f"{name}=..." for name in needed)
