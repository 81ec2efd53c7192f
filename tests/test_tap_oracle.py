"""Random nested programs: `eqx_logs.tap` against the eager numpy oracle of `test_oracle.py`.

The programs, the JAX builder and the oracle come from `test_oracle.py`; here every Log node
also logs a step `s` computed from the state, and the oracle is extended to record each log
*call* (all its keys, its tags and its steps) in execution order. `expected_stream` turns those
calls into the callbacks `tap` must make: each key's events 0, k, 2k, ... (counted per key),
one callback per call that keeps at least one key.

Under `vmap`, `LaneOracle` runs all lanes in lock step, as JAX does: a cond or switch runs
every branch in order for every lane, a while loop runs its body until every lane is done, and
each event carries the mask of the lanes where it really happens. Projected on one lane, its
events are the plain oracle's (checked in every test). `vmap(tap(f))` must call the callback
for each event, lane after lane, only where it happens, counting the interval per lane;
`tap(vmap(f))` once per event that happens in some lane, with that mask as `steps["valid"]`,
NaN in the other lanes, counting the interval over events that happen in some lane.
"""

import contextlib
import dataclasses
import fnmatch

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, padded
from hypothesis import assume, given, strategies as st
from jax import lax
from test_oracle import (
    LANES,
    TAGS,
    Checkpoint,
    Cond,
    Fori,
    Jit,
    Log,
    Oracle,
    Scan,
    Seq,
    Switch,
    Update,
    While,
    _key_dtype,
    _key_shape,
    _predicate_sources,
    _source,
    _update,
    _value,
    bounds,
    budget,
    build,
    count_logs,
    in_outer_scan,
    inputs,
    programs,
    x_shapes,
)

import eqx_logs
from eqx_logs._tap._split import ScanSplit

_TIE = 1e-3  # as in test_oracle: a comparison this close to its threshold may flip

# ----------------------------------------------------------------------------------------
# Programs whose logs carry a step
# ----------------------------------------------------------------------------------------


_STEP_Z, _STEP_X = 0.2, -0.3  # thresholds of the step: rarely near the drawn inputs


def _step(xp, x, z):
    """The step `s` every Log node logs: which of z and sum(x) exceed a threshold (0..3)."""
    return (z > _STEP_Z).astype(np.int32) + 2 * (xp.sum(x) > _STEP_X).astype(np.int32)


def _nodes(node, kind):
    """Every node of type `kind` in the tree (repeats included)."""
    if isinstance(node, kind):
        yield node
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        for child in value if isinstance(value, tuple) else [value]:
            if dataclasses.is_dataclass(child):
                yield from _nodes(child, kind)


def _log_with_step(node: Log):
    def run(s):
        x, z = s
        values = {k: _value(jnp, k, v, x) for k, v in node.items}
        eqx_logs.log(values, tags=node.tags, s=_step(jnp, x, z))
        return s

    return run


def as_function(root):
    """`f(x, z) -> (x, z)`: test_oracle's builder, with every Log node logging its keys in one
    call with the step `s` (the builder's memo is seeded with those Log functions)."""
    memo = {node: _log_with_step(node) for node in _nodes(root, Log)}
    run = build(root, memo)

    def f(x, z):
        return run((x, z))

    return f


class TapOracle(Oracle):
    """The oracle, also recording every log call: `calls` is a list of
    `(values {key: value}, tags, steps)` in execution order."""

    def __init__(self, root, x0, z0):
        self.calls: list[tuple[dict, tuple, dict]] = []
        super().__init__(root, x0, z0)

    def record(self, key, value, tags=()):
        super().record(key, value, tags)
        if key == "n":  # the loop index of Scan and Fori: a call of its own, no steps
            self.calls.append(({"n": np.asarray(value, np.int32)}, tags, {}))

    def run(self, node, s):
        if isinstance(node, Log):
            x, z = s
            self.compare(z, _STEP_Z)  # flags a tie in the step
            self.compare(np.sum(x), _STEP_X)
            values = {k: np.asarray(_value(np, k, v, x), _key_dtype(k)) for k, v in node.items}
            self.calls.append((values, node.tags, {"s": np.asarray(_step(np, x, z), np.int32)}))
        return super().run(node, s)


def tap_oracle(root, x0, z0) -> TapOracle:
    o = TapOracle(root, x0, z0)
    assume(not o.tie)
    return o


def expected_stream(calls, interval=1, select=None, prefix="", drop=()) -> list:
    """The callbacks `tap(interval=..., tags/exclude (select), prefix, drop rules)` makes for
    these calls: for each selected call, the keys whose event is one of 0, k, 2k, ... of that
    key (dropped keys are not counted), if any."""
    seen: dict[str, int] = {}
    out = []
    for values, tags, steps in calls:
        if select is not None and not select(tags):
            continue
        kept = {}
        for key, value in values.items():
            if key in drop:
                continue
            n = seen.get(key, 0)
            seen[key] = n + 1
            if n % interval == 0:
                kept[prefix + key] = value
        if kept:
            out.append((kept, steps))
    return out


class Recorder:
    """A tap callback that keeps copies of everything it gets."""

    def __init__(self):
        self.events: list[tuple[dict, dict]] = []

    def __call__(self, logs, steps):
        self.events.append(
            (
                {k: np.array(v) for k, v in logs.items()},
                {k: np.array(v) for k, v in steps.items()},
            )
        )

    def stream(self) -> list:
        jax.effects_barrier()
        return self.events


