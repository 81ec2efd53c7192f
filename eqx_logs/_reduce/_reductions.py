"""Reductions: how the events of one key become one output, on the accelerator.

The protocol is that of CLU metrics and optax accumulators: `init` makes a state (a pytree
of arrays that can live in a loop carry), `update` folds in one event (only where `valid`),
`merge` combines two states, `finalize` produces the output.
"""

import abc
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, PRNGKeyArray, PyTree

from .._checks import check_count, check_number


class AbstractReduction(eqx.Module):
    """Base class of reductions: how the events of one key become one output.

    Subclasses implement `init`, `update`, `merge` and `finalize`. States are pytrees of
    arrays, so they can live in loop carries; `update` must leave the state unchanged where
    `valid` is false (an event in an untaken branch). A reduction sees the events of one
    batch lane: under `spool(vmap(f))` spool vmaps it over the batch axes.

    !!! example

        ```python
        class Product(eqx_logs.AbstractReduction):
            def init(self, struct, max_events):
                return jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), struct)

            def update(self, state, value, valid):
                return jax.tree.map(
                    lambda s, v: jnp.where(valid, s * v, s), state, value
                )

            def merge(self, a, b):
                return jax.tree.map(jnp.multiply, a, b)

            def finalize(self, state):
                return state
        ```
    """

    #: How many leading axes of the output index events or windows (Stack: 1, Mean: 0).
    #: Under `spool(vmap(f))` the batch axes go right after them.
    event_axes: ClassVar[int] = 0

    @abc.abstractmethod
    def init(self, struct: PyTree[jax.ShapeDtypeStruct], max_events: int | None) -> PyTree[Array]:
        """The empty state, for events shaped like `struct`. `max_events` is the static upper
        bound on the number of events (None when unbounded, as in a `while_loop`)."""

    @abc.abstractmethod
    def update(
        self, state: PyTree[Array], value: PyTree[Array], valid: bool | Bool[Array, ""]
    ) -> PyTree[Array]:
        """Fold in one event. Where `valid` is false the state must be unchanged."""

    def init_many(
        self,
        struct: PyTree[jax.ShapeDtypeStruct],
        max_events: int | None,
        values: list[PyTree[Array]],
    ) -> PyTree[Array]:
        """`init` followed by `update_many`: the first events of straight-line code. Override
        it where that costs less than making the empty state first (Stack, filled at once)."""
        cls = type(self)
        return cls.update_many(self, cls.init(self, struct, max_events), values)

    def update_many(self, state: PyTree[Array], values: list[PyTree[Array]]) -> PyTree[Array]:
        """Fold in several events, all valid, in order. Spool folds the events of straight-line
        code in with one call, when it next needs the state: override this where a block of
        events costs fewer operations than one `update` each (Stack writes them at once)."""
        update = type(self).update  # not `self.update`: a Module per access (`_methods.py`)
        for value in values:
            state = update(self, state, value, True)
        return state

    @abc.abstractmethod
    def merge(self, a: PyTree[Array], b: PyTree[Array]) -> PyTree[Array]:
        """The state that has seen the events of `a`, then those of `b`."""

    @abc.abstractmethod
    def finalize(self, state: PyTree[Array]) -> PyTree[Array]:
        """The output for a state."""

    def rows(self, state: PyTree[Array]) -> Array | None:
        """For outputs with an event axis (`event_axes == 1`): how many leading rows of the
        output are real (the rest is padding). None for other reductions."""
        return None

    def step_reduction(self) -> "AbstractReduction":
        """How the step values recorded with the events (`log(..., step=i)`) are reduced so
        that they line up with the output: the last step, by default."""
        return Last()

    def place_batch_axes(self, output: PyTree[Array], nbatch: int) -> PyTree[Array]:
        """Move the `nbatch` leading batch axes of a vmapped `finalize` output to just after
        its `event_axes`: `spool(vmap(f))` with Stack gives `(T, B, ...)`."""
        if not self.event_axes or not nbatch:
            return output
        src, dst = list(range(nbatch)), list(range(self.event_axes, self.event_axes + nbatch))
        return jtu.tree_map(lambda x: jnp.moveaxis(x, src, dst), output)

    def with_key(self, key: PRNGKeyArray) -> "AbstractReduction":
        """This reduction with randomness from `key`, if it needs any."""
        del key
        return self


