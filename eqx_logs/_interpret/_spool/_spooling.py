"""spool's handler: events folded into one reduction state per key (`_store.py`), finalized
into a `LogDict` after the run."""

import contextlib
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ... import _branching, _lanes
from ..._deferred import Lazy, force
from ..._logdict import LogDict
from ..._methods import method
from ..._primitive import rebind
from ..._reduce import Policy
from .._evaluator import Interpreter
from .._gate import items_of, mask_of, pass_on, selects, steps_of
from .._handler import Handler, Stream
from .._manual import check_across, merge_across
from .._values import known as _known, vmap_n
from ._nonfinite import FIRST, FirstNonfinite
from ._store import Store
from ._stream import Streaming, streamed

if TYPE_CHECKING:
    from ..._rules import Rule


class Spool(Handler):
    """Folds each selected event into its key's state (in its `store`); `keep`: the events
    also pass on to an enclosing spool or tap. Evaluates with `rules` (`eqx_logs/_rules/`)."""

    def __init__(self, policy: Policy, rules: "dict[str, Rule]", keep: bool = False):
        self.keep = keep
        self.interp = Interpreter(policy, rules, self)
        self.store = Store(self.interp.plan, self.interp.manual, policy)
        self.first: FirstNonfinite | None = None  # `Policy.first_nonfinite`, while running
        self.depth = 0  # loops around the equation being evaluated (`loop`)

    def keys(self, closed: Any) -> tuple[str, ...]:
        """The keys with a state (selected, not dropped) logged in `closed`; and where
        those log, the state that finds the first non-finite event (`FIRST`), if tracked."""
        keys = tuple(k for k in self.interp.plan.count(closed) if k in self.store.reductions)
        return (*keys, FIRST) if keys and self.first is not None else keys

    def settle(
        self, states: dict[str, Any], keys: Any = None, *, arrays: bool = True
    ) -> dict[str, Any]:
        return self.store.settle(states, keys, arrays=arrays)

    # The state that finds the first non-finite event spans a shard_map: each device takes a
    # copy of it in, and the lowest-numbered device that found one gives it back.

    def device_inputs(self, states: dict[str, Any], sizes: tuple[int, ...]) -> dict[str, Any]:
        if FIRST not in states:
            return states
        return {**states, FIRST: self.first.to_devices(states[FIRST], sizes)}

    def device_states(self, states: dict[str, Any], naxes: int) -> dict[str, Any]:
        if FIRST not in states:
            return states
        return {**states, FIRST: self.first.on_device(states[FIRST], naxes)}

    def device_blocks(self, states: dict[str, Any], naxes: int) -> dict[str, Any]:
        if FIRST not in states:
            return states
        return {**states, FIRST: self.first.off_device(states[FIRST], naxes)}

    def device_outputs(self, entering: dict[str, Any], blocks: dict[str, Any]) -> dict[str, Any]:
        if FIRST not in blocks:
            return blocks
        return {**blocks, FIRST: self.first.from_devices(entering[FIRST], blocks[FIRST])}

    def streamed(self, body: Any, length: Any) -> Stream:
        if self.first is not None:  # each event needs its index in the key's events
            return Stream()
        interp = self.interp
        return Streaming(self.store, streamed(interp.plan, interp.lanes, self.store, body, length))

    @contextlib.contextmanager
    def loop(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def entering_loop(self, states: dict[str, Any]) -> dict[str, Any]:
        return states if self.first is None else self.first.enter(self.depth, states)

    def iteration(self, states: dict[str, Any]) -> dict[str, Any]:
        return states if self.first is None else self.first.advance(self.depth - 1, states)

    def passes_on(self, eqn: Any) -> bool:
        """Whether the events it takes of the log equation `eqn` also go on to an enclosing
        spool or tap (`keep`)."""
        del eqn
        return self.keep

    def event(self, eqn: Any, invals: list[Any], states: dict[str, Any]) -> None:
        """Fold the events of one log equation into the states. Operands computed only for
        logs arrive `Lazy` (`_deferred.py`): where an event may be skipped, they are computed
        inside the `lax.cond` that folds it in (but on GPUs: `_branching.py`)."""
        interp, store = self.interp, self.store
        params = eqn.params
        if not selects(interp, eqn, invals):
            return  # not ours: an enclosing spool sees it
        if self.passes_on(eqn):  # (kept: an enclosing spool sees it too)
            rebind(eqn, invals, interp.lanes.mask())
        n_leaves = params["treedef"].num_leaves
        items = items_of(eqn, list(range(n_leaves)))
        steps = steps_of(interp, eqn, invals)
        mask = mask_of(eqn, invals, everywhere=True)
        lane = interp.lanes.mask()
        if lane is not None:
            mask = jnp.logical_and(mask, lane)
        # Keys without a state here are dropped by a Policy rule, or pass on (`pass_on`).
        keys = [k for k in items if k in states]
        pass_on(interp, eqn, invals, items, keys)
        if self.first is not None and keys:
            invals = [*force(invals[:n_leaves]), *invals[n_leaves:]]  # checked: all needed
            for key in keys:
                value = [invals[i] for i in jtu.tree_leaves(items[key])]
                self.first.check(self.depth, key, value, steps, mask, params, states)
        by_lane = [k for k in keys if store.info[k].lanes_as_events and params["nbatch"]]
        if by_lane:
            keys = [k for k in keys if k not in by_lane]
            leaves = force(invals[:n_leaves])
            batch = eqn.invars[0].aval.shape[: params["nbatch"]]  # (every operand's)
            self._lane_events(by_lane, items, leaves, steps, mask, batch, states)
        valid = {}
        for key in keys:
            states[key], valid[key] = store.gate(key, states[key], steps, mask)

        def fold(sub, leaves):
            for key in keys:
                value = jtu.tree_map(lambda i: leaves[i], items[key])
                event = store.event_of(key, value, steps, params["site"])
                sub[key] = store.fold(key, sub[key], event, valid[key])
            return sub

        lazy = any(isinstance(x, Lazy) for x in invals[:n_leaves])
        if not lazy or all(isinstance(v, bool) for v in valid.values()):
            states.update(fold({k: states[k] for k in keys}, force(invals[:n_leaves])))
        else:  # computed only if some event is kept
            kept = functools.reduce(jnp.logical_or, [jnp.any(v) for v in valid.values()])

            def folded(sub):  # also right where no event is kept: `fold` masks them
                return store.settle(fold(sub, force(invals[:n_leaves], {})))

            sub = store.settle(states, keys)
            states.update(_branching.skippable(kept, folded, lambda s: s, sub))

    def _lane_events(self, keys, items, leaves, steps, mask, batch, states) -> None:
        """Each lane of a batched event, of `batch` lanes, as an event of its own
        (`KeyInfo.lanes_as_events`)."""
        store = self.store
        for key in keys:
            value = jtu.tree_map(lambda i: leaves[i], items[key])
            lane_mask = True if mask is True else _lanes.fit(mask, batch)
            for idx in np.ndindex(*batch):
                lane_steps = {
                    n: x[idx] if jnp.shape(x)[: len(batch)] == batch else x
                    for n, x in steps.items()
                }
                lane = jtu.tree_map(lambda x: x[idx], value)
                m = True if lane_mask is True else lane_mask[idx]
                states[key], valid = store.gate(key, states[key], lane_steps, m)
                event = store.event_of(key, lane, lane_steps)
                states[key] = store.fold(key, states[key], event, valid)

    def run(self, closed: Any, args: Sequence[Any]) -> tuple[list[Any], LogDict]:
        interp, store = self.interp, self.store
        policy = interp.policy
        counts = interp.plan.program(closed)
        states = store.setup(counts)
        if policy.first_nonfinite:
            self.first = FirstNonfinite(store)
            states[FIRST] = self.first.init()
        outs, states = interp.eval(closed, args, states, settle=False)
        first = states.pop(FIRST, None)
        states = store.settle(states, arrays=False)  # what is known now stays so
        for key, state in states.items():
            for channel in store.channels[key]:
                store.check_size(key, channel, state[channel])
        check_across(store.info, policy.across)
        # keys with the same batch shape are finalized under one vmap: a vmap per key costs
        # more to trace than most finalizations
        by_batch: dict[tuple[int, ...], dict[str, Any]] = {}
        for key, state in states.items():
            state, batch = merge_across(
                store.info[key],
                state,
                store.channels[key],
                store.bounds[key],
                functools.partial(store.lane_struct, key),
                policy.across,
            )
            by_batch.setdefault(batch, {})[key] = state
        values, count, steps, names, rows = {}, {}, {}, {}, {}
        for batch, group in by_batch.items():
            finished = vmap_n(lambda g: {k: store.finish(k, s) for k, s in g.items()}, len(batch))
            for key, (key_rows, finals) in finished(group).items():
                name = policy.prefix + key
                reduction = store.reductions[key]
                count[name] = group[key]["count"]
                names[name] = type(reduction).__name__
                if key_rows is not None:
                    rows[name] = key_rows
                for channel, out in finals.items():
                    if channel in store.channels[key]:  # (not a value never logged)
                        place = method(store.channels[key][channel], "place_batch_axes")
                        out = place(out, len(batch))
                    if channel == "value":
                        values[name] = out
                    else:
                        steps.setdefault(channel.removeprefix("step:"), {})[name] = out
        logs = LogDict(values, count=count, steps=steps, reductions=names, rows=rows)
        # what is known now is static: not an output (`LogDict`); but for a key with no value,
        # whose count a vmap around the spool could not give its lanes (`_parts`)
        parts = {"count": count, "rows": rows}
        valued = {policy.prefix + k for k in states if store.info[k].leaves}
        logs._known = {
            (p, k): None
            for p, xs in parts.items()
            for k, x in xs.items()
            if _known(x) and k in valued
        }
        if first is not None:
            logs._nonfinite = (self.first.finish(first["value"]), self.first.tables())
        return outs, logs
