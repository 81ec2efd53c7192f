"""Every use of private JAX API, in one place.

JAX changes its internals between minor releases (jax 0.10 has `ClosedJaxpr` and a scan with
`num_consts`/`num_carry`; jax 0.12 folds constants into `Jaxpr` and describes a scan's operands
with a flat tree). The rest of eqx_logs sees only the small, stable vocabulary defined here:

- `Effect`/`register_effect`: an effect type of our own, allowed everywhere a log may appear;
- `Primitive` and the rule registries (`def_jvp`, `def_batching`, `def_lowering`);
- `logging_enabled`, `scope_prefix`: JAX config states in the jit key and the trace context;
- `keep_in_loops`: partial-eval rules that stop JAX hoisting logs out of loops;
- `unpack`/`sub_jaxprs`/`strip_eqn`: reading and rebuilding jaxprs without mutating them;
- `bind_eqn`: evaluating one equation as `jax.core.eval_jaxpr` would;
- one accessor per higher-order primitive (`scan_parts`, `while_parts`, ...).

`tests/test_compat.py` checks each of these on the installed JAX version.
"""

import functools
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from jax import ShapeDtypeStruct, lax as _lax, make_jaxpr as _make_jaxpr, tree_util as _tree_util
from jax._src import (
    ad_checkpoint as _ad_checkpoint,
    ad_util as _ad_util,
    callback as _callback,
    config as _jax_config,
    core as _core,
    debugging as _debugging,
    dispatch as _dispatch,
    effects as _effects,
    hijax as _hijax,
    linear_util as _lu,
    pjit as _pjit,
    sharding_impls as _sharding_impls,
    source_info_util as _source_info_util,
)
from jax._src.ad_util import SymbolicZero as _SymbolicZero
from jax._src.interpreters import (
    ad as _ad,
    batching as _batching,
    mlir as _mlir,
    partial_eval as _pe,
)
from jax._src.lax.control_flow import conditionals as _conditionals, loops as _loops
from jax.sharding import (
    NamedSharding as _NamedSharding,
    PartitionSpec as _PartitionSpec,
    SingleDeviceSharding as _SingleDeviceSharding,
    reshard as _reshard,
)
from jax.tree_util import tree_leaves as _tree_leaves

Jaxpr = _core.Jaxpr
JaxprEqn = _core.JaxprEqn
Literal = _core.Literal
DropVar = _core.DropVar
Primitive = _core.Primitive
ShapedArray = _core.ShapedArray
Effect = _effects.Effect
# jax <= 0.11 wraps constants in a `ClosedJaxpr`; jax 0.12 attaches them to `Jaxpr` itself.
_ClosedJaxpr = getattr(_core, "ClosedJaxpr", None)
_closed_types = (Jaxpr,) if _ClosedJaxpr is None else (Jaxpr, _ClosedJaxpr)

# ----------------------------------------------------------------------------------------
# The effect, and the switch that turns `log` on while a spool or tap traces.
# ----------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------
# Host callbacks that keep their order on any number of devices and processes.
# `jax.debug.callback(..., ordered=True)` is refused by a program over more than one device
# (its effect is not "shardable"), and `io_callback(..., ordered=True)` cannot be vmapped or
# rematerialized. `host_callback` is `jax.debug.callback` (its rules for vmap, grad and
# remat) with an ordered effect of its own that JAX may shard, lowered as `io_callback` is:
# in a program over many devices (a sharded jit) it runs once, on the first device, with the
# whole value (across processes: on process 0's); inside a `shard_map` whose axes are all
# manual it runs on every device with that device's values.
# ----------------------------------------------------------------------------------------


class HostEffect(Effect):
    __str__ = lambda self: "eqx_logs.host"  # noqa: E731


host_effect = HostEffect()
register_effect(HostEffect)
_effects.ordered_effects.add_type(HostEffect)
_effects.shardable_ordered_effects.add_type(HostEffect)

host_p = Primitive("eqx_logs.host")
host_p.multiple_results = True


