"""The `log` and `sow` primitives, their rules, and the functions that bind them (`bind`,
`rebind`, `grad_tap`, `bind_backward_logs`); `log` and `log_grad` (`_log.py`) check what the
user logs and bind it.

One call to `log` binds `log_p` once. Its operands are the value leaves of every key, then the
step scalars, then (if `masked`) a boolean validity mask; its parameters say how to rebuild
them (`treedef`, `steps`) and carry the call's `tags`, `reduce`, `site` (where it was called,
for error messages), `nbatch` (how many leading axes vmap added) and `axis_names` (their
`vmap` axis names, outermost first; None where unnamed). The mask is added by
`_masking.py` when vmap turns a cond or while loop with a batched predicate into code that runs
every branch or iteration for every lane: it marks the lanes where the event really happens.
For a cond, `branches` then records which branch of which batched cond the log is in (pairs
`(cond, branch)`, sorted): a lane takes one branch of each, so the events of different
branches of one cond exclude each other, and a spool bounds them by the maximum over the
branches, as without vmap. (A custom_vjp's backward rule in such a branch, which JAX traces
when it transposes, binds its logs with the mask too: `masked_events`.)
JAX's backward-pass logs (`bind_backward_logs`) carry `iteration=True`, and no other log
does: their step `iteration` is filled where they are consumed.
`log_p` has no outputs and an effect of its own, so it survives DCE, AD, remat and control
flow until a spool or tap interprets it.
"""

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from . import _compat
from ._deferred import force

# (`x as x`: imported from here by the interpreters, `plant`, `instrument` and `log_stats`)
from ._log_checks import (
    check_step as check_step,
    check_value as check_value,
    normalise_tags as normalise_tags,
)
from ._scope import (
    call_site as call_site,
    current_prefix as current_prefix,
    current_steps,
    local,
    logging_as as logging_as,
    no_context_steps,
    note_steps,
    tracing_context as tracing_context,
    unwatched,
)


class LogEffect(_compat.Effect):
    """The effect of `log_p`: keeps a log alive until a spool or tap consumes it."""

    def __repr__(self) -> str:
        return "eqx_logs.LogEffect"


log_effect = LogEffect()
_compat.register_effect(LogEffect)


def _lost_message(site: str, rule: str, what: str = "eqx_logs.log") -> str:
    return (
        f"{what} at {site}, in a custom derivative rule of {rule}, ran outside every "
        "spool and tap, so its events are lost: the derivative was taken outside the spool "
        "(as in `jax.grad(spool(f))`), and the spool's outputs were fixed by the primal "
        "function. Put the spool outside the derivative to capture them: "
        "`eqx_logs.spool(jax.grad(f))`."
    )


class LostEventsWarning(UserWarning):
    """Log events that no spool or tap captured (see `_lost_message`)."""


class _LogPrimitive(_compat.Primitive):
    """A log bound where no spool or tap is tracing (logging off) is dropped, as `log` is
    outside a spool: the program keeps no log and no `LogEffect` (an effectful program
    dispatches on JAX's slow path). Such binds come from jaxprs a library captured under a
    spool and evaluates later (Equinox's checkpointed loops re-run their body in the
    backward pass), and from custom derivative rules JAX traces after the spool returned."""

    multiple_results = True

    def bind(self, *args, **params):
        if _compat.logging_enabled.value:
            return super().bind(*args, **params)
        warn_dropped(params["site"], params["rule"])
        return []


def warn_dropped(site: str, rule: str | None) -> None:
    if rule is not None:
        warnings.warn(_lost_message(site, rule), LostEventsWarning, stacklevel=3)


log_p = _LogPrimitive("eqx_logs.log")


@log_p.def_effectful_abstract_eval
def _log_abstract_eval(*avals, **params):
    del avals, params
    return [], {log_effect}


@log_p.def_impl
def _log_impl(*args, site, rule, **params):
    del args, params
    if rule is not None:
        warnings.warn(_lost_message(site, rule), LostEventsWarning, stacklevel=2)
        return []
    raise RuntimeError(
        f"eqx_logs.log at {site} was evaluated eagerly while a spool or tap was tracing (for "
        "example under `jax.ensure_compile_time_eval`). Its value cannot be captured there: "
        "log traced values, outside `ensure_compile_time_eval`."
    )


