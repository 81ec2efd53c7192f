"""tap's scans split at trace time (`ScanSplit`), where each iteration logs each of the scan's
groups of keys exactly once, unconditionally: into a first run of iterations, an outer scan over
whole parts of k iterations, and a last run. Two modes:

- `peeled`, with `interval=k` and the counters known on entry: [quiet iterations] + parts of
  [one iteration with its event, k - 1 quiet iterations] + [a last partial part]: the skipped
  iterations compile without the logged computation at all;
- `blocked`, with `buffer=k` (`_blocks.py`): [the iterations that complete the current block]
  + parts that each return their events as `ys` and send them in one callback + [a last
  partial block]: no iteration carries a block or tests whether it is full.
"""

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

from .. import _compat
from .._interpret import INTERVAL_STEP, keys_of
from .._rules import split_at
from ._blocks import BLOCK


def _per_iteration(tap: Any, closed: Any, stepped: bool = False) -> dict[str, int] | None:
    """How often each counter advances in one evaluation of `closed`, if that is the same
    every time (no conditional or masked events, nor events kept by their step unless
    `stepped`: with `interval=1` a step keeps nothing); else None."""
    plan = tap.interp.plan
    total: dict[str, int] = {}
    for eqn, logs in plan.logging(closed):
        if logs:
            groups = tap.groups_of(keys_of(eqn))
            by_step = INTERVAL_STEP in eqn.params["steps"] and not stepped
            if groups and (eqn.params["masked"] or by_step):
                return None  # conditional, or kept by its step value
            for g in groups:
                total[g] = total.get(g, 0) + 1
        else:
            rule = plan.rule(eqn)
            if rule.straight:
                sub = _per_iteration(tap, _compat.call_jaxpr(eqn), stepped)
                if sub is None:
                    return None
                for g, n in sub.items():
                    total[g] = total.get(g, 0) + n
            elif tap.groups_of(rule.count(plan, eqn)):
                return None
    return total


