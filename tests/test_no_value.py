"""An event with no value, a count only: `log("tick", (), step=i)`. spool keeps its count and
steps, `logs["tick"]` is `()`; tap calls back with it; the loggers write the number of events
(tests/test_backends.py and tests/test_trackio.py read a "tick" back from every backend,
tests/test_writer_batching.py from `logger.jit`'s buffers, tests/test_devices.py checks it on
4 devices). Every count here is worked out by hand or in numpy, or read from the same program
logging a value at the same place."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_logs as el
from eqx_logs.loggers import ConsoleLogger, JsonlLogger, read_jsonl

XS = np.array([[1.0, -2.0, 3.0, 0.5, -1.0], [-1.0, -1.0, -1.0, -1.0, -1.0]], np.float32)
NS = np.array([3, 0], np.int32)


def program(xs, n):
    """ "start" once, "tick" at every scan step (step=c), "pos" where x > 0 (a cond), "loop" at
    each of n while-loop iterations (no static bound, no step), and "x", the value logged by
    "pos"'s own cond: the same events with a value."""
    el.log("start", ())

    def body(c, x):
        el.log("tick", (), step=c)
        lax.cond(x > 0, lambda: el.log({"pos": (), "x": x}, step=c), lambda: None)
        return c + 1, None

    c = lax.scan(body, jnp.int32(0), xs)[0]

    def loop(i):
        el.log("loop", ())
        return i + 1

    return c + lax.while_loop(lambda i: i < n, loop, jnp.int32(0))


def plain(logs) -> dict:
    """Every part of a LogDict as numpy (values, counts, rows, steps), to compare two."""
    return {
        "values": {k: jax.tree.map(np.asarray, v) for k, v in logs.items()},
        "count": {k: np.asarray(c) for k, c in logs.count.items()},
        "rows": {k: np.asarray(r) for k, r in logs.rows.items()},
        "steps": {n: {k: np.asarray(s) for k, s in per.items()} for n, per in logs.steps.items()},
    }


def assert_same(got: dict, want: dict, what: str) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w, err_msg=what)
        assert g.shape == w.shape and g.dtype == w.dtype, what


def by_hand(xs: np.ndarray, n: int) -> dict:
    """`program`'s counts and steps, in numpy."""
    pos = np.nonzero(xs > 0)[0].astype(np.int32)
    return {
        "count": {"start": 1, "tick": len(xs), "pos": len(pos), "x": len(pos), "loop": n},
        "steps": {"tick": np.arange(len(xs), dtype=np.int32), "pos": pos},
    }


def test_spool_counts_events_with_no_value_eagerly_jitted_and_per_lane():
    spooled = el.spool(program)
    runs = [spooled(jnp.asarray(x), jnp.asarray(n)) for x, n in zip(XS, NS)]
    for (out, logs), x, n in zip(runs, XS, NS):
        want = by_hand(x, int(n))
        assert int(out) == len(x) + n
        assert {k: logs[k] for k in ("start", "tick", "pos", "loop")} == dict.fromkeys(
            ("start", "tick", "pos", "loop"), ()
        )
        assert {k: int(c) for k, c in logs.count.items()} == want["count"]
        # steps stacked as a value's would be: up to the static bound, real ones first
        np.testing.assert_array_equal(logs.step["tick"], want["steps"]["tick"])
        pos = want["steps"]["pos"]
        np.testing.assert_array_equal(np.asarray(logs.step["pos"])[: len(pos)], pos)
        assert int(logs.rows["pos"]) == len(pos) == int(logs.rows["x"])
        np.testing.assert_array_equal(logs.step["pos"], logs.step["x"])  # as with a value
        assert "loop" not in logs.steps.get("step", {}) and "loop" not in logs.rows

    # under jax.jit: the same LogDict
    _, jitted = jax.jit(spooled)(jnp.asarray(XS[0]), jnp.asarray(NS[0]))
    assert_same(plain(jitted), plain(runs[0][1]), "jit")

    # under a vmap outside the spool: each lane is spool of that lane alone, straight-line
    # counts ("start", "tick") included, which a vmap must give the lanes' axis
    _, lanes = jax.vmap(spooled)(jnp.asarray(XS), jnp.asarray(NS))
    assert np.shape(lanes.count["start"]) == (2,) and np.shape(lanes.count["tick"]) == (2,)
    for i, (_, logs) in enumerate(runs):
        lane = jax.tree.map(lambda v, i=i: v[i], lanes)
        assert_same(plain(lane), plain(logs), f"lane {i}")


