"""`tap`: stream log events to a host callback as they happen."""

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from . import _compat
from ._interpret import Interpreter
from ._policy import Policy
from ._primitive import current_prefix
from ._rules import RULES
from ._spool import trace_filtered

_T = TypeVar("_T")


def print_callback(logs: dict[str, Any], steps: dict[str, Any]) -> None:
    """The default tap callback: one line per event, `key=value ... step=...`."""

    def fmt(x):
        a = np.asarray(x)
        return np.array2string(a, precision=4) if a.ndim else f"{a.item():.6g}"

    parts = [f"{k}={fmt(v)}" for k, v in logs.items()] + [f"{k}={v}" for k, v in steps.items()]
    print("  ".join(parts), flush=True)


class _TapInterpreter(Interpreter):
    """Evaluates a jaxpr, turning each selected log event into an ordered host callback,
    gated on the device by the policy's interval (a per-key event counter is threaded)."""

    def __init__(self, policy: Policy, sink: Callable, context: Any):
        super().__init__(policy, RULES)
        self.sink = sink
        self.context = context

    def run(self, closed: Any, args: Any) -> list[Any]:
        counts = self.count(closed)
        kept = [k for k in counts if not isinstance(self.policy.reduction(k), str)]
        # Keys logged by exactly the same log equations always have the same number of events,
        # so they share one event counter: fewer scalar ops in every loop iteration.
        groups: dict[frozenset, str] = {}
        self._group = {}
        for key in kept:
            sites = frozenset(self._eqns_of[key])
            self._group[key] = groups.setdefault(sites, f"group{len(groups)}")
        self._reductions = dict.fromkeys(kept)
        outs, _ = self.eval(closed, args, {g: jnp.zeros((), jnp.int32) for g in groups.values()})
        return outs

    def keys(self, closed: Any) -> tuple[str, ...]:
        """The event counters (one per group of keys) that `closed` updates."""
        return tuple(dict.fromkeys(self._group[k] for k in super().keys(closed)))

    def _record(self, eqn):
        keys = super()._record(eqn)
        if not hasattr(self, "_eqns_of"):
            self._eqns_of: dict[str, set[int]] = {}
            self._alive: list[Any] = []  # keeps the ids above unique
        self._alive.append(eqn)
        for key in keys:
            self._eqns_of.setdefault(key, set()).add(id(eqn))
        return keys

    def _event(self, eqn, invals, states):
        params = eqn.params
        if not self.policy.selects(params["tags"]):
            if _compat.logging_enabled.value:
                _compat.bind_eqn(eqn, invals)  # not ours: an enclosing spool or tap sees it
            return
        n_leaves = params["treedef"].num_leaves
        items = jtu.tree_unflatten(params["treedef"], invals[:n_leaves])
        steps = dict(zip(params["steps"], invals[n_leaves:]))
        keys = [k for k in items if k in self._reductions]
        if not keys:
            return
        mask = invals[-1] if params["masked"] else None
        happened = jnp.bool_(True) if mask is None else jnp.any(mask)
        groups = list(dict.fromkeys(self._group[k] for k in keys))
        if self.policy.interval == 1:
            wanted = dict.fromkeys(groups, happened)
        else:  # events 0, k, 2k, ... of each key (counters are never negative: lax.rem)
            period = jnp.int32(self.policy.interval)
            wanted = {g: jnp.logical_and(happened, lax.rem(states[g], period) == 0) for g in groups}
            for g in groups:
                states[g] = states[g] + happened.astype(jnp.int32)
        values = {k: items[k] for k in keys}
        group_of = {k: self._group[k] for k in keys}
        prefix, sink = self.policy.prefix, self.sink

        def host(context, values, steps, wanted, mask):
            values, steps = jax.tree.map(np.asarray, (values, steps))
            if mask is not None:  # lanes where the event did not happen: NaN (inexact values)
                mask = np.asarray(mask)
                steps = {**steps, "valid": mask}

                def hide(v):
                    if not np.issubdtype(v.dtype, np.inexact):
                        return v
                    m = mask.reshape(mask.shape + (1,) * (v.ndim - mask.ndim))
                    return np.where(m, v, np.nan)

                values = jax.tree.map(hide, values)
            logs = {prefix + k: v for k, v in values.items() if bool(wanted[group_of[k]])}
            if logs:
                sink(context, logs, steps)

        def emit():
            jax.debug.callback(host, self.context, values, steps, wanted, mask, ordered=True)

        lax.cond(functools.reduce(jnp.logical_or, wanted.values()), emit, lambda: None)


def tap(
    fun: Callable[..., _T] | None = None,
    /,
    *,
    callback: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
    policy: Policy | None = None,
    interval: int | None = None,
    tags: Any = None,
    exclude: Any = None,
    prefix: str | None = None,
) -> Callable[..., _T]:
    """Stream every `eqx_logs.log` event of `fun` to `callback(logs, steps)` on the host, in
    execution order, as it happens (inside jit, scan, while, cond).

    **Arguments:**

    - `fun`: the function; `tap` also works bare or with options only, like `spool`.
    - `callback`: called with `logs` (a dict from key to the event's numpy value) and `steps`
        (the step values of the call). Default: print a line per event. Under `vmap` it is
        called once per event with the batched values; where a batched `cond` or `while`
        predicate means the event did not happen in some lanes, `steps["valid"]` is the lane
        mask and those lanes' inexact values are NaN.
    - `policy`, `interval`, `tags`, `exclude`, `prefix`: as for `spool`. `interval=k` is
        applied on the device: the host is called only for events 0, k, 2k, ... of each key.

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

        eqx_logs.tap(f, interval=2)(jnp.arange(5.0))  # prints x=0 step=0, x=2 ..., x=4 ...
        ```
    """
    if policy is None:
        policy = Policy()
    policy = policy.replace(interval=interval, tags=tags, exclude=exclude, prefix=prefix)
    if fun is None:
        return functools.partial(tap, callback=callback, policy=policy)
    if not callable(fun):
        raise TypeError(f"eqx_logs.tap expects a callable, got {type(fun).__name__}.")
    sink = _Callback(print_callback if callback is None else callback)

    @functools.wraps(fun)
    def tapped(*args, **kwargs):
        return tap_call(fun, policy, sink, current_prefix(), None, args, kwargs)

    return tapped


class _Callback(eqx.Module):
    """A user's `callback(logs, steps)` as a sink (static, so jit caches on its identity)."""

    callback: Callable = eqx.field(static=True)

    def __call__(self, context: None, logs: dict[str, Any], steps: dict[str, Any]) -> None:
        self.callback(logs, steps)


@eqx.filter_jit
def tap_call(fun, policy, sink, scope, context, args, kwargs):
    """Run `fun(*args, **kwargs)`, calling `sink(context, logs, steps)` on the host for each
    selected event. `context` (a pytree of arrays) is passed through to every call; `scope` is
    part of the cache key only."""
    del scope
    closed, flat, rebuild = trace_filtered(fun, args, kwargs)
    return rebuild(_TapInterpreter(policy, sink, context).run(closed, flat))
