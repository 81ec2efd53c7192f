"""The jaxpr interpreter behind `spool`.

Two passes over a traced program:

1. `Interpreter.count` walks the jaxpr once and finds, for every key, the static upper bound on
   its number of events (a scan multiplies, a cond takes the maximum over branches, a while
   loop is unbounded) and the shape of its events (checking that sites of one key agree).
2. `Interpreter.eval` evaluates the jaxpr in the current trace, threading one reduction state
   per key: a log equation updates its keys' states; a higher-order primitive that contains
   logs is rebuilt through its public constructor by its rule in `_rules.py`, with the states
   added to its operands, carries and results. Nothing JAX created is mutated.
"""

import contextlib
import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from . import _compat, _lanes
from ._buffers import NeedsBound, Stack, _cast
from ._deferred import Lazy, Producers, force, log_only, stop_gradient
from ._logdict import LogDict
from ._methods import method
from ._policy import Policy, unmatched
from ._primitive import (
    BACKWARD_TAG,
    current_prefix,
    is_log,
    is_sow,
    log_effect,
    logging_as,
    rebind,
)
from ._stats import overflows, per_lane, stats_p
from ._warn import warn_user

Counts = dict[str, int | None]  # key -> static bound on its events (None: unbounded)

# With `interval=k`, events that carry a step of this name are kept where it is a multiple of
# k (in a per-step training loop, one jitted call per step, only the step can tell).
INTERVAL_STEP = "step"


class UnhandledPrimitiveError(NotImplementedError):
    pass


