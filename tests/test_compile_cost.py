"""What spool adds to the traced program: straight-line events folded in once, scans that
stream their events out as `ys`, counters known at trace time. Values against numpy or the
same program threaded by hand; program sizes against the hand-written program's."""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import eqx_logs
from eqx_logs import _compat

pytestmark = pytest.mark.fast


def _eqns(jaxpr) -> list:
    """Every equation, recursively through sub-jaxprs (a jit counts as its body)."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in ("pjit", "jit"):
            out.append(eqn)
        for sub in _compat.sub_jaxprs(eqn.params):
            out += _eqns(_compat.unpack(sub)[0])
    return out


def _primitives(fun, *args) -> list[str]:
    return [e.primitive.name for e in _eqns(jax.make_jaxpr(fun)(*args).jaxpr)]


def test_straight_line_events_cost_about_what_stacking_by_hand_costs():
    def f(x, log=True):
        outs = []
        for _ in range(40):
            x = jnp.sin(x)
            if log:
                eqx_logs.log({"a": x, "b": x.sum()})
            else:
                outs.append(x)
                outs.append(x.sum())
        return x if log else (x, jnp.stack(outs[::2]), jnp.stack(outs[1::2]))

    x = jnp.arange(3.0)
    spooled = _primitives(eqx_logs.spool(f), x)
    hand = _primitives(lambda x: f(x, log=False), x)
    # per key: the stack and one stop_gradient; no counter or buffer write per event
    assert len(spooled) <= len(hand) + 4, (len(spooled), len(hand))
    assert "dynamic_update_slice" not in spooled
    out, logs = eqx_logs.spool(f)(x)
    _, a, b = f(x, log=False)
    assert_close(logs["a"], a)
    assert_close(logs["b"], b)
    assert int(logs.count["a"]) == 40 and int(logs.rows["b"]) == 40


def test_interval_in_straight_line_code_is_decided_at_trace_time():
    def f(x):
        for i in range(10):
            eqx_logs.log({"a": x + i})
        return x

    x = jnp.float32(1.0)
    out, logs = eqx_logs.spool(f, interval=3)(x)
    assert_close(logs["a"], [1.0, 4.0, 7.0, 10.0])
    assert int(logs.count["a"]) == 4
    assert "cond" not in _primitives(eqx_logs.spool(f, interval=3), x)


class _Product(eqx_logs.AbstractReduction):
    """A reduction without `update_many`: spool folds straight-line events one by one."""

    def init(self, struct, max_events):
        return jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), struct)

    def update(self, state, value, valid):
        return jax.tree.map(lambda s, v: jnp.where(valid, s * v, s), state, value)

    def merge(self, a, b):
        return jax.tree.map(jnp.multiply, a, b)

    def finalize(self, state):
        return state


@pytest.mark.parametrize("reduce", ["mean", "max", "last", "first", "sum", "var", "product"])
def test_straight_line_events_with_every_kind_of_reduction(reduce):
    values = np.array([0.5, 2.0, -1.0, 3.0, 1.5], np.float32)

    def f(x):
        for v in values:
            eqx_logs.log({"a": x * v})
        # a branch in the middle folds the events so far in, then more follow
        x = jax.lax.cond(x > 0, lambda x: x + 0.0, lambda x: x, x)
        eqx_logs.log({"a": x * 4.0})
        return x

    r = _Product() if reduce == "product" else reduce
    _, logs = eqx_logs.spool(f, reduce=r)(jnp.float32(1.0))
    events = np.append(values, 4.0)
    want = {
        "mean": events.mean(),
        "max": events.max(),
        "last": events[-1],
        "first": events[0],
        "sum": events.sum(),
        "var": events.var(),
        "product": events.prod(),
    }[reduce]
    assert_close(logs["a"], want)
    assert int(logs.count["a"]) == 6


def _scan_program(length, per_iteration, reverse, batched, log=True):
    """A scan logging `per_iteration` events of "h" per step (under vmap if `batched`), with
    events of "h" before and after the scan; returns the events by hand when `log` is False."""

    def inner(c, x):
        events = []
        for j in range(per_iteration):
            c = jnp.sin(c + x) * (j + 1)
            if log:
                eqx_logs.log({"h": c}, step=x.astype(jnp.int32))
            events.append(c)
        return c, jnp.stack(events)

    def f(c0, xs):
        if log:
            eqx_logs.log({"h": c0 * 0.5})
        body = jax.vmap(inner, in_axes=(0, None)) if batched else inner
        c, ys = jax.lax.scan(body, c0, xs, reverse=reverse)
        if log:
            eqx_logs.log({"h": c})
            return c
        if batched:  # (length, batch, per_iteration, ...) -> (length, per_iteration, batch, ...)
            ys = jnp.swapaxes(ys, 1, 2)
        ys = jnp.flip(ys, 0) if reverse else ys
        ys = ys.reshape(length * per_iteration, *ys.shape[2:])
        return c, jnp.concatenate([c0[None] * 0.5, ys, c[None]])

    return f


@pytest.mark.parametrize("per_iteration", [1, 3])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("batched", [False, True])
def test_scan_streams_its_events_out_as_by_hand(per_iteration, reverse, batched):
    length = 4
    c0 = jnp.linspace(0.1, 0.4, 2 if batched else 1).reshape(-1) if batched else jnp.float32(0.3)
    xs = jnp.arange(length, dtype=jnp.float32)
    f = _scan_program(length, per_iteration, reverse, batched)
    out, logs = eqx_logs.spool(f)(c0, xs)
    want_out, want = _scan_program(length, per_iteration, reverse, batched, log=False)(c0, xs)
    assert_close(out, want_out)
    assert_close(logs["h"], want)
    assert int(np.max(logs.count["h"])) == length * per_iteration + 2
    steps = np.asarray(logs.step["h"])
    order = np.arange(length)[::-1] if reverse else np.arange(length)
    np.testing.assert_array_equal(steps[1:-1].reshape(length, per_iteration, -1)[:, 0, 0], order)


def test_a_scan_that_only_logs_carries_no_buffer():
    def f(xs):
        def body(c, x):
            c = c + x
            eqx_logs.log({"c": c, "x2": x * 2})
            return c, None

        return jax.lax.scan(body, 0.0, xs)[0]

    xs = jnp.arange(5.0)
    names = _primitives(eqx_logs.spool(f), xs)
    assert "dynamic_update_slice" not in names and "scatter" not in names
    _, logs = eqx_logs.spool(f)(xs)
    assert_close(logs["c"], np.cumsum(np.arange(5.0)))
    assert_close(logs["x2"], np.arange(5.0) * 2)


def test_a_scan_with_conditional_events_keeps_them_in_its_carry():
    def f(xs):
        def body(c, x):
            c = c + x
            jax.lax.cond(x > 1, lambda: eqx_logs.log({"c": c}), lambda: None)
            eqx_logs.log({"always": c})
            return c, None

        return jax.lax.scan(body, 0.0, xs)[0]

    xs = jnp.arange(5.0)
    _, logs = eqx_logs.spool(f)(xs)
    assert int(logs.count["c"]) == 3
    assert_close(logs["c"][:3], np.cumsum(np.arange(5.0))[2:])
    assert_close(logs["always"], np.cumsum(np.arange(5.0)))


def test_streamed_scan_under_grad_and_interval():
    def loss(w, xs):
        def body(c, x):
            c = jnp.tanh(w * c + x)
            eqx_logs.log({"c": c})
            return c, None

        return jax.lax.scan(body, 0.1, xs)[0]

    xs = jnp.linspace(0.0, 1.0, 6)

    def hand(w):
        c, cs = 0.1, []
        for x in np.asarray(xs):
            c = np.tanh(w * c + x)
            cs.append(c)
        return np.array(cs, np.float32)

    grad, logs = jax.grad(
        lambda w: (lambda o: (o[0], o[1]))(eqx_logs.spool(loss)(w, xs)), has_aux=True
    )(0.7)
    assert_close(logs["c"], hand(0.7))
    assert_close(grad, jax.grad(loss)(0.7, xs))
    _, logs = eqx_logs.spool(loss, interval=2)(0.7, xs)
    assert_close(logs["c"], hand(0.7)[::2])


def test_eager_spool_does_not_retrace_for_a_new_module_of_the_same_structure():
    traces = []

    class Model(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            traces.append(None)
            eqx_logs.log({"y": self.w * x})
            return self.w * x

    x = jnp.ones(3)
    for i in range(3):
        _, logs = eqx_logs.spool(Model(jnp.full(3, float(i))))(x)
        assert_close(logs["y"], np.full((1, 3), float(i)))
    assert len(traces) == 1


@pytest.mark.parametrize("outer", [0, 2])
def test_streamed_inner_scan_inside_a_scan_of_any_length(outer):
    def f(x):
        def inner(c, _):
            eqx_logs.log({"a": c})
            return c + 1.0, None

        def body(c, _):
            eqx_logs.log({"b": c})
            return jax.lax.scan(inner, c, None, length=2)[0], None

        return jax.lax.scan(body, x, None, length=outer)[0]

    out, logs = eqx_logs.spool(f)(jnp.float32(0.0))
    assert_close(out, 2.0 * outer)
    assert_close(logs["a"], np.arange(2.0 * outer))
    assert_close(logs["b"], 2.0 * np.arange(outer))


def test_scan_in_a_branch_of_a_batched_cond():
    # under vmap the cond becomes a select of both branches, each re-evaluated with its logs
    # masked: the scan inside streams nothing there
    def f(x):
        def body(c, _):
            eqx_logs.log({"a": c})
            return c + 1.0, None

        def scan(x):
            return jax.lax.scan(body, x, None, length=2)[0]

        return jax.lax.cond(x > 0, scan, lambda x: x, x)

    out, logs = eqx_logs.spool(jax.vmap(f))(jnp.array([-1.0, 1.0]))
    assert_close(out, [-1.0, 3.0])
    np.testing.assert_array_equal(logs.count["a"], [0, 2])
    assert_close(logs["a"][:, 1], [1.0, 2.0])
    assert np.all(np.isnan(logs["a"][:, 0]))


def _nested_program(lengths, reverses, before, after, *, log=True):
    """Scans nested `len(lengths)` deep; each body logs "h" before (`before`) and after
    (`after`) the scan nested in it. With `log` False: a numpy run returning the events in
    execution order."""

    def step(c, x, depth):
        return np.sin(c) + x * 0.1 * (depth + 1)

    if not log:

        def run(c, depth, events):
            order = range(lengths[depth])[::-1] if reverses[depth] else range(lengths[depth])
            for x in order:
                c = step(c, np.float32(x), depth)
                if before:
                    events.append(c)
                if depth + 1 < len(lengths):
                    c = run(c, depth + 1, events)
                if after:
                    events.append(2 * c)
            return c

        def oracle(c0):
            events = []
            c = run(np.asarray(c0, np.float64), 0, events)
            return c, np.stack(events) if events else np.zeros((0, *c.shape))

        return oracle

    def level(depth):
        def body(c, x):
            c = jnp.sin(c) + x * 0.1 * (depth + 1)
            if before:
                eqx_logs.log({"h": c})
            if depth + 1 < len(lengths):
                xs = jnp.arange(lengths[depth + 1], dtype=jnp.float32)
                c = jax.lax.scan(level(depth + 1), c, xs, reverse=reverses[depth + 1])[0]
            if after:
                eqx_logs.log({"h": 2 * c})
            return c, None

        return body

    def f(c0):
        xs = jnp.arange(lengths[0], dtype=jnp.float32)
        return jax.lax.scan(level(0), c0, xs, reverse=reverses[0])[0]

    return f


@pytest.mark.parametrize(
    "lengths, reverses, before, after",
    [
        ((3, 2), (False, False), False, True),  # the inner scan's block only
        ((3, 2), (True, False), True, True),  # single, block, single per outer iteration
        ((2, 3, 2), (False, True, True), True, False),
        ((2, 1, 1), (False, False, False), False, True),  # one event per iteration, in a block
        ((2, 3, 2), (True, True, False), True, True),
        ((2, 0), (False, False), True, True),  # an inner scan that never runs
        ((2, 2, 0), (False, True, False), True, False),
        ((0, 2), (False, False), True, True),  # an outer scan that never runs
    ],
)
def test_nested_scans_stream_through_every_level(lengths, reverses, before, after):
    f = _nested_program(lengths, reverses, before, after)
    c0 = jnp.linspace(0.1, 0.5, 3)
    out, logs = eqx_logs.spool(f)(c0)
    want_out, want = _nested_program(lengths, reverses, before, after, log=False)(c0)
    assert_close(out, want_out)
    assert_close(logs["h"], want)
    assert int(logs.count["h"]) == len(want)
    # nothing written into a buffer: every level returns its events as `ys`
    names = _primitives(eqx_logs.spool(f), c0)
    assert "dynamic_update_slice" not in names and "scatter" not in names
    # and the same under vmap, the batch axis first
    c0s = jnp.stack([c0, c0 + 1.0])
    outs, logs = jax.vmap(eqx_logs.spool(f))(c0s)
    for i in range(2):
        want_out, want = _nested_program(lengths, reverses, before, after, log=False)(c0s[i])
        assert_close(outs[i], want_out)
        assert_close(logs["h"][i], want)


def test_nested_scan_with_conditional_events_streams_only_what_is_kept_for_sure():
    # "c" is logged under a cond in the outer body: it rides in the outer carry, while the
    # inner scan still streams it; "h" streams through both levels
    def f(c0):
        def inner(c, x):
            c = jnp.sin(c) + x
            eqx_logs.log({"h": c, "c": -c})
            return c, None

        def outer(c, x):
            jax.lax.cond(x > 0, lambda: eqx_logs.log({"c": c}), lambda: None)
            c = jax.lax.scan(inner, c, jnp.arange(2.0))[0]
            return c, None

        return jax.lax.scan(outer, c0, jnp.arange(3.0))[0]

    _, logs = eqx_logs.spool(f)(jnp.float32(0.2))
    c, h, cs = np.float32(0.2), [], []
    for x in range(3):
        if x > 0:
            cs.append(c)
        for y in range(2):
            c = np.sin(c) + y
            h.append(c)
            cs.append(-c)
    assert_close(logs["h"], np.array(h))
    assert int(logs.count["c"]) == len(cs)
    assert_close(logs["c"][: len(cs)], np.array(cs))


def test_nested_scan_after_an_equinox_loop_under_vmap():
    # a vmapped Equinox while loop gives values lane values; a scan nested after it in the
    # body is not streamed through the outer scan, and the events stay right
    def f(c0):
        def inner(carry, x):
            c, flag = carry
            c = c + x + flag
            eqx_logs.log({"h": c})
            return (c, flag), None

        def outer(c, _):
            n = eqx.internal.while_loop(
                lambda n: n < c,
                lambda n: n + 1.0,
                jnp.float32(0.0),
                max_steps=8,
                kind="checkpointed",
            )
            eqx_logs.log({"n": n})
            # a carry with a lane value: the inner scan guards its events with it
            flag = eqx.internal.unvmap_any(c > 100.0).astype(jnp.float32)
            c = jax.lax.scan(inner, (c + n, flag), jnp.arange(2.0))[0][0]
            return c, None

        return jax.lax.scan(outer, c0, None, length=2)[0]

    c0s = jnp.array([0.5, 2.5])
    _, logs = jax.vmap(eqx_logs.spool(f))(c0s)
    for i, c0 in enumerate(np.asarray(c0s)):
        c, h, ns = c0, [], []
        for _ in range(2):
            n = float(np.ceil(max(c, 0.0))) if c > 0 else 0.0
            n = min(n, 8.0)
            ns.append(n)
            c = c + n
            for y in range(2):
                c = c + y
                h.append(c)
        assert_close(logs["h"][i], np.array(h, np.float32))
        assert_close(logs["n"][i], np.array(ns, np.float32))


def test_eager_spool_sees_changes_made_to_the_spooled_function_by_tree_at():
    # eager calls split the spooled function into its static part and its arrays once per
    # object: a changed copy (eqx.tree_at) is a new object, split again
    traces = []

    class Layer(eqx.Module):
        w: jax.Array
        act: Callable

        def __call__(self, x):
            traces.append(None)
            y = self.act(self.w * x)
            eqx_logs.log({"y": y})
            return y

    x = jnp.linspace(0.0, 1.0, 3)
    spooled = eqx_logs.spool(Layer(jnp.full(3, 2.0), jnp.sin))
    _, logs = spooled(x)
    assert_close(logs["y"], np.sin(2.0 * np.asarray(x))[None])
    new_w = eqx.tree_at(lambda s: s.fun.w, spooled, jnp.full(3, 3.0))
    _, logs = new_w(x)
    assert_close(logs["y"], np.sin(3.0 * np.asarray(x))[None])
    assert len(traces) == 1  # new arrays, same static part: no retrace
    new_act = eqx.tree_at(lambda s: s.fun.act, spooled, jnp.cos)
    _, logs = new_act(x)
    assert_close(logs["y"], np.cos(2.0 * np.asarray(x))[None])
    assert len(traces) == 2
    _, logs = spooled(x)  # the first one is unchanged
    assert_close(logs["y"], np.sin(2.0 * np.asarray(x))[None])
    assert len(traces) == 2


def test_spool_written_inline_is_made_once_per_function_and_options():
    def f(x):
        eqx_logs.log({"x": x})
        return x

    assert eqx_logs.spool(f) is eqx_logs.spool(f)
    assert eqx_logs.spool(f, reduce="mean") is eqx_logs.spool(f, reduce="mean")
    assert eqx_logs.spool(f, reduce="mean") is not eqx_logs.spool(f)
    # options that are not hashable still work (made each time)
    _, logs = eqx_logs.spool(f, exclude=["debug"])(jnp.float32(2.0))
    assert int(logs.count["x"]) == 1
    _, logs = eqx_logs.spool(f, tags=["train"])(jnp.float32(2.0))
    assert "x" not in logs  # the log has no tag "train"
    _, logs = eqx_logs.spool(f, reduce="mean")(jnp.arange(3.0))
    assert_close(logs["x"], np.arange(3.0))
    with pytest.raises(ValueError, match="interval"):
        eqx_logs.spool(f, interval=0)


@pytest.mark.parametrize("inner_length", [0, 1])
def test_a_key_logged_only_in_a_nested_scan_that_never_runs(inner_length):
    # "h" has no event in an iteration of the outer scan: nothing to stream for it there
    def f(c0):
        def inner(c, x):
            eqx_logs.log({"h": c + x})
            return c, None

        def middle(c, x):
            c = jax.lax.scan(inner, c, jnp.arange(float(inner_length)))[0]
            return c + x, None

        def outer(c, x):
            eqx_logs.log({"g": c})
            return jax.lax.scan(middle, c, jnp.arange(2.0))[0], None

        return jax.lax.scan(outer, c0, jnp.arange(3.0))[0]

    out, logs = eqx_logs.spool(f)(jnp.float32(0.5))
    assert_close(out, 0.5 + 3.0)
    assert_close(logs["g"], 0.5 + np.arange(3.0))
    want = [0.5 + i for i in range(3) for _ in range(2)] if inner_length else []
    assert_close(logs["h"], np.array(want, np.float32).reshape(len(want)))
    assert int(logs.count["h"]) == len(want)


def test_eager_spool_gives_the_logdict_a_jitted_spool_gives():
    # The eager call returns the LogDict's leaves and structure apart and rebuilds it: every
    # part (values, counts shared by keys, rows, steps, reductions, first_nonfinite) survives.
    def f(x):
        eqx_logs.log({"a": x, "b": 2 * x}, step=0)
        eqx_logs.log({"a": x + 1, "b": x}, step=1)

        def body(c):
            eqx_logs.log({"w": c}, reduce=eqx_logs.Stack(capacity=4))
            return c * 2.0

        y = jax.lax.while_loop(lambda c: c < 10.0, body, x)
        eqx_logs.log({"m": y}, reduce="mean")
        eqx_logs.log({"bad": jnp.log(x - 5.0)})
        return y

    spooled = eqx_logs.spool(f, first_nonfinite=True)
    out, eager = spooled(jnp.float32(1.0))
    out_jit, jitted = jax.jit(spooled)(jnp.float32(1.0))
    assert_close(out, out_jit)
    assert list(eager) == list(jitted) == ["a", "b", "w", "m", "bad"]
    assert_close(eager["a"], [1.0, 2.0])
    assert_close(eager["w"], [1.0, 2.0, 4.0, 8.0])
    for part in ("count", "rows", "step", "reductions"):
        got, want = getattr(eager, part), getattr(jitted, part)
        assert list(got) == list(want), part
        for k in want:
            if part == "reductions":
                assert got[k] == want[k]
            else:
                np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), part)
    # the counts known at trace time are in both structures, the same
    assert jax.tree.structure(eager) == jax.tree.structure(jitted)
    assert {k for _, k in eager._known} == {"a", "b", "m", "bad"}
    assert set(eager._known) == set(jitted._known)
    assert eager.first_nonfinite == jitted.first_nonfinite
    assert eager.first_nonfinite.key == "bad"
