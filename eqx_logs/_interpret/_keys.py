"""What the plan learns about each key: its `KeyInfo`, unified over all its log sites.

The plan first collects every log equation's `Site` of each key (`sites_of`), then `merge`s
each key's sites once, with all of them in hand: the layout (batch axes, lanes as events) is
decided from all of them, and every site is checked against it (shape, dtype, pytree
structure, steps, vmap and mesh axes), naming both call sites where two disagree. The records
are not changed afterwards.
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
from .._primitive import is_log
from .._reduce import as_reduction


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
    # The batch shape (`nbatch` axes): kept apart from `leaves`, which a key logged with no
    # value (`log("tick", ())`, a count only) has none of.
    batch: tuple[Any, ...] = ()

    def axis_names(self) -> tuple[Any, ...]:
        """A name per batch axis: the mesh axes, then the vmap axes (`across` merges these)."""
        return self.mesh + self.lane_names

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
        return self.batch

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
    # every operand of a batched log has its batch axes (a key with no value has no leaf)
    return math.prod(eqn.invars[0].aval.shape[:nb])


def check_rule_dtypes(infos: dict[str, KeyInfo], closed: Any, name: str) -> None:
    """Every log in `closed`, the custom derivative rule of `name`, logs each key known
    here with its dtype (a rule's events replace its primal's under differentiation)."""
    for eqn in _compat.eqns(closed):
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


@dataclasses.dataclass(frozen=True)
class Site:
    """One log equation's view of one key: what `merge` unifies. Shapes include the batch
    axes the site logs under (the mesh axes first, then its vmaps': `nbatch` in all)."""

    site: str
    treedef: Any
    leaves: tuple[jax.ShapeDtypeStruct, ...]
    weak: tuple[bool, ...]
    steps: dict[str, jax.ShapeDtypeStruct]
    nbatch: int
    names: tuple[Any, ...]  # the vmap axis names
    reduce: Any
    specs: tuple[tuple[Any, ...] | None, ...]
    spec_mesh: Any
    mesh: tuple[str, ...]
    devices: Any
    lead: tuple[Any, ...]  # the batch shape: that of every operand of a batched log

    def batch(self) -> tuple[int, ...]:
        return self.lead

    def events(self) -> list[tuple[int, ...]]:
        """Each leaf's shape after the batch axes."""
        return [s.shape[self.nbatch :] for s in self.leaves]


def sites_of(
    eqn: _compat.JaxprEqn, manual: tuple[tuple[str, int], ...], devices: Any
) -> dict[str, Site]:
    """The `Site` of each key of the log equation `eqn`. `manual`: the manual mesh axes
    (names and sizes) of the shard_maps around it, on the `jax.sharding.Mesh` `devices`."""
    params = eqn.params
    treedef, site = params["treedef"], params["site"]
    n_leaves = treedef.num_leaves
    # inside a shard_map the mesh axes lead, as batch axes
    mesh = tuple(name for name, _ in manual)
    lead = tuple(size for _, size in manual)
    avals = [v.aval.update(shape=lead + v.aval.shape) if lead else v.aval for v in eqn.invars]
    steps = {
        name: jax.ShapeDtypeStruct(a.shape, a.dtype)
        for name, a in zip(params["steps"], avals[n_leaves : n_leaves + len(params["steps"])])
    }
    nbatch = len(lead) + params["nbatch"]
    # every operand of a log has its batch axes, those of a key without value leaves too
    batch = avals[0].shape[:nbatch] if avals else lead
    out = {}
    for key, positions in jtu.tree_unflatten(treedef, list(range(n_leaves))).items():
        at, sub_def = jtu.tree_flatten(positions)
        specs = tuple(None if mesh else _compat.explicit_spec(avals[i]) for i in at)
        out[key] = Site(
            site=site,
            treedef=sub_def,
            leaves=tuple(jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype) for i in at),
            weak=tuple(bool(getattr(avals[i], "weak_type", False)) for i in at),
            steps=steps,
            nbatch=nbatch,
            names=params["axis_names"],
            reduce=params["reduce"],
            specs=specs,
            spec_mesh=next((avals[i].sharding.mesh for i, p in zip(at, specs) if p), None),
            mesh=mesh,
            devices=devices,
            lead=batch,
        )
    return out


def merge(key: str, sites: Sequence[Site], across: tuple[Any, ...]) -> KeyInfo:
    """The record of `key`, logged at `sites` (all of them, in the order the plan met them):
    its layout decided once from all of them, then each site checked against it. Raises an
    error naming both call sites where two disagree; `across`: the policy's."""
    first = sites[0]
    for s in sites[1:]:
        _check_same(key, first, s, across)
    lanes = _lanes_as_events(sites)
    # The layout's batch axes: the first batched site's, unless lanes are events. An
    # unbatched site whose events are shaped as the key's is broadcast along them.
    target = None if lanes else next((s for s in sites if s.nbatch), None)
    ref = target or first
    nbatch = 0 if target is None else target.nbatch
    info = KeyInfo(
        treedef=first.treedef,
        leaves=[],
        weak=list(ref.weak),
        steps={},
        sites=[ref.site],
        nbatch=nbatch,
        reduce=[(s.site, s.reduce) for s in sites],
        specs=_specs(first, nbatch, lanes),
        lanes_as_events=lanes,
        mesh=first.mesh,
        devices=first.devices,
        spec_mesh=first.spec_mesh,
        lane_names=() if target is None else target.names,
        batch=() if target is None else target.batch(),
    )
    shapes, _, _ = _laid_out(info, ref, target)
    info.leaves = [jax.ShapeDtypeStruct(sh, x.dtype) for sh, x in zip(shapes, ref.leaves)]
    for s in sites:
        shapes, steps, why = _laid_out(info, s, target)
        for j, (shape, x, weak) in enumerate(zip(shapes, s.leaves, s.weak)):
            _merge_leaf(key, info, j, shape, x.dtype, weak, s.site, why)
        for name, st in steps.items():
            if name in info.steps and info.steps[name].shape != st.shape:
                raise ValueError(
                    f"eqx_logs: step {name!r} of key {key!r} has shape {st.shape} at {s.site} "
                    f"but {info.steps[name].shape} at {site_list(info.sites)}."
                )
            info.steps.setdefault(name, st)
        if s is not ref:
            info.sites.append(s.site)
    info.sites = [s.site for s in sites]
    return info


