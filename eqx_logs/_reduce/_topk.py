"""TopK: the k largest (or smallest) elements of all events of a key, each with its id, the
ordinal of its event and that event's named steps.

Design. A reduction sees one channel of a key: the values, not the steps (those are channels
of their own). So what TopK needs beside each element travels inside the value: `log(key, x,
ids=idx, step=i)` (or any `log` whose `reduce=` is TopK) logs the value packed as a `Ranked`
(an `eqx.Module`, a pytree): `Ranked(value=x, ids=idx, steps={"step": i})`. Its leaves are
logged like any others (cast, broadcast over vmap lanes, sharded, differentiated: the engine
does not know about it), and TopK unpacks it in `init`/`update`. A value that is not a `Ranked`
(TopK chosen by a spool's Policy for a plain `log`) is ranked with each element's flat index
as its id and no steps.

A `Ranked` reaching any other reduction would be reduced as a pytree (a Mean would average the
ids and steps beside the values), so it is refused where spool picks each key's reduction
(`check_ranked`, called by `Store.setup`): an error naming the key and its call sites. `log`
refuses `ids=` with a `reduce=` that takes no ids at once, naming the call site. A reduction
takes ids where its class sets `takes_ids = True`. `eqx_logs.tap` reduces nothing: its
callback gets the `Ranked` as logged.

A site packs its value only with `ids=` or a TopK `reduce=`, so all sites of a key must agree
(a key logged with `ids=` at one site and without at another has two pytree structures: the
engine's error names both sites).

State, per leaf: the `k` kept elements best first (`_Top`: values, ids, event ordinals, flat
positions, steps; empty slots have event -1), and per key the number of events seen. An
update (or a block of straight-line events, `update_many`) sorts the kept elements followed by
the new ones with `lax.sort` on (class, value, event, position) and keeps the first `k`;
`merge(a, b)` does the same with b's event ordinals offset by a's count, so lanes and devices
merged `across=` continue the ordinals in lane (device) order.

Ordering (exactly a stable sort of all elements of all events, concatenated in event order):
larger first (smaller first with `largest=False`); ties by earliest event, then lowest flat
position within the event. NaN ranks as larger than every number, as in `numpy.sort` (which
puts NaN last): with `largest=True` NaNs come first (a NaN loss is the worst example), with
`largest=False` last. -0.0 and 0.0 tie. Booleans rank True above False.
"""

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from .._checks import check_count
from ._reductions import AbstractReduction, select_valid

#: The fields of each leaf's TopK output; a step of one of these names would clash with them.
RANKED_FIELDS = ("value", "id", "event")


class Ranked(eqx.Module):
    """A value logged with what TopK keeps beside each element: its `ids` (an integer array
    of each leaf's shape, or None: the flat index) and the `steps` of the `log` call."""

    value: PyTree[Any]
    ids: Any
    steps: dict[str, Any]


def takes_ids(reduction: Any) -> bool:
    """Whether `reduction` reduces `Ranked` values (its class sets `takes_ids = True`)."""
    return bool(getattr(type(reduction), "takes_ids", False))


def check_ranked(key: str, struct: Any, reduction: Any, sites: str) -> None:
    """Refuse a `Ranked` value (logged with `ids=`, or with `reduce=TopK(...)`) under a
    reduction that does not take ids: it would reduce the ids and steps as values."""
    if not isinstance(struct, Ranked) or takes_ids(reduction):
        return
    raise ValueError(
        f"eqx_logs.spool: key {key!r} is logged with `ids=` (or `reduce=eqx_logs.TopK(...)`) "
        f"at {sites}, but its reduction is {type(reduction).__name__} (chosen by the spool's "
        "Policy or its `reduce=`), which does not take ids: it would reduce the ids and steps "
        "as if they were values. Use `reduce=eqx_logs.TopK(k)` for this key (a Policy rule, "
        "or `reduce=` at the call site), or log it without `ids=` for other reductions "
        "(under another key if it needs both). Note that `ids` is reserved by `log`: it is "
        "never a step name."
    )


def _parts(x: Any) -> tuple[Any, Any, dict[str, Any]]:
    if isinstance(x, Ranked):
        return x.value, x.ids, dict(x.steps)
    return x, None, {}


class _Top(eqx.Module):
    """One leaf's kept elements, best first: their values, ids, event ordinals (-1: an empty
    slot), flat positions within their event and steps."""

    value: Array
    id: Array
    event: Array
    pos: Array
    steps: dict[str, Array]


