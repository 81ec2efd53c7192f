"""What the plan learns about each key: its `KeyInfo`, unified over all its log sites.

`record` adds one log equation's sites to the keys' records and checks that they agree (shape,
dtype, pytree structure, steps, vmap and mesh axes), naming both call sites where they do not.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.sharding import NamedSharding, PartitionSpec

from .. import _compat
from .._buffers import as_reduction
from .._primitive import is_log


@dataclasses.dataclass
class KeyInfo:
    """What the first pass learns about one key."""

    treedef: Any
    leaves: list[jax.ShapeDtypeStruct]
    weak: list[bool]
    steps: dict[str, jax.ShapeDtypeStruct]
    sites: list[str]
    nbatch: int
    reduce: list[tuple[str, Any]]  # (call site, the reduction it names), every site seen
    specs: list[tuple[Any, ...] | None]  # each leaf's partition spec over Explicit axes
    # Sites logged the key under vmaps of different sizes (`lax.map(..., batch_size=k)` with a
    # remainder): then each lane of each event is an event of its own, in lane order.
    lanes_as_events: bool = False
    # The manual mesh axes (`jax.shard_map`, `jax.pmap`) the key is logged under: its leading
    # batch axes, one per mesh axis, as `vmap`'s (see `_manual.py`).
    mesh: tuple[str, ...] = ()
    devices: Any = None  # the `jax.sharding.Mesh` of those axes
    spec_mesh: Any = None  # the (abstract) mesh of `specs`: no mesh context is needed
    # The `vmap` axis names of the batch axes after the mesh axes (None where unnamed).
    lane_names: tuple[Any, ...] = ()

    def axis_names(self) -> tuple[Any, ...]:
        """A name per batch axis: the mesh axes, then the vmap axes (`across` merges these)."""
        return self.mesh + self.lane_names

    def to_lanes_as_events(self) -> None:
        batch = self.batch_shape()
        self.leaves = [jax.ShapeDtypeStruct(s.shape[self.nbatch :], s.dtype) for s in self.leaves]
        self.steps = {n: _unbatched(s, batch) for n, s in self.steps.items()}
        self.specs = [None if spec is None else spec[self.nbatch :] for spec in self.specs]
        self.nbatch, self.lanes_as_events, self.lane_names = 0, True, ()

    def widen(self, batch: tuple[int, ...], names: tuple[Any, ...]) -> None:
        """Give the unbatched key the vmap axes `batch`: a site logs it batched (or under a
        batched mask) where its earlier sites are unbatched. Their events are broadcast along
        the axes (`broadcast_site`)."""
        self.leaves = [jax.ShapeDtypeStruct(batch + s.shape, s.dtype) for s in self.leaves]
        self.steps = {
            n: jax.ShapeDtypeStruct(batch + s.shape, s.dtype) for n, s in self.steps.items()
        }
        self.specs = [None if p is None else (None,) * len(batch) + p for p in self.specs]
        self.nbatch, self.lane_names = len(batch), names

    def shard_like_values(self, state: Any) -> Any:
        """`state` (of the value channel) with each leaf that holds values of a sharded leaf
        (its last dims are that leaf's, after the batch axes) sharded the same way: under
        Explicit mesh axes a buffer must have the sharding of what is written into it."""
        sharded = [(s.shape, spec) for s, spec in zip(self.leaves, self.specs) if spec]
        if not sharded:
            return state
        n = self.nbatch

        def shard(x):
            for shape, spec in sharded:
                extra = x.ndim - len(shape)
                if extra >= 0 and x.shape[:n] == shape[:n] and x.shape[n + extra :] == shape[n:]:
                    new = PartitionSpec(*spec[:n], *[None] * extra, *spec[n:])
                    return jax.sharding.reshard(x, NamedSharding(self.spec_mesh, new))
            return x

        return jtu.tree_map(shard, state)

    def batch_shape(self) -> tuple[int, ...]:
        return self.leaves[0].shape[: self.nbatch]

    def lane_struct(self) -> Any:
        """The structure of one event of one batch lane."""
        leaves = [jax.ShapeDtypeStruct(s.shape[self.nbatch :], s.dtype) for s in self.leaves]
        return jtu.tree_unflatten(self.treedef, leaves)

    def site_reduce(self, key: str) -> Any:
        named = [(site, r) for site, r in self.reduce if r is not None]
        if len({as_reduction(r) for _, r in named}) > 1:
            detail = "; ".join(dict.fromkeys(f"{r!r} at {site}" for site, r in named))
            raise ValueError(
                f"eqx_logs: key {key!r} is logged with different reductions ({detail}). Name "
                "one reduction per key, or set it once with a Policy rule."
            )
        return named[0][1] if named else None


def site_list(sites: Sequence[str]) -> str:
    return "; ".join(dict.fromkeys(sites))


def _python_scalar(dtype) -> Any:
    """A Python scalar of `dtype`'s kind: promotes like a weakly typed value of that dtype."""
    for kind, value in ((jnp.bool_, True), (jnp.integer, 1), (jnp.floating, 1.0)):
        if jnp.issubdtype(dtype, kind):
            return value
    return 1j


def _unbatched(s: jax.ShapeDtypeStruct, batch: tuple[int, ...]) -> jax.ShapeDtypeStruct:
    """`s` without the leading `batch` axes, if it has them."""
    n = len(batch)
    if s.shape[:n] != batch:
        return s
    return jax.ShapeDtypeStruct(s.shape[n:], s.dtype)


def _vmap_depth_hint(info: KeyInfo, nbatch: int, site: str) -> str:
    """Why a key's shapes differ when its sites are under different numbers of vmap axes
    (`info.nbatch` and `nbatch`), and what to write instead."""

    def axes(n: int) -> str:
        return f"{n} vmap ax{'i' if n == 1 else 'e'}s"

    where = (
        f"at the same call site {site}, so a `jax.vmap` inside the spooled function runs "
        "around that log on some paths and not on others: most often a vmap inside library "
        "code that calls your function (optimistix's `NelderMead` evaluates its simplex "
        "under `jax.vmap`, and its other points without)"
        if site in info.sites
        else f"at {site_list(info.sites)} and at {site}"
    )
    return (
        f" The key is logged under {axes(info.nbatch)} and under {axes(nbatch)} {where}. "
        "Unnamed vmap axes cannot be told apart, so the spool cannot know which leading axis "
        "is which vmap's. Put the spool inside your own vmap, `jax.vmap(eqx_logs.spool(f))` "
        "instead of `eqx_logs.spool(jax.vmap(f))`: each lane is then its own run (what "
        "`eqx_logs.spool(f)` gives for that lane alone), and a key logged both inside and "
        "outside the library's vmap takes its batch, the other events broadcast to its "
        "lanes. Or give the sites keys of their own, or wrap the library call in "
        "`eqx_logs.nolog`."
    )


def _adapts(weak: Any, dtype: Any) -> bool:
    """Whether a weakly typed Python scalar of dtype `weak` takes `dtype` as it is logged."""
    return jnp.result_type(dtype, _python_scalar(weak)) == dtype


def _merge_leaf(key, info, i, shape, dtype, weak, site, why=""):
    old = info.leaves[i]
    earlier = site_list(info.sites)
    if old.shape != shape:
        raise ValueError(
            f"eqx_logs: key {key!r} is logged with shape {old.shape} (at {earlier}) and with "
            f"shape {shape} (at {site})."
            + (
                why
                or " Every event of one key must have the same shape and dtype; log the "
                "differently shaped values under different keys."
            )
        )
    if old.dtype == dtype:
        info.weak[i] = info.weak[i] and weak
        return
    if weak and not info.weak[i] and _adapts(dtype, old.dtype):
        return  # a weakly typed Python scalar adapts
    if info.weak[i] and not weak and jnp.result_type(dtype, _python_scalar(old.dtype)) == dtype:
        info.leaves[i] = jax.ShapeDtypeStruct(shape, dtype)
        info.weak[i] = False
        return
    raise TypeError(
        f"eqx_logs: key {key!r} is logged with dtype {old.dtype} (at {earlier}) and with "
        f"dtype {dtype} (at {site}). Every event of one key must have the same dtype; cast one "
        "of them."
    )


def events_per_log(infos: dict[str, KeyInfo], eqn: _compat.JaxprEqn, key: str) -> int:
    """Events one execution of a log equation makes for `key`: one, or one per lane."""
    nb = eqn.params["nbatch"]
    if not infos[key].lanes_as_events or not nb:
        return 1
    treedef = eqn.params["treedef"]
    first = jtu.tree_leaves(jtu.tree_unflatten(treedef, list(range(treedef.num_leaves)))[key])
    return math.prod(eqn.invars[first[0]].aval.shape[:nb])


def check_rule_dtypes(infos: dict[str, KeyInfo], closed: Any, name: str) -> None:
    """Every log in `closed`, the custom derivative rule of `name`, logs each key known
    here with its dtype (a rule's events replace its primal's under differentiation)."""
    jaxpr, _ = _compat.unpack(closed)
    for eqn in jaxpr.eqns:
        for sub in _compat.sub_jaxprs(eqn.params):
            check_rule_dtypes(infos, sub, name)
        if not is_log(eqn):
            continue
        treedef = eqn.params["treedef"]
        items = jtu.tree_unflatten(treedef, eqn.invars[: treedef.num_leaves])
        for key, tree in items.items():
            info = infos.get(key)
            if info is None:
                continue  # passes on (see `_event`)
            for v, old in zip(jtu.tree_leaves(tree), info.leaves):
                weak = getattr(v.aval, "weak_type", False)
                if v.aval.dtype == old.dtype or (weak and _adapts(v.aval.dtype, old.dtype)):
                    continue
                raise TypeError(
                    f"eqx_logs: key {key!r} is logged with dtype {old.dtype} (at "
                    f"{site_list(info.sites)}) and with dtype {v.aval.dtype} in the "
                    f"derivative rule of {name} (at {eqn.params['site']}). Under "
                    "differentiation the rule's events replace the primal's, so the key "
                    "would change dtype with `jax.grad`; cast one of them."
                )


def record(
    infos: dict[str, KeyInfo],
    eqn: _compat.JaxprEqn,
    manual: tuple[tuple[str, int], ...],
    devices: Any,
    across: tuple[Any, ...],
) -> list[str]:
    """Add the sites of the log equation `eqn` to the records of its keys (`infos`), checking
    that they agree with the key's earlier sites; returns its keys. `manual`: the manual mesh
    axes (names and sizes) of the shard_maps around it, on the `jax.sharding.Mesh` `devices`;
    `across`: the policy's."""
    params = eqn.params
    treedef, site = params["treedef"], params["site"]
    n_leaves = treedef.num_leaves
    # inside a shard_map the mesh axes lead, as batch axes
    mesh = tuple(name for name, _ in manual)
    lead = tuple(size for _, size in manual)
    avals = [v.aval.update(shape=lead + v.aval.shape) if lead else v.aval for v in eqn.invars]
    items = jtu.tree_unflatten(treedef, list(range(n_leaves)))
    steps = {
        name: jax.ShapeDtypeStruct(a.shape, a.dtype)
        for name, a in zip(params["steps"], avals[n_leaves : n_leaves + len(params["steps"])])
    }
    nb = len(lead) + params["nbatch"]
    for key, positions in items.items():
        sub_leaves, sub_def = jtu.tree_flatten(positions)
        info = infos.get(key)
        if info is None:
            infos[key] = KeyInfo(
                treedef=sub_def,
                leaves=[jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype) for i in sub_leaves],
                weak=[bool(getattr(avals[i], "weak_type", False)) for i in sub_leaves],
                steps=dict(steps),
                sites=[site],
                nbatch=nb,
                reduce=[(site, params["reduce"])],
                specs=[None if mesh else _compat.explicit_spec(avals[i]) for i in sub_leaves],
                spec_mesh=next(
                    (avals[i].sharding.mesh for i in sub_leaves if _compat.explicit_spec(avals[i])),
                    None,
                ),
                mesh=mesh,
                devices=devices,
                lane_names=params["axis_names"],
            )
            continue
        if info.mesh != mesh:
            where = f"inside a shard_map over {mesh}" if mesh else "outside any shard_map"
            there = f"inside a shard_map over {info.mesh}" if info.mesh else "outside"
            raise ValueError(
                f"eqx_logs: key {key!r} is logged {where} at {site}, and {there} at "
                f"{site_list(info.sites)}. Each device reduces the events it logs inside a "
                "shard_map (or pmap) on its own, so those events cannot share a key with "
                "others: give them a key of their own."
            )
        names = params["axis_names"]
        if names != info.lane_names and set(across) & {*names, *info.lane_names}:
            raise ValueError(
                f"eqx_logs.spool(across={across!r}): key {key!r} is logged "
                f"under vmap axes {names} at {site} and {info.lane_names} at "
                f"{site_list(info.sites)}, so its lanes cannot be merged over one axis. "
                "Log it under the same vmaps everywhere, or give the sites keys of their own."
            )
        if info.treedef != sub_def:
            raise ValueError(
                f"eqx_logs: key {key!r} is logged with pytree structure {sub_def} at {site} "
                f"and {info.treedef} at {site_list(info.sites)}. Every event of one key must "
                "have the same structure."
            )
        key_avals, key_steps, key_nb = avals, steps, nb
        if nb != info.nbatch and not mesh and not info.lanes_as_events:
            key_avals, key_steps, key_nb = broadcast_site(info, avals, sub_leaves, steps, nb, names)
        batch = key_avals[sub_leaves[0]].shape[:key_nb]
        if (
            not info.lanes_as_events
            and key_nb
            and key_nb == info.nbatch
            and batch != info.batch_shape()
            and all(
                key_avals[i].shape[key_nb:] == s.shape[key_nb:]
                for i, s in zip(sub_leaves, info.leaves)
            )
        ):
            info.to_lanes_as_events()
        if info.lanes_as_events:  # compare one lane of this site's events
            key_steps = {n: _unbatched(s, batch) for n, s in key_steps.items()}
        why = ""
        if key_nb != info.nbatch and not mesh and not info.mesh and not info.lanes_as_events:
            why = _vmap_depth_hint(info, key_nb, site)
        for j, i in enumerate(sub_leaves):
            a = key_avals[i]
            shape = a.shape[key_nb:] if info.lanes_as_events else a.shape
            weak = getattr(a, "weak_type", False)
            _merge_leaf(key, info, j, shape, a.dtype, weak, site, why)
        for name, s in key_steps.items():
            if name in info.steps and info.steps[name].shape != s.shape:
                raise ValueError(
                    f"eqx_logs: step {name!r} of key {key!r} has shape {s.shape} at {site} "
                    f"but {info.steps[name].shape} at {site_list(info.sites)}."
                )
            info.steps.setdefault(name, s)
        info.sites.append(site)
        info.reduce.append((site, params["reduce"]))
    return list(items)


