"""Custom derivatives rebuilt with extra inputs and outputs (the reduction states), as JAX's
checkify does: the same primitive is bound again with new functions for the primal, the
forward or JVP rule, and the backward rule. The user's rules run once, inside them."""

from collections.abc import Callable, Sequence
from typing import Any

from jax._src import ad_util as _ad_util, core as _core, linear_util as _lu
from jax._src.ad_util import SymbolicZero as _SymbolicZero
from jax._src.interpreters import ad as _ad
from jax.tree_util import tree_structure as _tree_structure, tree_unflatten as _tree_unflatten

from ._backward_logs import BACKWARD_LOGS, rule_output
from ._higher_order import CUSTOM_JVP, close
from ._types import JaxprEqn


def _wrap(fun: Callable, like: Any) -> Any:
    return _lu.wrap_init(fun, debug_info=like.debug_info)


def _tangent_zero(x: Any, symbolic: bool) -> Any:
    aval = _core.typeof(x).to_tangent_aval()
    return _SymbolicZero(aval) if symbolic else _ad_util.zeros_like_aval(aval)


def _zeros(operands: Sequence[Any]) -> list[Any]:
    """The cotangents a backward rule returns for operands that get none (symbolic zeros, as
    JAX's own rules return for constants: a vmap batching the rule takes no `None`)."""
    return [_ad_util.Zero(_core.typeof(x).to_tangent_aval()) for x in operands]


def bind_custom_rules_in(
    eqn: JaxprEqn,
    invals: Sequence[Any],
    context: Callable[..., Any],
    carry: Sequence[Any] = (),
):
    """Bind a custom_jvp/custom_vjp equation again as it is, except that its JVP, forward and
    backward rules (traced later by JAX, if it differentiates) run under the context manager
    `context(*carried)`. For calls whose primal does not log: their rules may.

    `carry` (arrays) are bound as extra operands that the rules receive as they are traced
    (`carried`): the JVP and forward rules as the operands, the backward rule as residuals
    the forward pass keeps. A rule traced after the trace that called this (a backward rule,
    always) can use them, where a value of that trace would leak."""
    params = dict(eqn.primitive.get_bind_params(eqn.params))
    fun, *rules = params.pop("subfuns")
    n, k = len(invals), len(carry)

    def fun_(*xs):
        return fun.call_wrapped(*xs[:n])

    if eqn.primitive.name == CUSTOM_JVP:
        (jvp,) = rules

        def jvp_(*xs):
            primals, tangents = xs[: n + k], xs[n + k :]
            with context(*primals[n:]):
                return jvp.call_wrapped(*primals[:n], *tangents[:n])

        subfuns = (_wrap(fun_, fun) if k else fun, _wrap(jvp_, jvp))
    else:
        fwd, bwd = rules
        out_trees = params["out_trees"]

        def fwd_(*xs):  # (value, nonzero) pairs
            with context(*xs[2 * n :: 2]):
                return fwd.call_wrapped(*xs[: 2 * n])

        def out_trees_():  # `carry` kept as residuals: the inputs forwarded to the bwd
            out_tree, res_tree, forwarded = out_trees()
            res = _tree_unflatten(res_tree, [0] * res_tree.num_leaves)
            return out_tree, _tree_structure((res, [0] * k)), [*forwarded, *range(n, n + k)]

        def bwd_(*xs):
            r = out_trees()[1].num_leaves
            with context(*xs[r : r + k]):  # (its logs, jax >= 0.12, emitted there too)
                cts_in, logs = rule_output(bwd.call_wrapped(*xs[:r], *xs[r + k :]))
            cts_in = [*cts_in, *_zeros(xs[r : r + k])]
            return (cts_in, logs) if BACKWARD_LOGS else cts_in

        subfuns = (_wrap(fun_, fun) if k else fun, _wrap(fwd_, fwd), _wrap(bwd_, bwd))
        params["out_trees"] = out_trees_ if k else out_trees
    out = eqn.primitive.bind(*invals, *carry, subfuns=subfuns, **params)
    return list(out)


def custom_rule_jaxpr(eqn: JaxprEqn) -> Any:
    """The user's JVP rule (`custom_jvp_call`) or forward rule (`custom_vjp_call`) of `eqn`,
    traced as JAX traces it when it differentiates the call with every input's tangent
    nonzero (JAX memoizes it, so differentiating later traces it no more)."""
    params = eqn.params
    n = len(eqn.invars) - params["num_consts"]
    if eqn.primitive.name == CUSTOM_JVP:
        jaxpr, consts, _ = params["jvp_jaxpr_fun"].call_wrapped(*[False] * n)
    else:
        jaxpr, consts = params["fwd_jaxpr_thunk"].call_wrapped(*[True] * n)
    return close(jaxpr, consts)