def select_valid(valid, new: PyTree, old: PyTree) -> PyTree:
    if valid is True:
        return new
    return jtu.tree_map(lambda n, o: jnp.where(valid, n, o), new, old)


def nan_or_zero(dtype) -> Any:
    """What fills a slot without an event: NaN for an inexact dtype, else 0."""
    return jnp.nan if jnp.issubdtype(dtype, jnp.inexact) else 0


# Output dtypes (each reduction's docstring states its own). Statistics never round to a
# narrower dtype than they were computed in: float16 and bfloat16 events are accumulated, and
# reported, in float32. Every dtype is fixed by `init`, so that straight-line code, loop
# carries and cond branches agree; values are cast explicitly (strict dtype promotion).


def _is_half(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize < 4


def _default(kind: str) -> np.dtype:
    """JAX's default dtype of a kind ("i", "u", "f"): 32 bits, or 64 under `jax_enable_x64`."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(f"{kind}8")))


def _sum_dtype(dtype) -> np.dtype:
    """Sum's dtype: `jnp.sum`'s for bool and integers (those narrower than JAX's default
    integer widen to it, unsigned ones to the default unsigned), float32 for float16 and
    bfloat16, other dtypes kept."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_ or jnp.issubdtype(dtype, jnp.integer):
        default = _default("u" if jnp.issubdtype(dtype, jnp.unsignedinteger) else "i")
        return default if dtype.itemsize < default.itemsize else dtype
    return np.dtype(np.float32) if _is_half(dtype) else dtype


def _float_dtype(dtype) -> np.dtype:
    """The dtype of a statistic (Mean, Var, Std, EMA): float32 and wider inexact dtypes kept,
    float32 for float16 and bfloat16, JAX's default float for bool and integers (as
    `jnp.mean`)."""
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.inexact):
        return _default("f")
    return np.dtype(np.float32) if _is_half(dtype) else dtype


def _as(x: Any, dtype: Any) -> Array:
    return jnp.asarray(x, dtype)


def _count(valid) -> Array:
    return jnp.asarray(valid, jnp.int32)


class Last(AbstractReduction):
    """The latest event (NaN, or 0 for integers, if none happened), in the events' dtype."""

    def init(self, struct, max_events):
        value = jtu.tree_map(lambda s: jnp.full(s.shape, nan_or_zero(s.dtype), s.dtype), struct)
        return {"value": value, "count": jnp.zeros((), jnp.int32)}

    def update(self, state, value, valid):
        value = jtu.tree_map(lambda v, s: jnp.asarray(v, s.dtype), value, state["value"])
        return {
            "value": select_valid(valid, value, state["value"]),
            "count": state["count"] + _count(valid),
        }

    def merge(self, a, b):
        return {
            "value": select_valid(b["count"] > 0, b["value"], a["value"]),
            "count": a["count"] + b["count"],
        }

    def finalize(self, state):
        return state["value"]


class First(AbstractReduction):
    """The first event (NaN, or 0 for integers, if none happened), in the events' dtype."""

    def init(self, struct, max_events):
        return Last().init(struct, max_events)

    def update(self, state, value, valid):
        return Last().update(state, value, jnp.logical_and(valid, state["count"] == 0)) | {
            "count": state["count"] + _count(valid)
        }

    def merge(self, a, b):
        return Last().merge(b, a)  # a's first event, if it had one

    def finalize(self, state):
        return state["value"]


