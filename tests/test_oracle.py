"""Random nested programs: `eqx_logs.spool` against an eager numpy reference oracle.

A program is a small tree over the state `(x, z)`: `x` is a float32 scalar or vector, `z` a
float32 scalar that only ever depends on itself (so it stays unbatched under `vmap` and can
drive conds there). `build` turns a tree into a JAX function with the real `lax` primitives
and `eqx_logs.log`; `Oracle` runs the same tree with Python loops and ifs, records every event
on the host and computes each key's static bound (scan: length times the body, cond/switch:
maximum over branches). The tests compare the two under spool, jit, grad, vmap, and with a
bounded `Stack(capacity, keep)` (which also allows while loops).

Reductions and policies: a reduction is drawn as a small spec (`make_reduction` builds the
eqx_logs object, `reference` applies it in numpy to the oracle's events), a Policy as a
`Config` (rules, call-site reductions, tags, interval, prefix, window). The batched test lets
predicates read the vmapped state (`z` may be batched too, and while loops may take one more
trip depending on it) and compares spool(vmap(f)) and vmap(spool(f)) with the oracle per lane.

Statistics and plant: `programs(extras=EXTRAS)` adds leaves that call `log_stats` (Stats), an
`instrument`ed Equinox model (Instrument) and `sow` (Sow). The oracle records a statistic's
event as numpy's statistic of the value (and the value, for statistics over a vmap's whole
batch), and substitutes planted values for sown ones by hand, for `plant`.
"""

import dataclasses
import fnmatch
import functools
import math
import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ATOL, RTOL, assert_close, assert_logs, padded
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase
from jax import lax
from jax.sharding import PartitionSpec as P

import eqx_logs

# ----------------------------------------------------------------------------------------
# Programs
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Log:
    items: tuple[tuple[str, int], ...]  # (key, value variant); one call, distinct keys
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Update:
    op: int


@dataclasses.dataclass(frozen=True)
class Seq:
    children: tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Scan:
    length: int
    reverse: bool
    unroll: int
    log_index: bool  # log the int32 element of xs = arange(length) under `index_key`
    body: Any
    index_key: str = "n"  # "N" inside a ShardMap


@dataclasses.dataclass(frozen=True)
class Fori:
    lower: int
    upper: int
    log_index: bool
    body: Any
    index_key: str = "n"


@dataclasses.dataclass(frozen=True)
class Cond:
    on: str  # "x": predicate on sum(x) + z; "z": on z only (unbatched under vmap)
    threshold: float
    true: Any
    false: Any


@dataclasses.dataclass(frozen=True)
class Switch:
    on: str
    threshold: float  # index = (s > t) + (s > t + 0.5)
    branches: tuple[Any, Any, Any]


@dataclasses.dataclass(frozen=True)
class Jit:
    body: Any


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    body: Any


@dataclasses.dataclass(frozen=True)
class ShardMap:
    """`jax.shard_map` over a mesh of one device (axis "dev"). Its keys are upper case (a key
    logged inside a shard_map cannot be logged outside it); spooled with `across="dev"`, they
    equal the oracle's events of the same lower-case key."""

    body: Any
    check_vma: bool = True


@dataclasses.dataclass(frozen=True)
class While:
    trips: int  # lax.while_loop on a counter: no static bound on its events
    body: Any
    on: str | None = None  # if set: one more trip if then the source exceeds `threshold`
    threshold: float = 0.0


@dataclasses.dataclass(frozen=True)
class Stats:
    """`eqx_logs.log_stats(name, value, stats=stats)` of the value a Log node records for
    `source` (a `(key, variant)` pair of `_value`): keys `<name>/<stat>`, each statistic over
    all of the value."""

    name: str  # "s"; "S" inside a ShardMap
    source: tuple[str, int]
    stats: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Instrument:
    """`x <- 0.5 * x + 0.5 * tanh(model(x))`, `model` the `eqx_logs.instrument`ed `_model`
    (Linear, Lambda(tanh), Linear): keys `layers[i]/<stat>` for i in 0, 1, 2 (inside a
    ShardMap, in `eqx_logs.scope("S")`); with `grads`, also `layers[i]/grad/<stat>` in the
    backward pass."""

    stats: tuple[str, ...]
    grads: bool = False
    scope: str = ""


@dataclasses.dataclass(frozen=True)
class Sow:
    """`x <- 0.5 * x + 0.5 * eqx_logs.sow(key, value)`: "h" sows a value shaped like x, "g" a
    scalar ("H", "G" inside a ShardMap). Under `plant`, the planted value replaces it (in
    what follows, and in what a spool records)."""

    key: str
    variant: int


EXTRAS = ("stats", "instrument", "sow")  # the leaves `programs(extras=...)` may add
STATS = ("mean", "std", "rms", "absmax", "min", "max", "norm", "nonfinite")


def _value(xp, key: str, variant: int, x):
    """The value a Log node records for `key`; the same formula for numpy and jax.numpy."""
    key = key.lower()
    if key == "a":  # shaped like x
        return (x, 2.0 * x - 1.0, xp.cos(x))[variant % 3]
    if key == "b":  # scalar
        return (xp.sum(x), xp.sum(xp.sin(x)))[variant % 2]
    if key == "c":  # shape (2,)
        if variant % 2 == 0:
            return xp.stack([xp.sum(x), xp.max(x)])
        return xp.stack([xp.min(x), xp.mean(x)])
    raise AssertionError(key)


def _update(xp, op: int, x, z):
    """One state update; z depends only on z. Every map is (nearly) 1-Lipschitz."""
    if op == 0:
        return xp.sin(x) + 0.5, z
    if op == 1:
        return 0.9 * x - 0.2, xp.sin(z) + 0.3
    if op == 2:
        return xp.cos(x) - 0.2 + 0.1 * z, z
    rolled = xp.roll(x, 1) if x.ndim else x
    return 0.7 * x + 0.3 * rolled, 0.8 * z + 0.25


def _source(xp, on: str, x, z):
    return xp.sum(x) + z if on == "x" else z


def _sown(xp, key: str, variant: int, x):
    """The value a Sow node sows under `key` (before any plant)."""
    if key.lower() == "h":  # shaped like x
        return (xp.cos(x), 0.5 * xp.sin(x) + 0.25)[variant % 2]
    return (xp.mean(xp.sin(x)), 0.5 * xp.max(x))[variant % 2]  # "g": scalar


@functools.cache
def _model(shape: tuple[int, ...]) -> eqx.nn.Sequential:
    """The small model an Instrument node calls, mapping arrays of `shape` to `shape`. Its
    weights are numpy arrays: it is first made inside some trace (a jit, a shard_map), and
    JAX arrays made there would belong to it."""
    n = shape[0] if shape else "scalar"
    size = shape[0] if shape else 1
    rng = np.random.default_rng(0)

    def linear():
        layer = eqx.filter_eval_shape(lambda: eqx.nn.Linear(n, n, key=jax.random.key(0)))
        w = (rng.uniform(-1, 1, (size, size + 1)) / np.sqrt(size)).astype(np.float32)
        return eqx.tree_at(lambda m: (m.weight, m.bias), layer, (w[:, :size], w[:, size]))

    return eqx.nn.Sequential([linear(), eqx.nn.Lambda(jnp.tanh), linear()])


def _activations(x) -> list[np.ndarray]:
    """Each layer's output of `_model(x.shape)` on `x`, in numpy (float32)."""
    h = np.asarray(x, np.float32).reshape(-1)
    outs = []
    for layer in _model(x.shape).layers:
        if isinstance(layer, eqx.nn.Linear):
            h = np.asarray(layer.weight) @ h + np.asarray(layer.bias)
        else:
            h = np.tanh(h)
        outs.append(np.asarray(h, np.float32).reshape(x.shape))
    return outs


def statistic(stat: str, x) -> np.ndarray:
    """One statistic of all of `x`, in float64 (as `eqx_logs.log_stats` documents them)."""
    x = np.asarray(x, np.float64)
    return {
        "mean": np.mean,
        "std": np.std,
        "rms": lambda x: np.sqrt(np.mean(x**2)),
        "absmax": lambda x: np.max(np.abs(x)),
        "min": np.min,
        "max": np.max,
        "norm": lambda x: np.sqrt(np.sum(x**2)),
        "nonfinite": lambda x: np.sum(~np.isfinite(x)),
    }[stat](x)


def _is_stat(key: str) -> bool:
    return "/" in key  # `<name>/<stat>`, `layers[i]/<stat>`, `S/layers[i]/<stat>`


