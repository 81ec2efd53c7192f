"""Lane-local predicates: what each `vmap` lane would decide if it ran alone.

Equinox's loops (`eqx.internal.while_loop` of every kind, and so diffrax, optimistix and
lineax) make a batched loop predicate unbatched with `unvmap_any`: the loop runs while any lane
runs, the body runs for every lane, and Equinox guards its own carry with a per-lane select. A
log in that body would fire for lanes that are already done. Logs need the predicate each lane
computes alone, which is the operand of `unvmap_any`.

So the interpreter evaluates, next to the real value of every scalar computed from an
`unvmap_any`/`unvmap_all`, its *lane value*: the same computation with those reductions made
lane-local (`jnp.any` of one lane's operand) and Equinox's `nonbatchable` check skipped. The
cond and while rules hand the lane value of their index or predicate to `Interpreter.guard`,
and events under the guard are masked with it.

- Under a `vmap` outside the spool, the jaxpr still holds the unbatched `unvmap_any`: its lane
  value `jnp.any(x)` is batched per lane by that `vmap` later.
- Under a `vmap` inside the spool, the batching rule of `unvmap_any` (while logging is on)
  binds `lane_reduce_p` instead, which computes the same value but records which axes of its
  operand are batch axes, so the interpreter can reduce over the others only.

A lane value with no lane axes equals its value until a `vmap` batches them apart. Where
events use one (as a mask), they use `shadow(value, lane)`, which is `value` where nothing is
batched: XLA then drops the lane computation of a program no `vmap` batches, and the loops
carry no lane values.
"""

from collections.abc import Callable, Sequence
from typing import Any

import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np

from . import _compat

_REDUCE: dict[str, Callable] = {"any": jnp.any, "all": jnp.all}
# Equinox's primitives that reduce over the batch axes, and the reduction each one is.
_EQUINOX = {eqxi.unvmap_any_p.name: "any", eqxi.unvmap_all_p.name: "all"}
# Primitives that only check that their operand is unbatched: the identity on lane values.
_CHECKS = frozenset({eqxi.nonbatchable_p.name})

lane_reduce_p = _compat.Primitive("eqx_logs.lane_reduce")


@lane_reduce_p.def_abstract_eval
def _lane_reduce_abstract_eval(x, *, op, axes):
    del axes
    return _compat.ShapedArray((), x.dtype if op not in _REDUCE else np.dtype(bool))


def _lane_reduce_impl(x, *, op, axes):
    del axes
    return _REDUCE[op](x)


lane_reduce_p.def_impl(_lane_reduce_impl)
_compat.def_lowering(lane_reduce_p, lambda x, *, op, axes: [_lane_reduce_impl(x, op=op, axes=axes)])


shadow_p = _compat.Primitive("eqx_logs.shadow")
shadow_p.def_abstract_eval(lambda value, lane: lane)
shadow_p.def_impl(lambda value, lane: value)
_compat.def_lowering(shadow_p, lambda value, lane: [value])


def _shadow_batch(args, dims):
    (value, lane), (value_dim, lane_dim) = args, dims
    if value_dim is None and lane_dim is None:
        return shadow_p.bind(value, lane), None
    return lane, lane_dim  # batched apart: the lane value is what each lane computes


_compat.def_batching(shadow_p, _shadow_batch)


def shadow(value: Any, lane: Any) -> Any:
    """`lane` where a `vmap` batches it (or `value`), `value` elsewhere. For a lane value with no
    lane axes, whose value (without batching) is `value`."""
    value = jnp.broadcast_to(jnp.asarray(value, jnp.result_type(lane)), jnp.shape(lane))
    return shadow_p.bind(value, jnp.asarray(lane))


