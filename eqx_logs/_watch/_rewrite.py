"""The rewrite behind `watch`: the program traced to a jaxpr is evaluated again, equation by
equation, in a new trace; each watched output is logged after the equation that makes it, and
each loop, branch or call that contains something watched is rebuilt with JAX's public
constructors around its body evaluated the same way. The result is the program with `log`
calls in it, which a spool, a tap or a logger then consumes as any other (reductions,
interval, tags, lanes and devices apply). Nothing JAX created is mutated.

Addresses: each equation is `kind[j]`, `j` counting the equations of that kind (a primitive's
name, `scan`, `while`, `cond`, `shard_map`, ...) in the jaxpr it belongs to; inside a loop,
branch or shard_map, its address is that of the container then its own
(`while[0]/cholesky[1]`, `cond[0]/branch[1]/...`, a while loop's predicate
`while[0]/cond/...`). Calls (`jit`, `checkpoint`, custom derivatives) are transparent: what
they contain is counted with the jaxpr around them. A primitive's outputs are `kind[j]` (one)
or `kind[j]/i` (several); a loop's carry `kind[j]/carry/i`.

The same address names the same value whatever runs it: differentiated, a custom_vjp's
forward rule (another program) runs unwatched and its primal once more for the watched
values (`_custom_vjp`); a loop whose predicate a vmap batched logs each lane's carry for the
iterations that lane runs (`_while`).
"""

import collections
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import _compat
from .._primitive import (
    bind,
    current_prefix,
    grad_tap,
    is_log,
    is_sow,
    logging_as,
    masked_events,
    tracing_context,
)
from .._spelling import closest
from .._stats import CotangentStats, leaf_statistics, stats_p
from .._warn import warn_user
from ._spec import WATCH_TAG, Watch

LOOPS = (_compat.SCAN, _compat.WHILE)  # watched by their carries, at each iteration


def _transparent(eqn: _compat.JaxprEqn) -> bool:
    name = eqn.primitive.name
    return name in _compat.INLINE_CALLS or name in _compat.REMAT or name in _compat.CUSTOM_CALLS


def _backward(eqn: _compat.JaxprEqn) -> bool:
    return _compat.in_backward_pass(eqn) or (
        eqn.primitive.name in _compat.REMAT and _compat.recomputes(eqn)
    )


def _loggable(x: Any) -> bool:
    extended = jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) if eqx.is_array(x) else True
    return not extended and x.size > 0


def _depth(address: str) -> int:
    """The loops, branches and shard_maps around the value at `address` (its last part names
    the value, a branch is counted with its cond)."""
    parts = address.split("/")
    return sum(p.endswith("]") and not p.startswith("branch[") for p in parts[:-1])