def _log_jvp(primals, tangents, **params):
    del tangents
    log_p.bind(*primals, **params)  # primal values only, once
    return [], []


def _leading(x: Any, dim: Any, size: int) -> Any:
    """`x` with its batch axis `dim` first, or broadcast along a new one if unbatched. `x` is
    any operand a primitive takes: an array, a tracer or a Python scalar (a jaxpr literal's
    value, as an interpreter reads it: on jax 0.10 a `TypedFloat`, with no `.shape`)."""
    if dim is _compat.not_mapped:
        return jnp.broadcast_to(x, (size, *jnp.shape(x)))
    return x if dim == 0 else jnp.moveaxis(x, dim, 0)


def _log_batch(axis_data, args, dims, *, treedef, nbatch, axis_names, **params):
    """A key whose leaves (and the call's steps and mask) are all unbatched stays unbatched;
    the others get a leading batch axis, unbatched leaves broadcast. So a key's layout does
    not depend on the keys logged in the same call."""
    size = _compat.axis_size_and_name(axis_data)[0]  # (called even if nothing is batched)
    name = _compat.user_axis_name(axis_data)
    n_leaves = treedef.num_leaves
    mapped = [d is not _compat.not_mapped for d in dims]
    shared = any(mapped[n_leaves:])  # steps and mask
    positions = jtu.tree_unflatten(treedef, list(range(n_leaves)))
    batched = {
        k: shared or any(mapped[i] for i in jtu.tree_leaves(v)) for k, v in positions.items()
    }
    rest = list(range(n_leaves, len(args)))
    for want in (False, True):
        keys = {k: v for k, v in positions.items() if batched[k] == want}
        if not keys:
            continue
        leaves, sub = jtu.tree_flatten(keys)
        ops = [args[i] for i in [*leaves, *rest]]
        if not want:
            log_p.bind(*ops, treedef=sub, nbatch=nbatch, axis_names=axis_names, **params)
            continue
        moved = [_leading(a, dims[i], size) for a, i in zip(ops, [*leaves, *rest])]
        names = (name, *axis_names)
        log_p.bind(*moved, treedef=sub, nbatch=nbatch + 1, axis_names=names, **params)
    return [], []


def _log_transpose(cts, *args, **params):
    """A log inside a function JAX transposes (the `matvec` of `lax.custom_linear_solve`, whose
    transpose is a derived `vecmat`) contributes no cotangent; the transposed function, which
    the user did not write, does not log."""
    del cts, params
    return [None] * len(args)


_compat.def_jvp(log_p, _log_jvp)
_compat.def_primal_only(log_p)  # `_log_jvp` without tracing it at every bind under grad
_compat.def_transpose(log_p, _log_transpose)
_compat.def_batching_with_axis(log_p, _log_batch)
_compat.keep_in_loops(log_p, LogEffect)


def _log_lowering(*args, site, rule, **params):
    """A log that reaches compilation was traced with logging on but never consumed by a
    spool or tap interpreter (so it is outside every spool): it does nothing, like `log`
    outside a spool. A custom rule's backward pass is the one way this loses events."""
    del args, params
    if rule is not None:
        warnings.warn(_lost_message(site, rule), LostEventsWarning, stacklevel=2)
    return []


_compat.def_lowering(log_p, _log_lowering)


def is_log(eqn: _compat.JaxprEqn) -> bool:
    return eqn.primitive is log_p