def host_callback(fun: Callable[..., None], *args: Any, every_process: bool = False) -> None:
    """Call `fun(*args)` on the host, with numpy arrays for the arrays of the pytrees `args`,
    in program order (see above for where it runs on many devices). With `every_process`, a
    program over the devices of many processes calls it on each of them (on its first device)
    instead of on process 0 alone."""
    leaves, treedef = _tree_util.tree_flatten(args)

    def flat(*leaves):
        fun(*_tree_util.tree_unflatten(treedef, leaves))

    host_p.bind(*map(_whole, leaves), callback=flat, every_process=every_process)


def _whole(x: Any) -> Any:
    """A traced `x` whose type shards it over a mesh's explicit axes (`jax.make_mesh`'s
    default), replicated: the call reads the whole value on one device, and XLA moves a
    sharded value there only by an "Involuntary full rematerialization" (a warning of 400
    characters per value and compilation); an all-gather first says what is meant."""
    if not isinstance(x, _core.Tracer):
        return x
    sharding = getattr(x.aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(s is None for s in spec):
        return x
    return _reshard(x, _NamedSharding(sharding.mesh, _PartitionSpec()))


@host_p.def_impl
def _host_impl(*args, callback, every_process):
    if all(getattr(x, "is_fully_addressable", True) for x in args):
        callback(*_tree_util.tree_map(np.asarray, args))
        return []
    # arrays of many processes: a program of their devices places the call
    return _dispatch.apply_primitive(host_p, *args, callback=callback, every_process=every_process)


@host_p.def_effectful_abstract_eval
def _host_abstract_eval(*avals, callback, every_process):
    del avals, callback, every_process
    return [], {host_effect}


def _host_batch(args, dims, **params):
    """One call per lane, in lane order (as `jax.debug.callback`)."""
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not not_mapped)
    for i in range(size):
        lane = [
            x if d is not_mapped else _lax.index_in_dim(x, i, d, False) for x, d in zip(args, dims)
        ]
        host_p.bind(*lane, **params)
    return [], []


def _host_jvp(primals, tangents, **params):
    del tangents
    return host_p.bind(*primals, **params), []


def _host_lowering(ctx, *args, callback, every_process):
    context = ctx.module_context.axis_context
    # over many devices (not inside a shard_map): on the first one, or each process's first
    places = [None]
    if every_process and isinstance(context, _sharding_impls.ShardingContext):
        firsts: dict[int, Any] = {}
        for device in context.device_assignment or ():
            firsts.setdefault(device.process_index, device)
        places = [_SingleDeviceSharding(d) for d in firsts.values()] or places
    token = ctx.tokens_in.get(host_effect)
    for place in places:
        _, token, _ = _callback.emit_python_callback(
            ctx,
            lambda *xs: (callback(*xs), ())[1],
            token,
            list(args),
            ctx.avals_in,
            ctx.avals_out,
            has_side_effect=True,
            returns_token=True,
            sharding=_callback._callback_op_sharding(context, place, []),
        )
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(_mlir.TokenSet({host_effect: token})))
    return []


_batching.primitive_batchers[host_p] = _host_batch
_ad.primitive_jvps[host_p] = _host_jvp
_ad.primitive_transposes[host_p] = lambda cts, *args, **params: [None] * len(args)
_mlir.register_lowering(host_p, _host_lowering)
# lowered knowing the devices (as io_callback is): to place a call on each process's first
_dispatch.prim_requires_devices_during_lowering.add(host_p)
def_primal_only(host_p)
# kept in the forward pass of a rematerialized function, as `jax.debug.callback` is
_pe.partial_eval_jaxpr_custom_rules[host_p] = functools.partial(
    _debugging._debug_partial_eval_custom, primitive=host_p
)


# ----------------------------------------------------------------------------------------
# Loop-invariant hoisting. When JAX partially evaluates a scan (under grad, vjp, linearize,
# checkpoint), it re-traces the known loop body with only the loop-invariant inputs known and
# evaluates every equation that depends on them alone once, outside the loop, effects
# included (`_scan_known_hoisting`, and the hoisting step of `_scan_partial_eval_custom`;
# jax.debug.callback has the same bug). A log reading a loop-invariant value would then fire
# once instead of once per iteration, and a cond with a loop-invariant predicate would lose
# its logs. While such a pass runs, equations holding logs are kept in the loop.
# ----------------------------------------------------------------------------------------


