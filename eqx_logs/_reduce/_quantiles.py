"""Quantiles: a mergeable sketch of all elements of all events, with a relative-error bound.

The sketch is DDSketch's (Masson, Rim and Lee, VLDB 2019) with its cubically interpolated
mapping: a magnitude `|x| = 2**e * (1 + m)` (`m` in [0, 1), read from the float's bits) falls
in bucket `e * k + floor(k * P(m))` of its sign, where `P(m) = (6/35) m**3 - (3/5) m**2 +
(10/7) m` is a monotone cubic with `P(0) = 0` and `P(1) = 1` that stands in for `log2(1 + m)`
(a logarithm costs twice the cubic on the CPU). `k` buckets per power of two are chosen so
that no bucket is wider than `(1 + a) / (1 - a)` (a = `relative_error`, less a margin for the
rounding of float32), and a bucket is read out as the harmonic mean of its bounds, within `a`
of every value in it. Counts of all buckets, of zeros, of the infinities and of NaNs are one
flat int32 array in sorted order, so that an event is one scatter-add and a merge one sum.
"""

import functools
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Float, Int

from ._reductions import AbstractReduction

# The cubic standing in for log2(1 + m) on [0, 1], and the least of (1 + m) P'(m) there
# (at m = 0): a bucket of width 1/k in P spans at most 1 / (k * 10/7) in log(x).
_A, _B, _C = 6 / 35, -3 / 5, 10 / 7
# What the float32 index and read-out may add to the error of a value: P's rounding (a few
# float32 ulps of 1, at most 0.7 of it in log(x)), the table's and an integer's conversion.
_MARGIN = 1e-6
# At most this many counts per leaf (64 MiB of int32).
_MAX_BUCKETS = 2**24
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _p(m: np.ndarray) -> np.ndarray:
    return ((_A * m + _B) * m + _C) * m


def _p_inverse(y: np.ndarray) -> np.ndarray:
    """The m in [0, 1] with P(m) = y, by bisection (P is increasing), in float64."""
    lo, hi = np.zeros_like(y), np.ones_like(y)
    for _ in range(60):
        mid = (lo + hi) / 2
        below = _p(mid) < y
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return (lo + hi) / 2


class _Layout:
    """Where each magnitude goes, for one (relative_error, min_magnitude, max_magnitude).

    Flat positions, in sorted order: 0 is -inf; 1 .. nb the negative buckets, largest
    magnitude first; nb + 1 zero (|x| < min_magnitude); nb + 2 .. 2 nb + 1 the positive
    buckets; 2 nb + 2 +inf; 2 nb + 3 NaN. Bucket j (of either sign) holds the magnitudes
    whose index `(e - e_min) * k + floor(k * P(m)) - r_min` is j, clipped to [0, nb - 1]."""

    def __init__(self, relative_error: float, min_magnitude: float, max_magnitude: float):
        a = relative_error - _MARGIN
        self.e_min = math.floor(math.log2(min_magnitude))
        self.e_max = math.floor(math.log2(max_magnitude))
        # k from the bound, then up until the widest bucket (measured) is within a
        k = max(1, math.ceil(1 / (_C * math.log((1 + a) / (1 - a)))) - 1)
        while True:
            edges = _p_inverse(np.arange(k + 1, dtype=np.float64) / k)
            ratio = (1 + edges[1:]) / (1 + edges[:-1])
            if np.max((ratio - 1) / (ratio + 1)) <= a:
                break
            k += 1
        self.k = k
        self.r_min = self._sub(min_magnitude)
        top = (self.e_max - self.e_min) * k + self._sub(max_magnitude) - self.r_min
        self.nb = top + 1
        self.size = 2 * self.nb + 4
        self.achieved = float(np.max((ratio - 1) / (ratio + 1)))
        self.edges = edges  # lower bounds of the sub-buckets of a binade, as m
        self.min_magnitude, self.max_magnitude = min_magnitude, max_magnitude

    def _sub(self, x: float) -> int:
        _, e = math.frexp(x)  # x = f * 2**e, f in [0.5, 1)
        m = x / 2.0 ** (e - 1) - 1
        return min(int(math.floor(_p(np.float64(m)) * self.k)), self.k - 1)

    @functools.cached_property
    def _table64(self) -> np.ndarray:
        """The value each flat position reads out as, in float64."""
        j = np.arange(self.nb) + self.r_min
        e, r = self.e_min + j // self.k, j % self.k
        lo = np.ldexp(1 + self.edges[r], e)
        hi = np.ldexp(1 + self.edges[r + 1], e)
        lo = np.maximum(lo, self.min_magnitude)
        hi = np.minimum(hi, self.max_magnitude)
        hi = np.maximum(hi, lo)
        rep = 2 * lo / (1 + lo / hi)  # their harmonic mean (lo * hi may overflow)
        return np.concatenate([[-np.inf], -rep[::-1], [0.0], rep, [np.inf, np.nan]])

    def table(self, dtype) -> np.ndarray:
        with np.errstate(over="ignore"):
            return self._table64.astype(dtype)

    def positions(self, x: Array) -> Array:
        """The flat position of each element of `x` (float32 or float64), as int32."""
        wide = x.dtype == jnp.float64
        ints, mbits, bias = (jnp.int64, 52, 1023) if wide else (jnp.int32, 23, 127)
        one = 0x3FF0000000000000 if wide else 0x3F800000
        bits = jax.lax.bitcast_convert_type(jnp.abs(x), ints)
        e = bits >> mbits  # biased; all ones for inf and NaN
        mantissa = jax.lax.bitcast_convert_type((bits & ((1 << mbits) - 1)) | one, x.dtype)
        m = mantissa - 1
        sub = (((_A * m + _B) * m + _C) * m * self.k).astype(jnp.int32)
        sub = jnp.minimum(sub, self.k - 1)
        offset = (bias + self.e_min) * self.k + self.r_min
        j = (e.astype(jnp.int32) * self.k + sub) - offset
        j = jnp.clip(j, 0, self.nb - 1)
        j = jnp.where(e == (2 * bias + 1), self.nb, j)  # the infinities: the ends
        threshold = max(self.min_magnitude, float(jnp.finfo(x.dtype).tiny))
        sign = (x >= threshold).astype(jnp.int32) - (x <= -threshold).astype(jnp.int32)
        position = (self.nb + 1) + sign * (j + 1)
        return jnp.where(jnp.isnan(x), self.size - 1, position)


