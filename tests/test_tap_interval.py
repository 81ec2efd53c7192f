"""tap with an interval: counters known at trace time, and scans split into iterations with and
without events. Checked against events and outputs computed with numpy. The events log their
position as `index`, not `step`: an event with a `step` is kept by its step value instead
(tests/test_interval.py)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_logs as el


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, logs, steps):
        self.events.append(({k: np.asarray(v) for k, v in logs.items()}, dict(steps)))

    def values(self, key):
        jax.effects_barrier()
        return [logs[key].tolist() for logs, _ in self.events if key in logs]


def _program(xs, pre, together=True, reverse=False, nested=False):
    for j in range(pre):  # events before the scan shift the interval's phase
        el.log("a", jnp.float32(-1 - j))
        if together:
            el.log("b", jnp.float32(-1 - j))

    def inner(x):
        el.log({"a": x, "b": 2 * x} if together else {"a": x}, index=jnp.int32(x))
        if not together:
            el.log("b", 2 * x)
        return x

    def step(c, x):
        x = jax.jit(inner)(x) if nested else inner(x)
        return c + x, (3 * x, c)

    c, ys = lax.scan(step, jnp.float32(0), xs, reverse=reverse)
    el.log("a", c)
    if together:
        el.log("b", c)
    return c, ys


def _expected(xs, pre, k, reverse=False):
    order = xs[::-1] if reverse else xs
    a = [-1.0 - j for j in range(pre)] + [float(x) for x in order] + [float(np.sum(xs))]
    return a[::k]


CASES = list(itertools.product([0, 1, 5, 7, 10, 23], [2, 3, 5], [0, 1, 2, 4]))


@pytest.mark.parametrize("length,k,pre", CASES)
def test_events_and_outputs_match_numpy(length, k, pre):
    xs = np.arange(1, length + 1, dtype=np.float32)
    rec = Recorder()
    c, (ys, cs) = jax.jit(el.tap(_program, callback=rec, interval=k), static_argnums=1)(
        jnp.asarray(xs), pre
    )
    assert rec.values("a") == _expected(xs, pre, k)
    assert rec.values("b") == _b_expected(xs, pre, k)
    np.testing.assert_allclose(float(c), xs.sum())
    np.testing.assert_allclose(np.asarray(ys), 3 * xs)
    np.testing.assert_allclose(np.asarray(cs), (np.cumsum(xs) - xs).astype(np.float32))
    # the step logged with each kept event is that event's own
    steps = [int(s["index"]) for logs, s in rec.events if "index" in s]
    stream = [None] * pre + [int(x) for x in xs] + [None]
    assert steps == [s for s in stream[::k] if s is not None]


def _b_expected(xs, pre, k):
    b = [-1.0 - j for j in range(pre)] + [2 * float(x) for x in xs] + [float(np.sum(xs))]
    return b[::k]


@pytest.mark.parametrize("length,k,pre", [(23, 5, 2), (10, 3, 0), (7, 2, 1)])
@pytest.mark.parametrize("variant", ["separate", "reverse", "nested"])
def test_variants_match_numpy(length, k, pre, variant):
    """Separate log calls (so counters in different phases), a reversed scan (not split), and a
    body calling a jitted function that logs."""
    xs = np.arange(1, length + 1, dtype=np.float32)
    options = {
        "separate": dict(together=False),
        "reverse": dict(reverse=True),
        "nested": dict(nested=True),
    }[variant]
    rec = Recorder()
    out = el.tap(lambda xs: _program(xs, pre, **options), callback=rec, interval=k)(jnp.asarray(xs))
    reverse = options.get("reverse", False)
    assert rec.values("a") == _expected(xs, pre, k, reverse=reverse)
    if variant == "separate":  # "b" has no events before the scan
        b = [2 * float(x) for x in xs][::k]
        assert rec.values("b") == b
    else:
        order = xs[::-1] if reverse else xs
        b = [-1.0 - j for j in range(pre)] + [2 * float(x) for x in order] + [float(xs.sum())]
        assert rec.values("b") == b[::k]
    np.testing.assert_allclose(float(out[0]), xs.sum())
    ys = 3 * xs
    np.testing.assert_allclose(np.asarray(out[1][0]), ys)


def test_split_scan_has_no_per_iteration_cond():
    """The kept and skipped iterations are separated at trace time: no `cond` is compiled."""
    f = el.tap(lambda xs: _program(xs, 0), callback=lambda logs, steps: None, interval=4)
    text = str(jax.make_jaxpr(f)(jnp.arange(1.0, 11.0)))
    assert "cond[" not in text
    assert text.count("eqx_logs.host") >= 1


def test_skipped_iterations_still_pass_other_events_to_an_enclosing_spool():
    def f(xs):
        def step(c, x):
            el.log("tapped", x, tags="t")
            el.log("spooled", x)
            return c + x, None

        return lax.scan(step, 0.0, xs)[0]

    rec = Recorder()
    xs = jnp.arange(10.0)
    out, logs = el.spool(el.tap(f, callback=rec, interval=4, tags="t"))(xs)
    assert rec.values("tapped") == [0.0, 4.0, 8.0]
    np.testing.assert_array_equal(np.asarray(logs["spooled"]), np.arange(10.0))
    assert float(out) == 45.0


def test_split_scan_under_grad_and_vmap():
    def f(w, xs):
        def step(c, x):
            el.log("c", c)
            return c * w + x, None

        return lax.scan(step, 1.0, xs)[0]

    xs = jnp.arange(6.0)
    rec = Recorder()
    g = jax.grad(el.tap(f, callback=rec, interval=2))(2.0, xs)
    ref = jax.grad(f)(2.0, xs)
    np.testing.assert_allclose(float(g), float(ref))
    cs, c = [], 1.0
    for x in range(6):
        cs.append(c)
        c = c * 2.0 + x
    assert rec.values("c") == cs[::2]

    rec = Recorder()
    ws = jnp.array([1.0, 2.0])
    out = el.tap(jax.vmap(f, in_axes=(0, None)), callback=rec, interval=3)(ws, xs)
    np.testing.assert_allclose(np.asarray(out), jax.vmap(f, in_axes=(0, None))(ws, xs))
    got = rec.values("c")
    assert len(got) == 2 and all(len(v) == 2 for v in got)


@pytest.mark.parametrize("length,k,pre", [(10, 3, 0), (10, 3, 2), (4, 5, 1), (1, 2, 0), (0, 2, 1)])
def test_fori_loop_without_xs(length, k, pre):
    """fori_loop with a static trip count is a scan with no xs."""

    def f(c):
        for j in range(pre):
            el.log("c", jnp.float32(-1 - j), index=jnp.int32(-1))

        def body(i, c):
            el.log("c", c, index=i)
            return c + 1.0

        return lax.fori_loop(0, length, body, c)

    rec = Recorder()
    out = el.tap(f, callback=rec, interval=k)(jnp.float32(1.0))
    assert float(out) == 1.0 + length
    stream = [(-1.0 - j, -1) for j in range(pre)] + [(1.0 + i, i) for i in range(length)]
    assert rec.values("c") == [v for v, _ in stream[::k]]
    assert [int(s["index"]) for _, s in rec.events] == [s for _, s in stream[::k]]


def test_checkpoint_under_grad_fires_once_and_passes_other_events_on_once():
    """A checkpointed function is recomputed in the backward pass; its tapped events fire once,
    and the events tap does not select reach an enclosing spool once."""

    def f(x):
        def body(x):
            el.log("mine", x, tags="t")
            el.log("other", 2 * x)
            return jnp.sin(x)

        return jax.checkpoint(body)(x)

    rec = Recorder()
    grad, logs = el.spool(jax.grad(el.tap(f, callback=rec, tags="t")))(jnp.float32(0.5))
    np.testing.assert_allclose(float(grad), np.cos(0.5), rtol=1e-6)
    assert rec.values("mine") == [0.5]
    np.testing.assert_allclose(np.asarray(logs["other"]), [1.0])


# -- a step batched by a vmap inside the tap: the interval keeps each lane's own steps -----------
# (issue 34). The reference is each lane alone: its events and their steps written down in
# numpy, and what `jax.vmap(tap(f, interval=k))` and `spool(jax.vmap(f), interval=k)` keep. A
# delivery of `tap(jax.vmap(f), interval=k)` holds the lanes that keep the event as valid, and
# is made only where some lane keeps it.


class Deliveries:
    """A tap callback keeping each call; `per_lane` reads them lane by lane."""

    def __init__(self):
        self.calls = []

    def __call__(self, logs, steps):
        self.calls.append((jax.tree.map(np.array, logs), jax.tree.map(np.array, steps)))

    def per_lane(self, key, lanes):
        """Each lane's `(step, value)` pairs, in order, from the deliveries of a tap of a vmap
        over `lanes` lanes (with `buffer=k`: blocks, whose rows are events). Checks that each
        delivered event keeps some lane and that the other lanes' values are NaN."""
        jax.effects_barrier()
        out = [[] for _ in range(lanes)]
        for logs, steps in self.calls:
            if key not in logs:
                continue
            values = logs[key].reshape(-1, lanes)
            valid = steps["valid"].reshape(-1, lanes)
            at = steps["step"].reshape(-1, lanes)
            assert valid.any(axis=1).all(), "an event no lane keeps was delivered"
            assert np.isnan(values[~valid]).all()
            for row in range(len(values)):
                for lane in np.flatnonzero(valid[row]):
                    out[lane].append((int(at[row, lane]), float(values[row, lane])))
        return out