def _codes(module: Any, *names: str) -> set[Any]:
    return {getattr(module, n).__code__ for n in names if hasattr(module, n)}


# The innermost of these on the stack tells whether a partial-eval trace is a hoisting pass.
_hoisting_codes = _codes(_loops, "_scan_known_hoisting", "_scan_partial_eval_custom")
_splitting_codes = (
    _codes(_loops, "_scan_partial_eval", "_while_partial_eval")
    | _codes(_conditionals, "_cond_partial_eval")
    | _codes(_pjit, "_pjit_partial_eval")
    | _codes(_ad_checkpoint, "remat_partial_eval")
)


def _in_scan_hoisting() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _hoisting_codes:
            return True
        if frame.f_code in _splitting_codes:
            return False
        frame = frame.f_back
    return False


def _stage(trace, prim, tracers, params):
    """Stage `prim` into the partial-eval trace as if its inputs were unknown."""
    tracers = [trace.instantiate_const(t) for t in tracers]
    return trace.default_process_primitive(prim, tracers, params)


def keep_in_loops(log_prim: Primitive, effect_type: type[Effect]) -> None:
    """Keep `log_prim`, and higher-order primitives holding `effect_type`, inside the loops
    they were written in (see above)."""

    def log_rule(trace, *tracers, **params):
        if _in_scan_hoisting():
            return _stage(trace, log_prim, tracers, params)
        return trace.default_process_primitive(log_prim, tracers, params)

    _pe.custom_partial_eval_rules[log_prim] = log_rule

    for prim, rule in list(_pe.custom_partial_eval_rules.items()):
        if prim.name in _HIGHER_ORDER:
            _pe.custom_partial_eval_rules[prim] = _keep_in_loop(prim, rule, effect_type)


def _keep_in_loop(prim, rule, effect_type):
    def wrapped(trace, *tracers, **params):
        if _in_scan_hoisting() and any(
            any(isinstance(e, effect_type) for e in unpack(j)[0].effects)
            for j in sub_jaxprs(params)
        ):
            return _stage(trace, prim, tracers, params)
        return rule(trace, *tracers, **params)

    return wrapped


def wrap_batching(name: str, make_rule: Callable[[Callable], Callable]) -> None:
    """Replace the batching rule of the primitive called `name` by `make_rule(original)`;
    rules are called as `rule(axis_data, args, dims, **params) -> (outs, out_dims)`."""
    for prim, rule in list(_batching.fancy_primitive_batchers.items()):
        if prim.name == name:
            _batching.fancy_primitive_batchers[prim] = make_rule(rule)
            return
    raise NotImplementedError(f"eqx_logs: no batching rule for {name!r} in this JAX version.")


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


# ----------------------------------------------------------------------------------------
# Reading and evaluating jaxprs.
# ----------------------------------------------------------------------------------------


def unpack(closed: Any) -> tuple[Jaxpr, list[Any]]:
    """`(jaxpr, consts)` of what `jax.make_jaxpr` returns or a sub-jaxpr found in params."""
    if _ClosedJaxpr is not None and isinstance(closed, _ClosedJaxpr):
        return closed.jaxpr, list(closed.consts)
    return closed, list(getattr(closed, "consts", ()))  # jax 0.12, or an open jaxpr


def is_tracer(x: Any) -> bool:
    return isinstance(x, _core.Tracer)


def is_traced(tree: Any) -> bool:
    """Whether a leaf of `tree` is a tracer: the call is inside `jit`, `grad` or `vmap`."""
    return any(is_tracer(x) for x in _tree_leaves(tree))


def tracing() -> bool:
    """Whether any JAX transform is tracing (`jit`, `grad`, `vmap`, ...), not eager code."""
    return not isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def staging() -> bool:
    """Whether the current trace builds a jaxpr (`jax.jit`, `make_jaxpr`, a loop body), rather
    than differentiating, batching or running the operations bound in it."""
    return type(_core.trace_ctx.trace) is _pe.DynamicJaxprTrace