def rebind(
    eqn: _compat.JaxprEqn,
    invals: list[Any],
    mask: Any = None,
    *,
    keys: list[str] | None = None,
    rule: str | None = None,
    branch: tuple[int, int] | None = None,
) -> None:
    """Bind a log equation again (for an enclosing spool or tap): only `keys` of it (None:
    all), its events masked by `mask` too (a bool per lane; None: as they were), marked as
    coming from the backward or forward `rule` of a custom derivative (None: as it was), and
    as in `branch`, `(cond, branch index)`, of a batched cond (None: as it was).
    Where no spool or tap is tracing, the events are dropped (see `log_p`), and operands
    computed only for logs (`Lazy`) are never computed."""
    params = dict(eqn.params)
    if not _compat.logging_enabled.value:
        warn_dropped(params["site"], rule or params["rule"])
        return
    invals = force(invals)
    if mask is None and keys is None and rule is None and branch is None:
        _compat.bind_eqn(eqn, invals)
        return
    treedef, n_steps = params["treedef"], len(params["steps"])
    items = jtu.tree_unflatten(treedef, invals[: treedef.num_leaves])
    if keys is not None:
        items = {k: items[k] for k in keys}
    leaves, params["treedef"] = jtu.tree_flatten(items)
    rest = invals[treedef.num_leaves :]
    steps, old = rest[:n_steps], rest[n_steps:]
    if mask is not None:
        mask = jnp.logical_and(old[0], mask) if params["masked"] else mask
        old, params["masked"] = [jnp.asarray(mask, bool)], True
    if rule is not None:
        params["rule"] = rule
    if branch is not None:
        params["branches"] = tuple(sorted((*params["branches"], branch)))
    log_p.bind(*leaves, *steps, *old, **params)


def event_mask() -> tuple[Any, tuple[tuple[int, int], ...]] | None:
    """The mask and branches of `masked_events` around, if any."""
    hit = getattr(local, "event_mask", None)
    return None if hit is None else hit[:2]


@contextlib.contextmanager
def masked_events(mask: Any, branch: tuple[int, int] | None) -> Iterator[None]:
    """Events `bind` binds inside masked by `mask` too and marked as in `branch` (as `rebind`
    does), and statistics (`_stats.statistics`) over the lanes where it holds: for a custom
    derivative's rules in a cond whose predicate a vmap batches (`_masking.py`), which JAX
    traces apart from the branch (the backward rule, always), where the masking interpreter
    does not see their logs. Nested blocks combine. Part of the trace context: a function
    jitted inside is traced again for it."""
    saved = getattr(local, "event_mask", None)
    mask = jnp.asarray(mask, bool)
    branches = () if branch is None else (branch,)
    if saved is not None:
        mask, branches = jnp.logical_and(saved[0], mask), (*saved[1], *branches)
    local.event_mask = (mask, tuple(sorted(set(branches))), object())
    try:
        with tracing_context():
            yield
    finally:
        local.event_mask = saved


def bind(
    items: dict[str, Any],
    steps: dict[str, Any],
    *,
    tags: tuple[str, ...] = (),
    reduce: Any = None,
    site: str,
    statistics: bool = False,
    iteration: bool = False,
) -> None:
    """Bind `log_p` for already-validated, already-scoped `items`, with the steps of the
    enclosing `scope` blocks. `statistics`: the items are statistics of arrays
    (`"<where>/<stat>"`, see `_stats.py`), not the values the user logged. `iteration`: the
    step `ITERATION_STEP` is filled where the event is consumed (`bind_backward_logs`)."""
    steps = {**current_steps(), **steps}
    if _compat.logging_enabled.value:
        note_steps(steps, site)
    leaves, treedef = jtu.tree_flatten(items)
    names = tuple(sorted(steps))
    operands = [jnp.asarray(x) for x in leaves] + [jnp.asarray(steps[n]) for n in names]
    masked, branches = event_mask() or (None, ())
    if masked is not None:
        operands.append(masked)
    log_p.bind(
        *operands,
        treedef=treedef,
        steps=names,
        tags=tags,
        reduce=reduce,
        site=site,
        rule=getattr(local, "rule", None),
        nbatch=0,
        axis_names=(),
        masked=masked is not None,
        branches=branches,
        statistics=statistics,
        **({"iteration": True} if iteration else {}),  # (only there: other logs print as before)
    )


# ----------------------------------------------------------------------------------------
# log_grad's backward pass
# ----------------------------------------------------------------------------------------


BACKWARD_TAG = "backward"  # on the events logged in the backward pass


def grad_tap(
    items_of: Callable[[Any], dict[str, Any]], site: str, x: Any, tags: tuple[str, ...] = ()
) -> Any:
    """Identity on `x`; in the backward pass, logs `items_of(cotangent)`, tagged
    `BACKWARD_TAG` and `tags` (those of the forward events it belongs with), with the steps of
    the `scope` blocks around this call. `items_of` must be hashable (JAX keys its traces on
    it)."""
    steps = current_steps()
    note_steps(steps, site)
    return _grad_tap(items_of, site, (BACKWARD_TAG, *tags), x, steps)


