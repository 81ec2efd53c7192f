"""`logger.jit(..., step="i")`: the host knows the step, so the steps an `interval` skips run
the function without its logs.

With `interval=k`, an event logged with the step `i` is kept where `i` is a multiple of k. In a
per-step loop (one compiled call per step) whose events all carry the call's step, a call at
any other step keeps nothing: its logs are computed, gated off on the device and their counts
read back, for nothing. Told which argument is the step, and given it as a Python int,
`logger.jit` picks on the host between two compiled programs: the step with its logs (kept
steps) and the step for skipped steps (`Skipping`). The step is passed to both as a traced
scalar, so a new value compiles nothing.

The program for skipped steps is the same function, traced under a `_scope.StepWatch`: where
every event carries the very traced step argument (logged without `step=` inside the call's
`scope`, or with `step=` that argument), none can be kept at such a call, and the program
returns the function's output alone: the logs' computation is dead code, which XLA removes
(nothing computed, returned or read back). Where some event does not (its own `step=2 * i`, a
step passed into an inner `jax.jit`, a custom rule traced apart, which sees no scope), that
program returns the logs too, gated on the device as without `step=`, and a warning names the
events. This is decided at each trace, so for each compiled program: a new static argument or
shape that turns such a log on is looked at before any call of it is skipped.
"""

import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import numpy as np

from .._nnx import unwrapped
from .._scope import call_step, kept_at, watching
from .._warn import warn_user

_MISSING = object()


class StepArg:
    """Where the step is among a call's arguments: the parameter `name` of the function, at
    position `index` when it can be passed by position, and its `default` (`_MISSING` if it
    has none): a call that leaves the step out has the default as its step, as the function
    itself binds it (`def step(w, x, i=0)`, called `step(w, x)`: step 0)."""

    __slots__ = ("name", "index", "default")

    def __init__(self, name: str, index: int | None, default: Any = _MISSING):
        self.name, self.index, self.default = name, index, default

    # (compared by value: a static field of the compiled function, which equal functions share)
    def _key(self) -> tuple:
        default = self.default
        try:
            hash(default)
        except TypeError:  # (a default that cannot be hashed: compared by identity)
            default = id(default)
        return (self.name, self.index, type(self.default), default)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StepArg) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((StepArg, self._key()))

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
        default = _MISSING if parameter.default is parameter.empty else parameter.default
        return cls(name, index, default)

    def shifted(self, by: int) -> "StepArg":
        """The same parameter, with `by` arguments put in front of the call's."""
        index = None if self.index is None else self.index + by
        return StepArg(self.name, index, self.default)

    def peek(self, args: tuple, kwargs: dict) -> Any:
        """The step's value in a call: its argument, else the parameter's default
        (`_MISSING` if it has none)."""
        if self.index is not None and len(args) > self.index:
            return args[self.index]
        return kwargs.get(self.name, self.default)

    def take(self, args: tuple, kwargs: dict, where: str) -> tuple[Any, tuple, dict]:
        """The step's value and the call's arguments with None in its place (a step left to
        its default: the default, and None passed in its place)."""
        i = self.index
        if i is not None and len(args) > i:
            return args[i], (*args[:i], None, *args[i + 1 :]), kwargs
        if self.name not in kwargs:
            if self.default is _MISSING:
                raise self.missing(where)
            if i == len(args):  # (by position: the call compiles what `step(w, x, 0)` did)
                return self.default, (*args, None), kwargs
            return self.default, args, {**kwargs, self.name: None}
        kwargs = dict(kwargs)
        return kwargs.pop(self.name), args, {**kwargs, self.name: None}

    def missing(self, where: str) -> TypeError:
        return TypeError(
            f"{where}(step={self.name!r}): the call passes no argument {self.name!r}, and "
            "the parameter has no default. Pass the step at every call."
        )

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
    """Which program a call of `logger.jit(..., step=..., interval=k)` runs: where its step is
    a Python int, the one for skipped steps (`Skipping`) if it is not a multiple of k, else
    the one for kept steps (`Keeping`); where it is a JAX array, the step gated on the
    device."""

    __slots__ = ("step", "interval")

    def __init__(self, step: StepArg, interval: int):
        self.step, self.interval = step, interval

    def kept(self, args: tuple, kwargs: dict) -> bool | None:
        """Whether the interval keeps the call's step: True or False where the host knows
        the step (a Python int), None where only the device does (a JAX array)."""
        value = self.step.peek(args, kwargs)
        return bool(value % self.interval == 0) if host_int(value) else None


class AtStep(eqx.Module):
    """`fun` called with its step argument as the step of every event inside it without one
    of its own (a `scope(step=...)` around it), which an enclosing `watching` compares every
    event's step with (see `Skipping`). A plain `nnx.jit(fun)` is called as `fun`: its
    nested `jax.jit` would give the events a step of its own (`_nnx.unwrapped`)."""

    fun: Callable
    step: StepArg = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self.fun

    def __call__(self, *args, **kwargs):
        value = self.step.peek(args, kwargs)
        if value is _MISSING:
            raise self.step.missing("logger.jit")
        with call_step(value):  # (a plain `nnx.jit` inside: its function, see `_nnx`)
            return unwrapped(self.fun)(*args, **kwargs)


class _AtInterval(eqx.Module):
    """`fun` (the packed, spooled step) compiled for some of the calls of a `logger.jit(...,
    step=..., interval=k)`: those whose step the host reads (`Gate`)."""

    fun: Callable
    step: StepArg = eqx.field(static=True)
    interval: int = eqx.field(static=True)

    @property
    def __wrapped__(self):
        return self.fun.__wrapped__


class Keeping(_AtInterval):
    """`fun` (the packed, spooled step) for a call whose step the interval keeps, as the host
    read it: every event at the call's step is kept without a gate on the device
    (`_scope.kept_at`), so the call computes what the step without logs computes, bit for
    bit on a CPU (a gate on the device changed how XLA compiled the model's update: a run at
    `interval=7` drifted from the unlogged loop's). Events at other steps are gated there."""

    def __call__(self, *args, **kwargs):
        with kept_at(self.step.peek(args, kwargs), self.interval):
            return self.fun(*args, **kwargs)


class Skipping(_AtInterval):
    """`fun` (the packed, spooled step) for a call whose step the interval skips: its output
    alone, where every event it logs carries the call's step (so none is kept: the logs'
    computation is dead code, which XLA removes), else its output and its logs, gated on the
    device (with a warning naming the events at other steps). Decided at each trace, so for
    each compiled program (a new static argument, a new shape: a new trace)."""

    def __call__(self, *args, **kwargs):
        with watching() as watch:
            out, packed = self.fun(*args, **kwargs)
        if not watch.others:
            return out, None
        sites = sorted(set(watch.others))
        more = f" (and {len(sites) - 3} more)" if len(sites) > 3 else ""
        name = self.step.name
        warn_user(
            f"logger.jit(step={name!r}, interval={self.interval}): the events logged at "
            f"{'; '.join(sites[:3])}{more} carry a step other than the call's {name!r} (a "
            "`step=` of their own, or none: a custom derivative rule sees no scope), so the "
            "calls between intervals run the step with its logs, gated on the device, "
            f"rather than without them. To skip them, log without `step=` (the call's "
            f"{name!r} is the step of every event without one) or with `step={name}` itself."
        )
        return out, packed