def broadcast_site(info: KeyInfo, avals, leaves: list[int], steps, nb: int, names):
    """A site that logs a key unbatched where its other sites are batched, or the other
    way round: under `spool(vmap(f))`, a value vmap leaves unbatched (a loop index)
    logged both outside and inside a cond whose predicate is batched (the mask batches
    the second). The key takes the batch, and the unbatched site's avals and steps are
    returned as broadcast to it (its events are, in `_event_of`), as each lane of
    `jax.vmap(spool(f))` sees them. Only where the shapes differ as they are and agree
    after the batch axes (a key whose unbatched site logs a whole batch, shaped as the
    batched site's, is left as it was); and not for a site batched over some of the
    key's vmaps but not all (unnamed vmap axes cannot be told apart): the shapes are
    then compared as they are. `leaves` are the positions of the key's leaves in
    `avals`."""
    shapes = [avals[i].shape for i in leaves]
    if shapes == [s.shape for s in info.leaves]:
        return avals, steps, nb
    events = [s.shape[info.nbatch :] for s in info.leaves]
    if info.nbatch == 0 and [shape[nb:] for shape in shapes] == events:
        info.widen(shapes[0][:nb], names)
        return avals, steps, nb
    if nb == 0 and shapes == events:
        lead = info.batch_shape()
        avals = [a.update(shape=lead + a.shape) for a in avals]
        steps = {n: jax.ShapeDtypeStruct(lead + s.shape, s.dtype) for n, s in steps.items()}
        return avals, steps, info.nbatch
    return avals, steps, nb


# -- second pass --------------------------------------------------------------------


def keys_of(eqn: _compat.JaxprEqn) -> list[str]:
    """The keys a log equation logs."""
    treedef = eqn.params["treedef"]
    return list(jtu.tree_unflatten(treedef, [None] * treedef.num_leaves))