class Watcher:
    """Evaluates a jaxpr in the current trace with the watched values logged."""

    def __init__(self, spec: Watch):
        self.spec = spec
        self.prefix = current_prefix()
        self.matched: set[str] = set()  # the names that matched an equation
        self.logged = False  # whether anything passed `where` and `max_depth`
        self.replaying = 0  # inside `replay`: the program's own logs are not bound again

    def watches(self, eqn: _compat.JaxprEqn) -> bool:
        """Whether `eqn`'s outputs (a loop's: its carry) are logged."""
        return eqn.primitive.name in self.spec.names

    def contains(self, closed: Any) -> bool:
        """Whether `closed` has an equation this watches, at any depth."""
        return _compat.any_eqn(closed, self.watches)

    def descends(self, eqn: _compat.JaxprEqn) -> bool:
        """Whether `eqn`'s jaxprs are evaluated here (rebuilt), not bound as they are."""
        if eqn.primitive.name in LOOPS and self.watches(eqn):
            return True  # its carry
        return any(self.contains(j) for j in _compat.sub_jaxprs(eqn.params))

    def eval(
        self,
        closed: Any,
        args: Sequence[Any],
        path: str,
        outer: tuple,
        counters: collections.Counter | None = None,
    ) -> list[Any]:
        """Evaluate `closed` on `args`, its equations addressed under `path` (`counters`: the
        enclosing jaxpr's, for a transparent call). `outer`: the equations around it."""
        jaxpr, consts = _compat.unpack(closed)
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        counters = collections.Counter() if counters is None else counters

        def read(v):
            return v.val if isinstance(v, _compat.Literal) else env[v]

        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(v) for v in eqn.invars], path, outer, counters)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, _compat.DropVar):
                    env[v] = x
        self.flush()
        return [read(v) for v in jaxpr.outvars]

    def replay(self, closed: Any, args: Sequence[Any], path: str, outer: tuple, counters) -> None:
        """Evaluate `closed` for its watched values alone: a computation the program runs
        another way (a custom_vjp's primal, where its forward rule runs), whose own logs
        and host callbacks (every equation without outputs) come from what runs."""
        self.replaying += 1
        try:
            self.eval(closed, args, path, outer, counters)
        finally:
            self.replaying -= 1

    def flush(self) -> None:
        """Before a nested jaxpr is evaluated, and at the end of one: a subclass that gathers
        values in a straight run of equations logs them here."""

    def equation(self, eqn, invals: list[Any], path: str, outer: tuple, counters) -> list[Any]:
        if self.replaying and not eqn.outvars:
            # (a log, a host callback: the computation that runs does it; what has no
            # output computes no watched value)
            return []
        if is_log(eqn) or is_sow(eqn) or eqn.primitive is stats_p:
            self.flush()  # (what was gathered comes before, in execution order)
            return _compat.bind_eqn(eqn, invals)  # eqx_logs' own: as it is
        if _backward(eqn) and not self.spec.backward:
            return _compat.bind_eqn(eqn, invals)
        name, watched = eqn.primitive.name, self.watches(eqn)
        inner = (*outer, eqn)
        rebuild = _rebuild_of(eqn)
        here = path
        if not _transparent(eqn) or watched:
            here = f"{path}{name}[{counters[name]}]"
            counters[name] += 1
        if rebuild is None or not self.descends(eqn):
            outs = _compat.bind_eqn(eqn, invals)
        else:
            self.flush()
            within = (path, counters) if _transparent(eqn) else (here + "/", None)
            outs = rebuild(self, eqn, invals, within[0], inner, within[1])
        if watched:
            self.matched.add(name)
            if name not in LOOPS:
                named = outs[0] if len(outs) == 1 else {str(i): x for i, x in enumerate(outs)}
                named = self.emit(here, named, eqn, outer)
                outs = [named] if len(outs) == 1 else [named[str(i)] for i in range(len(outs))]
        return outs

    def emit(self, address: str, values: Any, eqn, outer: tuple) -> Any:
        """Log `values` (an array, or a dict of them by name) at `address`; returns them (with
        the cotangent taps, if `grads`)."""
        key = f"{self.prefix}/watch/{address}" if self.prefix else f"watch/{address}"
        depth, site = _depth(address), None
        leaves = values if isinstance(values, dict) else {"": values}
        out = {}
        for name, x in leaves.items():
            where = f"{key}/{name}" if name else key
            if _loggable(x) and self.spec.selects(where, depth):
                site = site or _compat.eqn_location(eqn, outer)
                out[name] = self.log(where, x, site, eqn)
            else:
                out[name] = x
        return out if isinstance(values, dict) else out[""]

    def log(self, key: str, x: Any, site: str, eqn: _compat.JaxprEqn) -> Any:
        """Log `x` (or its statistics), an output of `eqn`, under `key`; returns it, with its
        cotangent tapped if `grads`."""
        spec = self.spec
        self.logged = True
        whole = spec.stats is None or x.size == 1
        items = {key: x} if whole else leaf_statistics(key, x, spec.stats, site)
        bind(items, {}, tags=(WATCH_TAG,), site=site, statistics=not whole)
        if spec.grads and jnp.issubdtype(x.dtype, jnp.inexact):
            stats = None if whole else spec.stats
            x = grad_tap(CotangentStats(f"{key}/grad", stats, site), site, x, (WATCH_TAG,))
        return x


def _rebuild_of(eqn) -> Any:
    name = eqn.primitive.name
    if name in _compat.INLINE_CALLS:
        return _inline
    if name in _compat.REMAT:
        return _remat
    return _REBUILD.get(name)


# -- rebuilding what contains watched equations, with JAX's public constructors -----------
# Each takes the watcher, the equation, its operands, the path of what it contains, the
# equations around that, and for a transparent call the enclosing jaxpr's counters.


def _inline(w: Watcher, eqn, invals, path: str, outer: tuple, counters) -> list[Any]:
    return w.eval(_compat.call_jaxpr(eqn), invals, path, outer, counters)


def _remat(w: Watcher, eqn, invals, path: str, outer: tuple, counters) -> list[Any]:
    body = _compat.call_jaxpr(eqn)

    def run(*xs):  # (traced once, now: the counters go on from the enclosing jaxpr's)
        return w.eval(body, xs, path, outer, counters)

    return list(jax.checkpoint(run, **_compat.remat_options(eqn))(*invals))


