"""Chunked tap, `tap(f, callback=cb, buffer=k)`: the events of each group of keys (keys logged
by exactly the same `log` calls) gathered on the device and delivered in blocks of k, with a
leading axis of events.

The reference is independent of the blocks: the UNBUFFERED tap of the same function, whose
per-event callbacks are regrouped here into the blocks `buffer=k` must deliver (a full block
as soon as its k-th event happens, in execution order; each group's partial block at the end
of the call); and numpy where the expected values are easy to write down.
"""

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

import eqx_logs as el

fast = pytest.mark.fast  # in `make test-fast`


# -- the reference: blocks rebuilt from the unbuffered tap --------------------------------------


class Recorder:
    """A tap callback keeping each call's `(logs, steps)`, copied to numpy."""

    def __init__(self):
        self.calls = []

    def __call__(self, logs, steps):
        logs = jax.tree.map(np.array, logs)
        self.calls.append((logs, {name: np.array(v) for name, v in steps.items()}))


def run_tap(f, *args, wrap=None, **options):
    """`tap(f, **options)` (wrapped by `wrap`, such as `jax.jit`) called on `args`; its output
    and the callbacks it made."""
    return tap_runner(f, wrap=wrap, **options)(*args)


def tap_runner(f, wrap=None, **options):
    """As `run_tap`, one tapped function (so one compilation) for many calls: `args` ->
    (output, the callbacks this call made)."""
    rec = Recorder()
    tapped = el.tap(f, callback=rec, **options)
    tapped = tapped if wrap is None else wrap(tapped)

    def run(*args):
        rec.calls = []
        out = tapped(*args)
        jax.block_until_ready(out)
        jax.effects_barrier()
        return out, rec.calls

    return run


def groups_of(calls) -> list[frozenset]:
    """The groups of keys the blocks show (each block holds one group's keys), disjoint."""
    groups = list(dict.fromkeys(frozenset(logs) for logs, _ in calls))
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            assert not a & b, f"key(s) {sorted(a & b)} in blocks of groups {a} and {b}"
    return groups


def expected_blocks(ref_calls, groups, k):
    """The blocks `buffer=k` must deliver, from the unbuffered tap's calls `ref_calls`: the
    full blocks in the order they fill, and the partial blocks (one per group, at the end).
    A block: (group, [(logs of the group's keys, steps) per event])."""
    group_of = {key: g for g in groups for key in g}
    pending = {g: [] for g in groups}
    full = []
    for logs, steps in ref_calls:
        missing = set(logs) - set(group_of)
        assert not missing, f"keys {sorted(missing)} of the unbuffered tap in no block"
        for g in dict.fromkeys(group_of[key] for key in logs):
            assert g <= set(logs), f"group {sorted(g)} logged apart: {sorted(logs)}"
            pending[g].append(({key: logs[key] for key in g}, steps))
            if len(pending[g]) == k:
                full.append((g, pending[g]))
                pending[g] = []
    partial = [(g, rows) for g, rows in pending.items() if rows]
    return full, partial


