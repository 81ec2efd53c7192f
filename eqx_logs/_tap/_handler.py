"""tap's handler: each selected log event becomes an ordered host callback, gated on the
device by the policy's interval (a counter per group of keys is threaded as the states)."""

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from .. import _compat, _lanes
from .._deferred import force
from .._interpret import (
    INTERVAL_STEP,
    Handler,
    Interpreter,
    Interval,
    items_of,
    mask_of,
    pass_on,
    selects,
    steps_of,
)
from ._blocks import BLOCK, Blocks, hide_lanes
from ._rules import TAP_RULES
from ._split import ScanSplit


def _numeric(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.number) or jnp.issubdtype(x.dtype, jnp.bool_)


def _zero_of(args: Any) -> Any:
    """A zero computed from every input (`Tap._lanes`), from none of its elements:
    an empty slice (of a complex input, its real part: summing it as int32 would discard the
    imaginary part, with numpy's `ComplexWarning`). (Not of inputs sharded over Explicit mesh
    axes, which cannot be flattened without naming a sharding; vmap does not batch those.)"""
    empty = [
        jnp.real(jnp.ravel(x)[:0]).sum(dtype=jnp.int32)
        for x in args
        if _numeric(x) and _compat.explicit_spec(jax.typeof(x)) is None
    ]
    return functools.reduce(jnp.add, empty, jnp.int32(0))