def _summary(stream) -> list[str]:
    return [",".join(sorted(logs)) for logs, _ in stream]


def assert_stream(got: list, want: list, what: str = "tap") -> None:
    """Callbacks against `expected_stream`: the same number, each with the same keys (values
    of the same shape and dtype, close; NaN where expected) and the same steps. An expected
    `valid` mask is the lanes where the event happened: `tap` must pass it as `steps["valid"]`
    unless it is all True, and steps are compared in those lanes only."""
    assert _summary(got) == _summary(want), (
        f"{what}: {len(got)} callbacks with keys {_summary(got)}, expected {len(want)} with "
        f"{_summary(want)}"
    )
    for i, ((logs, steps), (want_logs, want_steps)) in enumerate(zip(got, want)):
        where = f"{what}: callback {i}"
        for key, value in want_logs.items():
            assert_tree_allclose(logs[key], value, what=f"{where} logs[{key!r}]")
        valid = want_steps.get("valid")
        if valid is None:
            assert set(steps) == set(want_steps), f"{where}: steps {sorted(steps)}"
        else:
            assert set(steps) - {"valid"} == set(want_steps) - {"valid"}, f"{where}: {steps}"
            if "valid" in steps:
                np.testing.assert_array_equal(steps["valid"], valid, err_msg=f"{where} valid")
            else:
                assert valid.all(), f"{where}: no steps['valid'], but lanes {valid} are masked"
        for name, value in want_steps.items():
            if name == "valid":
                continue
            got_step = np.asarray(steps[name])
            assert got_step.shape == value.shape, f"{where} step {name}: {got_step.shape}"
            assert got_step.dtype == value.dtype, f"{where} step {name}: {got_step.dtype}"
            lanes = ... if valid is None else valid
            np.testing.assert_array_equal(
                got_step[lanes], value[lanes], err_msg=f"{where} step {name}"
            )


# ----------------------------------------------------------------------------------------
# All lanes in lock step, as vmap runs them
# ----------------------------------------------------------------------------------------


class LaneOracle:
    """Runs a program on a batch of lanes at once, as `vmap` does: every branch of a cond or
    switch in order, each with the mask of the lanes that take it; a while loop until every
    lane's predicate fails, masked by the lanes still running. `slots` holds every log call
    executed, `(values {key: (B, ...)}, steps {"s": (B,)}, mask (B,), tags)`; a lane's events
    are the slots whose mask holds there. The loop index `n` (not batched under vmap) is
    broadcast to every lane; `batched_stream` does not model it."""

    def __init__(self, root, xs, zs):
        self.lanes = len(xs)
        self.slots: list[tuple[dict, dict, np.ndarray, tuple]] = []
        self.tie = False
        x = np.asarray(xs, np.float32)
        z = np.broadcast_to(np.asarray(zs, np.float32), (self.lanes,)).copy()
        self.out = self.run(root, x, z, np.ones(self.lanes, bool))

    def compare(self, src, threshold, mask) -> np.ndarray:
        src = np.asarray(src, np.float64)
        if np.any(mask & (np.abs(src - threshold) < _TIE)):
            self.tie = True
        return src > threshold

    def _per_lane(self, fun, *args):
        return np.stack([np.asarray(fun(*(a[i] for a in args))) for i in range(self.lanes)])

    def run(self, node, x, z, mask):
        if isinstance(node, Log):
            self.compare(z, _STEP_Z, mask)
            self.compare(np.sum(x.reshape(self.lanes, -1), axis=1), _STEP_X, mask)
            values = {
                k: self._per_lane(lambda x, k=k, v=v: _value(np, k, v, x), x).astype(_key_dtype(k))
                for k, v in node.items
            }
            steps = {"s": self._per_lane(lambda x, z: _step(np, x, z), x, z).astype(np.int32)}
            self.slots.append((values, steps, mask.copy(), node.tags))
            return x, z
        if isinstance(node, Update):
            pairs = [_update(np, node.op, x[i], z[i]) for i in range(self.lanes)]
            return (
                np.stack([np.asarray(a, np.float32) for a, _ in pairs]),
                np.array([b for _, b in pairs], np.float32),
            )
        if isinstance(node, Seq):
            for child in node.children:
                x, z = self.run(child, x, z, mask)
            return x, z
        if isinstance(node, Scan | Fori):

            def index(i):
                if node.log_index:
                    n = np.full(self.lanes, i, np.int32)
                    self.slots.append(({"n": n}, {}, mask.copy(), ()))

            if isinstance(node, Fori):
                for i in range(node.lower, node.upper):
                    index(i)
                    x, z = self.run(node.body, x, z, mask)
                return x, z
            ys = np.zeros((node.length, *x.shape), np.float32)
            order = range(node.length)
            for i in reversed(order) if node.reverse else order:
                index(i)
                x, z = self.run(node.body, x, z, mask)
                ys[i] = 0.5 * x
            return (x + 0.05 * ys.sum(axis=0)).astype(np.float32), z
        if isinstance(node, Cond | Switch):
            src = self._per_lane(lambda x, z: _source(np, node.on, x, z), x, z)
            index = self.compare(src, node.threshold, mask).astype(int)
            if isinstance(node, Switch):
                index += self.compare(src, node.threshold + 0.5, mask).astype(int)
                branches = node.branches
            else:
                branches = (node.false, node.true)  # lax.cond: index 0 is the false branch
            outs = [self.run(b, x, z, mask & (index == i)) for i, b in enumerate(branches)]
            lanes = np.arange(self.lanes)
            return (
                np.stack([outs[index[i]][0][i] for i in lanes]),
                np.array([outs[index[i]][1][i] for i in lanes], np.float32),
            )
        if isinstance(node, Jit | Checkpoint):
            return self.run(node.body, x, z, mask)
        if isinstance(node, While):
            trips = np.zeros(self.lanes, int)

            def test(x, z, mask):
                if node.on is None:
                    return trips < node.trips
                src = self._per_lane(lambda x, z: _source(np, node.on, x, z), x, z)
                extra = self.compare(src, node.threshold, mask & (trips == node.trips))
                return trips < node.trips + extra

            running = test(x, z, mask)
            while running.any():
                new_x, new_z = self.run(node.body, x, z, mask & running)
                x = np.where(running.reshape((-1,) + (1,) * (x.ndim - 1)), new_x, x)
                z = np.where(running, new_z, z)
                trips = trips + running
                running = running & test(x, z, mask & running)
            return x.astype(np.float32), z.astype(np.float32)
        raise AssertionError(node)

    def lane_calls(self, lane: int) -> list:
        """One lane's events as `TapOracle.calls`."""
        return [
            ({k: v[lane] for k, v in values.items()}, tags, {k: v[lane] for k, v in steps.items()})
            for values, steps, mask, tags in self.slots
            if mask[lane]
        ]

    def per_lane_stream(self, interval: int) -> list:
        """What `vmap(tap(f))` calls: per event, lane after lane, where the event happens and
        is one of 0, k, 2k, ... of its key in that lane."""
        seen = [{} for _ in range(self.lanes)]
        out = []
        for values, steps, mask, _ in self.slots:
            for lane in np.flatnonzero(mask):
                kept = {}
                for key, value in values.items():
                    n = seen[lane].get(key, 0)
                    seen[lane][key] = n + 1
                    if n % interval == 0:
                        kept[key] = value[lane]
                if kept:
                    out.append((kept, {k: v[lane] for k, v in steps.items()}))
        return out

    def batched_stream(self, interval: int) -> list:
        """What `tap(vmap(f))` calls: per event that happens in some lane and is one of
        0, k, 2k, ... of such events of its key, the batched values (NaN where it does not
        happen) and the lane mask."""
        seen: dict[str, int] = {}
        out = []
        for values, steps, mask, _ in self.slots:
            assert "n" not in values, "an unbatched value: not modelled"
            if not mask.any():
                continue
            kept = {}
            for key, value in values.items():
                n = seen.get(key, 0)
                seen[key] = n + 1
                if n % interval == 0:
                    m = mask.reshape((-1,) + (1,) * (value.ndim - 1))
                    kept[key] = np.where(m, value, np.nan).astype(value.dtype)
            if kept:
                out.append((kept, {**steps, "valid": mask}))
        return out


