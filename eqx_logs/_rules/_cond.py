"""cond / switch (and `lax.platform_dependent`): every branch threads all the states of all
branches."""

import functools

import jax.numpy as jnp

from .. import _compat
from .._interpret import max_counts
from ._table import register


def _cond_count(plan, eqn):
    return max_counts([plan.count(b) for b in _compat.cond_branches(eqn)])


def _cond_apply(interp, eqn, invals, states):
    branches = _compat.cond_branches(eqn)
    index, *ops = invals
    keys = dict.fromkeys(k for b in branches for k in interp.handler.keys(b))

    lane = interp.lanes.of(index)

    def make(i, branch):
        def run(ops, lanes, sub):
            # taken by a lane alone where its lane index says so and its operands are its own
            live = [interp.lanes.in_step(ops, lanes), None if lane is None else lane == i]
            live = [x for x in live if x is not None]
            live = functools.reduce(jnp.logical_and, live) if live else None
            interp.lanes.give(ops, lanes)
            with interp.guard(lambda: index == i, live):
                return interp.eval(branch, ops, sub)

        return run

    runs = [make(i, b) for i, b in enumerate(branches)]
    lanes, sub = interp.lanes.of_each(ops), interp.handler.settle(states, keys)
    # (a `lax.platform_dependent` stays one: lowered, it keeps its platform's branch alone)
    platforms = _compat.cond_platforms(eqn)
    outs, sub = _compat.switch(index, runs, ops, lanes, sub, platforms=platforms)
    return outs, {**states, **sub}


register(_compat.COND, _cond_count, _cond_apply)