def is_jaxpr(x: Any) -> bool:
    return isinstance(x, _closed_types)


# The objects that "hi" equations (`call_hi_primitive`) carry: `HiPrim` (jax 0.12; jax 0.10
# calls it `VJPHiPrimitive`, and only `jax.experimental.hijax` users bind it).
_HiPrim = getattr(_hijax, "HiPrim", None) or getattr(_hijax, "VJPHiPrimitive", ())


def sub_jaxprs(params: dict[str, Any]) -> Iterator[Any]:
    """Every jaxpr found in an equation's parameters (also inside tuples, as cond's, and
    those a hi primitive holds, as `lax.custom_root`'s `solve`: see `_hi_jaxprs`)."""
    for value in params.values():
        if is_jaxpr(value):
            yield value
        elif isinstance(value, tuple | list):
            for item in value:
                if is_jaxpr(item):
                    yield item
        elif isinstance(value, _HiPrim):
            yield from _hi_jaxprs(value)


def _hi_jaxprs(prim: Any) -> Iterator[Any]:
    """The jaxprs of a `HiPrim`'s parameters: its own (`Scan3`'s body, `RematTraced`'s
    function), those of the traced functions it holds (`CustomJVPTraced`'s primal), and those
    of the hi primitives it holds (`OptRemat`'s). Logs there are found, and so never lost."""
    for value in prim.params.values():
        if isinstance(value, _HiPrim):
            yield from _hi_jaxprs(value)
        elif is_jaxpr(value):
            yield value
        elif is_jaxpr(getattr(value, "jaxpr", None)):  # a `jax.jit(f).trace(...)`
            yield value.jaxpr


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Evaluate one equation in the current trace, exactly as `jax.core.eval_jaxpr` does."""
    if staging() and not eqn.effects:
        out = _emit(_core.trace_ctx.trace, eqn, invals)
        if out is not None:
            return out
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(bind_params, tuple):  # jax <= 0.11: (subfuns, params)
        subfuns, bind_params = bind_params
    else:
        subfuns = []
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    with (
        _source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*subfuns, *invals, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _emit(trace: Any, eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any] | None:
    """Stage `eqn` into the jaxpr being built, as `jax.jit` inlines a jaxpr: with the types
    the equation already has, so without running its abstract evaluation or staging rule
    again. None where an operand's type differs from the equation's, or for a "hi" equation
    (then it is bound)."""
    if eqn.primitive.ref_allocating or is_high(eqn):
        return None
    name_stack = _source_info_util.current_name_stack() + eqn.source_info.name_stack
    src = eqn.source_info.replace(name_stack=name_stack)
    tracers = []
    for v, x in zip(eqn.invars, invals):
        t = trace.to_jaxpr_tracer(x, src)
        if t.aval != v.aval:
            return None
        tracers.append(t)
    avals = [v.aval for v in eqn.outvars]
    return trace.emit_eqn(tracers, avals, eqn.primitive, eqn.params, eqn.effects, src, eqn.ctx)


def is_high(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is a "hi" equation: a `HiPrim` (jax 0.12's `jnp.searchsorted`,
    `jnp.nonzero(size=)`, `jnp.ldexp`, `lax.custom_root`, ...) or a call, loop or branch whose
    jaxpr holds one. JAX expands these into lower primitives when it binds them (a jaxpr that
    holds one is marked `is_high` and lowered before compilation); an equation copied into a
    jaxpr with `emit_eqn` skips that, and XLA later finds no lowering for
    `call_hi_primitive`."""
    return eqn.primitive.is_high(*(v.aval for v in eqn.invars), **eqn.params)


_package_dir = os.path.dirname(os.path.abspath(__file__))


def _installed(path: str) -> bool:
    """Whether `path` is a file of an installed package (Equinox, lineax, optimistix, ...)."""
    parts = os.path.normpath(path).split(os.sep)
    return "site-packages" in parts or "dist-packages" in parts


