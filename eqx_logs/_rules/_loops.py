"""Loops: scan and while, the states riding in the carry."""

import contextlib

import jax.numpy as jnp
from jax import lax

from .. import _compat, _lanes
from .._interpret import Stream, unbounded
from ._table import register, split_at

# -- scan: states ride in the carry -----------------------------------------------------------


def _scan_count(plan, eqn):
    body, _, _ = _compat.scan_parts(eqn)
    length = _compat.scan_options(eqn)["length"]
    per_iteration = plan.count(body)
    plan.note_iteration(per_iteration)
    return {k: None if n is None else n * length for k, n in per_iteration.items()}


def _scan_apply(interp, eqn, invals, states):
    body, num_consts, num_carry = _compat.scan_parts(eqn)
    consts, init, xs = split_at(invals, num_consts, num_carry)
    options = _compat.scan_options(eqn)
    handler = interp.handler
    # keys whose events leave as `ys` (`Handler.streamed`), the others ride in the carry
    init_lanes = interp.lanes.of_each(init)
    stream = Stream() if init_lanes else handler.streamed(body, options["length"])
    carried = [k for k in handler.keys(body) if k not in stream.keys]
    # the iteration's index, where JAX's backward-pass logs inside record it (`in_iteration`)
    indexed = interp.plan.fills_iteration(body)
    if indexed:
        xs = [*xs, jnp.arange(options["length"], dtype=jnp.int32)]

    def step(carry, x):
        values, lanes, sub = carry
        live = interp.lanes.in_step(values, lanes)  # see _while_apply
        interp.lanes.give(values, lanes)
        sub = stream.start(handler.iteration(sub))
        x, index = (x[:-1], x[-1]) if indexed else (x, None)
        with contextlib.ExitStack() as context:
            if lanes:
                context.enter_context(interp.guard(lambda: live, live))
            if indexed:
                context.enter_context(interp.in_iteration(index))
            outs, sub = interp.eval(body, [*consts, *values, *x], sub, settle=False)
        sub, events = stream.take(sub)
        values = outs[:num_carry]
        new_lanes = interp.lanes.like(values, lanes)
        lanes = {i: jnp.where(live, new_lanes[i], x) for i, x in lanes.items()}
        return (values, interp.lanes.carried(values, lanes), handler.settle(sub)), (
            outs[num_carry:],
            events,
        )

    states = handler.entering_loop(states)
    carry = (init, interp.lanes.carried(init, init_lanes), handler.settle(states, carried))
    if xs:  # inferred from xs: a symbolic length (jax.export) cannot be passed explicitly
        options["length"] = None
    with handler.loop():
        (values, lanes, sub), (ys, events) = lax.scan(step, carry, xs, **options)
    interp.lanes.give(values, lanes)
    states = stream.add({**states, **sub}, events, options["reverse"])
    return [*values, *ys], states


register(_compat.SCAN, _scan_count, _scan_apply, scan=True)


# -- while: states ride in the carry; logs in cond_fun run before each test --------------------


def _while_count(plan, eqn):
    cond, _, body, _ = _compat.while_parts(eqn)
    return unbounded({**plan.count(cond), **plan.count(body)})


def _while_apply(interp, eqn, invals, states):
    cond, cond_nconsts, body, body_nconsts = _compat.while_parts(eqn)
    cond_consts, body_consts, init = split_at(invals, cond_nconsts, body_nconsts)
    handler = interp.handler
    keys = dict.fromkeys([*handler.keys(cond), *handler.keys(body)])
    # carried values with a lane value (`_lanes.py`) carry it along, as an extra carry
    init_lanes = interp.lanes.of_each(init)

    def test(values, lanes, sub):
        interp.lanes.give(values, lanes)
        (pred,), sub = interp.eval(cond, [*cond_consts, *values], sub)
        return pred, sub

    def advance(values, lanes, sub):
        interp.lanes.give(values, lanes)
        values, sub = interp.eval(body, [*body_consts, *values], handler.iteration(sub))
        return values, interp.lanes.like(values, lanes), sub

    sub = handler.settle(handler.entering_loop(states), keys)
    with handler.loop():
        return _while_loop(interp, eqn, states, sub, init, init_lanes, test, advance)


def _while_loop(interp, eqn, states, sub, init, init_lanes, test, advance):
    """The loop of `_while_apply`, built inside `Handler.loop()`."""
    cond = _compat.while_parts(eqn)[0]
    guarded = interp.handler.tracks_guards or init_lanes or _lanes.has_lanes(cond)
    if not interp.plan.has_log(cond) and not guarded:
        values, _, sub = lax.while_loop(
            lambda c: test(c[0], {}, {})[0], lambda c: advance(*c), (init, {}, sub)
        )
        return values, {**states, **sub}

    # An iteration runs for a lane alone where the lane value of the test that admitted it
    # holds and the carried control values agree with the lane's own (`in_step`); only then
    # do those advance.
    def live_in(values, lanes, lane):
        step = interp.lanes.in_step(values, lanes)
        return lane if step is None else step if lane is None else jnp.logical_and(lane, step)

    init_lanes = interp.lanes.carried(init, init_lanes)
    if not interp.plan.has_log(cond):
        # the loop as it was; the body evaluates the test again for its lane value (without a
        # vmap that is dead code, see `_lanes.shadow`)
        def plain_body(carry):
            values, lanes, sub = carry
            pred, _ = test(values, lanes, {})
            live = live_in(values, lanes, interp.lanes.of(pred))
            with interp.guard(lambda: pred, live):
                values, new_lanes, sub = advance(values, lanes, sub)
            lanes = {i: jnp.where(live, new_lanes[i], x) for i, x in lanes.items()}
            return values, interp.lanes.carried(values, lanes), sub

        carry = (init, init_lanes, sub)
        values, lanes, sub = lax.while_loop(lambda c: test(*c)[0], plain_body, carry)
        interp.lanes.give(values, lanes)
        return values, {**states, **sub}

    # cond_fun logs and runs once more than the body: test, (body, test)*. The predicate (and
    # its lane value) rides in the carry, so each iteration knows the test that admitted it.
    pred, sub = test(init, init_lanes, sub)

    def loop_body(carry):
        values, lanes, sub, pred, lane = carry
        live = live_in(values, lanes, lane)
        with interp.guard(lambda: pred, live):
            values, new_lanes, sub = advance(values, lanes, sub)
            lanes = {i: jnp.where(live, new_lanes[i], x) for i, x in lanes.items()}
            pred, sub = test(values, lanes, sub)
        return values, interp.lanes.carried(values, lanes), sub, pred, interp.lanes.of(pred)

    carry = (init, init_lanes, sub, pred, interp.lanes.of(pred))
    values, lanes, sub, _, _ = lax.while_loop(lambda c: c[3], loop_body, carry)
    interp.lanes.give(values, lanes)
    return values, {**states, **sub}


register(_compat.WHILE, _while_count, _while_apply)