def _scan(w: Watcher, eqn, invals, path: str, outer: tuple, counters) -> list[Any]:
    body, num_consts, num_carry = _compat.scan_parts(eqn)
    consts, init = invals[:num_consts], invals[num_consts : num_consts + num_carry]
    xs = invals[num_consts + num_carry :]
    carried = w.watches(eqn)

    def step(carry, x):
        outs = w.eval(body, [*consts, *carry, *x], path, outer)
        carry = outs[:num_carry]
        if carried:
            carry = _carry(w, path, carry, eqn, outer)
        return carry, outs[num_carry:]

    carry, ys = jax.lax.scan(step, init, xs, **_compat.scan_options(eqn))
    return [*carry, *ys]


def _carry(w: Watcher, path: str, carry: list[Any], eqn, outer: tuple) -> list[Any]:
    named = w.emit(f"{path}carry", {str(i): x for i, x in enumerate(carry)}, eqn, outer)
    return [named[str(i)] for i in range(len(carry))]


def _while(w: Watcher, eqn, invals, path: str, outer: tuple, counters) -> list[Any]:
    cond, cond_n, body, body_n = _compat.while_parts(eqn)
    cond_consts, body_consts = invals[:cond_n], invals[cond_n : cond_n + body_n]
    carried = w.watches(eqn)
    lanes = len(_compat.unpack(cond)[0].outvars[0].aval.shape)

    def test(carry):
        return w.eval(cond, [*cond_consts, *carry], f"{path}cond/", outer)[0]

    if not lanes:

        def body_fun(carry):
            carry = w.eval(body, [*body_consts, *carry], path, outer)
            return _carry(w, path, carry, eqn, outer) if carried else carry

        return list(jax.lax.while_loop(test, body_fun, invals[cond_n + body_n :]))

    # A vmap batched the predicate (a `jax.vmap` inside the spool): JAX's batching rule leaves
    # a loop that runs while any lane's predicate holds, each carry leaf batched on the
    # predicate's axes and advanced where its lane's holds (as XLA lowers it). Rebuilt so,
    # each lane's carry logged for the iterations that lane runs, as if it ran alone.
    def lane_body(carry):
        pred = _bound(cond, [*cond_consts, *carry])[0]  # (watched in the test)
        new = w.eval(body, [*body_consts, *carry], path, outer)
        carry = [_where(pred, n, c) for n, c in zip(new, carry)]
        return _lane_carry(w, path, carry, pred, eqn, outer) if carried else carry

    init = invals[cond_n + body_n :]
    return list(jax.lax.while_loop(lambda c: jnp.any(test(c)), lane_body, init))


def _where(pred: Any, new: Any, old: Any) -> Any:
    """`new` in the lanes where `pred` (on the leading axes) holds, else `old`."""
    return jax.lax.select(jax.lax.broadcast_in_dim(pred, old.shape, range(pred.ndim)), new, old)


def _lane_carry(w: Watcher, path: str, carry: list[Any], pred: Any, eqn, outer) -> list[Any]:
    """`_carry` for each lane of the predicate's axes, its events kept where it holds."""

    def lane(p, *xs):
        with masked_events(p, None):
            return _carry(w, path, list(xs), eqn, outer)

    for _ in range(pred.ndim):
        lane = jax.vmap(lane)
    return list(lane(pred, *carry))


def _cond(w: Watcher, eqn, invals, path: str, outer: tuple, counters) -> list[Any]:
    def branch(b, closed):
        return lambda *ops: w.eval(closed, ops, f"{path}branch[{b}]/", outer)

    branches = [branch(b, closed) for b, closed in enumerate(_compat.cond_branches(eqn))]
    platforms = _compat.cond_platforms(eqn)
    return list(_compat.switch(invals[0], branches, *invals[1:], platforms=platforms))


def _custom_jvp(w: Watcher, eqn, invals, path: str, outer: tuple, counters) -> list[Any]:
    n, prefix = len(eqn.outvars), current_prefix()
    entry = collections.Counter(counters)  # the user's rule, traced later, is addressed alike

    def fun(args, extra):
        return w.eval(_compat.call_jaxpr(eqn), args, path, outer, counters)

    def rule(jvp_closed, primals, tangents, extra):
        outs = w.eval(jvp_closed, [*primals, *tangents], path, outer, collections.Counter(entry))
        return outs[:n], outs[n:], []

    return _compat.bind_custom_jvp(eqn, invals, [], fun, rule, lambda: logging_as(prefix))


