"""tap with an interval: counters known at trace time, and scans split into iterations with and
without events. Checked against events and outputs computed with numpy. The events log their
position as `index`, not `step`: an event with a `step` is kept by its step value instead
(tests/test_interval.py)."""

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
