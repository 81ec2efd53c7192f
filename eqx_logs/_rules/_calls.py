"""Calls: inlined (jit, closed_call, custom_vmap), rebuilt with jax.checkpoint (remat), or
bound as they are with their logs evaluated separately (`inline_copy_apply`, tap's remat)."""

import jax
from jax import lax

from .. import _compat
from .._primitive import is_log, log_effect
from ._table import register

# -- calls that are inlined: jit, closed_call -------------------------------------------------


def _call_count(plan, eqn):
    return plan.count(_compat.call_jaxpr(eqn))


def _inline_apply(interp, eqn, invals, states):
    return interp.eval(_compat.call_jaxpr(eqn), invals, states, settle=False)


register(_compat.INLINE_CALLS, _call_count, _inline_apply, straight=True)
register(_compat.CUSTOM_VMAP, _call_count, _inline_apply)


# -- checkpoint / remat: rebuilt with jax.checkpoint ------------------------------------------


def _remat_count(plan, eqn):
    with plan.recomputing(_compat.recomputes(eqn)):
        return plan.count(_compat.call_jaxpr(eqn))


def _remat_apply(interp, eqn, invals, states):
    closed = _compat.call_jaxpr(eqn)

    def body(args, sub):
        with interp.plan.recomputing(_compat.recomputes(eqn)):
            return interp.eval(closed, args, sub)

    remat = jax.checkpoint(body, **_compat.remat_options(eqn))
    handler = interp.handler
    outs, sub = remat(invals, handler.settle(states, handler.keys(closed)))
    return outs, {**states, **sub}


register(_compat.REMAT, _remat_count, _remat_apply, straight=True, recomputed=True)


# -- calls with their logs evaluated separately ----------------------------------------------
# The outputs come from the original call with its logs removed; the events come from
# evaluating its jaxpr again on stop-gradient inputs (XLA deduplicates straight-line copies,
# not loops). tap uses this for remat, whose body JAX recomputes in the backward pass.


def inline_copy_apply(interp, eqn, invals, states):
    outs = _compat.bind_eqn(_compat.strip_eqn(eqn, is_log, log_effect), invals)
    primal = [lax.stop_gradient(x) for x in invals]
    interp.lanes.give(primal, interp.lanes.of_each(invals))
    _, states = interp.eval(_compat.call_jaxpr(eqn), primal, states, settle=False)
    return outs, states
