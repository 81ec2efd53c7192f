"""Reductions that keep events: Stack, Collect, Sample (and `cast_event`, an event as its key's
dtype)."""

import math
from typing import Any, ClassVar, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PRNGKeyArray

from .._checks import check_count
from ._reductions import (
    AbstractReduction,
    nan_or_zero,
)


class NeedsBound(Exception):
    """Raised by `init` when a reduction needs a static bound on the number of events and
    none is known (a log inside a while loop); spool turns it into an error naming the key."""


def check_capacity(name: str, capacity: Any) -> None:
    check_count(name, "capacity", capacity, optional=True)


def _cast(x: Any, dtype: Any) -> Array:
    """`x` as an array of `dtype`, with no operation where it is one already."""
    return x if getattr(x, "dtype", None) == dtype else jnp.asarray(x, dtype)


def cast_event(x: Any, dtype: Any, key: str, site: str | None = None) -> Array:
    """`_cast` of a leaf of an event of `key` to the key's dtype; where it is a Python
    number (weakly typed: it takes the key's dtype) that does not fit, an error naming the
    key and, if given, where it was logged."""
    try:
        return _cast(x, dtype)
    except OverflowError as e:
        raise OverflowError(
            f"eqx_logs: key {key!r} holds {np.dtype(dtype)} (the dtype of its other events), "
            f"and a Python number logged under it{f' at {site}' if site else ''} does not fit "
            f"that dtype ({e}). Log an array of a dtype that holds every event, at every site "
            "of the key."
        ) from None


def _write(buf: Array, rows: Array, start: Any) -> Array:
    """`rows` written into `buf` from row `start` (never negative: no wrap-around to
    compute)."""
    zero = np.zeros((), jnp.result_type(start))  # one index dtype (int64 0s under x64)
    starts = (start, *(zero,) * (buf.ndim - 1))
    return jax.lax.dynamic_update_slice(buf, rows, starts, allow_negative_indices=False)


def _empty(leaf: jax.ShapeDtypeStruct, n: int) -> Array:
    return jnp.full((n, *leaf.shape), nan_or_zero(leaf.dtype), leaf.dtype)


