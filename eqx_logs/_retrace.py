"""A warning for a function compiled again for each new value of a Python scalar argument.

`spool(step)(model, x, i)` with `i` a Python `int` compiles once per value of `i`: arguments
are filtered as by `eqx.filter_jit`, which keeps Python scalars static. In a training loop that
is a compilation per step (minutes, then the compiler's memory). Nothing is wrong with one
compilation per value of a few configuration scalars, so the warning waits for `AFTER`
compilations that differ in nothing else."""

import collections
import inspect
import threading
import types
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from ._warn import warn_user

AFTER = 4  # compilations differing only in one Python scalar before the warning
_GROUPS = 256  # the (function, argument structure) groups remembered, most recent first

_lock = threading.Lock()
_seen: "collections.OrderedDict[Hashable, list[tuple[Any, ...]]]" = collections.OrderedDict()
_warned: set[tuple[Hashable, int]] = set()


def note_compile(who: str, key: Hashable, fun: Callable, args: tuple, kwargs: dict) -> None:
    """Called when `who` (`"eqx_logs.spool"`) traces `fun(*args, **kwargs)` to compile it;
    `key` identifies `fun` across compilations. After `AFTER` compilations that differ only
    in the value of a Python `int` or `float` argument, warn once, naming it."""
    leaves = jtu.tree_flatten_with_path((args, kwargs))[0]
    scalars = [(path, x) for path, x in leaves if type(x) in (int, float)]
    if not scalars:
        return
    rest = tuple(
        (path, (x.shape, x.dtype) if eqx.is_array(x) else x)
        for path, x in leaves
        if type(x) not in (int, float)
    )
    group = (key, tuple(path for path, _ in scalars), rest)
    try:
        hash(group)
    except TypeError:  # (an unhashable static argument: eqx.filter_jit says so)
        return
    values = tuple(x for _, x in scalars)
    with _lock:
        seen = _seen.setdefault(group, [])
        _seen.move_to_end(group)
        while len(_seen) > _GROUPS:
            _seen.popitem(last=False)
        if values not in seen and len(seen) < 2 * AFTER:
            seen.append(values)
        new = [
            i
            for i in range(len(scalars))
            if (group, i) not in _warned and len({v[i] for v in seen}) >= AFTER
        ]
        _warned.update((group, i) for i in new)
    for i in new:
        path, x = scalars[i]
        name = _argument(fun, path)
        some = ", ".join(repr(v[i]) for v in seen[:AFTER])
        array = "jnp.int32" if type(x) is int else "jnp.float32"
        warn_user(
            f"{who}: {_name(fun)} was compiled {len(seen)} times, once for each new value of "
            f"the Python {type(x).__name__} `{name}` ({some}, ...). Arguments are filtered as "
            "by `eqx.filter_jit`: a Python scalar is static, so each new value compiles the "
            f"function again. Pass an array, `{array}({name})`, to compile it once."
        )


def fun_key(fun: Callable) -> Hashable:
    """What identifies `fun` across compilations: a function itself, a callable pytree (an
    Equinox model) by its type and structure (its arrays are rebuilt for each trace)."""
    if isinstance(fun, types.FunctionType):
        return fun
    return type(fun), jtu.tree_structure(fun)


def _name(fun: Callable) -> str:
    return getattr(fun, "__qualname__", None) or type(fun).__name__


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