def bind_custom_jvp(
    eqn: JaxprEqn,
    invals: Sequence[Any],
    extra: Sequence[Any],
    fun: Callable,
    rule: Callable,
    rule_context: Callable[[], Any],
) -> list[Any]:
    """Bind a `custom_jvp_call` equation again on `[*invals, *extra]`. `fun(invals, extra)`
    returns `[*outs, *extra_outs]` (the primal); `rule(jvp_jaxpr, primals, tangents, extra)`
    evaluates the user's JVP jaxpr (on the non-constant inputs and their nonzero tangents)
    and returns `(outs, nonzero_out_tangents, extra_outs)`. Extra outputs have zero tangents.
    The user's rule is traced (when JAX differentiates) under the context manager
    `rule_context()`. Returns `[*outs, *extra_outs]`."""
    params = eqn.params
    n_in, num_consts, jvp_fun = len(invals), params["num_consts"], params["jvp_jaxpr_fun"]

    def fun_(*xs):
        return fun(list(xs[:n_in]), list(xs[n_in:]))

    def jvp_(*xs):
        n = len(xs) // 2
        primals, tangents = xs[num_consts:n_in], xs[n + num_consts : n + n_in]
        zeros = [type(t) is _SymbolicZero for t in tangents]
        with rule_context():
            jaxpr, consts, out_zeros = jvp_fun.call_wrapped(*zeros)
        nonzero = [t for t in tangents if type(t) is not _SymbolicZero]
        outs, out_tangents, extra_outs = rule(
            close(jaxpr, consts), list(primals), nonzero, list(xs[n_in:n])
        )
        it = iter(out_tangents)
        symbolic = params["symbolic_zeros"]
        out_tangents = [
            _tangent_zero(p, symbolic) if z else next(it) for p, z in zip(outs, out_zeros)
        ]
        extra_tangents = [_tangent_zero(x, symbolic) for x in extra_outs]
        return [*outs, *extra_outs, *out_tangents, *extra_tangents]

    subfuns = (_wrap(fun_, jvp_fun), _wrap(jvp_, jvp_fun))
    out = eqn.primitive.bind(
        *invals, *extra, subfuns=subfuns, symbolic_zeros=params["symbolic_zeros"]
    )
    return list(out)


def bind_custom_vjp(
    eqn: JaxprEqn,
    invals: Sequence[Any],
    extra: Sequence[Any],
    fun: Callable,
    fwd: Callable,
    fwd_context: Callable[[], Any],
    bwd_context: Callable[..., Any],
    carry: Sequence[Any] = (),
) -> list[Any]:
    """Bind a `custom_vjp_call` equation again on `[*invals, *extra]`. `fun(invals, extra)`
    returns `[*outs, *extra_outs]` (the primal); `fwd(fwd_jaxpr, args, extra)` evaluates the
    user's forward jaxpr (on the non-constant inputs) and returns `(res_and_outs,
    extra_outs)`. The user's forward rule is traced under the context manager
    `fwd_context()`, its backward rule under `bwd_context(*carry)`, on the cotangents of
    `outs`: `carry` (arrays) are operands too, kept as residuals for the backward rule (as in
    `bind_custom_rules_in`); extra inputs get zero cotangents. Returns `[*outs,
    *extra_outs]`."""
    params = eqn.params
    n_in, num_consts = len(invals), params["num_consts"]
    n_extra, k = len(extra), len(carry)
    thunk, bwd, out_trees = params["fwd_jaxpr_thunk"], params["bwd"], params["out_trees"]

    def fun_(*xs):
        return fun(list(xs[:n_in]), list(xs[n_in : n_in + n_extra]))

    def fwd_(*xs):
        vals, nonzeros = xs[::2], xs[1::2]
        if any(nonzeros[:num_consts]):
            raise _ad.CustomVJPException()
        with fwd_context():
            jaxpr, consts = thunk.call_wrapped(*nonzeros[num_consts:n_in])
        res_and_outs, extra_outs = fwd(
            close(jaxpr, consts), list(vals[num_consts:n_in]), list(vals[n_in : n_in + n_extra])
        )
        return [*res_and_outs, *extra_outs]

    def out_trees_():  # `carry` kept as residuals: the inputs forwarded to the bwd
        out_tree, res_tree, forwarded = out_trees()
        res = _tree_unflatten(res_tree, [0] * res_tree.num_leaves)
        first = n_in + n_extra
        return out_tree, _tree_structure((res, [0] * k)), [*forwarded, *range(first, first + k)]

    n_out = len(eqn.outvars)
    # (symbolic, not None: a backward rule that a vmap batches returns JAX types only)
    const_zeros, extra_zeros = _zeros(invals[:num_consts]), _zeros(extra)

    def bwd_(*xs):
        num_res = out_trees()[1].num_leaves
        res, carried = xs[:num_res], xs[num_res : num_res + k]
        cts = xs[num_res + k : num_res + k + n_out]
        with bwd_context(*carried):  # (its logs, jax >= 0.12, emitted there too)
            cts_in, logs = rule_output(bwd.call_wrapped(*res, *cts))
        cts_in = [*const_zeros, *cts_in, *extra_zeros, *_zeros(carried)]
        return (cts_in, logs) if BACKWARD_LOGS else cts_in

    subfuns = (_wrap(fun_, thunk), _wrap(fwd_, thunk), _wrap(bwd_, bwd))
    out = eqn.primitive.bind(
        *invals,
        *extra,
        *carry,
        subfuns=subfuns,
        out_trees=out_trees_ if k else out_trees,
        symbolic_zeros=params["symbolic_zeros"],
    )
    return list(out)