class Stack(AbstractReduction):
    """Every event, stacked along a new leading axis in execution order.

    **Arguments:**

    - `capacity`: the number of slots. By default, the static upper bound on the number of
        events, which spool computes; required for logs inside `lax.while_loop`.
    - `keep`: with a capacity smaller than the number of events, `"first"` keeps the first
        `capacity` events, `"last"` the latest ones (a ring buffer), oldest first.

    Real events come first; unused slots hold NaN (inexact dtypes) or 0. The buffer is
    allocated once and written in place inside loops.
    """

    capacity: int | None = eqx.field(default=None, static=True)
    keep: Literal["first", "last"] = eqx.field(default="first", static=True)
    event_axes: ClassVar[int] = 1

    def __check_init__(self):
        check_capacity("Stack", self.capacity)
        if self.keep not in ("first", "last"):
            raise ValueError(f"Stack(keep={self.keep!r}): keep must be 'first' or 'last'.")

    def init(self, struct, max_events):
        size = self.capacity if self.capacity is not None else max_events
        if size is None:
            raise NeedsBound()
        buffers = jtu.tree_map(lambda s: _empty(s, size), struct)
        # index: the number of events received; a numpy value while known at trace time, so
        # that straight-line events are written at static offsets (`update_many`)
        return {"buffer": buffers, "index": np.zeros((), np.int32)}

    def update(self, state, value, valid):
        index = state["index"]
        size = jtu.tree_leaves(state["buffer"])[0].shape[0]
        if size == 0:
            return state
        if self.keep == "last":
            position = index % size
        else:
            position = index
            # The static bound can only be exceeded where events are conditional (`interval`
            # by step value, when steps repeat); those write under a mask anyway.
            if self.capacity is not None or valid is not True:
                valid = jnp.logical_and(valid, index < size)

        def write(buf: Array, v: Any) -> Array:
            v = jnp.asarray(v, buf.dtype)
            if valid is not True:
                v = jnp.where(valid, v, buf[jnp.minimum(position, size - 1)])
            return _write(buf, v[None], position)

        buffers = jtu.tree_map(write, state["buffer"], value)
        return {"buffer": buffers, "index": index + jnp.asarray(valid, jnp.int32)}

    def init_many(self, struct, max_events, values):
        size = self.capacity if self.capacity is not None else max_events
        if len(values) != size:
            return super().init_many(struct, max_events, values)
        # exactly filled: the buffer is the events (cast to the recorded dtypes)
        block = jtu.tree_map(
            lambda s, *vs: jnp.stack([_cast(v, s.dtype) for v in vs]), struct, *values
        )
        return {"buffer": block, "index": np.asarray(size, np.int32)}

    def update_many(self, state, values):
        index = state["index"]
        size = jtu.tree_leaves(state["buffer"])[0].shape[0]
        known = isinstance(index, np.ndarray | np.generic)
        # With a static bound (no capacity) these events, all valid, fit where they can run (a
        # scan of length 0 still traces its body); with a capacity, where the offset is known.
        if self.capacity is None:
            fits = len(values) <= size
        else:
            fits = known and int(index) + len(values) <= size
        if self.keep == "last" or size == 0 or not fits:
            return super().update_many(state, values)

        def write(buf: Array, *vs: Any) -> Array:
            block = jnp.stack([jnp.asarray(v, buf.dtype) for v in vs])
            if known and int(index) == 0 and len(vs) == size:
                return block
            return _write(buf, block, index)

        buffers = jtu.tree_map(write, state["buffer"], *values)
        return {"buffer": buffers, "index": index + len(values)}

    def extend(self, state, block):
        """`update_many` with the events stacked along a leading axis, all of them kept."""
        index = state["index"]
        n = jtu.tree_leaves(block)[0].shape[0]

        def write(buf, rows):
            # more rows than the buffer has only where they can never be written (a scan of
            # length 0 still traces its body)
            return _write(buf, rows[: buf.shape[0]].astype(buf.dtype), index)

        buffers = jtu.tree_map(write, state["buffer"], block)
        return {"buffer": buffers, "index": index + n}

    def merge(self, a, b):
        # Replay b's stored events, oldest first, into a.
        stored = self.finalize(b)
        size = jtu.tree_leaves(stored)[0].shape[0]
        if size == 0:  # a key without events (a loop of no trips): nothing to replay
            return a
        num = jnp.minimum(b["index"], size)

        def body(i, state):
            event = jtu.tree_map(lambda x: x[i], stored)
            return self.update(state, event, jnp.asarray(i, num.dtype) < num)

        return jax.lax.fori_loop(0, size, body, a)

    def step_reduction(self):
        return self  # the same slots, so steps line up with values

    def rows(self, state):
        size = jtu.tree_leaves(state["buffer"])[0].shape[0]
        index = state["index"]
        known = isinstance(index, np.ndarray | np.generic)
        return np.minimum(index, size) if known else jnp.minimum(index, size)

    def finalize(self, state):
        if self.keep == "first":
            return state["buffer"]
        index = state["index"]
        size = jtu.tree_leaves(state["buffer"])[0].shape[0]
        shift = jnp.where(index > size, index % size, 0) if size else 0
        return jtu.tree_map(lambda b: jnp.roll(b, -shift, axis=0), state["buffer"])


class Collect(AbstractReduction):
    """Every element of every event, ravelled and concatenated (per leaf), in execution
    order; unused slots at the end hold NaN or 0 (learned_optimization's "collect").

    **Arguments:**

    - `capacity`: the number of events kept (required inside while loops).
    """

    capacity: int | None = eqx.field(default=None, static=True)
    event_axes: ClassVar[int] = 1

    def __check_init__(self):
        check_capacity("Collect", self.capacity)

    def _stack(self) -> Stack:
        return Stack(capacity=self.capacity)

    def init(self, struct, max_events):
        return self._stack().init(struct, max_events)

    def update(self, state, value, valid):
        return self._stack().update(state, value, valid)

    def merge(self, a, b):
        return self._stack().merge(a, b)

    def rows(self, state):  # elements of the first leaf that are real
        buffer = jtu.tree_leaves(state["buffer"])[0]
        return self._stack().rows(state) * math.prod(buffer.shape[1:])

    def finalize(self, state):
        return jtu.tree_map(jnp.ravel, self._stack().finalize(state))


