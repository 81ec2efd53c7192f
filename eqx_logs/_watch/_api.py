"""`eqx_logs.watch(fun, ...)`: the function transform (the `watch=` option of a spool, tap or
logger applies the same rewrite to the function it wraps)."""

from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import equinox as eqx

from .. import _compat
from .._spool import trace_filtered
from .._stats import DEFAULT_STATS
from .._wrapper import AbstractWrapper, build_wrapper, carrying
from ._rewrite import run_watched
from ._spec import Watch

_T = TypeVar("_T")


class _Watched(AbstractWrapper):
    """`watch(fun, ...)`: a pytree of `fun` and what it watches (see `AbstractWrapper`)."""

    fun: Callable
    spec: Watch
    caller: str = eqx.field(static=True, default="eqx_logs.watch")

    shown: ClassVar[str] = "eqx_logs.watch"

    @property
    def __wrapped__(self):
        return self.fun

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return carrying(self, "eqx_logs.watch", _Watched._run, args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        if not _compat.logging_enabled.value:  # no spool or tap traces: nothing to log
            return self.fun(*args, **kwargs)
        closed, flat, rebuild = trace_filtered(self.fun, args, kwargs)
        return rebuild(run_watched(closed, flat, self.spec, self.caller))


def watch_with(fun: Callable[..., _T], spec: Watch, caller: str) -> Callable[..., _T]:
    """`watch(fun, ...)` for a `Watch` already made (a policy's), `caller` naming it in what
    it says."""
    return build_wrapper(_Watched, fun, spec, caller)


def watch(
    fun: Callable[..., _T],
    *names: str,
    where: str | Callable[[str], bool] | None = None,
    max_depth: int | None = None,
    stats: Sequence[str] | None = DEFAULT_STATS,
    grads: bool = False,
    backward: bool = False,
) -> Callable[..., _T]:
    """`fun` with the outputs of some primitives, and the carries of some loops, logged
    wherever they are: in code you did not write (optax, diffrax, optimistix, lineax), behind
    `jit`, in loops, branches, custom derivatives and `shard_map`.

    **Arguments:**

    - `fun`: any function of arrays (and of static values, filtered as `eqx.filter_jit` does).
    - `*names`, `where`, `max_depth`, `stats`, `grads`, `backward`: what to watch, as for
        [`eqx_logs.Watch`][].

    **Returns:**

    A function with the signature of `fun` that logs, under `"watch/<address>"` and tagged
    `"watch"`, each watched value (or its statistics): a spool, tap or logger around it
    records them as any other log (reductions, `interval`, `tags` and `rules` apply). Outside
    them it is `fun`'s program. The address is the value's position in the program:
    `"watch/while[1]/carry/0"` is the first carry leaf of the second while loop at the top
    level, `"watch/while[0]/cholesky[0]"` the output of the first cholesky inside the first
    while loop. Calls are transparent: a cholesky inside a jitted function `solve` is
    `"watch/cholesky[0]"`, as if it were written in place (see [the guide](../watch.md)).

    The spool's `watch=` option does the same for the function it spools; use this transform
    to watch inside a derivative (`spool(jax.grad(watch(f, "while")))` watches the forward
    pass once, and `grads=True` adds the cotangents), or to watch one part of a program.

    !!! example

        ```python
        def f(x):
            def body(c):
                return c[0] + 1, c[1] * x

            return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))

        _, logs = eqx_logs.spool(eqx_logs.watch(f, "while"), reduce="last")(2.0)
        logs["watch/while[0]/carry/1"]  # 16.0
        ```
    """
    if not callable(fun):
        raise TypeError(f"eqx_logs.watch expects a callable, got {type(fun).__name__}.")
    spec = Watch(
        *names, where=where, max_depth=max_depth, stats=stats, grads=grads, backward=backward
    )
    return build_wrapper(_Watched, fun, spec)
