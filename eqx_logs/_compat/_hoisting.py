"""Loop-invariant hoisting. When JAX partially evaluates a scan (under grad, vjp, linearize,
checkpoint), it re-traces the known loop body with only the loop-invariant inputs known and
evaluates every equation that depends on them alone once, outside the loop, effects
included (`_scan_known_hoisting`, and the hoisting step of `_scan_partial_eval_custom`;
jax.debug.callback has the same bug). A log reading a loop-invariant value would then fire
once instead of once per iteration, and a cond with a loop-invariant predicate would lose
its logs. While such a pass runs, equations holding logs are kept in the loop.

On jax <= 0.11 `closed_call` (which `_scan_partial_eval_custom` wraps a known loop in) is a
call primitive, partially evaluated by `JaxprTrace.process_call`, which stages its unknown
half without the effect handle `default_process_primitive` keeps: a staged call with logs
and no outputs was unreachable, and dropped (a log in a loop in a `jax.checkpoint` in a
scan, under grad). There, a call holding logs is staged whole while a hoisting pass runs."""

import sys
from typing import Any

from jax._src import ad_checkpoint as _ad_checkpoint, core as _core, pjit as _pjit
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax.control_flow import conditionals as _conditionals, loops as _loops

from ._higher_order import HIGHER_ORDER
from ._jaxprs import sub_jaxprs, unpack
from ._types import Effect, Primitive


def _codes(module: Any, *names: str) -> set[Any]:
    return {getattr(module, n).__code__ for n in names if hasattr(module, n)}


# The innermost of these on the stack tells whether a partial-eval trace is a hoisting pass.
hoisting_codes = _codes(_loops, "_scan_known_hoisting", "_scan_partial_eval_custom")
splitting_codes = (
    _codes(_loops, "_scan_partial_eval", "_while_partial_eval")
    | _codes(_conditionals, "_cond_partial_eval")
    | _codes(_pjit, "_pjit_partial_eval")
    | _codes(_ad_checkpoint, "remat_partial_eval")
)


def _in_scan_hoisting() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in hoisting_codes:
            return True
        if frame.f_code in splitting_codes:
            return False
        frame = frame.f_back
    return False


def _stage(trace, prim, tracers, params):
    """Stage `prim` into the partial-eval trace as if its inputs were unknown."""
    tracers = [trace.instantiate_const(t) for t in tracers]
    return trace.default_process_primitive(prim, tracers, params)


def _holds(jaxpr: Any, effect_type: type[Effect]) -> bool:
    return any(isinstance(e, effect_type) for e in unpack(jaxpr)[0].effects)


def keep_in_loops(log_prim: Primitive, effect_type: type[Effect]) -> None:
    """Keep `log_prim`, and higher-order primitives and calls holding `effect_type`, inside
    the loops they were written in (see above)."""

    def log_rule(trace, *tracers, **params):
        if _in_scan_hoisting():
            return _stage(trace, log_prim, tracers, params)
        return trace.default_process_primitive(log_prim, tracers, params)

    _pe.custom_partial_eval_rules[log_prim] = log_rule

    for prim, rule in list(_pe.custom_partial_eval_rules.items()):
        if prim.name in HIGHER_ORDER:
            _pe.custom_partial_eval_rules[prim] = _keep_in_loop(prim, rule, effect_type)
    if isinstance(_core.closed_call_p, getattr(_core, "CallPrimitive", ())):  # jax <= 0.11
        _pe.JaxprTrace.process_call = _keep_call_in_loop(_pe.JaxprTrace.process_call, effect_type)


def _keep_in_loop(prim, rule, effect_type):
    def wrapped(trace, *tracers, **params):
        if _in_scan_hoisting() and any(_holds(j, effect_type) for j in sub_jaxprs(params)):
            return _stage(trace, prim, tracers, params)
        return rule(trace, *tracers, **params)

    return wrapped


def _keep_call_in_loop(process_call, effect_type):
    if getattr(process_call, "_eqx_logs_keeps", False):  # installed once
        return process_call

    def wrapped(trace, primitive, fun, tracers, params, /):
        if primitive is _core.closed_call_p and _in_scan_hoisting():
            tracers = [trace.to_jaxpr_tracer(t) for t in tracers]
            # `fun` evaluates the call's jaxpr: it has no stores, and is traced again below
            jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(fun, [t.aval for t in tracers])
            if _holds(jaxpr, effect_type):
                closed = _core.ClosedJaxpr(jaxpr, consts)
                return _stage(trace, primitive, tracers, {**params, "call_jaxpr": closed})
        return process_call(trace, primitive, fun, tracers, params)

    wrapped._eqx_logs_keeps = True
    return wrapped
