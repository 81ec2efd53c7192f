"""One rule per higher-order primitive: how spool counts and evaluates its logs.

A rule has two functions:

- `count(interp, eqn) -> Counts`: the static bound on events per key inside the equation;
- `apply(interp, eqn, invals, states) -> (outs, states)`: evaluate the equation in the current
  trace, rebuilt with JAX's public constructors (`lax.scan`, `lax.while_loop`, `lax.switch`,
  `jax.checkpoint`) and with the reduction states of its keys threaded through.

To support a new primitive, write these two functions and `register` them under its name.
"""

import contextlib
import functools
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from . import _compat, _lanes
from ._interpret import Counts, Interpreter, max_counts, unbounded
from ._primitive import current_prefix, is_log, log_effect, logging_as


class Rule(NamedTuple):
    count: Callable[[Interpreter, Any], Counts]
    apply: Callable[[Interpreter, Any, list, dict], tuple[list, dict]]
    # Evaluates its jaxpr (`_compat.call_jaxpr`) once, in the current trace, as straight-line
    # code, and threads the states itself: a handler may take its events for its jaxpr's.
    straight: bool = False
    # Its jaxpr is evaluated again in the backward pass (a remat): so are its callbacks.
    recomputed: bool = False
    # A `lax.scan`: its events may leave as its `ys` (`_interpret/_stream.py`).
    scan: bool = False
    # A custom derivative: its rules, traced by JAX later, may log where its primal does not.
    custom: bool = False


RULES: dict[str, Rule] = {}


def register(names: str | Iterable[str], count, apply, **attributes: bool) -> None:
    for name in [names] if isinstance(names, str) else names:
        RULES[name] = Rule(count, apply, **attributes)


def _split(xs, *sizes):
    out, start = [], 0
    for n in sizes:
        out.append(list(xs[start : start + n]))
        start += n
    out.append(list(xs[start:]))
    return out


# -- calls that are inlined: jit, closed_call -------------------------------------------------


def _call_count(interp, eqn):
    return interp.count(_compat.call_jaxpr(eqn))


def _inline_apply(interp, eqn, invals, states):
    return interp.eval(_compat.call_jaxpr(eqn), invals, states, settle=False)


register(_compat.INLINE_CALLS, _call_count, _inline_apply, straight=True)
register(_compat.CUSTOM_VMAP, _call_count, _inline_apply)


# -- checkpoint / remat: rebuilt with jax.checkpoint ------------------------------------------


def _remat_count(interp, eqn):
    with interp.plan.recomputing(_compat.recomputes(eqn)):
        return interp.count(_compat.call_jaxpr(eqn))


def _remat_apply(interp, eqn, invals, states):
    closed = _compat.call_jaxpr(eqn)

    def body(args, sub):
        with interp.plan.recomputing(_compat.recomputes(eqn)):
            return interp.eval(closed, args, sub)

    remat = jax.checkpoint(body, **_compat.remat_options(eqn))
    outs, sub = remat(invals, interp.settle(states, interp.keys(closed)))
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
        sub = interp.threadable(interp.settle(states, interp.keys(self.closed)))
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
        often as the primal (keys the primal does not log pass on, see `Interpreter._event`)."""
        interp = self.interp
        primal = interp.count(self.closed)
        for key, n in interp.count(closed).items():
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
    (their events pass on to an enclosing spool or tap, else warn)."""
    name, prefix = _custom_name(eqn), current_prefix()
    return _compat.bind_custom_rules_in(eqn, invals, lambda: logging_as(prefix, name, enabled=None))


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

    def bwd_context():  # its logs reach an enclosing spool or tap, if any (see `log_p`)
        return logging_as(t.prefix, rule=t.name, enabled=None)

    flat = _compat.bind_custom_vjp(eqn, invals, t.extra, fun, fwd, t.rule_context, bwd_context)
    return t.finish(flat, states)


def _custom_count(interp, eqn):
    """The primal's events; where it logs, the user's rule is traced too (as JAX traces it when
    it differentiates), and must log each key the primal logs with the same dtype: under
    differentiation its events replace the primal's, and a key's layout may not depend on
    whether a derivative is taken."""
    counts = interp.count(_compat.call_jaxpr(eqn))
    if counts:
        try:
            with logging_as(current_prefix()):
                rule = _compat.custom_rule_jaxpr(eqn)
        except Exception:  # noqa: BLE001 (traced only when JAX differentiates, then checked)
            return counts
        interp.plan.check_rule_dtypes(rule, _custom_name(eqn))
    return counts