def eqn_location(eqn: JaxprEqn, outer: Sequence[JaxprEqn] = ()) -> str:
    """A short 'file:line (function)' of the user frame that created `eqn`: the innermost
    outside JAX, eqx_logs and installed packages (a `lx.linear_solve` call, not the Equinox
    function that binds its primitive), else the innermost outside JAX and eqx_logs. The
    traceback of an equation inside a jit stops at that jit: `outer` are the equations
    around `eqn` (outermost first), whose frames are searched next for one outside packages."""
    frames = [
        frame
        for e in (eqn, *reversed(outer))
        for frame in _source_info_util.user_frames(e.source_info.traceback)
        if not os.path.abspath(frame.file_name).startswith(_package_dir)
    ]
    frame = next((f for f in frames if not _installed(f.file_name)), frames[0] if frames else None)
    if frame is None:
        return "<unknown location>"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def function_name(eqn: JaxprEqn) -> str:
    """What the user wrote that made a call-like equation: its function and where it is
    defined (`'f at file.py:12'`), else where it was called."""
    debug = getattr(unpack(call_jaxpr(eqn))[0], "debug_info", None)
    where = getattr(debug, "func_src_info", None)
    return where if where else f"the call at {eqn_location(eqn)}"


def strip_jaxpr(closed: Any, is_log: Callable[[JaxprEqn], bool], effect: Effect) -> Any:
    jaxpr, _ = unpack(closed)
    eqns = [strip_eqn(e, is_log, effect) for e in jaxpr.eqns if not is_log(e)]
    new = jaxpr.replace(eqns=eqns, effects=jaxpr.effects - {effect})
    if _ClosedJaxpr is not None and isinstance(closed, _ClosedJaxpr):
        return closed.replace(jaxpr=new)
    return new


def with_params(eqn: JaxprEqn, **params: Any) -> JaxprEqn:
    """A copy of `eqn` with `params` changed (`eqn` itself is left as it is)."""
    return eqn.replace(params={**eqn.params, **params})


def strip_eqn(eqn: JaxprEqn, is_log: Callable[[JaxprEqn], bool], effect: Effect) -> JaxprEqn:
    """A new equation with every log equation removed from its sub-jaxprs. Nothing is
    mutated: JAX may have cached the original."""
    if effect not in eqn.effects:
        return eqn
    params = {}
    for name, value in eqn.params.items():
        if is_jaxpr(value):
            value = strip_jaxpr(value, is_log, effect)
        elif isinstance(value, tuple) and any(is_jaxpr(v) for v in value):
            value = tuple(strip_jaxpr(v, is_log, effect) if is_jaxpr(v) else v for v in value)
        params[name] = value
    return eqn.replace(params=params, effects=eqn.effects - {effect})


# Equinox's primitives (`eqxi.create_vprim`: lineax's `linear_solve`, and `vprim`, any of them
# under vmap) run a Python implementation when JAX lowers them. The functions it calls are
# parameters: jaxprs (closure-converted, in `static`) or Python functions, traced only then.
# (`vprim`: a `linear_solve` under vmap; `noinline`: `eqx.internal.noinline`'s calls)
EQUINOX_PRIMITIVES = frozenset({"linear_solve", "vprim", "noinline"})


def equinox_impl(eqn: JaxprEqn) -> Callable[..., Any] | None:
    """The implementation JAX lowers `eqn` with, if Equinox defined its primitive; else None."""
    name = eqn.primitive.name
    if name == "noinline":
        # `eqx.internal.noinline(f)`: its impl calls `f` (a parameter, in no jaxpr)
        module = sys.modules.get("equinox.internal._noinline")
        index = eqn.invars[0]
        ours = eqn.primitive is getattr(module, "noinline_p", None)
        if not ours or not isinstance(index, Literal):
            return None
        impl = functools.partial(eqn.primitive.impl, **eqn.params)
        # the function's index in Equinox's registry, read as a Python value: the literal
        return lambda _, *args: impl(index.val, *args)
    if name == "vprim":  # under vmap: another vprim's (Equinox's loops' `maybe_set`: no)
        name = getattr(eqn.params.get("prim"), "name", None)
    if name not in EQUINOX_PRIMITIVES:
        return None
    module = sys.modules.get("equinox.internal._primitive")
    impl = getattr(module, "_vprim_impl_registry", {}).get(eqn.primitive)
    return None if impl is None else functools.partial(impl, **eqn.params)