# The steps travel as residuals: JAX may trace the backward rule in a trace of its own (the
# transpose of an inner jit), where the traced values of the enclosing scopes do not exist.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _grad_tap(items_of, site, tags, x, steps):
    return x


def _grad_tap_fwd(items_of, site, tags, x, steps):
    return x, steps


def _grad_tap_bwd(items_of, site, tags, steps, ct):
    if _compat.logging_enabled.value:
        with no_context_steps(), unwatched():
            bind(items_of(ct), steps, tags=tags, site=site, statistics=items_of.statistics)
    zeros = jtu.tree_map(lambda s: np.zeros(np.shape(s), jax.dtypes.float0), steps)
    return ct, zeros


_grad_tap.defvjp(_grad_tap_fwd, _grad_tap_bwd)


# ----------------------------------------------------------------------------------------
# JAX's backward-pass logs (jax >= 0.12)
# ----------------------------------------------------------------------------------------

ITERATION_STEP = "iteration"  # the step of JAX's backward-pass logs (see below)


def bind_backward_logs(logs: dict[Any, Any], site: str) -> None:
    """Log JAX's backward-pass logs: `logs`, the dict a backward rule registered with
    `custom_vjp.defvjp_with_logs` (or `custom_gradient(with_logs=True)`) returned beside its
    cotangents, handed over where JAX runs the rule (`_compat.on_backward_logs`; `site`: where
    the custom function was called). One event per key, under the key as JAX names it (scopes
    apply), tagged `BACKWARD_TAG`, with one step, `ITERATION_STEP`: filled where the event is
    consumed (`_interpret/_gate.py`: `steps_of`) with the index of the innermost `lax.scan`
    iteration around it, -1 outside any. A backward rule inside a scan runs in the transposed
    scan at the index of its forward iteration, which is how `jax.vjp(...).with_logs` stacks
    them. The steps of the `scope` blocks around are not recorded: JAX may run the rule in a
    trace of its own (a transposed scan body), where their traced values do not exist."""
    rule = getattr(local, "rule", None)  # a custom function spool or tap bound again
    if not _compat.logging_enabled.value:  # (JAX's own use: nothing; else lost, as `log`)
        if rule is not None:
            what = f"JAX's backward-pass logs {', '.join(map(repr, logs))}"
            warnings.warn(_lost_message(site, rule, what), LostEventsWarning, stacklevel=2)
        return
    prefix, items = current_prefix(), {}
    for key, value in logs.items():
        if not isinstance(key, str) or not key:
            raise TypeError(
                f"eqx_logs: a backward rule called at {site} returned the backward-pass log "
                f"key {key!r} (a {type(key).__name__}); eqx_logs names events with non-empty "
                "strings. Name the rule's logs with strings."
            )
        check_value(key, value, site)
        items[f"{prefix}/{key}" if prefix else key] = value
    with no_context_steps():
        steps = {ITERATION_STEP: np.int32(-1)}
        bind(items, steps, tags=(BACKWARD_TAG,), site=site, iteration=True)


_compat.on_backward_logs(bind_backward_logs)


# ----------------------------------------------------------------------------------------
# sow: a logged value that `plant` may replace
# ----------------------------------------------------------------------------------------

# Identity on its operands (the leaves of one sown value), `nbatch` leading batch axes; the
# value it returns is logged after it, so that a spool records what the program goes on with.
# An instrumented submodule's output, sown only while a plant traces (`plant_point`), has the
# parameter `hidden=True` (absent otherwise): its log is tagged `PLANT_TAG`, for plants only.
# A planted sow differentiated inside the plant has `indexed=True` (absent otherwise) and one
# more output: the index of its event among the key's (an int32 per lane), which the plant
# fills in and the derivative's `sow_tangent_p` reads (see below).
sow_p = _compat.Primitive("eqx_logs.sow")
sow_p.multiple_results = True


def _sow_identity(*xs, nbatch, indexed=False, **params):
    del params
    if not indexed:
        return list(xs)
    return [*xs, jnp.zeros(jnp.shape(xs[0])[:nbatch], jnp.int32)]  # (replaced by the plant)


