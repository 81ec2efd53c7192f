"""Reading and evaluating jaxprs."""

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jax import ShapeDtypeStruct, make_jaxpr as _make_jaxpr
from jax._src import (
    core as _core,
    dtypes as _dtypes,
    hijax as _hijax,
    source_info_util as _source_info_util,
)
from jax._src.ad_util import SymbolicZero as _SymbolicZero
from jax._src.interpreters import ad as _ad, partial_eval as _pe
from jax.tree_util import tree_leaves as _tree_leaves

from ._higher_order import call_jaxpr
from ._types import ClosedJaxprType, Effect, Jaxpr, JaxprEqn, closed_types


def unpack(closed: Any) -> tuple[Jaxpr, list[Any]]:
    """`(jaxpr, consts)` of what `jax.make_jaxpr` returns or a sub-jaxpr found in params."""
    if ClosedJaxprType is not None and isinstance(closed, ClosedJaxprType):
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
    return isinstance(x, closed_types)


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


def eqns(closed: Any, *, deep: bool = True) -> Iterator[JaxprEqn]:
    """The equations of `closed` in program order, each followed (with `deep`) by those of the
    jaxprs it holds (`sub_jaxprs`), at any depth. This is the one walk over jaxprs: what looks
    at equations (the plan, streaming, tap's splitters, the custom rules' checks) is a loop
    over it. Lazy: a search stops where it finds."""
    for eqn in unpack(closed)[0].eqns:
        yield eqn
        if deep:
            for sub in sub_jaxprs(eqn.params):
                yield from eqns(sub)


def any_eqn(closed: Any, pred: Callable[[JaxprEqn], bool]) -> bool:
    """Whether an equation of `closed`, at any depth (`sub_jaxprs`), satisfies `pred`."""
    return any(pred(eqn) for eqn in eqns(closed))


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
        # canonical, as `Primitive.bind` makes them: a numpy array (an argument a `vmap`
        # outside the spool leaves unbatched) is no constant of a jaxpr as it is
        t = trace.to_jaxpr_tracer(_dtypes.canonicalize_value(x), src)
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


# eqx_logs/ (this module is in eqx_logs/_compat/): frames of any of its modules are skipped
_package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    return _location([e.source_info.traceback for e in (eqn, *reversed(outer))])


def current_location() -> str:
    """`eqn_location` of the equation JAX is transposing now: its backward pass runs each
    equation's transpose under that equation's source information (for a custom_vjp call,
    where the user called the function)."""
    return _location([_source_info_util.current().traceback])


def _location(tracebacks: Sequence[Any]) -> str:
    frames = [
        frame
        for traceback in tracebacks
        for frame in _source_info_util.user_frames(traceback)
        if not os.path.abspath(frame.file_name).startswith(_package_dir)
    ]
    frame = next((f for f in frames if not _installed(f.file_name)), frames[0] if frames else None)
    if frame is None:
        return "<unknown location>"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def in_backward_pass(eqn: JaxprEqn) -> bool:
    """Whether JAX made `eqn` by transposing (the backward pass of a `jax.grad` or `jax.vjp`
    traced into the program): its name stack has a `transpose` transform."""
    return any(
        isinstance(s, _source_info_util.Transform) and s.name == "transpose"
        for s in eqn.source_info.name_stack.stack
    )


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
    if ClosedJaxprType is not None and isinstance(closed, ClosedJaxprType):
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
