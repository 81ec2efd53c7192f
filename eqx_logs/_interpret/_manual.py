"""Manual mesh axes: the `shard_map`s (and pmaps) around the equation being evaluated.

A key logged inside a shard_map has one leading batch axis per manual mesh axis, as a vmap
lane's: each device reduces its own events into its block of the key's states. Inside the body
those axes have size 1 (the device's own block). After the run, `merge_across` merges the
blocks (and vmap lanes) over the axes the policy names in `across`.
"""

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from .. import _compat, _lanes
from .._methods import method
from ._keys import KeyInfo
from ._values import known, vmap_n


class ManualAxes:
    def __init__(self):
        self.axes: tuple[tuple[str, int], ...] = ()  # manual mesh axes here, with sizes
        self.vary: tuple[str, ...] = ()  # those of them whose values' variation JAX checks
        self.mesh: Any = None  # the mesh of the shard_map being counted

    @contextlib.contextmanager
    def inside(self, axes: tuple[tuple[str, int], ...], check_vma: bool = False, mesh=None):
        """Inside the body of a `shard_map` over `axes` (names and sizes) of `mesh`: the events
        of a key logged there are one device's, and its states are that device's block of the
        key's states, whose leading batch axes are the mesh axes (of size 1 here)."""
        outer = self.axes, self.vary, self.mesh
        self.axes = self.axes + axes
        self.mesh = mesh
        if check_vma:
            self.vary = self.vary + tuple(name for name, _ in axes)
        try:
            yield
        finally:
            self.axes, self.vary, self.mesh = outer

    def local_axes(self, info: KeyInfo) -> int:
        """How many of the key's batch axes are mesh axes of the shard_map being evaluated."""
        return len(info.mesh) if self.axes else 0

    def batch_shape(self, info: KeyInfo) -> tuple[int, ...]:
        """The batch shape of the key's states here: the mesh axes of a `shard_map` being
        evaluated have size 1 (each device holds its own block)."""
        n = self.local_axes(info)
        return (1,) * n + info.batch_shape()[n:]

    def fit(self, info: KeyInfo, mask: Any) -> Any:
        """`_lanes.fit` for the key's batch here: a mask has no mesh axes (one device's)."""
        n = self.local_axes(info)
        return self.lead(info, _lanes.fit(mask, self.batch_shape(info)[n:]))

    def lead(self, info: KeyInfo, x: Any) -> Any:
        """A value of one device's event of the key with the mesh axes put first (size 1), and
        varying over them: the device's own."""
        n = self.local_axes(info)
        if n == 0:
            return x
        return _compat.vary(lax.expand_dims(x, tuple(range(n))), self.vary)


def check_across(infos: dict[str, KeyInfo], across: tuple[Any, ...]) -> None:
    axes = {a for info in infos.values() for a in info.axis_names() if a is not None}
    missing = [a for a in across if a not in axes]
    if axes and missing:
        raise ValueError(
            f"eqx_logs.spool(across={across!r}): no shard_map, pmap or named "
            f"vmap that logs has the axis {missing[0]!r}; those that log are over "
            f"{sorted(axes, key=str)}."
        )