class Sum(AbstractReduction):
    """The sum of the events.

    The output dtype is `jnp.sum`'s for booleans and integers: those narrower than JAX's
    default integer widen to it (int8, int16 and bool give int32, uint8 and uint16 give
    uint32; int64 and uint64 under `jax_enable_x64`), wider ones are kept (and wrap on
    overflow, as in `jnp.sum`). float16 and bfloat16 events are summed, and reported, in
    float32; other dtypes are kept.
    """

    def init(self, struct, max_events):
        return jtu.tree_map(lambda s: jnp.zeros(s.shape, _sum_dtype(s.dtype)), struct)

    def update(self, state, value, valid):
        return jtu.tree_map(lambda s, v: jnp.where(valid, s + _as(v, s.dtype), s), state, value)

    def update_many(self, state, values):
        def add(s, *vs):
            block = jnp.stack([_as(v, s.dtype) for v in vs])
            return s + jnp.sum(block, axis=0, dtype=s.dtype)

        return jtu.tree_map(add, state, *values)

    def merge(self, a, b):
        return jtu.tree_map(jnp.add, a, b)

    def finalize(self, state):
        return state


class Count(AbstractReduction):
    """The number of events, as an int32 scalar."""

    def init(self, struct, max_events):
        return jnp.zeros((), jnp.int32)

    def update(self, state, value, valid):
        return state + _count(valid)

    def merge(self, a, b):
        return a + b

    def finalize(self, state):
        return state


class Mean(AbstractReduction):
    """The mean of the events, as a numerically stable running mean (NaN if none).

    The output dtype is `jnp.mean`'s, but never narrower than float32: float32 and float64
    events keep their dtype, float16 and bfloat16 ones are averaged, and reported, in float32,
    booleans and integers give JAX's default float (float32; float64 under `jax_enable_x64`).
    """

    def init(self, struct, max_events):
        mean = jtu.tree_map(lambda s: jnp.zeros(s.shape, _float_dtype(s.dtype)), struct)
        return {"mean": mean, "count": jnp.zeros((), jnp.int32)}

    def update(self, state, value, valid):
        count = state["count"] + _count(valid)
        safe = jnp.maximum(count, 1)

        def step(m, v):
            return m + (_as(v, m.dtype) - m) / safe.astype(m.dtype)

        mean = select_valid(valid, jtu.tree_map(step, state["mean"], value), state["mean"])
        return {"mean": mean, "count": count}

    def update_many(self, state, values):
        def mean(m, *vs):
            return jnp.mean(jnp.stack([_as(v, m.dtype) for v in vs]), axis=0, dtype=m.dtype)

        count = jnp.asarray(len(values), jnp.int32)
        block = {"mean": jtu.tree_map(mean, state["mean"], *values), "count": count}
        return Mean.merge(self, state, block)  # `self.merge`: a Module per access

    def merge(self, a, b):
        count = a["count"] + b["count"]
        safe = jnp.maximum(count, 1)

        def mean(x, y):  # b's weight; 0 where neither has events
            return x + (y - x) * (b["count"].astype(x.dtype) / safe.astype(x.dtype))

        return {"mean": jtu.tree_map(mean, a["mean"], b["mean"]), "count": count}

    def finalize(self, state):
        return jtu.tree_map(lambda m: jnp.where(state["count"] > 0, m, jnp.nan), state["mean"])


class _Extremum(AbstractReduction):
    def _better(self, x, y):
        raise NotImplementedError

    def _identity(self, dtype):
        raise NotImplementedError

    def init(self, struct, max_events):
        value = jtu.tree_map(lambda s: jnp.full(s.shape, self._identity(s.dtype), s.dtype), struct)
        return {"value": value, "count": jnp.zeros((), jnp.int32)}

    def update(self, state, value, valid):
        def step(s, v):
            return jnp.where(valid, self._better(s, jnp.asarray(v, s.dtype)), s)

        return {
            "value": jtu.tree_map(step, state["value"], value),
            "count": state["count"] + _count(valid),
        }

    def merge(self, a, b):
        value = jtu.tree_map(self._better, a["value"], b["value"])
        return {"value": value, "count": a["count"] + b["count"]}

    def finalize(self, state):
        def out(v):
            return jnp.where(state["count"] > 0, v, jnp.asarray(nan_or_zero(v.dtype), v.dtype))

        return jtu.tree_map(out, state["value"])