def _is_top(x: Any) -> bool:
    return isinstance(x, _Top)


def _fill_value(dtype: Any, largest: bool) -> Any:
    """An empty slot's value: NaN for inexact dtypes, else the worst value of the dtype."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return jnp.nan
    if dtype == jnp.bool_:
        return not largest
    info = jnp.iinfo(dtype)
    return info.min if largest else info.max


def _missing(dtype: Any) -> Any:
    """An empty slot's id or step: -1, or the largest value of an unsigned dtype."""
    return jnp.iinfo(dtype).max if jnp.issubdtype(dtype, jnp.unsignedinteger) else -1


def _sort_keys(x: Array, event: Array, largest: bool) -> tuple[Array, Array]:
    """A class (0: NaN ranked first, 1: a number, 2: NaN ranked last, 3: an empty slot) and a
    primary key, both ascending for better elements."""
    nan = jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros(x.shape, bool)
    cls = jnp.where(nan, jnp.int32(0 if largest else 2), jnp.int32(1))
    cls = jnp.where(event < 0, jnp.int32(3), cls)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        zero = jnp.zeros((), x.dtype)
        primary = jnp.where(jnp.logical_or(nan, x == zero), zero, x)  # -0.0 ties with 0.0
        primary = -primary if largest else primary
    else:
        primary = x.astype(jnp.int8) if x.dtype == jnp.bool_ else x
        primary = jnp.invert(primary) if largest else primary  # ~x: order-reversing, no overflow
    return cls, primary


def _select(top: _Top, k: int, largest: bool) -> _Top:
    """The best `k` of the candidates in `top` (of any length >= k)."""
    cls, primary = _sort_keys(top.value, top.event, largest)
    index = jnp.arange(top.value.shape[0], dtype=jnp.int32)
    *_, perm = jax.lax.sort((cls, primary, top.event, top.pos, index), num_keys=4)
    perm = perm[:k]
    return jtu.tree_map(lambda a: a[perm], top)


def _concat(tops: list[_Top]) -> _Top:
    return jtu.tree_map(lambda *xs: jnp.concatenate(xs), *tops)


def _candidates(top: _Top, leaf: Any, ids: Any, steps: dict[str, Any], ordinal: Any) -> _Top:
    """One event's elements of one leaf, as candidates like the kept ones in `top`."""
    value = jnp.ravel(jnp.asarray(leaf, top.value.dtype))
    n = value.shape[0]
    pos = jnp.arange(n, dtype=jnp.int32)
    ident = pos if ids is None else jnp.ravel(jnp.asarray(ids))
    ident = ident.astype(top.id.dtype)
    event = jnp.broadcast_to(jnp.asarray(ordinal, jnp.int32), (n,))
    stepped = {
        name: jnp.broadcast_to(jnp.asarray(steps[name], s.dtype), (n,))
        for name, s in top.steps.items()
    }
    return _Top(value=value, id=ident, event=event, pos=pos, steps=stepped)


