"""Chunked tap, `tap(..., buffer=k)`: a tap handler option that gathers the events it keeps on
the device, in a block of k rows per group of keys (keys logged by the same equations), and
hands each full block to the host in one callback; a partial block goes at the end of the call.

A group's block is a state of its own (`states[group + BLOCK]`), threaded through loops and
branches as the group's counter is: its rows (each key's values, each step, and for batched
events the lanes where the event happened) and `fill`, the rows written. An event is written
at row `fill`, which advances by whether the interval keeps the event; where a row is written
and not kept, the next event overwrites it.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from .. import _compat, _lanes
from .._branching import skippable
from .._deferred import Lazy, force, stop_gradient
from .._interpret import site_list, widened
from .._reduce import cast_event

BLOCK = "\x00block"  # a group's block state: `states[group + BLOCK]`


class Blocks:
    """The blocks of one tap's groups. `sink(context, logs, steps)` receives each block: `logs`
    maps each key (with the policy's prefix) to its values, `steps` each step to its values,
    all with a leading axis of events (and `steps["valid"]`, the lanes where each batched
    event happened). A block with no array at all (keys logged with no value, `()`, and no
    step) is received event by event."""

    def __init__(self, size: int, sink: Callable, context: Any, every_process: bool):
        self.size, self.sink, self.context = size, sink, context
        self.every_process = every_process
        # in a scan `_split.ScanSplit.blocked` splits: each group's row of this iteration
        self.streaming: dict[str, Any] | None = None

    def setup(self, info: dict[str, Any], groups: dict[str, str], prefix: str) -> dict:
        """The first block of each group (`groups`: key -> group), from the keys' `info`."""
        self.prefix = prefix
        self.keys: dict[str, list[str]] = {}
        for key, group in groups.items():
            where = f"key {key!r} (logged at {site_list(info[key].sites)})"
            if info[key].mesh:
                raise ValueError(
                    f"eqx_logs.tap(buffer={self.size}): {where} is logged inside a shard_map or "
                    "pmap, where tap does not gather blocks yet. Tap without `buffer` (each "
                    "device calls back with its own events), or spool inside the shard_map."
                )
            if info[key].lanes_as_events:
                raise ValueError(
                    f"eqx_logs.tap(buffer={self.size}): {where} is logged under vmaps of "
                    "different sizes (`lax.map(..., batch_size=k)` with a remainder), whose "
                    "events cannot share one block. Tap it without `buffer`."
                )
            self.keys.setdefault(group, []).append(key)
        # each group's rows: each key's value, each step; and the batch shape of its events
        self._structs = {
            group: (
                {k: jtu.tree_unflatten(info[k].treedef, info[k].leaves) for k in keys},
                info[keys[0]].steps,
                info[keys[0]].batch_shape(),
            )
            for group, keys in self.keys.items()
        }
        return {g + BLOCK: self._empty(g) for g in self.keys}

    def _empty(self, group: str) -> dict[str, Any]:
        values, steps, batch = self._structs[group]
        n = self.size
        block = {
            "fill": 0,
            "values": jtu.tree_map(lambda s: jnp.zeros((n, *s.shape), s.dtype), values),
            "steps": {name: jnp.full((n, *s.shape), -1, s.dtype) for name, s in steps.items()},
        }
        if batch:
            block["valid"] = jnp.ones((n, *batch), jnp.bool_)
        return block

    @staticmethod
    def threadable(block: dict[str, Any]) -> dict[str, Any]:
        fill = block["fill"]
        return {**block, "fill": jnp.int32(fill) if isinstance(fill, int) else fill}

    def row(self, group, items, steps, mask, memo=None) -> dict[str, Any]:
        """One event of `group` as a row of its block: its keys' values (`items`, maybe
        `Lazy`: forced with `memo`), its steps, and for batched events the lanes where it
        happened (`mask`, or None: all)."""
        values_struct, steps_struct, batch = self._structs[group]

        def leaf(key, x, s):  # as its key's: cast, and broadcast along vmap axes it lacks
            return widened(cast_event(stop_gradient(force([x], memo)[0]), s.dtype, key), s.shape)

        row = {
            "values": {
                k: jtu.tree_map(functools.partial(leaf, k), items[k], values_struct[k])
                for k in values_struct
            },
            "steps": {n: _step(steps, n, s) for n, s in steps_struct.items()},
        }
        if batch:
            lanes = True if mask is None else _lanes.fit(mask, batch)
            row["valid"] = jnp.broadcast_to(lanes, batch)
        return row

    @staticmethod
    def put(block: dict[str, Any], rows: dict[str, Any], at: Any, one: bool = True) -> dict:
        """`block` with `rows` (one row, or a leading axis of rows if not `one`) written from
        row `at` on."""

        def put(buffer, x):
            x = jnp.asarray(x, buffer.dtype)
            if one:
                return lax.dynamic_update_index_in_dim(buffer, x, at, 0)
            return lax.dynamic_update_slice_in_dim(buffer, x, at, 0)

        out = {**block, "values": jtu.tree_map(put, block["values"], rows["values"])}
        out["steps"] = {n: put(b, rows["steps"][n]) for n, b in block["steps"].items()}
        if "valid" in block:
            out["valid"] = put(block["valid"], rows["valid"])
        return out

    def add(self, states, group, wanted, items, steps, mask, guard, tokens) -> None:
        """Write one event of `group` (its keys' values `items`, maybe `Lazy`; `steps`; the
        lanes `mask` where it happened, or None) where `wanted` (the interval keeps it), and
        send the block if that fills it; `guard` (or None): whether the host takes it (the
        conditions of the cond branches around it, under a vmap outside the tap). In a scan
        that `_split.ScanSplit.blocked` splits, the row is only recorded (`streaming`)."""
        if wanted is False:
            return
        if self.streaming is not None:
            self.streaming[group] = self.row(group, items, steps, mask)
            return
        name = group + BLOCK
        block = states[name]

        def write(block, memo=None):
            return self.put(block, self.row(group, items, steps, mask, memo), block["fill"])

        lazy = any(isinstance(x, Lazy) for x in jtu.tree_leaves(items))
        if isinstance(wanted, bool) or not lazy:
            block = write(block)  # a row not kept is overwritten by the next event
        else:  # computed only if kept (but on GPUs: `_branching.py`)
            block = skippable(wanted, lambda b: write(b, {}), lambda b: b, self.threadable(block))
        fill = block["fill"] + (
            int(wanted) if isinstance(wanted, bool) else wanted.astype(jnp.int32)
        )
        if isinstance(fill, int):
            if fill == self.size:
                self.send(group, block, self.size, guard, tokens)
                fill = 0
        else:
            full = fill == self.size
            n = jnp.where(full, self.size, 0)  # (0: the host ignores a call vmap made anyway)
            lax.cond(full, lambda: self.send(group, block, n, guard, tokens), lambda: None)
            fill = jnp.where(full, 0, fill)
        states[name] = {**block, "fill": fill}

    def finish(self, states: dict[str, Any], tokens: list[Any]) -> None:
        """Send each group's partial block, at the end of the call."""
        for group in self.keys:
            block = states[group + BLOCK]
            fill = block["fill"]
            if isinstance(fill, int):
                if fill:
                    self.send(group, block, fill, None, tokens)
            else:
                send = functools.partial(self.send, group, block, fill, None, tokens)
                lax.cond(fill > 0, send, lambda: None)

    def send(self, group, block, n, guard, tokens) -> None:
        """Call the sink on the host with the first `n` rows of `block`."""
        prefix, sink = self.prefix, self.sink
        meta = [n, True if guard is None else guard, *tokens]
        meta = jnp.stack([jnp.asarray(m, jnp.int32) for m in meta])
        rows = {"values": block["values"], "steps": block["steps"], "valid": block.get("valid")}

        def host(context, rows, meta):
            n, take = int(meta[0]), bool(meta[1])
            if not n or not take:
                return
            values = jtu.tree_map(lambda x: np.asarray(x)[:n], rows["values"])
            steps = {name: np.asarray(x)[:n] for name, x in rows["steps"].items()}
            if rows["valid"] is not None:
                steps["valid"] = valid = np.asarray(rows["valid"])[:n]
                values = hide_lanes(values, valid)
            logs = {prefix + k: v for k, v in values.items()}
            if jtu.tree_leaves((values, steps)):
                sink(context, logs, steps)
                return
            # keys with no value and no step (`log("tick", ())`): no axis could say how many
            # events there are, so each goes on its own, as without `buffer`
            for _ in range(n):
                sink(context, logs, steps)

        _compat.host_callback(host, self.context, rows, meta, every_process=self.every_process)


def hide_lanes(values: Any, valid: np.ndarray) -> Any:
    """On the host: `values` (numpy, leading axes those of `valid`) with NaN in their inexact
    leaves (bfloat16 too) where `valid`, the lanes where the event happened, is false."""

    def hide(v):
        if not jnp.issubdtype(v.dtype, jnp.inexact):
            return v
        return np.where(valid.reshape(valid.shape + (1,) * (v.ndim - valid.ndim)), v, np.nan)

    return jtu.tree_map(hide, values)


def _step(steps: dict[str, Any], name: str, s: jax.ShapeDtypeStruct) -> Any:
    """A step of an event as its key's (-1 where the event has none), as `Store.event_of`."""
    if name not in steps:
        return jnp.full(s.shape, -1, s.dtype)
    return widened(jnp.asarray(steps[name], s.dtype), s.shape)