def derivative_noinline(eqn: JaxprEqn) -> bool:
    """Whether `eqn` is an `eqx.internal.noinline` call that JAX's AD made: its function under
    a JVP or transpose transform, which recomputes the forward pass (whose events the primal
    call has) to differentiate it."""
    if eqn.primitive.name != "noinline":
        return False
    noinline = sys.modules.get("equinox.internal._noinline")
    combine = getattr(sys.modules.get("equinox.internal._primitive"), "_combine", None)
    if noinline is None or combine is None:
        return False
    params = eqn.params
    _, _, transforms, _ = _tree_util.tree_unflatten(
        params["treedef"], combine(list(eqn.invars), params["static"])
    )
    derivative = (noinline._MetaTransposeTransform,)
    return any(t is noinline._jvp_transform or isinstance(t, derivative) for t in transforms)


def trace_on_avals(fun: Callable[..., Any], avals: Sequence[Any]) -> Any:
    """`fun` traced to a closed jaxpr on arguments of types `avals`."""
    structs = [
        ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False)) for a in avals
    ]
    return _make_jaxpr(fun)(*structs)


def primitive_jvp(eqn: JaxprEqn, primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
    """`eqn`'s JVP rule applied to `primals` and `tangents` (a symbolic zero, as a custom_jvp
    rule gets them with `symbolic_zeros=True`, or None, for a zero) as JAX applies it:
    returns `(outs, out_tangents)`, the tangents as arrays."""
    zeros = [
        _ad.Zero(_core.typeof(p).to_tangent_aval()) if t is None or type(t) is _SymbolicZero else t
        for p, t in zip(primals, tangents)
    ]
    outs, out_tangents = _ad.primitive_jvps[eqn.primitive](list(primals), zeros, **eqn.params)
    return list(outs), [_ad.instantiate_zeros(t) for t in out_tangents]


# ----------------------------------------------------------------------------------------
# The higher-order primitives, by name (names are stable across versions; objects move).
# ----------------------------------------------------------------------------------------

_HIGHER_ORDER = frozenset({"cond", "scan", "while", "pjit", "jit", "remat2", "checkpoint"})
INLINE_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "named_call", "eval_jaxpr"})
# Outside vmap, a custom_vmap call is its function (under a vmap inside the spool, JAX has
# already applied the rule).
CUSTOM_VMAP = "custom_vmap_call"
SCAN = "scan"
SHARD_MAP = "shard_map"  # `jax.shard_map`, and `jax.pmap` (a jit of a shard_map)
WHILE = "while"
COND = "cond"
REMAT = frozenset({"remat2", "checkpoint", "remat"})
CUSTOM_JVP = "custom_jvp_call"
CUSTOM_VJP = "custom_vjp_call"
CUSTOM_CALLS = frozenset({CUSTOM_JVP, CUSTOM_VJP})


def call_jaxpr(eqn: JaxprEqn) -> Any:
    """The jaxpr of a call-like equation (jit, closed_call, remat, custom_jvp/vjp)."""
    for name in ("jaxpr", "call_jaxpr", "fun_jaxpr", "call"):
        if name in eqn.params:
            return eqn.params[name]
    raise NotImplementedError(f"eqx_logs: cannot find the jaxpr of {eqn.primitive.name}")


def shard_map_parts(eqn: JaxprEqn) -> tuple[Any, Any, tuple, tuple, tuple[str, ...], bool]:
    """A shard_map's body (a jaxpr without constants), mesh, in and out specs (one per operand
    and result), its manual axes in mesh order, and `check_vma`."""
    p = eqn.params
    mesh = p["mesh"]
    manual = p["newly_manual_axes"] if "newly_manual_axes" in p else p["manual_axes"]
    axes = tuple(name for name in mesh.axis_names if name in manual)
    check = p["check_vma"] if "check_vma" in p else p["check_rep"]
    return p["jaxpr"], mesh, tuple(p["in_specs"]), tuple(p["out_specs"]), axes, check