class Min(_Extremum):
    """The elementwise minimum over events (NaN, or 0 for integers, if none), in the events'
    dtype (booleans: a logical and)."""

    def _better(self, x, y):
        return jnp.minimum(x, y)

    def _identity(self, dtype):
        if jnp.issubdtype(dtype, jnp.inexact):
            return jnp.inf
        return True if dtype == jnp.bool_ else jnp.iinfo(dtype).max


class Max(_Extremum):
    """The elementwise maximum over events (NaN, or 0 for integers, if none), in the events'
    dtype (booleans: a logical or)."""

    def _better(self, x, y):
        return jnp.maximum(x, y)

    def _identity(self, dtype):
        if jnp.issubdtype(dtype, jnp.inexact):
            return -jnp.inf
        return False if dtype == jnp.bool_ else jnp.iinfo(dtype).min


class Var(AbstractReduction):
    """The (population, ddof=0) variance over events: Welford updates, Chan's merge. The
    output dtype is Mean's (never narrower than float32)."""

    def init(self, struct, max_events):
        zeros = jtu.tree_map(lambda s: jnp.zeros(s.shape, _float_dtype(s.dtype)), struct)
        return {"mean": zeros, "m2": zeros, "count": jnp.zeros((), jnp.int32)}

    def update(self, state, value, valid):
        count = state["count"] + _count(valid)
        safe = jnp.maximum(count, 1)
        value = jtu.tree_map(lambda m, v: _as(v, m.dtype), state["mean"], value)
        delta = jtu.tree_map(lambda m, v: v - m, state["mean"], value)
        mean = jtu.tree_map(lambda m, d: m + d / safe.astype(m.dtype), state["mean"], delta)

        def m2(m2, d, v, m):
            return m2 + d * (v - m)

        new = {"mean": mean, "m2": jtu.tree_map(m2, state["m2"], delta, value, mean)}
        old = {"mean": state["mean"], "m2": state["m2"]}
        return {**select_valid(valid, new, old), "count": count}

    def merge(self, a, b):
        na, nb = a["count"], b["count"]
        n = na + nb
        safe = jnp.maximum(n, 1)

        def mean(ma, mb):
            return ma + (mb - ma) * (nb.astype(ma.dtype) / safe.astype(ma.dtype))

        def m2(ma, mb, m2a, m2b):  # in floats: na * nb may exceed int32
            delta = mb - ma
            fa, fb, fn = (x.astype(ma.dtype) for x in (na, nb, safe))
            return m2a + m2b + delta**2 * (fa * fb / fn)

        return {
            "mean": jtu.tree_map(mean, a["mean"], b["mean"]),
            "m2": jtu.tree_map(m2, a["mean"], b["mean"], a["m2"], b["m2"]),
            "count": n,
        }

    def finalize(self, state):
        n = state["count"]
        safe = jnp.maximum(n, 1)
        return jtu.tree_map(
            lambda m2: jnp.where(n > 0, m2 / safe.astype(m2.dtype), jnp.nan), state["m2"]
        )


class Std(Var):
    """The (population, ddof=0) standard deviation over events, in Mean's dtype."""

    def finalize(self, state):
        return jtu.tree_map(jnp.sqrt, super().finalize(state))