def _key_shape(key: str, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    if _is_stat(key):
        return ()
    return {"a": x_shape, "b": (), "c": (2,), "n": (), "h": x_shape, "g": ()}[key.lower()]


def _key_dtype(key: str):
    if _is_stat(key):
        return np.int32 if key.endswith("/nonfinite") else np.float32
    return np.int32 if key.lower() == "n" else np.float32


# ----------------------------------------------------------------------------------------
# Interpreter 1: the real thing, with lax primitives and eqx_logs.log
# ----------------------------------------------------------------------------------------


def build(node, memo: dict | None = None, site_reduce: dict | None = None):
    """A function `(x, z) -> (x, z)` running `node` with JAX.

    Equal subtrees share one function (`memo`), so a repeated `Jit` calls the same `jax.jit`
    object twice and the second call reuses JAX's cached trace. With `site_reduce` (key ->
    reduction or None), every Log node logs each key in its own call with
    `log(..., reduce=site_reduce[key])`.
    """
    memo = {} if memo is None else memo
    if node not in memo:
        memo[node] = _build(node, memo, site_reduce)
    return memo[node]


def _build(node, memo: dict, site_reduce: dict | None):
    if isinstance(node, Log):

        def run(s):
            x, _ = s
            values = {k: _value(jnp, k, v, x) for k, v in node.items}
            if site_reduce is not None:
                for k, v in values.items():
                    eqx_logs.log(k, v, tags=node.tags, reduce=site_reduce.get(k))
            elif len(values) == 1:
                eqx_logs.log(*next(iter(values.items())), tags=node.tags)
            else:
                eqx_logs.log(values, tags=node.tags)
            return s

    elif isinstance(node, Update):

        def run(s):
            return _update(jnp, node.op, *s)

    elif isinstance(node, Seq):
        parts = [build(c, memo, site_reduce) for c in node.children]

        def run(s):
            for part in parts:
                s = part(s)
            return s

    elif isinstance(node, Scan):
        body = build(node.body, memo, site_reduce)

        def step(s, i):
            if node.log_index:
                eqx_logs.log(node.index_key, i)
            s = body(s)
            return s, 0.5 * s[0]

        def run(s):
            xs = jnp.arange(node.length, dtype=jnp.int32)
            (x, z), ys = lax.scan(step, s, xs, reverse=node.reverse, unroll=node.unroll)
            return x + 0.05 * jnp.sum(ys, axis=0), z

    elif isinstance(node, Fori):
        body = build(node.body, memo, site_reduce)

        def fori_body(i, s):
            if node.log_index:
                eqx_logs.log(node.index_key, i)
            return body(s)

        def run(s):
            return lax.fori_loop(node.lower, node.upper, fori_body, s)

    elif isinstance(node, Cond):
        true, false = build(node.true, memo, site_reduce), build(node.false, memo, site_reduce)

        def run(s):
            return lax.cond(_source(jnp, node.on, *s) > node.threshold, true, false, s)

    elif isinstance(node, Switch):
        branches = [build(b, memo, site_reduce) for b in node.branches]

        def run(s):
            src = _source(jnp, node.on, *s)
            index = (src > node.threshold).astype(jnp.int32) + (src > node.threshold + 0.5).astype(
                jnp.int32
            )
            return lax.switch(index, branches, s)

    elif isinstance(node, Jit):
        run = jax.jit(build(node.body, memo, site_reduce))
    elif isinstance(node, Checkpoint):
        run = jax.checkpoint(build(node.body, memo, site_reduce))
    elif isinstance(node, ShardMap):
        run = jax.shard_map(
            build(node.body, memo, site_reduce),
            mesh=jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dev",)),
            in_specs=P(),
            out_specs=P(),
            check_vma=node.check_vma,
        )
    elif isinstance(node, While):
        body = build(node.body, memo, site_reduce)

        def run(s):
            def loop(c):
                i, s = c
                return i + 1, body(s)

            def test(c):
                i, (x, z) = c
                if node.on is None:
                    return i < node.trips
                extra = (_source(jnp, node.on, x, z) > node.threshold).astype(jnp.int32)
                return i < node.trips + extra

            return lax.while_loop(test, loop, (0, s))[1]

    elif isinstance(node, Stats):

        def run(s):
            eqx_logs.log_stats(node.name, _value(jnp, *node.source, s[0]), stats=node.stats)
            return s

    elif isinstance(node, Instrument):

        def run(s):
            x, z = s
            model = eqx_logs.instrument(_model(x.shape), stats=node.stats, grads=node.grads)
            with eqx_logs.scope(node.scope or None):
                y = model(x)
            return 0.5 * x + 0.5 * jnp.tanh(y), z

    elif isinstance(node, Sow):

        def run(s):
            x, z = s
            h = eqx_logs.sow(node.key, _sown(jnp, node.key, node.variant, x))
            return 0.5 * x + 0.5 * h, z

    else:
        raise AssertionError(node)
    return run


def as_function(root, site_reduce: dict | None = None):
    """`f(x, z) -> (x, z)` for a program tree."""
    run = build(root, None, site_reduce)

    def f(x, z):
        return run((x, z))

    return f


# ----------------------------------------------------------------------------------------
# Interpreter 2: the eager numpy oracle
# ----------------------------------------------------------------------------------------

_TIE = 1e-3  # a predicate this close to its threshold could flip between numpy and XLA


class Oracle:
    """Runs a program eagerly in numpy, recording every event per key on the host.

    A statistic's event is the statistic of the value (`raw` keeps the value too, for
    statistics over a batch). `planted` (key -> array) substitutes by hand what
    `eqx_logs.plant` must: a Sow node's value becomes the planted value (of the sown shape)
    or its i-th row at the key's i-th event. `backward` counts the events each Instrument
    node with `grads` must log in the backward pass (one per forward call). `where` gives
    each statistic's event its place in the run (each Seq child, loop iteration and branch
    taken on the way): under `spool(vmap(f))` the events of lanes at the same place are one
    masked event of the batch, and its statistic is over those lanes."""

    def __init__(self, root, x0, z0, planted: dict | None = None):
        self.events: dict[str, list] = {}
        self.tags: dict[str, list] = {}  # the tags of every event, parallel to `events`
        self.raw: dict[str, list] = {}  # for statistics: the value, parallel to `events`
        self.where: dict[str, list] = {}  # for statistics: the place, parallel to `events`
        self.path: list = []  # the place being run
        self.backward: dict[str, int] = {}
        self.planted = planted or {}
        self.tie = False
        self.root = root
        x = np.asarray(x0, np.float32)
        self.x_shape = x.shape
        self.out = self.run(root, (x, np.float32(z0)))
        self.bounds = bounds(root)

    def record(self, key, value, tags=()):
        self.events.setdefault(key, []).append(np.asarray(value, _key_dtype(key)))
        self.tags.setdefault(key, []).append(tags)

    def record_stat(self, key, value, tags=()):
        self.raw.setdefault(key, []).append(value)
        self.where.setdefault(key, []).append(tuple(self.path))
        self.record(key, statistic(key.rsplit("/", 1)[1], value), tags)

    def compare(self, src, threshold) -> bool:
        if abs(float(src) - threshold) < _TIE:
            self.tie = True
        return bool(src > threshold)

    def at(self, place, node, s):
        """`run(node, s)` at `place` (a Seq child's index, an iteration, a branch)."""
        self.path.append(place)
        try:
            return self.run(node, s)
        finally:
            self.path.pop()

    def run(self, node, s):
        x, z = s
        if isinstance(node, Log):
            for key, variant in node.items:
                self.record(key, _value(np, key, variant, x), node.tags)
            return s
        if isinstance(node, Update):
            x, z = _update(np, node.op, x, z)
            return np.asarray(x, np.float32), np.float32(z)
        if isinstance(node, Seq):
            for place, child in enumerate(node.children):
                s = self.at(place, child, s)
            return s
        if isinstance(node, Scan):
            order = range(node.length)
            ys = np.zeros((node.length, *self.x_shape), np.float32)
            for i in reversed(order) if node.reverse else order:
                if node.log_index:
                    self.record(node.index_key, i)
                s = self.at(i, node.body, s)
                ys[i] = 0.5 * s[0]
            x, z = s
            return np.asarray(x + 0.05 * ys.sum(axis=0), np.float32), z
        if isinstance(node, Fori):
            for i in range(node.lower, node.upper):
                if node.log_index:
                    self.record(node.index_key, i)
                s = self.at(i, node.body, s)
            return s
        if isinstance(node, While):
            for trip in range(node.trips):
                s = self.at(trip, node.body, s)
            if node.on is not None and self.compare(_source(np, node.on, *s), node.threshold):
                s = self.at(node.trips, node.body, s)
            return s
        if isinstance(node, Cond):
            taken = self.compare(_source(np, node.on, x, z), node.threshold)
            return self.at(taken, node.true if taken else node.false, s)
        if isinstance(node, Switch):
            src = _source(np, node.on, x, z)
            index = int(self.compare(src, node.threshold))
            index += int(self.compare(src, node.threshold + 0.5))
            return self.at(index, node.branches[index], s)
        if isinstance(node, Jit | Checkpoint | ShardMap):
            return self.run(node.body, s)
        if isinstance(node, Stats):
            value = np.asarray(_value(np, *node.source, x), np.float32)
            for stat in node.stats:
                self.record_stat(f"{node.name}/{stat}", value)
            return s
        if isinstance(node, Instrument):
            activations = _activations(x)
            prefix = f"{node.scope}/" if node.scope else ""
            for i, act in enumerate(activations):
                for stat in node.stats:
                    self.record_stat(f"{prefix}layers[{i}]/{stat}", act, ("instrument",))
                    if node.grads:
                        key = f"{prefix}layers[{i}]/grad/{stat}"
                        self.backward[key] = self.backward.get(key, 0) + 1
            return np.asarray(0.5 * x + 0.5 * np.tanh(activations[-1]), np.float32), z
        if isinstance(node, Sow):
            value = np.asarray(_sown(np, node.key, node.variant, x), np.float32)
            if node.key in self.planted:
                planted = np.asarray(self.planted[node.key], np.float32)
                i = len(self.events.get(node.key, []))
                value = planted if planted.shape == value.shape else planted[i]
            self.record(node.key, value)
            return np.asarray(0.5 * x + 0.5 * value, np.float32), z
        raise AssertionError(node)

    def expected(self, capacity: int | None = None, keep: str = "first") -> tuple[dict, dict]:
        """`(values, counts)` as `spool` must return them; with `reduce=Stack(capacity, keep)`
        every key has `capacity` slots holding its first (or last) events."""
        values, counts = {}, {}
        for key, bound in self.bounds.items():
            events = self.events.get(key, [])
            kept = events
            if capacity is not None:
                kept = events[:capacity] if keep == "first" else events[-capacity:]
            shape = _key_shape(key, self.x_shape)
            size = bound if capacity is None else capacity
            values[key] = padded(kept, size, shape, _key_dtype(key))
            counts[key] = len(events)  # every event, kept or not
        return values, counts


def _plus(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, n in b.items():
        out[k] = None if n is None or out.get(k, 0) is None else out.get(k, 0) + n
    return out


def bounds(node, select=None) -> dict[str, int | None]:
    """Static upper bound on the number of events of each key that `node` may log (None:
    unbounded, inside a while loop). With `select` (tags -> bool), only the log calls it
    selects count; a key none of whose calls is selected is absent."""
    if isinstance(node, Log):
        if select is not None and not select(node.tags):
            return {}
        return {k: 1 for k, _ in node.items}
    if isinstance(node, Update):
        return {}
    if isinstance(node, Seq):
        out = {}
        for child in node.children:
            out = _plus(out, bounds(child, select))
        return out
    if isinstance(node, Scan | Fori):
        trips = node.length if isinstance(node, Scan) else node.upper - node.lower
        index = node.log_index and (select is None or select(()))
        per_trip = _plus({node.index_key: 1} if index else {}, bounds(node.body, select))
        return {k: None if n is None else n * trips for k, n in per_trip.items()}
    if isinstance(node, While):
        return {k: None for k in bounds(node.body, select)}
    if isinstance(node, Cond | Switch):
        branches = (node.true, node.false) if isinstance(node, Cond) else node.branches
        out = {}
        for branch in branches:
            for k, n in bounds(branch, select).items():
                out[k] = None if n is None or out.get(k, 0) is None else max(out.get(k, 0), n)
        return out
    if isinstance(node, Jit | Checkpoint | ShardMap):
        return bounds(node.body, select)
    if isinstance(node, Stats | Instrument | Sow):
        tags = ("instrument",) if isinstance(node, Instrument) else ()
        if select is not None and not select(tags):
            return {}
        return dict.fromkeys(leaf_keys(node), 1)
    raise AssertionError(node)


def leaf_keys(node) -> list[str]:
    """The keys a Stats, Instrument or Sow node logs in the forward pass."""
    if isinstance(node, Stats):
        return [f"{node.name}/{stat}" for stat in node.stats]
    if isinstance(node, Instrument):
        prefix = f"{node.scope}/" if node.scope else ""
        return [f"{prefix}layers[{i}]/{stat}" for i in range(3) for stat in node.stats]
    return [node.key]


def nodes(node):
    """Every node of a tree, `node` first."""
    yield node
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        for child in value if isinstance(value, tuple) else [value]:
            if dataclasses.is_dataclass(child):
                yield from nodes(child)


def backward_keys(root) -> set[str]:
    """The keys of the cotangent statistics of the Instrument nodes with `grads`."""
    keys = set()
    for node in nodes(root):
        if isinstance(node, Instrument) and node.grads:
            keys.update("/grad/".join(k.rsplit("/", 1)) for k in leaf_keys(node))
    return keys


def count_logs(node, kinds: tuple[type, ...] = (Log,)) -> int:
    """Number of nodes of `kinds` (by default Log nodes) in a tree."""
    if isinstance(node, kinds):
        return 1
    children = []
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        children.extend(value if isinstance(value, tuple) else [value])
    return sum(count_logs(c, kinds) for c in children if dataclasses.is_dataclass(c))


# ----------------------------------------------------------------------------------------
# Reductions and policies: specs, the library objects they stand for, numpy references
# ----------------------------------------------------------------------------------------

# A reduction spec is a tuple: (name,) for a reduction passed by name (NAMED), ("ema", decay),
# ("stack", capacity, keep), ("collect", capacity), ("window", size, inner spec, capacity) and
# ("fanout", ((name, spec), ...)).
_SIMPLE = ("mean", "sum", "last", "first", "min", "max", "var", "std", "count")
NAMED = ("stack", "collect", *_SIMPLE)
_ACCUMULATING = {"sum", "mean", "var", "std", "ema"}  # compared with a float32 tolerance
_EVENT_KEEPING = {"stack", "collect", "window"}  # outputs index events (or windows) first


def make_reduction(spec):
    """The eqx_logs reduction a spec stands for (a name where the spec is one)."""
    kind = spec[0]
    if len(spec) == 1:
        return kind
    if kind == "ema":
        return eqx_logs.EMA(spec[1])
    if kind == "stack":
        return eqx_logs.Stack(capacity=spec[1], keep=spec[2])
    if kind == "collect":
        return eqx_logs.Collect(capacity=spec[1])
    if kind == "window":
        return eqx_logs.Window(spec[1], make_reduction(spec[2]), capacity=spec[3])
    if kind == "fanout":
        return eqx_logs.Fanout(**{name: make_reduction(s) for name, s in spec[1]})
    raise AssertionError(spec)


def _fill(dtype):
    return np.nan if np.issubdtype(dtype, np.inexact) else 0


def reference(spec, events: list, bound: int | None, shape: tuple[int, ...], dtype):
    """What the reduction `spec` makes of `events` (one key, one lane, in execution order), in
    numpy; `bound` is the static upper bound on their number (None: unbounded)."""
    kind, n, dtype = spec[0], len(events), np.dtype(dtype)
    real = dtype if np.issubdtype(dtype, np.inexact) else np.dtype(np.float32)
    data = np.asarray(events, np.float64).reshape(n, *shape)
    if kind in ("stack", "collect"):
        capacity = spec[1] if len(spec) > 1 else None
        keep = spec[2] if len(spec) > 2 else "first"
        kept = events
        if capacity is not None:
            kept = events[:capacity] if keep == "first" else events[max(n - capacity, 0) :]
        out = padded(kept, bound if capacity is None else capacity, shape, dtype)
        return out.reshape(-1) if kind == "collect" else out
    if kind == "window":
        _, size, inner, capacity = spec
        windows = math.ceil(bound / size) if capacity is None else capacity
        empty = reference(inner, [], size, shape, dtype)
        out = np.full((windows, *empty.shape), _fill(empty.dtype), empty.dtype)
        for w, start in enumerate(range(0, n, size)[:windows]):
            out[w] = reference(inner, events[start : start + size], size, shape, dtype)
        return out
    if kind == "fanout":
        return {name: reference(s, events, bound, shape, dtype) for name, s in spec[1]}
    if kind == "count":
        return np.asarray(n, np.int32)
    if kind == "sum":
        return data.sum(axis=0).astype(dtype)
    if kind in ("mean", "var", "std", "ema"):
        if n == 0:
            return np.full(shape, np.nan, real)
        if kind == "ema":
            d = spec[1]
            weights = (1 - d) * d ** np.arange(n - 1, -1, -1, dtype=np.float64)
            return (np.tensordot(weights, data, axes=1) / (1 - d**n)).astype(real)
        return {"mean": np.mean, "var": np.var, "std": np.std}[kind](data, axis=0).astype(real)
    if n == 0:
        return np.full(shape, _fill(dtype), dtype)
    pick = {"first": lambda d: d[0], "last": lambda d: d[-1], "min": np.min, "max": np.max}
    if kind in ("min", "max"):
        return pick[kind](data, axis=0).astype(dtype)
    return pick[kind](data).astype(dtype)


def _kinds(spec) -> set[str]:
    if spec[0] == "window":
        return {"window", *_kinds(spec[2])}
    if spec[0] == "fanout":
        return {"fanout"}.union(*(_kinds(s) for _, s in spec[1]))
    return {spec[0]}


def tolerance(spec, events: list) -> tuple[float, float]:
    """(rtol, atol): reductions that accumulate in float32 get a looser one."""
    kinds = _kinds(spec)
    if not kinds & _ACCUMULATING:
        return RTOL, ATOL
    scale = max((float(np.max(np.abs(e))) for e in events), default=0.0)
    if "sum" in kinds:
        scale *= len(events)
    return 1e-4, 1e-5 * (1.0 + scale)


def stack_lanes(spec, values: list, event_first: bool):
    """Per-lane outputs stacked on a batch axis: axis 0 (`vmap(spool(f))`), or under
    `spool(vmap(f))` just after the event axis of event-keeping reductions."""
    if spec[0] == "fanout":
        return {name: stack_lanes(s, [v[name] for v in values], event_first) for name, s in spec[1]}
    axis = 1 if event_first and spec[0] in _EVENT_KEEPING else 0
    return np.stack(values, axis=axis)


@dataclasses.dataclass(frozen=True)
class Config:
    """What a spool does with the events: Policy fields, and the reductions named at log
    call sites (`site`: key -> spec)."""

    reduce: tuple = ("stack",)
    interval: int = 1
    tags: tuple[str, ...] | None = None
    exclude: tuple[str, ...] = ()
    rules: tuple[tuple[str, Any], ...] = ()  # (pattern, spec or "drop"); the first match wins
    prefix: str = ""
    site: tuple[tuple[str, Any], ...] = ()
    window: int | None = None  # Policy(window=w): every reduction r becomes Window(w, r)

    def selects(self, tags: tuple[str, ...]) -> bool:
        if self.tags is not None and not any(t in self.tags for t in tags):
            return False
        return not any(t in self.exclude for t in tags)

    def reduction(self, key: str):
        for pattern, spec in self.rules:
            if fnmatch.fnmatchcase(key, pattern):
                break
        else:
            site = dict(self.site).get(key)
            spec = self.reduce if site is None else site
        if self.window is None or spec == "drop":
            return spec
        return ("window", self.window, spec, None)


def expected_reduced(o: Oracle, config: Config) -> dict[str, tuple]:
    """`{output key: (value, count, spec, (rtol, atol))}` as `spool` must return them for the
    oracle's events under `config`."""
    out = {}
    for key, bound in bounds(o.root, config.selects).items():
        spec = config.reduction(key)
        if spec == "drop":
            continue
        tagged = zip(o.events.get(key, []), o.tags.get(key, []))
        kept = [e for e, tags in tagged if config.selects(tags)][:: config.interval]
        if bound is not None:
            bound = math.ceil(bound / config.interval)
        value = reference(spec, kept, bound, _key_shape(key, o.x_shape), _key_dtype(key))
        out[config.prefix + key] = (value, np.int32(len(kept)), spec, tolerance(spec, kept))
    return out


def _specs(spec) -> list:
    """`spec` and the specs inside it (Fanout parts; not Window's inner)."""
    if spec[0] == "fanout":
        return [spec, *(t for _, s in spec[1] for t in _specs(s))]
    return [spec]


def combine_lanes(lanes: list[dict], event_first: bool) -> dict[str, tuple]:
    """Per-lane expectations (from `expected_reduced`) as one vmapped spool returns them."""
    out = {}
    for name, (_, _, spec, _) in lanes[0].items():
        value = stack_lanes(spec, [lane[name][0] for lane in lanes], event_first)
        count = np.array([lane[name][1] for lane in lanes], np.int32)
        rtol = max(lane[name][3][0] for lane in lanes)
        atol = max(lane[name][3][1] for lane in lanes)
        out[name] = (value, count, spec, (rtol, atol))
    return out


def assert_reduced(logs, want: dict[str, tuple]) -> None:
    """A LogDict against `expected_reduced` (or `combine_lanes`): keys, values (shape, dtype,
    NaN positions, values) and counts (shape and values). Where the event axis is sized by
    the static bound, the bounds must agree too (under `spool(vmap(f))`, a cond with a
    batched predicate is bounded by the maximum over its branches, as per lane)."""
    assert set(logs) == set(want), f"keys {sorted(logs)} != expected {sorted(want)}"
    for name, (value, count, spec, (rtol, atol)) in want.items():
        got = logs[name]
        if isinstance(value, dict):
            assert isinstance(got, dict), f"{name!r} ({spec}): {type(got)} is not a dict"
            assert set(got) == set(value), f"{name!r} ({spec}): {sorted(got)} != {sorted(value)}"
            parts = [(f"{name}[{k!r}]", got[k], value[k], s) for k, s in spec[1]]
        else:
            parts = [(name, got, value, spec)]
        for what, g, w, s in parts:
            g = np.asarray(g)
            assert g.shape == w.shape, f"{what!r} ({s}): shape {g.shape} != {w.shape}"
            assert g.dtype == w.dtype, f"{what!r} ({s}): dtype {g.dtype} != {w.dtype}"
            np.testing.assert_allclose(
                g, w, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"logs[{what!r}] ({s})"
            )
        got_count = np.asarray(logs.count[name])
        assert got_count.shape == count.shape, (
            f"count[{name!r}]: shape {got_count.shape} != {count.shape}"
        )
        np.testing.assert_array_equal(got_count, count, err_msg=f"count[{name!r}] ({spec})")


# ----------------------------------------------------------------------------------------
# The generator
# ----------------------------------------------------------------------------------------

MAX_DEPTH = 3
MAX_LOGS = 6
_LEAVES = ["log", "log", "update"]


@st.composite
def programs(
    draw,
    vmap_safe: bool = False,
    loops: tuple[str, ...] = ("scan", "fori"),
    batched: bool = False,
    tags: tuple[str, ...] = (),
    shard_map: bool = False,
    extras: tuple[str, ...] = (),
):
    """A random program tree: at most MAX_LOGS Log nodes (a Seq may repeat a child, which
    then runs twice) and control flow nested at most MAX_DEPTH deep.

    With `vmap_safe`, predicates read only `z` and nothing logs the (unbatched) loop index,
    so every logged value is batched under `vmap`. `loops` may add "while". With `batched`,
    nothing logs the loop index either, but predicates may read `x` (batched under `vmap`)
    and a while loop may take one more trip depending on the state. With `tags`, every Log
    node carries a random subset of them. With `shard_map`, a ShardMap node may appear
    (not nested in another). `extras` (from EXTRAS) adds Stats, Instrument and Sow leaves,
    counted with the Log nodes.
    """
    budget = [MAX_LOGS]
    ons = ["z"] if vmap_safe else ["x", "z"]
    thresholds = st.sampled_from([-0.5, 0.0, 0.35, 0.7, 1.0])
    control = ["seq", *loops, "cond", "switch", "jit", "checkpoint"]
    inside = [False]  # drawing the body of a ShardMap

    def log_index():
        return False if vmap_safe or batched else draw(st.booleans())

    def extra(kind):
        stats = tuple(draw(st.lists(st.sampled_from(STATS), min_size=1, max_size=3, unique=True)))
        if kind == "stats":
            source = (draw(st.sampled_from("abc")), draw(st.integers(0, 2)))
            return Stats("S" if inside[0] else "s", source, stats)
        if kind == "instrument":
            return Instrument(stats, draw(st.booleans()), "S" if inside[0] else "")
        key = draw(st.sampled_from("HG" if inside[0] else "hg"))
        return Sow(key, draw(st.integers(0, 1)))

    def node(depth):
        kinds = _LEAVES + list(extras) + (control if depth < MAX_DEPTH else [])
        if shard_map and not inside[0] and depth < MAX_DEPTH:
            kinds = [*kinds, "shard_map"]
        kind = draw(st.sampled_from(kinds))
        if kind in EXTRAS:
            if budget[0] <= 0:
                return Update(draw(st.integers(0, 3)))
            budget[0] -= 1
            return extra(kind)
        if kind == "log" and budget[0] > 0:
            budget[0] -= 1
            names = "ABC" if inside[0] else "abc"
            keys = draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))
            items = tuple((k, draw(st.integers(0, 2))) for k in keys)
            if not tags:
                return Log(items)
            return Log(items, tuple(draw(st.lists(st.sampled_from(tags), unique=True))))
        if kind in ("log", "update"):
            return Update(draw(st.integers(0, 3)))
        if kind == "seq":
            children = []
            for _ in range(draw(st.integers(1, 3))):
                repeat = children and draw(st.integers(0, 3)) == 0
                children.append(children[-1] if repeat else node(depth + 1))
            return Seq(tuple(children))
        index_key = "N" if inside[0] else "n"
        if kind == "scan":
            return Scan(
                length=draw(st.integers(0, 4)),
                reverse=draw(st.booleans()),
                unroll=draw(st.sampled_from([1, 2])),
                log_index=log_index(),
                body=node(depth + 1),
                index_key=index_key,
            )
        if kind == "fori":
            lower = draw(st.integers(0, 2))
            upper = lower + draw(st.integers(0, 3))
            return Fori(lower, upper, log_index(), node(depth + 1), index_key)
        if kind == "shard_map":
            inside[0] = True
            try:
                return ShardMap(node(depth + 1), draw(st.booleans()))
            finally:
                inside[0] = False
        if kind == "while":
            trips = draw(st.integers(0, 3))
            if not batched:
                return While(trips, node(depth + 1))
            on = draw(st.sampled_from([None, "x", "z"]))
            return While(trips, node(depth + 1), on, draw(thresholds))
        if kind == "cond":
            on, t = draw(st.sampled_from(ons)), draw(thresholds)
            return Cond(on, t, node(depth + 1), node(depth + 1))
        if kind == "switch":
            on, t = draw(st.sampled_from(ons)), draw(thresholds)
            return Switch(on, t, tuple(node(depth + 1) for _ in range(3)))
        return (Jit if kind == "jit" else Checkpoint)(node(depth + 1))

    return Seq(tuple(node(0) for _ in range(draw(st.integers(1, 3)))))