class ScanSplit:
    """A scan of `tap`'s (the equation `eqn`, its operands `invals`), split at trace time in
    one of the two modes (see above): calling it returns `(outs, states)`, or None where
    neither mode applies (then the scan's rule evaluates it)."""

    def __init__(self, tap: Any, eqn: Any, invals: list[Any]):
        self.tap, self.interp = tap, tap.interp
        self.body, num_consts, self.num_carry = _compat.scan_parts(eqn)
        options = _compat.scan_options(eqn)
        self.length, self.reverse = options["length"], options["reverse"]
        self.unroll = options["unroll"]
        self.consts, self.carry, self.xs = split_at(invals, num_consts, self.num_carry)

    def __call__(self, states: dict[str, Any]) -> Any:
        split = self.peeled(states)
        if split is None and self.tap.blocks is not None:
            split = self.blocked(states)
        return split

    def once_each(self, groups: list[str], stepped: bool = False) -> bool:
        """Whether the scan runs forward, its length known and not zero, and its body logs
        each of `groups` exactly once per iteration, unconditionally (`_per_iteration`), and
        records no iteration's index (JAX's backward-pass logs: see `_rules/_loops.py`)."""
        length = self.length
        if self.reverse or not groups or not isinstance(length, int) or not length:
            return False  # (a symbolic length, under jax.export, is not split)
        if self.interp.plan.fills_iteration(self.body):
            return False
        return _per_iteration(self.tap, self.body, stepped) == dict.fromkeys(groups, 1)

    def iteration(self, carry: Any, x: Any, counters: dict[str, Any]) -> tuple[Any, Any]:
        """One iteration of the body, entered with `counters`: its carry and its `ys`."""
        outs, _ = self.interp.eval(self.body, [*self.consts, *carry, *x], counters)
        return outs[: self.num_carry], outs[self.num_carry :]

    def split(self, head: int, size: int, first: Callable, part: Callable, rest: Callable):
        """The scan's outputs (its carry, then its `ys`) from `first(carry, xs, n)` over its
        first `head` iterations, an outer `lax.scan` of `part((carry, index), xs)` over whole
        parts of `size` iterations, and `rest(carry, xs, n)` over the others. `first` and
        `rest` return the carry and a list of pieces of the `ys`."""
        carry, xs, length = self.carry, self.xs, self.length
        pieces = []
        if head:
            carry, ys = first(carry, [x[:head] for x in xs], head)
            pieces.extend(ys)
        whole = (length - head) // size
        if whole:
            shaped = [
                x[head : head + whole * size].reshape((whole, size) + x.shape[1:]) for x in xs
            ]
            (carry, _), ys = lax.scan(part, (carry, jnp.int32(0)), shaped, length=whole)
            pieces.append([y.reshape((whole * size,) + y.shape[2:]) for y in ys])
        done = head + whole * size
        if done < length:
            carry, ys = rest(carry, [x[done:] for x in xs], length - done)
            pieces.extend(ys)
        ys = [jnp.concatenate(parts) for parts in zip(*pieces)] if pieces else []
        return [*carry, *ys]

    def peeled(self, states: dict[str, Any]) -> Any:
        """With `interval=k`, counters known on entry, all at the same point of the period:
        [quiet iterations] + parts of [one iteration with its event, `k - 1` quiet iterations]
        + [a last partial part]. None if not applicable."""
        tap, period = self.tap, self.interp.policy.interval
        if not tap.unconditional or tap.blocks is not None or period == 1:
            return None
        groups = list(tap.keys(self.body))
        if not self.once_each(groups) or any(not isinstance(states[g], int) for g in groups):
            return None
        if len({states[g] % period for g in groups}) != 1:
            return None
        kept_now = dict.fromkeys(groups, 0)  # a counter at 0: this iteration's event is kept

        def quiet(carry, xs_part, n):
            def step(carry, x):
                return self.iteration(carry, x, dict.fromkeys(groups, 0))

            with tap.quiet():
                return lax.scan(step, carry, xs_part, length=n, unroll=self.unroll)

        def part(carry_index, xs_part):
            carry, index = carry_index
            with tap.iteration_token(index):
                carry, y = self.iteration(carry, [x[0] for x in xs_part], kept_now)
            carry, ys = quiet(carry, [x[1:] for x in xs_part], period - 1)
            return (carry, index + 1), [jnp.concatenate([a[None], b]) for a, b in zip(y, ys)]

        def first(carry, xs_part, n):
            carry, ys = quiet(carry, xs_part, n)
            return carry, [ys]

        def rest(carry, xs_part, n):
            carry, y = self.iteration(carry, [x[0] for x in xs_part], kept_now)
            pieces = [[a[None] for a in y]]
            if n > 1:
                carry, ys = quiet(carry, [x[1:] for x in xs_part], n - 1)
                pieces.append(ys)
            return carry, pieces

        head = min(-states[groups[0]] % period, self.length)
        outs = self.split(head, period, first, part, rest)
        return outs, {**states, **{g: states[g] + self.length for g in groups}}

    def blocked(self, states: dict[str, Any]) -> Any:
        """With `buffer=k`, entered with the same known `fill` in every group's block:
        [the iterations that complete the current block] + parts of a whole block, each an
        inner scan returning its events as `ys` and one callback + [a last partial block].
        None if not applicable (then each event is written into the carried block)."""
        tap, interp, blocks = self.tap, self.interp, self.tap.blocks
        if not tap.unconditional or interp.policy.interval != 1 or interp.lanes.guards:
            return None
        groups = [g for g in tap.keys(self.body) if not g.endswith(BLOCK)]
        fills = [states[g + BLOCK]["fill"] for g in groups]
        if not all(isinstance(f, int) for f in fills) or len(set(fills)) != 1:
            return None
        if not self.once_each(groups, stepped=True):
            return None
        size, fill, states = blocks.size, fills[0], dict(states)

        def run(carry, xs_part, n):
            """`n` iterations: the carry, and the `ys` and each group's rows, stacked."""

            def step(carry, x):
                outer, blocks.streaming = blocks.streaming, {}
                try:
                    carry, ys = self.iteration(carry, x, dict.fromkeys(groups, 0))
                    rows = blocks.streaming
                finally:
                    blocks.streaming = outer
                return carry, (ys, rows)

            return lax.scan(step, carry, xs_part, length=n, unroll=self.unroll)

        def into_blocks(carry, xs_part, n):  # rows of n iterations, written from `fill` on
            nonlocal fill
            carry, (ys, rows) = run(carry, xs_part, n)
            for g in groups:
                states[g + BLOCK] = blocks.put(states[g + BLOCK], rows[g], fill, one=False)
            fill += n
            if fill == size:
                for g in groups:
                    blocks.send(g, states[g + BLOCK], size, None, [tap.lanes])
                fill = 0
            return carry, [ys]

        def part(carry_index, xs_part):
            carry, index = carry_index
            carry, (ys, rows) = run(carry, xs_part, size)
            for g in groups:  # (the index: an operand that changes in every iteration)
                blocks.send(g, rows[g], size, None, [index, tap.lanes])
            return (carry, index + 1), ys

        head = min(size - fill, self.length) if fill else 0
        outs = self.split(head, size, into_blocks, part, into_blocks)
        for g in groups:
            states[g] = states[g] + self.length
            states[g + BLOCK] = {**states[g + BLOCK], "fill": fill}
        return outs, states
