"""Random nested programs: `eqx_logs.spool` against an eager numpy reference oracle.

A program is a small tree over the state `(x, z)`: `x` is a float32 scalar or vector, `z` a
float32 scalar that only ever depends on itself (so it stays unbatched under `vmap` and can
drive conds there). `build` turns a tree into a JAX function with the real `lax` primitives
and `eqx_logs.log`; `Oracle` runs the same tree with Python loops and ifs, records every event
on the host and computes each key's static bound (scan: length times the body, cond/switch:
maximum over branches). The tests compare the two under spool, jit, grad, vmap, and with a
bounded `Stack(capacity, keep)` (which also allows while loops).
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close, assert_logs, padded
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from jax import lax

import eqx_logs

# ----------------------------------------------------------------------------------------
# Programs
# ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Log:
    items: tuple[tuple[str, int], ...]  # (key, value variant); one call, distinct keys


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
    log_index: bool  # log the int32 element of xs = arange(length) under "n"
    body: Any


@dataclasses.dataclass(frozen=True)
class Fori:
    lower: int
    upper: int
    log_index: bool
    body: Any


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
class While:
    trips: int  # lax.while_loop on a counter: no static bound on its events
    body: Any


def _value(xp, key: str, variant: int, x):
    """The value a Log node records for `key`; the same formula for numpy and jax.numpy."""
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


def _key_shape(key: str, x_shape: tuple[int, ...]) -> tuple[int, ...]:
    return {"a": x_shape, "b": (), "c": (2,), "n": ()}[key]


def _key_dtype(key: str):
    return np.int32 if key == "n" else np.float32


# ----------------------------------------------------------------------------------------
# Interpreter 1: the real thing, with lax primitives and eqx_logs.log
# ----------------------------------------------------------------------------------------


def build(node, memo: dict | None = None):
    """A function `(x, z) -> (x, z)` running `node` with JAX.

    Equal subtrees share one function (`memo`), so a repeated `Jit` calls the same `jax.jit`
    object twice and the second call reuses JAX's cached trace.
    """
    memo = {} if memo is None else memo
    if node not in memo:
        memo[node] = _build(node, memo)
    return memo[node]


def _build(node, memo: dict):
    if isinstance(node, Log):

        def run(s):
            x, _ = s
            values = {k: _value(jnp, k, v, x) for k, v in node.items}
            if len(values) == 1:
                eqx_logs.log(*next(iter(values.items())))
            else:
                eqx_logs.log(values)
            return s

    elif isinstance(node, Update):

        def run(s):
            return _update(jnp, node.op, *s)

    elif isinstance(node, Seq):
        parts = [build(c, memo) for c in node.children]

        def run(s):
            for part in parts:
                s = part(s)
            return s

    elif isinstance(node, Scan):
        body = build(node.body, memo)

        def step(s, i):
            if node.log_index:
                eqx_logs.log("n", i)
            s = body(s)
            return s, 0.5 * s[0]

        def run(s):
            xs = jnp.arange(node.length, dtype=jnp.int32)
            (x, z), ys = lax.scan(step, s, xs, reverse=node.reverse, unroll=node.unroll)
            return x + 0.05 * jnp.sum(ys, axis=0), z

    elif isinstance(node, Fori):
        body = build(node.body, memo)

        def fori_body(i, s):
            if node.log_index:
                eqx_logs.log("n", i)
            return body(s)

        def run(s):
            return lax.fori_loop(node.lower, node.upper, fori_body, s)

    elif isinstance(node, Cond):
        true, false = build(node.true, memo), build(node.false, memo)

        def run(s):
            return lax.cond(_source(jnp, node.on, *s) > node.threshold, true, false, s)

    elif isinstance(node, Switch):
        branches = [build(b, memo) for b in node.branches]

        def run(s):
            src = _source(jnp, node.on, *s)
            index = (src > node.threshold).astype(jnp.int32) + (src > node.threshold + 0.5).astype(
                jnp.int32
            )
            return lax.switch(index, branches, s)

    elif isinstance(node, Jit):
        run = jax.jit(build(node.body, memo))
    elif isinstance(node, Checkpoint):
        run = jax.checkpoint(build(node.body, memo))
    elif isinstance(node, While):
        body = build(node.body, memo)

        def run(s):
            def loop(c):
                i, s = c
                return i + 1, body(s)

            return lax.while_loop(lambda c: c[0] < node.trips, loop, (0, s))[1]

    else:
        raise AssertionError(node)
    return run


def as_function(root):
    """`f(x, z) -> (x, z)` for a program tree."""
    run = build(root)

    def f(x, z):
        return run((x, z))

    return f


# ----------------------------------------------------------------------------------------
# Interpreter 2: the eager numpy oracle
# ----------------------------------------------------------------------------------------

_TIE = 1e-3  # a predicate this close to its threshold could flip between numpy and XLA


class Oracle:
    """Runs a program eagerly in numpy, recording every event per key on the host."""

    def __init__(self, root, x0, z0):
        self.events: dict[str, list] = {}
        self.tie = False
        x = np.asarray(x0, np.float32)
        self.x_shape = x.shape
        self.out = self.run(root, (x, np.float32(z0)))
        self.bounds = bounds(root)

    def record(self, key, value):
        self.events.setdefault(key, []).append(np.asarray(value, _key_dtype(key)))

    def compare(self, src, threshold) -> bool:
        if abs(float(src) - threshold) < _TIE:
            self.tie = True
        return bool(src > threshold)

    def run(self, node, s):
        x, z = s
        if isinstance(node, Log):
            for key, variant in node.items:
                self.record(key, _value(np, key, variant, x))
            return s
        if isinstance(node, Update):
            x, z = _update(np, node.op, x, z)
            return np.asarray(x, np.float32), np.float32(z)
        if isinstance(node, Seq):
            for child in node.children:
                s = self.run(child, s)
            return s
        if isinstance(node, Scan):
            order = range(node.length)
            ys = np.zeros((node.length, *self.x_shape), np.float32)
            for i in reversed(order) if node.reverse else order:
                if node.log_index:
                    self.record("n", i)
                s = self.run(node.body, s)
                ys[i] = 0.5 * s[0]
            x, z = s
            return np.asarray(x + 0.05 * ys.sum(axis=0), np.float32), z
        if isinstance(node, Fori):
            for i in range(node.lower, node.upper):
                if node.log_index:
                    self.record("n", i)
                s = self.run(node.body, s)
            return s
        if isinstance(node, While):
            for _ in range(node.trips):
                s = self.run(node.body, s)
            return s
        if isinstance(node, Cond):
            taken = self.compare(_source(np, node.on, x, z), node.threshold)
            return self.run(node.true if taken else node.false, s)
        if isinstance(node, Switch):
            src = _source(np, node.on, x, z)
            index = int(self.compare(src, node.threshold))
            index += int(self.compare(src, node.threshold + 0.5))
            return self.run(node.branches[index], s)
        if isinstance(node, Jit | Checkpoint):
            return self.run(node.body, s)
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


def bounds(node) -> dict[str, int | None]:
    """Static upper bound on the number of events of each key that `node` may log (None:
    unbounded, inside a while loop)."""
    if isinstance(node, Log):
        return {k: 1 for k, _ in node.items}
    if isinstance(node, Update):
        return {}
    if isinstance(node, Seq):
        out = {}
        for child in node.children:
            out = _plus(out, bounds(child))
        return out
    if isinstance(node, Scan | Fori):
        trips = node.length if isinstance(node, Scan) else node.upper - node.lower
        per_trip = _plus({"n": 1} if node.log_index else {}, bounds(node.body))
        return {k: None if n is None else n * trips for k, n in per_trip.items()}
    if isinstance(node, While):
        return {k: None for k in bounds(node.body)}
    if isinstance(node, Cond | Switch):
        branches = (node.true, node.false) if isinstance(node, Cond) else node.branches
        out = {}
        for branch in branches:
            for k, n in bounds(branch).items():
                out[k] = None if n is None or out.get(k, 0) is None else max(out.get(k, 0), n)
        return out
    if isinstance(node, Jit | Checkpoint):
        return bounds(node.body)
    raise AssertionError(node)


def count_logs(node) -> int:
    """Number of Log nodes in a tree."""
    if isinstance(node, Log):
        return 1
    children = []
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        children.extend(value if isinstance(value, tuple) else [value])
    return sum(count_logs(c) for c in children if dataclasses.is_dataclass(c))


# ----------------------------------------------------------------------------------------
# The generator
# ----------------------------------------------------------------------------------------

MAX_DEPTH = 3
MAX_LOGS = 6
_LEAVES = ["log", "log", "update"]


@st.composite
def programs(draw, vmap_safe: bool = False, loops: tuple[str, ...] = ("scan", "fori")):
    """A random program tree: at most MAX_LOGS Log nodes (a Seq may repeat a child, which
    then runs twice) and control flow nested at most MAX_DEPTH deep.

    With `vmap_safe`, predicates read only `z` and nothing logs the (unbatched) loop index,
    so every logged value is batched under `vmap`. `loops` may add "while".
    """
    budget = [MAX_LOGS]
    ons = ["z"] if vmap_safe else ["x", "z"]
    thresholds = st.sampled_from([-0.5, 0.0, 0.35, 0.7, 1.0])
    control = ["seq", *loops, "cond", "switch", "jit", "checkpoint"]

    def log_index():
        return False if vmap_safe else draw(st.booleans())

    def node(depth):
        kinds = _LEAVES + (control if depth < MAX_DEPTH else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "log" and budget[0] > 0:
            budget[0] -= 1
            keys = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=2, unique=True))
            return Log(tuple((k, draw(st.integers(0, 2))) for k in keys))
        if kind in ("log", "update"):
            return Update(draw(st.integers(0, 3)))
        if kind == "seq":
            children = []
            for _ in range(draw(st.integers(1, 3))):
                repeat = children and draw(st.integers(0, 3)) == 0
                children.append(children[-1] if repeat else node(depth + 1))
            return Seq(tuple(children))
        if kind == "scan":
            return Scan(
                length=draw(st.integers(0, 4)),
                reverse=draw(st.booleans()),
                unroll=draw(st.sampled_from([1, 2])),
                log_index=log_index(),
                body=node(depth + 1),
            )
        if kind == "fori":
            lower = draw(st.integers(0, 2))
            upper = lower + draw(st.integers(0, 3))
            return Fori(lower, upper, log_index(), node(depth + 1))
        if kind == "while":
            return While(draw(st.integers(0, 3)), node(depth + 1))
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
def cases(draw, vmap_safe=False, batch: int | None = None, loops=("scan", "fori")):
    root = draw(programs(vmap_safe=vmap_safe, loops=loops))
    x0, z0 = draw(inputs(draw(x_shapes), batch))
    return root, x0, z0


def oracle(root, x0, z0) -> Oracle:
    o = Oracle(root, x0, z0)
    assume(not o.tie)
    return o


SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

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


# ----------------------------------------------------------------------------------------
# Differential tests
# ----------------------------------------------------------------------------------------


@settings(max_examples=300, **SETTINGS)
@given(cases())
def test_spool_matches_oracle(case):
    """spool(f) records exactly the oracle's events, padded to the static bound."""
    root, x0, z0 = case
    o = oracle(root, x0, z0)
    (x, z), logs = eqx_logs.spool(as_function(root))(x0, z0)
    assert_close(x, o.out[0], "x")
    assert_close(z, o.out[1], "z")
    assert_logs(logs, *o.expected())