class Tap(Handler):
    """Turns each selected log event into an ordered host callback, gated on the device by
    the policy's interval (a per-key event counter is threaded).

    Counters stay Python ints while they are known at trace time (straight-line code, and
    after a scan handled below), so events the interval skips cost nothing and kept ones need
    no `cond`. A scan whose body logs each of its counters' keys exactly once per iteration,
    entered with known counters, is split at trace time into runs of iterations without
    events and single iterations with one (`_split.py`, `ScanSplit.peeled`): the skipped
    iterations compile without the logged computation at all.
    """

    # Under a `vmap` outside `tap`, a cond or while with a batched predicate runs its branches
    # or body for every lane, callbacks included: each event carries the conditions it is
    # under, per lane, and the host drops the lanes where they do not hold.
    tracks_guards = True

    name = "eqx_logs.tap"

    def __init__(
        self,
        policy: Any,
        sink: Callable,
        every_process: bool,
        context: Any,
        buffer: int | None = None,
    ):
        self.interp = Interpreter(policy, TAP_RULES, self)
        self.interval = Interval(policy.interval)
        self.sink = sink
        # `buffer=k`: events gathered on the device, k per callback (`_blocks.py`)
        self.blocks = None if buffer is None else Blocks(buffer, sink, context, every_process)
        self.every_process = every_process
        self.context = context
        self._silent = False  # inside iterations whose events the interval skips
        self._guards: list[Any] = []
        # Values that change in every iteration of the loops around an event, passed to its
        # callback (and ignored there): under grad, JAX's scan partial eval would otherwise
        # hoist a callback whose operands are loop-invariant out of the loop, running it once.
        self._loop_tokens: list[Any] = []
        # A zero computed from every input: under a `vmap` outside `tap`, JAX calls a callback
        # once per lane only if an operand is batched; with this one, unbatched events too.
        self._lanes: Any = None

    @contextlib.contextmanager
    def guarded(self, pred: Callable[[], Any], lane: Any):
        # a lane value with lane axes belongs to a vmap inside tap: it masks events instead
        self._guards.append(pred() if lane is None or jnp.ndim(lane) else lane)
        try:
            yield
        finally:
            self._guards.pop()

    @contextlib.contextmanager
    def quiet(self):
        """Events traced inside are skipped by the interval: none is gated or called back."""
        silent, self._silent = self._silent, True
        try:
            yield
        finally:
            self._silent = silent

    @contextlib.contextmanager
    def iteration_token(self, index: Any):
        """`index` (an outer loop's counter) passed to the callbacks traced inside, as the
        loops' own counters are (`_loop_tokens`)."""
        self._loop_tokens.append(index)
        try:
            yield
        finally:
            self._loop_tokens.pop()

    @property
    def unconditional(self) -> bool:
        """Whether events traced now are neither skipped by the interval (`quiet`) nor under
        a batched predicate's guard."""
        return not self._silent and not self._guards

    @property
    def lanes(self) -> Any:
        """The zero that makes JAX call a callback per lane under a `vmap` outside `tap`."""
        return self._lanes

    def groups_of(self, keys: Any) -> list[str]:
        """The counters (groups of keys) of the kept keys among `keys`, in order, once each."""
        return list(dict.fromkeys(self._group[k] for k in keys if k in self._kept))

    @contextlib.contextmanager
    def on_device(self, args):
        lanes = self._lanes  # (computed from the global inputs, which stay outside)
        self._lanes = _zero_of(args)
        try:
            yield
        finally:
            self._lanes = lanes

    def device_states(self, states, naxes):  # a device's counters: scalars
        del naxes
        return self.threadable({g: jnp.reshape(c, ()) for g, c in states.items()})

    def device_blocks(self, states, naxes):
        return {g: jnp.reshape(c, (1,) * naxes) for g, c in self.threadable(states).items()}

    def threadable(self, states):
        """Counters as arrays: one per device for the keys a shard_map logs (outside it;
        inside, each device's own, varying over the mesh)."""
        manual = self.interp.manual

        def array(g, c):
            if g.endswith(BLOCK):  # (never inside a shard_map)
                return Blocks.threadable(c)
            if not isinstance(c, int):
                return c
            if manual.axes:
                return _compat.vary(jnp.int32(c), manual.vary)
            return jnp.full(self._per_device.get(g, ()), c, jnp.int32)

        return {g: array(g, c) for g, c in states.items()}

    # (`streamed`: none, events reach the host, not a scan's outputs; `settle`: counters
    # only, which rules make arrays where they must, see `_rules.py`)

    def snapshot(self):
        tap = {"guards": self._guards, "tokens": self._loop_tokens, "lanes": self._lanes}
        return tap, self._silent

    @contextlib.contextmanager
    def restored(self, context, static):
        saved = self._guards, self._loop_tokens, self._lanes, self._silent
        self._guards, self._loop_tokens = list(context["guards"]), list(context["tokens"])
        self._lanes, self._silent = context["lanes"], static
        try:
            yield
        finally:
            self._guards, self._loop_tokens, self._lanes, self._silent = saved

    def run(self, closed: Any, args: Any) -> list[Any]:
        interp = self.interp
        plan = interp.plan
        counts = plan.program(closed)
        kept = [k for k in counts if not plan.dropped(k)]
        # Keys logged by exactly the same log equations always have the same number of events,
        # so they share one event counter: fewer scalar ops in every loop iteration.
        groups: dict[frozenset, str] = {}
        self._group = {}
        for key in kept:
            sites = frozenset(plan.eqns_of[key])
            self._group[key] = groups.setdefault(sites, f"group{len(groups)}")
        self._kept = dict.fromkeys(kept)
        # the counters of keys logged inside a shard_map: one per device
        self._per_device = {
            self._group[k]: plan.info[k].batch_shape()[: len(plan.info[k].mesh)]
            for k in kept
            if plan.info[k].mesh
        }
        self._lanes = _zero_of(args)
        states = dict.fromkeys(groups.values(), 0)
        if self.blocks is not None:
            kept_groups = {k: self._group[k] for k in kept}
            states |= self.blocks.setup(plan.info, kept_groups, interp.policy.prefix)
        outs, states = interp.eval(closed, args, states)
        if self.blocks is not None:
            self.blocks.finish(states, [self._lanes])
        return outs

    def keys(self, closed: Any) -> tuple[str, ...]:
        """The event counters (one per group of keys) that `closed` updates."""
        groups = tuple(self.groups_of(self.interp.plan.count(closed)))
        return groups if self.blocks is None else groups + tuple(g + BLOCK for g in groups)

    def split_scan(self, eqn, invals, states):
        """A scan split at trace time (`_split.py`: `ScanSplit`, peeled with `interval=k`, in
        blocks with `buffer=k`), or None (then its rule evaluates it, see `_rules.py`)."""
        return ScanSplit(self, eqn, invals)(states)

    def event(self, eqn, invals, states):
        selected = self._selected(eqn, invals, states)
        if selected is None:
            return
        items, steps, keys = selected
        mask, lane = self._event_mask(eqn, invals)
        groups = self.groups_of(keys)
        # (the counters as they were before this event)
        tokens = [
            *self._loop_tokens,
            *(states[g] for g in groups if not isinstance(states[g], int)),
        ]
        wanted, mask = self._gate(groups, steps, mask, lane, states)
        if not any(w is not False for w in wanted.values()):
            return  # skipped by the interval, known at trace time
        if self.blocks is not None:
            guard = functools.reduce(jnp.logical_and, self._guards) if self._guards else None
            for g, w in wanted.items():
                mine = {k: items[k] for k in keys if self._group[k] == g}
                self.blocks.add(states, g, w, mine, steps, mask, guard, [*tokens, self._lanes])
            return
        self._call_back({k: items[k] for k in keys}, steps, mask, wanted, tokens)

    def _selected(self, eqn, invals, states) -> tuple[dict, dict, list] | None:
        """The event's items and steps, and the keys this tap takes of it; None where it
        takes none (the others are bound again, for an enclosing spool or tap)."""
        interp = self.interp
        if not selects(interp, eqn, invals):
            return None  # not ours: an enclosing one's
        if self._silent:  # the interval skips this event
            return None
        items = items_of(eqn, invals[: eqn.params["treedef"].num_leaves])
        steps = steps_of(interp, eqn, invals)
        if interp.manual.axes:  # inside a shard_map: the device's coordinates on its axes
            steps = {**{a: lax.axis_index(a) for a, _ in interp.manual.axes}, **steps}
        keys = [k for k in items if k in self._kept and self._group[k] in states]
        pass_on(interp, eqn, invals, items, keys)  # as in spool
        return (items, steps, keys) if keys else None

    def _event_mask(self, eqn, invals) -> tuple[Any, Any]:
        """(mask, lane): where the event happened, and the guard of a vmap outside the tap.
        Equinox's loops (`_lanes.py`): lanes with axes come from a vmap inside tap and mask
        the event; a scalar lane (a vmap outside) is a guard, and gates the counters."""
        mask = mask_of(eqn, invals)
        lane = self.interp.lanes.mask()
        if lane is not None and jnp.ndim(lane):
            mask = lane if mask is None else jnp.logical_and(mask, lane)
            lane = None
        return mask, lane

    def _gate(self, groups, steps, mask, lane, states) -> tuple[dict[Any, Any], Any]:
        """The policy's interval: whether each group keeps the event (a bool where known at
        trace time), its counter advanced in `states`; and the event's mask for the host."""
        wanted: dict[Any, Any] = {}
        interval = self.interval
        period = interval.period
        by_step = interval.by_step(steps)  # kept where step % k == 0
        # A step batched by a vmap inside the tap: the interval keeps each lane's own step, as
        # `jax.vmap(tap(f))` (and spool's `Store.gate`) would. The event goes to the host where
        # some lane keeps it, the lanes that do not masked as lanes where it did not happen
        # are: `shown` is the event's mask for the host (the counters still count `mask`).
        stepped = by_step and jnp.ndim(steps[INTERVAL_STEP]) > 0
        shown = mask
        if stepped:
            shown = interval.keeps(steps[INTERVAL_STEP])
            if mask is not None:
                shown = jnp.logical_and(_lanes.fit(mask, jnp.shape(shown)), shown)
        for g in groups:
            count = states[g]
            if mask is None and lane is None and isinstance(count, int):  # known now
                number = interval.number(steps, count)
                wanted[g] = jnp.any(shown) if stepped else interval.keeps(number)
                states[g] = count + 1
                continue
            if mask is None and lane is None and period == 1:  # always kept
                wanted[g] = True
                states[g] = count + 1
                continue
            happened = jnp.bool_(True) if mask is None else jnp.any(mask)
            if lane is not None:
                happened = jnp.logical_and(happened, lane)
            count = jnp.asarray(count, jnp.int32)
            if period == 1:
                wanted[g] = happened
            elif stepped:  # (a lane of `shown` is one where the event happened)
                kept = jnp.any(shown)
                wanted[g] = kept if lane is None else jnp.logical_and(kept, lane)
            else:  # events 0, k, 2k, ... of each group, or kept by their step
                number = interval.number(steps, count)
                wanted[g] = jnp.logical_and(happened, interval.keeps(number))
            states[g] = count + happened.astype(jnp.int32)
        return wanted, shown

    def _call_back(self, values, steps, mask, wanted, tokens) -> None:
        """The event's host callback, behind a `cond` on the groups' flags unless known."""
        group_of = {k: self._group[k] for k in values}
        prefix, sink = self.interp.policy.prefix, self.sink
        group_list = list(wanted)

        def host(context, values, steps, meta, mask):
            # meta: each group's "wanted" flag, then the loop tokens and the lane operand
            flags = dict(zip(group_list, np.asarray(meta)[: len(group_list)].astype(bool)))
            values, steps = jax.tree.map(np.asarray, (values, steps))
            if mask is not None:  # lanes where the event did not happen: NaN (inexact values)
                mask = np.asarray(mask)
                steps = {**steps, "valid": mask}
                values = hide_lanes(values, mask)
            logs = {prefix + k: v for k, v in values.items() if flags[group_of[k]]}
            if logs:
                sink(context, logs, steps)

        flags = {g: jnp.bool_(w) for g, w in wanted.items()}
        if self._guards:  # only for the host: the device-side gate stays as it is
            guard = functools.reduce(jnp.logical_and, self._guards)
            flags = {g: jnp.logical_and(f, guard) for g, f in flags.items()}

        # the scalars travel as one array: fewer buffers to move per callback
        meta = [*flags.values(), *tokens, self._lanes]
        meta = jnp.stack([jnp.asarray(m, jnp.int32) for m in meta])

        def emit(memo):  # values only logs use are computed here (`_deferred.py`)
            forced = jtu.tree_map(lambda x: force([x], memo)[0], values)
            _compat.host_callback(
                host, self.context, forced, steps, meta, mask, every_process=self.every_process
            )

        if all(isinstance(w, bool) for w in wanted.values()):
            emit(None)  # kept, known at trace time
        else:
            kept = functools.reduce(jnp.logical_or, flags.values())
            lax.cond(kept, lambda: emit({}), lambda: None)