def _kept(events, k):
    """Of one lane's `(step, value)` events, those whose step the interval `k` keeps."""
    return [(s, v) for s, v in events if s % k == 0]


def _spooled_per_lane(f, args, k, **options):
    """Each lane's kept values from `spool(jax.vmap(f), interval=k)`."""
    _, logs = el.spool(jax.vmap(f), interval=k, **options)(*args)
    values, count = np.asarray(logs["x"]), np.asarray(logs.count["x"])
    return [values[: count[lane], lane].tolist() for lane in range(values.shape[1])]


def _tap_vmap(f, args, k, buffer, jit):
    rec = Deliveries()
    tapped = el.tap(jax.vmap(f), callback=rec, interval=k, buffer=buffer)
    out = (jax.jit(tapped) if jit else tapped)(*args)
    jax.block_until_ready(out)
    return out, rec


def _cond_in_scan(thr, length=7):
    """The issue's program: a cond with a batched predicate in a scan, logging `step=i`."""

    def body(c, i):
        lax.cond(i > thr, lambda: el.log("x", i.astype(jnp.float32), step=i), lambda: None)
        return c + 1, None

    return lax.scan(body, thr, jnp.arange(length))[0]


STEP_CASES = list(itertools.product([2, 3], [None, 2, 3], [False, True]))
THRS = np.array([0, 2, 1, 5, 9], np.int32)  # the cond's thresholds, per lane


