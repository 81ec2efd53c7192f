"""`tap`: stream log events to a host callback as they happen."""

import functools
import inspect
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeVar, Unpack

import equinox as eqx
import jax.tree_util as jtu
import numpy as np

from .. import _compat
from .._interpret import warn_unmatched
from .._primitive import current_prefix
from .._reduce import (
    TAP_OPTIONS,
    Policy,
    Stack,
    TapOptions,
    check_options,
    document_options,
    with_options,
)
from .._retrace import OPEN, finish, fun_key, note_compile
from .._spool import trace_filtered
from .._watch._rewrite import watched
from .._wrapper import AbstractWrapper, build_wrapper, carrying
from ._handler import Tap

_T = TypeVar("_T")


class CallbackFailedWarning(UserWarning):
    """A tap's callback raised, under `on_error="warn"`: said once per tap, with the
    traceback; the run went on."""


def print_callback(logs: dict[str, Any], steps: dict[str, Any]) -> None:
    """The default tap callback: one line per event, `key=value ... step=...` (a key logged
    with no value, `()`, as `key` alone)."""

    def fmt(k, x):
        a = np.asarray(x)
        return f"{k}={np.array2string(a, precision=4) if a.ndim else f'{a.item():.6g}'}"

    def items(k, value):  # a pytree value: a part per leaf, `key['a']=...`
        leaves = jtu.tree_flatten_with_path(value)[0]
        if not leaves:
            return [k]
        return [fmt(f"{k}{jtu.keystr(tuple(path))}", x) for path, x in leaves]

    parts = [p for k, v in logs.items() for p in items(k, v)]
    parts += [f"{k}={v}" for k, v in steps.items()]
    print("  ".join(parts), flush=True)


@document_options
def tap(
    fun: Callable[..., _T] | None = None,
    /,
    *,
    callback: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
    policy: Policy | None = None,
    buffer: int | None = None,
    on_error: Literal["raise", "warn"] = "raise",
    **options: Unpack[TapOptions],
) -> Callable[..., _T]:
    """Stream every [`eqx_logs.log`][] event of `fun` to `callback(logs, steps)` on the host, in
    execution order, as it happens (inside jit, scan, while, cond).

    **Arguments:**

    - `fun`: the function; `tap` also works bare or with options only, like `spool`.
    - `callback`: called with `logs` (a dict from key to the event's numpy value) and `steps`
        (the step values of the call). Default: print a line per event. Under `vmap` it is
        called once per event with the batched values; where a batched `cond` or `while`
        predicate means the event did not happen in some lanes, `steps["valid"]` is the lane
        mask and those lanes' inexact values are NaN.
    - `buffer`: if an int `k`, the events are gathered on the device and `callback` gets
        them in blocks of `k` events (per group of keys logged by the same calls), one host
        callback per block, and the last partial block at the end of the call: each value
        and step then has a leading axis of events, in order (`steps["valid"]`, for batched
        events, says which lanes each happened in). Far fewer host round trips: use it where
        a loop logs every step.
    - `on_error`: `"raise"` (the default): an exception in `callback` fails the call (JAX's
        `JaxRuntimeError` names it, at the call or the next `jax.effects_barrier()`).
        `"warn"`: this tap's first one is said once, an `eqx_logs.CallbackFailedWarning` with
        its traceback, and the run goes on; later ones are dropped without a word.
    - `policy`: an [`eqx_logs.Policy`][], as for `spool`; the options below override its
        fields. A policy with `reduce`, `window`, `first_nonfinite`, `key` or `across`
        raises a `ValueError`: a tap keeps no events to work on.

    The policy's options a tap uses, as for [`eqx_logs.Policy`][]:

    {tap_options}

    `interval=k` is applied on the device: the host is called only for events 0, k, 2k, ...
    of each key, or, for events with a `step=`, those whose step is a multiple of k. Under a
    `vmap` inside `fun` a step is kept lane by lane, as `jax.vmap(tap(fun))` would keep it:
    the event reaches the host where some lane keeps it, and the lanes that do not are masked
    in `steps["valid"]` (NaN), as lanes where it did not happen are. `spool`'s other options
    (`reduce`, `window`, `first_nonfinite`, `keep`, `key`, `across`) raise a `TypeError`
    saying why: tap keeps no events to work on. Of a policy's `rules`, a tap applies
    `"drop"` and ignores the reductions, so that one Policy's rules serve a spool and a tap.

    **Returns:**

    A function with the signature and output of `fun`. Call `jax.effects_barrier()` to wait
    for all callbacks.

    !!! example

        ```python
        def f(xs):
            def step(c, x):
                eqx_logs.log("x", x, step=c)
                return c + 1, None
            return jax.lax.scan(step, 0, xs)[0]

        eqx_logs.tap(f, interval=2)(jnp.arange(5.0))  # prints 3 lines:
        # x=0  step=0
        # x=2  step=2
        # x=4  step=4
        ```
    """
    check_tap_options("eqx_logs.tap", options, also=("callback", "policy", "buffer", "on_error"))
    check_buffer("eqx_logs.tap", buffer)
    _check_on_error(on_error)
    policy = with_options(policy, "eqx_logs.tap", **options)
    if fun is None:
        return functools.partial(
            tap, callback=callback, policy=policy, buffer=buffer, on_error=on_error
        )
    if not callable(fun):
        raise TypeError(f"eqx_logs.tap expects a callable, got {type(fun).__name__}.")
    if callback is not None:
        _check_callback(callback)
    callback = print_callback if callback is None else callback
    sink = _Callback(callback if on_error == "raise" else _WarnOnce(callback))
    return tap_with(fun, policy, sink, None, every_process=False, buffer=buffer)


