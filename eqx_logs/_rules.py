"""One rule per higher-order primitive: how spool counts and evaluates its logs.

A rule has two functions:

- `count(interp, eqn) -> Counts`: the static bound on events per key inside the equation;
- `apply(interp, eqn, invals, states) -> (outs, states)`: evaluate the equation in the current
  trace, rebuilt with JAX's public constructors (`lax.scan`, `lax.while_loop`, `lax.switch`,
  `jax.checkpoint`) and with the reduction states of its keys threaded through.

To support a new primitive, write these two functions and `register` them under its name.
"""

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
from jax import lax

from . import _compat
from ._interpret import Counts, Interpreter, max_counts, unbounded
from ._primitive import is_log, log_effect


class Rule(NamedTuple):
    count: Callable[[Interpreter, Any], Counts]
    apply: Callable[[Interpreter, Any, list, dict], tuple[list, dict]]


RULES: dict[str, Rule] = {}


def register(names: str | Iterable[str], count, apply) -> None:
    for name in [names] if isinstance(names, str) else names:
        RULES[name] = Rule(count, apply)


def _split(xs, *sizes):
    out, start = [], 0
    for n in sizes:
        out.append(list(xs[start : start + n]))
        start += n
    out.append(list(xs[start:]))
    return out


def _only(states: dict, keys: Iterable[str]) -> dict:
    return {k: states[k] for k in keys}


# -- calls that are inlined: jit, closed_call -------------------------------------------------


def _call_count(interp, eqn):
    return interp.count(_compat.call_jaxpr(eqn))


def _inline_apply(interp, eqn, invals, states):
    return interp.eval(_compat.call_jaxpr(eqn), invals, states)


register(_compat.INLINE_CALLS, _call_count, _inline_apply)


# -- checkpoint / remat: rebuilt with jax.checkpoint ------------------------------------------


def _remat_apply(interp, eqn, invals, states):
    closed = _compat.call_jaxpr(eqn)

    def body(args, sub):
        return interp.eval(closed, args, sub)

    remat = jax.checkpoint(body, **_compat.remat_options(eqn))
    outs, sub = remat(invals, _only(states, interp.keys(closed)))
    return outs, {**states, **sub}


register(_compat.REMAT, _call_count, _remat_apply)


# -- custom_jvp / custom_vjp --------------------------------------------------------------------
# The outputs come from the original custom call with its logs removed, so derivatives still
# use the user's rule; the events come from evaluating the primal jaxpr on stop-gradient inputs
# (XLA deduplicates the two copies of the primal computation).


def _custom_apply(interp, eqn, invals, states):
    outs = _compat.bind_eqn(_compat.strip_eqn(eqn, is_log, log_effect), invals)
    primal = [lax.stop_gradient(x) for x in invals]
    _, states = interp.eval(_compat.call_jaxpr(eqn), primal, states)
    return outs, states


register([_compat.CUSTOM_JVP, *_compat.CUSTOM_VJP], _call_count, _custom_apply)


# -- scan: states ride in the carry -----------------------------------------------------------


def _scan_count(interp, eqn):
    body, _, _ = _compat.scan_parts(eqn)
    length = _compat.scan_options(eqn)["length"]
    return {k: None if n is None else n * length for k, n in interp.count(body).items()}


def _scan_apply(interp, eqn, invals, states):
    body, num_consts, num_carry = _compat.scan_parts(eqn)
    consts, init, xs = _split(invals, num_consts, num_carry)

    def step(carry, x):
        values, sub = carry
        outs, sub = interp.eval(body, [*consts, *values, *x], sub)
        return (outs[:num_carry], sub), outs[num_carry:]

    init_sub = _only(states, interp.keys(body))
    (values, sub), ys = lax.scan(step, (init, init_sub), xs, **_compat.scan_options(eqn))
    return [*values, *ys], {**states, **sub}


register(_compat.SCAN, _scan_count, _scan_apply)


# -- while: states ride in the carry; logs in cond_fun run before each test --------------------


def _while_count(interp, eqn):
    cond, _, body, _ = _compat.while_parts(eqn)
    return unbounded({**interp.count(cond), **interp.count(body)})


def _while_apply(interp, eqn, invals, states):
    cond, cond_nconsts, body, body_nconsts = _compat.while_parts(eqn)
    cond_consts, body_consts, init = _split(invals, cond_nconsts, body_nconsts)
    keys = dict.fromkeys([*interp.keys(cond), *interp.keys(body)])

    def test(values, sub):
        (pred,), sub = interp.eval(cond, [*cond_consts, *values], sub)
        return pred, sub

    def advance(values, sub):
        return interp.eval(body, [*body_consts, *values], sub)

    sub = _only(states, keys)
    if not interp.has_log(cond) and not interp.tracks_guards:
        values, sub = lax.while_loop(
            lambda c: test(c[0], {})[0], lambda c: advance(*c), (init, sub)
        )
    else:
        # cond_fun runs once more than the body: test, (body, test)*. The predicate rides in
        # the carry, so each iteration knows the test that admitted it (its guard).
        pred, sub = test(init, sub)

        def loop_body(carry):
            values, sub, pred = carry
            with interp.guard(lambda: pred):
                values, sub = advance(values, sub)
                pred, sub = test(values, sub)
            return values, sub, pred

        values, sub, _ = lax.while_loop(lambda c: c[2], loop_body, (init, sub, pred))
    return values, {**states, **sub}


register(_compat.WHILE, _while_count, _while_apply)


# -- cond / switch: every branch threads all the states of all branches -------------------------


def _cond_count(interp, eqn):
    return max_counts([interp.count(b) for b in _compat.cond_branches(eqn)])


def _cond_apply(interp, eqn, invals, states):
    branches = _compat.cond_branches(eqn)
    index, *ops = invals
    keys = dict.fromkeys(k for b in branches for k in interp.keys(b))

    def make(i, branch):
        def run(ops, sub):
            with interp.guard(lambda: index == i):
                return interp.eval(branch, ops, sub)

        return run

    outs, sub = lax.switch(
        index, [make(i, b) for i, b in enumerate(branches)], ops, _only(states, keys)
    )
    return outs, {**states, **sub}


register(_compat.COND, _cond_count, _cond_apply)