register(_compat.CUSTOM_JVP, _custom_count, _custom_jvp_apply, straight=True, custom=True)
register(_compat.CUSTOM_VJP, _custom_count, _custom_vjp_apply, straight=True, custom=True)


# -- custom_linear_solve: rebuilt with the states as the solve's auxiliary output ---------------
# `lax.custom_linear_solve` (and so `jax.scipy.sparse.linalg.cg`, `gmres`, `bicgstab`) runs its
# `solve` jaxpr forward; its other jaxprs serve derivatives. The states ride out of `solve` as
# its auxiliary data (`has_aux`), so the solve runs once and its derivatives stay implicit.
# Logs in `matvec` as derivatives re-run it (not the forward solve) are removed.


def _linear_solve_count(interp, eqn):
    jaxprs, _, _ = _compat.linear_solve_parts(eqn)
    return interp.count(jaxprs["solve"])


def _linear_solve_apply(interp, eqn, invals, states):
    jaxprs, positions, num_consts = _compat.linear_solve_parts(eqn)
    consts = {name: [invals[i] for i in idx] for name, idx in positions.items()}
    b = list(invals[num_consts:])
    sub = interp.settle(states, interp.keys(jaxprs["solve"]))

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


def _opaque_count(interp, eqn):
    body = interp.plan.opaque_body(eqn)
    if body is None:
        interp.plan.unhandled(eqn)
    return interp.count(body)


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


def _hi_forward(interp, eqn):
    forward = _compat.hi_forward(eqn)
    if forward is None:
        interp.plan.unhandled(eqn)
    return forward


def _hi_count(interp, eqn):
    return interp.count(_hi_forward(interp, eqn)[0])


def _hi_apply(interp, eqn, invals, states):
    forward, n = _hi_forward(interp, eqn)
    outs = _compat.bind_eqn(eqn, invals)
    primal = [lax.stop_gradient(x) for x in invals[:n]]
    _, states = interp.eval(forward, primal, states, settle=False)
    return outs, states


register(_compat.HI_CALL, _hi_count, _hi_apply)


# -- scan: states ride in the carry -----------------------------------------------------------


def _scan_count(interp, eqn):
    body, _, _ = _compat.scan_parts(eqn)
    length = _compat.scan_options(eqn)["length"]
    per_iteration = interp.count(body)
    interp.plan.note_iteration(per_iteration)
    return {k: None if n is None else n * length for k, n in per_iteration.items()}


def _scan_apply(interp, eqn, invals, states):
    body, num_consts, num_carry = _compat.scan_parts(eqn)
    consts, init, xs = _split(invals, num_consts, num_carry)
    options = _compat.scan_options(eqn)
    # keys whose events leave as `ys` (`Interpreter.streamed`), the others ride in the carry
    init_lanes = interp.lanes.of_each(init)
    streamed = {} if init_lanes else interp.handler.streamed(body, options["length"])
    carried = [k for k in interp.keys(body) if k not in streamed]

    def step(carry, x):
        values, lanes, sub = carry
        live = interp.lanes.in_step(values, lanes)  # see _while_apply
        interp.lanes.give(values, lanes)
        sub = {**interp.iteration(sub), **{k: interp.handler.stream_state(k) for k in streamed}}
        with interp.guard(lambda: live, live) if lanes else contextlib.nullcontext():
            outs, sub = interp.eval(body, [*consts, *values, *x], sub, settle=False)
        events = {k: interp.handler.stream_events(k, sub.pop(k)) for k in streamed}
        values = outs[:num_carry]
        new_lanes = interp.lanes.like(values, lanes)
        lanes = {i: jnp.where(live, new_lanes[i], x) for i, x in lanes.items()}
        return (values, interp.lanes.carried(values, lanes), interp.settle(sub)), (
            outs[num_carry:],
            events,
        )

    states = interp.entering_loop(states)
    carry = (init, interp.lanes.carried(init, init_lanes), interp.settle(states, carried))
    if xs:  # inferred from xs: a symbolic length (jax.export) cannot be passed explicitly
        options["length"] = None
    with interp.loop():
        (values, lanes, sub), (ys, events) = lax.scan(step, carry, xs, **options)
    interp.lanes.give(values, lanes)
    states = {**states, **sub}
    for k, block in events.items():
        states[k] = interp.handler.add_stream(k, states[k], block, streamed[k], options["reverse"])
    return [*values, *ys], states


