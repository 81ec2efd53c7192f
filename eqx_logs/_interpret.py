"""The jaxpr interpreter behind `spool`.

Two passes over a traced program:

1. `Interpreter.count` walks the jaxpr once and finds, for every key, the static upper bound on
   its number of events (a scan multiplies, a cond takes the maximum over branches, a while
   loop is unbounded) and the shape of its events (checking that sites of one key agree).
2. `Interpreter.eval` evaluates the jaxpr in the current trace, threading one reduction state
   per key: a log equation updates its keys' states; a higher-order primitive that contains
   logs is rebuilt through its public constructor by its rule in `_rules.py`, with the states
   added to its operands, carries and results. Nothing JAX created is mutated.
"""

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

from . import _compat
from ._buffers import NeedsBound
from ._logdict import LogDict
from ._policy import Policy
from ._primitive import is_log, log_effect

Counts = dict[str, int | None]  # key -> static bound on its events (None: unbounded)


class UnhandledPrimitiveError(NotImplementedError):
    pass


@dataclasses.dataclass
class _KeyInfo:
    """What the first pass learns about one key."""

    treedef: Any
    leaves: list[jax.ShapeDtypeStruct]
    weak: list[bool]
    steps: dict[str, jax.ShapeDtypeStruct]
    sites: list[str]
    nbatch: int
    reduce: list[tuple[str, Any]]  # (call site, the reduction it names), every site seen

    def batch_shape(self) -> tuple[int, ...]:
        return self.leaves[0].shape[: self.nbatch]

    def lane_struct(self) -> Any:
        """The structure of one event of one batch lane."""
        leaves = [jax.ShapeDtypeStruct(s.shape[self.nbatch :], s.dtype) for s in self.leaves]
        return jtu.tree_unflatten(self.treedef, leaves)

    def site_reduce(self, key: str) -> Any:
        named = [(site, r) for site, r in self.reduce if r is not None]
        if len({_reduce_id(r) for _, r in named}) > 1:
            detail = "; ".join(dict.fromkeys(f"{r!r} at {site}" for site, r in named))
            raise ValueError(
                f"eqx_logs: key {key!r} is logged with different reductions ({detail}). Name "
                "one reduction per key, or set it once with a Policy rule."
            )
        return named[0][1] if named else None


def _reduce_id(reduce: Any) -> Any:
    from ._policy import as_reduction

    return as_reduction(reduce)


def _site_list(sites: Sequence[str]) -> str:
    return "; ".join(dict.fromkeys(sites))


def _python_scalar(dtype) -> Any:
    """A Python scalar of `dtype`'s kind: promotes like a weakly typed value of that dtype."""
    for kind, value in ((jnp.bool_, True), (jnp.integer, 1), (jnp.floating, 1.0)):
        if jnp.issubdtype(dtype, kind):
            return value
    return 1j


def _merge_leaf(key, info, i, shape, dtype, weak, site):
    old = info.leaves[i]
    where = f"at {site} and at {_site_list(info.sites)}"
    if old.shape != shape:
        raise ValueError(
            f"eqx_logs: key {key!r} is logged with shape {old.shape} and with shape {shape} "
            f"({where}). Every event of one key must have the same shape and dtype; log the "
            "differently shaped values under different keys."
        )
    if old.dtype == dtype:
        info.weak[i] = info.weak[i] and weak
        return
    if weak and not info.weak[i] and jnp.result_type(old.dtype, _python_scalar(dtype)) == old.dtype:
        return  # a weakly typed Python scalar adapts
    if info.weak[i] and not weak and jnp.result_type(dtype, _python_scalar(old.dtype)) == dtype:
        info.leaves[i] = jax.ShapeDtypeStruct(shape, dtype)
        info.weak[i] = False
        return
    raise TypeError(
        f"eqx_logs: key {key!r} is logged with dtype {old.dtype} and with dtype {dtype} "
        f"({where}). Every event of one key must have the same dtype; cast one of them."
    )


