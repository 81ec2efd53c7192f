"""The public transforms: `spool` and `nolog`."""

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.tree_util as jtu
from jaxtyping import PyTree

from ._interpret import Interpreter, Selection
from ._logdict import LogDict
from ._primitive import current_prefix, tracing_context
from ._reductions import AbstractReduction, Stack
from ._rules import RULES

_T = TypeVar("_T")


def _tuple_of_str(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"eqx_logs.spool({name}=...) takes strings, got {value!r}.")
    return value


def _selection(*, interval, tags, exclude, prefix, keep) -> Selection:
    if interval is None:
        interval = 1
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(
            f"eqx_logs.spool(interval={interval!r}): interval must be an integer >= 1 (keep every "
            "interval-th event of each key)."
        )
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"eqx_logs.spool(prefix={prefix!r}): prefix must be a string.")
    return Selection(
        tags=_tuple_of_str("tags", tags),
        exclude=_tuple_of_str("exclude", exclude) or (),
        interval=interval,
        prefix=prefix or "",
        keep=bool(keep),
    )


def spool(
    fun: Callable[..., _T] | None = None,
    /,
    *,
    policy: Any = None,
    reduce: str | AbstractReduction | None = None,
    interval: int | None = None,
    window: int | None = None,
    tags: str | tuple[str, ...] | None = None,
    exclude: str | tuple[str, ...] | None = None,
    prefix: str | None = None,
    keep: bool = False,
) -> Callable[..., tuple[_T, LogDict]]:
    """Capture every `eqx_logs.log` event of `fun` and return them with its output.

    **Arguments:**

    - `fun`: the function. `spool` also works as a bare decorator or with options only:
        `@eqx_logs.spool` or `@eqx_logs.spool(tags="train")`.
    - `interval`: keep every `interval`-th event of each key (events 0, k, 2k, ...).
    - `tags`: keep only events carrying at least one of these tags (None keeps all).
    - `exclude`: drop events carrying any of these tags.
    - `prefix`: prepended to every output key.
    - `keep`: also pass the captured events on to an enclosing spool (by default an inner
        spool consumes them). Events this spool does not select always pass on.
    - `reduce`: `"stack"` (the default) or an `eqx_logs.Stack(capacity=..., keep=...)`, which
        bounds the buffer (required for logs inside `lax.while_loop`).
    - `policy`, `window`: reserved for the reductions issue.

    **Returns:**

    A function with the signature of `fun` returning `(out, logs)`, where `logs` is a
    [`eqx_logs.LogDict`][]: `logs[key]` stacks the key's events along a new leading axis in
    execution order, `logs.count[key]` is the number of real events.

    Arguments are filtered as by `eqx.filter_jit`: arrays are traced, everything else is
    static. The spooled function is compiled and cached per static arguments and input shapes.

    !!! example

        ```python
        def f(xs):
            def step(c, x):
                eqx_logs.log("c", c)
                return c + x, None
            return jax.lax.scan(step, 0.0, xs)[0]

        out, logs = eqx_logs.spool(f)(jnp.arange(3.0))  # logs["c"] == [0., 0., 1.]
        ```
    """
    if isinstance(reduce, str) and reduce in ("stack", "append") or reduce is None:
        reduction = Stack()
    elif isinstance(reduce, Stack):
        reduction = reduce
    else:
        raise NotImplementedError(
            f"eqx_logs.spool(reduce={reduce!r}): only the stack reduction ('stack' or "
            "`eqx_logs.Stack(capacity=..., keep=...)`) is available in this version."
        )
    if policy is not None or window is not None:
        raise NotImplementedError(
            "eqx_logs.spool: `policy` and `window` are not available in this version."
        )
    selection = _selection(interval=interval, tags=tags, exclude=exclude, prefix=prefix, keep=keep)
    if fun is None:
        return functools.partial(
            spool,
            reduce=reduce,
            interval=interval,
            tags=tags,
            exclude=exclude,
            prefix=prefix,
            keep=keep,
        )
    if not callable(fun):
        raise TypeError(f"eqx_logs.spool expects a callable, got {type(fun).__name__}.")

    @functools.wraps(fun)
    def spooled(*args, **kwargs):
        # The enclosing scope changes the keys `fun` logs, so it is part of the cache key.
        return _spool_call(fun, selection, reduction, current_prefix(), args, kwargs)

    return spooled


@eqx.filter_jit
def _spool_call(fun, selection, reduction, scope, args, kwargs):
    del scope
    dynamic, static = eqx.partition((fun, args, kwargs), eqx.is_array)
    flat, treedef = jtu.tree_flatten(dynamic)
    out_structure = []

    def flat_fun(*flat_args):
        f, a, k = eqx.combine(jtu.tree_unflatten(treedef, flat_args), static)
        out = f(*a, **k)
        out_dynamic, out_static = eqx.partition(out, eqx.is_array)
        leaves, out_def = jtu.tree_flatten(out_dynamic)
        out_structure.append((out_def, out_static))
        return leaves

    with tracing_context(enabled=True):
        closed = jax.make_jaxpr(flat_fun)(*flat)
    interp = Interpreter(selection, RULES)
    outs, logs = interp.run(closed, flat, lambda key: reduction)
    out_def, out_static = out_structure[-1]
    return eqx.combine(jtu.tree_unflatten(out_def, outs), out_static), logs


def nolog(fun: Callable[..., _T]) -> Callable[..., _T]:
    """`fun` with every `eqx_logs.log` inside it removed.

    **Arguments:**

    - `fun`: any function, jitted or not.

    **Returns:**

    A function with the same signature and outputs. Nothing is logged from inside it, even
    under an enclosing `spool`, and it compiles to exactly what `fun` would without logs.
    """

    @functools.wraps(fun)
    def wrapper(*args: PyTree, **kwargs: PyTree) -> _T:
        with tracing_context(enabled=False):
            return fun(*args, **kwargs)

    return wrapper