class TopK(AbstractReduction):
    """The `k` largest (or smallest) elements of all events of a key, each with its id, the
    ordinal of the event it came from and that event's named steps: across every loop
    iteration, branch and step of the run, merged across vmap lanes and devices with
    `spool(..., across=...)`. So a loss spike names its examples.

    Log the value with `ids=` (an integer array of the value's shape: an id per element, such
    as the examples' indices in the dataset), or without: the id is then the element's flat
    index within its event. Each leaf of a pytree value has a TopK of its own.

    **Arguments:**

    - `k`: how many elements to keep (an int, at least 1).
    - `largest`: keep the largest (True) or the smallest (False).

    **Returns:**

    Per leaf, a dict of arrays of shape `(k,)`, best first: `"value"` (the leaf's dtype),
    `"id"` (the ids' dtype; int32 flat indices without `ids=`), `"event"` (int32, the ordinal
    of the event among the key's events, from 0) and one entry per step of the `log` call
    (`step=i` gives `"step"`; the steps of enclosing `eqx_logs.scope` blocks too). Ties: the
    earliest event first, then the lowest flat position, so the order is that of a stable
    sort of all elements of all events in the order they were logged. NaN ranks above every
    number (first with `largest=True`, last with `largest=False`); booleans rank True above
    False. With fewer than `k` elements, the empty slots at the end hold value NaN (the
    dtype's minimum for integers with `largest=True`, its maximum with `largest=False`;
    False/True for booleans), id -1, event -1 and steps -1 (the dtype's maximum for unsigned
    ones).

    The steps are recorded only where the `log` call itself packs them: with `ids=` or with
    `reduce=TopK(...)` at the call site. A TopK chosen by a spool's Policy for a `log` with
    neither ranks elements by flat index and event, without steps. `ids` is reserved by
    `log` (a step cannot be named `ids`); steps named `id` or `event` clash with the
    output's fields and are refused.

    !!! example

        ```python
        def train(losses):
            def step(c, i):
                batch = losses[i]  # per-example losses of step i
                eqx_logs.log("loss", batch, ids=jnp.arange(4) + 4 * i, step=i,
                             reduce=eqx_logs.TopK(2))
                return c, None

            return jax.lax.scan(step, 0, jnp.arange(3))[0]

        losses = jnp.array([[1.0, 2, 3, 4], [5, 9, 0, 1], [2, 2, 8, 1]])
        _, logs = eqx_logs.spool(train)(losses)
        # logs["loss"]["value"] == [9, 8], ["id"] == [5, 10], ["step"] == [1, 2]
        ```
    """

    k: int = eqx.field(static=True, default=8)
    largest: bool = eqx.field(static=True, default=True)
    takes_ids: ClassVar[bool] = True

    def __check_init__(self):
        check_count("TopK", "k", self.k)
        if not isinstance(self.largest, bool):
            raise TypeError(
                f"TopK(largest={self.largest!r:.60}): largest must be True (the k largest "
                "elements) or False (the k smallest)."
            )

    def init(self, struct, max_events):
        del max_events
        value, ids, steps = _parts(struct)
        clash = sorted(set(steps) & set(RANKED_FIELDS))
        if clash:
            raise ValueError(
                f"TopK: a step named {clash[0]!r} clashes with TopK's output field of that "
                f"name ({', '.join(RANKED_FIELDS)}); rename the step."
            )
        id_dtype = np.dtype(np.int32) if ids is None else np.dtype(ids.dtype)

        def empty(leaf: jax.ShapeDtypeStruct) -> _Top:
            if jnp.issubdtype(leaf.dtype, jnp.complexfloating):
                raise TypeError(
                    f"TopK: complex values ({leaf.dtype}) have no order; log a real array, "
                    "such as `jnp.abs(x)`."
                )
            k = (self.k,)
            return _Top(
                value=jnp.full(k, _fill_value(leaf.dtype, self.largest), leaf.dtype),
                id=jnp.full(k, _missing(id_dtype), id_dtype),
                event=jnp.full(k, -1, jnp.int32),
                pos=jnp.full(k, -1, jnp.int32),
                steps={n: jnp.full(k, _missing(s.dtype), s.dtype) for n, s in steps.items()},
            )

        return {"top": jtu.tree_map(empty, value), "events": jnp.zeros((), jnp.int32)}

    def update(self, state, value, valid):
        new = TopK.update_many(self, state, [value])
        return select_valid(valid, new, state)

    def update_many(self, state, values):
        if not values:
            return state
        parts = [_parts(v) for v in values]
        first = jnp.asarray(state["events"], jnp.int32)

        def fold(top: _Top, *leaves: Any) -> _Top:
            candidates = [
                _candidates(top, leaf, ids, steps, first + j)
                for j, (leaf, (_, ids, steps)) in enumerate(zip(leaves, parts))
            ]
            return _select(_concat([top, *candidates]), self.k, self.largest)

        leaves = [p[0] for p in parts]
        top = jtu.tree_map(fold, state["top"], *leaves, is_leaf=_is_top)
        return {"top": top, "events": first + len(values)}

    def merge(self, a, b):
        offset = a["events"]

        def fold(x: _Top, y: _Top) -> _Top:
            later = jnp.where(y.event >= 0, y.event + offset, y.event)
            y = _Top(value=y.value, id=y.id, event=later, pos=y.pos, steps=y.steps)
            return _select(_concat([x, y]), self.k, self.largest)

        top = jtu.tree_map(fold, a["top"], b["top"], is_leaf=_is_top)
        return {"top": top, "events": a["events"] + b["events"]}

    def finalize(self, state):
        def out(top: _Top) -> dict[str, Array]:
            return {"value": top.value, "id": top.id, "event": top.event, **top.steps}

        return jtu.tree_map(out, state["top"], is_leaf=_is_top)