def test_interval_keeps_events_with_no_value_by_step_or_by_number():
    with pytest.warns(UserWarning, match="'start' .* is logged without a `step`"):
        _, logs = el.spool(program, interval=2)(jnp.asarray(XS[0]), jnp.int32(5))
    # with a step: kept where it is a multiple of 2; without: events 0, 2, 4, ...
    steps = np.arange(5)
    kept = steps[steps % 2 == 0]
    np.testing.assert_array_equal(np.asarray(logs.step["tick"])[: len(kept)], kept)
    pos = steps[(XS[0] > 0) & (steps % 2 == 0)]
    assert {k: int(c) for k, c in logs.count.items()} == {
        "start": 1,
        "tick": len(kept),
        "pos": len(pos),
        "x": len(pos),
        "loop": 3,  # events 0, 2 and 4 of 5
    }
    np.testing.assert_array_equal(np.asarray(logs.step["pos"])[: len(pos)], pos)


def inside(xs):
    """A vmap inside the spool: "pos" in a cond on each lane's x (batched: a count per lane),
    "each" with nothing batched (one event per call, as an unbatched value is)."""

    def one(x, i):
        lax.cond(x > 0, lambda: el.log({"pos": (), "x": x}, step=i), lambda: None)
        el.log("each", ())
        return x

    return jax.vmap(one, axis_name="b")(xs, jnp.arange(len(xs), dtype=jnp.int32))


def test_vmap_inside_the_spool_counts_per_lane_and_across_lanes():
    xs = XS[0]
    _, logs = el.spool(inside)(jnp.asarray(xs))
    np.testing.assert_array_equal(logs.count["pos"], (xs > 0).astype(np.int32))
    np.testing.assert_array_equal(logs.count["pos"], logs.count["x"])  # as with a value
    # (events, lanes): each lane's step where it logged, as for the value
    np.testing.assert_array_equal(logs.step["pos"], logs.step["x"])
    np.testing.assert_array_equal(np.asarray(logs.step["pos"])[0, xs > 0], np.nonzero(xs > 0)[0])
    assert int(logs.count["each"]) == 1 and np.ndim(logs.count["each"]) == 0
    # merged across the named vmap axis: the lanes' counts summed, their steps in lane order
    _, merged = el.spool(inside, across="b")(jnp.asarray(xs))
    lanes = np.nonzero(xs > 0)[0]
    assert int(merged.count["pos"]) == len(lanes)
    np.testing.assert_array_equal(np.asarray(merged.step["pos"])[: len(lanes)], lanes)


def test_grad_and_checkpoint_count_each_forward_event_once():
    def loss(w, xs):
        @jax.checkpoint
        def body(c, x):
            el.log("tick", (), step=c)
            return c + 1, jnp.sin(w * x)

        return jnp.sum(lax.scan(body, jnp.int32(0), xs)[1])

    xs = jnp.asarray(XS[0])
    grad, logs = el.spool(jax.grad(loss))(0.5, xs)
    np.testing.assert_allclose(grad, np.sum(XS[0] * np.cos(0.5 * XS[0])), rtol=1e-5)
    assert int(logs.count["tick"]) == len(xs)  # the forward pass's, not again backward
    np.testing.assert_array_equal(logs.step["tick"], np.arange(len(xs)))


def stepped(n):
    """ "tick" at each of 5 scan steps, step=c, and "once", once."""
    el.log("once", (), tags="debug")

    def body(c, _):
        el.log("tick", (), step=c)
        return c + 1, None

    return lax.scan(body, jnp.int32(0), None, length=n)[0]


