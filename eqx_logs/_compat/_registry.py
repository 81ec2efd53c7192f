"""The effect, and the switch that turns `log` on while a spool or tap traces; the rule
registries of primitives (derivatives, batching, lowering)."""

from collections.abc import Callable
from typing import Any

from jax._src import config as _jax_config, core as _core, effects as _effects
from jax._src.interpreters import ad as _ad, batching as _batching, mlir as _mlir

from ._types import Effect, Primitive


def register_effect(effect_type: type[Effect]) -> None:
    """Allow `effect_type` in lowering, control flow, custom derivatives and remat, and keep
    it through partial evaluation, so that an equation carrying it is never removed."""
    _effects.lowerable_effects.add_type(effect_type)
    _effects.control_flow_allowed_effects.add_type(effect_type)
    _effects.custom_derivatives_allowed_effects.add_type(effect_type)
    _effects.remat_allowed_effects.add_type(effect_type)
    _effects.partial_eval_kept_effects.add_type(effect_type)


# Part of the jit cache key and of the trace context: `jit(f)` traced with logging off is
# re-traced (and its logs kept) when called again inside a spool, and vice versa. When off,
# `log` binds nothing, so the compiled program and the C++ dispatch path are untouched.
logging_enabled = _jax_config.bool_state(
    "eqx_logs_enabled",
    False,
    "Internal to eqx_logs: whether `eqx_logs.log` records events (set by spool and tap).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)

# The current `eqx_logs.scope` prefix, set only while logging is enabled: a jitted function
# called under two different scopes inside a spool is traced twice, with the right keys.
scope_prefix = _jax_config.string_or_object_state(
    "eqx_logs_scope",
    "",
    "Internal to eqx_logs: the key prefix of the enclosing eqx_logs.scope blocks.",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


# The keys an `eqx_logs.plant` plants while it traces (a frozenset; None when none traces): an
# `instrument`ed submodule then sows its output under its path, for the plant to replace, and
# a planted sow differentiated there carries its event's index to the derivative the plant
# gives it (`_primitive.sow_tangent_p`). In the jit key and the trace context like
# `logging_enabled`; None everywhere else, where instrumented models emit no sow.
planting = _jax_config.string_or_object_state(
    "eqx_logs_planting",
    None,
    "Internal to eqx_logs: the keys an eqx_logs.plant tracing plants (set by plant).",
    include_in_jit_key=True,
    include_in_trace_context=True,
)


def def_jvp(prim: Primitive, rule: Callable) -> None:
    _ad.primitive_jvps[prim] = rule


# jax 0.12's linearization rules return structured residuals too (None here), which their
# linear part then receives before the tangents.
_STRUCTURED_RESIDUALS = (
    "structured_res" in _ad.LinearizeTrace.process_primitive.__code__.co_varnames
)


def def_primal_only(prim: Primitive) -> None:
    """Differentiate `prim` (a primitive with no outputs) by binding it on the primal values
    once: what its jvp rule does, without JAX tracing that rule into a jaxpr for every bind
    under `grad` (the fallback linearization, about 2 ms a bind)."""

    def linearize(is_vjp, nonzeros, *primals, **params):
        del is_vjp, nonzeros
        out = prim.bind(*primals, **params)
        if _STRUCTURED_RESIDUALS:
            return out, [], [], None, lambda residuals, structured, *tangents: []
        return out, [], [], lambda residuals, *tangents: []

    _ad.primitive_linearizations[prim] = linearize


def def_no_derivative(prim: Primitive) -> None:
    """`prim`'s outputs (`multiple_results`) have zero derivatives: what is computed only to
    be logged."""

    def jvp(primals, tangents, **params):
        del tangents
        outs = prim.bind(*primals, **params)
        return outs, [_ad.Zero(_core.typeof(x).to_tangent_aval()) for x in outs]

    _ad.primitive_jvps[prim] = jvp


def explicit_spec(aval: Any) -> tuple[Any, ...] | None:
    """The partition spec of a value sharded over Explicit mesh axes (sharding in types, as
    `jax.make_mesh` gives by default), or None."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is None or all(p is None for p in spec):
        return None
    return tuple(spec)


def def_transpose(prim: Primitive, rule: Callable) -> None:
    """`rule(cts, *args, **params) -> cotangents of args` (None for zero)."""
    _ad.primitive_transposes[prim] = rule


def def_batching(prim: Primitive, rule: Callable) -> None:
    """`rule(args, dims, **params) -> (outs, out_dims)`."""
    _batching.primitive_batchers[prim] = rule


def def_lowering(prim: Primitive, rule: Callable) -> None:
    """`rule(*args, **params) -> outs` in terms of JAX operations."""
    _mlir.register_lowering(prim, _mlir.lower_fun(rule, multiple_results=True))


def wrap_batching(name: str, make_rule: Callable[[Callable], Callable]) -> None:
    """Replace the batching rule of the primitive called `name` by `make_rule(original)`;
    rules are called as `rule(axis_data, args, dims, **params) -> (outs, out_dims)`."""
    for prim, rule in list(_batching.fancy_primitive_batchers.items()):
        if prim.name == name:
            _batching.fancy_primitive_batchers[prim] = make_rule(rule)
            return
    raise NotImplementedError(f"eqx_logs: no batching rule for {name!r} in this JAX version.")


def wrap_every_batching(make_rule: Callable[[Primitive, Callable], Callable]) -> None:
    """Replace the batching rule of every primitive that has one now by `make_rule(prim,
    original)` (rules called as for `wrap_batching`)."""
    for prim, rule in list(_batching.fancy_primitive_batchers.items()):
        _batching.fancy_primitive_batchers[prim] = make_rule(prim, rule)


def def_batching_with_axis(prim: Primitive, rule: Callable) -> None:
    """`rule(axis_data, args, dims, **params) -> (outs, out_dims)`."""
    _batching.fancy_primitive_batchers[prim] = rule


def axis_size_and_name(axis_data: Any) -> tuple[int, Any]:
    return axis_data.size, axis_data.name


def user_axis_name(axis_data: Any) -> Any:
    """The `axis_name` the user gave `vmap`, or None (JAX names an unnamed axis with a
    sentinel object)."""
    name = axis_data.name
    return None if name is _core.no_axis_name else name


not_mapped = None  # jax marks an unbatched operand with None (batching.NotMapped)