@functools.lru_cache(maxsize=64)
def _layout(relative_error: float, min_magnitude: float, max_magnitude: float) -> _Layout:
    return _Layout(relative_error, min_magnitude, max_magnitude)


def _lower_rank(q: float, m: Array) -> Array:
    """floor(q * m) for uint32 `m`, exactly, with `q` read as the decimal it is written as
    (0.9 * 10 is 9, as numpy's float64 product rounds it): the product is worked out in 16-bit
    limbs of q * 2**64 plus 2**-22."""
    if q >= 1:
        return m
    big = math.floor(Fraction(q) * 2**64)
    a = [(big >> (16 * i)) & 0xFFFF for i in range(4)]
    limbs = [m & jnp.uint32(0xFFFF), m >> jnp.uint32(16)]
    cols = [jnp.zeros_like(m) for _ in range(7)]
    for i, ai in enumerate(a):
        for j, mj in enumerate(limbs):
            p = jnp.uint32(ai) * mj
            cols[i + j] = cols[i + j] + (p & jnp.uint32(0xFFFF))
            cols[i + j + 1] = cols[i + j + 1] + (p >> jnp.uint32(16))
    cols[2] = cols[2] + jnp.uint32(2**10)  # 2**-22 = 2**10 * 2**32 / 2**64
    carry = jnp.zeros_like(m)
    for c in range(7):
        total = cols[c] + carry
        cols[c], carry = total & jnp.uint32(0xFFFF), total >> jnp.uint32(16)
    return cols[4] | (cols[5] << jnp.uint32(16))


def quantile_name(q: float) -> str:
    """A quantile's key in `Quantiles`' output: `"p" + f"{100 * q:g}"` (p50, p99.9)."""
    return "p" + f"{100 * q:g}"