def merge_across(
    info: KeyInfo,
    state: dict[str, Any],
    channels: dict[str, Any],
    bound: int | None,
    lane_struct: Callable[[str], Any],
    across: tuple[Any, ...],
) -> tuple[dict[str, Any], tuple[int, ...]]:
    """A key's state with the devices' (or vmap lanes') states merged over the axes named in
    `across`, in device (lane) order; and its batch shape left. `channels`: the key's
    reduction per channel; `bound`: on its events; `lane_struct(channel)`: one lane's event."""
    nbatch = info.nbatch
    merged = [j for j, a in enumerate(info.axis_names()) if a in across]
    state, batch = dict(state), info.batch_shape()
    for j in reversed(merged):  # later axes first: row-major device order
        size, rest = batch[j], batch[:j] + batch[j + 1 :]
        for name in ("count", "seen"):
            if name in state:
                x = state[name]
                state[name] = np.sum(x, axis=j) if known(x) else jnp.sum(x, axis=j)
        bound = None if bound is None else bound * size  # every device's events
        for channel, reduction in channels.items():
            init = method(reduction, "init")(lane_struct(channel), bound)
            out = jtu.tree_map(lambda x: jnp.broadcast_to(x, rest + jnp.shape(x)), init)
            out = _placed(out, state[channel], j, len(rest))
            merge = vmap_n(method(reduction, "merge"), nbatch - 1)
            parts = jtu.tree_map(lambda x: _unsharded(x, j, info.devices), state[channel])
            if not isinstance(size, int):  # a vmap's symbolic size (`jax.export`)
                state[channel] = _merge_scanned(merge, out, parts, j)
                continue
            parts = [jtu.tree_map(lambda x: jnp.take(x, d, j), parts) for d in range(size)]
            if _shapes(parts[0]) == _shapes(out):  # (init is merge's identity)
                out, parts = parts[0], parts[1:]
            for part in parts:  # a state that grows (a stack) starts from init
                out = merge(out, part)
            state[channel] = out
        nbatch, batch = nbatch - 1, rest
    return state, batch


def _shapes(tree: Any) -> Any:
    return jtu.tree_structure(tree), [
        (jnp.shape(x), jnp.result_type(x)) for x in jtu.tree_leaves(tree)
    ]


def _merge_scanned(merge: Callable, out: Any, parts: Any, axis: int) -> Any:
    """`out` merged with each slice of `parts` along `axis`, in order, as
    `merge_across` does, in a `lax.scan`: for an axis whose size is symbolic (a
    vmap's under `jax.export`), which a Python loop cannot unroll. Merges keep the shape of
    their first state (a stack merges into its buffer), so the carry keeps its type."""
    parts = jtu.tree_map(lambda x: jnp.moveaxis(x, axis, 0), parts)
    # a state of merge's shape is its first part, as in the loop (the rest has symbolic size)
    first = _shapes(jtu.tree_map(lambda x: x[0], parts)) == _shapes(out)

    def step(out, part_and_index):
        part, i = part_and_index
        merged = merge(out, part)
        if first:
            merged = jtu.tree_map(lambda p, m: jnp.where(i == 0, p, m), part, merged)
        return merged, None

    size = jtu.tree_leaves(parts)[0].shape[0]
    return lax.scan(step, out, (parts, jnp.arange(size)))[0]


def _placed(init: Any, state: Any, axis: int, nbatch: int) -> Any:
    """A merge's first state `init` (with `nbatch` batch axes) laid out as the devices'
    `state` is without its merged `axis`, where Explicit mesh axes type `state`: a stack
    writes the devices' events into it, and an update must have its buffer's sharding."""

    def place(x, like):
        spec = _compat.explicit_spec(jax.typeof(like))
        if spec is None:
            return x
        spec = (*spec[:axis], *spec[axis + 1 :])[:nbatch]
        mesh = jax.typeof(like).sharding.mesh
        return jax.reshard(x, NamedSharding(mesh, PartitionSpec(*spec)))

    return jtu.tree_map(place, init, state)


def _unsharded(x: Any, axis: int, mesh: Any) -> Any:
    """`x` with its `axis` (a mesh axis of `mesh`, or a vmap's: None) on every device, once:
    a merge over the devices then reads each device's block without moving it again (and
    where Explicit mesh axes shard `x` there, only so may it read them)."""
    spec = _compat.explicit_spec(jax.typeof(x))
    if spec is None and mesh is not None and isinstance(mesh, jax.sharding.Mesh):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec()))
    if spec is None or len(spec) <= axis or spec[axis] is None:
        return x
    spec = PartitionSpec(*spec[:axis], None, *spec[axis + 1 :])
    return jax.reshard(x, NamedSharding(jax.typeof(x).sharding.mesh, spec))
