"""`Policy.first_nonfinite`: the first event, in execution order, whose value has a non-finite
element, found on the device by a state threaded with the keys' states (under `FIRST`).
Through a shard_map each device threads a copy of it (`to_devices`); leaving it, the
lowest-numbered device that found one gives its record (`from_devices`)."""

import functools
import math
from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ... import _lanes
from ..._primitive import BACKWARD_TAG
from ..._stats import overflows
from ._store import Store

# The state of `Policy.first_nonfinite`, threaded with the keys' states (`Spool.keys`).
FIRST = "\x00first_nonfinite"
MAX_LOOPS = 8  # nested loops whose iteration it records


class FirstNonfinite:
    """Finds the first event, in execution order, whose value has a non-finite element: a
    state threaded through every loop, branch and custom rule where a kept key logs, as the
    keys' states are, updated at each of their events."""

    def __init__(self, store: Store):
        info = self.info = store.info
        self.manual = store.manual
        self.keys = {k: i for i, k in enumerate(store.reductions)}
        sites = (s for k in store.reductions for s in info[k].sites)
        self.sites = {s: i for i, s in enumerate(dict.fromkeys(sites))}
        self.steps = sorted({n for k in store.reductions for n in info[k].steps})
        # whether a kept key is logged inside a shard_map or pmap: the record names the device
        self.devices = any(info[k].mesh for k in store.reductions)

    def init(self) -> dict[str, Any]:
        record = {"found": np.bool_(False), "backward": np.bool_(False)}
        record.update({n: np.int32(-1) for n in ("key", "site", "event", "lane", "depth")})
        record.update({f"step:{n}": np.int32(-1) for n in self.steps})
        record["iterations"] = np.full(MAX_LOOPS, -1, np.int32)
        # the iteration each enclosing loop is in now (not a field of the record)
        state = {"value": record, "loops": np.full(MAX_LOOPS, -1, np.int32)}
        if self.devices:  # the device it happened on; the device evaluating now (-1: none)
            record["device"] = state["device"] = np.int32(-1)
        return state

    def enter(self, depth: int, states: dict[str, Any]) -> dict[str, Any]:
        if depth >= MAX_LOOPS or FIRST not in states:
            return states
        state = states[FIRST]
        return {**states, FIRST: {**state, "loops": jnp.asarray(state["loops"]).at[depth].set(-1)}}

    def advance(self, depth: int, states: dict[str, Any]) -> dict[str, Any]:
        if depth >= MAX_LOOPS or FIRST not in states:
            return states
        state = states[FIRST]
        loops = jnp.asarray(state["loops"]).at[depth].add(1)
        return {**states, FIRST: {**state, "loops": loops}}

    def check(self, depth, key, leaves, steps, mask, params, states) -> None:
        """Fold one event of `key` (its value's `leaves`, batched over `params["nbatch"]`
        leading axes; it happened where `mask`, inside `depth` loops) into the state, before
        the event counts."""
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
        mesh = self.manual.local_axes(self.info[key])
        if mesh:  # inside a shard_map: the device's own count (its block: mesh axes of size 1)
            before = jnp.reshape(before, jnp.shape(before)[mesh:])
        if self.info[key].lanes_as_events:  # one count for all lanes, in lane order
            event = before + lane
        else:
            event = jnp.ravel(jnp.broadcast_to(before, batch))[lane]
        record = {
            "key": self.keys[key],
            "site": self.sites.get(params["site"], -1),  # (-1: a rule JAX traced later)
            "event": event,
            "lane": lane if batch else -1,
            "backward": BACKWARD_TAG in params["tags"],
            "depth": min(depth, MAX_LOOPS),
            "iterations": states[FIRST]["loops"],
        }
        if self.devices:
            record["device"] = states[FIRST]["device"]
        for name in self.steps:
            if name not in steps:
                continue
            x = jnp.asarray(steps[name])
            record[f"step:{name}"] = jnp.ravel(x)[lane] if x.ndim else x
        old = states[FIRST]["value"]
        hit = bad[lane]
        new = jnp.logical_and(hit, jnp.logical_not(old["found"]))
        out = {n: jnp.where(new, jnp.asarray(v, old[n].dtype), old[n]) for n, v in record.items()}
        found = jnp.logical_or(old["found"], hit)
        states[FIRST] = {**states[FIRST], "value": {**old, **out, "found": found}}

    # -- through a shard_map (`Spool.device_*`) ----------------------------------------------

    def to_devices(self, state: dict[str, Any], sizes: tuple[int, ...]) -> dict[str, Any]:
        """`state` entering a shard_map whose manual mesh axes have `sizes`: a copy for each
        device (leading axes `sizes`), with the device's number, row-major over those axes
        (within the device of an enclosing shard_map: `outer * devices + own`)."""
        copies = jtu.tree_map(lambda x: jnp.broadcast_to(x, sizes + jnp.shape(x)), state)
        n = math.prod(sizes)
        own = jnp.arange(n, dtype=jnp.int32).reshape(sizes)
        outer = jnp.maximum(jnp.asarray(state["device"], jnp.int32), 0)
        return {**copies, "device": outer * n + own}

    def on_device(self, state: dict[str, Any], naxes: int) -> dict[str, Any]:
        """A device's copy, from its block (its leading `naxes` axes of size 1)."""
        return jtu.tree_map(lambda x: jnp.reshape(x, jnp.shape(x)[naxes:]), state)

    def off_device(self, state: dict[str, Any], naxes: int) -> dict[str, Any]:
        """A device's block of the copies, from its copy."""
        return jtu.tree_map(lambda x: jnp.reshape(x, (1,) * naxes + jnp.shape(x)), state)

    def from_devices(self, entering: dict[str, Any], copies: dict[str, Any]) -> dict[str, Any]:
        """The state leaving a shard_map, from every device's copy: the devices run at once,
        so where the state `entering` it had found none, the lowest-numbered device that
        found one gives its record (if `entering` had, every copy holds that record)."""
        record, devices = copies["value"], copies["device"]
        nlead = jnp.ndim(devices)
        lead = tuple(range(nlead))
        none = jnp.iinfo(jnp.int32).max
        lowest = jnp.min(jnp.where(record["found"], devices, none))
        found = lowest != none
        this = devices == lowest  # that device (where one found)

        def pick(x, before):
            mask = jnp.reshape(this, this.shape + (1,) * (x.ndim - nlead))
            mask = jnp.broadcast_to(mask, x.shape)
            got = jnp.sum(jnp.where(mask, x, jnp.zeros((), x.dtype)), lead, dtype=jnp.int32)
            return jnp.where(found, got.astype(x.dtype), before)

        value = jtu.tree_map(pick, record, entering["value"])
        return {**entering, "value": value}

    def finish(self, state: dict[str, Any]) -> dict[str, Any]:
        return {n: jnp.asarray(x) for n, x in state.items()}

    def tables(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        return tuple(self.keys), tuple(self.sites), tuple(self.steps)
