"""Checks of user input shared by the public constructors: every message names the option."""

from collections.abc import Sequence
from typing import Any

# Counts, sizes and intervals are int32 on the device.
INT32_MAX = 2**31 - 1


def is_count(value: Any) -> bool:
    """An int from 1 to 2**31 - 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= INT32_MAX


def check_count(where: str, name: str, value: Any, *, optional: bool = False) -> None:
    """Raise `ValueError` naming `where(name=value)` unless `value` `is_count` (or is None,
    when `optional`)."""
    if optional and value is None:
        return
    if not is_count(value):
        raise ValueError(
            f"{where}({name}={value!r:.60}): {name} must be an int from 1 to 2**31 - 1."
        )


def check_number(where: str, name: str, value: Any) -> None:
    """Raise `TypeError` naming `where(name=value)` unless `value` is a real Python number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{where}({name}={value!r:.60}): {name} must be a real number.")


# The statistics, each a scalar over all of an array; `nonfinite` counts its NaN and infinite
# elements.
STATS = ("mean", "std", "rms", "absmax", "min", "max", "norm", "nonfinite")
DEFAULT_STATS = ("mean", "std", "rms", "absmax", "nonfinite")  # instrument's and watch's


def check_stats(stats: Any, where: str) -> tuple[str, ...]:
    """`stats` as a tuple of known statistic names; `where` names the caller in errors."""
    if isinstance(stats, str):
        stats = (stats,)
    if not isinstance(stats, Sequence) or not stats:
        raise TypeError(
            f"{where}: stats must be a non-empty tuple of statistic names from {tuple(STATS)}, "
            f"got {stats!r}."
        )
    unknown = [s for s in stats if s not in STATS]
    if unknown:
        raise ValueError(f"{where}: unknown statistic(s) {unknown!r}; choose from {tuple(STATS)}.")
    return tuple(dict.fromkeys(stats))