@settings(max_examples=80, **SETTINGS)
@given(cases())
def test_jit_of_spool_matches_oracle(case):
    """f alone, then spool(f), then jax.jit(spool(f)): inner jits traced without logs are
    re-traced inside the spool, and cached traces are reused without losing events."""
    root, x0, z0 = case
    o = oracle(root, x0, z0)
    f = as_function(root)
    x, z = f(x0, z0)  # outside any spool: logs do nothing
    assert_close(x, o.out[0], "x")
    assert_close(z, o.out[1], "z")
    for spooled in (eqx_logs.spool(f), jax.jit(eqx_logs.spool(f))):
        (x, z), logs = spooled(x0, z0)
        assert_close(x, o.out[0], "x")
        assert_close(z, o.out[1], "z")
        assert_logs(logs, *o.expected())


@settings(max_examples=80, **SETTINGS)
@given(cases())
def test_spool_of_grad_matches_oracle(case):
    """spool(value_and_grad(f)): forward events once, with primal values; grads unchanged."""
    root, x0, z0 = case
    o = oracle(root, x0, z0)
    f = as_function(root)

    def scalar(x, z):
        x, z = f(x, z)
        return jnp.sum(x) + z

    (value, grads), logs = eqx_logs.spool(jax.value_and_grad(scalar, argnums=(0, 1)))(x0, z0)
    assert_close(value, np.sum(o.out[0]) + o.out[1], "value")
    want_grads = jax.grad(scalar, argnums=(0, 1))(x0, z0)  # outside any spool
    assert_close(grads[0], want_grads[0], "dx")
    assert_close(grads[1], want_grads[1], "dz")
    assert_logs(logs, *o.expected())


