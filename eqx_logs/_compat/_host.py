"""Host callbacks that keep their order on any number of devices and processes.
`jax.debug.callback(..., ordered=True)` is refused by a program over more than one device
(its effect is not "shardable"), and `io_callback(..., ordered=True)` cannot be vmapped or
rematerialized. `host_callback` is `jax.debug.callback` (its rules for vmap, grad and
remat) with an ordered effect of its own that JAX may shard, lowered as `io_callback` is:
in a program over many devices (a sharded jit) it runs once, on the first device, with the
whole value (across processes: on process 0's); inside a `shard_map` whose axes are all
manual it runs on every device with that device's values."""

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from jax import lax as _lax, tree_util as _tree_util
from jax._src import (
    callback as _callback,
    core as _core,
    debugging as _debugging,
    dispatch as _dispatch,
    effects as _effects,
    sharding_impls as _sharding_impls,
)
from jax._src.interpreters import (
    ad as _ad,
    batching as _batching,
    mlir as _mlir,
    partial_eval as _pe,
)
from jax.sharding import (
    NamedSharding as _NamedSharding,
    PartitionSpec as _PartitionSpec,
    SingleDeviceSharding as _SingleDeviceSharding,
    reshard as _reshard,
)

from ._registry import def_primal_only, not_mapped, register_effect
from ._types import Effect, Primitive


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
