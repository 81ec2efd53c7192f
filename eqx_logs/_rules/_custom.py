"""custom_jvp / custom_vjp: the call bound again with the states threaded through
(`_Threaded`)."""

import contextlib

import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _compat
from .._interpret import check_rule_dtypes
from .._primitive import current_prefix, logging_as
from ._table import register

# -- custom_jvp / custom_vjp: the custom rule rebuilt with the states threaded through ---------
# The primitive is bound again with the states (and what events depend on: the lane guards
# and lane values, see `_lanes.py`) as extra inputs and outputs. The primal is evaluated by
# the interpreter; so is the user's JVP or forward rule when JAX differentiates the call (its
# events then replace the primal's, as its computation does); the backward rule gets the
# cotangents of the real outputs, and the states get zero cotangents. User code runs once.


class _Threaded:
    """How the states and context of one custom call travel as flat extra operands."""

    def __init__(self, interp, eqn, invals, states):
        self.interp, self.eqn = interp, eqn
        self.closed = _compat.call_jaxpr(eqn)
        self.num_consts = eqn.params["num_consts"]
        handler = interp.handler
        sub = handler.threadable(handler.settle(states, handler.keys(self.closed)))
        lanes = interp.lanes.of_each(invals[self.num_consts :])
        context, self.static = interp.snapshot()
        extra, self.in_def = jtu.tree_flatten((sub, context, lanes))
        self.extra = [jnp.asarray(x) for x in extra]
        self.out_def = None
        self.prefix = current_prefix()
        self.name = _custom_name(eqn)

    def run(self, closed, args, extra, *, rule):
        """Evaluate `closed` (the primal, or the user's rule) on `args` (without constants,
        for a rule); returns `(outs, flat states)`."""
        interp = self.interp
        sub, context, lanes = jtu.tree_unflatten(self.in_def, extra)
        if rule:
            self._check(closed)
        saved = interp.rule_name
        if rule:
            interp.rule_name = self.name
        try:
            # a rule is evaluated when JAX differentiates: under the call's scope (what it
            # passes on reaches an enclosing spool or tap if one is tracing, see `log_p`)
            logging = logging_as(self.prefix, enabled=None) if rule else contextlib.nullcontext()
            with interp.restored(context, self.static), logging:
                interp.lanes.give(args if rule else args[self.num_consts :], lanes)
                outs, sub = interp.eval(closed, args, sub)
        finally:
            interp.rule_name = saved
        leaves, self.out_def = jtu.tree_flatten(sub)
        return outs, leaves

    def _check(self, closed):
        """The states were made for the primal's events: a rule may log a key at most as
        often as the primal (keys the primal does not log pass on, see `Spool.event`)."""
        interp = self.interp
        primal = interp.plan.count(self.closed)
        for key, n in interp.plan.count(closed).items():
            bound = primal.get(key)
            if key in primal and bound is not None and (n is None or n > bound):
                raise ValueError(
                    f"eqx_logs: the custom derivative rule of {self.name} logs key {key!r} "
                    f"more often than its primal does (at "
                    f"{', '.join(dict.fromkeys(interp.plan.info[key].sites))}). Under "
                    "differentiation the rule runs instead of the primal, and the events of "
                    "each key were counted in the primal: log the key at most as often in the "
                    "rule (call the primal function from it), or use a reduction of fixed size."
                )

    def rule_context(self):
        """Where the user's rule is traced (when JAX differentiates, after the spool traced
        the call): logging on, under the call's scope."""
        return logging_as(self.prefix)

    def finish(self, flat, states):
        n = len(self.eqn.outvars)
        sub = jtu.tree_unflatten(self.out_def, flat[n:])
        return flat[:n], {**states, **sub}


def _custom_name(eqn) -> str:
    """The custom function as the user wrote it, for messages: `the custom_vjp function f at
    file.py:12`."""
    return f"the {eqn.primitive.name.removesuffix('_call')} function {_compat.function_name(eqn)}"


def _rules_only(interp, eqn, invals):
    """A custom call whose primal does not log: bound as it is, its rules with logging on
    (their events pass on to an enclosing spool or tap, else warn, where the handler owns
    them), under the handler's `rule_events`."""
    prefix, handler = current_prefix(), interp.handler
    name = _custom_name(eqn) if handler.owns_rules() else None

    @contextlib.contextmanager
    def context(*carried):
        with logging_as(prefix, name, enabled=None), handler.rule_events(*carried):
            yield

    carry = handler.rule_carry(eqn)
    return _compat.bind_custom_rules_in(eqn, invals, context, carry)


def _custom_jvp_apply(interp, eqn, invals, states):
    if not interp.plan.eqn_has_log(eqn):
        return _rules_only(interp, eqn, invals), states
    t = _Threaded(interp, eqn, invals, states)
    n = len(eqn.outvars)

    def fun(args, extra):
        outs, leaves = t.run(t.closed, args, extra, rule=False)
        return [*outs, *leaves]

    def rule(jvp_closed, primals, tangents, extra):
        outs, leaves = t.run(jvp_closed, [*primals, *tangents], extra, rule=True)
        return outs[:n], outs[n:], leaves

    flat = _compat.bind_custom_jvp(eqn, invals, t.extra, fun, rule, t.rule_context)
    return t.finish(flat, states)


def _custom_vjp_apply(interp, eqn, invals, states):
    if not interp.plan.eqn_has_log(eqn):
        return _rules_only(interp, eqn, invals), states
    t = _Threaded(interp, eqn, invals, states)

    def fun(args, extra):
        outs, leaves = t.run(t.closed, args, extra, rule=False)
        return [*outs, *leaves]

    def fwd(fwd_closed, args, extra):
        return t.run(fwd_closed, args, extra, rule=True)

    handler = interp.handler

    @contextlib.contextmanager
    def bwd_context(*carried):  # its logs reach an enclosing spool or tap, if any (`log_p`)
        with logging_as(t.prefix, rule=t.name, enabled=None), handler.rule_events(*carried):
            yield

    carry = handler.rule_carry(eqn)
    flat = _compat.bind_custom_vjp(
        eqn, invals, t.extra, fun, fwd, t.rule_context, bwd_context, carry
    )
    return t.finish(flat, states)


def _custom_count(plan, eqn):
    """The primal's events; where it logs, the user's rule is traced too (as JAX traces it when
    it differentiates), and must log each key the primal logs with the same dtype: under
    differentiation its events replace the primal's, and a key's layout may not depend on
    whether a derivative is taken."""
    counts = plan.count(_compat.call_jaxpr(eqn))
    if counts and plan.frozen:  # (checked against the keys' records, once they are known)
        try:
            with logging_as(current_prefix()):
                rule = _compat.custom_rule_jaxpr(eqn)
        except Exception:  # noqa: BLE001 (traced only when JAX differentiates, then checked)
            return counts
        check_rule_dtypes(plan.info, rule, _custom_name(eqn))
    return counts


register(_compat.CUSTOM_JVP, _custom_count, _custom_jvp_apply, straight=True, custom=True)
register(_compat.CUSTOM_VJP, _custom_count, _custom_vjp_apply, straight=True, custom=True)