BATCH = 2


@settings(max_examples=80, **SETTINGS)
@given(cases(vmap_safe=True, batch=BATCH))
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

    (x, z), logs = eqx_logs.spool(jax.vmap(f, in_axes=(0, None)))(xs, z0)
    assert_close(x, want_x, "x")
    assert_close(z, want_z, "z")
    assert_logs(logs, {k: np.stack([e[0][k] for e in expected], axis=1) for k in keys}, counts)

    (x, z), logs = jax.vmap(eqx_logs.spool(f), in_axes=(0, None))(xs, z0)
    assert_close(x, want_x, "x")
    assert_close(z, want_z, "z")
    assert_logs(logs, {k: np.stack([e[0][k] for e in expected], axis=0) for k in keys}, counts)


@settings(max_examples=25, **SETTINGS)
@given(programs(), x_shapes, st.integers(0, 3))
def test_logs_in_while_loop_raise(root, shape, trips):
    """A log inside a while_loop has no static bound: the default stack raises, naming it."""
    assume(count_logs(root) > 0)
    f = as_function(While(trips, root))
    with pytest.raises(ValueError, match="while_loop"):
        eqx_logs.spool(f)(np.zeros(shape, np.float32), np.float32(0.0))


@settings(max_examples=60, **SETTINGS)
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