@dataclasses.dataclass
class _KeyInfo:
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
    # batch axes, one per mesh axis, as `vmap`'s (see `Interpreter.manual`).
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
        the axes (`Interpreter._broadcast_site`)."""
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
        if len({_reduce_id(r) for _, r in named}) > 1:
            detail = "; ".join(dict.fromkeys(f"{r!r} at {site}" for site, r in named))
            raise ValueError(
                f"eqx_logs: key {key!r} is logged with different reductions ({detail}). Name "
                "one reduction per key, or set it once with a Policy rule."
            )
        return named[0][1] if named else None


def _reduce_id(reduce: Any) -> Any:
    from ._policy import as_reduction

    return as_reduction(reduce)


# What the user wrote, for primitives that arrive under another name.
_WRITTEN_AS = {
    "shard_map": "`jax.shard_map` or `jax.pmap` (the primitive 'shard_map')",
    "xla_pmap": "`jax.pmap` (the primitive 'xla_pmap')",
}


# Hi primitives that hold user functions (other than `lax.custom_root`'s) come from options.
_HI_HINT = (
    " JAX's options `jax_scan3`, `jax_remat3`, `jax_custom_jvp3` and `jax_custom_vjp3` turn "
    "`lax.scan`, `jax.checkpoint`, `jax.custom_jvp` and `jax.custom_vjp` into hi primitives, "
    "as `defvjp(..., generic_batching=True)` does a custom_vjp; without them (the default), "
    "logs inside are captured."
)


def _log_sites(eqn: _compat.JaxprEqn) -> list[str]:
    """The call sites of the logs inside `eqn`, however deeply nested."""
    sites = []
    for sub in _compat.sub_jaxprs(eqn.params):
        for inner in _compat.unpack(sub)[0].eqns:
            sites += [inner.params["site"]] if is_log(inner) else _log_sites(inner)
    return sites


def _site_list(sites: Sequence[str]) -> str:
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


def _vmap_depth_hint(info: _KeyInfo, nbatch: int, site: str) -> str:
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
        else f"at {_site_list(info.sites)} and at {site}"
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
    earlier = _site_list(info.sites)
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


def _add(a: Counts, b: Counts, scale: int = 1) -> Counts:
    out = dict(a)
    for k, n in b.items():
        n = None if n is None else n * scale
        out[k] = None if n is None or out.get(k, 0) is None else out.get(k, 0) + n
    return out


def max_counts(many: Sequence[Counts]) -> Counts:
    out: Counts = {}
    for counts in many:
        for k, n in counts.items():
            out[k] = None if n is None or out.get(k, 0) is None else max(out.get(k, 0), n)
    return out


def _exclusive(logs: list[tuple[tuple[tuple[int, int], ...], Counts]], depth: int) -> Counts:
    """The bound on the events of logs in branches of batched conds (`log_p`'s `branches`,
    pairs `(cond, branch)`), all sharing their first `depth` pairs: a lane takes one branch of
    a cond, so each cond adds the maximum over its branches (each branch's logs grouped the
    same way by their next pair); logs with no more pairs add their own. Max is only taken
    between different branches of one cond, everything else is summed: whatever order the
    pairs come in, the bound holds for every lane."""
    total: Counts = {}
    conds: dict[int, dict[int, list[Any]]] = {}
    for branches, counts in logs:
        if len(branches) == depth:
            total = _add(total, counts)
        else:
            cond, i = branches[depth]
            conds.setdefault(cond, {}).setdefault(i, []).append((branches, counts))
    for by_branch in conds.values():
        total = _add(total, max_counts([_exclusive(b, depth + 1) for b in by_branch.values()]))
    return total


def unbounded(counts: Counts) -> Counts:
    return {k: None for k in counts}


def _shapes(tree: Any) -> Any:
    return jtu.tree_structure(tree), [
        (jnp.shape(x), jnp.result_type(x)) for x in jtu.tree_leaves(tree)
    ]


def _merge_scanned(merge: Callable, out: Any, parts: Any, axis: int) -> Any:
    """`out` merged with each slice of `parts` along `axis`, in order, as
    `Interpreter._merge_across` does, in a `lax.scan`: for an axis whose size is symbolic (a
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


class Interpreter:
    """Evaluates jaxprs, folding log events into per-key reduction states."""

    # Whether custom_jvp/custom_vjp calls whose primal does not log go through their rule too:
    # their derivative rules, traced later by JAX, may log (see `_rules._rules_only`).
    wraps_custom_rules = True

    # Whether rules must say under which condition they evaluate a sub-jaxpr (`guard`) even
    # where no lane value is known. Spool does not need it: a `vmap` outside it selects the
    # states of untaken branches away (for predicates JAX batches; see `_lanes.py`).
    tracks_guards = False

    @contextlib.contextmanager
    def guard(self, pred: Callable[[], Any], lane: Any = None):
        """Evaluate what follows only where `pred()` holds (a cond branch's index, a while
        loop's predicate). `lane` is the same condition as each vmap lane would compute it
        alone, where that differs (`_lanes.py`): events under it are masked with it."""
        if lane is None:
            yield
            return
        # with no lane axes, the lane value is `pred()` (true here) unless a vmap batches it
        self._lane_guards.append(_lanes.shadow(True, lane) if jnp.ndim(lane) == 0 else lane)
        try:
            yield
        finally:
            self._lane_guards.pop()

    def lane_mask(self) -> Any:
        """The conjunction of the lane guards around the current equation, or None."""
        if not self._lane_guards:
            return None
        return functools.reduce(jnp.logical_and, self._lane_guards)

    def statistics(self, eqn: _compat.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
        """The outputs of a statistics equation (`log_stats`, `instrument`; see
        `_stats.stats_p`). What consumes the logs (spool, tap) makes them per lane under a
        `vmap` around it; what re-evaluates a function inside them (masking, plant) binds
        them otherwise."""
        return _compat.bind_eqn(per_lane(eqn), invals)

    def bind_eqn(self, eqn: _compat.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
        """`_compat.bind_eqn` for an equation that is neither a log nor evaluated by a rule
        (at once, or when an event forces it: `Lazy`), statistics as `statistics` binds
        them."""
        if eqn.primitive is stats_p:
            return self.statistics(eqn, invals)
        return _compat.bind_eqn(eqn, invals)

    def threadable(self, states: dict[str, Any]) -> dict[str, Any]:
        """`states` as arrays, to pass through a function JAX traces separately."""
        return states

    def snapshot(self) -> tuple[Any, Any]:
        """What events depend on besides the states: `(arrays, static)`, to pass into a
        function JAX may trace later (a custom derivative rule) and `restored` there."""
        return {"lane_guards": list(self._lane_guards)}, None

    @contextlib.contextmanager
    def restored(self, context: Any, static: Any):
        """Evaluate under a `snapshot()` taken elsewhere."""
        del static
        saved, self._lane_guards = self._lane_guards, list(context["lane_guards"])
        try:
            yield
        finally:
            self._lane_guards = saved

    def lane_of(self, x: Any) -> Any:
        """The lane value of `x` (a value `eval` produced), or None if it has none."""
        hit = self._lane_values.get(id(x))
        return None if hit is None or hit[0] is not x else hit[1]

    def lanes(self, xs: Sequence[Any]) -> dict[int, Any]:
        """The lane values of `xs`, by position, where they have one."""
        return {i: lane for i, x in enumerate(xs) if (lane := self.lane_of(x)) is not None}

    def with_lanes(self, xs: Sequence[Any], lanes: dict[int, Any]) -> None:
        """Give `xs[i]` the lane value `lanes[i]`: values entering a loop body or branch.
        Only integer and boolean values (those that steer control flow) keep one."""
        for i, lane in lanes.items():
            x = xs[i]
            # not a Python scalar (their ids are shared)
            if isinstance(x, jax.Array) and not jnp.issubdtype(x.dtype, jnp.inexact):
                self._lane_values[id(x)] = (x, lane)

    def in_step(self, xs: Sequence[Any], lanes: dict[int, Any]) -> Any:
        """Whether (per lane) each `xs[i]` equals its lane value `lanes[i]`: a loop iteration
        runs for a lane on its own only where its carried control values agree with what the
        lane alone would have (None if no value has a lane value)."""
        if not lanes:
            return None
        same = [jnp.equal(xs[i], lane) for i, lane in lanes.items()]
        return functools.reduce(jnp.logical_and, same)

    def lanes_like(self, xs: Sequence[Any], like: dict[int, Any]) -> dict[int, Any]:
        """The lane values of `xs` at the positions of `like`, shaped like those (a value
        without a lane value is its own): what a loop carries from one iteration to the
        next."""
        out = {}
        for i, old in like.items():
            lane = self.lane_of(xs[i])
            out[i] = jnp.broadcast_to(xs[i] if lane is None else lane, jnp.shape(old))
        return out

    def carried(self, xs: Sequence[Any], lanes: dict[int, Any]) -> dict[int, Any]:
        """`lanes` as a loop carries them: a lane value with no lane axes is `xs[i]` itself
        unless a vmap batches them apart (`_lanes.shadow`), so where none does, XLA sees two
        equal carries and keeps one."""
        return {
            i: _lanes.shadow(xs[i], lane) if jnp.shape(lane) == jnp.shape(xs[i]) else lane
            for i, lane in lanes.items()
        }

    def __init__(self, policy: Policy, rules: dict[str, Any], *, keep: bool = False):
        self.policy = policy
        self.keep = keep
        self.rules = rules
        self.info: dict[str, _KeyInfo] = {}
        self._counts: dict[int, tuple[Any, Counts]] = {}
        self._has_log: dict[int, tuple[Any, bool]] = {}
        self._bodies: dict[tuple[int, str, bool], tuple[Any, Any]] = {}  # `opaque_body`
        self._recomputing = False  # inside a remat's recomputation (`recomputing`)
        self._outer: list[Any] = []  # the equations around the one being counted
        self._lane_guards: list[Any] = []
        # the custom derivative rule being evaluated, if any (its events may pass on)
        self.rule_name: str | None = None
        self._lane_values: dict[int, tuple[Any, Any]] = {}  # id(x) -> (x, its lane value)
        self._log_only_cache: dict[int, tuple[Any, Producers, set[int]]] = {}
        self._selects: dict[tuple[str, ...], bool] = {}
        self._reduction_of: dict[tuple[str, Any], Any] = {}
        self._bounds: dict[str, int | None] = {}  # key -> bound on its (kept) events
        self._per_call: Counts = {}  # key -> its events per call (`run`)
        self._mesh: tuple[tuple[str, int], ...] = ()  # manual mesh axes here, with sizes
        self._vary: tuple[str, ...] = ()  # those of them whose values' variation JAX checks
        self._mesh_object: Any = None  # the mesh of the shard_map being counted
        self._first: _FirstNonfinite | None = None  # `Policy.first_nonfinite`, while running
        self._depth = 0  # loops around the equation being evaluated (`loop`)
        self._iteration_events: dict[str, int] = {}  # key -> most events in one loop iteration

    @contextlib.contextmanager
    def manual(self, axes: tuple[tuple[str, int], ...], check_vma: bool = False, mesh=None):
        """Inside the body of a `shard_map` over `axes` (names and sizes) of `mesh`: the events
        of a key logged there are one device's, and its states are that device's block of the
        key's states, whose leading batch axes are the mesh axes (of size 1 here)."""
        outer = self._mesh, self._vary, self._mesh_object
        self._mesh = self._mesh + axes
        self._mesh_object = mesh
        if check_vma:
            self._vary = self._vary + tuple(name for name, _ in axes)
        try:
            yield
        finally:
            self._mesh, self._vary, self._mesh_object = outer

    @contextlib.contextmanager
    def on_device(self, args: Sequence[Any], axes: tuple[str, ...], check_vma: bool):
        """Evaluating the body of a `shard_map` over `axes` on one device, whose blocks of the
        operands are `args`."""
        del args
        with self.manual(tuple((a, 1) for a in axes), check_vma):
            yield

    def device_states(self, states: dict[str, Any]) -> dict[str, Any]:
        """A device's states, from its blocks of them (entering a shard_map's body)."""
        return states

    def device_blocks(self, states: dict[str, Any], naxes: int) -> dict[str, Any]:
        """A device's blocks of its states (leaving a shard_map's body over `naxes` axes)."""
        del naxes
        return states

    def batch_shape(self, key: str) -> tuple[int, ...]:
        """The batch shape of `key`'s states here: the mesh axes of a `shard_map` being
        evaluated have size 1 (each device holds its own block)."""
        n = self._local_axes(key)
        return (1,) * n + self.info[key].batch_shape()[n:]

    def _local_axes(self, key: str) -> int:
        """How many of `key`'s batch axes are mesh axes of the shard_map being evaluated."""
        return len(self.info[key].mesh) if self._mesh else 0

    def _fit(self, key: str, mask: Any) -> Any:
        """`_lanes.fit` for `key`'s batch here: a mask has no mesh axes (one device's)."""
        n = self._local_axes(key)
        return self._lead(key, _lanes.fit(mask, self.batch_shape(key)[n:]))

    def _lead(self, key: str, x: Any) -> Any:
        """A value of one device's event of `key` with the mesh axes put first (size 1), and
        varying over them: the device's own."""
        n = self._local_axes(key)
        if n == 0:
            return x
        return _compat.vary(lax.expand_dims(x, tuple(range(n))), self._vary)

    def selects(self, tags: tuple[str, ...]) -> bool:
        """`self.policy.selects(tags)`, cached: called for every log equation."""
        hit = self._selects.get(tags)
        if hit is None:
            hit = self._selects[tags] = method(self.policy, "selects")(tags)
        return hit

    def warn_unmatched(self, who: str) -> None:
        """After a run: warn (at the user's call) for what in the policy most likely holds a
        typo: `tags` that selected nothing, an `exclude` tag or `rules` pattern that matches
        nothing but resembles a tag or key logged (`_policy.unmatched`)."""
        if not isinstance(self.policy, Policy) or not self._selects:
            return
        tags = {t for ts in self._selects for t in ts}
        keys = {key for key, _ in self._reduction_of}
        selected = any(self._selects.values())
        for message in unmatched(self.policy, who, tags, keys, selected):
            warn_user(message)
        if message := self._stepless(who):
            warn_user(message)

    def _stepless(self, who: str) -> str | None:
        """With `interval=k`, keys kept by their `step` beside keys without one, whose events
        per call are not a multiple of k: those are numbered within each call, so in a loop
        calling the spool once per step, each call keeps its first (a step-less key follows
        no step). Say so, naming `scope(step=...)`."""
        period, counts = self.policy.interval, self._per_call
        stepped = [k for k in counts if INTERVAL_STEP in self.info[k].steps]
        if period == 1 or not stepped:
            return None
        stepless = {
            k: n
            for k, n in counts.items()
            if k in self._reductions
            and INTERVAL_STEP not in self.info[k].steps
            and isinstance(n, int)
            and n % period
        }
        if not stepless:
            return None
        names = ", ".join(f"{k!r} ({n} per call)" for k, n in list(stepless.items())[:4])
        more = f" and {len(stepless) - 4} more" if len(stepless) > 4 else ""
        verb = "is" if len(stepless) == 1 else "are"
        return (
            f"{who}(interval={period}): {names}{more} {verb} logged without a `step`, while "
            f"{stepped[0]!r} carries one. `interval` keeps an event with a step where the step "
            f"is a multiple of {period}, and numbers the others within each call (events 0, "
            f"{period}, {2 * period}, ... of the call): called once per training step, each "
            "call keeps its first. Log them inside `with eqx_logs.scope(step=i):` (around the "
            "model's call, for `instrument`'s statistics) to keep them by step too."
        )

    def reduction_of(self, key: str, site_reduce: Any = None) -> Any:
        """`self.policy.reduction(key, site_reduce)`, cached."""
        hit = self._reduction_of.get((key, site_reduce))
        if hit is None:
            hit = method(self.policy, "reduction")(key, site_reduce)
            self._reduction_of[(key, site_reduce)] = hit
        return hit

    # -- first pass ---------------------------------------------------------------------

    def has_log(self, closed: Any) -> bool:
        hit = self._has_log.get(id(closed))
        if hit is None:
            jaxpr, _ = _compat.unpack(closed)
            found = any(is_log(e) or self.eqn_has_log(e) for e in jaxpr.eqns)
            hit = self._has_log[id(closed)] = (closed, found)
        return hit[1]

    def eqn_has_log(self, eqn: _compat.JaxprEqn) -> bool:
        if log_effect in eqn.effects:
            return True
        hit = self._has_log.get(id(eqn))  # (logs where the effect is not declared: custom rules)
        if hit is None:
            found = any(self.has_log(sub) for sub in _compat.sub_jaxprs(eqn.params))
            body = self.opaque_body(eqn)
            found = found or (body is not None and self.has_log(body))
            hit = self._has_log[id(eqn)] = (eqn, found)
        return hit[1]

    def opaque_body(self, eqn: _compat.JaxprEqn) -> Any:
        """For a primitive Equinox defined (`_compat.equinox_impl`: lineax's `linear_solve`),
        its implementation traced as JAX lowers it, with logging on: its logs may sit in a
        Python function among its parameters (a linear operator's `mv`), in no jaxpr. None
        for other primitives."""
        impl = _compat.equinox_impl(eqn)
        if impl is None:
            return None
        # A recomputation of the forward pass (a remat's for the backward pass, `noinline`'s
        # JVP and transpose) has no events of its own: they are the primal pass's.
        enabled = not (self._recomputing or _compat.derivative_noinline(eqn))
        prefix = current_prefix()
        hit = self._bodies.get((id(eqn), prefix, enabled))
        if hit is None:
            try:
                with logging_as(prefix, enabled=enabled):
                    body = _compat.trace_on_avals(impl, [v.aval for v in eqn.invars])
            except Exception:  # noqa: BLE001 (then as any primitive: logs found in its
                body = None  # jaxprs raise `unhandled`, and it is bound as it is otherwise)
            hit = self._bodies[(id(eqn), prefix, enabled)] = (eqn, body)
        return hit[1]

    @contextlib.contextmanager
    def recomputing(self, on: bool):
        """Within: a remat's recomputation of the forward pass if `on` (see `opaque_body`)."""
        before, self._recomputing = self._recomputing, self._recomputing or on
        try:
            yield
        finally:
            self._recomputing = before

    def count(self, closed: Any) -> Counts:
        """Static bound on the number of selected events per key in `closed`."""
        hit = self._counts.get(id(closed))
        if hit is not None:
            return hit[1]
        jaxpr, _ = _compat.unpack(closed)
        # each log and each loop or call with logs: the batched-cond branches it is in, and
        # its counts (`_exclusive` adds them up)
        parts: list[tuple[tuple[tuple[int, int], ...], Counts]] = []
        for eqn in jaxpr.eqns:
            if is_log(eqn):
                if self.selects(eqn.params["tags"]):
                    keys = self._record(eqn)
                    counts = {k: self._events_per_log(eqn, k) for k in keys}
                    parts.append((eqn.params["branches"], counts))
            elif self.eqn_has_log(eqn):
                self._outer.append(eqn)  # (for the location of an error inside it)
                try:
                    parts.append((self._branches(eqn), self.rule(eqn).count(self, eqn)))
                finally:
                    self._outer.pop()
        total = _exclusive(parts, 0)
        self._counts[id(closed)] = (closed, total)
        return total

    def _branches(self, eqn: _compat.JaxprEqn) -> tuple[tuple[int, int], ...]:
        """The batched-cond branches (`log_p`'s `branches`) that every log inside `eqn` (a
        loop, a call) is in: its events are those branches' too."""
        common = None
        for sub in _compat.sub_jaxprs(eqn.params):
            jaxpr, _ = _compat.unpack(sub)
            for inner in jaxpr.eqns:
                if is_log(inner):
                    pairs = set(inner.params["branches"])
                elif self.eqn_has_log(inner):
                    pairs = set(self._branches(inner))
                else:
                    continue
                common = pairs if common is None else common & pairs
                if not common:
                    return ()  # (as for any loop or call outside batched conds: at once)
        return tuple(sorted(common or ()))

    def _events_per_log(self, eqn: _compat.JaxprEqn, key: str) -> int:
        """Events one execution of a log equation makes for `key`: one, or one per lane."""
        nb = eqn.params["nbatch"]
        if not self.info[key].lanes_as_events or not nb:
            return 1
        treedef = eqn.params["treedef"]
        first = jtu.tree_leaves(jtu.tree_unflatten(treedef, list(range(treedef.num_leaves)))[key])
        return math.prod(eqn.invars[first[0]].aval.shape[:nb])

    def keys(self, closed: Any) -> tuple[str, ...]:
        """The keys with a state (selected, not dropped) logged in `closed`; and where
        those log, the state that finds the first non-finite event (`_FIRST`), if tracked."""
        keys = tuple(k for k in self.count(closed) if k in self._reductions)
        return (*keys, _FIRST) if keys and self._first is not None else keys

    name = "eqx_logs.spool"  # in errors

    def rule(self, eqn: _compat.JaxprEqn) -> Any:
        rule = self.rules.get(eqn.primitive.name)
        if rule is None:
            self.unhandled(eqn)
        return rule

    def unhandled(self, eqn: _compat.JaxprEqn) -> None:
        """Raise the error for a primitive that holds logs and has no rule."""
        name, hi = eqn.primitive.name, _compat.hi_name(eqn)
        what = _WRITTEN_AS.get(name, f"the primitive {name!r}")
        if hi is not None:
            what = f"JAX's hi primitive {hi!r} (a {name!r})"
        sites = _log_sites(eqn)
        raise UnhandledPrimitiveError(
            f"eqx_logs: {what} (at {_compat.eqn_location(eqn, self._outer)}) contains logs"
            f"{f' (at {_site_list(sites)})' if sites else ''}, but {self.name} has no rule "
            "for it yet, so its events cannot be captured and would be lost. Move the logs "
            f"out of it, or wrap the code in `eqx_logs.nolog`."
            f"{_HI_HINT if hi is not None else ''} Supported: {sorted(self.rules)}."
        )

    def check_rule_dtypes(self, closed: Any, name: str) -> None:
        """Every log in `closed`, the custom derivative rule of `name`, logs each key known
        here with its dtype (a rule's events replace its primal's under differentiation)."""
        jaxpr, _ = _compat.unpack(closed)
        for eqn in jaxpr.eqns:
            for sub in _compat.sub_jaxprs(eqn.params):
                self.check_rule_dtypes(sub, name)
            if not is_log(eqn):
                continue
            treedef = eqn.params["treedef"]
            items = jtu.tree_unflatten(treedef, eqn.invars[: treedef.num_leaves])
            for key, tree in items.items():
                info = self.info.get(key)
                if info is None:
                    continue  # passes on (see `_event`)
                for v, old in zip(jtu.tree_leaves(tree), info.leaves):
                    weak = getattr(v.aval, "weak_type", False)
                    if v.aval.dtype == old.dtype or (weak and _adapts(v.aval.dtype, old.dtype)):
                        continue
                    raise TypeError(
                        f"eqx_logs: key {key!r} is logged with dtype {old.dtype} (at "
                        f"{_site_list(info.sites)}) and with dtype {v.aval.dtype} in the "
                        f"derivative rule of {name} (at {eqn.params['site']}). Under "
                        "differentiation the rule's events replace the primal's, so the key "
                        "would change dtype with `jax.grad`; cast one of them."
                    )

    def _record(self, eqn: _compat.JaxprEqn) -> list[str]:
        params = eqn.params
        treedef, site = params["treedef"], params["site"]
        n_leaves = treedef.num_leaves
        # inside a shard_map the mesh axes lead, as batch axes
        mesh = tuple(name for name, _ in self._mesh)
        lead = tuple(size for _, size in self._mesh)
        avals = [v.aval.update(shape=lead + v.aval.shape) if lead else v.aval for v in eqn.invars]
        items = jtu.tree_unflatten(treedef, list(range(n_leaves)))
        steps = {
            name: jax.ShapeDtypeStruct(a.shape, a.dtype)
            for name, a in zip(params["steps"], avals[n_leaves : n_leaves + len(params["steps"])])
        }
        nb = len(lead) + params["nbatch"]
        for key, positions in items.items():
            sub_leaves, sub_def = jtu.tree_flatten(positions)
            info = self.info.get(key)
            if info is None:
                self.info[key] = _KeyInfo(
                    treedef=sub_def,
                    leaves=[
                        jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype) for i in sub_leaves
                    ],
                    weak=[bool(getattr(avals[i], "weak_type", False)) for i in sub_leaves],
                    steps=dict(steps),
                    sites=[site],
                    nbatch=nb,
                    reduce=[(site, params["reduce"])],
                    specs=[None if mesh else _compat.explicit_spec(avals[i]) for i in sub_leaves],
                    spec_mesh=next(
                        (
                            avals[i].sharding.mesh
                            for i in sub_leaves
                            if _compat.explicit_spec(avals[i])
                        ),
                        None,
                    ),
                    mesh=mesh,
                    devices=self._mesh_object,
                    lane_names=params["axis_names"],
                )
                continue
            if info.mesh != mesh:
                where = f"inside a shard_map over {mesh}" if mesh else "outside any shard_map"
                there = f"inside a shard_map over {info.mesh}" if info.mesh else "outside"
                raise ValueError(
                    f"eqx_logs: key {key!r} is logged {where} at {site}, and {there} at "
                    f"{_site_list(info.sites)}. Each device reduces the events it logs inside a "
                    "shard_map (or pmap) on its own, so those events cannot share a key with "
                    "others: give them a key of their own."
                )
            names = params["axis_names"]
            if names != info.lane_names and set(self.policy.across) & {*names, *info.lane_names}:
                raise ValueError(
                    f"eqx_logs.spool(across={self.policy.across!r}): key {key!r} is logged "
                    f"under vmap axes {names} at {site} and {info.lane_names} at "
                    f"{_site_list(info.sites)}, so its lanes cannot be merged over one axis. "
                    "Log it under the same vmaps everywhere, or give the sites keys of their own."
                )
            if info.treedef != sub_def:
                raise ValueError(
                    f"eqx_logs: key {key!r} is logged with pytree structure {sub_def} at {site} "
                    f"and {info.treedef} at {_site_list(info.sites)}. Every event of one key must "
                    "have the same structure."
                )
            key_avals, key_steps, key_nb = avals, steps, nb
            if nb != info.nbatch and not mesh and not info.lanes_as_events:
                key_avals, key_steps, key_nb = self._broadcast_site(
                    info, avals, sub_leaves, steps, nb, names
                )
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
                        f"but {info.steps[name].shape} at {_site_list(info.sites)}."
                    )
                info.steps.setdefault(name, s)
            info.sites.append(site)
            info.reduce.append((site, params["reduce"]))
        return list(items)

    @staticmethod
    def _broadcast_site(info: _KeyInfo, avals, leaves: list[int], steps, nb: int, names):
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

    def eval(self, closed: Any, args: Sequence[Any], states: dict[str, Any], *, settle=True):
        """Evaluate `closed` on `args`; returns `(outs, states)`, the states as arrays unless
        `settle` is false (for code inlined in the current trace)."""
        jaxpr, consts = _compat.unpack(closed)
        states = dict(states)
        env: dict[Any, Any] = {}
        producers, deferred = self._log_only(jaxpr)

        def read(v):
            if isinstance(v, _compat.Literal):
                return v.val
            if v in env or v not in producers:
                return env[v]
            # computed only for logs: when an event needs it
            return Lazy(v, env, producers, self.bind_eqn)

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            if id(eqn) in deferred:
                continue
            invals = [read(v) for v in eqn.invars]
            if is_log(eqn):
                self._event(eqn, invals, states)
                outs = []
            elif is_sow(eqn):
                outs = self.sown(eqn, invals, states)
            elif self.eqn_has_log(eqn) or (
                self.wraps_custom_rules and eqn.primitive.name in _compat.CUSTOM_CALLS
            ):
                outs, states = self.rule(eqn).apply(self, eqn, invals, states)
            else:
                outs = self.bind_eqn(eqn, invals)
            if self._lane_values or _lanes.is_lane_primitive(eqn):
                self._follow_lanes(eqn, invals, outs)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, _compat.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars], self.settle(states) if settle else states

    @contextlib.contextmanager
    def loop(self):
        """Evaluate the body of a loop (`lax.scan`, `lax.while_loop`) one level deeper; its
        rule calls `entering_loop` before it and `iteration` as each iteration begins."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def entering_loop(self, states: dict[str, Any]) -> dict[str, Any]:
        return states if self._first is None else self._first.enter(self._depth, states)

    def iteration(self, states: dict[str, Any]) -> dict[str, Any]:
        return states if self._first is None else self._first.advance(self._depth - 1, states)

    def sown(self, eqn: _compat.JaxprEqn, invals: list[Any], states: dict[str, Any]) -> Any:
        """The outputs of an `eqx_logs.sow` (its value, which `plant` replaces)."""
        del states
        return _compat.bind_eqn(eqn, invals)

    def _log_only(self, jaxpr: Any) -> tuple[Producers, set[int]]:
        """The equations of `jaxpr` that only logs use (`_deferred.py`), cached."""
        hit = self._log_only_cache.get(id(jaxpr))
        if hit is None:

            def keeps(eqn):
                return self.eqn_has_log(eqn) or _lanes.is_lane_primitive(eqn) or is_sow(eqn)

            producers = log_only(jaxpr, is_log, keeps)
            deferred = {id(eqn) for _, eqn in producers.values()}
            hit = self._log_only_cache[id(jaxpr)] = (jaxpr, producers, deferred)
        return hit[1], hit[2]

    def _follow_lanes(self, eqn: _compat.JaxprEqn, invals: list[Any], outs: list[Any]) -> None:
        """Record the lane values of `eqn`'s outputs (see `_lanes.py`)."""
        inlanes = [self.lane_of(x) for x in invals]
        if _lanes.is_lane_primitive(eqn):
            lanes = [
                _lanes.lane_value(eqn, [x if y is None else y for x, y in zip(invals, inlanes)])
            ]
        else:
            if all(lane is None for lane in inlanes):
                return
            lanes = _lanes.propagate(eqn, invals, inlanes)
            if lanes is None:
                return
        self.with_lanes(outs, dict(enumerate(lanes)))

    def _event(self, eqn: _compat.JaxprEqn, invals: list[Any], states: dict[str, Any]) -> None:
        """Fold the events of one log equation into the states. Operands computed only for
        logs arrive `Lazy` (`_deferred.py`): where an event may be skipped, they are computed
        inside the `lax.cond` that folds it in."""
        params = eqn.params
        selected = self.selects(params["tags"])
        if not selected or self.keep:
            # not ours (or kept): an enclosing spool sees it
            rebind(eqn, invals, self.lane_mask())
        if not selected:
            return
        treedef = params["treedef"]
        n_leaves = treedef.num_leaves
        items = jtu.tree_unflatten(treedef, list(range(n_leaves)))
        steps = dict(zip(params["steps"], force(invals[n_leaves:])))
        mask = force(invals[-1:])[0] if params["masked"] else True
        lane = self.lane_mask()
        if lane is not None:
            mask = jnp.logical_and(mask, lane)
        # Keys without a state here are dropped by a Policy rule, or logged by a custom
        # derivative rule but not by its primal (`_rules.py`): those pass on, and warn if no
        # enclosing spool or tap captures them.
        passed = [k for k in items if k not in states and not self._dropped(k)]
        if passed:
            rebind(eqn, invals, self.lane_mask(), keys=passed, rule=self.rule_name)
        keys = [k for k in items if k in states]
        if self._first is not None and keys:
            invals = [*force(invals[:n_leaves]), *invals[n_leaves:]]  # checked: all needed
            for key in keys:
                value = [invals[i] for i in jtu.tree_leaves(items[key])]
                self._first.check(self, key, value, steps, mask, params, states)
        by_lane = [k for k in keys if self.info[k].lanes_as_events and params["nbatch"]]
        if by_lane:
            keys = [k for k in keys if k not in by_lane]
            leaves = force(invals[:n_leaves])
            self._lane_events(by_lane, items, leaves, steps, mask, params["nbatch"], states)
        valid = {}
        for key in keys:
            states[key], valid[key] = self._gate(key, states[key], steps, mask)

        def fold(sub, leaves):
            for key in keys:
                value = jtu.tree_map(lambda i: leaves[i], items[key])
                sub[key] = self._fold(key, sub[key], self._event_of(key, value, steps), valid[key])
            return sub

        lazy = any(isinstance(x, Lazy) for x in invals[:n_leaves])
        if not lazy or all(isinstance(v, bool) for v in valid.values()):
            states.update(fold({k: states[k] for k in keys}, force(invals[:n_leaves])))
        else:  # computed only if some event is kept
            kept = functools.reduce(jnp.logical_or, [jnp.any(v) for v in valid.values()])

            def folded(sub):
                return self.settle(fold(sub, force(invals[:n_leaves], {})))

            states.update(lax.cond(kept, folded, lambda s: s, self.settle(states, keys)))

    def _lane_events(self, keys, items, leaves, steps, mask, nbatch, states) -> None:
        """Each lane of a batched event as an event of its own (`_KeyInfo.lanes_as_events`)."""
        for key in keys:
            value = jtu.tree_map(lambda i: leaves[i], items[key])
            batch = jnp.shape(jtu.tree_leaves(value)[0])[:nbatch]
            lane_mask = True if mask is True else _lanes.fit(mask, batch)
            for idx in np.ndindex(*batch):
                lane_steps = {
                    n: x[idx] if jnp.shape(x)[: len(batch)] == batch else x
                    for n, x in steps.items()
                }
                lane = jtu.tree_map(lambda x: x[idx], value)
                m = True if lane_mask is True else lane_mask[idx]
                states[key], valid = self._gate(key, states[key], lane_steps, m)
                event = self._event_of(key, lane, lane_steps)
                states[key] = self._fold(key, states[key], event, valid)

    def _event_of(self, key: str, value: Any, steps: dict[str, Any]) -> dict[str, Any]:
        """One event of `key`, cast to its recorded types: the value and every step."""
        info = self.info[key]
        n = self._local_axes(key)
        leaves = [
            self._lead(key, _widened(_cast(x, s.dtype), s.shape[n:]))
            for x, s in zip(jtu.tree_leaves(value), info.leaves)
        ]
        event = {"value": jtu.tree_unflatten(info.treedef, leaves)}
        for name, s in info.steps.items():
            if name in steps:
                step = self._lead(key, _widened(jnp.asarray(steps[name], s.dtype), s.shape[n:]))
            else:
                step = self._lead(key, jnp.full(s.shape[n:], -1, s.dtype))
            event[f"step:{name}"] = step
        # events take no gradient: under `grad`, stopped now, so that nothing stacks or reduces
        # them under differentiation (in a jaxpr being built, one stop per state suffices)
        return event if _compat.staging() else _stop_gradient(event)

    def _dropped(self, key: str) -> bool:
        return isinstance(self.reduction_of(key), str)

    def _gate(
        self, key: str, state: dict[str, Any], steps: dict[str, Any], mask: Any
    ) -> tuple[dict[str, Any], Any]:
        """Whether an event of `key` is kept (True, or a bool per batch lane), and the state
        with it counted. `mask` says where the event really happened. With `interval=k`, an
        event that carries the step `INTERVAL_STEP` is kept where that step is a multiple of
        k; other events are numbered per key (0, k, 2k, ... are kept)."""
        state = dict(state)
        batch = self.batch_shape(key)
        valid = mask
        period = self.policy.interval
        if period > 1:
            if mask is not True:
                mask = self._fit(key, mask)
            if INTERVAL_STEP in steps:
                number = jnp.asarray(steps[INTERVAL_STEP])
            else:
                number = state["seen"]
            if _known(number) and mask is True:  # all lanes have seen as many events
                valid = bool(np.all(number % period == 0))
            else:
                multiple = lax.rem(number, jnp.asarray(period, number.dtype)) == 0
                valid = jnp.logical_and(multiple, mask)
            state["seen"] = _plus(state["seen"], mask)
        if not isinstance(valid, bool):
            valid = self._fit(key, valid) if jnp.shape(valid) != batch else valid
        state["count"] = _plus(state["count"], valid)
        return state, valid

    def _fold(
        self, key: str, state: dict[str, Any], event: dict[str, Any], valid: Any
    ) -> dict[str, Any]:
        """Fold one event into every channel of a key's state, where `valid`. An event kept
        for sure is only recorded (`_Pending`)."""
        if valid is False:
            return state
        state = dict(state)
        for channel, reduction in self._channels[key].items():
            s = state[channel]
            if valid is True:
                events = s.events if isinstance(s, _Pending) else ()
                base = s.state if isinstance(s, _Pending) else s
                state[channel] = _Pending(base, (*events, event[channel]))
            else:
                s = self._settle_channel(key, channel, s, arrays=False)
                update = _vmap(method(reduction, "update"), self.info[key].nbatch)
                state[channel] = update(s, _stop_gradient(event[channel]), valid)
        return state

    def _settle_channel(self, key: str, channel: str, state: Any, arrays: bool) -> Any:
        if isinstance(state, _Pending):
            assert state.state is not _STREAM, key  # taken out by the scan rule
            if state.state is _FRESH:
                state = self._empty(key, channel, state.events)
            else:
                update_many = method(self._channels[key][channel], "update_many")
                state = _vmap(update_many, self.info[key].nbatch)(state.state, list(state.events))
            # states take no gradient: one stop per leaf, where the events need one each
            state = _stop_gradient(state)
        return jtu.tree_map(_as_array, state) if arrays else state

    def settle(
        self, states: dict[str, Any], keys: Any = None, *, arrays: bool = True
    ) -> dict[str, Any]:
        """The states of `keys` (all by default) with their pending events folded in, and as
        arrays (unless `arrays` is false): to thread through a function JAX traces (a loop
        body, a branch)."""
        keys = states if keys is None else keys
        return {
            k: {c: self._settle_channel(k, c, s, arrays) for c, s in states[k].items()}
            for k in keys
        }

    # -- events a loop streams out -------------------------------------------------------
    # A key whose events in a scan body are all kept for sure (no cond, mask or interval
    # decides them), the same number in every iteration, and stacked (Stack, the default),
    # leaves the scan as its `ys`, as by hand: no buffer in the carry, no write per iteration.

    def streamed(self, body: Any, length: Any) -> dict[str, int]:
        """The keys `body` can stream out (see above), with their events per iteration. The
        events of a scan nested in `body` that streams them count too, as one block (where no
        lane value can reach that scan, see `_lanes.py`: a lane guard would mask them)."""
        if not self._reductions or self.policy.interval != 1 or self._lane_guards:
            return {}  # (no states at all: `_masking`'s interpreter only re-binds logs)
        if self._first is not None:
            return {}  # each event needs its index in the key's events, which a state counts
        if not isinstance(length, int):
            return {}
        per_iteration: dict[str, int] = {}
        excluded: set[str] = set()
        nested = not self._lane_values and not _lanes.has_lanes(body, nested=True)
        for eqn in _compat.unpack(body)[0].eqns:
            if is_log(eqn):
                if not self.selects(eqn.params["tags"]):
                    continue
                for key in self._keys_of(eqn):
                    if key not in self._reductions:
                        continue
                    if eqn.params["masked"] or self.info[key].lanes_as_events:
                        excluded.add(key)
                    per_iteration[key] = per_iteration.get(key, 0) + 1
            elif self.eqn_has_log(eqn):
                inner = {}
                if nested and eqn.primitive.name == _compat.SCAN:
                    inner_body, _, _ = _compat.scan_parts(eqn)
                    inner_length = _compat.scan_options(eqn)["length"]
                    inner = self.streamed(inner_body, inner_length)
                    for key, n in inner.items():
                        per_iteration[key] = per_iteration.get(key, 0) + n * inner_length
                excluded.update(k for k in self.rule(eqn).count(self, eqn) if k not in inner)
        return {
            k: n
            for k, n in per_iteration.items()
            if n and k not in excluded and all(_streams(r) for r in self._channels[k].values())
        }

    def _keys_of(self, eqn: _compat.JaxprEqn) -> list[str]:
        """The keys a log equation logs."""
        treedef = eqn.params["treedef"]
        return list(jtu.tree_unflatten(treedef, [None] * treedef.num_leaves))

    def stream_state(self, key: str) -> dict[str, Any]:
        """The state a streamed key starts every iteration with."""
        state = {"count": _counter(self.batch_shape(key))}
        return state | {channel: _Pending(_STREAM, ()) for channel in self._channels[key]}

    def stream_events(self, key: str, state: dict[str, Any]) -> dict[str, Any]:
        """The events of one iteration of a streamed key, per channel: stacked, or the one
        event itself."""
        out = {}
        for channel in self._channels[key]:
            pending = state[channel]
            assert isinstance(pending, _Pending) and pending.state is _STREAM, key
            events = pending.events
            if any(isinstance(e, _Block) for e in events):  # a nested scan's events among them
                # (a block left its scan stopped already)
                parts = [
                    e.events if isinstance(e, _Block) else _one_row(_stop_gradient(e))
                    for e in events
                ]
                out[channel] = jtu.tree_map(lambda *v: jnp.concatenate(v), *parts)
                if sum(_rows_of(p) for p in parts) == 1:
                    out[channel] = jtu.tree_map(lambda x: x[0], out[channel])
                continue
            if len(events) > 1:
                events = [jtu.tree_map(lambda *v: jnp.stack(v), *events)]
            out[channel] = _stop_gradient(events[0])
        return out

    def add_stream(
        self, key: str, state: dict[str, Any], ys: dict[str, Any], per_iteration: int, reverse: bool
    ) -> dict[str, Any]:
        """`state` after the events a scan streamed out: `ys`, per channel, shaped
        `(iterations, events per iteration, *batch, ...)`, without the second axis for one
        event per iteration."""
        state = dict(state)
        nbatch = self.info[key].nbatch
        n = None
        for channel, block in ys.items():

            def flat(x):
                x = jnp.flip(x, 0) if reverse else x  # execution order
                if per_iteration != 1:  # (none: a nested scan of length 0)
                    x = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
                return x

            block = jtu.tree_map(flat, block)
            n = jtu.tree_leaves(block)[0].shape[0]
            old = state[channel]
            if isinstance(old, _Pending) and old.state is _STREAM:  # an outer scan streams on
                state[channel] = _Pending(_STREAM, (*old.events, _Block(block)))
                continue
            # the lanes' layout: batch axes first
            block = jtu.tree_map(lambda x: jnp.moveaxis(x, 0, nbatch), block)
            batch = self.batch_shape(key)
            if isinstance(old, _Pending) and old.state is _FRESH and not old.events:
                if n == self._bounds[key]:  # the events are the whole buffer
                    state[channel] = {"buffer": block, "index": _counter(batch, n)}
                    continue
            old = self._settle_channel(key, channel, old, arrays=False)
            extend = method(self._channels[key][channel], "extend")
            state[channel] = _vmap(extend, nbatch)(old, block)
        if n is not None:
            state["count"] = _plus(state["count"], n)
        if isinstance(state["value"], dict) and "buffer" in state["value"]:
            state["value"] = self.info[key].shard_like_values(state["value"])
        return state

    # -- the whole program ----------------------------------------------------------------

    def run(self, closed: Any, args: Sequence[Any]) -> tuple[list[Any], LogDict]:
        counts = self.count(closed)
        if any(info.lanes_as_events for info in self.info.values()):
            self._counts.clear()  # sites counted before a key turned to lanes as events
            counts = self.count(closed)
        self._reductions = {}
        self._channels = {}
        for key in counts:
            info = self.info[key]
            reduction = self.reduction_of(key, info.site_reduce(key))
            if not isinstance(reduction, str):  # "drop"
                self._reductions[key] = reduction
                step = method(reduction, "step_reduction")()
                self._channels[key] = {
                    "value": reduction,
                    **{f"step:{n}": step for n in info.steps},
                }
        self._per_call = counts
        states = {key: self._init(key, counts[key]) for key in self._reductions}
        if self.policy.first_nonfinite:
            self._first = _FirstNonfinite(self)
            states[_FIRST] = self._first.init()
        outs, states = self.eval(closed, args, states, settle=False)
        first = states.pop(_FIRST, None)
        states = self.settle(states, arrays=False)  # what is known now stays so
        for key, state in states.items():
            for channel in self._channels[key]:
                self._check_size(key, channel, state[channel])
        self._check_across()
        # keys with the same batch shape are finalized under one vmap: a vmap per key costs
        # more to trace than most finalizations
        by_batch: dict[tuple[int, ...], dict[str, Any]] = {}
        for key, state in states.items():
            state, batch = self._merge_across(key, state)
            by_batch.setdefault(batch, {})[key] = state
        values, count, steps, names, rows, same = {}, {}, {}, {}, {}, set()
        for batch, group in by_batch.items():
            finished = _vmap(lambda g: {k: self._finish(k, s) for k, s in g.items()}, len(batch))
            for key, (key_rows, finals) in finished(group).items():
                name = self.policy.prefix + key
                reduction = self._reductions[key]
                count[name] = group[key]["count"]
                names[name] = type(reduction).__name__
                if reduction.event_axes:
                    rows[name] = key_rows
                    if _known(key_rows) and _known(count[name]):
                        if np.array_equal(key_rows, count[name]):
                            same.add(name)
                for channel, out in finals.items():
                    out = method(self._channels[key][channel], "place_batch_axes")(out, len(batch))
                    if channel == "value":
                        values[name] = out
                    else:
                        steps.setdefault(channel.removeprefix("step:"), {})[name] = out
        logs = LogDict(values, count=count, steps=steps, reductions=names, rows=rows)
        logs._rows_are_counts = frozenset(same)
        # counts known now and equal share one output (`LogDict._count_groups`)
        known: dict[Any, list[str]] = {}
        for name, c in count.items():
            if _known(c):
                known.setdefault((c.shape, c.dtype.str, c.tobytes()), []).append(name)
        logs._count_groups = tuple(tuple(g) for g in known.values() if len(g) > 1)
        if first is not None:
            logs._nonfinite = (self._first.finish(first["value"]), self._first.tables())
        return outs, logs

    def _finish(self, key: str, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """One lane of `key`'s outputs: its rows (for an output with an event axis), and its
        finalized channels."""
        reduction = self._reductions[key]
        key_rows = method(reduction, "rows")(state["value"]) if reduction.event_axes else None
        finalized = {
            channel: method(r, "finalize")(state[channel])
            for channel, r in self._channels[key].items()
        }
        return key_rows, finalized

    def _check_across(self) -> None:
        axes = {a for info in self.info.values() for a in info.axis_names() if a is not None}
        missing = [a for a in self.policy.across if a not in axes]
        if axes and missing:
            raise ValueError(
                f"eqx_logs.spool(across={self.policy.across!r}): no shard_map, pmap or named "
                f"vmap that logs has the axis {missing[0]!r}; those that log are over "
                f"{sorted(axes, key=str)}."
            )

    def _merge_across(
        self, key: str, state: dict[str, Any]
    ) -> tuple[dict[str, Any], tuple[int, ...]]:
        """`key`'s state with the devices' (or vmap lanes') states merged over the axes the
        policy names in `across`, in device (lane) order; and its batch shape left."""
        info = self.info[key]
        nbatch = info.nbatch
        merged = [j for j, a in enumerate(info.axis_names()) if a in self.policy.across]
        state, batch, bound = dict(state), info.batch_shape(), self._bounds[key]
        for j in reversed(merged):  # later axes first: row-major device order
            size, rest = batch[j], batch[:j] + batch[j + 1 :]
            for name in ("count", "seen"):
                if name in state:
                    x = state[name]
                    state[name] = np.sum(x, axis=j) if _known(x) else jnp.sum(x, axis=j)
            bound = None if bound is None else bound * size  # every device's events
            for channel, reduction in self._channels[key].items():
                init = method(reduction, "init")(self._lane_struct(key, channel), bound)
                out = jtu.tree_map(lambda x: jnp.broadcast_to(x, rest + jnp.shape(x)), init)
                merge = _vmap(method(reduction, "merge"), nbatch - 1)
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

    def note_iteration(self, counts: Counts) -> None:
        """Record the events per key of one iteration of a loop body (`_scan_count`)."""
        for key, n in counts.items():
            if n is not None:
                self._iteration_events[key] = max(self._iteration_events.get(key, 0), n)

    def _init(self, key: str, bound: int | None) -> dict[str, Any]:
        info = self.info[key]
        period = self.policy.interval
        if bound is not None and period > 1:
            kept = -(-bound // period)  # a ceiling that stays symbolic
            if INTERVAL_STEP in info.steps:
                # kept where the logged step is a multiple of k: the events that share a step
                # (those of one loop iteration, or of the whole call outside loops) are all kept
                # or all not, so up to that many per kept step (consecutive step values)
                shared = self._iteration_events.get(key, bound)
                if isinstance(shared, int) and isinstance(bound, int):
                    kept = min(bound, shared * kept)
                elif not (isinstance(shared, int) and shared == 1):
                    kept = bound  # symbolic sizes (`jax.export`) that cannot be compared
            bound = kept
        self._bounds[key] = bound
        # counters are numpy values while they are known at trace time: straight-line events
        # are counted (and selected by `interval`) without an operation
        state = {"count": _counter(info.batch_shape())}
        if self.policy.interval > 1:
            state["seen"] = _counter(info.batch_shape())
        for channel in self._channels[key]:
            if bound is None:  # made now: a reduction that needs a bound says so now
                state[channel] = self._empty(key, channel)
            else:  # made with the first events (`AbstractReduction.init_many`)
                state[channel] = _Pending(_FRESH, ())
        return state

    def _lane_struct(self, key: str, channel: str) -> Any:
        """The structure of one lane of one event of `key` in `channel`."""
        info = self.info[key]
        if channel == "value":
            return info.lane_struct()
        s = info.steps[channel.removeprefix("step:")]
        return jax.ShapeDtypeStruct(s.shape[info.nbatch :], s.dtype)

    def _empty(self, key: str, channel: str, events: Sequence[Any] = ()) -> Any:
        """A new state of `key` in `channel`, with `events` (all kept) folded in."""
        info, reduction = self.info[key], self._channels[key][channel]
        struct, bound = self._lane_struct(key, channel), self._bounds[key]
        batch = self.batch_shape(key)
        try:
            if events:
                init = functools.partial(method(reduction, "init_many"), struct, bound)
                state = _vmap(init, info.nbatch)(list(events))
            else:
                state = method(reduction, "init")(struct, bound)
                if batch:
                    state = jtu.tree_map(lambda x: jnp.broadcast_to(x, batch + jnp.shape(x)), state)
        except NeedsBound:
            raise ValueError(
                f"eqx_logs.spool: key {key!r} is logged inside a `lax.while_loop` (at "
                f"{_site_list(info.sites)}; a `lax.fori_loop` whose bounds are traced is one, "
                "as are Equinox's and diffrax's loops), so its number of events has no static "
                "bound and "
                f"{type(reduction).__name__} cannot allocate its buffer without one. Pass a "
                "capacity, e.g. `reduce=eqx_logs.Stack(capacity=N)` (keep='first' or 'last'), "
                "or use a reduction of fixed size (mean, last, ...), or `lax.scan`/"
                "`lax.fori_loop` with static bounds."
            ) from None
        return info.shard_like_values(state) if channel == "value" else state

    def _check_size(self, key: str, channel: str, state: Any) -> None:
        """A buffer larger than the device's memory would fail at run time with an
        out-of-memory error naming nothing: fail now, naming the key and the fixes."""
        nbytes = 0
        for x in jtu.tree_leaves(state):
            shape = tuple(getattr(x, "shape", ()))
            if not all(isinstance(d, int) for d in shape):
                return  # symbolic sizes (`jax.export`): not known here
            nbytes += math.prod(shape) * np.dtype(x.dtype).itemsize
        limit = _memory_limit()
        if limit is None or nbytes <= limit:
            return
        info, reduction = self.info[key], self._channels[key][channel]
        event = ", ".join(f"{s.dtype}{list(s.shape)}" for s in jtu.tree_leaves(info.lane_struct()))
        raise ValueError(
            f"eqx_logs.spool: key {key!r} (logged at {_site_list(info.sites)}) needs a "
            f"{type(reduction).__name__} buffer of {_gib(nbytes)} for its {channel} "
            f"({self._bounds[key]} events of {event}), more than the "
            f"{_gib(limit)} of memory the device has. Keep fewer events (`interval=k`, in "
            "spool or the Policy), reduce them on the device (`reduce='mean'`, a "
            "`eqx_logs.Window`, a `eqx_logs.Histogram`), or keep the first or last N "
            "(`reduce=eqx_logs.Stack(capacity=N)`)."
        )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@functools.cache
def _memory_limit() -> int | None:
    """This process's first device's memory in bytes (for a CPU: the host's), or None if
    unknown."""
    # this process's own device: asking another process's (`jax.devices()[0]` in a
    # `jax.distributed` run) upsets the collectives of the run
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# A channel state not made yet (`Interpreter._init`).
_FRESH = object()


# The state of `Policy.first_nonfinite`, threaded with the keys' states (`Interpreter.keys`).
_FIRST = "\x00first_nonfinite"
MAX_LOOPS = 8  # nested loops whose iteration it records


class _FirstNonfinite:
    """Finds the first event, in execution order, whose value has a non-finite element: a
    state threaded through every loop, branch and custom rule where a kept key logs, as the
    keys' states are, updated at each of their events."""

    def __init__(self, interp: "Interpreter"):
        if any(interp.info[k].mesh for k in interp._reductions):
            keys = [k for k in interp._reductions if interp.info[k].mesh]
            raise ValueError(
                f"eqx_logs.spool(first_nonfinite=True): key {keys[0]!r} is logged inside a "
                f"shard_map or pmap (at {_site_list(interp.info[keys[0]].sites)}), where "
                "finding the first non-finite event is not supported yet. Spool inside the "
                "shard_map, or check `logs[key]` for NaNs with `jnp.isfinite`."
            )
        self.keys = {k: i for i, k in enumerate(interp._reductions)}
        sites = (s for k in interp._reductions for s in interp.info[k].sites)
        self.sites = {s: i for i, s in enumerate(dict.fromkeys(sites))}
        self.steps = sorted({n for k in interp._reductions for n in interp.info[k].steps})

    def init(self) -> dict[str, Any]:
        record = {"found": np.bool_(False), "backward": np.bool_(False)}
        record.update({n: np.int32(-1) for n in ("key", "site", "event", "lane", "depth")})
        record.update({f"step:{n}": np.int32(-1) for n in self.steps})
        record["iterations"] = np.full(MAX_LOOPS, -1, np.int32)
        # the iteration each enclosing loop is in now (not a field of the record)
        return {"value": record, "loops": np.full(MAX_LOOPS, -1, np.int32)}

    def enter(self, depth: int, states: dict[str, Any]) -> dict[str, Any]:
        if depth >= MAX_LOOPS or _FIRST not in states:
            return states
        state = states[_FIRST]
        return {**states, _FIRST: {**state, "loops": jnp.asarray(state["loops"]).at[depth].set(-1)}}

    def advance(self, depth: int, states: dict[str, Any]) -> dict[str, Any]:
        if depth >= MAX_LOOPS or _FIRST not in states:
            return states
        state = states[_FIRST]
        loops = jnp.asarray(state["loops"]).at[depth].add(1)
        return {**states, _FIRST: {**state, "loops": loops}}

    def check(self, interp, key, leaves, steps, mask, params, states) -> None:
        """Fold one event of `key` (its value's `leaves`, batched over `params["nbatch"]`
        leading axes; it happened where `mask`) into the state, before the event counts."""
        nb = params["nbatch"]
        floats = [jnp.asarray(x) for x in leaves]
        floats = [x for x in floats if jnp.issubdtype(x.dtype, jnp.inexact)]
        if not floats:
            return
        batch = floats[0].shape[:nb]
        # a statistic names a value that is not finite, not a finite one's overflow
        if params["statistics"] and overflows(key):
            bad = [jnp.any(jnp.isnan(x), axis=tuple(range(nb, x.ndim))) for x in floats]
        else:
            bad = [jnp.any(~jnp.isfinite(x), axis=tuple(range(nb, x.ndim))) for x in floats]
        bad = functools.reduce(jnp.logical_or, bad)
        if mask is not True:
            bad = jnp.logical_and(bad, _lanes.fit(mask, batch))
        bad = jnp.ravel(bad)
        lane = jnp.argmax(bad)
        state = states[key]
        before = jnp.asarray(state["seen"] if "seen" in state else state["count"])
        if interp.info[key].lanes_as_events:  # one count for all lanes, in lane order
            event = before + lane
        else:
            event = jnp.ravel(jnp.broadcast_to(before, batch))[lane]
        record = {
            "key": self.keys[key],
            "site": self.sites.get(params["site"], -1),  # (-1: a rule JAX traced later)
            "event": event,
            "lane": lane if batch else -1,
            "backward": BACKWARD_TAG in params["tags"],
            "depth": min(interp._depth, MAX_LOOPS),
            "iterations": states[_FIRST]["loops"],
        }
        for name in self.steps:
            if name not in steps:
                continue
            x = jnp.asarray(steps[name])
            record[f"step:{name}"] = jnp.ravel(x)[lane] if x.ndim else x
        old = states[_FIRST]["value"]
        hit = bad[lane]
        new = jnp.logical_and(hit, jnp.logical_not(old["found"]))
        out = {n: jnp.where(new, jnp.asarray(v, old[n].dtype), old[n]) for n, v in record.items()}
        found = jnp.logical_or(old["found"], hit)
        states[_FIRST] = {**states[_FIRST], "value": {**old, **out, "found": found}}

    def finish(self, state: dict[str, Any]) -> dict[str, Any]:
        return {n: jnp.asarray(x) for n, x in state.items()}

    def tables(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        return tuple(self.keys), tuple(self.sites), tuple(self.steps)


class _Pending:
    """A channel's state with events still to fold in, each of them kept for sure: the events
    of straight-line code are folded in together (`AbstractReduction.update_many`), where the
    state is next needed as arrays (`Interpreter.settle`)."""

    __slots__ = ("state", "events")

    def __init__(self, state: Any, events: tuple[Any, ...]):
        self.state, self.events = state, events


# Where a streamed key's events start in a scan body (`Interpreter.streamed`).
_STREAM = object()


class _Block:
    """Among a streamed key's pending events: those a nested scan streamed out, stacked on a
    leading axis (`Interpreter.add_stream`)."""

    __slots__ = ("events",)

    def __init__(self, events: Any):
        self.events = events


def _one_row(event: Any) -> Any:
    return jtu.tree_map(lambda x: lax.expand_dims(x, (0,)), event)


def _rows_of(block: Any) -> int:
    return jtu.tree_leaves(block)[0].shape[0]


def _streams(reduction: Any) -> bool:
    """Whether a channel's events can leave a scan as its `ys`: stacked in full."""
    return type(reduction) is Stack and reduction.capacity is None and reduction.keep == "first"


def _known(x: Any) -> bool:
    """Whether `x` is a value known at trace time (a numpy counter, see `Interpreter._init`)."""
    return isinstance(x, np.ndarray | np.generic)


def _counter(shape: tuple[Any, ...], value: Any = 0) -> Any:
    """An int32 counter of one lane per element of `shape` (a key's batch shape), holding
    `value`: a numpy value, known at trace time, unless `shape` is symbolic (a batch dimension
    of `jax.export`, which numpy cannot hold), then an array."""
    if all(isinstance(d, int | np.integer) for d in shape):
        return np.full(shape, value, np.int32)
    return jnp.full(shape, value, jnp.int32)


def _widened(x: Any, shape: tuple[int, ...]) -> Any:
    """An event of a site unbatched over some of its key's vmap axes, broadcast along them
    (`Interpreter._broadcast_site`); `x` itself where it has the key's shape."""
    return x if jnp.shape(x) == shape else jnp.broadcast_to(x, shape)


def _as_array(x: Any) -> Any:
    return jnp.asarray(x) if _known(x) else x


def _stop_gradient(tree: Any) -> Any:
    """`lax.stop_gradient` of the traced inexact leaves of `tree` (the others take none)."""
    return jtu.tree_map(stop_gradient, tree)


def _plus(count: Any, valid: Any) -> Any:
    """`count + valid`, computed now where both are known at trace time."""
    if _known(count) and isinstance(valid, bool | int):
        return count + valid
    return count + jnp.asarray(valid, jnp.int32)


def _vmap(fun: Callable, nbatch: int) -> Callable:
    """`fun` mapped over `nbatch` leading axes of all its arguments."""
    for _ in range(nbatch):
        fun = jax.vmap(fun)
    return fun