def lane_oracles(root, xs, zs) -> tuple[LaneOracle, list[TapOracle]]:
    """The lock-step oracle and one plain oracle per lane; they must agree lane by lane."""
    zs = np.broadcast_to(np.asarray(zs, np.float32), (len(xs),))
    lock = LaneOracle(root, xs, zs)
    assume(not lock.tie)
    lanes = [tap_oracle(root, x, z) for x, z in zip(xs, zs)]
    for i, o in enumerate(lanes):  # a check of the lock-step oracle itself
        mine = lock.lane_calls(i)
        assert [sorted(v) for v, _, _ in mine] == [sorted(v) for v, _, _ in o.calls], i
        for (v, _, s), (w, _, t) in zip(mine, o.calls):
            for k in w:
                np.testing.assert_allclose(v[k], w[k], rtol=1e-5, atol=1e-6)
            assert s == t
        np.testing.assert_allclose(lock.out[0][i], o.out[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lock.out[1][i], o.out[1], rtol=1e-5, atol=1e-6)
    return lock, lanes


# ----------------------------------------------------------------------------------------
# Generators
# ----------------------------------------------------------------------------------------

intervals = st.sampled_from([1, 2, 3, 5])


@st.composite
def scan_programs(draw, batched: bool = False):
    """Programs made to exercise tap's split scans: a few events before a loop (shifting the
    interval's phase), the loop (a scan, or a fori_loop: a scan with no xs), bare or in a jit,
    perhaps another loop and another log. The first loop's body logs once per iteration (the
    log possibly in a jit or checkpoint), so that tap splits it at trace time; or (under vmap)
    logs under a cond on the batched state, so only in some iterations and lanes; or anything
    goes: random bodies, conds, reversed scans, loops in a checkpoint, cond or scan (where the
    counters are not known at trace time).

    Returns `(root, split)`: `split` is None, or for a first loop that tap must split (if the
    interval is above 1 and puts all its keys in one phase), the number of events of each of
    its keys before it."""
    ons = ["x", "z"] if batched else ["z"]
    thresholds = st.sampled_from([-0.5, 0.0, 0.35, 0.7])

    def log():
        keys = draw(st.lists(st.sampled_from("abc"), min_size=1, max_size=2, unique=True))
        return Log(tuple((k, draw(st.integers(0, 2))) for k in keys))

    # Most first loops are made to be split ("split"); under vmap, half log under a cond on the
    # batched x instead ("masked": in some iterations and lanes only); the rest vary all.
    modes = ["masked", "split", "masked", "any"] if batched else ["split", "split", "any"]
    mode = draw(st.sampled_from(modes))

    def body(mode):
        if mode == "any" and draw(st.integers(0, 2)) == 0:
            return draw(programs(loops=("scan", "fori"), batched=batched)), None
        the_log = log()
        wrapped = draw(st.sampled_from(["bare", "bare", "jit", "checkpoint"]))
        node = {"bare": the_log, "jit": Jit(the_log), "checkpoint": Checkpoint(the_log)}[wrapped]
        if mode == "masked" or (mode == "any" and draw(st.booleans())):
            on = "x" if mode == "masked" else draw(st.sampled_from(ons))
            t, other = draw(thresholds), Update(draw(st.integers(0, 3)))
            node = Cond(on, t, node, other) if draw(st.booleans()) else Cond(on, t, other, node)
        parts = [node]
        if mode == "masked":  # x drifts towards -2, lanes cross the threshold one by one
            parts.insert(0, Update(1))
        elif draw(st.booleans()):
            parts.insert(0, Update(draw(st.integers(0, 3))))
        if draw(st.booleans()):
            parts.append(Update(draw(st.integers(0, 3))))
        return Seq(tuple(parts)), the_log

    def scan(mode):
        inner, the_log = body(mode)
        log_index = not batched and mode == "any" and draw(st.booleans())
        if draw(st.integers(0, 3)) == 0:  # a fori_loop: a scan with no xs
            lower = draw(st.integers(0, 2))
            node = Fori(lower, lower + draw(st.integers(1, 9)), log_index, inner)
        else:
            node = Scan(
                length=draw(st.integers(4 if mode == "masked" else 1, 11)),
                reverse=mode == "any" and draw(st.booleans()),
                unroll=draw(st.sampled_from([1, 2, 3])),
                log_index=log_index,
                body=inner,
            )
        kinds = ["bare", "jit"] + (["checkpoint", "cond", "scan"] if mode == "any" else [])
        where = draw(st.sampled_from(kinds))
        if where == "checkpoint":
            return Checkpoint(node), node, the_log, False
        if where == "cond":
            other = Update(draw(st.integers(0, 3)))
            on, t = draw(st.sampled_from(ons)), draw(thresholds)
            pair = (node, other) if draw(st.booleans()) else (other, node)
            return Cond(on, t, *pair), node, the_log, False
        if where == "scan":
            return Scan(draw(st.integers(1, 3)), False, 1, False, node), node, the_log, False
        return Jit(node) if where == "jit" else node, node, the_log, mode == "split"

    first, node, the_log, straight = scan(mode)
    if the_log is not None and (mode != "any" or draw(st.booleans())):
        pre = [k for _ in range(draw(st.integers(0, 4))) for k, _ in the_log.items]
        items: list = [the_log] * (len(pre) // len(the_log.items))  # its keys, in one phase
    else:
        pre = draw(st.lists(st.sampled_from("abc"), max_size=4))
        items = [Log(((k, 0),)) for k in pre]
    items.append(first)
    if draw(st.booleans()):
        items.append(Update(draw(st.integers(0, 3))))
        items.append(scan("any")[0])
    if draw(st.booleans()):
        items.append(log())
    split = None
    if straight and the_log is not None and not getattr(node, "reverse", False):
        keys = [k for k, _ in the_log.items] + (["n"] if node.log_index else [])
        split = {k: pre.count(k) for k in keys}
    return Seq(tuple(items)), split


@st.composite
def batched_cases(draw, batch: int = LANES):
    """`(root, xs, z0, z_axis)`: a program whose predicates may read the batched state (a
    random one as in test_oracle's batched test, or a `scan_programs` one), with lanes spread
    out so that predicates split them; `z` batched (z_axis 0) or not (None)."""
    if draw(st.booleans()):
        root, _ = draw(scan_programs(batched=True))
    else:
        root = draw(programs(loops=("scan", "fori", "while"), batched=True))
        assume(count_logs(root) > 0)
        root = draw(in_outer_scan(root))
    sources = _predicate_sources(root)
    x0, z0 = draw(inputs(draw(x_shapes), batch))
    offsets = np.linspace(-1.0, 1.0, batch, dtype=np.float32)
    x0 = x0 + draw(st.sampled_from([0.5, 1.0])) * offsets.reshape((-1,) + (1,) * (x0.ndim - 1))
    z_axis = None
    if "x" not in sources or draw(st.booleans()):
        z_axis, z0 = 0, z0 + draw(st.sampled_from([0.5, 1.0])) * offsets[::-1]
    return root, x0, z0, z_axis


@contextlib.contextmanager
def counting_split_scans():
    """Counts the scans tap splits at trace time (`ScanSplit.peeled` answering)."""
    original = ScanSplit.peeled
    hits: list[bool] = []

    def spy(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        hits.append(out is not None)
        return out

    ScanSplit.peeled = spy
    try:
        yield hits
    finally:
        ScanSplit.peeled = original


def _transform(f, variant: str, interval: int, rec: Recorder, **options):
    tap = eqx_logs.tap
    if variant == "tap":
        return tap(f, callback=rec, interval=interval, **options)
    if variant == "tap_of_jit":
        return tap(jax.jit(f), callback=rec, interval=interval, **options)
    if variant == "jit_of_tap":
        return jax.jit(tap(f, callback=rec, interval=interval, **options))
    if variant == "jit_of_tap_of_jit":
        return jax.jit(tap(jax.jit(f), callback=rec, interval=interval, **options))
    raise AssertionError(variant)


VARIANTS = st.sampled_from(["tap", "tap_of_jit", "jit_of_tap", "jit_of_tap_of_jit"])


def _check_twice(tapped, x0, z0, o: TapOracle, want: list, rec: Recorder) -> None:
    """Two calls: the same outputs, and the stream twice (the interval counts per call)."""
    for _ in range(2):
        x, z = tapped(x0, z0)
        assert_tree_allclose(np.asarray(x), np.asarray(o.out[0], np.float32), what="x")
        assert_tree_allclose(np.asarray(z), np.asarray(o.out[1], np.float32), what="z")
    assert_stream(rec.stream(), want * 2)


# ----------------------------------------------------------------------------------------
# 1. The stream: every k-th event of each key, in execution order
# ----------------------------------------------------------------------------------------


@budget(40)
@given(programs(loops=("scan", "fori", "while")), x_shapes, st.data(), intervals, VARIANTS)
def test_tap_matches_oracle(root, shape, data, interval, variant):
    """tap(f, interval=k) (also of and under jax.jit, called twice) calls back exactly the
    oracle's log calls, each key's events 0, k, 2k, ... with their values and steps; the
    outputs are f's."""
    assume(count_logs(root) > 0)
    root = data.draw(in_outer_scan(root))
    x0, z0 = data.draw(inputs(shape))
    o = tap_oracle(root, x0, z0)
    rec = Recorder()
    tapped = _transform(as_function(root), variant, interval, rec)
    _check_twice(tapped, x0, z0, o, expected_stream(o.calls, interval), rec)


@budget(40)
@given(scan_programs(), x_shapes, st.data(), st.sampled_from([2, 3, 4, 5]), VARIANTS)
def test_split_scans_match_oracle(program, shape, data, interval, variant):
    """Loops (scans, fori_loops) logging once per iteration after events that shift the
    interval's phase, bare or in a jit: tap must split them into kept and skipped iterations
    at trace time (checked with a spy), and the stream must not change; and loops it gates on
    the device: in a checkpoint, cond or another scan, reversed, with random bodies."""
    root, split = program
    x0, z0 = data.draw(inputs(shape))
    o = tap_oracle(root, x0, z0)
    rec = Recorder()
    with counting_split_scans() as hits:
        tapped = _transform(as_function(root), variant, interval, rec)
        _check_twice(tapped, x0, z0, o, expected_stream(o.calls, interval), rec)
    if split is not None and len({n % interval for n in split.values()}) == 1:
        assert any(hits), f"the scan was not split: {hits}"


# ----------------------------------------------------------------------------------------
# 2. grad: each event once
# ----------------------------------------------------------------------------------------


def _check_grad(root, x0, z0, interval: int, where: str) -> None:
    o = tap_oracle(root, x0, z0)
    f = as_function(root)

    def scalar(x, z):
        x, z = f(x, z)
        return jnp.sum(x) + z

    rec = Recorder()
    if where == "tap_of_grad":
        grad = jax.value_and_grad(scalar, argnums=(0, 1))
        fun = eqx_logs.tap(grad, callback=rec, interval=interval)
    else:
        tapped = eqx_logs.tap(scalar, callback=rec, interval=interval)
        fun = jax.value_and_grad(tapped, argnums=(0, 1))
    value, grads = fun(x0, z0)
    assert_stream(rec.stream(), expected_stream(o.calls, interval), where)
    assert_tree_allclose(value, np.float32(np.sum(o.out[0]) + o.out[1]), what="value")
    want = jax.grad(scalar, argnums=(0, 1))(x0, z0)  # outside any tap
    assert_tree_allclose(grads[0], want[0], what="dx")
    assert_tree_allclose(grads[1], want[1], what="dz")


@budget(40)
@given(
    st.one_of(programs(), scan_programs().map(lambda p: p[0])),
    x_shapes,
    st.data(),
    intervals,
    st.sampled_from(["tap_of_grad", "grad_of_tap"]),
)
def test_grad_fires_each_event_once(root, shape, data, interval, where):
    """tap(value_and_grad(f)) and value_and_grad(tap(f)): the forward events once each (with
    their primal values), as without grad, split scans and checkpoints included; gradients
    unchanged."""
    x0, z0 = data.draw(inputs(shape))
    _check_grad(root, x0, z0, interval, where)


# Regressions: eqx_logs bugs the random test above found (shrunk by hand), all fixed in
# dbfbf79. The first three lost or duplicated events under grad(tap(f)) only.


def _scan_logging_its_carry(x):
    def step(c, _):
        eqx_logs.log("c", c)
        return jnp.sin(c) + 0.5, None

    return lax.scan(step, x, None, length=3)[0]


def test_grad_of_tap_keeps_scan_events_at_interval_1():
    """Each event in a loop once. (The bug: at interval 1 with a traced counter, the callback
    was gated by `lax.cond` on the constant `jnp.bool_(True)`, and JAX's partial eval of the
    scan under grad dropped that output-less cond: no event at all.)"""
    want = [0.0, 0.5, float(np.sin(np.float32(0.5)) + np.float32(0.5))]
    tap = eqx_logs.tap
    for make, expected in [
        (lambda rec: tap(jax.grad(_scan_logging_its_carry), callback=rec), want),
        (lambda rec: jax.grad(tap(_scan_logging_its_carry, callback=rec, interval=2)), want[::2]),
        (lambda rec: jax.grad(tap(_scan_logging_its_carry, callback=rec)), want),
    ]:
        rec = Recorder()
        make(rec)(jnp.float32(0.0))
        got = [float(logs["c"]) for logs, _ in rec.stream()]
        np.testing.assert_allclose(got, expected, rtol=1e-6)


def _fori_logging_an_invariant(x):
    def body(i, c):
        eqx_logs.log("x", x)  # the same value in every iteration
        return c * 1.5

    return lax.fori_loop(0, 4, body, x)


@pytest.mark.parametrize("under_grad", [False, True])
@pytest.mark.parametrize("interval", [2, 3])
def test_grad_of_tap_keeps_loop_invariant_events_of_split_scans(under_grad, interval):
    """Iterations 0 and 2 (two blocks of two), or 0 and 3 (a block and a tail), are kept.
    (The bug: a kept event of a split scan called back unconditionally, with loop-invariant
    operands, and under grad JAX's `_scan_known_hoisting` moved that callback out of the block
    scan: it fired once, not once per block.)"""
    rec = Recorder()
    fun = eqx_logs.tap(_fori_logging_an_invariant, callback=rec, interval=interval)
    (jax.grad(fun) if under_grad else fun)(jnp.float32(0.5))
    assert [float(logs["x"]) for logs, _ in rec.stream()] == [0.5, 0.5]


def _checkpoint_logging(x):
    def inner(x):
        eqx_logs.log("x", x)
        return jnp.sin(x)

    return jax.checkpoint(inner)(x)


@pytest.mark.parametrize("interval", [1, 2])
@pytest.mark.parametrize("where", ["tap", "tap_of_grad", "grad_of_tap"])
def test_checkpointed_events_fire_once(interval, where):
    """(The bug: tap rebuilt a checkpoint with its callbacks inside, and under grad(tap(f))
    JAX recomputes the checkpointed forward pass in the backward pass, callbacks included:
    each event fired twice.)"""
    rec = Recorder()
    if where == "tap_of_grad":
        fun = eqx_logs.tap(jax.grad(_checkpoint_logging), callback=rec, interval=interval)
    else:
        fun = eqx_logs.tap(_checkpoint_logging, callback=rec, interval=interval)
        fun = jax.grad(fun) if where == "grad_of_tap" else fun
    fun(jnp.float32(0.5))
    assert [float(logs["x"]) for logs, _ in rec.stream()] == [0.5]


def _checkpointed_loop_in_a_loop(x):
    def inner(c):
        def body(i, c):
            eqx_logs.log("a", c)  # loop-invariant: the loops never change their carry
            return c

        return lax.fori_loop(0, 1, body, c)

    return lax.fori_loop(0, 1, lambda i, c: jax.checkpoint(inner)(c), x)


@pytest.mark.parametrize("where", ["tap", "tap_of_grad", "grad_of_tap"])
def test_a_checkpointed_loop_in_a_loop_fires_under_grad(where):
    """The program `test_grad_fires_each_event_once` shrank to in CI (its seed on stop 56).
    (The bug, jax 0.10: under grad JAX hoisted the inner loop out of the outer one as a
    `closed_call` holding the log and nothing else, and `JaxprTrace.process_call` staged that
    call without an effect handle: the event was dropped, no error.)"""
    rec = Recorder()
    if where == "tap_of_grad":
        fun = eqx_logs.tap(jax.grad(_checkpointed_loop_in_a_loop), callback=rec)
    else:
        fun = eqx_logs.tap(_checkpointed_loop_in_a_loop, callback=rec)
        fun = jax.grad(fun) if where == "grad_of_tap" else fun
    fun(jnp.float32(0.5))
    assert [float(logs["a"]) for logs, _ in rec.stream()] == [0.5]
    _, logs = eqx_logs.spool(jax.grad(_checkpointed_loop_in_a_loop))(jnp.float32(0.5))
    np.testing.assert_array_equal(np.asarray(logs["a"]), [0.5])


# ----------------------------------------------------------------------------------------
# 3. and 4. vmap, with predicates that read the batched state
# ----------------------------------------------------------------------------------------


def _lane_outputs(lanes):
    return np.stack([o.out[0] for o in lanes]), np.stack([o.out[1] for o in lanes])


def _with_loop_index(node):
    """`node` with every loop logging its index `n` (not batched under vmap)."""
    changes = {"log_index": True} if isinstance(node, Scan | Fori) else {}
    for field in dataclasses.fields(node):
        value = getattr(node, field.name)
        if isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            changes[field.name] = tuple(_with_loop_index(c) for c in value)
        elif dataclasses.is_dataclass(value):
            changes[field.name] = _with_loop_index(value)
    return dataclasses.replace(node, **changes) if changes else node


@budget(30)
@given(
    batched_cases(),
    intervals,
    st.sampled_from(["vmap_of_tap", "jit_of_vmap_of_tap"]),
    st.booleans(),
)
def test_vmap_of_tap_calls_back_per_lane(case, interval, variant, index):
    """vmap(tap(f)): the callback gets one lane's values at a time, only in lanes where the
    event happens (untaken branches, finished while lanes: none), every k-th event of each
    key counted in that lane: per lane, the oracle run on that lane alone. Half the programs
    also log their loop indices, which are not batched: called back per lane too."""
    root, xs, z0, z_axis = case
    if index:
        root = _with_loop_index(root)
    lock, lanes = lane_oracles(root, xs, z0)
    rec = Recorder()
    fun = jax.vmap(eqx_logs.tap(as_function(root), callback=rec, interval=interval), (0, z_axis))
    if variant.startswith("jit"):
        fun = jax.jit(fun)
    x, z = fun(xs, z0)
    want_x, want_z = _lane_outputs(lanes)
    assert_tree_allclose(np.asarray(x), want_x, what="x")
    assert_tree_allclose(np.broadcast_to(z, want_z.shape), want_z, what="z")
    assert_stream(rec.stream(), lock.per_lane_stream(interval), variant)


@budget(30)
@given(batched_cases(), intervals)
def test_tap_of_vmap_calls_back_batched_events(case, interval):
    """tap(vmap(f)): one callback per event that happens in some lane, with the batched
    values; where a batched predicate means it does not happen in some lanes, those lanes
    are NaN and `steps["valid"]` is the oracle's per-lane mask. The interval counts events
    that happen in some lane."""
    root, xs, z0, z_axis = case
    lock, lanes = lane_oracles(root, xs, z0)
    rec = Recorder()
    fun = eqx_logs.tap(jax.vmap(as_function(root), (0, z_axis)), callback=rec, interval=interval)
    x, z = fun(xs, z0)
    want_x, want_z = _lane_outputs(lanes)
    assert_tree_allclose(np.asarray(x), want_x, what="x")
    assert_tree_allclose(np.broadcast_to(z, want_z.shape), want_z, what="z")
    assert_stream(rec.stream(), lock.batched_stream(interval), "tap(vmap)")


@pytest.mark.parametrize("interval", [2, 3])
@pytest.mark.parametrize("loop", ["scan", "fori"])
@pytest.mark.parametrize("logs_when", ["above", "below"])
def test_loops_logging_in_some_iterations_and_lanes(interval, loop, logs_when):
    """A loop after an event (a phase shift) whose body logs under a cond on the batched
    state, which drifts so that lanes cross the threshold one by one: some iterations log in
    no lane, some in a few, some in all. Both vmap orders against the lock-step oracle (tap
    must not split such a loop at trace time: its events are not one per iteration)."""
    the_log, other = Log((("a", 0), ("b", 1))), Update(1)
    cond = Cond("x", -0.5, *((the_log, other) if logs_when == "above" else (other, the_log)))
    body = Seq((Update(1), cond))
    looped = Scan(10, False, 2, False, body) if loop == "scan" else Fori(1, 11, False, body)
    root = Seq((Log((("a", 1), ("b", 0))), looped, Log((("b", 0),))))
    xs, z0 = np.array([-0.69, -0.99, -1.29], np.float32), np.float32(-0.45)
    lock = LaneOracle(root, xs, np.full(3, z0))
    assert not lock.tie
    masks = np.array([m for _, _, m, _ in lock.slots[1:-1]])  # the loop's
    assert (~masks).all(axis=1).sum() >= 2 and masks.all(axis=1).any()  # none, some, all lanes
    assert (masks.any(axis=1) & ~masks.all(axis=1)).sum() >= 2
    f = as_function(root)
    rec = Recorder()
    eqx_logs.tap(jax.vmap(f, (0, None)), callback=rec, interval=interval)(xs, z0)
    assert_stream(rec.stream(), lock.batched_stream(interval), "tap(vmap)")
    rec = Recorder()
    jax.vmap(eqx_logs.tap(f, callback=rec, interval=interval), (0, None))(xs, z0)
    assert_stream(rec.stream(), lock.per_lane_stream(interval), "vmap(tap)")


# ----------------------------------------------------------------------------------------
# 5. tags, exclude, prefix, dropped keys; unselected events reach an enclosing spool
# ----------------------------------------------------------------------------------------

_DROP_PATTERNS = ("a", "b", "c", "n", "[ab]", "[!a]", "b*", "x")


@st.composite
def selections(draw):
    """`(select, drop, prefix, policy_kwargs, tap_kwargs)`: a random tag filter, rules that
    drop some keys (or name a reduction, which tap ignores), a prefix, split between a
    `Policy` and tap's keywords (a keyword overrides a decoy in the Policy)."""
    subsets = st.lists(st.sampled_from(TAGS), unique=True).map(tuple)
    tags = draw(st.one_of(st.none(), st.none(), subsets))
    exclude = draw(subsets)
    prefix = draw(st.sampled_from(["", "run/", "p_"]))
    patterns = draw(st.lists(st.sampled_from(_DROP_PATTERNS), unique=True, max_size=2))
    rules = {p: draw(st.sampled_from(["drop", "mean"])) for p in patterns}

    def select(t):
        if tags is not None and not set(t) & set(tags):
            return False
        return not set(t) & set(exclude)

    def drop(key):
        for pattern, rule in rules.items():
            if fnmatch.fnmatchcase(key, pattern):
                return rule == "drop"
        return False

    decoys = dict(tags=("eval",), exclude=TAGS, prefix="decoy/")
    policy_kw: dict = {"rules": rules}
    tap_kw: dict = {}
    for name, value in (("tags", tags), ("exclude", exclude), ("prefix", prefix)):
        where = draw(st.sampled_from(["policy", "tap", "both"]))
        if where != "policy" and value is None:
            where = "policy"  # tap(tags=None) keeps the policy's
        if where == "policy":
            policy_kw[name] = value
        else:
            tap_kw[name] = value
            if where == "both":
                policy_kw[name] = decoys[name]
    return select, drop, prefix, policy_kw, tap_kw


@budget(30)
@given(
    programs(tags=TAGS, loops=("scan", "fori")),
    x_shapes,
    st.data(),
    intervals,
    selections(),
    st.booleans(),
)
def test_selection_matches_oracle(root, shape, data, interval, selection, in_spool):
    """tags=/exclude= select log calls by their tags, rules drop keys, prefix= renames: the
    stream is the oracle's selected calls, then every k-th event of each remaining key. Inside
    a spool, the events tap does not select reach the spool (in order), the others do not."""
    assume(count_logs(root) > 0)
    root = data.draw(in_outer_scan(root))
    select, drop, prefix, policy_kw, tap_kw = selection
    x0, z0 = data.draw(inputs(shape))
    o = tap_oracle(root, x0, z0)
    dropped = {k for k in o.bounds if drop(k)}
    want = expected_stream(o.calls, interval, select, prefix, dropped)
    rec = Recorder()
    policy = eqx_logs.Policy(**policy_kw)
    tapped = eqx_logs.tap(
        as_function(root), callback=rec, policy=policy, interval=interval, **tap_kw
    )
    if in_spool:
        (x, z), logs = eqx_logs.spool(tapped)(x0, z0)
        passed = bounds(root, lambda t: not select(t))
        assert set(logs) == set(passed), f"spool got {sorted(logs)}, expected {sorted(passed)}"
        for key, bound in passed.items():
            events = [
                np.asarray(values[key], _key_dtype(key))
                for values, tags, _ in o.calls
                if key in values and not select(tags)
            ]
            stacked = padded(events, bound, _key_shape(key, o.x_shape), _key_dtype(key))
            assert_tree_allclose(np.asarray(logs[key]), stacked, what=f"spool logs[{key!r}]")
            assert int(logs.count[key]) == len(events), key
    else:
        x, z = tapped(x0, z0)
    assert_tree_allclose(np.asarray(x), np.asarray(o.out[0], np.float32), what="x")
    assert_tree_allclose(np.asarray(z), np.asarray(o.out[1], np.float32), what="z")
    assert_stream(rec.stream(), want)


# ----------------------------------------------------------------------------------------
# The oracles themselves; a bug found (shrunk by hand)
# ----------------------------------------------------------------------------------------


def test_expected_stream_and_lane_oracle():
    """expected_stream counts per key; the lock-step oracle runs both branches of a cond,
    false first, and a while loop until every lane is done."""
    calls = [({"a": 1, "b": 2}, (), {}), ({"a": 3}, (), {}), ({"b": 4, "a": 5}, (), {})]
    assert expected_stream(calls, 2) == [({"a": 1, "b": 2}, {}), ({"a": 5}, {})]
    assert expected_stream(calls, 1, prefix="p/", drop={"a"}) == [
        ({"p/b": 2}, {}),
        ({"p/b": 4}, {}),
    ]
    root = Seq(
        (
            Cond("x", 0.0, Log((("b", 0),)), Log((("b", 0),), ("eval",))),
            While(1, Log((("b", 0),)), "x", 0.0),
        )
    )
    lock = LaneOracle(root, np.array([1.0, -1.0], np.float32), np.float32(0.5))
    masks = [m.tolist() for _, _, m, _ in lock.slots]
    assert masks == [[False, True], [True, False], [True, True], [True, False]]
    assert [t for *_, t in lock.slots] == [("eval",), (), (), ()]
    for _, steps, _, _ in lock.slots:  # z > 0.2; sum(x) > -0.3 in lane 0 only
        np.testing.assert_array_equal(steps["s"], [3, 1])
    assert len(lock.per_lane_stream(1)) == 5
    batched = lock.batched_stream(2)
    assert len(batched) == 2
    np.testing.assert_array_equal(batched[0][0]["b"], [np.nan, -1.0])


def _unbatched_events(x):
    def step(c, i):
        eqx_logs.log("i", i)  # the loop index: not batched under vmap
        eqx_logs.log("x", x)
        return c, None

    lax.scan(step, 0, jnp.arange(2))
    eqx_logs.log("one", 1.0)
    return x


def test_vmap_of_tap_calls_unbatched_events_once_per_lane():
    """vmap(spool(f)) records an unbatched event in every lane; vmap(tap(f)) calls back once
    per lane too, as for batched values. (The bug, fixed in dbfbf79: an event whose operands
    were all unbatched reached the host once, because `jax.debug.callback` unrolls over lanes
    only when some operand is batched.)"""
    rec = Recorder()
    jax.vmap(eqx_logs.tap(_unbatched_events, callback=rec))(jnp.array([1.0, 2.0, 3.0]))
    got = [(k, float(v)) for logs, _ in rec.stream() for k, v in logs.items()]
    want = [("i", 0)] * 3 + [("x", 1), ("x", 2), ("x", 3)]
    want += [("i", 1)] * 3 + [("x", 1), ("x", 2), ("x", 3)] + [("one", 1.0)] * 3
    assert got == want
