"""`logger.jit(..., step="i")`: the host knows the step, so the steps an `interval` skips run
the function without its logs.

With `interval=k`, an event logged with the step `i` is kept where `i` is a multiple of k. In a
per-step loop (one compiled call per step) whose events all carry the call's step, a call at
any other step keeps nothing: its logs are computed, gated off on the device and their counts
read back, for nothing. Told which argument is the step, and given it as a Python int,
`logger.jit` picks on the host between two compiled programs: the step with its logs (kept
steps) and the step with every log removed (the others: nothing computed for logs, nothing
returned, nothing read back). The step is passed to both as a traced scalar, so a new value
compiles nothing.

Whether "every event carries the call's step" holds is found when the step with its logs is
traced (`_scope.StepWatch`): every event whose step is not the very traced argument (a `log`
with a `step=` of its own, a custom rule traced apart) is noted, and then every call runs
the step with its logs, as without `step=`, with a warning naming where.
"""

import inspect
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import equinox as eqx
import numpy as np

from .._retrace import fun_key
from .._scope import call_step, tracing_context, watching
from .._warn import warn_user

_MISSING = object()


class StepArg:
    """Where the step is among a call's arguments: the parameter `name` of the function, at
    position `index` when it can be passed by position."""

    __slots__ = ("name", "index")

    def __init__(self, name: str, index: int | None):
        self.name, self.index = name, index

    # (compared by value: a static field of the compiled function, which equal functions share)
    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepArg) and (self.name, self.index) == (other.name, other.index)

    def __hash__(self) -> int:
        return hash((StepArg, self.name, self.index))

    @classmethod
    def of(cls, fun: Callable, name: str, where: str) -> "StepArg":
        try:
            parameters = inspect.signature(fun).parameters
        except (TypeError, ValueError):
            raise TypeError(
                f"{where}(step={name!r}): the step is named by parameter, but "
                f"{type(fun).__name__} has no signature to find it in. Wrap it in a function "
                f"with a parameter {name!r}."
            ) from None
        parameter = parameters.get(name)
        if parameter is None or parameter.kind is parameter.VAR_POSITIONAL:
            raise TypeError(
                f"{where}(step={name!r}): the function has no parameter {name!r} (it has "
                f"{', '.join(parameters) or 'none'}). Name the parameter that is the step."
            )
        positional = (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
        index = list(parameters).index(name) if parameter.kind in positional else None
        return cls(name, index)

    def shifted(self, by: int) -> "StepArg":
        """The same parameter, with `by` arguments put in front of the call's."""
        return StepArg(self.name, None if self.index is None else self.index + by)

    def peek(self, args: tuple, kwargs: dict) -> Any:
        """The step's value in a call (`_MISSING` if it is not passed)."""
        if self.index is not None and len(args) > self.index:
            return args[self.index]
        return kwargs.get(self.name, _MISSING)

    def take(self, args: tuple, kwargs: dict, where: str) -> tuple[Any, tuple, dict]:
        """The step's value and the call's arguments with None in its place."""
        i = self.index
        if i is not None and len(args) > i:
            return args[i], (*args[:i], None, *args[i + 1 :]), kwargs
        if self.name not in kwargs:
            raise TypeError(
                f"{where}(step={self.name!r}): the call passes no argument {self.name!r}. Pass "
                "the step at every call."
            )
        kwargs = dict(kwargs)
        return kwargs.pop(self.name), args, {**kwargs, self.name: None}

    def put(self, args: tuple, kwargs: dict, value: Any) -> tuple[tuple, dict]:
        """The arguments of `take` with `value` back in the step's place."""
        i = self.index
        if i is not None and len(args) > i:
            return (*args[:i], value, *args[i + 1 :]), kwargs
        return args, {**kwargs, self.name: value}


def host_int(value: Any) -> bool:
    """Whether the host knows a step's value without asking the device."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


class Gate:
    """Which calls of a `logger.jit(..., step=..., interval=k)` run without their logs: those
    whose step is a Python int not a multiple of k, once the step with its logs has been
    traced and found to log at the call's step only (`exact`).

    One per function, step and interval (`Gate.of`): equal functions share their compiled
    steps (a `logger.jit` made again each epoch compiles nothing), so they share what the
    trace found too."""

    __slots__ = ("step", "interval", "exact", "where")

    def __init__(self, step: StepArg, interval: int, where: str):
        self.step, self.interval, self.where = step, interval, where
        self.exact: bool | None = None  # None: not traced yet (the first call runs the logs)

    @classmethod
    def of(cls, fun: Callable, step: StepArg, interval: int, where: str) -> "Gate":
        key = (fun_key(fun), step.name, step.index, interval, where)
        try:
            _GATES.move_to_end(key)
        except TypeError:  # (a function that cannot be hashed: its own)
            return cls(step, interval, where)
        except KeyError:
            _GATES[key] = cls(step, interval, where)
            if len(_GATES) > 64:
                _GATES.popitem(last=False)
        return _GATES[key]

    def skips(self, args: tuple, kwargs: dict) -> bool:
        if not self.exact:
            return False
        value = self.step.peek(args, kwargs)
        return host_int(value) and value % self.interval != 0

    def traced(self, others: list[str]) -> None:
        """What a trace of the step with its logs found: the events not at the call's step."""
        if others and self.exact is not False and self.interval > 1:
            sites = sorted(set(others))
            more = f" (and {len(sites) - 3} more)" if len(sites) > 3 else ""
            warn_user(
                f"{self.where}(step={self.step.name!r}, interval={self.interval}): the events "
                f"logged at {'; '.join(sites[:3])}{more} carry a step other than the call's "
                f"{self.step.name!r} (a `step=` of their own, or none: a custom derivative "
                "rule sees no scope), so every call runs the step with its logs, gated on "
                "the device, rather than skipping them between intervals. To skip them, "
                f"log without `step=` (the call's {self.step.name!r} is the step of every "
                f"event without one) or with `step={self.step.name}` itself."
            )
        self.exact = not others if self.exact is None else self.exact and not others


_GATES: "OrderedDict[Any, Gate]" = OrderedDict()


class AtStep(eqx.Module):
    """`fun` called with its step argument as the step of every event inside it without one
    of its own (a `scope(step=...)` around it), and with every event's step noted for the
    `Gate` (see `Watched`)."""

    fun: Callable
    step: StepArg = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self.fun

    def __call__(self, *args, **kwargs):
        value = self.step.peek(args, kwargs)
        if value is _MISSING:
            raise TypeError(
                f"the call passes no argument {self.step.name!r}, named as the step. Pass the "
                "step at every call."
            )
        with call_step(value):
            return self.fun(*args, **kwargs)


class Watched(eqx.Module):
    """`fun` (the packed, spooled step), telling `gate` when traced whether every event it
    logs carries the call's step."""

    fun: Callable
    gate: Gate = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self.fun.__wrapped__

    def __call__(self, *args, **kwargs):
        with watching() as watch:
            out = self.fun(*args, **kwargs)
        self.gate.traced(watch.others)
        return out


class Unlogged(eqx.Module):
    """`fun` with every log inside it removed (`eqx_logs.nolog`, as a pytree of `fun`)."""

    fun: Callable

    @property
    def __wrapped__(self):
        return self.fun

    def __call__(self, *args, **kwargs):
        with tracing_context(enabled=False):
            return self.fun(*args, **kwargs)