class QuantileSketch(eqx.Module):
    """The sketch `Quantiles(sketch=True)` outputs (under `"sketch"`): every element seen, in
    fixed buckets, so that sketches of different runs, processes or parts of a run can be
    merged after the run (`a + b`, or `QuantileSketch.merge(a, b)`) and any quantile read.

    `counts` is one flat int32 array in sorted order (its last axis; leading axes are batch
    axes, as under `vmap`): -inf, the negative buckets, zero, the positive buckets, +inf, NaN.
    Sketches merge only with sketches of the same `relative_error` and magnitudes; see
    `Quantiles`' second example.
    """

    counts: Int[Array, "*batch buckets"]
    relative_error: float = eqx.field(static=True)
    min_magnitude: float = eqx.field(static=True)
    max_magnitude: float = eqx.field(static=True)
    dtype: str = eqx.field(static=True)  # what it reads out in: "float32" or "float64"

    @property
    def _layout(self) -> _Layout:
        return _layout(self.relative_error, self.min_magnitude, self.max_magnitude)

    @property
    def count(self) -> Int[Array, "*batch"]:
        """How many elements (NaN aside) were seen, as uint32."""
        return jnp.sum(self.counts[..., :-1].astype(jnp.uint32), axis=-1, dtype=jnp.uint32)

    @property
    def nan(self) -> Int[Array, "*batch"]:
        """How many NaN elements were seen (counted aside, in no quantile)."""
        return self.counts[..., -1]

    def quantile(self, q: float | Sequence[float]) -> Float[Array, "*batch"]:
        """The `q`-quantile of the elements seen (NaN aside), as `Quantiles` defines it: the
        value of rank `floor(q * (n - 1))` in sorted order (`numpy.quantile(..., method=
        "lower")`), within the relative error; NaN where no element was seen.

        **Arguments:**

        - `q`: in [0, 1], or a sequence of them (the output then has a last axis, one
          entry each).

        **Returns:** an array of the sketch's batch shape (with a last axis for several `q`),
        in float32 (float64 for float64 events).
        """
        if isinstance(q, Sequence):
            qs = tuple(_check_q("QuantileSketch.quantile", q))
            return jnp.stack([self._one(v) for v in qs], axis=-1)
        return self._one(_check_q("QuantileSketch.quantile", (q,))[0])

    def _one(self, q: float) -> Array:
        counts = self.counts[..., :-1].astype(jnp.uint32)  # NaN aside
        cum = jnp.cumsum(counts, axis=-1, dtype=jnp.uint32)
        n = cum[..., -1]
        rank = _lower_rank(q, jnp.maximum(n, jnp.uint32(1)) - jnp.uint32(1))
        position = jnp.argmax(cum > rank[..., None], axis=-1).astype(jnp.int32)
        table = jnp.asarray(self._layout.table(np.dtype(self.dtype))[:-1])
        # the table's entry at `position`, as a sum with one term: a gather of a replicated
        # table by indices sharded over Explicit mesh axes has no output sharding to pick
        hit = jnp.arange(table.shape[0], dtype=jnp.int32) == position[..., None]
        value = jnp.sum(jnp.where(hit, table, jnp.zeros((), table.dtype)), axis=-1)
        return jnp.where(n > 0, value, jnp.asarray(jnp.nan, value.dtype))

    def merge(self, other: "QuantileSketch") -> "QuantileSketch":
        """The sketch of the elements of both (`self + other`)."""
        if not isinstance(other, QuantileSketch):
            raise TypeError(
                f"QuantileSketch.merge: got {type(other).__name__}, not a QuantileSketch."
            )
        mine = (self.relative_error, self.min_magnitude, self.max_magnitude, self.dtype)
        theirs = (other.relative_error, other.min_magnitude, other.max_magnitude, other.dtype)
        if mine != theirs:
            raise ValueError(
                "QuantileSketch.merge: the sketches have different (relative_error, "
                f"min_magnitude, max_magnitude, dtype): {mine} and {theirs}; only sketches "
                "made by the same Quantiles options on events of the same dtype merge."
            )
        return eqx.tree_at(lambda s: s.counts, self, self.counts + other.counts)

    def __add__(self, other: "QuantileSketch") -> "QuantileSketch":
        return self.merge(other)


def _check_q(where: str, q: Any) -> tuple[float, ...]:
    if isinstance(q, int | float) and not isinstance(q, bool):
        q = (q,)
    if not isinstance(q, Sequence) or isinstance(q, str):
        raise TypeError(
            f"{where}(q={q!r:.60}): q must be a tuple of numbers in [0, 1], such as "
            "(0.5, 0.9, 0.99)."
        )
    if not q:
        raise ValueError(
            f"{where}(q={q!r}): q is empty; give at least one quantile, such as q=(0.5,)."
        )
    for v in q:
        if isinstance(v, bool) or not isinstance(v, int | float | np.floating | np.integer):
            raise TypeError(f"{where}(q={q!r:.60}): {v!r:.30} is not a number in [0, 1].")
        if not 0 <= v <= 1:
            raise ValueError(
                f"{where}(q={q!r:.60}): {v!r} is outside [0, 1]; quantiles are fractions "
                "(the median is 0.5, the 99th percentile 0.99)."
            )
    return tuple(float(v) for v in q)