register(_compat.SCAN, _scan_count, _scan_apply, scan=True)


# -- while: states ride in the carry; logs in cond_fun run before each test --------------------


def _while_count(interp, eqn):
    cond, _, body, _ = _compat.while_parts(eqn)
    return unbounded({**interp.count(cond), **interp.count(body)})


def _while_apply(interp, eqn, invals, states):
    cond, cond_nconsts, body, body_nconsts = _compat.while_parts(eqn)
    cond_consts, body_consts, init = _split(invals, cond_nconsts, body_nconsts)
    keys = dict.fromkeys([*interp.keys(cond), *interp.keys(body)])
    # carried values with a lane value (`_lanes.py`) carry it along, as an extra carry
    init_lanes = interp.lanes.of_each(init)

    def test(values, lanes, sub):
        interp.lanes.give(values, lanes)
        (pred,), sub = interp.eval(cond, [*cond_consts, *values], sub)
        return pred, sub

    def advance(values, lanes, sub):
        interp.lanes.give(values, lanes)
        values, sub = interp.eval(body, [*body_consts, *values], interp.iteration(sub))
        return values, interp.lanes.like(values, lanes), sub

    sub = interp.settle(interp.entering_loop(states), keys)
    with interp.loop():
        return _while_loop(interp, eqn, states, sub, init, init_lanes, test, advance)


def _while_loop(interp, eqn, states, sub, init, init_lanes, test, advance):
    """The loop of `_while_apply`, built inside `interp.loop()`."""
    cond = _compat.while_parts(eqn)[0]
    guarded = interp.tracks_guards or init_lanes or _lanes.has_lanes(cond)
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


# -- cond / switch: every branch threads all the states of all branches -------------------------


def _cond_count(interp, eqn):
    return max_counts([interp.count(b) for b in _compat.cond_branches(eqn)])


def _cond_apply(interp, eqn, invals, states):
    branches = _compat.cond_branches(eqn)
    index, *ops = invals
    keys = dict.fromkeys(k for b in branches for k in interp.keys(b))

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
    outs, sub = lax.switch(index, runs, ops, interp.lanes.of_each(ops), interp.settle(states, keys))
    return outs, {**states, **sub}


register(_compat.COND, _cond_count, _cond_apply)


# -- shard_map (and pmap): each device reduces its own events, as a vmap lane does -----------


def _shard_map_count(interp, eqn):
    body, mesh, _, _, axes, _ = _compat.shard_map_parts(eqn)
    with interp.manual.inside(tuple((a, mesh.shape[a]) for a in axes), mesh=mesh):
        return interp.count(body)


def _shard_map_apply(interp, eqn, invals, states):
    body, mesh, in_specs, out_specs, axes, check_vma = _compat.shard_map_parts(eqn)
    keys = interp.keys(body)
    # a key's states have one leading axis per mesh axis: each device gets its own block
    specs = {k: P(*axes) for k in keys}

    def per_device(args, sub):
        with interp.on_device(args, axes, check_vma):
            outs, sub = interp.eval(body, args, interp.handler.device_states(sub))
            sub = interp.handler.device_blocks(sub, len(axes))
        return tuple(outs), sub

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(in_specs, specs),
        out_specs=(out_specs, specs),
        axis_names=frozenset(axes),
        check_vma=check_vma,
    )
    outs, sub = run(tuple(invals), per_device_blocks(interp.settle(states, keys), mesh, axes))
    return list(outs), {**states, **sub}


def per_device_blocks(states, mesh, axes: tuple[str, ...]):
    """States entering a shard_map. With Explicit mesh axes (`jax.make_mesh`'s default) a
    value's type names its sharding, which must be the block per device that `P(*axes)`
    gives; Auto axes take any layout."""
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    spec = P(*(a if types[a] == AxisType.Explicit else None for a in axes))
    if all(a is None for a in spec):
        return states
    return jax.tree.map(lambda x: jax.reshard(x, NamedSharding(mesh, spec)), states)


register(_compat.SHARD_MAP, _shard_map_count, _shard_map_apply)
