"""`Policy.first_nonfinite`: the first event, in execution order, whose value has a non-finite
element, found on the device by a state threaded with the keys' states (under `FIRST`)."""

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from ... import _lanes
from ..._primitive import BACKWARD_TAG
from ..._stats import overflows
from .._keys import site_list
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
        if any(info[k].mesh for k in store.reductions):
            keys = [k for k in store.reductions if info[k].mesh]
            raise ValueError(
                f"eqx_logs.spool(first_nonfinite=True): key {keys[0]!r} is logged inside a "
                f"shard_map or pmap (at {site_list(info[keys[0]].sites)}), where "
                "finding the first non-finite event is not supported yet. Spool inside the "
                "shard_map, or check `logs[key]` for NaNs with `jnp.isfinite`."
            )
        self.keys = {k: i for i, k in enumerate(store.reductions)}
        sites = (s for k in store.reductions for s in info[k].sites)
        self.sites = {s: i for i, s in enumerate(dict.fromkeys(sites))}
        self.steps = sorted({n for k in store.reductions for n in info[k].steps})

    def init(self) -> dict[str, Any]:
        record = {"found": np.bool_(False), "backward": np.bool_(False)}
        record.update({n: np.int32(-1) for n in ("key", "site", "event", "lane", "depth")})
        record.update({f"step:{n}": np.int32(-1) for n in self.steps})
        record["iterations"] = np.full(MAX_LOOPS, -1, np.int32)
        # the iteration each enclosing loop is in now (not a field of the record)
        return {"value": record, "loops": np.full(MAX_LOOPS, -1, np.int32)}

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

    def finish(self, state: dict[str, Any]) -> dict[str, Any]:
        return {n: jnp.asarray(x) for n, x in state.items()}

    def tables(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        return tuple(self.keys), tuple(self.sites), tuple(self.steps)