# spool's options that tap has not, and what tap would need to keep for them
SPOOL_ONLY = {
    "reduce": "to reduce",
    "window": "to reduce by window",
    "first_nonfinite": "to search for a NaN or infinity (or check the values in the callback)",
    "keep": "to pass on to an enclosing spool",
    "key": "to sample",
    "across": "to merge across devices",
}


def check_tap_options(where: str, options: dict[str, Any], also: tuple[str, ...]) -> None:
    """A `TypeError` for keywords `where` (a tap) does not take, saying why for spool's;
    `also`: `where`'s keywords that are not options."""
    for name in options:
        if name in SPOOL_ONLY:
            raise TypeError(
                f"{where}() has no `{name}`: that is a spool option. A tap streams each event "
                f"to the host as it happens and keeps none on the device {SPOOL_ONLY[name]}; "
                f"use `eqx_logs.spool(..., {name}=...)` (or `logger.spool` / `logger.jit`)."
            )
    check_options(where, options, TAP_OPTIONS, also)


def check_buffer(where: str, buffer: Any) -> None:
    """`buffer` must be None or a positive Python int (a block's static size)."""
    if buffer is None:
        return
    if isinstance(buffer, bool) or not isinstance(buffer, int | np.integer):
        raise TypeError(
            f"{where}(buffer=...) takes a Python int, the number of events per block (or "
            f"None, one callback per event); got {type(buffer).__name__}."
        )
    if buffer < 1:
        raise ValueError(f"{where}(buffer={buffer}): a block holds at least one event.")


def _name(callback: Callable) -> str:
    return getattr(callback, "__qualname__", None) or repr(callback)


def _check_on_error(on_error: Any) -> None:
    if on_error not in ("raise", "warn"):
        raise ValueError(
            f'eqx_logs.tap: on_error must be "raise" (a failing callback fails the call) or '
            f'"warn" (said once, then the run goes on), got {on_error!r}.'
        )


def _check_callback(callback: Any) -> None:
    """`callback(logs, steps)` must be callable with two positional arguments: found here,
    not on the host in the middle of a run."""
    if not callable(callback):
        raise TypeError(
            f"eqx_logs.tap: callback must be a function `callback(logs, steps)`, got "
            f"{type(callback).__name__}."
        )
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        signature.bind(None, None)
    except TypeError:
        name = _name(callback)
        raise TypeError(
            f"eqx_logs.tap: callback {name}{signature} cannot be called as callback(logs, "
            "steps), with two positional arguments: the dict of the event's values and the "
            "dict of its steps. Define it as `def callback(logs, steps): ...`."
        ) from None