def _batch_axes(axes: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """The batch axes of an operand after a new batch axis was inserted at `dim` (outer
    vmaps first)."""
    return (dim, *(a + (a >= dim) for a in axes))


def _lane_reduce_batch(axis_data, args, dims, *, op, axes):
    del axis_data
    ((x,), (dim,)) = args, dims
    if dim is None:
        return lane_reduce_p.bind(x, op=op, axes=axes), None
    return lane_reduce_p.bind(x, op=op, axes=_batch_axes(axes, dim)), None


def _equinox_batching(op: str):
    def make(original):
        def rule(axis_data, args, dims, **params):
            ((x,), (dim,)) = args, dims
            if dim is None or not _compat.logging_enabled.value:
                return original(axis_data, args, dims, **params)
            return lane_reduce_p.bind(x, op=op, axes=(dim,)), None

        return rule

    return make


_compat.def_batching_with_axis(lane_reduce_p, _lane_reduce_batch)
for _name, _op in _EQUINOX.items():
    _compat.wrap_batching(_name, _equinox_batching(_op))


def is_lane_primitive(eqn: _compat.JaxprEqn) -> bool:
    name = eqn.primitive.name
    return eqn.primitive is lane_reduce_p or name in _EQUINOX


def has_lanes(closed: Any, *, nested: bool = False) -> bool:
    """Whether `closed` computes values that have lane values: at its top level, or (with
    `nested`) anywhere in it."""
    if nested:
        return _compat.any_eqn(closed, is_lane_primitive)
    return any(is_lane_primitive(eqn) for eqn in _compat.eqns(closed, deep=False))


def lane_value(eqn: _compat.JaxprEqn, invals: Sequence[Any]) -> Any:
    """The lane value of a lane-reducing equation's output: leading axes index the lanes
    known at this level (none for Equinox's own primitives: a later vmap adds them)."""
    (x,) = invals
    if eqn.primitive is not lane_reduce_p:
        # a scalar is its own reduction: no second computation that XLA could round apart
        return x if jnp.ndim(x) == 0 else _REDUCE[_EQUINOX[eqn.primitive.name]](x)
    axes = eqn.params["axes"]
    rest = tuple(i for i in range(jnp.ndim(x)) if i not in axes)
    y = _REDUCE[eqn.params["op"]](x, axis=rest)
    order = sorted(axes)
    return jnp.transpose(y, [order.index(a) for a in axes])


def propagate(eqn: _compat.JaxprEqn, invals: Sequence[Any], lanes: Sequence[Any]) -> Any:
    """The lane values of a scalar equation's outputs, given the lane values (or None) of its
    inputs; None where they cannot be followed (non-scalar outputs, control flow, lane values
    with different lane shapes)."""
    if any(v.aval.shape for v in eqn.outvars):
        return None
    if eqn.primitive.name not in _compat.INLINE_CALLS and any(_compat.sub_jaxprs(eqn.params)):
        return None  # control flow: not repeated for its lane values
    if eqn.primitive.name in _CHECKS:
        return [lanes[0]]
    shapes = {jnp.shape(lane) for lane in lanes if lane is not None}
    if len(shapes) != 1:
        return None

    def fun(*lane_args):
        it = iter(lane_args)
        args = [x if lane is None else next(it) for x, lane in zip(invals, lanes)]
        return _compat.bind_eqn(eqn, args)

    for _ in shapes.pop():
        fun = jax.vmap(fun)
    return fun(*(lane for lane in lanes if lane is not None))


def fit(mask: Any, batch_shape: tuple[int, ...]) -> Any:
    """A lane mask (outer lanes first) as an event mask for a key with `batch_shape`: lanes a
    key's events do not have (an unbatched value logged in a batched loop) are reduced with
    `any`; batch axes of the key the mask does not have are broadcast."""
    extra = jnp.ndim(mask) - len(batch_shape)
    if extra > 0:
        mask = jnp.any(mask, axis=tuple(range(extra)))
    mask = jnp.reshape(mask, jnp.shape(mask) + (1,) * (len(batch_shape) - jnp.ndim(mask)))
    return jnp.broadcast_to(mask, batch_shape)