def assert_leaf(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if jnp.issubdtype(want.dtype, jnp.inexact):
        np.testing.assert_allclose(
            got.astype(np.float64),
            want.astype(np.float64),
            rtol=1e-6,
            atol=1e-7,
            equal_nan=True,
            err_msg=what,
        )
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def assert_block(block, rows, what):
    """A delivered block `(logs, steps)` holds the unbuffered events `rows`, in order."""
    logs, steps = block
    n = len(rows)
    assert set(logs) == set(rows[0][0]), f"{what}: keys {sorted(logs)}"
    for key in logs:
        got_leaves, got_def = jax.tree.flatten(logs[key])
        want_def = jax.tree.structure(rows[0][0][key])
        assert got_def == want_def, f"{what}[{key!r}]: structure {got_def} != {want_def}"
        for j, leaf in enumerate(got_leaves):
            leaf = np.asarray(leaf)
            assert leaf.shape[:1] == (n,), f"{what}[{key!r}]: {leaf.shape[:1]} != ({n},)"
            for i, (row, _) in enumerate(rows):
                want = jax.tree.leaves(row[key])[j]
                assert_leaf(leaf[i], want, f"{what}[{key!r}] leaf {j} event {i}")
    names = set().union(*(s for _, s in rows))
    assert names <= set(steps), f"{what}: steps {sorted(steps)} lack {sorted(names - set(steps))}"
    for name, got in steps.items():
        got = np.asarray(got)
        assert got.shape[:1] == (n,), f"{what}: steps[{name!r}] has {got.shape[:1]} events"
        for i, (_, s) in enumerate(rows):
            if name in s:
                want = s[name]
            elif name == "valid":  # the unbuffered call of an event in every lane has none
                want = np.ones(got.shape[1:], bool)
            else:  # a step this event's call does not name: -1
                want = np.full(got.shape[1:], -1, got.dtype)
            assert_leaf(got[i], want, f"{what}: steps[{name!r}] event {i}")


def assert_blocks(calls, ref_calls, k):
    """The buffered tap's `calls` are the blocks of k the unbuffered tap's `ref_calls` make."""
    full, partial = expected_blocks(ref_calls, groups_of(calls), k)
    assert len(calls) == len(full) + len(partial), (
        f"{len(calls)} blocks, expected {len(full)} full + {len(partial)} partial; got sizes "
        f"{[(sorted(logs), n) for (logs, _), n in zip(calls, sizes(calls))]}"
    )
    for i, (block, (_, rows)) in enumerate(zip(calls, full)):
        assert_block(block, rows, f"full block {i}")
    # the partial blocks come last, one per group (their order among groups is not said)
    tail = {frozenset(logs): (logs, steps) for logs, steps in calls[len(full) :]}
    assert set(tail) == {g for g, _ in partial}, f"partial blocks of {set(tail)}"
    for g, rows in partial:
        assert_block(tail[g], rows, f"partial block of {sorted(g)}")


def check(f, *args, k, wrap=None, ref=None, **options):
    """`tap(f, buffer=k)` against the unbuffered tap of `f`: same output, and the blocks its
    events make. Returns the buffered calls and the unbuffered ones."""
    return check_out(f, *args, k=k, wrap=wrap, ref=ref, **options)[1:]


def check_out(f, *args, k, wrap=None, ref=None, **options):
    """As `check`, also returning the buffered tap's output first. `ref`: the unbuffered
    tap's `(output, calls)` where the caller has run it already."""
    ref_out, ref_calls = run_tap(f, *args, wrap=wrap, **options) if ref is None else ref
    out, calls = run_tap(f, *args, wrap=wrap, buffer=k, **options)
    return out, *check_against(out, calls, ref_out, ref_calls, k)


def check_against(out, calls, ref_out, ref_calls, k):
    """The buffered tap's `out` and `calls` against the unbuffered tap's: same output, and
    the blocks its events make. Returns the buffered calls and the unbuffered ones."""
    jax.tree.map(lambda a, b: assert_leaf(a, b, "output"), out, ref_out)
    assert_blocks(calls, ref_calls, k)
    return calls, ref_calls


def stacked(calls, key):
    """A key's values over all blocks, concatenated (a pytree of arrays)."""
    parts = [logs[key] for logs, _ in calls if key in logs]
    return jax.tree.map(lambda *xs: np.concatenate(xs), *parts)


def stacked_step(calls, key, name):
    return np.concatenate([steps[name] for logs, steps in calls if key in logs])


def sizes(calls):
    return [len(jax.tree.leaves(logs)[0]) for logs, _ in calls]


@fast
def test_strict_promotion():
    """Strict dtype promotion (the suite's, and Equinox's, setting) in a loop."""
    with jax.numpy_dtype_promotion("strict"):
        _, calls = run_tap(_squares, jnp.arange(5.0), buffer=2)
    assert sizes(calls) == [2, 2, 1]


# -- a scan logging every step ----------------------------------------------------------------


def _squares(xs):
    def step(c, x):
        el.log("x2", x * x, step=c)
        return c + 1, x + 1.0

    return lax.scan(step, 0, xs)


@pytest.mark.parametrize(
    "k, want_sizes",
    [
        pytest.param(5, [5, 5], marks=fast, id="exactly-full"),
        pytest.param(4, [4, 4, 2], marks=fast, id="partial"),
        pytest.param(25, [10], id="k-above-events"),
        pytest.param(1, [1] * 10, id="k=1"),
        pytest.param(10, [10], id="k=events"),
    ],
)
def test_scan_every_step(k, want_sizes):
    xs = np.arange(10.0, dtype=np.float32) / 4
    calls, ref = check(_squares, jnp.asarray(xs), k=k)
    assert len(ref) == 10
    assert sizes(calls) == want_sizes
    np.testing.assert_array_equal(stacked(calls, "x2"), xs * xs)
    np.testing.assert_array_equal(stacked_step(calls, "x2", "step"), np.arange(10))
    for logs, steps in calls:
        assert set(logs) == {"x2"} and set(steps) == {"step"}
        assert logs["x2"].dtype == np.float32 and steps["step"].dtype == np.int32


@fast
def test_several_keys_with_pytree_values_in_one_call():
    def f(xs):
        def step(c, x):
            tree = {"w": jnp.stack([x, -x, 2 * x]), "pair": (x + 1, c * 3)}
            el.log({"a": x, "tree": tree, "flag": x > 2}, step=c, epoch=c // 3)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    xs = np.arange(7.0, dtype=np.float32)
    calls, _ = check(f, jnp.asarray(xs), k=3)
    assert [set(logs) for logs, _ in calls] == [{"a", "tree", "flag"}] * 3
    assert sizes(calls) == [3, 3, 1]
    tree = stacked(calls, "tree")
    np.testing.assert_array_equal(tree["w"], np.stack([xs, -xs, 2 * xs], 1))
    np.testing.assert_array_equal(tree["pair"][0], xs + 1)
    np.testing.assert_array_equal(tree["pair"][1], np.arange(7) * 3)
    np.testing.assert_array_equal(stacked(calls, "flag"), xs > 2)
    np.testing.assert_array_equal(stacked_step(calls, "a", "epoch"), np.arange(7) // 3)


def _two_groups(xs):
    """Groups: {"a"} (every step), {"b", "c"} (every step, one call), {"d"} (x > 3 only)."""

    def step(c, x):
        el.log("a", x, step=c)
        el.log({"b": 2 * x, "c": c}, step=c)
        lax.cond(x > 3, lambda: el.log("d", -x, step=c), lambda: None)
        return c + 1, None

    return lax.scan(step, 0, xs)[0]


@fast
def test_two_log_calls_make_two_groups_delivered_as_they_fill():
    xs = jnp.array([5.0, 1.0, 4.0, 0.0, 7.0, 2.0, 9.0, 8.0], jnp.float32)
    calls, _ = check(_two_groups, xs, k=3)
    assert set(groups_of(calls)) == {frozenset("a"), frozenset("bc"), frozenset("d")}
    # "a" and "b, c": 8 events each, in blocks of 3, 3, 2; "d": 5 (x > 3), blocks of 3, 2
    full = [sorted(logs) for logs, _ in calls[:5]]
    assert full == [["a"], ["b", "c"], ["d"], ["a"], ["b", "c"]]
    np.testing.assert_array_equal(stacked(calls, "d"), [-5, -4, -7, -9, -8])
    np.testing.assert_array_equal(stacked_step(calls, "d", "step"), [0, 2, 4, 6, 7])


def test_a_key_logged_by_more_calls_than_another_is_a_group_of_its_own():
    def f(xs):
        def step(c, x):
            el.log({"a": x, "b": x + 100}, step=c)
            el.log("a", -x, step=c)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    xs = np.arange(5.0, dtype=np.float32)
    calls, _ = check(f, jnp.asarray(xs), k=4)
    assert set(groups_of(calls)) == {frozenset("a"), frozenset("b")}
    np.testing.assert_array_equal(stacked(calls, "a"), np.stack([xs, -xs], 1).ravel())
    np.testing.assert_array_equal(stacked_step(calls, "a", "step"), np.repeat(np.arange(5), 2))
    np.testing.assert_array_equal(stacked(calls, "b"), xs + 100)


# -- interval ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=fast)])
def test_interval_without_step_keeps_every_third_event(k):
    def f(xs):
        def step(c, x):
            el.log("x", x)
            lax.cond(x > 3, lambda: el.log("big", x * 10), lambda: None)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    xs = np.array([5, 1, 4, 0, 7, 2, 9, 8, 6, 3, 11], np.float32)
    calls, ref = check(f, jnp.asarray(xs), k=k, interval=3)
    np.testing.assert_array_equal(stacked(calls, "x"), xs[::3])
    np.testing.assert_array_equal(stacked(calls, "big"), (xs[xs > 3] * 10)[::3])
    assert len(ref) == len(xs[::3]) + len(xs[xs > 3][::3])


@pytest.mark.parametrize("k", [1, 2])
def test_interval_with_a_step_keeps_steps_that_are_multiples(k):
    def f(xs):
        def step(c, x):
            # kept by its step's value (c + 1 = 3, 6, 9), not by its count (0, 3, 6, 9)
            el.log("x", x, step=c + 1)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    xs = np.arange(10.0, dtype=np.float32) * 2
    calls, _ = check(f, jnp.asarray(xs), k=k, interval=3)
    np.testing.assert_array_equal(stacked_step(calls, "x", "step"), [3, 6, 9])
    np.testing.assert_array_equal(stacked(calls, "x"), xs[[2, 5, 8]])


def test_interval_in_a_while_loop_with_lazy_values():
    def f(n):
        def body(i):
            el.log("s", jnp.sin(i * 1.0), step=i)  # computed only for the logs
            return i + 1

        return lax.while_loop(lambda i: i < n, body, 0)

    calls, _ = check(f, jnp.int32(11), k=2, interval=3)
    np.testing.assert_array_equal(stacked_step(calls, "s", "step"), [0, 3, 6, 9])
    np.testing.assert_allclose(stacked(calls, "s"), np.sin([0.0, 3, 6, 9]), rtol=1e-6)


def test_on_a_gpu_a_lazy_row_is_written_rather_than_branched_to(monkeypatch):
    # XLA:GPU decides a conditional on the host (`_branching.py`): there a row of lazy values
    # is computed and written at every event, the next event overwriting a row not kept. The
    # CPU made one of the platforms that compute: one conditional fewer, the same blocks.
    from eqx_logs import _branching

    def f(n):
        def body(i):
            el.log("s", jnp.sin(i * 1.0), step=i)  # computed only for the logs
            return i + 1

        return lax.while_loop(lambda i: i < n, body, 0)

    runs = {}
    for selecting in (("cuda", "rocm"), ("cpu", "cuda", "rocm")):
        monkeypatch.setattr(_branching, "SELECTING", selecting)
        rec = Recorder()
        tapped = jax.jit(el.tap(f, callback=rec, buffer=2, interval=3))
        compiled = tapped.lower(jnp.int32(11)).compile()  # the program counted is the one run
        conditionals = compiled.as_text().count(" conditional(")
        ref = run_tap(f, jnp.int32(11), interval=3, wrap=jax.jit)
        out = compiled(jnp.int32(11))
        jax.block_until_ready(out)
        jax.effects_barrier()
        calls, _ = check_against(out, rec.calls, *ref, k=2)
        runs[selecting] = (conditionals, calls)
    (branching, want), (computing, got) = runs.values()
    assert computing == branching - 1
    assert len(got) == len(want) == 2
    for (logs, steps), (want_logs, want_steps) in zip(got, want):
        np.testing.assert_array_equal(logs["s"], want_logs["s"])
        np.testing.assert_array_equal(steps["step"], want_steps["step"])
    np.testing.assert_allclose(stacked(got, "s"), np.sin([0.0, 3, 6, 9]), rtol=1e-6)


# -- cond, while, nested scans ----------------------------------------------------------------


@fast
def test_event_inside_cond_is_data_dependent():
    def f(xs):
        def step(c, x):
            lax.cond(
                x > 0.5,
                lambda: el.log("hi", x, step=c),
                lambda: el.log("lo", -x, step=c),
            )
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    xs = np.asarray(jax.random.uniform(jax.random.key(0), (23,)))
    calls, _ = check(f, jnp.asarray(xs), k=4)
    np.testing.assert_array_equal(stacked(calls, "hi"), xs[xs > 0.5])
    np.testing.assert_array_equal(stacked(calls, "lo"), -xs[xs <= 0.5])
    np.testing.assert_array_equal(stacked_step(calls, "hi", "step"), np.flatnonzero(xs > 0.5))


def _collatz(n):
    def body(carry):
        i, m = carry
        el.log({"m": m}, step=i)
        m = jnp.where(m % 2 == 0, m // 2, 3 * m + 1)
        return i + 1, m

    return lax.while_loop(lambda c: c[1] != 1, body, (0, n))[0]


@pytest.mark.parametrize("n", [pytest.param(6, marks=fast), 27, 1])
def test_while_loop_with_a_data_dependent_trip_count(n):
    calls, ref = check(_collatz, jnp.int32(n), k=5)
    seq = [n]
    while seq[-1] != 1:
        m = seq[-1]
        seq.append(m // 2 if m % 2 == 0 else 3 * m + 1)
    want = np.array(seq[:-1], np.int32)
    assert len(ref) == len(want)
    if n == 1:
        assert calls == []  # no event, no block (not even an empty one)
        return
    np.testing.assert_array_equal(stacked(calls, "m"), want)
    np.testing.assert_array_equal(stacked_step(calls, "m", "step"), np.arange(len(want)))
    assert sizes(calls) == [5] * (len(want) // 5) + ([len(want) % 5] if len(want) % 5 else [])


def test_nested_scans():
    def f(xs):
        def outer(o, row):
            def inner(i, x):
                el.log("x", x, epoch=o, step=i)
                return i + 1, None

            lax.scan(inner, 0, row)
            el.log("row", row.sum(), epoch=o)
            return o + 1, None

        return lax.scan(outer, 0, xs)[0]

    xs = np.arange(12.0, dtype=np.float32).reshape(3, 4)
    calls, _ = check(f, jnp.asarray(xs), k=5)
    np.testing.assert_array_equal(stacked(calls, "x"), xs.ravel())
    np.testing.assert_array_equal(stacked_step(calls, "x", "epoch"), np.repeat(np.arange(3), 4))
    np.testing.assert_array_equal(stacked_step(calls, "x", "step"), np.tile(np.arange(4), 3))
    np.testing.assert_array_equal(stacked(calls, "row"), xs.sum(1))
    blocks = [(sorted(logs), n) for (logs, _), n in zip(calls, sizes(calls))]
    assert blocks[:2] == [(["x"], 5), (["x"], 5)]
    assert sorted(blocks[2:]) == [(["row"], 3), (["x"], 2)]  # the partial blocks, at the end


def test_a_full_block_arrives_with_its_last_event():
    """Full blocks are sent as they fill, in program order with other host callbacks: here an
    enclosing unbuffered tap's, of events tagged apart. A block arrives in the iteration of
    its last event (after that event, or at the end of that iteration, where a scan is split
    into blocks: `_tap/_split.py`, `ScanSplit.blocked`), before the next iteration's callbacks."""
    order = []

    def f(xs):
        def step(c, x):
            el.log("x", x, tags="blocks")
            el.log("tick", c, tags="ticks")
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    inner = el.tap(f, tags="blocks", buffer=3, callback=lambda logs, s: order.append(logs))
    el.tap(inner, tags="ticks", callback=lambda logs, s: order.append(logs))(jnp.arange(7.0))
    jax.effects_barrier()
    got = [("x", list(map(float, v["x"]))) if "x" in v else ("tick", int(v["tick"])) for v in order]
    ticks = [g for g in got if g[0] == "tick"]
    assert ticks == [("tick", i) for i in range(7)]
    blocks = [g for g in got if g[0] == "x"]
    assert blocks == [("x", [0.0, 1.0, 2.0]), ("x", [3.0, 4.0, 5.0]), ("x", [6.0])]
    for block, last in zip(blocks, (2, 5, 6)):  # the iteration of the block's last event
        at = got.index(block)
        assert got.index(("tick", last - 1)) < at, got
        if last < 6:
            assert at < got.index(("tick", last + 1)), got


@fast
def test_tags_exclude_and_prefix_apply_to_blocks():
    def f(xs):
        def step(c, x):
            el.log({"a": x, "b": -x}, step=c, tags="train")
            el.log("dbg", x * 2, tags="debug")
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    xs = jnp.arange(5.0)
    calls, _ = check(f, xs, k=2, exclude="debug", prefix="run/")
    assert [sorted(logs) for logs, _ in calls] == [["run/a", "run/b"]] * 3
    np.testing.assert_array_equal(stacked(calls, "run/b"), -np.arange(5.0))
    calls, _ = check(f, xs, k=2, tags="debug")
    assert [sorted(logs) for logs, _ in calls] == [["dbg"]] * 3


# -- transformations --------------------------------------------------------------------------


@fast
def test_jit_of_buffered_tap_equals_eager_and_repeats_per_call():
    xs = jnp.array([5.0, 1.0, 4.0, 0.0, 7.0, 2.0, 9.0], jnp.float32)
    _, eager = run_tap(_two_groups, xs, buffer=3)
    rec = Recorder()
    jitted = jax.jit(el.tap(_two_groups, callback=rec, buffer=3))
    for _ in range(2):
        jitted(xs)
    jax.effects_barrier()
    assert len(rec.calls) == 2 * len(eager)
    for calls in (rec.calls[: len(eager)], rec.calls[len(eager) :]):
        for i, (got, want) in enumerate(zip(calls, eager)):
            assert_block(got, _rows(want), f"jit block {i}")


def _rows(block):
    """A delivered block as the per-event rows `assert_block` compares with."""
    logs, steps = block
    n = len(jax.tree.leaves(logs)[0])
    return [
        (jax.tree.map(lambda x: x[i], logs), {name: v[i] for name, v in steps.items()})
        for i in range(n)
    ]


@pytest.mark.parametrize("remat", [False, True], ids=["plain", "checkpoint"])
def test_grad_of_buffered_tap_delivers_forward_events_once(remat):
    def loss(w, xs):
        def step(c, x):
            el.log("c", c, step=x.astype(jnp.int32))
            return jnp.sin(c * w + x), None

        body = jax.checkpoint(step) if remat else step
        return lax.scan(body, jnp.float32(0.5), xs)[0]

    xs = jnp.arange(7.0)
    rec = Recorder()
    g = jax.grad(el.tap(loss, callback=rec, buffer=3))(jnp.float32(1.2), xs)
    jax.effects_barrier()
    ref_out, ref = run_tap(jax.grad(loss), jnp.float32(1.2), xs)
    assert len(ref) == 7
    assert len(rec.calls) == 3 and sizes(rec.calls) == [3, 3, 1]
    assert_blocks(rec.calls, ref, 3)
    c = [0.5]
    for x in range(6):
        c.append(float(np.sin(c[-1] * 1.2 + x)))
    np.testing.assert_allclose(stacked(rec.calls, "c"), c, rtol=1e-5)
    np.testing.assert_allclose(g, jax.grad(loss)(jnp.float32(1.2), xs), rtol=1e-6)
    # tap outside grad: the same blocks
    calls, _ = check(jax.grad(loss), jnp.float32(1.2), xs, k=3, ref=(ref_out, ref))
    assert len(calls) == 3


def _lane_program(x, n):
    """A lane's events: a while loop of `n` iterations and a cond on `x`; each event also logs
    the lane's own `x`, to tell the lanes' blocks apart."""

    def body(i):
        el.log({"w": x * i, "lane": x}, step=i)
        lax.cond(x * i > 4, lambda: el.log({"big": x * i, "lane2": x}), lambda: None)
        return i + 1

    return lax.while_loop(lambda i: i < n, body, 0)


@pytest.mark.parametrize("interval", [pytest.param(1, marks=fast), 2])
def test_vmap_of_buffered_tap_gives_each_lane_its_own_blocks(interval):
    xs = jnp.array([1.0, 3.0, 0.5, 2.0], jnp.float32)
    ns = jnp.array([7, 2, 0, 5], jnp.int32)
    k = 3
    out, calls = run_tap(_lane_program, xs, ns, wrap=jax.vmap, buffer=k, interval=interval)
    np.testing.assert_array_equal(out, ns)
    alone = tap_runner(_lane_program, interval=interval)  # one tap for the lanes' references
    for lane, (x, n) in enumerate(zip(xs, ns)):
        # this lane's blocks: those whose lane key is this lane's x
        mine = [
            (logs, steps)
            for logs, steps in calls
            if np.all(logs.get("lane", logs.get("lane2")) == x)
        ]
        _, ref = alone(x, n)
        assert_blocks(mine, ref, k)
        w = stacked(mine, "w") if mine else np.zeros(0)
        want = float(x) * np.arange(0, int(n), interval)
        np.testing.assert_array_equal(w, want, err_msg=f"lane {lane}")


def test_vmap_of_buffered_tap_gives_each_lane_blocks_of_unbatched_values():
    def f(x):
        def step(c, _):
            el.log("i", c)  # the same in every lane
            el.log("xi", x * c, step=c)
            return c + 1, None

        return lax.scan(step, 0, None, length=5)[0]

    xs = jnp.arange(3.0)
    _, ref = run_tap(f, xs, wrap=jax.vmap)
    assert sum("i" in logs for logs, _ in ref) == 15  # each lane's own events
    _, calls = run_tap(f, xs, wrap=jax.vmap, buffer=2)
    i_blocks = [logs["i"].tolist() for logs, _ in calls if "i" in logs]
    assert i_blocks == [[0, 1]] * 3 + [[2, 3]] * 3 + [[4]] * 3


def _masked_program(xs):
    """A vmap inside the tapped function: "x" in every lane, "big" where a batched cond holds,
    and a while loop whose lanes run different numbers of iterations."""

    def lane(x):
        def step(c, _):
            el.log("x", x * c, step=c)
            lax.cond(x * c > 3, lambda: el.log({"big": x * c, "ibig": c}, step=c), lambda: None)
            return c + 1, None

        lax.scan(step, 0, None, length=5)

        def body(i):
            el.log("w", x + i, it=i)
            return i + 1

        return lax.while_loop(lambda i: i < x.astype(jnp.int32), body, 0)

    return jax.vmap(lane)(xs)


@pytest.mark.parametrize("k", [2, pytest.param(4, marks=fast)])
def test_vmap_inside_with_a_batched_cond_gives_the_valid_lanes(k):
    xs = jnp.array([0.0, 1.0, 2.0, 4.0], jnp.float32)
    calls, ref = check(_masked_program, xs, k=k)
    # the unbuffered tap's "valid" per event, in order, is the blocks' steps["valid"]
    for key in ("big", "w"):
        want = np.stack([s["valid"] for logs, s in ref if key in logs])
        got = stacked_step(calls, key, "valid")
        assert got.shape == (len(want), 4) and got.dtype == np.bool_
        np.testing.assert_array_equal(got, want)
    # numpy: lane x, step c: "big" happened where x * c > 3; NaN in the other lanes
    x, c = np.meshgrid(np.asarray(xs), np.arange(5))
    happened = x * c > 3
    some = happened.any(1)  # an event where it happened in some lane: not at c = 0
    assert list(some) == [False, True, True, True, True]
    np.testing.assert_array_equal(stacked_step(calls, "big", "valid"), happened[some])
    want = np.where(happened, x * c, np.nan)[some]
    np.testing.assert_array_equal(stacked(calls, "big"), want)
    np.testing.assert_array_equal(stacked(calls, "ibig"), c[some])  # integers: as computed
    # "x" happened in every lane: all valid
    assert stacked_step(calls, "x", "valid").shape == (5, 4)
    assert stacked_step(calls, "x", "valid").all()
    np.testing.assert_array_equal(stacked(calls, "x"), x * c)
    # "w": lanes run 0, 1, 2, 4 iterations
    np.testing.assert_array_equal(
        stacked_step(calls, "w", "valid"), np.arange(4)[:, None] < np.asarray(xs)
    )


# -- dtypes -----------------------------------------------------------------------------------


def _typed(dtype):
    def f(xs):
        def step(c, x):
            el.log({"v": x.astype(dtype), "m": jnp.stack([x, x + 1]).astype(dtype)}, step=c)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    return f


@pytest.mark.parametrize("name", [pytest.param("int8", marks=fast), "bfloat16", "float64"])
def test_dtypes_are_kept(name):
    dtype = {"bfloat16": ml_dtypes.bfloat16}.get(name, np.dtype(name))
    xs = np.array([1.5, -3.25, 100.0, 7.0, -60.5, 0.125, 2.0], np.float64)
    with jax.enable_x64(name == "float64"):
        calls, _ = check(_typed(dtype), jnp.asarray(xs), k=3)
    assert sizes(calls) == [3, 3, 1]
    v = stacked(calls, "v")
    assert v.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(v, xs.astype(dtype))
    np.testing.assert_array_equal(stacked(calls, "m"), np.stack([xs, xs + 1], 1).astype(dtype))
    if name == "float64":  # not rounded through float32
        np.testing.assert_array_equal(stacked(calls, "v"), xs)


def test_bfloat16_lanes_where_the_event_did_not_happen_are_nan():
    def f(xs):
        def lane(x):
            lax.cond(
                x > 1,
                lambda: el.log({"h": x.astype(jnp.float16), "b": x.astype(jnp.bfloat16)}),
                lambda: None,
            )
            return x

        return jax.vmap(lane)(xs)

    _, calls = run_tap(f, jnp.arange(4.0), buffer=2)
    ((logs, steps),) = calls
    np.testing.assert_array_equal(steps["valid"], [[False, False, True, True]])
    np.testing.assert_array_equal(logs["h"].astype(np.float32), [[np.nan, np.nan, 2, 3]])
    np.testing.assert_array_equal(logs["b"].astype(np.float32), [[np.nan, np.nan, 2, 3]])


# -- real libraries ---------------------------------------------------------------------------


def test_diffrax_fixed_step_solve():
    def solve(y0):
        def vector_field(t, y, args):
            el.log({"y": y, "t": t})
            return -2.0 * y

        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vector_field),
            diffrax.Euler(),
            t0=0.0,
            t1=1.0,
            dt0=0.05,
            y0=y0,
            saveat=diffrax.SaveAt(t1=True),
            max_steps=64,
        )
        return sol.ys[-1], sol.stats["num_steps"]

    y0 = jnp.array([1.0, -0.5], jnp.float32)
    (y1, steps), calls, ref = check_out(solve, y0, k=8)
    assert int(steps) == 20 and len(ref) == 20  # Euler: one evaluation per step
    assert sizes(calls) == [8, 8, 4]
    # numpy: Euler's iterates, at t = 0, 0.05, ..., 0.95
    ys = [np.asarray(y0)]
    for _ in range(19):
        ys.append(ys[-1] * (1 - 2.0 * 0.05))
    np.testing.assert_allclose(stacked(calls, "y"), np.stack(ys), rtol=1e-5)
    np.testing.assert_allclose(stacked(calls, "t"), np.arange(20) * 0.05, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y1, ys[-1] * (1 - 2.0 * 0.05), rtol=1e-5)


def test_optax_equinox_training_scan(standard_promotion):
    model = eqx.nn.MLP(2, 1, 8, 1, key=jax.random.key(0))
    opt = optax.adam(1e-2)
    x = jax.random.normal(jax.random.key(1), (16, 2))
    y = jnp.sin(x.sum(1, keepdims=True))

    def train(model, opt_state):
        params, static = eqx.partition(model, eqx.is_array)

        def step(carry, i):
            params, opt_state = carry

            def loss_fn(p):
                m = eqx.combine(p, static)
                return jnp.mean((jax.vmap(m)(x) - y) ** 2)

            loss, grads = jax.value_and_grad(loss_fn)(params)
            norms = [jnp.linalg.norm(layer.weight) for layer in grads.layers]
            el.log({"loss": loss, "grad_norms": norms}, step=i)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        (params, opt_state), losses = lax.scan(step, (params, opt_state), jnp.arange(12))
        return losses

    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    _, ref = run_tap(train, model, opt_state)
    losses, calls = run_tap(train, model, opt_state, buffer=5)
    assert_blocks(calls, ref, 5)
    assert sizes(calls) == [5, 5, 2]
    np.testing.assert_allclose(stacked(calls, "loss"), losses, rtol=1e-6)  # the scan's outputs
    assert losses[-1] < losses[0]
    norms = stacked(calls, "grad_norms")
    assert len(norms) == len(model.layers) and all(n.shape == (12,) for n in norms)
    np.testing.assert_array_equal(stacked_step(calls, "loss", "step"), np.arange(12))


# -- errors -----------------------------------------------------------------------------------


@fast
@pytest.mark.parametrize(
    "buffer, error",
    [
        (2.0, TypeError),
        ("3", TypeError),
        (True, TypeError),
        (jnp.int32(3), TypeError),
        (0, ValueError),
        (-2, ValueError),
    ],
    ids=repr,
)
def test_bad_buffer_raises_naming_the_option(buffer, error):
    with pytest.raises(error, match=r"buffer"):
        el.tap(_squares, callback=Recorder(), buffer=buffer)
    with pytest.raises(error, match=r"buffer"):
        el.tap(callback=Recorder(), buffer=buffer)  # the decorator form, too


@fast
def test_numpy_int_buffer_is_accepted():
    _, calls = run_tap(_squares, jnp.arange(5.0), buffer=np.int64(2))
    assert sizes(calls) == [2, 2, 1]


def test_key_logged_inside_shard_map_raises_naming_it():
    mesh = jax.make_mesh((1,), ("d",), axis_types=(AxisType.Auto,))

    def f(xs):
        def inner(x):
            el.log("sharded_key", x.sum())
            return x * 2

        return jax.shard_map(inner, mesh=mesh, in_specs=P("d"), out_specs=P("d"))(xs)

    _, ref = run_tap(f, jnp.arange(4.0))  # unbuffered: fine
    assert len(ref) == 1
    with pytest.raises(ValueError, match=r"'sharded_key'.*shard_map"):
        run_tap(f, jnp.arange(4.0), buffer=2)


def test_key_logged_as_lanes_raises_naming_it():
    def f(xs):
        def g(x):
            el.log("lane_key", x)
            return x + 1

        return lax.map(g, xs, batch_size=2)  # 5 = 2 * 2 + a remainder of 1

    _, ref = run_tap(f, jnp.arange(5.0))  # unbuffered: fine
    assert ref
    with pytest.raises(ValueError, match=r"'lane_key'.*buffer"):
        run_tap(f, jnp.arange(5.0), buffer=2)


# -- logger.tap(buffer=k): blocks reach the writer, each event a row of its own -----------------


def _logger_rows(tmp_path, buffer):
    import json

    from eqx_logs.loggers import JsonlLogger

    def f(xs):
        def step(c, x):
            el.log({"loss": x * x, "p": {"a": x, "b": -x}}, step=c)
            return c + 1, None

        el.log("total", xs.sum())
        return lax.scan(step, 0, xs)[0]

    path = tmp_path / f"run{buffer}.jsonl"
    with JsonlLogger(path) as logger:
        jax.jit(logger.tap(f, logger.init(), buffer=buffer))(jnp.arange(8.0))
        jax.effects_barrier()
    with open(path) as file:
        return [json.loads(line) for line in file]


@fast
@pytest.mark.parametrize("buffer", [1, 3, 100])
def test_logger_tap_buffer_writes_every_event_in_order(tmp_path, buffer):
    """The JSONL file of `logger.tap(f, state, buffer=k)` holds, key by key, the rows the
    unbuffered `logger.tap` writes (read back with `json`): values, pytree values, steps."""
    reference = _logger_rows(tmp_path, None)
    rows = _logger_rows(tmp_path, buffer)
    loss = [r for r in reference if r["key"] == "loss"]
    assert [r["value"] for r in loss] == (np.arange(8.0) ** 2).tolist()
    assert [r["step"] for r in loss] == list(range(8))
    keys = {r["key"] for r in reference}
    assert {r["key"] for r in rows} == keys and len(keys) >= 3
    for key in keys:
        assert [r for r in rows if r["key"] == key] == [r for r in reference if r["key"] == key]


def test_logger_tap_buffer_rejects_a_bad_size(tmp_path):
    from eqx_logs.loggers import JsonlLogger

    with JsonlLogger(tmp_path / "x.jsonl") as logger:
        with pytest.raises(ValueError, match="buffer=0"):
            logger.tap(lambda x: x, logger.init(), buffer=0)


# -- the scan split into blocks agrees with the carried block ------------------------------------


@fast
@pytest.mark.parametrize("k", [1, 3, 4, 7, 12, 50])
@pytest.mark.parametrize("start", [0, 2])
def test_blocked_scan_equals_the_carried_block(monkeypatch, k, start):
    """A scan logging each group once per iteration is split into blocks (`_tap/_split.py`,
    `ScanSplit.blocked`: counted here, so the test fails if it stops applying); with the split
    turned off, every event is written into the block carried through the scan. Both must
    deliver the same blocks, in the same order, entered with `start` events already in the
    block (logs before the scan), and the scan's own outputs must not change."""
    from eqx_logs._tap._split import ScanSplit

    def f(xs):
        for i in range(start):
            el.log({"x": xs[i], "p": {"a": xs[i] * 2}}, step=i)

        def step(c, x):
            el.log({"x": x * c.astype(x.dtype), "p": {"a": x + 1.0}}, step=c)
            return c + 1, x * 2

        return lax.scan(step, jnp.int32(start), xs)

    xs = jnp.arange(12.0)
    taken = []
    original = ScanSplit.blocked

    def counted(*args):
        out = original(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(ScanSplit, "blocked", counted)
    split_out, split = run_tap(f, xs, wrap=jax.jit, buffer=k)
    assert taken == [True]
    monkeypatch.setattr(ScanSplit, "blocked", lambda *args: None)
    carried_out, carried = run_tap(f, xs, wrap=jax.jit, buffer=k)
    jax.tree.map(np.testing.assert_array_equal, split_out, carried_out)
    assert sizes(split) == sizes(carried)
    for (a, sa), (b, sb) in zip(split, carried):
        jax.tree.map(np.testing.assert_array_equal, (a, sa), (b, sb))
    n = start + 12
    assert sum(sizes(split)) == n and all(s == k for s in sizes(split)[: n // k])
