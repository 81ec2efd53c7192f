"""tap's scans split at trace time (`peeled_scan`): with `interval=k`, where each iteration
logs each of the scan's groups of keys exactly once, unconditionally, and the counters are
known on entry, the scan becomes [quiet iterations] + blocks of [one iteration with its event,
k - 1 quiet iterations] + [a last partial block]: the skipped iterations compile without the
logged computation at all."""

from typing import Any

import jax.numpy as jnp
from jax import lax

from .. import _compat
from .._interpret import INTERVAL_STEP, keys_of
from .._primitive import is_log
from .._rules import split_at
from ._blocks import BLOCK


def _groups_of(tap: Any, eqn: Any) -> list[str]:
    keys = keys_of(eqn)
    return list(dict.fromkeys(tap._group[k] for k in keys if k in tap._kept))


def _per_iteration(tap: Any, closed: Any, stepped: bool = False) -> dict[str, int] | None:
    """How often each counter advances in one evaluation of `closed`, if that is the same
    every time (no conditional or masked events, nor events kept by their step unless
    `stepped`: with `interval=1` a step keeps nothing); else None."""
    plan = tap.interp.plan
    total: dict[str, int] = {}
    for eqn in _compat.unpack(closed)[0].eqns:
        if is_log(eqn):
            if not plan.selects(eqn.params["tags"]):
                continue
            groups = _groups_of(tap, eqn)
            by_step = INTERVAL_STEP in eqn.params["steps"] and not stepped
            if groups and (eqn.params["masked"] or by_step):
                return None  # conditional, or kept by its step value
            for g in groups:
                total[g] = total.get(g, 0) + 1
        elif plan.eqn_has_log(eqn):
            rule = plan.rule(eqn)
            if rule.straight:
                sub = _per_iteration(tap, _compat.call_jaxpr(eqn), stepped)
                if sub is None:
                    return None
                for g, n in sub.items():
                    total[g] = total.get(g, 0) + n
            elif any(k in tap._kept for k in rule.count(plan, eqn)):
                return None
    return total


def peeled_scan(tap: Any, eqn: Any, invals: list[Any], states: dict[str, Any]) -> Any:
    """Evaluate a scan as [quiet iterations] + blocks of [one iteration with its event,
    `interval - 1` quiet iterations] + [a last partial block], when the event each
    iteration makes is known at trace time to be kept or skipped. None if not applicable."""
    interp = tap.interp
    period = interp.policy.interval
    if tap._silent or tap.blocks is not None:
        return None
    body, num_consts, num_carry = _compat.scan_parts(eqn)
    options = _compat.scan_options(eqn)
    groups = tap.keys(body)
    length = options["length"]
    if period == 1 or options["reverse"] or not groups or not isinstance(length, int):
        return None  # (a symbolic length, under jax.export, is not split)
    if not length:
        return None
    if any(not isinstance(states[g], int) for g in groups):
        return None
    if len({states[g] % period for g in groups}) != 1:
        return None
    if _per_iteration(tap, body) != dict.fromkeys(groups, 1):
        return None
    unroll = options["unroll"]
    consts, carry, xs = split_at(invals, num_consts, num_carry)
    head = min(-states[groups[0]] % period, length)
    blocks = (length - head) // period
    tail = length - head - blocks * period
    kept_now = dict.fromkeys(groups, 0)  # a counter at 0: this iteration's event is kept

    def loud(carry, x):
        outs, _ = interp.eval(body, [*consts, *carry, *x], kept_now)
        return outs[:num_carry], outs[num_carry:]

    def quiet(carry, xs_part, n):
        def step(carry, x):
            outs, _ = interp.eval(body, [*consts, *carry, *x], dict.fromkeys(groups, 0))
            return outs[:num_carry], outs[num_carry:]

        tap._silent, silent = True, tap._silent
        try:
            return lax.scan(step, carry, xs_part, length=n, unroll=unroll)
        finally:
            tap._silent = silent

    def block(carry_index, xs_block):
        carry, index = carry_index
        tap._loop_tokens.append(index)
        try:
            carry, y = loud(carry, [x[0] for x in xs_block])
        finally:
            tap._loop_tokens.pop()
        carry, ys = quiet(carry, [x[1:] for x in xs_block], period - 1)
        return (carry, index + 1), [jnp.concatenate([a[None], b]) for a, b in zip(y, ys)]

    pieces = []
    if head:
        carry, ys = quiet(carry, [x[:head] for x in xs], head)
        pieces.append(ys)
    if blocks:
        start, stop = head, head + blocks * period
        shaped = [x[start:stop].reshape((blocks, period) + x.shape[1:]) for x in xs]
        (carry, _), ys = lax.scan(block, (carry, jnp.int32(0)), shaped, length=blocks)
        pieces.append([y.reshape((blocks * period,) + y.shape[2:]) for y in ys])
    if tail:
        rest = [x[length - tail :] for x in xs]
        carry, y = loud(carry, [x[0] for x in rest])
        pieces.append([a[None] for a in y])
        if tail > 1:
            carry, ys = quiet(carry, [x[1:] for x in rest], tail - 1)
            pieces.append(ys)
    ys = [jnp.concatenate(parts) for parts in zip(*pieces)] if pieces else []
    states = {**states, **{g: states[g] + length for g in groups}}
    return [*carry, *ys], states