def _as_q(q: Any) -> Any:
    if isinstance(q, list):
        return tuple(q)
    if isinstance(q, int | float) and not isinstance(q, bool):
        return (q,)
    return q


def _compute_dtype(dtype) -> Any:
    return jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32


class Quantiles(AbstractReduction):
    """Quantiles of all elements of all events, from a fixed-size sketch with a
    relative-error bound (DDSketch's: log-spaced buckets for positive and negative
    magnitudes, a count of zeros, of +inf and -inf, and of NaNs, aside).

    Each event's elements (all elements of each leaf; a pytree value gets one sketch per
    leaf) are counted on the device, one scatter-add per event, into a state whose size does
    not depend on the number of events; `merge` adds counts, so sketches merge across scan
    iterations, vmap lanes and devices (`across=`), and processes.

    **Quantile:** for `n` (non-NaN) elements seen, the q-quantile is the value of rank
    `floor(q * (n - 1))` in sorted order (`numpy.quantile(all_values, q, method="lower")`,
    the product read as the decimal `q` is written as), reported within relative error
    `relative_error` where its magnitude is in [`min_magnitude`, `max_magnitude`]: exactly 0
    for a magnitude below `min_magnitude` (zeros, float32 and float64 subnormals), ±inf for
    the infinities, and the top bucket's value (about `max_magnitude`) for a magnitude above
    it. NaNs are counted aside (the sketch's `.nan`). Integers and booleans are read as
    float32.

    **Memory:** `k` buckets per power of two for each sign, `k = 36` at the default 1% (the
    cubic mapping needs 1% more than exact logarithms). The default magnitudes cover
    float32's normal range, 2**-126 to float32's largest (254 powers of two, 76 decades):
    18,292 int32 counts, 71 KiB per leaf, however many events. float64 events beyond it
    want `min_magnitude=1e-300, max_magnitude=1e300` (143,512 counts, 561 KiB). Counts are
    int32: at most 2**31 - 1 elements in a bucket and 2**32 - 1 in all. On the CPU an
    element costs about 1.5 ns (its bucket, then a scatter-add, which XLA runs serially):
    4-6x `Mean` of the same value (`benchmarks/bench_quantiles.py`).

    **Arguments:**

    - `q`: the quantiles to report, each in [0, 1].
    - `relative_error`: the bound, in (0, 1); the buckets are that much apart.
    - `min_magnitude`: magnitudes below it count as zero (positive).
    - `max_magnitude`: the largest magnitude with the bound (above `min_magnitude`).
    - `sketch`: also output the sketch itself (a `QuantileSketch`), to merge after the run
      (from `spool`'s logs: the loggers write numbers, and refuse a sketch).

    **Returns:** per leaf, a dict of scalars `{"p50": ..., "p90": ..., "p99": ...}` (named
    `"p" + f"{100 * q:g}"`: q=0.999 is `"p99.9"`), in float32 (float64 for float64 events),
    NaN where no non-NaN element was seen; with `sketch=True` also `"sketch"`.

    !!! example

        ```python
        def f(xs):
            def step(c, x):
                eqx_logs.log("x", x)
                return c, None

            return jax.lax.scan(step, 0, xs)[0]

        xs = jnp.arange(1.0, 1001.0).reshape(10, 100)  # 10 events of 100 elements
        _, logs = eqx_logs.spool(f, reduce=eqx_logs.Quantiles())(xs)
        print(logs["x"])  # {'p50': ~500.0, 'p90': ~900.0, 'p99': ~990.0} (within 1%)
        ```

    !!! example

        With `sketch=True`, sketches of two runs merge after them:

        ```python
        def f(xs):
            def step(c, x):
                eqx_logs.log("x", x)
                return c, None

            return jax.lax.scan(step, 0, xs)[0]

        reduce = eqx_logs.Quantiles(q=(0.5,), sketch=True)
        xs = jnp.arange(1.0, 13.0).reshape(3, 4)
        _, a = eqx_logs.spool(f, reduce=reduce)(xs)
        _, b = eqx_logs.spool(f, reduce=reduce)(xs + 12)
        both = a["x"]["sketch"] + b["x"]["sketch"]
        print(both.count, both.quantile(0.5))  # 24 ~12.0 (within 1%)
        ```
    """

    q: tuple[float, ...] = eqx.field(static=True, default=(0.5, 0.9, 0.99), converter=_as_q)
    relative_error: float = eqx.field(static=True, default=0.01)
    min_magnitude: float = eqx.field(static=True, default=_FLOAT32_TINY)
    max_magnitude: float = eqx.field(static=True, default=_FLOAT32_MAX)
    sketch: bool = eqx.field(static=True, default=False)

    def __check_init__(self):
        qs = _check_q("Quantiles", self.q)
        names = [quantile_name(v) for v in qs]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"Quantiles(q={self.q!r}): two quantiles share the output name "
                f"{repeated[0]!r}; give each quantile once."
            )
        a = self.relative_error
        if isinstance(a, bool) or not isinstance(a, int | float):
            raise TypeError(f"Quantiles(relative_error={a!r:.60}): must be a number in (0, 1).")
        if not 0 < a < 1:
            raise ValueError(
                f"Quantiles(relative_error={a!r}): must be in (0, 1), such as 0.01 (1%)."
            )
        if a <= 10 * _MARGIN:
            raise ValueError(
                f"Quantiles(relative_error={a!r}): below float32's resolution for a sketch "
                f"(at least {10 * _MARGIN:g}); use relative_error=1e-4 or more."
            )
        for name in ("min_magnitude", "max_magnitude"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise TypeError(
                    f"Quantiles({name}={v!r:.60}): {name} must be a finite positive number."
                )
            if not v > 0:
                raise ValueError(f"Quantiles({name}={v!r}): {name} must be positive.")
        lo, hi = self.min_magnitude, self.max_magnitude
        if not lo < hi:
            raise ValueError(
                f"Quantiles(min_magnitude={lo!r}, max_magnitude={hi!r}): needs "
                "min_magnitude < max_magnitude."
            )
        if not isinstance(self.sketch, bool):
            raise TypeError(f"Quantiles(sketch={self.sketch!r:.60}): sketch must be a bool.")
        layout = _layout(float(a), float(lo), float(hi))
        if layout.size > _MAX_BUCKETS:
            raise ValueError(
                f"Quantiles(relative_error={a!r}, min_magnitude={lo!r}, max_magnitude={hi!r})"
                f": {layout.size:,} buckets per leaf, more than {_MAX_BUCKETS:,}; use a "
                "larger relative_error or a narrower range of magnitudes."
            )

    @property
    def _layout(self) -> _Layout:
        return _layout(float(self.relative_error), float(self.min_magnitude),
                       float(self.max_magnitude))  # fmt: skip

    def init(self, struct, max_events):
        size = self._layout.size

        def empty(s):
            return _Counts(jnp.zeros((size,), jnp.int32), _zero(s.dtype))

        return jtu.tree_map(empty, struct)

    def _positions(self, v):
        v = jnp.ravel(jnp.asarray(v))
        return self._layout.positions(v.astype(_compute_dtype(v.dtype)))

    def _bincount(self, *values):
        """How many elements of `values` fall at each flat position: one scatter-add into
        fresh zeros (into the state, or `jnp.bincount`, measure within 2% of it on the CPU:
        bench_quantiles.py; the scatter is ~half the update's time there)."""
        positions = jnp.concatenate([self._positions(v) for v in values])
        zeros = jnp.zeros((self._layout.size,), jnp.int32)
        return zeros.at[positions].add(jnp.int32(1), mode="promise_in_bounds")

    def update(self, state, value, valid):
        weight = jnp.asarray(valid, jnp.int32)

        def add(s, v):
            return _Counts(s.counts + weight * self._bincount(v), s.dtype)

        return _map(add, state, value)

    def update_many(self, state, values):
        def add(s, *vs):
            return _Counts(s.counts + self._bincount(*vs), s.dtype)

        return _map(add, state, *values)

    def merge(self, a, b):
        return jtu.tree_map(jnp.add, a, b)

    def finalize(self, state):
        return _map(self._finalize_leaf, state)

    def _finalize_leaf(self, s):
        sketch = QuantileSketch(
            s.counts,
            float(self.relative_error),
            float(self.min_magnitude),
            float(self.max_magnitude),
            str(s.dtype.dtype),
        )
        out = {quantile_name(q): sketch._one(q) for q in _check_q("Quantiles", self.q)}
        if self.sketch:
            out["sketch"] = sketch
        return out


def _zero(dtype) -> Array:
    return jnp.zeros((), _compute_dtype(dtype))


class _Counts(eqx.Module):
    """One leaf's state: the flat counts, and a scalar zero of the dtype it reads out in."""

    counts: Array
    dtype: Array


def _map(f, state, *values):
    """`f` over the leaves' states of `state`, and the matching leaves of `values`."""
    return jtu.tree_map(f, state, *values, is_leaf=lambda x: isinstance(x, _Counts))