def _sow_abstract_eval(*avals, nbatch, indexed=False, **params):
    del params
    if not indexed:
        return list(avals)
    return [*avals, _compat.leading_axes_aval(avals[0], nbatch, np.int32)]


sow_p.def_impl(_sow_identity)
sow_p.def_abstract_eval(_sow_abstract_eval)

# The derivative of a sown value that a plant replaces, taken inside the planted function
# (`plant(jax.grad(f), values)`): JAX differentiates `f` before the plant replaces anything, so
# the derivative is left for the plant to give, as it gives the value. Operands: the event's
# index (the `indexed` sow's last output), the sown leaves `xs` (where the derivative is
# taken: the original value), then the linear ones, one for each leaf in `ins`; one output for
# each leaf in `outs`. Not `transposed`: tangents of the sown leaves `ins` in, tangents of the
# planted leaves `outs` out (a jvp); `transposed`: cotangents of the planted leaves `ins` in,
# cotangents of the sown leaves `outs` out (a vjp). The plant (`_plant.py`) makes it the
# derivative of what is planted: zero for a value or a row, `fn`'s for a function `fn`, the
# sown value's own (the identity) for the events `eqx_logs.at` leaves alone. It carries the
# log effect, so that a loop or branch of the backward pass holding one reaches the plant's
# rules (and is never removed). Unreplaced (outside every plant), it is the identity.
sow_tangent_p = _compat.Primitive("eqx_logs.sow_tangent")
sow_tangent_p.multiple_results = True


def _tangent_identity(index, *args, ins, outs, **params):
    del index, params
    xs, linear = args[: len(args) - len(ins)], dict(zip(ins, args[len(args) - len(ins) :]))
    return [linear[i] if i in linear else jnp.zeros_like(xs[i]) for i in outs]


@sow_tangent_p.def_effectful_abstract_eval
def _tangent_abstract_eval(index, *avals, ins, outs, **params):
    del index, params
    xs = avals[: len(avals) - len(ins)]
    return [xs[i].to_tangent_aval() for i in outs], {log_effect}


sow_tangent_p.def_impl(_tangent_identity)


def _second_order_message(key: str) -> str:
    return (
        f"eqx_logs.plant: {key!r} is planted, and differentiated twice inside the planted "
        "function (a `jax.hessian`, or a derivative of a derivative, inside `plant(f, "
        "values)`). The plant gives a first derivative there (zero for a planted value, "
        "`fn`'s for a planted function `fn`), not a second. Take the outer derivative "
        "outside the plant: `jax.jacfwd(eqx_logs.plant(jax.grad(f), values))`, or both: "
        "`jax.hessian(eqx_logs.plant(f, values))`."
    )


def _sow_jvp(primals, tangents, *, key, nbatch, **params):
    # Outside a plant's trace, or for a key it does not plant, the sown value's own derivative
    # (the identity): `jax.grad(plant(f, values))` differentiates what is planted, since the
    # plant replaces the sow before JAX sees it. Inside the planted function, a planted key's
    # derivative is `sow_tangent_p`'s, which the plant replaces with the planted value's.
    planted = _compat.planting.value
    ins = tuple(i for i, t in enumerate(tangents) if not _compat.is_zero(t))
    if planted is None or key not in planted or not ins:
        outs = sow_p.bind(*primals, key=key, nbatch=nbatch, **params)
        return outs, [*tangents, *[_compat.zero_tangent(i) for i in outs[len(primals) :]]]
    *outs, index = sow_p.bind(*primals, key=key, nbatch=nbatch, **{**params, "indexed": True})
    inexact = tuple(
        i for i, x in enumerate(primals) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    )
    given = [tangents[i] for i in ins]
    derived = sow_tangent_p.bind(
        index, *primals, *given, key=key, nbatch=nbatch, ins=ins, outs=inexact, transposed=False
    )
    by_leaf = dict(zip(inexact, derived))
    out_tangents = [by_leaf.get(i, _compat.zero_tangent(x)) for i, x in enumerate(outs)]
    if not params.get("indexed"):
        return outs, out_tangents
    return [*outs, index], [*out_tangents, _compat.zero_tangent(index)]


