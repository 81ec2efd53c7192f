"""Checks of user input shared by the public constructors: every message names the option."""

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