_floats = st.floats(-2.0, 2.0, allow_nan=False, width=32)
x_shapes = st.sampled_from([(), (3,)])


@st.composite
def inputs(draw, shape, batch: int | None = None):
    full = shape if batch is None else (batch, *shape)
    size = int(np.prod(full))
    x = np.asarray(draw(st.lists(_floats, min_size=size, max_size=size)), np.float32)
    return x.reshape(full), np.float32(draw(_floats))


@st.composite
def cases(
    draw,
    vmap_safe=False,
    batch: int | None = None,
    loops=("scan", "fori"),
    shard_map=False,
    extras=(),
):
    root = draw(programs(vmap_safe=vmap_safe, loops=loops, shard_map=shard_map, extras=extras))
    x0, z0 = draw(inputs(draw(x_shapes), batch))
    return root, x0, z0


def oracle(root, x0, z0, planted: dict | None = None) -> Oracle:
    o = Oracle(root, x0, z0, planted)
    assume(not o.tie)
    return o


KINDS = ("stack", "collect", *_SIMPLE, "ema", "window", "fanout")


@st.composite
def reductions(draw, bounded: bool = True, fanout: bool = True, kind: str | None = None):
    """A reduction spec (see `make_reduction`) of `kind` (by default a random one). Without
    a static bound on the events (`bounded=False`: logs in while loops) every buffer gets a
    capacity."""
    if kind is None:
        kind = draw(st.sampled_from(KINDS if fanout else KINDS[:-1]))

    def capacity():
        return None if bounded and draw(st.booleans()) else draw(st.integers(1, 5))

    if kind == "stack":
        cap, keep = capacity(), draw(st.sampled_from(["first", "last"]))
        return ("stack",) if cap is None and keep == "first" else ("stack", cap, keep)
    if kind == "collect":
        cap = capacity()
        return ("collect",) if cap is None and draw(st.booleans()) else ("collect", cap)
    if kind == "ema":
        return ("ema", draw(st.sampled_from([0.5, 0.9, 0.0])))
    if kind == "window":
        inner = draw(st.sampled_from([*_SIMPLE, "ema"]))
        inner = ("ema", 0.5) if inner == "ema" else (inner,)
        return ("window", draw(st.integers(1, 3)), inner, capacity())
    if kind == "fanout":
        parts = draw(st.lists(reductions(bounded, fanout=False), min_size=2, max_size=2))
        return ("fanout", (("p", parts[0]), ("q", parts[1])))
    return (kind,)