def _custom_vjp(w: Watcher, eqn, invals, path: str, outer: tuple, counters) -> list[Any]:
    """The primal watched; differentiated, the forward rule runs as it is, and the primal
    once more for its watched values alone. The forward rule is another program: Equinox's
    checkpointed while loop (diffrax's default adjoint) runs a loop whose carry holds the
    primal's and the checkpoints', so its positions are not the addresses of the program
    the user traced (`while[0]/carry/3` would name a checkpoint counter)."""
    prefix = current_prefix()
    entry = collections.Counter(counters)
    primal = _compat.call_jaxpr(eqn)
    whole = eqn.params["num_consts"] == 0  # (the forward rule sees every primal input)

    def fun(args, extra):
        return w.eval(primal, args, path, outer, counters)

    def fwd(fwd_closed, args, extra):
        if not whole:  # (constants the forward rule does not see: watched in it, as it is)
            return w.eval(fwd_closed, args, path, outer, collections.Counter(entry)), []
        outs = _bound(fwd_closed, args)
        w.replay(primal, args, path, outer, collections.Counter(entry))
        return outs, []

    def bwd_context(*carried):
        return logging_as(prefix, enabled=None)

    return _compat.bind_custom_vjp(
        eqn, invals, [], fun, fwd, lambda: logging_as(prefix), bwd_context
    )


def _bound(closed: Any, args: Sequence[Any]) -> list[Any]:
    """`closed` evaluated on `args` in the current trace, each equation bound as it is."""
    jaxpr, consts = _compat.unpack(closed)
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))

    def read(v):
        return v.val if isinstance(v, _compat.Literal) else env[v]

    for eqn in jaxpr.eqns:
        outs = _compat.bind_eqn(eqn, [read(v) for v in eqn.invars])
        env.update((v, x) for v, x in zip(eqn.outvars, outs) if not isinstance(v, _compat.DropVar))
    return [read(v) for v in jaxpr.outvars]


def _shard_map(w: Watcher, eqn, invals, path: str, outer: tuple, counters) -> list[Any]:
    body, mesh, in_specs, out_specs, axes, check_vma = _compat.shard_map_parts(eqn)

    def per_device(*args):
        return tuple(w.eval(body, args, path, outer))

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names=frozenset(axes),
        check_vma=check_vma,
    )
    return list(run(*invals))


_REBUILD = {
    _compat.SCAN: _scan,
    _compat.WHILE: _while,
    _compat.COND: _cond,
    _compat.CUSTOM_JVP: _custom_jvp,
    _compat.CUSTOM_VJP: _custom_vjp,
    _compat.SHARD_MAP: _shard_map,
}


def watched(closed: Any, args: Sequence[Any], spec: Watch, where: str) -> Any:
    """`closed` (traced on `args`) with the values `spec` watches logged, as a new jaxpr.
    `where` names the caller in warnings (a name that matches nothing in the program is said,
    with the closest there)."""
    watcher = Watcher(spec)
    if watcher.contains(closed):
        closed = retraced(lambda *xs: watcher.eval(closed, xs, "", ()), args)
    _warn_unmatched(spec, watcher, closed, where)
    return closed


def retraced(run: Callable[..., list[Any]], args: Sequence[Any]) -> Any:
    """`run` traced to a jaxpr on `args`' types, with logging on."""
    with tracing_context(enabled=True):
        return jax.make_jaxpr(run)(*args)


def run_watched(closed: Any, args: Sequence[Any], spec: Watch, where: str) -> list[Any]:
    """`closed` evaluated on `args` in the current trace, the values `spec` watches logged
    (where a spool or tap is tracing)."""
    watcher = Watcher(spec)
    outs = watcher.eval(closed, args, "", ())
    _warn_unmatched(spec, watcher, closed, where)
    return outs


def _warn_unmatched(spec: Watch, watcher: Watcher, closed: Any, where: str) -> None:
    present = {e.primitive.name for e in _compat.eqns(closed)}
    calls = {
        e.params.get("name")
        for e in _compat.eqns(closed)
        if e.primitive.name in _compat.INLINE_CALLS
    }
    for name in spec.names:
        if name not in watcher.matched:
            near = closest(name, sorted(present))
            hint = f" (did you mean {near!r}?)" if near else ""
            if name in calls:
                hint = (
                    f" ({name!r} is a jitted function's name: calls are looked through, not "
                    "watched; watch the primitives or loops inside it, narrowed with where=)"
                )
            warn_user(
                f"{where}: watch={name!r} matches nothing in the program{hint}; the program "
                f"has {sorted(present)}."
            )
    if (
        watcher.matched
        and not watcher.logged
        and (spec.where is not None or spec.max_depth is not None)
    ):
        warn_user(
            f"{where}: the watched {sorted(watcher.matched)} are found, but none at an address "
            f"that where={spec.where!r} and max_depth={spec.max_depth!r} keep."
        )
