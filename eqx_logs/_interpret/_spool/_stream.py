"""Events a scan streams out.

A key whose events in a scan body are all kept for sure (no cond, mask or interval decides
them), the same number in every iteration, and stacked (Stack, the default), leaves the scan as
its `ys`, as by hand: no buffer in the carry, no write per iteration. The scan rule asks
`Spool.streamed` which keys of a body stream (`streamed`), and gets a `Streaming`: it starts
every iteration with `stream_state`, takes each iteration's events out with `stream_events`
and adds them after the scan with `add_stream`.
"""

from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

from ... import _compat, _lanes
from ..._methods import method
from ..._reduce import Stack
from .._handler import Stream
from .._keys import keys_of
from .._lane_context import LaneContext
from .._plan import Plan
from .._values import counter, plus, stop_gradients, vmap_n
from ._store import FRESH, STREAM, Pending, Store


class Streaming(Stream):
    """Spool's `Stream`: `keys` (with their events per iteration) leave a scan as its `ys`."""

    def __init__(self, store: Store, keys: dict[str, int]):
        self.store, self.keys = store, keys

    def start(self, states: dict[str, Any]) -> dict[str, Any]:
        return {**states, **{k: stream_state(self.store, k) for k in self.keys}}

    def take(self, states: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        states = dict(states)
        return states, {k: stream_events(self.store, k, states.pop(k)) for k in self.keys}

    def add(self, states: dict[str, Any], events: dict[str, Any], reverse: bool) -> dict[str, Any]:
        states = dict(states)
        for k, block in events.items():
            states[k] = add_stream(self.store, k, states[k], block, self.keys[k], reverse)
        return states


def streamed(
    plan: Plan, lanes: LaneContext, store: Store, body: Any, length: Any
) -> dict[str, int]:
    """The keys `body` can stream out (see above), with their events per iteration. The
    events of a scan nested in `body` that streams them count too, as one block (where no
    lane value can reach that scan, see `_lanes.py`: a lane guard would mask them)."""
    if not store.reductions or store.policy.interval != 1 or lanes.guards:
        return {}  # (no states at all: `_masking`'s interpreter only re-binds logs)
    if not isinstance(length, int):
        return {}
    per_iteration: dict[str, int] = {}
    excluded: set[str] = set()
    nested = not lanes.values and not _lanes.has_lanes(body, nested=True)
    for eqn, logs in plan.logging(body):
        if logs:
            for key in keys_of(eqn):
                if key not in store.reductions:
                    continue
                if eqn.params["masked"] or store.info[key].lanes_as_events:
                    excluded.add(key)
                per_iteration[key] = per_iteration.get(key, 0) + 1
        else:
            inner = {}
            if nested and plan.rule(eqn).scan:
                inner_body, _, _ = _compat.scan_parts(eqn)
                inner_length = _compat.scan_options(eqn)["length"]
                inner = streamed(plan, lanes, store, inner_body, inner_length)
                for key, n in inner.items():
                    per_iteration[key] = per_iteration.get(key, 0) + n * inner_length
            excluded.update(k for k in plan.rule(eqn).count(plan, eqn) if k not in inner)
    return {
        k: n
        for k, n in per_iteration.items()
        # (a key with no channel, a count without steps, has nothing to stream)
        if n
        and k not in excluded
        and store.channels[k]
        and all(_streams(r) for r in store.channels[k].values())
    }


def stream_state(store: Store, key: str) -> dict[str, Any]:
    """The state a streamed key starts every iteration with."""
    state = {"count": counter(store.manual.batch_shape(store.info[key]))}
    return state | {channel: Pending(STREAM, ()) for channel in store.channels[key]}


def stream_events(store: Store, key: str, state: dict[str, Any]) -> dict[str, Any]:
    """The events of one iteration of a streamed key, per channel: stacked, or the one
    event itself."""
    out = {}
    for channel in store.channels[key]:
        pending = state[channel]
        assert isinstance(pending, Pending) and pending.state is STREAM, key
        events = pending.events
        if any(isinstance(e, _Block) for e in events):  # a nested scan's events among them
            # (a block left its scan stopped already)
            parts = [
                e.events if isinstance(e, _Block) else _one_row(stop_gradients(e)) for e in events
            ]
            out[channel] = jtu.tree_map(lambda *v: jnp.concatenate(v), *parts)
            if sum(_rows_of(p) for p in parts) == 1:
                out[channel] = jtu.tree_map(lambda x: x[0], out[channel])
            continue
        if len(events) > 1:
            events = [jtu.tree_map(lambda *v: jnp.stack(v), *events)]
        out[channel] = stop_gradients(events[0])
    return out


def add_stream(
    store: Store,
    key: str,
    state: dict[str, Any],
    ys: dict[str, Any],
    per_iteration: int,
    reverse: bool,
) -> dict[str, Any]:
    """`state` after the events a scan streamed out: `ys`, per channel, shaped
    `(iterations, events per iteration, *batch, ...)`, without the second axis for one
    event per iteration."""
    state = dict(state)
    nbatch = store.info[key].nbatch
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
        if isinstance(old, Pending) and old.state is STREAM:  # an outer scan streams on
            state[channel] = Pending(STREAM, (*old.events, _Block(block)))
            continue
        # the lanes' layout: batch axes first
        block = jtu.tree_map(lambda x: jnp.moveaxis(x, 0, nbatch), block)
        batch = store.manual.batch_shape(store.info[key])
        if isinstance(old, Pending) and old.state is FRESH and not old.events:
            if n == store.bounds[key]:  # the events are the whole buffer
                state[channel] = {"buffer": block, "index": counter(batch, n)}
                continue
        old = store.settle_channel(key, channel, old, arrays=False)
        extend = method(store.channels[key][channel], "extend")
        state[channel] = vmap_n(extend, nbatch)(old, block)
    if n is not None:
        state["count"] = plus(state["count"], n)
    if isinstance(state.get("value"), dict) and "buffer" in state["value"]:
        state["value"] = store.info[key].shard_like_values(state["value"])
    return state


# -- the whole program ----------------------------------------------------------------


class _Block:
    """Among a streamed key's pending events: those a nested scan streamed out, stacked on a
    leading axis (`add_stream`)."""

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
