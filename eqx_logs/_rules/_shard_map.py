"""shard_map (and pmap): each device reduces its own events, as a vmap lane does."""

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from .. import _compat
from ._table import register


def _shard_map_count(plan, eqn):
    body, mesh, _, _, axes, _ = _compat.shard_map_parts(eqn)
    with plan.manual.inside(tuple((a, mesh.shape[a]) for a in axes), mesh=mesh):
        return plan.count(body)


def _shard_map_apply(interp, eqn, invals, states):
    body, mesh, in_specs, out_specs, axes, check_vma = _compat.shard_map_parts(eqn)
    handler = interp.handler
    keys = handler.keys(body)
    # a key's states have one leading axis per mesh axis: each device gets its own block
    specs = {k: P(*axes) for k in keys}

    def per_device(args, sub):
        with interp.on_device(args, axes, check_vma):
            outs, sub = interp.eval(body, args, handler.device_states(sub, len(axes)))
            sub = handler.device_blocks(sub, len(axes))
        return tuple(outs), sub

    run = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(in_specs, specs),
        out_specs=(out_specs, specs),
        axis_names=frozenset(axes),
        check_vma=check_vma,
    )
    entering = handler.settle(states, keys)
    blocks = handler.device_inputs(entering, tuple(mesh.shape[a] for a in axes))
    outs, sub = run(tuple(invals), per_device_blocks(blocks, mesh, axes))
    return list(outs), {**states, **handler.device_outputs(entering, sub)}


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