def _batch_leading(prim: _compat.Primitive):
    """The batching rule of `prim` (the sow, its tangent): the batch axis moved first and
    counted in `nbatch`. A value that no lane changes stays unbatched, as its log does
    (`_log_batch`): the primal of a `jax.jacfwd`, a vmap over tangents only."""

    def rule(axis_data, args, dims, *, nbatch, **params):
        if all(d is _compat.not_mapped for d in dims):
            outs = prim.bind(*args, nbatch=nbatch, **params)
            return outs, [_compat.not_mapped] * len(outs)
        size = _compat.axis_size_and_name(axis_data)[0]
        moved = [_leading(x, d, size) for x, d in zip(args, dims)]
        outs = prim.bind(*moved, nbatch=nbatch + 1, **params)
        return outs, [0] * len(outs)

    return rule


_compat.def_jvp(sow_p, _sow_jvp)
_compat.def_batching_with_axis(sow_p, _batch_leading(sow_p))
_compat.def_lowering(sow_p, _sow_identity)


def _tangent_jvp(primals, tangents, *, key, ins, **params):
    # linear in its last operands; a derivative with respect to the sown value would be a
    # second derivative of what is planted
    n = len(primals) - len(ins)
    if any(not _compat.is_zero(t) for t in tangents[1:n]):
        raise ValueError(_second_order_message(key))
    outs = sow_tangent_p.bind(*primals, key=key, ins=ins, **params)
    if all(_compat.is_zero(t) for t in tangents[n:]):
        return outs, [_compat.zero_tangent(o) for o in outs]
    dots = [_compat.instantiate(t) for t in tangents[n:]]
    return outs, sow_tangent_p.bind(*primals[:n], *dots, key=key, ins=ins, **params)


def _tangent_transpose(cts, index, *args, ins, outs, transposed, **params):
    xs = args[: len(args) - len(ins)]
    if _compat.is_linear_operand(index) or any(_compat.is_linear_operand(x) for x in xs):
        raise ValueError(_second_order_message(params["key"]))
    if all(_compat.is_zero(c) for c in cts):
        return [None] * (1 + len(args))
    back = sow_tangent_p.bind(
        index,
        *xs,
        *[_compat.instantiate(c) for c in cts],
        ins=outs,
        outs=ins,
        transposed=not transposed,
        **params,
    )
    return [None] * (1 + len(xs)) + list(back)


_compat.def_jvp(sow_tangent_p, _tangent_jvp)
_compat.def_transpose(sow_tangent_p, _tangent_transpose)
_compat.def_batching_with_axis(sow_tangent_p, _batch_leading(sow_tangent_p))
_compat.def_lowering(sow_tangent_p, _tangent_identity)

# The tag of the events of `plant_point`: a plant takes them; a spool or tap never selects
# them (`Handler.selects`), and passes them on to the plant around it.
PLANT_TAG = "eqx_logs:plant"


def plant_point(key: str, x: Any, site: str) -> Any:
    """While a plant traces, `x` (an instrumented submodule's output, `key` its path) sown for
    that plant alone, and returned as the plant replaces it; `x` itself otherwise. Its array
    leaves are sown; a pytree without any is returned as it is."""
    if _compat.planting.value is None or not _compat.logging_enabled.value:
        return x
    leaves, treedef = jtu.tree_flatten(x)
    arrays = [i for i, leaf in enumerate(leaves) if eqx.is_array(leaf)]
    if not arrays:
        return x
    sown = sow_p.bind(*[jnp.asarray(leaves[i]) for i in arrays], key=key, nbatch=0, hidden=True)
    for i, leaf in zip(arrays, sown):
        leaves[i] = leaf
    value = [leaf if i in arrays else None for i, leaf in enumerate(leaves)]
    bind({key: jtu.tree_unflatten(treedef, value)}, {}, tags=(PLANT_TAG,), site=site)
    return jtu.tree_unflatten(treedef, leaves)


def is_sow(eqn: _compat.JaxprEqn) -> bool:
    """A sow, or the derivative of one that a plant gives (`sow_tangent_p`)."""
    return eqn.primitive is sow_p or eqn.primitive is sow_tangent_p