def vary(x: Any, axes: tuple[str, ...]) -> Any:
    """`x` varying over the manual mesh `axes` (in a `shard_map` with `check_vma`), as a value
    computed from a device's own data is; a constant or a `psum` is not. States a loop carries
    there keep one type however the events they take in vary."""
    varying = _core.typeof(x).mat.varying
    missing = tuple(a for a in axes if a not in varying)
    return _lax.pcast(x, missing, to="varying") if missing else x


def scan_parts(eqn: JaxprEqn) -> tuple[Any, int, int]:
    """`(body, num_consts, num_carry)` of a scan equation."""
    params = eqn.params
    if "num_consts" in params:
        return params["jaxpr"], params["num_consts"], params["num_carry"]
    # jax 0.12: a flat tree (consts, carry, xs) describes the operands.
    consts, carry, _ = params["ft_in"].update(list(range(len(eqn.invars)))).unpack()
    return params["jaxpr"], len(list(consts)), len(list(carry))


def scan_options(eqn: JaxprEqn) -> dict[str, Any]:
    params = eqn.params
    return dict(length=params["length"], reverse=params["reverse"], unroll=params["unroll"])


def while_parts(eqn: JaxprEqn) -> tuple[Any, int, Any, int]:
    """`(cond_jaxpr, cond_nconsts, body_jaxpr, body_nconsts)` of a while equation."""
    p = eqn.params
    return p["cond_jaxpr"], p["cond_nconsts"], p["body_jaxpr"], p["body_nconsts"]


def cond_branches(eqn: JaxprEqn) -> tuple[Any, ...]:
    return tuple(eqn.params["branches"])


LINEAR_SOLVE = "custom_linear_solve"


def linear_solve_parts(eqn: JaxprEqn) -> tuple[dict[str, Any], dict[str, list[Any]], int]:
    """`(jaxprs, const_indices, num_consts)` of a custom_linear_solve equation: the jaxprs of
    `matvec`, `vecmat`, `solve` and `transpose_solve` (None where absent) by name, and the
    positions of each one's constants among the operands (then come the right-hand sides)."""
    jaxprs, lengths = eqn.params["jaxprs"], eqn.params["const_lengths"]
    names = ("matvec", "vecmat", "solve", "transpose_solve")
    out, positions, start = {}, {}, 0
    for name in names:
        out[name] = getattr(jaxprs, name)
        n = getattr(lengths, name)
        positions[name] = list(range(start, start + n))
        start += n
    return out, positions, start


# jax >= 0.12 binds some higher-order functions as "hi" primitives (`lax.custom_root` among
# them): an object of their own in the parameters, with the jaxprs it needs.
HI_CALL = "call_hi_primitive"


def hi_name(eqn: JaxprEqn) -> str | None:
    """The kind of a hi primitive's equation (`'SearchSorted'`, `'Scan3'`); else None."""
    prim = eqn.params.get("_prim") if eqn.primitive.name == HI_CALL else None
    return None if prim is None else type(prim).__name__


def hi_forward(eqn: JaxprEqn) -> tuple[Any, int] | None:
    """For a hi primitive whose forward computation is a jaxpr of its first operands (the
    `solve` of `lax.custom_root`): that jaxpr and how many operands it takes; else None."""
    prim = eqn.params.get("_prim")
    forward = getattr(prim, "params", {}).get("solve_jaxpr")
    if forward is None:
        return None
    return forward, len(_tree_leaves(prim.in_avals[:2]))


def remat_options(eqn: JaxprEqn) -> dict[str, Any]:
    return dict(prevent_cse=eqn.params["prevent_cse"], policy=eqn.params["policy"])


def recomputes(eqn: JaxprEqn) -> bool:
    """Whether a remat `eqn` is the forward pass recomputed for a backward pass (its logs
    stay with the primal pass; what a primitive's own function would log there, too)."""
    return bool(eqn.params.get("differentiated", False))


def close(jaxpr: Jaxpr, consts: Sequence[Any]) -> Any:
    """A jaxpr with its constants, in the form `unpack` reads."""
    if _ClosedJaxpr is not None:
        return _ClosedJaxpr(jaxpr, list(consts))
    return jaxpr.with_consts(list(consts)) if consts else jaxpr


