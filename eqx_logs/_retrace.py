"""A warning for a function compiled again for each new value of a Python scalar argument.

`spool(step)(model, x, i)` with `i` a Python `int` compiles once per value of `i`: arguments
are filtered as by `eqx.filter_jit`, which keeps Python scalars static. In a training loop that
is a compilation per step (minutes, then the compiler's memory). Nothing is wrong with one
compilation per value of a few configuration scalars, so the warning waits for `AFTER`
compilations that differ in nothing else; it comes again as their count grows (at 4, 16, 64,
256, ... compilations), with the time spent compiling.

`note_compile` is called as a compilation's trace starts; `finish`, by the same caller once
the call that compiled returns: the time between is the compilation's (its trace, lowering and
compiling, and the dispatch of its first run), and a warning due is given then, at the
user's line."""

import collections
import dataclasses
import functools
import inspect
import threading
import time
import types
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ._warn import warn_user

AFTER = 4  # compilations differing only in one Python scalar before the warning
AGAIN = 4  # then again each time their count has grown this many times over
_SAMPLE = 2 * AFTER  # the distinct values remembered per group (the count goes on beyond)
_GROUPS = 256  # the (function, argument structure) groups remembered, most recent first


@dataclasses.dataclass(eq=False)
class _Group:
    """The compilations of one function for one structure of its other arguments."""

    count: int = 0
    seconds: float = 0.0  # spent compiling them, as `finish` measures it
    values: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)  # a sample
    due: int = AFTER  # the count at which to warn next


_lock = threading.Lock()
_groups: "collections.OrderedDict[Hashable, _Group]" = collections.OrderedDict()
# thread -> its compilations under way: (group, start, the warnings to give at their end)
OPEN: dict[int, list[tuple[_Group, float, list[Callable[[float], str]]]]] = {}


def note_compile(who: str, key: Hashable, fun: Callable, args: tuple, kwargs: dict) -> None:
    """Called when `who` (`"eqx_logs.spool"`) traces `fun(*args, **kwargs)` to compile it;
    `key` identifies `fun` across compilations. Once `AFTER` compilations differ only in the
    value of a Python `int` or `float` argument, and again at `AFTER * AGAIN**k` of them, a
    warning names it and the time spent compiling, at the caller's `finish`."""
    leaves = jtu.tree_flatten_with_path((args, kwargs))[0]
    scalars = [(path, x) for path, x in leaves if type(x) in (int, float)]
    if not scalars:
        return
    rest = tuple(
        (path, (x.shape, x.dtype) if eqx.is_array(x) else x)
        for path, x in leaves
        if type(x) not in (int, float)
    )
    key = (who, key, tuple(path for path, _ in scalars), rest)
    try:
        hash(key)
    except TypeError:  # (an unhashable static argument: eqx.filter_jit says so)
        return
    values = tuple(x for _, x in scalars)
    with _lock:
        group = _groups.get(key)
        if group is None:
            group = _groups[key] = _Group()
        _groups.move_to_end(key)
        while len(_groups) > _GROUPS:
            _groups.popitem(last=False)
        group.count += 1
        if values not in group.values and len(group.values) < _SAMPLE:
            group.values.append(values)
        due = []
        if group.count >= group.due:
            for i, (path, x) in enumerate(scalars):
                some = list(dict.fromkeys(v[i] for v in group.values))
                if len(some) >= AFTER:
                    said = (who, fun_name(fun), group.count, _argument(fun, path), x, some[:AFTER])
                    due.append(functools.partial(_message, *said))
            while due and group.due <= group.count:
                group.due *= AGAIN
        OPEN.setdefault(threading.get_ident(), []).append((group, time.perf_counter(), due))


def finish() -> None:
    """Called by `note_compile`'s caller when a call that may have compiled returns (or
    raises): the time since each compilation this thread noted is added to its group's, and
    the warnings due are given, at the user's line."""
    opened = OPEN.pop(threading.get_ident(), None)
    if not opened:
        return
    end = time.perf_counter()
    for group, start, due in opened:
        with _lock:
            group.seconds += end - start
            seconds = group.seconds
        for message in due:
            warn_user(message(seconds))


def _message(who: str, fun: str, count: int, name: str, x: Any, some: list, seconds: float):
    array = "jnp.int32" if type(x) is int else "jnp.float32"
    took = f"{seconds:.2f}" if seconds < 10 else f"{seconds:.0f}"
    some = ", ".join(map(repr, some))
    return (
        f"{who}: {fun} was compiled {count} times so far, taking {took} s, once for each new "
        f"value of the Python {type(x).__name__} `{name}` ({some}, ...). Arguments are "
        "filtered as by `eqx.filter_jit`: a Python scalar is static, so each new value "
        f"compiles the function again. {_remedy(who, name, x, array)}"
    )


def _remedy(who: str, name: str, x: Any, array: str) -> str:
    """What to write instead: for `logger.jit`'s int parameter, `step=` first (passed traced,
    and the steps an interval skips run without their logs), as the README says."""
    if who == "logger.jit" and type(x) is int and name.isidentifier():
        return (
            f"If `{name}` is the training step, name it, `logger.jit(fun, state, "
            f'step="{name}")`: it is then passed traced (one compilation for every value), '
            f"it is the step of the events logged without one, and with an interval the "
            f"steps it skips run without their logs. Otherwise pass an array, "
            f"`{array}({name})`, to compile it once."
        )
    return f"Pass an array, `{array}({name})`, to compile it once."


def fun_key(fun: Callable) -> Hashable:
    """What identifies `fun` across compilations: a function itself, a callable pytree (an
    Equinox model) by its type and structure (its arrays are rebuilt for each trace)."""
    if isinstance(fun, types.FunctionType):
        return fun
    return type(fun), jtu.tree_structure(fun)


def fun_name(fun: Callable) -> str:
    """`fun`'s name: its `__qualname__`, or its class's (an Equinox model's)."""
    name = getattr(fun, "__qualname__", None)  # (an Equinox copy's may be `Missing`)
    return name if isinstance(name, str) else type(fun).__name__


def _argument(fun: Callable, path: tuple) -> str:
    """The argument at `path` in `(args, kwargs)`, by its parameter's name: `i`, `cfg['lr']`."""
    where, key, *inside = path
    if isinstance(where, jtu.SequenceKey) and where.idx == 1:  # kwargs
        name = str(key.key)
    else:
        name = f"argument {key.idx}"
        try:
            params = list(inspect.signature(fun).parameters.values())
        except (TypeError, ValueError):
            params = []
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if key.idx < len(positional):
            name = positional[key.idx].name
    return name + jtu.keystr(tuple(inside))