@functools.cache  # the same for every `buffer` and `jit`: computed once per `k`
def _cond_spooled(k):
    return _spooled_per_lane(_cond_in_scan, (jnp.asarray(THRS),), k)


@pytest.mark.parametrize("k,buffer,jit", STEP_CASES)
def test_vmap_inside_cond_in_scan_keeps_each_lanes_steps(k, buffer, jit):
    thrs = THRS
    out, rec = _tap_vmap(_cond_in_scan, (jnp.asarray(thrs),), k, buffer, jit)
    np.testing.assert_array_equal(np.asarray(out), thrs + 7)
    got = rec.per_lane("x", len(thrs))
    want = [_kept([(i, float(i)) for i in range(7) if i > t], k) for t in thrs]
    assert got == want
    assert [[v for _, v in lane] for lane in got] == _cond_spooled(k)


def _stepped_scan(offset):
    """No cond: every lane logs every iteration, each with its own step."""

    def body(c, i):
        el.log("x", (i + offset).astype(jnp.float32), step=i + offset)
        return c + 1, None

    return lax.scan(body, offset, jnp.arange(6))[0]


@pytest.mark.parametrize("k,buffer,jit", STEP_CASES)
def test_vmap_inside_steps_that_differ_per_lane(k, buffer, jit):
    offsets = np.array([0, 1, 3, 4], np.int32)
    _, rec = _tap_vmap(_stepped_scan, (jnp.asarray(offsets),), k, buffer, jit)
    want = [_kept([(o + i, float(o + i)) for i in range(6)], k) for o in offsets]
    assert rec.per_lane("x", len(offsets)) == want


