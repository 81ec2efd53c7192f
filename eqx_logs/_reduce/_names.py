"""The reductions by name (`reduce="mean"`), which the buffers, the policy and `log`'s
`reduce=` accept, and `"drop"`."""

from typing import Any

from ._buffers import Collect, Stack
from ._reductions import AbstractReduction, Count, First, Last, Max, Mean, Min, Std, Sum, Var

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
}
DROP = "drop"


def as_reduction(reduce: Any, *, allow_drop: bool = False, where: str = "reduce") -> Any:
    """A reduction from a name (`"mean"`) or a reduction; `"drop"` too where allowed."""
    if isinstance(reduce, AbstractReduction):
        return reduce
    if isinstance(reduce, str):
        if allow_drop and reduce == DROP:
            return DROP
        if reduce in _NAMES:
            return _NAMES[reduce]()
    names = sorted(_NAMES) + ([DROP] if allow_drop else [])
    raise ValueError(
        f"{where}={reduce!r} is not a reduction: use one of {names} or an "
        "eqx_logs.AbstractReduction such as eqx_logs.Window(100, 'mean')."
    )