class EMA(AbstractReduction):
    """The bias-corrected exponential moving average of the events:
    `sum_i (1 - decay) decay^(n-1-i) x_i / (1 - decay^n)` (the first event is returned as is),
    in Mean's dtype (never narrower than float32); NaN if none.

    **Arguments:**

    - `decay`: in [0, 1); may be an array (changing it does not recompile).
    """

    decay: float | Array

    def __check_init__(self):
        if not isinstance(self.decay, jax.Array | np.ndarray | np.generic):
            check_number("EMA", "decay", self.decay)
        if isinstance(self.decay, int | float) and not 0 <= self.decay < 1:
            raise ValueError(f"EMA(decay={self.decay!r}): decay must be in [0, 1).")

    def init(self, struct, max_events):
        total = jtu.tree_map(lambda s: jnp.zeros(s.shape, _float_dtype(s.dtype)), struct)
        # the weight in the widest of the totals' (real) dtypes
        wide = any(jnp.finfo(t.dtype).bits > 32 for t in jtu.tree_leaves(total))
        return {"total": total, "weight": jnp.zeros((), jnp.float64 if wide else jnp.float32)}

    def update(self, state, value, valid):
        def step(t, v):
            d = _as(self.decay, t.dtype)
            return d * t + (1 - d) * _as(v, t.dtype)

        total = jtu.tree_map(step, state["total"], value)
        new = {"total": total, "weight": step(state["weight"], 1)}
        return select_valid(valid, new, state)

    def merge(self, a, b):
        carry = 1 - b["weight"]  # decay ** (number of events in b)

        def total(x, y):
            return carry.astype(x.dtype) * x + y

        total = jtu.tree_map(total, a["total"], b["total"])
        return {"total": total, "weight": carry * a["weight"] + b["weight"]}

    def finalize(self, state):
        w = state["weight"]
        safe = jnp.where(w > 0, w, 1)
        return jtu.tree_map(
            lambda t: jnp.where(w > 0, t / safe.astype(t.dtype), jnp.nan), state["total"]
        )


class Histogram(AbstractReduction):
    """Counts of all elements of all events in `bins` equal bins over `range` (as
    `numpy.histogram`: the last bin includes its right edge, values outside are ignored).
    The bin edges are `jnp.linspace(*range, bins + 1)`; events are compared in float32 and
    counted in int32."""

    bins: int = eqx.field(static=True)
    range: tuple[float, float] = eqx.field(static=True)

    def __check_init__(self):
        check_count("Histogram", "bins", self.bins)
        if not isinstance(self.range, tuple | list) or len(self.range) != 2:
            raise TypeError(
                f"Histogram(range={self.range!r:.60}): range must be a pair (low, high)."
            )
        for bound in self.range:
            check_number("Histogram", "range", bound)
        lo, hi = self.range
        if not lo < hi:
            raise ValueError(f"Histogram(range={self.range!r}): needs low < high.")

    def init(self, struct, max_events):
        return jtu.tree_map(lambda s: jnp.zeros((self.bins,), jnp.int32), struct)

    def update(self, state, value, valid):
        lo, hi = self.range

        edges = jnp.linspace(lo, hi, self.bins + 1, dtype=jnp.float32)

        def add(counts, v):
            v = jnp.ravel(v).astype(jnp.float32)
            inside = jnp.logical_and(v >= lo, v <= hi)
            guess = jnp.floor((jnp.where(inside, v, lo) - lo) / (hi - lo) * self.bins)
            index = jnp.clip(guess.astype(jnp.int32), 0, self.bins - 1)
            # As numpy: correct the guess against the edges themselves.
            index = index - (v < edges[index]).astype(jnp.int32)
            upper = jnp.logical_and(v >= edges[index + 1], index != self.bins - 1)
            index = jnp.clip(index + upper.astype(jnp.int32), 0, self.bins - 1)
            weight = jnp.logical_and(inside, valid).astype(jnp.int32)
            return counts.at[index].add(weight)

        return jtu.tree_map(add, state, value)

    def merge(self, a, b):
        return jtu.tree_map(jnp.add, a, b)

    def finalize(self, state):
        return state
