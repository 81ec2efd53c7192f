"""The records of a `logger.jit` write cut straight from its fetched buffers.

`records(unpack(packed, buffers))` builds a LogDict per call (unflattened, unpacked, copied
without the keys that hold no event, flattened again by `to_host`), then reads it key by key
through pytree calls: about 150 us of the writer thread's Python per call, which competes
with the training loop for the GIL. For a layout whose keys each hold one packed array (the
common case: scalars and small arrays, no `first_nonfinite` report), where each key's value,
count, rows and steps are in the buffers is worked out once (`RowPlan`), and a write's
records are cut from the buffers with a numpy slice per leaf: the same records, in the same
order, with the same numpy values, for a few microseconds.
"""

import math
import weakref
from typing import Any

import jax
import numpy as np

from ._host import Record, key_records, overflow_message
from ._packed import Layout

# (buffer index, offset, shape) of a packed leaf
_Place = tuple[int, int, tuple[int, ...]]


class RowPlan:
    """Where each key's parts are in the buffers of a layout, in the LogDict's key order:
    `(key, value, count, rows or None, ((step name, place), ...), is a Stack)`; and, for a
    key whose count and rows are scalars and whose value and steps hold one element per
    row (a Stack of scalars: `interval=1`'s), `(buffer, offset)` of each of them
    (`scalar_rows`, else None), to be read an element at a time; `constants`: the buffers,
    after the layout's, of the counts and rows known at trace time."""

    __slots__ = ("keys", "scalar_rows", "constants")

    def __init__(self, keys: tuple[tuple[Any, ...], ...], constants: tuple[np.ndarray, ...]):
        self.keys = keys
        self.scalar_rows = tuple(map(_scalar_rows, keys))
        self.constants = constants


def _scalar_rows(key: tuple[Any, ...]) -> tuple[Any, ...] | None:
    _, value, count, rows, steps, _ = key
    if value is None:  # a key with no value: `key_records`
        return None
    length = value[2][:1]
    if rows is None or count[2] or rows[2] or len(value[2]) != 1:
        return None
    if any(shape != length for _, (_, _, shape) in steps):
        return None
    steps_at = tuple((n, at[:2]) for n, at in steps)
    return (count[:2], rows[:2], value[:2], steps_at, length[0])


# layout -> its plan (None: none), worked out once per compiled step
_PLANS: "weakref.WeakKeyDictionary[Layout, RowPlan | None]" = weakref.WeakKeyDictionary()


def row_plan(layout: Layout) -> RowPlan | None:
    """The `RowPlan` of `layout`, or None where a key's value is a pytree or a leaf is not
    packed, or the logs carry a `first_nonfinite` report (`records` of the LogDict then)."""
    try:
        return _PLANS[layout]
    except KeyError:
        plan = _PLANS[layout] = _row_plan(layout)
        return plan


def _row_plan(layout: Layout) -> RowPlan | None:
    places = layout.places
    # the LogDict of leaf indices: its own unflattening says which leaf is which part
    index = jax.tree.unflatten(layout.treedef, list(range(len(places))))
    if index._nonfinite is not None:
        return None
    # the counts and rows known at trace time (arrays in the treedef, not leaf indices) are
    # read from buffers of their own, after the layout's
    constants: list[np.ndarray] = []
    first = 1 + max((i for i, *_ in places), default=-1)

    def place(at: Any) -> _Place | None:
        if at is None or isinstance(at, int):
            return None if at is None else places[at]
        constants.append(np.ravel(at))
        return (first + len(constants) - 1, 0, np.shape(at))

    steps = index.steps
    keys = []
    for key, value in dict.items(index):
        empty = not jax.tree.leaves(value)  # logged with no value (`()`): a count and steps
        parts = [] if empty else [value]
        parts += [x for x in (index.count[key], index.rows.get(key)) if isinstance(x, int)]
        parts += [at for per_key in steps.values() if (at := per_key.get(key)) is not None]
        if not (empty or isinstance(value, int)) or any(places[i][0] < 0 for i in parts):
            return None
        keys.append(
            (
                key,
                None if empty else places[value],
                place(index.count[key]),
                place(index.rows.get(key)),
                tuple((n, places[per_key[key]]) for n, per_key in steps.items() if key in per_key),
                index.reductions.get(key) == "Stack",
            )
        )
    return RowPlan(tuple(keys), tuple(constants))


def _cut(buffers: list[np.ndarray], place: _Place) -> np.ndarray:
    index, at, shape = place  # (as `unpack` does)
    return buffers[index][at : at + math.prod(shape)].reshape(shape)


class HostRows:
    """A fetched `logger.jit` write of a layout with a `RowPlan`: its buffers on the host,
    and the keys not to write."""

    __slots__ = ("plan", "buffers", "drop")

    def __init__(self, plan: RowPlan, buffers: list[np.ndarray], drop: tuple[str, ...]):
        self.plan, self.buffers, self.drop = plan, buffers, drop

    def records(self, warn: Any) -> list[Record]:
        """What `records(logs, warn)` gives for the LogDict these buffers unpack to, without
        the keys in `drop` (the same records, values and order)."""
        plan, drop, out = self.plan, self.drop, []
        buffers = [*self.buffers, *plan.constants] if plan.constants else self.buffers
        for (key, value_at, count_at, rows_at, steps_at, stack), scalar in zip(
            plan.keys, plan.scalar_rows
        ):
            if drop and key in drop:
                continue
            if scalar is not None:  # (the same numpy scalars as the arrays' elements)
                (c, c_at), (r, r_at), (v, v_at), steps_of, length = scalar
                count, rows = buffers[c][c_at], buffers[r][r_at]
                if not count:  # no event: no record
                    continue
                if rows <= length:  # (else as below, which raises)
                    if stack and count > rows:
                        warn(overflow_message(key, count, rows), UserWarning)
                    vs = buffers[v]
                    for i in range(int(rows)):
                        row = {"key": key, "value": vs[v_at + i]}
                        for name, (b, at) in steps_of:
                            row[name] = buffers[b][at + i]
                        out.append(row)
                    continue
            count = _cut(buffers, count_at)
            if not count.any():  # no event: no record
                continue
            value = () if value_at is None else _cut(buffers, value_at)
            steps = {name: _cut(buffers, at) for name, at in steps_at}
            rows = None if rows_at is None else _cut(buffers, rows_at)
            out += key_records(key, value, count, rows, steps, stack, warn)
        return out
