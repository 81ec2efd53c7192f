"""Solves: custom_linear_solve, Equinox's opaque primitives (lineax's linear_solve) and the
hi primitives of jax >= 0.12 (lax.custom_root)."""

import jax
import jax.numpy as jnp
from jax import lax

from .. import _compat
from .._primitive import current_prefix, is_log, log_effect, logging_as
from ._table import register

# -- custom_linear_solve: rebuilt with the states as the solve's auxiliary output ---------------
# `lax.custom_linear_solve` (and so `jax.scipy.sparse.linalg.cg`, `gmres`, `bicgstab`) runs its
# `solve` jaxpr forward; its other jaxprs serve derivatives. The states ride out of `solve` as
# its auxiliary data (`has_aux`), so the solve runs once and its derivatives stay implicit.
# Logs in `matvec` as derivatives re-run it (not the forward solve) are removed.


def _linear_solve_count(plan, eqn):
    jaxprs, _, _ = _compat.linear_solve_parts(eqn)
    return plan.count(jaxprs["solve"])


def _linear_solve_apply(interp, eqn, invals, states):
    jaxprs, positions, num_consts = _compat.linear_solve_parts(eqn)
    consts = {name: [invals[i] for i in idx] for name, idx in positions.items()}
    b = list(invals[num_consts:])
    sub = interp.handler.settle(states, interp.handler.keys(jaxprs["solve"]))

    def run(name, args):
        closed = _compat.strip_jaxpr(jaxprs[name], is_log, log_effect)
        return interp.eval(closed, [*consts[name], *args], {})[0]

    def solve(matvec, b):
        del matvec  # traced into the solve jaxpr already
        return interp.eval(jaxprs["solve"], [*consts["solve"], *b], sub)

    transpose_solve = None
    if jaxprs["transpose_solve"] is not None:

        def transpose_solve(vecmat, b):
            del vecmat
            return run("transpose_solve", b), jax.tree.map(jnp.zeros_like, sub)

    x, sub = lax.custom_linear_solve(
        lambda x: run("matvec", x),
        b,
        solve,
        transpose_solve,
        symmetric=jaxprs["vecmat"] is jaxprs["matvec"],
        has_aux=True,
    )
    return x, {**states, **sub}


register(_compat.LINEAR_SOLVE, _linear_solve_count, _linear_solve_apply)


# -- Equinox's primitives: lineax's linear_solve ----------------------------------------------
# Their logs are those of their implementation, traced as JAX lowers it (`opaque_body`): a
# linear operator's `mv` may log, as a jaxpr among the parameters or as a Python function.
# lineax's `LU`, `QR`, `Cholesky`, ... solve from a state made outside the primitive (where the
# operator is materialised, and its events captured as any); `CG`, `GMRES`, ... call `mv` in
# the primitive's loop. Where the implementation logs, the outputs and the events come from
# evaluating it once, the derivatives from the primitive's own JVP rule (lineax's, implicit);
# elsewhere the primitive is bound as it is. Either way with logging off, as the jaxprs among
# its parameters cannot be rebuilt without their logs (lineax compares them with those other
# closure-converted functions hold): what its JVP and transpose rules run (the operator's `mv`
# on tangents, the transposed solve) is the derivative's, not the user's forward events.


def _opaque_count(plan, eqn):
    body = plan.opaque_body(eqn)
    if body is None:
        plan.unhandled(eqn)
    return plan.count(body)


def _opaque_apply(interp, eqn, invals, states):
    body = interp.plan.opaque_body(eqn)
    if body is None:
        interp.plan.unhandled(eqn)
    if not interp.plan.has_log(body):  # logs only in functions the implementation never calls
        with logging_as(current_prefix(), enabled=False):
            return _compat.bind_eqn(eqn, invals), states
    primal = [lax.stop_gradient(x) for x in invals]
    interp.lanes.give(primal, interp.lanes.of_each(invals))
    outs, states = interp.eval(body, primal, states, settle=False)
    return _with_jvp_of(eqn, list(invals), list(outs)), states


def _with_jvp_of(eqn, invals, outs):
    """`outs`, with the derivatives of `eqn` (bound on `invals`) as theirs."""
    prefix = current_prefix()

    @jax.custom_jvp
    def attach(args, outs):
        del args
        return outs

    def attach_jvp(primals, tangents):
        (args, outs), (t_args, _) = primals, tangents
        with logging_as(prefix, enabled=False):
            return outs, _compat.primitive_jvp(eqn, args, t_args)[1]

    attach.defjvp(attach_jvp, symbolic_zeros=True)  # lineax's rule wants its zeros symbolic
    return attach(invals, outs)


register(_compat.EQUINOX_PRIMITIVES, _opaque_count, _opaque_apply)


# -- hi primitives (jax >= 0.12): lax.custom_root ---------------------------------------------
# The outputs come from the primitive (its logs are not bound again when JAX expands it, after
# the spool traced), the events from its forward jaxpr (the `solve`) on stop-gradient inputs.


def _hi_forward(plan, eqn):
    forward = _compat.hi_forward(eqn)
    if forward is None:
        plan.unhandled(eqn)
    return forward


def _hi_count(plan, eqn):
    return plan.count(_hi_forward(plan, eqn)[0])


def _hi_apply(interp, eqn, invals, states):
    forward, n = _hi_forward(interp.plan, eqn)
    outs = _compat.bind_eqn(eqn, invals)
    primal = [lax.stop_gradient(x) for x in invals[:n]]
    _, states = interp.eval(forward, primal, states, settle=False)
    return outs, states


register(_compat.HI_CALL, _hi_count, _hi_apply)