# ----------------------------------------------------------------------------------------
# Custom derivatives rebuilt with extra inputs and outputs (the reduction states), as JAX's
# checkify does: the same primitive is bound again with new functions for the primal, the
# forward or JVP rule, and the backward rule. The user's rules run once, inside them.
# ----------------------------------------------------------------------------------------


# jax >= 0.12: a flat custom_vjp backward rule returns `(cotangents, logs)` (`vjp.with_logs`)
_BWD_RETURNS_LOGS = hasattr(_ad, "CustomBwdWithAccums")


def _wrap(fun: Callable, like: Any) -> Any:
    return _lu.wrap_init(fun, debug_info=like.debug_info)


def _tangent_zero(x: Any, symbolic: bool) -> Any:
    aval = _core.typeof(x).to_tangent_aval()
    return _SymbolicZero(aval) if symbolic else _ad_util.zeros_like_aval(aval)


def bind_custom_rules_in(eqn: JaxprEqn, invals: Sequence[Any], context: Callable[[], Any]):
    """Bind a custom_jvp/custom_vjp equation again as it is, except that its JVP, forward and
    backward rules (traced later by JAX, if it differentiates) run under the context manager
    `context()`. For calls whose primal does not log: their rules may."""
    params = dict(eqn.primitive.get_bind_params(eqn.params))
    subfuns = list(params.pop("subfuns"))

    def wrap(fun):
        def wrapped(*args):
            with context():
                return fun.call_wrapped(*args)

        return _wrap(wrapped, fun)

    subfuns[1:] = [wrap(f) for f in subfuns[1:]]  # (fun, jvp) or (fun, fwd, bwd)
    out = eqn.primitive.bind(*invals, subfuns=tuple(subfuns), **params)
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
    bwd_context: Callable[[], Any],
) -> list[Any]:
    """Bind a `custom_vjp_call` equation again on `[*invals, *extra]`. `fun(invals, extra)`
    returns `[*outs, *extra_outs]` (the primal); `fwd(fwd_jaxpr, args, extra)` evaluates the
    user's forward jaxpr (on the non-constant inputs) and returns `(res_and_outs,
    extra_outs)`. The user's forward rule is traced under the context manager
    `fwd_context()`, its backward rule under `bwd_context()`, on the cotangents of `outs`;
    extra inputs get zero cotangents. Returns `[*outs, *extra_outs]`."""
    params = eqn.params
    n_in, num_consts = len(invals), params["num_consts"]
    thunk, bwd, out_trees = params["fwd_jaxpr_thunk"], params["bwd"], params["out_trees"]

    def fun_(*xs):
        return fun(list(xs[:n_in]), list(xs[n_in:]))

    def fwd_(*xs):
        vals, nonzeros = xs[::2], xs[1::2]
        if any(nonzeros[:num_consts]):
            raise _ad.CustomVJPException()
        with fwd_context():
            jaxpr, consts = thunk.call_wrapped(*nonzeros[num_consts:n_in])
        res_and_outs, extra_outs = fwd(
            close(jaxpr, consts), list(vals[num_consts:n_in]), list(vals[n_in:])
        )
        return [*res_and_outs, *extra_outs]

    n_out = len(eqn.outvars)

    def bwd_(*xs):
        num_res = out_trees()[1].num_leaves
        res, cts = xs[:num_res], xs[num_res : num_res + n_out]
        with bwd_context():
            out = bwd.call_wrapped(*res, *cts)
        cts_in, logs = out if _BWD_RETURNS_LOGS else (out, None)
        cts_in = [*[None] * num_consts, *cts_in, *[None] * len(extra)]
        return (cts_in, logs) if _BWD_RETURNS_LOGS else cts_in

    subfuns = (_wrap(fun_, thunk), _wrap(fwd_, thunk), _wrap(bwd_, bwd))
    out = eqn.primitive.bind(
        *invals,
        *extra,
        subfuns=subfuns,
        out_trees=out_trees,
        symbolic_zeros=params["symbolic_zeros"],
    )
    return list(out)