_CHECKPOINT_BUG = pytest.mark.xfail(
    jax.__version__.startswith("0.10."),
    strict=True,
    reason="jax 0.10: a checkpoint hoisted out of a scan under grad loses its logs",
)


@pytest.mark.parametrize(
    "fn, want",
    [
        (_invariant_log, [1.0, 1.0, 1.0]),
        (_invariant_inner_xs, [0.0, 1.0, 0.0, 1.0]),
        (_invariant_carry_zero_trips, []),
        (_invariant_predicate, [1.0, np.sin(np.float32(1.0))]),
        pytest.param(_invariant_carry_in_checkpoint, [1.0] * 4, marks=_CHECKPOINT_BUG),
    ],
)
def test_grad_keeps_loop_invariant_logs_in_the_loop(fn, want):
    """Under grad, logs in a loop fire once per iteration even where they read loop-invariant
    values (shrunk from failures of `test_spool_of_grad_matches_oracle`).

    JAX's `_scan_known_hoisting` (jax/_src/lax/control_flow/loops.py) evaluates equations
    whose inputs are loop-invariant once, outside the loop, effects included, and
    `_cond_partial_eval` drops a staged cond that has no outputs.
    """
    want = np.array(want, np.float32)
    _, plain = eqx_logs.spool(fn)(jnp.float32(1.0))
    np.testing.assert_allclose(np.asarray(plain["a"]), want, rtol=1e-6)
    _, logs = eqx_logs.spool(jax.grad(fn))(jnp.float32(1.0))
    assert "a" in logs, "the key disappeared under grad"
    np.testing.assert_allclose(np.asarray(logs["a"]), want, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(logs.count["a"]), len(want))