def _bounded(root) -> bool:
    return all(n is not None for n in bounds(root).values())


@st.composite
def reduction_cases(draw, batch: int | None = None, shard_map: bool = False):
    """`(root, x0, z0, z_axis, spec, interval)`: a program that logs (while loops allowed,
    taking one more trip or not depending on the state), inputs (with `batch`, a batch of
    `x`, and `z` batched when `z_axis` is 0), a reduction spec and an interval.

    The kind of reduction is drawn first (hypothesis then spreads it evenly); half the
    programs run in an outer scan, for more events. With `batch`, some predicate reads the
    batched state and the lanes get spread-out inputs, so that predicates split them."""
    kind = draw(st.sampled_from(KINDS))
    root = draw(programs(loops=("scan", "fori", "while"), batched=True, shard_map=shard_map))
    assume(count_logs(root) > 0)
    root = draw(in_outer_scan(root))
    x0, z0 = draw(inputs(draw(x_shapes), batch))
    z_axis = None
    if batch is not None:
        sources = _predicate_sources(root)
        assume(sources)
        offsets = np.linspace(-1.0, 1.0, batch, dtype=np.float32)
        x0 = x0 + draw(st.sampled_from([0.5, 1.0])) * offsets.reshape(
            (-1,) + (1,) * len(x0[0].shape)
        )
        if "x" not in sources or draw(st.booleans()):
            z_axis, z0 = 0, z0 + draw(st.sampled_from([0.5, 1.0])) * offsets[::-1]
    spec = draw(reductions(bounded=_bounded(root), kind=kind))
    return root, x0, z0, z_axis, spec, draw(st.sampled_from([1, 2, 3]))


@st.composite
def in_outer_scan(draw, root):
    """`root`, or (half the time, for more events) `root` as the body of a scan."""
    if not draw(st.booleans()):
        return root
    return Seq((Scan(draw(st.integers(2, 4)), draw(st.booleans()), 1, False, root),))


def _predicate_sources(node) -> set[str]:
    """What the predicates of conds, switches and state-dependent while loops read."""
    out = {node.on} if isinstance(node, Cond | Switch | While) and node.on else set()
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        for child in value if isinstance(value, tuple) else [value]:
            if dataclasses.is_dataclass(child):
                out |= _predicate_sources(child)
    return out


TAGS = ("train", "debug", "eval")
_PATTERNS = ("a", "b", "c", "n", "[ab]", "[!a]", "?", "*", "b*", "x")


@st.composite
def policy_cases(draw):
    """`(root, x0, z0, config, policy_kwargs, spool_kwargs)`: a program whose logs carry
    random tags (half the time in an outer scan), a random `Config` (rules, call-site
    reductions, tag filters, interval, prefix, window), and how it is passed: each field to
    `Policy`, to `spool`, or to both (the `Policy` then gets a decoy that `spool`'s keyword
    must override)."""
    root = draw(programs(tags=TAGS))
    assume(count_logs(root) > 0)
    root = draw(in_outer_scan(root))
    x0, z0 = draw(inputs(draw(x_shapes)))
    subsets = st.lists(st.sampled_from(TAGS), unique=True).map(tuple)
    specs = reductions(fanout=False)
    patterns = draw(st.lists(st.sampled_from(_PATTERNS), unique=True, max_size=3))
    rules = tuple((p, draw(st.one_of(st.just("drop"), specs, specs))) for p in patterns)
    site = ()
    if draw(st.booleans()):
        site = tuple((k, draw(st.one_of(st.none(), specs))) for k in "abc")
    window = draw(st.one_of(st.none(), st.integers(1, 3)))
    config = Config(
        reduce=draw(reductions(fanout=window is None)),  # no Window of a Fanout
        interval=draw(st.sampled_from([1, 2, 3])),
        tags=draw(st.one_of(st.none(), st.none(), subsets)),
        exclude=draw(subsets),
        rules=rules,
        prefix=draw(st.sampled_from(["", "run/", "p_"])),
        site=site,
        window=window,
    )
    decoys = dict(
        reduce="count", interval=4, tags=("eval",), exclude=TAGS, prefix="decoy/", window=5
    )
    policy_kw = {"rules": {p: r if r == "drop" else make_reduction(r) for p, r in rules}}
    spool_kw = {}
    for field, decoy in decoys.items():
        value = getattr(config, field)
        if field == "reduce":
            value = make_reduction(value)
        elif field in ("tags", "exclude") and value is not None and len(value) == 1:
            value = value[0] if draw(st.booleans()) else value  # a single tag as a string
        where = draw(st.sampled_from(["policy", "spool", "both"]))
        if where == "both" and value is None:
            where = "policy"  # spool(tags=None) keeps the policy's tags (window too)
        if where in ("spool", "both"):
            spool_kw[field] = value
        if where == "policy":
            policy_kw[field] = value
        elif where == "both":
            policy_kw[field] = decoy
    return root, x0, z0, config, policy_kw, spool_kw


# The oracles' budgets, from one setting. Each test's `budget(n)` below is its full budget of n
# programs; a run spends the share EQX_LOGS_ORACLE_SHARE of it (a fraction, default 1: the
# full budget; at least one program each). Derandomized (the same programs on every run, no
# database) unless EQX_LOGS_ORACLE_EXPLORE=1: then new programs on every run, and the failing
# ones kept in .hypothesis/ and replayed first. `make test` spends a share of the budget,
# `make test-oracles` (run by CI too) the full budget, exploring (see the Makefile).
ORACLE_SHARE = float(os.environ.get("EQX_LOGS_ORACLE_SHARE", "1"))
ORACLE_EXPLORE = os.environ.get("EQX_LOGS_ORACLE_EXPLORE", "0") not in ("", "0")
if not ORACLE_SHARE > 0:
    raise ValueError(f"EQX_LOGS_ORACLE_SHARE={ORACLE_SHARE}: must be a positive fraction")