def test_reductions_policies_and_tags_on_keys_with_no_value():
    # every reduction keeps the value, (); the count is every kept event's; the steps are
    # reduced as the reduction reduces steps: Stack keeps each, others the last
    cases = {
        "mean": ([4], None),
        "count": ([4], None),
        el.Stack(capacity=2, keep="last"): ([3, 4], 2),
        el.Window(2): ([1, 3, 4], 3),  # the last step of each window of 2
    }
    for reduce, (steps, rows) in cases.items():
        _, logs = el.spool(stepped, rules={"tick": reduce})(5)
        assert logs["tick"] == () and int(logs.count["tick"]) == 5, reduce
        np.testing.assert_array_equal(logs.step["tick"], steps if rows else steps[0])
        assert (int(logs.rows["tick"]) if rows else logs.rows.get("tick")) == rows, reduce
    # `reduce=` at the site, the same as a rule
    _, logs = el.spool(lambda: el.log("t", (), step=3, reduce="last"))()
    assert logs["t"] == () and int(logs.count["t"]) == 1 and int(logs.step["t"]) == 3
    # dropped by a rule, filtered by tags
    _, logs = el.spool(stepped, rules={"tick": "drop"})(5)
    assert sorted(logs) == ["once"]
    _, logs = el.spool(stepped, exclude="debug")(5)
    assert sorted(logs) == ["tick"]
    _, logs = el.spool(stepped, tags="debug")(5)
    assert sorted(logs) == ["once"] and int(logs.count["once"]) == 1


def test_while_loop_needs_no_bound_unless_steps_are_stacked():
    def f(n, with_step):
        def body(i):
            el.log("tick", (), **({"step": i} if with_step else {}))
            return i + 1

        return lax.while_loop(lambda i: i < n, body, jnp.int32(0))

    _, logs = el.spool(f)(jnp.int32(4), False)
    assert int(logs.count["tick"]) == 4
    _, logs = el.spool(f, reduce=el.Stack(capacity=3))(jnp.int32(4), True)
    assert int(logs.count["tick"]) == 4 and int(logs.rows["tick"]) == 3
    np.testing.assert_array_equal(logs.step["tick"], [0, 1, 2])
    # stacked steps need a bound: the error names the key, the site and the ways out
    with pytest.raises(ValueError) as info:
        el.spool(f)(jnp.int32(4), True)
    message = str(info.value)
    assert "'tick'" in message and "test_no_value.py" in message, message
    assert "its step 'step'" in message and "without steps" in message, message


def test_first_nonfinite_passes_over_events_with_no_value():
    def f(xs):
        def body(c, x):
            el.log("tick", (), step=c)
            el.log("r", 1.0 / x, step=c)
            return c + 1, None

        return lax.scan(body, jnp.int32(0), xs)[0]

    _, logs = el.spool(f, first_nonfinite=True)(jnp.array([1.0, 2.0, 0.0, 4.0]))
    event = logs.first_nonfinite
    assert (event.key, event.steps) == ("r", {"step": 2})
    assert int(logs.count["tick"]) == 4


def test_a_value_with_none_is_an_error_naming_the_key_and_the_way_to_log_no_value():
    for value in (None, {"a": None}):
        with pytest.raises(ValueError, match=r"'k' at .*test_no_value.py.*log\('k', \(\)\)"):
            el.spool(lambda: el.log("k", value))()
    # sow and log_grad need a value: one with no array is an error there
    for fun in (el.sow, el.log_grad):
        with pytest.raises(ValueError, match=r"key 'h' at .*test_no_value.py.* no array"):
            fun("h", ())
    # an empty container of any kind is an event with no value
    _, logs = el.spool(lambda: el.log({"a": (), "b": {}, "c": []}))()
    assert dict(logs) == {"a": (), "b": {}, "c": []}
    assert {k: int(c) for k, c in logs.count.items()} == {"a": 1, "b": 1, "c": 1}


# -- tap -------------------------------------------------------------------------------------