def _add(a: Counts, b: Counts, scale: int = 1) -> Counts:
    out = dict(a)
    for k, n in b.items():
        n = None if n is None else n * scale
        out[k] = None if n is None or out.get(k, 0) is None else out.get(k, 0) + n
    return out


def max_counts(many: Sequence[Counts]) -> Counts:
    out: Counts = {}
    for counts in many:
        for k, n in counts.items():
            out[k] = None if n is None or out.get(k, 0) is None else max(out.get(k, 0), n)
    return out


def unbounded(counts: Counts) -> Counts:
    return {k: None for k in counts}


class Interpreter:
    """Evaluates jaxprs, folding log events into per-key reduction states."""

    # Whether rules must say under which condition they evaluate a sub-jaxpr (`guard`). Spool
    # does not need it: a `vmap` outside it selects the states of untaken branches away.
    tracks_guards = False

    @contextlib.contextmanager
    def guard(self, pred: Callable[[], Any]):
        """Evaluate what follows only where `pred()` holds (a cond branch's index, a while
        loop's predicate). Rules call it; the base interpreter ignores it."""
        yield

    def __init__(self, policy: Policy, rules: dict[str, Any], *, keep: bool = False):
        self.policy = policy
        self.keep = keep
        self.rules = rules
        self.info: dict[str, _KeyInfo] = {}
        self._counts: dict[int, tuple[Any, Counts]] = {}
        self._has_log: dict[int, tuple[Any, bool]] = {}

    # -- first pass ---------------------------------------------------------------------

    def has_log(self, closed: Any) -> bool:
        hit = self._has_log.get(id(closed))
        if hit is None:
            jaxpr, _ = _compat.unpack(closed)
            found = any(is_log(e) or self.eqn_has_log(e) for e in jaxpr.eqns)
            hit = self._has_log[id(closed)] = (closed, found)
        return hit[1]

    def eqn_has_log(self, eqn: _compat.JaxprEqn) -> bool:
        if log_effect in eqn.effects:
            return True
        return any(self.has_log(sub) for sub in _compat.sub_jaxprs(eqn.params))

    def count(self, closed: Any) -> Counts:
        """Static bound on the number of selected events per key in `closed`."""
        hit = self._counts.get(id(closed))
        if hit is not None:
            return hit[1]
        jaxpr, _ = _compat.unpack(closed)
        total: Counts = {}
        for eqn in jaxpr.eqns:
            if is_log(eqn):
                if self.policy.selects(eqn.params["tags"]):
                    total = _add(total, {k: 1 for k in self._record(eqn)})
            elif self.eqn_has_log(eqn):
                total = _add(total, self.rule(eqn).count(self, eqn))
        self._counts[id(closed)] = (closed, total)
        return total

    def keys(self, closed: Any) -> tuple[str, ...]:
        """The keys with a state (selected, not dropped) logged in `closed`."""
        return tuple(k for k in self.count(closed) if k in self._reductions)

    def rule(self, eqn: _compat.JaxprEqn) -> Any:
        rule = self.rules.get(eqn.primitive.name)
        if rule is None:
            raise UnhandledPrimitiveError(
                f"eqx_logs: the primitive {eqn.primitive.name!r} (at "
                f"{_compat.eqn_location(eqn)}) contains logs, but spool has no rule for it, so "
                "its events cannot be captured and would be lost. Move the logs out of it, or "
                f"wrap the code in `eqx_logs.nolog`. Supported: {sorted(self.rules)}."
            )
        return rule

    def _record(self, eqn: _compat.JaxprEqn) -> list[str]:
        params = eqn.params
        treedef, site = params["treedef"], params["site"]
        n_leaves = treedef.num_leaves
        avals = [v.aval for v in eqn.invars]
        items = jtu.tree_unflatten(treedef, list(range(n_leaves)))
        steps = {
            name: jax.ShapeDtypeStruct(a.shape, a.dtype)
            for name, a in zip(params["steps"], avals[n_leaves : n_leaves + len(params["steps"])])
        }
        for key, positions in items.items():
            sub_leaves, sub_def = jtu.tree_flatten(positions)
            info = self.info.get(key)
            if info is None:
                self.info[key] = _KeyInfo(
                    treedef=sub_def,
                    leaves=[
                        jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype) for i in sub_leaves
                    ],
                    weak=[bool(getattr(avals[i], "weak_type", False)) for i in sub_leaves],
                    steps=dict(steps),
                    sites=[site],
                    nbatch=params["nbatch"],
                    reduce=[(site, params["reduce"])],
                )
                continue
            if info.treedef != sub_def:
                raise ValueError(
                    f"eqx_logs: key {key!r} is logged with pytree structure {sub_def} at {site} "
                    f"and {info.treedef} at {_site_list(info.sites)}. Every event of one key must "
                    "have the same structure."
                )
            for j, i in enumerate(sub_leaves):
                a = avals[i]
                _merge_leaf(key, info, j, a.shape, a.dtype, getattr(a, "weak_type", False), site)
            for name, s in steps.items():
                if name in info.steps and info.steps[name].shape != s.shape:
                    raise ValueError(
                        f"eqx_logs: step {name!r} of key {key!r} has shape {s.shape} at {site} "
                        f"but {info.steps[name].shape} at {_site_list(info.sites)}."
                    )
                info.steps.setdefault(name, s)
            info.sites.append(site)
            info.reduce.append((site, params["reduce"]))
        return list(items)

    # -- second pass --------------------------------------------------------------------

    def eval(self, closed: Any, args: Sequence[Any], states: dict[str, Any]):
        """Evaluate `closed` on `args`; returns `(outs, states)`."""
        jaxpr, consts = _compat.unpack(closed)
        states = dict(states)
        env: dict[Any, Any] = {}

        def read(v):
            return v.val if isinstance(v, _compat.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            if is_log(eqn):
                self._event(eqn, invals, states)
                outs = []
            elif self.eqn_has_log(eqn):
                outs, states = self.rule(eqn).apply(self, eqn, invals, states)
            else:
                outs = _compat.bind_eqn(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, _compat.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars], states

    def _event(self, eqn: _compat.JaxprEqn, invals: list[Any], states: dict[str, Any]) -> None:
        selected = self.policy.selects(eqn.params["tags"])
        if (not selected or self.keep) and _compat.logging_enabled.value:
            _compat.bind_eqn(eqn, invals)  # not ours (or kept): an enclosing spool sees it
        if not selected:
            return
        params = eqn.params
        treedef = params["treedef"]
        n_leaves = treedef.num_leaves
        items = jtu.tree_unflatten(treedef, invals[:n_leaves])
        steps = dict(zip(params["steps"], invals[n_leaves:]))
        mask = invals[-1] if params["masked"] else True
        for key, value in items.items():
            if key not in states:
                continue  # dropped by a rule
            info = self.info[key]
            leaves = jtu.tree_leaves(value)
            value = jtu.tree_unflatten(
                info.treedef,
                [
                    jax.lax.stop_gradient(jnp.asarray(x, s.dtype))
                    for x, s in zip(leaves, info.leaves)
                ],
            )
            event = {
                "value": value,
                **{
                    f"step:{name}": jnp.asarray(steps[name], s.dtype)
                    if name in steps
                    else jnp.full(s.shape, -1, s.dtype)
                    for name, s in info.steps.items()
                },
            }
            states[key] = self._update(key, states[key], event, mask)

    def _update(
        self, key: str, state: dict[str, Any], event: dict[str, Any], mask: Any
    ) -> dict[str, Any]:
        """Fold one event into a key's state; `mask` (True, or a bool per batch lane) says
        where the event really happened."""
        state = dict(state)
        valid = mask
        if self.policy.interval > 1:  # events 0, k, 2k, ... of this key
            period = jnp.int32(self.policy.interval)
            valid = jnp.logical_and(lax.rem(state["seen"], period) == 0, mask)
            state["seen"] = state["seen"] + jnp.asarray(mask, jnp.int32)
        if valid is not True:
            valid = jnp.broadcast_to(valid, self.info[key].batch_shape())
        state["count"] = state["count"] + jnp.asarray(valid, jnp.int32)
        nbatch = self.info[key].nbatch
        for channel, reduction in self._channels[key].items():

            def update(s, v, valid, reduction=reduction):
                return reduction.update(s, v, valid)

            if valid is True:
                update = functools.partial(update, valid=True)
                state[channel] = _vmap(update, nbatch)(state[channel], event[channel])
            else:
                state[channel] = _vmap(update, nbatch)(state[channel], event[channel], valid)
        return state

    # -- the whole program ----------------------------------------------------------------

    def run(self, closed: Any, args: Sequence[Any]) -> tuple[list[Any], LogDict]:
        counts = self.count(closed)
        self._reductions = {}
        self._channels = {}
        for key in counts:
            info = self.info[key]
            reduction = self.policy.reduction(key, info.site_reduce(key))
            if not isinstance(reduction, str):  # "drop"
                self._reductions[key] = reduction
                step = reduction.step_reduction()
                self._channels[key] = {
                    "value": reduction,
                    **{f"step:{n}": step for n in info.steps},
                }
        states = {key: self._init(key, counts[key]) for key in self._reductions}
        outs, states = self.eval(closed, args, states)
        values, count, steps, names, rows = {}, {}, {}, {}, {}
        for key, state in states.items():
            name = self.policy.prefix + key
            nbatch = self.info[key].nbatch
            count[name] = state["count"]
            reduction = self._reductions[key]
            names[name] = type(reduction).__name__
            if reduction.event_axes:
                rows[name] = _vmap(reduction.rows, nbatch)(state["value"])
            for channel, reduction in self._channels[key].items():
                out = _vmap(reduction.finalize, nbatch)(state[channel])
                out = reduction.place_batch_axes(out, nbatch)
                if channel == "value":
                    values[name] = out
                else:
                    steps.setdefault(channel.removeprefix("step:"), {})[name] = out
        return outs, LogDict(values, count=count, steps=steps, reductions=names, rows=rows)

    def _init(self, key: str, bound: int | None) -> dict[str, Any]:
        info = self.info[key]
        if bound is not None:
            bound = math.ceil(bound / self.policy.interval)
        lane = {"value": info.lane_struct()}
        for name, s in info.steps.items():
            lane[f"step:{name}"] = jax.ShapeDtypeStruct(s.shape[info.nbatch :], s.dtype)
        batch = info.batch_shape()
        state = {"count": jnp.zeros(batch, jnp.int32)}
        if self.policy.interval > 1:
            state["seen"] = jnp.zeros(batch, jnp.int32)
        for channel, reduction in self._channels[key].items():
            try:
                lane_state = reduction.init(lane[channel], bound)
            except NeedsBound:
                raise ValueError(
                    f"eqx_logs.spool: key {key!r} is logged inside a `lax.while_loop` (at "
                    f"{_site_list(info.sites)}), so its number of events has no static bound and "
                    f"{type(reduction).__name__} cannot allocate its buffer without one. Pass a "
                    "capacity, e.g. `reduce=eqx_logs.Stack(capacity=N)` (keep='first' or 'last'), "
                    "or use a reduction of fixed size (mean, last, ...), or `lax.scan`/"
                    "`lax.fori_loop` with static bounds."
                ) from None
            state[channel] = jtu.tree_map(
                lambda x: jnp.broadcast_to(x, batch + jnp.shape(x)), lane_state
            )
        return state


def _vmap(fun: Callable, nbatch: int) -> Callable:
    """`fun` mapped over `nbatch` leading axes of all its arguments."""
    for _ in range(nbatch):
        fun = jax.vmap(fun)
    return fun