def check_late(key: str, info: KeyInfo, sites: Sequence[Site], site: Site, across) -> None:
    """Check `site` of `key`, in a jaxpr traced after the records were frozen (a custom
    derivative rule, traced when JAX differentiates), against the key's record `info`, merged
    from `sites`: it must fit the layout as it is (it is never merged into it)."""
    later = merge(key, [*sites, site], across)
    if (later.nbatch, later.lanes_as_events, later.leaves, later.batch) != (
        info.nbatch,
        info.lanes_as_events,
        info.leaves,
        info.batch,
    ):
        raise ValueError(
            f"eqx_logs: key {key!r} is logged at {site.site} with events of "
            f"{[(x.shape, str(x.dtype)) for x in site.leaves]} under {site.nbatch} batch axes, "
            f"in a function traced after its other sites ({site_list(info.sites)}) were "
            "counted (a custom derivative rule): its events would not fit the key's layout "
            f"{[(x.shape, str(x.dtype)) for x in info.leaves]}. Log the same shapes and "
            "dtypes under the same vmaps there, or give that site a key of its own."
        )


def _check_same(key: str, first: Site, s: Site, across: tuple[Any, ...]) -> None:
    """What every site of a key shares: its shard_maps, its pytree structure, and (when
    lanes are merged `across` vmap axes) its vmap axis names."""
    if s.mesh != first.mesh:
        where = f"inside a shard_map over {s.mesh}" if s.mesh else "outside any shard_map"
        there = f"inside a shard_map over {first.mesh}" if first.mesh else "outside"
        raise ValueError(
            f"eqx_logs: key {key!r} is logged {where} at {s.site}, and {there} at "
            f"{first.site}. Each device reduces the events it logs inside a "
            "shard_map (or pmap) on its own, so those events cannot share a key with "
            "others: give them a key of their own."
        )
    if s.names != first.names and set(across) & {*s.names, *first.names}:
        raise ValueError(
            f"eqx_logs.spool(across={across!r}): key {key!r} is logged "
            f"under vmap axes {s.names} at {s.site} and {first.names} at "
            f"{first.site}, so its lanes cannot be merged over one axis. "
            "Log it under the same vmaps everywhere, or give the sites keys of their own."
        )
    if s.treedef != first.treedef:
        raise ValueError(
            f"eqx_logs: key {key!r} is logged with pytree structure {s.treedef} at {s.site} "
            f"and {first.treedef} at {first.site}. Every event of one key must "
            "have the same structure."
        )


def _lanes_as_events(sites: Sequence[Site]) -> bool:
    """Whether two sites log the key under vmaps of different sizes, as many axes each and
    with events of one shape (`lax.map(..., batch_size=k)` with a remainder): then each lane
    of each event is an event of its own (`KeyInfo.lanes_as_events`)."""
    layouts = {(s.nbatch, s.batch(), tuple(s.events())) for s in sites if s.nbatch}
    return any(n == m and b != c and e == f for n, b, e in layouts for m, c, f in layouts)


def _specs(first: Site, nbatch: int, lanes: bool) -> list[tuple[Any, ...] | None]:
    """The key's partition specs: the first site's, with the key's batch axes."""
    if lanes:
        return [None if p is None else p[first.nbatch :] for p in first.specs]
    pad = (None,) * (nbatch - first.nbatch) if not first.nbatch else ()
    return [None if p is None else pad + p for p in first.specs]


def _laid_out(info: KeyInfo, s: Site, target: Site | None):
    """The shapes and steps of site `s` as the key lays its events out: one lane of each
    event where lanes are events; broadcast along the `target` site's batch axes where `s`
    logs the key unbatched with events of the key's shape (as each lane of
    `jax.vmap(spool(f))` sees them); as they are otherwise. And the hint for a shape error
    where `s` logs under another number of vmap axes than the key."""
    shapes = [x.shape for x in s.leaves]
    if info.lanes_as_events:
        steps = {n: _unbatched(st, s.batch()) for n, st in s.steps.items()}
        return [sh[s.nbatch :] for sh in shapes], steps, ""
    if target is not None and not s.nbatch and not s.mesh and shapes == target.events():
        lead = target.batch()
        steps = {n: jax.ShapeDtypeStruct(lead + st.shape, st.dtype) for n, st in s.steps.items()}
        return [lead + sh for sh in shapes], steps, ""
    why = ""
    if s.nbatch != info.nbatch and not s.mesh and not info.mesh:
        why = _vmap_depth_hint(info, s.nbatch, s.site)
    return shapes, s.steps, why


# -- second pass --------------------------------------------------------------------


def keys_of(eqn: _compat.JaxprEqn) -> list[str]:
    """The keys a log equation logs."""
    treedef = eqn.params["treedef"]
    return list(jtu.tree_unflatten(treedef, [None] * treedef.num_leaves))
