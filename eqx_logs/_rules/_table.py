"""The table of rules: `RULES`, by primitive name, and `register` to add one."""

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from .._interpret import Counts, Interpreter, Plan


class Rule(NamedTuple):
    count: Callable[[Plan, Any], Counts]
    apply: Callable[[Interpreter, Any, list, dict], tuple[list, dict]]
    # Evaluates its jaxpr (`_compat.call_jaxpr`) once, in the current trace, as straight-line
    # code, and threads the states itself: a handler may take its events for its jaxpr's.
    straight: bool = False
    # Its jaxpr is evaluated again in the backward pass (a remat): so are its callbacks.
    recomputed: bool = False
    # A `lax.scan`: its events may leave as its `ys` (`_interpret/_spool/_stream.py`).
    scan: bool = False
    # A custom derivative: its rules, traced by JAX later, may log where its primal does not.
    custom: bool = False


RULES: dict[str, Rule] = {}


def register(names: str | Iterable[str], count, apply, **attributes: bool) -> None:
    for name in [names] if isinstance(names, str) else names:
        RULES[name] = Rule(count, apply, **attributes)


def split_at(xs, *sizes):
    out, start = [], 0
    for n in sizes:
        out.append(list(xs[start : start + n]))
        start += n
    out.append(list(xs[start:]))
    return out