class Sample(AbstractReduction):
    """A uniform random sample of `k` events without replacement (reservoir sampling,
    algorithm R), in reservoir order; unused slots hold NaN or 0.

    **Arguments:**

    - `k`: the sample size.
    - `key`: a `jax.random.key`; by default the key given to spool (`spool(..., key=...)` or
        `Policy(key=...)`), folded with the log key so that keys are sampled independently.
        The same key gives the same sample.
    """

    k: int = eqx.field(static=True)
    key: PRNGKeyArray | None = None
    event_axes: ClassVar[int] = 1

    def __check_init__(self):
        check_count("Sample", "k", self.k)

    def with_key(self, key):
        return self if self.key is not None else Sample(self.k, key)

    def step_reduction(self):
        return self  # same key, same decisions: steps line up with values

    def init(self, struct, max_events):
        if self.key is None:
            raise ValueError(
                "Sample needs randomness: pass `key=jax.random.key(0)` to spool (or to Policy), "
                "or `Sample(k, key=...)`."
            )
        return {
            "stack": Stack(capacity=self.k).init(struct, self.k),
            "seen": jnp.zeros((), jnp.int32),
        }

    def update(self, state, value, valid):
        seen = state["seen"]
        key = jax.random.fold_in(self.key, seen)
        replace = jax.random.randint(key, (), 0, seen + 1, dtype=jnp.int32)
        slot = jnp.where(seen < self.k, seen, replace)
        write = jnp.logical_and(valid, slot < self.k)
        stack = state["stack"]

        def put(buf, v):
            v = jnp.asarray(v, buf.dtype)
            i = jnp.minimum(slot, self.k - 1)
            new = jnp.where(write, v, buf[i])
            return _write(buf, new[None], i)

        buffer = jtu.tree_map(put, stack["buffer"], value)
        filled = jnp.minimum(seen + jnp.asarray(valid, jnp.int32), self.k)
        return {
            "stack": {"buffer": buffer, "index": filled},
            "seen": seen + jnp.asarray(valid, jnp.int32),
        }

    def merge(self, a, b):
        # A uniform k-sample of the union: how many come from a is hypergeometric; those are
        # a uniformly random subset of a's reservoir (itself uniform over a's events), and
        # likewise for b.
        na, nb = a["seen"], b["seen"]
        key = jax.random.fold_in(jax.random.fold_in(self.key, na), nb + 2**30)
        k_count, k_a, k_b = jax.random.split(key, 3)
        draws = jnp.minimum(na + nb, self.k)
        uniforms = jax.random.uniform(k_count, (self.k,))

        def draw(i, taken):
            i = jnp.asarray(i, jnp.int32)  # int64 under x64, as the counts are not
            f = uniforms.dtype
            p = (na - taken).astype(f) / jnp.maximum(na + nb - i, 1).astype(f)
            return taken + jnp.logical_and(i < draws, uniforms[i] < p).astype(jnp.int32)

        from_a = jax.lax.fori_loop(0, self.k, draw, jnp.zeros((), jnp.int32))

        def shuffled(key, filled):  # a random order of the filled slots, filled slots first
            noise = jax.random.uniform(key, (self.k,))
            filled_slots = jnp.arange(self.k, dtype=jnp.int32) < filled
            return jnp.argsort(jnp.where(filled_slots, noise, 2.0))

        order_a = shuffled(k_a, a["stack"]["index"])
        order_b = shuffled(k_b, b["stack"]["index"])
        slots = jnp.arange(self.k, dtype=jnp.int32)
        take_a = slots < from_a
        index_b = order_b[jnp.clip(slots - from_a, 0, self.k - 1)]

        def combine(buf_a, buf_b):
            shape = (self.k,) + (1,) * (buf_a.ndim - 1)
            picked = jnp.where(take_a.reshape(shape), buf_a[order_a], buf_b[index_b])
            fill = jnp.full_like(buf_a, nan_or_zero(buf_a.dtype))
            return jnp.where((slots < draws).reshape(shape), picked, fill)

        buffer = jtu.tree_map(combine, a["stack"]["buffer"], b["stack"]["buffer"])
        return {"stack": {"buffer": buffer, "index": draws}, "seen": na + nb}

    def rows(self, state):
        return state["stack"]["index"]

    def finalize(self, state):
        return state["stack"]["buffer"]