def tap_with(
    fun: Callable[..., _T],
    policy: Policy,
    sink: Callable,
    context: Any,
    every_process: bool,
    buffer: int | None = None,
):
    """`fun`, calling `sink(context, logs, steps)` on the host for each selected event;
    `context` (a pytree of arrays, such as a logger's state) is passed through. With
    `every_process`, events of a program over many processes' devices reach every process
    (`_compat.host_callback`)."""

    if policy.first_nonfinite:
        raise ValueError(
            "tap(policy=Policy(first_nonfinite=True)): tap streams each event to the host as it "
            "happens and does not look for non-finite values; use `eqx_logs.spool(..., "
            "first_nonfinite=True)` (or `logger.spool`), or check the values in the callback."
        )
    ignored = [
        name
        for name, used in (
            ("reduce", not isinstance(policy.reduce, Stack)),
            ("window", policy.window is not None),
            ("across", bool(policy.across)),
            ("key", policy.key is not None),
        )
        if used
    ]
    if ignored:
        fields = ", ".join(f"{n}={getattr(policy, n)!r:.60}" for n in ignored)
        raise ValueError(
            f"tap(policy=Policy({fields})): a tap streams each event to the host as it "
            "happens and keeps none on the device to reduce, merge or sample, so these would "
            "be ignored. Use `eqx_logs.spool` (or `logger.spool` / `logger.jit`) for them, or "
            "tap with a Policy of what a tap uses: `interval`, `tags`, `exclude`, `prefix` "
            "and `rules` (of which a tap applies `'drop'` only)."
        )
    buffer = None if buffer is None else int(buffer)
    return build_wrapper(_Tapped, fun, policy, sink, context, every_process, buffer)


class _Tapped(AbstractWrapper):
    """`tap(fun)`: a pytree of `fun`, the policy and the context, like `eqx.filter_jit(fun)`
    (see `_Spooled`)."""

    fun: Callable
    policy: Policy
    sink: Callable = eqx.field(static=True)
    context: Any
    every_process: bool = eqx.field(default=False, static=True)
    buffer: int | None = eqx.field(default=None, static=True)

    shown: ClassVar[str] = "eqx_logs.tap"

    @property
    def __wrapped__(self):
        return self.fun

    def __call__(self, *args, **kwargs):
        return carrying(self, "eqx_logs.tap", _Tapped._run, args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        # the enclosing scope changes the keys `fun` logs, so it is part of the cache key
        sink = (self.sink, self.every_process, self.buffer)
        # (whether the call is eager: compiling again for a static argument of an enclosing
        # `jax.jit` is the user's choice, and not said)
        scope = (current_prefix(), not _compat.is_traced((args, kwargs)))
        try:
            return _tap_call(self.fun, self.policy, sink, scope, self.context, args, kwargs)
        finally:
            if OPEN:  # (a compilation of a Python scalar's value: timed, maybe said)
                finish()


class _Callback(eqx.Module):
    """A user's `callback(logs, steps)` as a sink (static, so jit caches on its identity)."""

    callback: Callable = eqx.field(static=True)

    def __call__(self, context: None, logs: dict[str, Any], steps: dict[str, Any]) -> None:
        self.callback(logs, steps)


class _WarnOnce:
    """A user's callback whose exceptions are said once, as a warning, then dropped (tap's
    `on_error="warn"`): one per `tap(...)`, so each tap says its first failure."""

    def __init__(self, callback: Callable[[dict[str, Any], dict[str, Any]], None]):
        self.callback = callback
        self.warned = False
        self.lock = threading.Lock()

    def __call__(self, logs: dict[str, Any], steps: dict[str, Any]) -> None:
        try:
            self.callback(logs, steps)
        except Exception:  # on_error="warn" asked for exactly this: said once, below
            with self.lock:
                said, self.warned = self.warned, True
            if not said:
                warnings.warn(
                    f"eqx_logs.tap: the callback {_name(self.callback)} raised on the events of "
                    f'{sorted(logs)} (on_error="warn": the run goes on, and this tap\'s '
                    f"later failures are dropped without a word):\n{traceback.format_exc()}",
                    CallbackFailedWarning,
                    stacklevel=2,
                )


@eqx.filter_jit
def _tap_call(fun, policy, sink, scope, context, args, kwargs):
    _, eager = scope  # (the prefix is part of the cache key only)
    if eager:
        note_compile("eqx_logs.tap", fun_key(fun), fun, args, kwargs)
    closed, flat, rebuild = trace_filtered(fun, args, kwargs)
    if policy.watch is not None:
        closed = watched(closed, flat, policy.watch, "eqx_logs.tap")
    sink, every_process, buffer = sink
    tap = Tap(policy, sink, every_process, context, buffer)
    outs = tap.run(closed, flat)
    warn_unmatched(tap.interp.plan, "eqx_logs.tap")
    return rebuild(outs)