SETTINGS = dict(
    deadline=None,
    derandomize=not ORACLE_EXPLORE,
    database=(
        DirectoryBasedExampleDatabase(
            Path(__file__).resolve().parents[1] / ".hypothesis" / "oracles"
        )
        if ORACLE_EXPLORE
        else None
    ),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def budget(full: int) -> settings:
    """Hypothesis settings for a test whose full budget is `full` programs: the run's share."""
    return settings(max_examples=max(1, math.ceil(full * ORACLE_SHARE)), **SETTINGS)


# ----------------------------------------------------------------------------------------
# The oracle itself, against hand-written expectations
# ----------------------------------------------------------------------------------------

NAN = np.nan


def test_oracle_reverse_scan_and_index():
    """A reverse scan: events in execution order; the int32 index runs backwards."""
    root = Seq((Scan(3, True, 1, True, Log((("a", 0), ("b", 1)))),))
    o = Oracle(root, np.float32(1.0), 0.0)
    values, counts = o.expected()
    np.testing.assert_array_equal(values["n"], np.array([2, 1, 0], np.int32))
    np.testing.assert_array_equal(values["a"], np.array([1.0, 1.0, 1.0], np.float32))
    np.testing.assert_allclose(values["b"], np.full(3, np.sin(1.0), np.float32), rtol=1e-6)
    assert counts == {"n": 3, "a": 3, "b": 3}
    assert_close(o.out[0], 1.0 + 0.05 * 1.5)


def test_oracle_cond_padding():
    """Branches logging different keys: the bound is the max over branches, the rest NaN."""
    root = Seq(
        (
            Log((("a", 0),)),
            Cond("z", 0.0, Log((("b", 0),)), Seq((Update(1), Log((("a", 1),)), Log((("a", 0),))))),
        )
    )
    taken = Oracle(root, np.array([1.0, 2.0, 3.0], np.float32), 1.0)
    values, counts = taken.expected()
    want_a = np.array([[1, 2, 3], [NAN] * 3, [NAN] * 3], np.float32)
    np.testing.assert_array_equal(values["a"], want_a)
    np.testing.assert_array_equal(values["b"], np.array([6.0], np.float32))
    assert counts == {"a": 1, "b": 1}

    untaken = Oracle(root, np.array([1.0, 2.0, 3.0], np.float32), -1.0)
    values, counts = untaken.expected()
    x1 = np.array([0.7, 1.6, 2.5], np.float32)
    want_a = np.stack([np.array([1, 2, 3], np.float32), 2 * x1 - 1, x1])
    np.testing.assert_allclose(values["a"], want_a, rtol=1e-6)
    np.testing.assert_array_equal(values["b"], np.array([NAN], np.float32))
    assert counts == {"a": 3, "b": 0}


def test_oracle_switch_fori_and_empty_scan():
    """Switch picks by thresholds; fori bounds multiply; a length-0 scan gives an empty key."""
    branches = (Log((("c", 0),)), Log((("c", 1),)), Seq((Log((("c", 0),)), Log((("c", 1),)))))
    root = Seq(
        (
            Fori(1, 4, True, Switch("z", 0.0, branches)),
            Scan(0, False, 2, True, Log((("b", 0),))),
        )
    )
    o = Oracle(root, np.array([1.0, -1.0, 2.0], np.float32), 0.2)  # index 1 each time
    values, counts = o.expected()
    np.testing.assert_array_equal(values["n"], np.array([1, 2, 3], np.int32))
    want_c = np.array([[-1.0, 2 / 3]] * 3 + [[NAN, NAN]] * 3, np.float32)
    np.testing.assert_allclose(values["c"], want_c, rtol=1e-6)
    assert values["b"].shape == (0,) and values["b"].dtype == np.float32
    assert counts == {"n": 3, "c": 3, "b": 0}
    assert o.bounds == {"n": 3, "c": 6, "b": 0}


def test_oracle_flags_ties():
    """A predicate within _TIE of its threshold is flagged, so the case is discarded."""
    root = Cond("x", 1.0, Log((("a", 0),)), Update(0))
    assert Oracle(root, np.float32(0.5), 0.5).tie
    assert not Oracle(root, np.float32(0.5), 0.6).tie


def test_reference_reductions():
    """The numpy references of the reductions, against hand-written values."""
    events = [np.float32(v) for v in (1.0, 3.0, 2.0, 6.0, 4.0)]

    def ref(spec, bound=6, evs=events, shape=(), dtype=np.float32):
        return reference(spec, evs, bound, shape, dtype)

    for spec, want in [
        (("mean",), 3.2),
        (("sum",), 16.0),
        (("var",), 2.96),  # population variance
        (("std",), np.sqrt(2.96)),
        (("first",), 1.0),
        (("last",), 4.0),
        (("min",), 1.0),
        (("max",), 6.0),
        (("ema", 0.5), 3.96875 / 0.96875),  # bias-corrected
        (("ema", 0.0), 4.0),
        (("stack",), [1, 3, 2, 6, 4, NAN]),
        (("stack", 3, "first"), [1, 3, 2]),
        (("stack", 3, "last"), [2, 6, 4]),  # oldest first
        (("stack", 7, "last"), [1, 3, 2, 6, 4, NAN, NAN]),
        (("window", 2, ("sum",), None), [4, 8, 4]),  # a trailing partial window
        (("window", 2, ("mean",), 2), [2, 4]),
        (("window", 3, ("max",), None), [3, 6]),
    ]:
        got = ref(spec)
        assert got.dtype == np.float32, spec
        np.testing.assert_allclose(got, np.array(want, np.float32), rtol=1e-6, err_msg=str(spec))
    assert ref(("count",)).dtype == np.int32 and ref(("count",)) == 5
    window = ref(("window", 2, ("count",), None), bound=8)
    np.testing.assert_array_equal(window, np.array([2, 2, 1, 0], np.int32))  # ints pad with 0
    fan = ref(("fanout", (("p", ("min",)), ("q", ("stack", 1, "last")))))
    np.testing.assert_array_equal(fan["p"], 1.0)
    np.testing.assert_array_equal(fan["q"], [4.0])
    pairs = [np.array([1, 2], np.float32), np.array([3, 4], np.float32)]
    got = ref(("collect",), bound=3, evs=pairs, shape=(2,))
    np.testing.assert_array_equal(got, np.array([1, 2, 3, 4, NAN, NAN], np.float32))
    # no events: NaN (floats) or 0 (ints), sum 0, count 0
    for spec, dtype, want, want_dtype in [
        (("mean",), np.float32, NAN, np.float32),
        (("mean",), np.int32, NAN, np.float32),
        (("std",), np.int32, NAN, np.float32),
        (("ema", 0.5), np.int32, NAN, np.float32),
        (("min",), np.float32, NAN, np.float32),
        (("max",), np.int32, 0, np.int32),
        (("last",), np.int32, 0, np.int32),
        (("sum",), np.int32, 0, np.int32),
        (("count",), np.float32, 0, np.int32),
    ]:
        got = reference(spec, [], 0, (), dtype)
        assert got.dtype == want_dtype, (spec, dtype)
        np.testing.assert_array_equal(got, want, err_msg=str(spec))
    assert reference(("window", 2, ("mean",), None), [], 0, (3,), np.float32).shape == (0, 3)


def test_config_reduction_and_selection():
    """The test's model of Policy: the first matching rule wins, then the call site's
    reduction, then the default; `window` wraps all but "drop"; tags and exclude."""
    config = Config(
        reduce=("mean",),
        rules=(("b*", "drop"), ("[ab]", ("max",)), ("*", ("sum",))),
        site=(("a", ("min",)), ("c", ("last",))),
    )
    assert config.reduction("a") == ("max",)
    assert config.reduction("b") == "drop"
    assert config.reduction("c") == ("sum",)
    assert Config(reduce=("mean",), site=(("a", ("min",)),)).reduction("a") == ("min",)
    assert Config(reduce=("mean",), site=(("a", None),)).reduction("a") == ("mean",)
    windowed = Config(reduce=("mean",), window=2, rules=(("b", "drop"),))
    assert windowed.reduction("a") == ("window", 2, ("mean",), None)
    assert windowed.reduction("b") == "drop"
    config = Config(tags=("train", "eval"), exclude=("debug",))
    assert config.selects(("train",)) and config.selects(("eval", "x"))
    assert not config.selects(()) and not config.selects(("train", "debug"))
    assert Config().selects(()) and not Config(tags=()).selects(("train",))


# ----------------------------------------------------------------------------------------
# Differential tests
# ----------------------------------------------------------------------------------------


@budget(300)
@given(cases(shard_map=True))
def test_spool_matches_oracle(case):
    """spool(f) records exactly the oracle's events, padded to the static bound (a shard_map's
    over its one device, merged `across` it)."""
    root, x0, z0 = case
    o = oracle(root, x0, z0)
    (x, z), logs = eqx_logs.spool(as_function(root), across="dev")(x0, z0)
    assert_close(x, o.out[0], "x")
    assert_close(z, o.out[1], "z")
    assert_logs(logs, *o.expected())


@budget(80)
@given(cases(shard_map=True))
def test_jit_of_spool_matches_oracle(case):
    """f alone, then spool(f), then jax.jit(spool(f)): inner jits traced without logs are
    re-traced inside the spool, and cached traces are reused without losing events."""
    root, x0, z0 = case
    o = oracle(root, x0, z0)
    f = as_function(root)
    x, z = f(x0, z0)  # outside any spool: logs do nothing
    assert_close(x, o.out[0], "x")
    assert_close(z, o.out[1], "z")
    for spooled in (eqx_logs.spool(f, across="dev"), jax.jit(eqx_logs.spool(f, across="dev"))):
        (x, z), logs = spooled(x0, z0)
        assert_close(x, o.out[0], "x")
        assert_close(z, o.out[1], "z")
        assert_logs(logs, *o.expected())


@budget(80)
@given(cases(shard_map=True))
def test_spool_of_grad_matches_oracle(case):
    """spool(value_and_grad(f)): forward events once, with primal values; grads unchanged."""
    root, x0, z0 = case
    o = oracle(root, x0, z0)
    f = as_function(root)

    def scalar(x, z):
        x, z = f(x, z)
        return jnp.sum(x) + z

    value_and_grad = jax.value_and_grad(scalar, argnums=(0, 1))
    (value, grads), logs = eqx_logs.spool(value_and_grad, across="dev")(x0, z0)
    assert_close(value, np.sum(o.out[0]) + o.out[1], "value")
    want_grads = jax.grad(scalar, argnums=(0, 1))(x0, z0)  # outside any spool
    assert_close(grads[0], want_grads[0], "dx")
    assert_close(grads[1], want_grads[1], "dz")
    assert_logs(logs, *o.expected())


BATCH = 2


@budget(80)
@given(cases(vmap_safe=True, batch=BATCH, shard_map=True))
def test_vmap_matches_oracle_per_lane(case):
    """spool(vmap(f)) stacks lanes on axis 1, vmap(spool(f)) on axis 0."""
    root, xs, z0 = case
    lanes = [oracle(root, x, z0) for x in xs]
    expected = [o.expected() for o in lanes]
    keys = expected[0][0]
    counts = {k: np.array([e[1][k] for e in expected]) for k in keys}
    want_x = np.stack([o.out[0] for o in lanes])
    want_z = np.stack([o.out[1] for o in lanes])
    f = as_function(root)

    (x, z), logs = eqx_logs.spool(jax.vmap(f, in_axes=(0, None)), across="dev")(xs, z0)
    assert_close(x, want_x, "x")
    assert_close(z, want_z, "z")
    assert_logs(logs, {k: np.stack([e[0][k] for e in expected], axis=1) for k in keys}, counts)

    (x, z), logs = jax.vmap(eqx_logs.spool(f, across="dev"), in_axes=(0, None))(xs, z0)
    assert_close(x, want_x, "x")
    assert_close(z, want_z, "z")
    assert_logs(logs, {k: np.stack([e[0][k] for e in expected], axis=0) for k in keys}, counts)


@budget(25)
@given(programs(), x_shapes, st.integers(0, 3))
def test_logs_in_while_loop_raise(root, shape, trips):
    """A log inside a while_loop has no static bound: the default stack raises, naming it."""
    assume(count_logs(root) > 0)
    f = as_function(While(trips, root))
    with pytest.raises(ValueError, match="while_loop"):
        eqx_logs.spool(f)(np.zeros(shape, np.float32), np.float32(0.0))


@budget(60)
@given(
    cases(loops=("scan", "fori", "while")), st.integers(1, 5), st.sampled_from(["first", "last"])
)
def test_capacity_stack_matches_oracle(case, capacity, keep):
    """reduce=Stack(capacity, keep), while loops allowed: the first (or last) `capacity`
    events of each key, oldest first; logs.count counts every event."""
    root, x0, z0 = case
    o = oracle(root, x0, z0)
    reduce = eqx_logs.Stack(capacity=capacity, keep=keep)
    (x, z), logs = eqx_logs.spool(as_function(root), reduce=reduce)(x0, z0)
    assert_close(x, o.out[0], "x")
    assert_close(z, o.out[1], "z")
    assert_logs(logs, *o.expected(capacity, keep))


@budget(100)
@given(reduction_cases(shard_map=True))
def test_reductions_match_oracle(case):
    """spool(f, reduce=..., interval=k) for every reduction (by name, EMA, Stack with a
    capacity, Collect, Window, Fanout) against numpy applied to the oracle's events; while
    loops too (buffers then get a capacity). A shard_map's keys are merged `across` its one
    device with the reduction's `merge`."""
    root, x0, z0, _, spec, interval = case
    o = oracle(root, x0, z0)
    config = Config(reduce=spec, interval=interval)
    f = as_function(root)
    reduce = make_reduction(spec)
    (x, z), logs = eqx_logs.spool(f, reduce=reduce, interval=interval, across="dev")(x0, z0)
    assert_close(x, o.out[0], "x")
    assert_close(z, o.out[1], "z")
    assert_reduced(logs, expected_reduced(o, config))


@budget(80)
@given(policy_cases())
def test_policy_matches_oracle(case):
    """A random Policy (rules with "drop", call-site reductions, tags and exclude against
    tagged logs, interval, prefix), its fields split between Policy and spool's keywords."""
    root, x0, z0, config, policy_kw, spool_kw = case
    o = oracle(root, x0, z0)
    site = {k: None if r is None else make_reduction(r) for k, r in config.site}
    f = as_function(root, site if config.site else None)
    policy = eqx_logs.Policy(**policy_kw)
    (x, z), logs = eqx_logs.spool(f, policy=policy, **spool_kw)(x0, z0)
    assert_close(x, o.out[0], "x")
    assert_close(z, o.out[1], "z")
    assert_reduced(logs, expected_reduced(o, config))


LANES = 3


@budget(50)
@given(reduction_cases(batch=LANES))
def test_batched_predicates_match_oracle_per_lane(case):
    """Conds, switches and while loops whose predicates read the batched state: under
    spool(vmap(f)) each lane counts only its own events (untaken branches and finished
    while lanes add nothing), equal to the oracle run per lane and to vmap(spool(f))."""
    root, xs, z0, z_axis, spec, interval = case
    zs = z0 if z_axis == 0 else [z0] * LANES
    lanes = [oracle(root, x, z) for x, z in zip(xs, zs)]
    config = Config(reduce=spec, interval=interval)
    expected = [expected_reduced(o, config) for o in lanes]
    want_x = np.stack([o.out[0] for o in lanes])
    want_z = np.stack([o.out[1] for o in lanes])
    f, reduce = as_function(root), make_reduction(spec)
    transforms = (
        (True, eqx_logs.spool(jax.vmap(f, (0, z_axis)), reduce=reduce, interval=interval)),
        (False, jax.vmap(eqx_logs.spool(f, reduce=reduce, interval=interval), (0, z_axis))),
    )
    for event_first, transformed in transforms:
        (x, z), logs = transformed(xs, z0)
        assert_close(x, want_x, "x")
        assert_close(np.broadcast_to(z, want_z.shape), want_z, "z")
        assert_reduced(logs, combine_lanes(expected, event_first))


# ----------------------------------------------------------------------------------------
# Statistics (log_stats, instrument), sow and plant in the random programs
# ----------------------------------------------------------------------------------------


def assert_events(logs, values: dict, counts: dict, keys=None, lane: int | None = None) -> None:
    """`assert_logs` for the keys of `logs` that `keys` selects (by default all), or for one
    `lane` of a vmapped spool's, with a float32 tolerance for statistics (`std` from sums of
    squares loses digits; numpy and XLA round the values themselves differently)."""
    got_keys = {k for k in logs if keys is None or keys(k)}
    assert got_keys == set(values), f"keys {sorted(got_keys)} != expected {sorted(values)}"
    for key, want in values.items():
        got, got_count = np.asarray(logs[key]), np.asarray(logs.count[key])
        if lane is not None:
            got, got_count = got[lane], got_count[lane]
        assert got.shape == want.shape, f"{key!r}: shape {got.shape} != {want.shape}"
        assert got.dtype == want.dtype, f"{key!r}: dtype {got.dtype} != {want.dtype}"
        rtol, atol = RTOL, ATOL
        if _is_stat(key):
            rtol, atol = 1e-4, 1e-5 * (1.0 + float(np.nanmax(np.abs(want), initial=0.0)))
        np.testing.assert_allclose(
            got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"logs[{key!r}]"
        )
        want_count = np.asarray(counts[key])
        np.testing.assert_array_equal(
            np.broadcast_to(got_count, want_count.shape), want_count, err_msg=f"count[{key!r}]"
        )


def over_batch(lanes: list[Oracle]) -> tuple[dict, dict]:
    """`(values, counts)` as `spool(vmap(f))` returns them for lanes that log the same keys
    in the same order (predicates unbatched): a statistic is one value per event, over all
    lanes together; other keys are stacked per lane on axis 1."""
    expected = [o.expected() for o in lanes]
    values, counts = {}, {}
    for key, bound in lanes[0].bounds.items():
        counts[key] = np.array([e[1][key] for e in expected])
        if not _is_stat(key):
            values[key] = np.stack([e[0][key] for e in expected], axis=1)
            continue
        per_lane = [o.raw.get(key, []) for o in lanes]
        assert len({len(r) for r in per_lane}) == 1, f"{key!r}: lanes disagree"
        stat = key.rsplit("/", 1)[1]
        events = [statistic(stat, np.stack(batch)) for batch in zip(*per_lane)]
        values[key] = padded(events, bound, (), _key_dtype(key))
    return values, counts


def over_taking_lanes(lanes: list[Oracle]) -> tuple[dict, dict]:
    """`(values, counts)` as `spool(vmap(f))` returns them where predicates read the batched
    state (lanes may take different branches and loop trips): every key per lane on axis 1;
    a statistic's event, in each lane that has it, the statistic over the lanes that have
    an event of that key at the same place (`Oracle.where`): those that take the branch or
    run the trip, as the masked event of the batch is."""
    values, counts = {}, {}
    for key, bound in lanes[0].bounds.items():
        events = [o.events.get(key, []) for o in lanes]
        counts[key] = np.array([len(e) for e in events])
        if _is_stat(key):
            stat, batch = key.rsplit("/", 1)[1], {}
            for o in lanes:
                for place, raw in zip(o.where.get(key, []), o.raw.get(key, [])):
                    batch.setdefault(place, []).append(raw)
            events = [
                [statistic(stat, np.stack(batch[place])) for place in o.where.get(key, [])]
                for o in lanes
            ]
        shape, dtype = _key_shape(key, lanes[0].x_shape), _key_dtype(key)
        values[key] = np.stack([padded(e, bound, shape, dtype) for e in events], axis=1)
    return values, counts


def assert_lanes(logs, values: dict, counts: dict) -> None:
    """`assert_events` for `over_taking_lanes`: a statistic no batched predicate reaches has
    one value per event for all lanes (equal in every lane: compared with each)."""
    assert set(logs) == set(values), f"keys {sorted(logs)} != expected {sorted(values)}"
    for key, want in values.items():
        got = np.asarray(logs[key])
        if _is_stat(key) and got.ndim == 1:
            got = np.broadcast_to(got[:, None], want.shape)
        assert got.shape == want.shape, f"{key!r}: shape {got.shape} != {want.shape}"
        assert got.dtype == want.dtype, f"{key!r}: dtype {got.dtype} != {want.dtype}"
        rtol, atol = RTOL, ATOL
        if _is_stat(key):  # (as in `assert_events`)
            rtol, atol = 1e-4, 1e-5 * (1.0 + float(np.nanmax(np.abs(want), initial=0.0)))
        np.testing.assert_allclose(
            got, want, rtol=rtol, atol=atol, equal_nan=True, err_msg=f"logs[{key!r}]"
        )
        got_count = np.broadcast_to(np.asarray(logs.count[key]), counts[key].shape)
        np.testing.assert_array_equal(got_count, counts[key], err_msg=f"count[{key!r}]")


class _Selected(dict):
    """Some keys of a LogDict, with its counts (for `assert_lanes`)."""

    def __init__(self, values: dict, count: Any):
        super().__init__(values)
        self.count = count


def _scalar(f):
    def scalar(x, z):
        x, z = f(x, z)
        return jnp.sum(x) + z

    return scalar


def _has_extras(case) -> bool:
    return count_logs(case[0], (Stats, Instrument, Sow)) > 0


@budget(12)
@given(cases(shard_map=True, extras=EXTRAS).filter(_has_extras))
def test_statistics_and_sow_match_oracle(case):
    """Programs with log_stats, instrument and sow (no plant: sow logs and returns its
    value): spool(f) and jax.jit(spool(f)) record the oracle's events, each statistic over
    all of its value."""
    root, x0, z0 = case
    o = oracle(root, x0, z0)
    f = as_function(root)
    for spooled in (eqx_logs.spool(f, across="dev"), jax.jit(eqx_logs.spool(f, across="dev"))):
        (x, z), logs = spooled(x0, z0)
        assert_close(x, o.out[0], "x")
        assert_close(z, o.out[1], "z")
        assert_events(logs, *o.expected())


@budget(10)
@given(cases(shard_map=True, extras=EXTRAS).filter(_has_extras))
def test_statistics_and_sow_under_grad_match_oracle(case):
    """spool(value_and_grad(f)): the forward events once, equal to spool(f)'s (the oracle's);
    gradients unchanged; an instrument with `grads` logs each cotangent statistic once per
    forward call."""
    root, x0, z0 = case
    o = oracle(root, x0, z0)
    scalar = _scalar(as_function(root))
    value_and_grad = jax.value_and_grad(scalar, argnums=(0, 1))
    (value, grads), logs = eqx_logs.spool(value_and_grad, across="dev")(x0, z0)
    assert_close(value, np.sum(o.out[0]) + o.out[1], "value")
    want_grads = jax.jit(jax.grad(scalar, argnums=(0, 1)))(x0, z0)  # outside any spool
    assert_close(grads[0], want_grads[0], "dx")
    assert_close(grads[1], want_grads[1], "dz")
    assert_events(logs, *o.expected(), keys=lambda k: "/grad/" not in k)
    backward = {k: int(np.asarray(logs.count[k])) for k in logs if "/grad/" in k}
    assert backward == {k: o.backward.get(k, 0) for k in backward_keys(root)}


@st.composite
def extra_vmap_cases(draw):
    """`(root, xs, z0, batched)`: a program with statistics and sows and a batch of `x`;
    with `batched`, predicates may read the batched state, and the lanes get spread-out
    inputs, so that predicates split them."""
    batched = draw(st.booleans())
    programs_ = programs(vmap_safe=not batched, batched=batched, shard_map=True, extras=EXTRAS)
    root = draw(programs_.filter(lambda r: _has_extras((r,))))
    xs, z0 = draw(inputs(draw(x_shapes), BATCH))
    if batched:
        assume("x" in _predicate_sources(root))
        offsets = np.linspace(-1.0, 1.0, BATCH, dtype=np.float32)
        spread = draw(st.sampled_from([0.5, 1.0])) * offsets
        xs = xs + spread.reshape((-1,) + (1,) * (xs.ndim - 1))
    return root, xs, z0, batched


@budget(10)
@given(extra_vmap_cases())
def test_statistics_and_sow_under_vmap(case):
    """vmap(spool(f))(xs)[i] == spool(f)(xs[i]) == the oracle on xs[i]: statistics per lane
    (a vmap outside the spool is a batch of runs), also where predicates read the batched
    state. spool(vmap(f)), predicates unbatched: a statistic over the whole batch, one value
    per event (a vmap inside the spool is the model's batch); other keys per lane. Where
    predicates read the batched state: each lane's events, a statistic over the lanes that
    take the same branch or loop trip (`over_taking_lanes`)."""
    root, xs, z0, batched = case
    lanes = [oracle(root, x, z0) for x in xs]
    want_x = np.stack([o.out[0] for o in lanes])
    want_z = np.stack([o.out[1] for o in lanes])
    f = as_function(root)
    spooled = eqx_logs.spool(f, across="dev")
    (x, z), logs = jax.vmap(spooled, in_axes=(0, None))(xs, z0)
    assert_close(x, want_x, "x")
    assert_close(z, want_z, "z")
    for i, o in enumerate(lanes):
        assert_events(logs, *o.expected(), lane=i)
    if batched:  # and literally, for one lane
        _, alone = spooled(xs[-1], z0)
        assert_events(logs, {k: np.asarray(alone[k]) for k in alone}, alone.count, lane=-1)
    (x, z), logs = eqx_logs.spool(jax.vmap(f, in_axes=(0, None)), across="dev")(xs, z0)
    assert_close(x, want_x, "x")
    assert_close(z, want_z, "z")
    if not batched:
        assert_events(logs, *over_batch(lanes))
        return
    assert_lanes(logs, *over_taking_lanes(lanes))

    # under grad: the forward events as without it; each lane's backward statistics once per
    # forward call it made (JAX transposes the instrument's custom_vjp after the vmap batched
    # the conds around it)
    def scalar(xs, z):
        x, z = jax.vmap(f, in_axes=(0, None))(xs, z)
        return jnp.sum(x) + jnp.sum(z)

    grads, logs = eqx_logs.spool(jax.grad(scalar, argnums=(0, 1)), across="dev")(xs, z0)
    want_grads = jax.jit(jax.grad(scalar, argnums=(0, 1)))(xs, z0)  # outside any spool
    assert_close(grads[0], want_grads[0], "dx")
    assert_close(grads[1], want_grads[1], "dz")
    forward = {k: v for k, v in logs.items() if "/grad/" not in k}
    values, counts = over_taking_lanes(lanes)
    assert_lanes(_Selected(forward, logs.count), values, counts)
    for key in backward_keys(root):
        want = [o.backward.get(key, 0) for o in lanes]
        got = np.broadcast_to(np.asarray(logs.count[key]), (len(lanes),)) if key in logs else 0
        np.testing.assert_array_equal(got, want, err_msg=f"count[{key!r}]")


@st.composite
def plant_cases(draw):
    """`(root, x0, z0, planted, transform)`: a program that sows, values to plant for some
    of its sown keys (of the sown shape, or one row per event: as many rows as the static
    bound, or one more), and the transform to check ("plant": plant(f) alone; "vmap": with
    a batch of `x`). Rows inside a ShardMap are left out (upper-case keys): its values do
    not vary over the mesh, where planting rows is an error
    (`test_plant_rows_inside_a_shard_map`)."""
    root = draw(programs(shard_map=True, extras=EXTRAS))
    sown = {k: n for k, n in bounds(root).items() if k.lower() in ("h", "g")}
    assume(sown)
    transform = draw(st.sampled_from(["plant", "spool", "jit", "grad", "vmap"]))
    x0, z0 = draw(inputs(draw(x_shapes), BATCH if transform == "vmap" else None))
    x_shape = x0.shape[1:] if transform == "vmap" else x0.shape
    planted = {}
    for key, bound in sorted(sown.items()):
        form = draw(
            st.sampled_from(["none", "same", "rows"] if key.islower() else ["none", "same"])
        )
        if form == "none":
            continue
        shape = _key_shape(key, x_shape)
        if form == "rows":
            shape = (bound + draw(st.integers(0, 1)), *shape)
        size = math.prod(shape)
        flat = draw(st.lists(_floats, min_size=size, max_size=size))
        planted[key] = np.asarray(flat, np.float32).reshape(shape)
    return root, x0, z0, planted, transform


@budget(15)
@given(plant_cases())
def test_plant_matches_oracle(case):
    """plant(f, values) against the oracle substituting by hand: the planted values replace
    the sown ones (the same value at every event, or row i at the i-th event), downstream
    (outside any spool) and in what spool(plant(f, values)) records; under jax.jit, under
    value_and_grad (the forward events once; gradients those of plant(f) outside a spool)
    and per lane under vmap(spool(plant(f)))."""
    root, x0, z0, planted, transform = case
    xs = x0 if transform == "vmap" else x0[None]
    lanes = [oracle(root, x, z0, planted) for x in xs]
    f = eqx_logs.plant(as_function(root), planted)
    if transform == "plant":
        x, z = f(x0, z0)  # outside any spool
        assert_close(x, lanes[0].out[0], "x")
        assert_close(z, lanes[0].out[1], "z")
        return
    spooled = eqx_logs.spool(f, across="dev")
    if transform == "vmap":
        (x, z), logs = jax.vmap(spooled, in_axes=(0, None))(xs, z0)
        assert_close(x, np.stack([o.out[0] for o in lanes]), "x")
        for i, o in enumerate(lanes):
            assert_events(logs, *o.expected(), lane=i)
        return
    o = lanes[0]
    if transform == "grad":
        scalar = _scalar(f)
        value_and_grad = jax.value_and_grad(scalar, argnums=(0, 1))
        (value, grads), logs = eqx_logs.spool(value_and_grad, across="dev")(x0, z0)
        assert_close(value, np.sum(o.out[0]) + o.out[1], "value")
        want_grads = jax.jit(jax.grad(scalar, argnums=(0, 1)))(x0, z0)  # outside any spool
        assert_close(grads[0], want_grads[0], "dx")
        assert_close(grads[1], want_grads[1], "dz")
        assert_events(logs, *o.expected(), keys=lambda k: "/grad/" not in k)
        return
    (x, z), logs = (jax.jit(spooled) if transform == "jit" else spooled)(x0, z0)
    assert_close(x, o.out[0], "x")
    assert_close(z, o.out[1], "z")
    assert_events(logs, *o.expected())


# ----------------------------------------------------------------------------------------
# Regressions found by the generator (shrunk by hand)
# ----------------------------------------------------------------------------------------


def _invariant_log(x):
    def body(c, _):
        eqx_logs.log("a", x)  # reads a loop-invariant value
        return jnp.sin(c), None

    return lax.scan(body, x, None, length=3)[0]


def _invariant_inner_xs(x):
    def inner(c, i):
        eqx_logs.log("a", i.astype(jnp.float32))  # the same xs on every outer iteration
        return jnp.sin(c), None

    return lax.scan(lambda c, _: (lax.scan(inner, c, jnp.arange(2))[0], None), x, None, 2)[0]


def _invariant_carry_zero_trips(x):
    return lax.fori_loop(0, 0, lambda i, c: (eqx_logs.log("a", c), c)[1], x)


def _invariant_predicate(x):
    def body(c, _):
        lax.cond(x > 0, lambda: eqx_logs.log("a", c), lambda: None)  # loop-invariant predicate
        return jnp.sin(c), None

    return lax.scan(body, x, None, length=2)[0]


def _invariant_carry_in_checkpoint(x):
    def body(c, _):
        eqx_logs.log("a", c)  # the carry never changes
        return c, None

    inner = jax.checkpoint(lambda c: lax.scan(body, c, None, length=2)[0])
    return lax.scan(lambda c, _: (inner(c), None), x, None, length=2)[0]


@pytest.mark.parametrize(
    "fn, want",
    [
        (_invariant_log, [1.0, 1.0, 1.0]),
        (_invariant_inner_xs, [0.0, 1.0, 0.0, 1.0]),
        (_invariant_carry_zero_trips, []),
        (_invariant_predicate, [1.0, np.sin(np.float32(1.0))]),
        (_invariant_carry_in_checkpoint, [1.0] * 4),
    ],
)
def test_grad_keeps_loop_invariant_logs_in_the_loop(fn, want):
    """Under grad, logs in a loop fire once per iteration even where they read loop-invariant
    values (shrunk from failures of `test_spool_of_grad_matches_oracle`).

    JAX's `_scan_known_hoisting` (jax/_src/lax/control_flow/loops.py) evaluates equations
    whose inputs are loop-invariant once, outside the loop, effects included, and
    `_cond_partial_eval` drops a staged cond that has no outputs; on jax 0.10 a staged
    `closed_call` with no outputs is dropped too (the loop in a checkpoint).
    """
    want = np.array(want, np.float32)
    _, plain = eqx_logs.spool(fn)(jnp.float32(1.0))
    np.testing.assert_allclose(np.asarray(plain["a"]), want, rtol=1e-6)
    _, logs = eqx_logs.spool(jax.grad(fn))(jnp.float32(1.0))
    assert "a" in logs, "the key disappeared under grad"
    np.testing.assert_allclose(np.asarray(logs["a"]), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(logs.count["a"]), len(want))


# ----------------------------------------------------------------------------------------
# eqx_logs bugs found by the statistics and plant generators (strict xfails: they fail until
# the library is fixed; then remove the marker, and the generator's workaround named)
# ----------------------------------------------------------------------------------------


def _sown_in_shard_map(x, spec=P()):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dev",))
    return jax.shard_map(
        lambda x: eqx_logs.sow("h", 2 * x), mesh=mesh, in_specs=spec, out_specs=spec
    )(x)


def test_plant_rows_inside_a_shard_map():
    """A value sown inside a shard_map, planted (found by `test_plant_matches_oracle`): the
    same value for every event; one row per event, each device taking the row of its own
    events, for a value that varies over the mesh; for one that does not (it would vary),
    an error naming the key."""
    x = jnp.float32(1.0)
    assert_close(eqx_logs.plant(_sown_in_shard_map, {"h": jnp.float32(5.0)})(x), 5.0)
    rows = {"h": jnp.array([[5.0], [6.0]])}  # (events, the device's block)
    got = eqx_logs.plant(lambda x: _sown_in_shard_map(x, P("dev")), rows)(jnp.ones(1))
    assert_close(got, [5.0])
    with pytest.raises(ValueError, match=r"plant: 'h' is sown inside a shard_map .* vary"):
        eqx_logs.plant(_sown_in_shard_map, {"h": jnp.array([5.0])})(x)


def _sown_in_no_trip(x):
    return lax.scan(lambda c, _: (eqx_logs.sow("h", c), None), x, None, length=0)[0]


def test_plant_no_rows_for_a_key_sown_no_times():
    """spool(f)'s logs replay through plant (found by `test_plant_matches_oracle`)."""
    x = jnp.float32(1.0)
    _, logs = eqx_logs.spool(_sown_in_no_trip)(x)
    assert logs["h"].shape == (0,)
    assert_close(eqx_logs.plant(_sown_in_no_trip, logs)(x), 1.0)


def _stats_in_batched_cond(x):
    def taken():
        eqx_logs.log_stats("s", x, stats=("mean", "min"))

    lax.cond(jnp.sum(x) > 0, taken, lambda: None)
    return x


def test_statistics_in_a_batched_cond_are_over_the_lanes_that_take_it():
    """spool(vmap(f)): a statistic is over the whole batch, and an untaken branch changes
    nothing, so a statistic in a branch is over the lanes that take it (the programs of
    `test_statistics_and_sow_under_vmap` keep spool(vmap(f))'s predicates unbatched)."""
    xs = np.array([[1.0, 2.0], [-5.0, -7.0], [3.0, 4.0]], np.float32)
    _, logs = eqx_logs.spool(jax.vmap(_stats_in_batched_cond))(xs)
    np.testing.assert_array_equal(np.ravel(logs.count["s/mean"]), [1, 0, 1])
    taken = xs[[0, 2]]
    assert_close(np.ravel(logs["s/mean"])[[0, 2]], [taken.mean()] * 2, "mean")  # got -1/3
    assert_close(np.ravel(logs["s/min"])[[0, 2]], [taken.min()] * 2, "min")  # got -7


# ----------------------------------------------------------------------------------------
# eqx_logs bugs found by the reduction and batched-predicate generators (strict xfails: they
# fail until the library is fixed; then remove the marker, and the workaround named)
# ----------------------------------------------------------------------------------------


def _log_in_empty_scan(x):
    def body(c, _):
        eqx_logs.log("a", c)
        return c, None

    return lax.scan(body, x, None, length=0)[0]


@pytest.mark.parametrize(
    "reduce",
    [eqx_logs.Window(2, "mean"), eqx_logs.Fanout(w=eqx_logs.Window(1, "sum"), m="mean")],
    ids=["window", "fanout"],
)
def test_window_of_a_key_without_events(reduce):
    """ceil(0 / size) = 0 windows: shape (0,), count 0, as Stack and Collect give."""
    _, logs = eqx_logs.spool(_log_in_empty_scan, reduce=reduce)(jnp.float32(1.0))
    out = logs["a"]["w"] if isinstance(reduce, eqx_logs.Fanout) else logs["a"]
    assert out.shape == (0,)
    assert int(logs.count["a"]) == 0


def _log_in_both_branches(x):
    lax.cond(x > 0, lambda: eqx_logs.log("a", x), lambda: eqx_logs.log("a", -x))
    return x


@pytest.mark.parametrize("reduce", ["stack", "collect", eqx_logs.Window(1, "sum")])
def test_batched_cond_bound_is_max_over_branches(reduce):
    """One event per lane whichever branch runs: the static bound is 1, as without vmap (the
    branches' logs carry the cond they are in, `log_p`'s `branches`)."""
    xs = jnp.array([1.0, -2.0, 3.0])
    _, outer = jax.vmap(eqx_logs.spool(_log_in_both_branches, reduce=reduce))(xs)
    np.testing.assert_array_equal(outer["a"], [[1.0], [2.0], [3.0]])
    _, inner = eqx_logs.spool(jax.vmap(_log_in_both_branches), reduce=reduce)(xs)
    assert inner["a"].shape == (1, 3), inner["a"]
    np.testing.assert_array_equal(inner["a"], [[1.0, 2.0, 3.0]])


def _loop_and_nested_cond_in_branches(x):
    def scans():
        body = lambda c, i: (eqx_logs.log("a", x + i), (c, None))[1]  # noqa: E731
        lax.scan(body, 0.0, jnp.arange(3.0))

    def nested():
        eqx_logs.log("a", 10 * x)
        lax.cond(x > 2, lambda: eqx_logs.log("a", 20 * x), lambda: eqx_logs.log("a", -x))

    lax.cond(x > 0, nested, scans)  # 2 events or 3: the bound is 3
    return x


@pytest.mark.parametrize("reduce", ["stack", "collect"])
def test_batched_cond_bound_with_a_loop_and_a_nested_cond_in_its_branches(reduce):
    """A loop in one branch and a nested batched cond in the other: the bound is the maximum
    over the branches at each level (3), and the values are vmap(spool(f))'s."""
    xs = jnp.array([1.0, -2.0, 3.0])
    spooled = eqx_logs.spool(_loop_and_nested_cond_in_branches, reduce=reduce)
    _, outer = jax.vmap(spooled)(xs)
    _, inner = eqx_logs.spool(jax.vmap(_loop_and_nested_cond_in_branches), reduce=reduce)(xs)
    assert outer["a"].shape == (3, 3) and inner["a"].shape == (3, 3)
    np.testing.assert_array_equal(inner["a"], np.moveaxis(np.asarray(outer["a"]), 0, 1))
    np.testing.assert_array_equal(inner.count["a"], [2, 3, 2])
    np.testing.assert_array_equal(outer["a"][2, :2], [30.0, 60.0])


def _index_inside_and_outside_batched_cond(x):
    def step(c, i):
        eqx_logs.log("n", i)  # unbatched under vmap
        lax.cond(x > 0, lambda: eqx_logs.log("n", i), lambda: None)  # made batched by the mask
        return c, None

    return lax.scan(step, x, jnp.arange(2))[0]


def test_unbatched_value_inside_and_outside_a_batched_cond():
    """The loop index, unbatched under vmap, logged outside and inside a cond whose
    predicate is batched (its mask batches the second site): the key takes the batch, and
    the unbatched site's events are broadcast along it, as each lane of vmap(spool(f)) sees
    them."""
    xs = jnp.array([1.0, -2.0])
    _, outer = jax.vmap(eqx_logs.spool(_index_inside_and_outside_batched_cond))(xs)
    np.testing.assert_array_equal(outer["n"], [[0, 0, 1, 1], [0, 1, 0, 0]])
    np.testing.assert_array_equal(outer.count["n"], [4, 2])
    _, inner = eqx_logs.spool(jax.vmap(_index_inside_and_outside_batched_cond))(xs)
    np.testing.assert_array_equal(inner["n"], np.moveaxis(np.asarray(outer["n"]), 0, 1))
    np.testing.assert_array_equal(inner.count["n"], [4, 2])


def _index_inside_then_outside_batched_cond(x):
    def step(c, i):
        lax.cond(x > 0, lambda: eqx_logs.log("n", i, step=i), lambda: None)  # batched first
        eqx_logs.log("n", 10 * i, step=i)
        return c, None

    return lax.scan(step, x, jnp.arange(3))[0]


def _index_under_two_vmaps(x):
    def step(c, i):
        eqx_logs.log("n", i + c)  # unbatched: c is the scan's own carry
        lax.cond(x > 0, lambda: eqx_logs.log("n", i + 0.5), lambda: None)  # batched over both
        return c, None

    return lax.scan(step, jnp.float32(0.0), jnp.arange(2.0))[0]


@pytest.mark.parametrize("reduce", ["stack", "mean", "last", eqx_logs.Window(2, "sum")])
def test_sites_batched_over_fewer_vmap_axes_are_broadcast(reduce):
    """Either order of the sites, steps included, and over one of two vmaps: spool(vmap(f))
    gives each lane what vmap(spool(f)) does."""
    xs = jnp.array([1.0, -2.0, 3.0])
    spooled = eqx_logs.spool(_index_inside_then_outside_batched_cond, reduce=reduce)
    _, outer = jax.vmap(spooled)(xs)
    _, inner = eqx_logs.spool(jax.vmap(_index_inside_then_outside_batched_cond), reduce=reduce)(xs)
    moved = (lambda a: np.moveaxis(np.asarray(a), 0, 1)) if outer["n"].ndim > 1 else np.asarray
    np.testing.assert_array_equal(inner["n"], moved(outer["n"]))
    np.testing.assert_array_equal(inner.count["n"], outer.count["n"])
    if reduce == "stack":
        np.testing.assert_array_equal(outer.count["n"], [6, 3, 6])
        np.testing.assert_array_equal(inner.step["n"], moved(outer.step["n"]))
        np.testing.assert_array_equal(outer["n"][1, :3], [0, 10, 20])

    xs2 = jnp.array([[1.0, -1.0], [2.0, 3.0]])
    twice = jax.vmap(jax.vmap(eqx_logs.spool(_index_under_two_vmaps, reduce=reduce)))
    _, outer = twice(xs2)
    _, inner = eqx_logs.spool(jax.vmap(jax.vmap(_index_under_two_vmaps)), reduce=reduce)(xs2)
    if outer["n"].ndim > 2:  # events last in outer, first in inner
        want = np.moveaxis(np.asarray(outer["n"]), 2, 0)
    else:
        want = np.asarray(outer["n"])
    np.testing.assert_array_equal(inner["n"], want)
    np.testing.assert_array_equal(inner.count["n"], outer.count["n"])


def test_a_site_batched_over_some_of_the_keys_vmaps_is_refused():
    """Unnamed vmap axes cannot be told apart, so a site batched over the outer of two vmaps
    is not broadcast along a guessed axis: the shapes differ, an error names both sites."""

    def f(x, y):
        eqx_logs.log("n", y)  # batched over the outer vmap only
        lax.cond(x > 0, lambda: eqx_logs.log("n", y), lambda: None)  # over both
        return x

    g = jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(0, 0))
    with pytest.raises(ValueError, match=r"key 'n' is logged with shape \(2,\)"):
        eqx_logs.spool(g)(jnp.ones((2, 3)), jnp.ones(2))