def blocked_scan(tap: Any, eqn: Any, invals: list[Any], states: dict[str, Any]) -> Any:
    """With `buffer=k` (`_blocks.py`), a scan whose body logs each of its groups of keys
    exactly once per iteration, unconditionally, entered with the same known `fill` in every
    group's block: evaluated as [the iterations that complete the current block] + an outer
    scan over whole blocks, each an inner scan returning its events as `ys` and one callback
    + [a last partial block]. No iteration carries a block or tests whether it is full. None
    if not applicable (then each event is written into the carried block)."""
    interp, blocks = tap.interp, tap.blocks
    if tap._silent or interp.policy.interval != 1 or tap._guards or interp.lanes.guards:
        return None
    body, num_consts, num_carry = _compat.scan_parts(eqn)
    options = _compat.scan_options(eqn)
    groups = [g for g in tap.keys(body) if not g.endswith(BLOCK)]
    length = options["length"]
    if options["reverse"] or not groups or not isinstance(length, int) or not length:
        return None
    fills = [states[g + BLOCK]["fill"] for g in groups]
    if not all(isinstance(f, int) for f in fills) or len(set(fills)) != 1:
        return None
    fill = fills[0]
    if _per_iteration(tap, body, stepped=True) != dict.fromkeys(groups, 1):
        return None
    size, unroll = blocks.size, options["unroll"]
    consts, carry, xs = split_at(invals, num_consts, num_carry)

    def run(carry, xs_part, n):
        """`n` iterations: the carry, and the `ys` and each group's rows, stacked."""

        def step(carry, x):
            outer, blocks.streaming = blocks.streaming, {}
            try:
                outs, _ = interp.eval(body, [*consts, *carry, *x], dict.fromkeys(groups, 0))
                rows = blocks.streaming
            finally:
                blocks.streaming = outer
            return outs[:num_carry], (outs[num_carry:], rows)

        return lax.scan(step, carry, xs_part, length=n, unroll=unroll)

    states = dict(states)
    pieces, done = [], 0

    def into_blocks(rows, n):  # rows of n iterations, written from `fill` on
        nonlocal fill
        for g in groups:
            states[g + BLOCK] = blocks.put(states[g + BLOCK], rows[g], fill, one=False)
        fill += n
        if fill == size:
            for g in groups:
                blocks.send(g, states[g + BLOCK], size, None, [tap._lanes])
            fill = 0

    head = min(size - fill, length) if fill else 0
    if head:
        carry, (ys, rows) = run(carry, [x[:head] for x in xs], head)
        into_blocks(rows, head)
        pieces.append(ys)
        done = head
    whole = (length - done) // size
    if whole:

        def outer(carry_index, xs_block):
            carry, index = carry_index
            carry, (ys, rows) = run(carry, xs_block, size)
            for g in groups:  # (the index: an operand that changes in every iteration)
                blocks.send(g, rows[g], size, None, [index, tap._lanes])
            return (carry, index + 1), ys

        shaped = [x[done : done + whole * size].reshape((whole, size) + x.shape[1:]) for x in xs]
        (carry, _), ys = lax.scan(outer, (carry, jnp.int32(0)), shaped, length=whole)
        pieces.append([y.reshape((whole * size,) + y.shape[2:]) for y in ys])
        done += whole * size
    if done < length:
        carry, (ys, rows) = run(carry, [x[done:] for x in xs], length - done)
        into_blocks(rows, length - done)
        pieces.append(ys)
    ys = [jnp.concatenate(parts) for parts in zip(*pieces)] if pieces else []
    for g in groups:
        states[g] = states[g] + length
        states[g + BLOCK] = {**states[g + BLOCK], "fill": fill}
    return [*carry, *ys], states