def _while_lane(lane, n):
    """jax-tap's "vmap while sample_every": each lane runs its own number of iterations,
    logging `step=i` in each; `lane` is logged to tell the lanes of a vmap outside apart."""

    def body(carry):
        i, s = carry
        el.log({"x": s, "lane": lane}, step=i)
        return i + 1, s + 0.5

    return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), jnp.float32(0)))[1]


NS = np.array([3, 6, 0, 1, 5], np.int32)  # the while loop's trip counts, per lane


@functools.cache  # the same for every `buffer` and `jit`: computed once per `k`
def _while_references(k):
    """What `jax.vmap(tap(f, interval=k))` delivers, lane by lane, and what
    `spool(jax.vmap(f), interval=k)` keeps."""
    lanes = jnp.arange(len(NS), dtype=jnp.int32)
    ref = Deliveries()
    jax.vmap(el.tap(_while_lane, callback=ref, interval=k))(lanes, jnp.asarray(NS))
    jax.effects_barrier()
    alone = [[] for _ in NS]
    for logs, steps in ref.calls:
        alone[int(logs["lane"])].append((int(steps["step"]), float(logs["x"])))
    spooled = _spooled_per_lane(
        _while_lane, (lanes, jnp.asarray(NS)), k, reduce=el.Stack(capacity=8)
    )
    return alone, spooled


@pytest.mark.parametrize("k,buffer,jit", STEP_CASES)
def test_vmap_inside_while_with_a_batched_trip_count(k, buffer, jit):
    ns = NS
    lanes = jnp.arange(len(ns), dtype=jnp.int32)
    out, rec = _tap_vmap(_while_lane, (lanes, jnp.asarray(ns)), k, buffer, jit)
    np.testing.assert_allclose(np.asarray(out), 0.5 * ns)
    got = rec.per_lane("x", len(ns))
    assert got == [_kept([(i, 0.5 * i) for i in range(n)], k) for n in ns]
    # what `jax.vmap(tap(f, interval=k))` delivers, lane by lane; what spool keeps
    alone, spooled = _while_references(k)
    assert got == alone
    assert [[v for _, v in lane] for lane in got] == spooled


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
@pytest.mark.parametrize("buffer", [None, 2])
def test_vmap_inside_equinox_while_loop_keeps_each_lanes_steps(kind, buffer):
    """Equinox's loops (diffrax's) run the body for every lane while any runs: each lane's
    events are those of its own iterations, kept by its own step."""
    import equinox.internal as eqxi

    def f(n):
        def body(carry):
            i, s = carry
            el.log("x", s, step=i)
            return i + 1, s + 0.5

        init = (jnp.int32(0), jnp.float32(0))
        return eqxi.while_loop(lambda c: c[0] < n, body, init, max_steps=8, kind=kind)[1]

    ns = np.array([3, 6, 1, 7], np.int32)
    out, rec = _tap_vmap(f, (jnp.asarray(ns),), 2, buffer, jit=True)
    np.testing.assert_allclose(np.asarray(out), 0.5 * ns)
    assert rec.per_lane("x", len(ns)) == [_kept([(i, 0.5 * i) for i in range(n)], 2) for n in ns]