def tapped(xs):
    """ "tick" at each step (step=c), "pos" where x > 0, "bare" with no step."""

    def body(c, x):
        el.log("tick", (), step=c)
        lax.cond(x > 0, lambda: el.log("pos", (), step=c), lambda: None)
        el.log("bare", ())
        return c + 1, None

    return lax.scan(body, jnp.int32(0), xs)[0]


def test_tap_calls_back_per_event_and_in_blocks():
    xs = XS[0]
    steps = np.arange(len(xs))
    got = []
    el.tap(tapped, callback=lambda logs, s: got.append((logs, s)))(jnp.asarray(xs))
    jax.effects_barrier()
    want = []
    for t in steps:
        want += [({"tick": ()}, {"step": t})]
        want += [({"pos": ()}, {"step": t})] if xs[t] > 0 else []
        want += [({"bare": ()}, {})]
    assert [(logs, {n: int(v) for n, v in s.items()}) for logs, s in got] == want

    # in blocks of 2: the steps of each block of a group; a group with no array at all
    # ("bare": no value, no step) is called back event by event, so that none is lost
    got = []
    el.tap(tapped, callback=lambda logs, s: got.append((logs, s)), buffer=2)(jnp.asarray(xs))
    jax.effects_barrier()
    ticks = [s["step"].tolist() for logs, s in got if "tick" in logs]
    assert ticks == [[0, 1], [2, 3], [4]]
    assert [s["step"].tolist() for logs, s in got if "pos" in logs] == [[0, 2], [3]]
    assert [(logs, s) for logs, s in got if "bare" in logs] == [({"bare": ()}, {})] * len(xs)
    assert all(logs[k] == () for logs, _ in got for k in logs)


def test_tap_under_vmap_calls_back_where_the_lane_logs():
    def f(n):
        def body(i):
            el.log("tick", (), step=i)
            return i + 1

        return lax.while_loop(lambda i: i < n, body, jnp.int32(0))

    got = []
    jax.vmap(el.tap(f, callback=lambda logs, s: got.append(int(s["step"]))))(jnp.array([2, 3]))
    jax.effects_barrier()
    assert sorted(got) == [0, 0, 1, 1, 2]  # lane 0: steps 0, 1; lane 1: 0, 1, 2


def test_tap_prints_a_key_with_no_value_by_its_name(capsys):
    el.tap(lambda: (el.log("tick", (), step=3), el.log({"bare": {}, "x": 1.5}))[1])()
    jax.effects_barrier()
    assert capsys.readouterr().out.splitlines() == ["tick  step=3", "bare  x=1.5"]


# -- loggers ---------------------------------------------------------------------------------


def test_loggers_write_the_number_of_events_at_each_step(tmp_path, capsys):
    """A stacked key with no value: a record per run of events at the same steps, its value
    their number; without steps, or reduced otherwise: one record of the call, the count."""

    def f(x):
        def body(t, _):
            el.log("tick", (), step=t)
            lax.cond(t % 2 == 0, lambda: el.log("tick", (), step=t), lambda: None)
            el.log("bare", ())
            el.log("last", (), step=t, reduce="last")
            return t + 1, None

        return lax.scan(body, jnp.int32(0), None, length=3)[0] + x

    with JsonlLogger(tmp_path / "a.jsonl") as jsonl, ConsoleLogger() as console:
        for logger in (jsonl, console):
            logger.spool(f, logger.init())(jnp.int32(0))
    records = [{k: v for k, v in r.items() if k != "run"} for r in read_jsonl(tmp_path / "a.jsonl")]
    assert records == [
        {"key": "tick", "value": 2, "step": 0},  # two events at step 0, one at 1, two at 2
        {"key": "tick", "value": 1, "step": 1},
        {"key": "tick", "value": 2, "step": 2},
        {"key": "bare", "value": 3, "count": 3},
        {"key": "last", "value": 3, "count": 3, "step": 2},
    ]
    lines = [re.sub(r" +", " ", line) for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        "step= 0 tick=2",
        "step= 1 tick=1",
        "step= 2 tick=2",
        "step= 2 count= 3 last=3",  # (a reduced key: a line with its count)
        "count= 3 bare=3",
    ]
