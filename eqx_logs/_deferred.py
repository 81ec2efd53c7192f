"""Computations that only feed logs: evaluated where, and only when, an event needs them.

`log("sv", jnp.linalg.svd(w, compute_uv=False))` with `interval=100` should compute the
singular values on every 100th step only. The interpreter therefore does not evaluate an
equation whose outputs are used only by log equations (directly or through other such
equations) when it meets it: the log's operands arrive as `Lazy` values, and the event forces
them inline when it is always kept, or inside the `lax.cond` that folds it in when it may be
skipped, so that XLA runs the computation only for kept events. On GPUs, where a conditional
makes the host wait for the device, there is no `lax.cond`: the computation runs at every
step (`_branching.py`).
"""

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

from . import _compat

Producers = dict[Any, tuple[int, _compat.JaxprEqn]]  # var -> (position, equation making it)


def log_only(
    jaxpr: _compat.Jaxpr,
    is_log: Callable[[_compat.JaxprEqn], bool],
    keeps: Callable[[_compat.JaxprEqn], bool],
) -> Producers:
    """The equations of `jaxpr` whose outputs only logs (`is_log`) use, by output variable.
    `keeps(eqn)` is true for other equations that must run where they are (logs inside)."""
    used_elsewhere = {v for v in jaxpr.outvars if not isinstance(v, _compat.Literal)}
    used_by_logs: set[Any] = set()
    producers: Producers = {}
    for i in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[i]
        outs = [v for v in eqn.outvars if not isinstance(v, _compat.DropVar)]
        inputs = {v for v in eqn.invars if not isinstance(v, _compat.Literal)}
        if is_log(eqn):
            used_by_logs.update(inputs)
            continue
        if keeps(eqn):
            used_elsewhere.update(inputs)
            continue
        deferrable = (
            not eqn.effects
            and outs
            and not any(v in used_elsewhere for v in outs)
            and any(v in used_by_logs for v in outs)
        )
        if deferrable:
            producers.update({v: (i, eqn) for v in outs})
            used_by_logs.update(inputs)
        else:
            used_elsewhere.update(inputs)
    return producers


class Lazy:
    """An operand of a log that is computed only when forced, each equation evaluated with
    `bind` (the interpreter's: see `Interpreter.bind_eqn`)."""

    __slots__ = ("var", "env", "producers", "bind")

    def __init__(
        self,
        var: Any,
        env: dict[Any, Any],
        producers: Producers,
        bind: Callable[[_compat.JaxprEqn, list[Any]], list[Any]] = _compat.bind_eqn,
    ):
        self.var, self.env, self.producers, self.bind = var, env, producers, bind

    def value(self, memo: dict[Any, Any] | None) -> Any:
        """Evaluate in the current trace; results are kept in `memo` (None: in the jaxpr's
        environment, for a value forced where the jaxpr is being evaluated).

        Logged values take no gradient, so under `grad` (or any trace that is not building a
        jaxpr) the computation reads its inputs through `stop_gradient`: it is not
        differentiated, just computed."""
        memo = self.env if memo is None else memo
        stop = not _compat.staging()
        needed, stack = {}, [self.var]
        while stack:
            v = stack.pop()
            if v in memo or v in self.env or v not in self.producers:
                continue
            i, eqn = self.producers[v]
            if i in needed:
                continue
            needed[i] = eqn
            stack.extend(u for u in eqn.invars if not isinstance(u, _compat.Literal))
        for i in sorted(needed):
            eqn = needed[i]
            invals = [self._read(u, memo, stop) for u in eqn.invars]
            for v, x in zip(eqn.outvars, self.bind(eqn, invals)):
                if not isinstance(v, _compat.DropVar):
                    memo[v] = x
        return self._read(self.var, memo, stop)

    def _read(self, v: Any, memo: dict[Any, Any], stop: bool) -> Any:
        if isinstance(v, _compat.Literal):
            return v.val
        if not stop or v in self.producers:  # computed here, or where the jaxpr is evaluated
            return memo[v] if v in memo else self.env[v]
        key = ("stopped", v)  # an input of the log-only computation, read once
        if key not in memo:
            memo[key] = stop_gradient(self.env[v])
        return memo[key]


def stop_gradient(x: Any) -> Any:
    """`lax.stop_gradient(x)` where `x` is a traced inexact array; `x` otherwise."""
    inexact = _compat.is_tracer(x) and jnp.issubdtype(x.dtype, jnp.inexact)
    return lax.stop_gradient(x) if inexact else x


def force(values: list[Any], memo: dict[Any, Any] | None = None) -> list[Any]:
    """`values` with every `Lazy` evaluated (see `Lazy.value`)."""
    return [x.value(memo) if isinstance(x, Lazy) else x for x in values]
