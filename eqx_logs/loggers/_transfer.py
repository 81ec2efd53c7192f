"""Logs on their way from the device to a logger's writer thread: a jitted step's logs
packed into a few buffers (`Packing`, for `logger.jit`), the size of a write, and the fetch
of the writes queued in a row (`fetch_writes`, on the writer thread)."""

import functools
import math
from collections.abc import Callable, Container
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._logdict import LogDict
from .._retrace import fun_key, note_compile
from ._host import to_host
from ._packed import Packed, pack, unpack
from ._prepared import NOTHING
from ._rows import HostRows, row_plan


@functools.cache
def one_process() -> bool:
    # (asked once arrays exist, so after any `jax.distributed.initialize`)
    return jax.process_count() == 1


def nbytes_of(logs: LogDict) -> int:
    """Roughly the bytes `logs` holds: its values' (counts and steps are a few more)."""
    leaves = map(host_leaves, logs.values())
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for xs in leaves for x in xs)


def host_leaves(value: Any) -> list[Any]:
    return [np.asarray(x) if not hasattr(x, "dtype") else x for x in jax.tree.leaves(value)]


def fetch_writes(
    items: list[tuple[Any, LogDict | Packed, tuple[str, ...]]], opened: Container[int] = ()
) -> list[Any]:
    """On the writer thread, before the backend's turn: wait for the device, then fetch the
    run indices and counts (or small leaves, packed) of every write queued in a row (one
    transfer), and the keys that hold events of those that have any (another); a packed write
    of a layout with a `RowPlan` as its buffers (`HostRows`). `(runs, None)`
    for a write without events, or `NOTHING` where its runs are all `opened` already, or
    opened by a write before it (a write without events opens its runs, and does nothing
    more). Each item is `(runs, logs, drop)`: `runs`, the state's run indices (on the device
    or not); `drop`, keys not to write (a backend cannot store them)."""
    heads = to_host([(runs, _head(logs)) for runs, logs, _ in items])
    more = {  # packed writes whose counts hold an event: all of their small leaves now
        i: list(logs.buffers)
        for i, ((_, logs, _), (_, head)) in enumerate(zip(items, heads))
        if isinstance(logs, Packed) and logs.layout.counts and head[: logs.layout.counts[1]].any()
    }
    for i, buffers in to_host(more).items():
        heads[i] = (heads[i][0], buffers)
    keep, cut = {}, {}
    for i, ((_, logs, drop), (runs, head)) in enumerate(zip(items, heads)):
        if isinstance(logs, Packed) and not isinstance(head, list):
            continue  # (the counts alone, none of them an event)
        if isinstance(logs, Packed):
            # (its counts hold an event; one lane; no key to drop: else as below)
            simple = not drop and np.ndim(runs) == 0
            plan = row_plan(logs.layout) if simple else None
            if plan is not None:  # its records are cut from the buffers (`HostRows`)
                cut[i] = HostRows(plan, head, drop)
                continue
            logs = unpack(logs, head)
            logs = logs._without(drop) if drop else logs
            head = logs.count  # (numpy arrays)
        count = head
        empty = [key for key in logs if not count[key].any()]  # (numpy arrays)
        if len(empty) < len(logs) or logs._nonfinite is not None:
            keep[i] = logs._without(empty) if empty else logs
    fetched = to_host(keep)
    fetched.update(cut)
    out, opening = [], set()  # (the runs that a write before this one opens)
    for i, (runs, _) in enumerate(heads):
        mine = {int(r) for r in np.ravel(runs)}
        if i in fetched or not all(r in opened or r in opening for r in mine):
            out.append((runs, fetched.get(i)))
            opening |= mine
        else:
            out.append(NOTHING)
    return out


def _head(logs: LogDict | Packed) -> Any:
    """What `fetch_writes` reads of every write first: the counts; for a packed write, the buffer
    that holds them (or every buffer)."""
    if not isinstance(logs, Packed):
        return logs.count
    if logs.layout.counts is not None:
        return logs.buffers[logs.layout.counts[0]]
    return list(logs.buffers)


class Packing(eqx.Module):
    spooled: Callable

    @property
    def __wrapped__(self):  # (its signature is the function's: `inspect.signature`)
        return self.spooled.__wrapped__

    def __call__(self, *args, **kwargs):  # traced by `logger.jit`'s `Jit`
        fun = self.spooled.__wrapped__
        note_compile("logger.jit", fun_key(fun), fun, args, kwargs)
        out, logs = self.spooled(*args, **kwargs)
        return out, pack(logs)
