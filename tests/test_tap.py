"""tap: events streamed to the host in execution order, gated on the device."""

import subprocess
import sys
import textwrap

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

    def flat(self):
        jax.effects_barrier()
        return [(k, float(np.ravel(v)[0])) for logs, _ in self.events for k, v in logs.items()]


def _program(xs):
    def step(c, x):
        el.log("x", x, step=c)
        lax.cond(x > 2, lambda: el.log("big", x), lambda: None)
        return c + 1, None

    c = lax.scan(step, 0, xs)[0]

    def body(i):
        el.log("w", i * 1.0)
        return i + 1

    lax.while_loop(lambda i: i < 2, body, 0)
    return c


def _reference(xs, interval=1):
    out, seen = [], {}
    for x in xs:
        for key, happens in (("x", True), ("big", x > 2)):
            if happens:
                if seen.get(key, 0) % interval == 0:
                    out.append((key, float(x)))
                seen[key] = seen.get(key, 0) + 1
    for i in range(2):
        if seen.get("w", 0) % interval == 0:
            out.append(("w", float(i)))
        seen["w"] = seen.get("w", 0) + 1
    return out


def test_events_in_execution_order_through_scan_cond_while():
    rec = Recorder()
    xs = np.arange(5.0, dtype=np.float32)
    out = el.tap(_program, callback=rec)(jnp.asarray(xs))
    assert int(out) == 5
    assert rec.flat() == _reference(xs)
    steps = [s["step"] for logs, s in rec.events if "x" in logs]
    assert [int(s) for s in steps] == [0, 1, 2, 3, 4]


def test_interval_gates_on_device_per_key():
    rec = Recorder()
    xs = np.arange(7.0, dtype=np.float32)
    el.tap(_program, callback=rec, interval=3)(jnp.asarray(xs))
    assert rec.flat() == _reference(xs, interval=3)
    # the host is not called for skipped events: the callback count is the kept count
    assert len(rec.events) == len(_reference(xs, interval=3))


def test_jit_called_repeatedly_fires_once_per_call():
    rec = Recorder()
    f = jax.jit(_program)
    tapped = el.tap(f, callback=rec)
    xs = jnp.arange(3.0)
    for _ in range(3):
        tapped(xs)
    assert rec.flat() == _reference(np.arange(3.0)) * 3
    assert int(f(xs)) == 3  # the jitted function is untouched


def test_grad_and_checkpoint_fire_each_event_once():
    def loss(w):
        def step(c, x):
            el.log("c", c)
            return jnp.sin(c * w + x), None

        return lax.scan(jax.checkpoint(step), 0.5, jnp.arange(3.0))[0]

    rec = Recorder()
    el.tap(jax.grad(loss), callback=rec)(jnp.float32(1.0))
    c = [0.5]
    for x in range(2):
        c.append(float(np.sin(c[-1] + x)))
    got = rec.flat()
    assert [k for k, _ in got] == ["c"] * 3
    np.testing.assert_allclose([v for _, v in got], c, rtol=1e-5)


def test_vmap_calls_once_per_event_with_batched_values_and_mask():
    rec = Recorder()
    el.tap(jax.vmap(_program), callback=rec)(jnp.arange(6.0).reshape(2, 3))
    jax.effects_barrier()
    xs = [logs["x"] for logs, _ in rec.events if "x" in logs]
    np.testing.assert_allclose(xs, [[0, 3], [1, 4], [2, 5]])
    bigs = [(logs["big"], s["valid"]) for logs, s in rec.events if "big" in logs]
    assert len(bigs) == 3
    for value, valid in bigs:
        assert list(valid) == [False, True] and np.isnan(value[0])


def test_tags_exclude_prefix_and_default_callback(capsys):
    def f(x):
        el.log("a", x, tags="train")
        el.log("b", x + 1, tags="debug")
        return x

    el.tap(f, exclude="debug", prefix="run/")(jnp.float32(1.5))
    jax.effects_barrier()
    out = capsys.readouterr().out
    assert "run/a=1.5" in out and "b=" not in out


def test_the_default_callback_prints_each_leaf_of_a_pytree_value(capsys):
    """(It raised on a dict value: `TypeError: unsupported format string passed to dict`.)"""

    def f(x):
        el.log("d", {"a": x, "b": [2 * x, x[0]]}, step=4)
        return x

    el.tap(f)(jnp.arange(3.0))
    jax.effects_barrier()
    want = "d['a']=[0. 1. 2.]  d['b'][0]=[0. 2. 4.]  d['b'][1]=0  step=4"
    assert capsys.readouterr().out.splitlines() == [want]


def test_tap_then_spool_of_one_function():
    rec = Recorder()
    f = jax.jit(_program)
    xs = jnp.arange(4.0)
    el.tap(f, callback=rec)(xs)
    _, logs = el.spool(f, reduce=el.Stack(capacity=8))(xs)
    el.tap(f, callback=rec)(xs)
    assert rec.flat() == _reference(np.arange(4.0)) * 2
    np.testing.assert_allclose(logs["x"][:4], np.arange(4.0))


def test_vmap_outside_tap_calls_only_lanes_where_the_event_happened():
    """JAX runs both branches of a batched cond, and every iteration of a batched while for
    all lanes; the callback still sees each lane's own events only."""

    def f(x, n):
        lax.cond(x > 0, lambda: el.log("pos", x), lambda: el.log("neg", x))

        def body(i):
            el.log("i", i)
            return i + 1

        return lax.while_loop(lambda i: i < n, body, 0)

    rec = Recorder()
    xs, ns = jnp.array([1.0, -2.0, 3.0]), jnp.array([2, 0, 1])
    out = jax.vmap(el.tap(f, callback=rec))(xs, ns)
    np.testing.assert_array_equal(np.asarray(out), [2, 0, 1])
    got = sorted(rec.flat())
    want = sorted([("pos", 1.0), ("neg", -2.0), ("pos", 3.0), ("i", 0), ("i", 1), ("i", 0)])
    assert got == want


# Run with warnings as errors in a process of its own: JAX caches what it traced (numpy's
# warnings are raised while tracing), so an earlier test in this process could hide one.
_COMPLEX = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    import eqx_logs as el

    def f(z):
        el.log("z", z)
        return 2 * z

    def lanes(z):  # a vmap inside: a batched cond masks lanes, the interval keeps steps
        def body(c, i):
            w = z * i.astype(z.dtype)
            lax.cond(z.real > i.astype(z.real.dtype), lambda: el.log("w", w, step=i), lambda: None)
            return c, None

        return lax.scan(body, 0, jnp.arange(4))[0]

    got = []
    def record(logs, steps):
        got.append((jax.tree.map(np.asarray, logs), jax.tree.map(np.asarray, steps)))

    z = jnp.complex64(1 - 2j)
    for buffer in (None, 2):
        out = el.tap(f, callback=record, buffer=buffer)(z)
        assert complex(out) == 2 - 4j, out
        zs = jnp.array([1 + 1j, 3 - 1j], jnp.complex64)
        el.tap(jax.vmap(lanes), callback=record, interval=2, buffer=buffer)(zs)
    jax.effects_barrier()
    for logs, steps in got:
        print(sorted(logs), {k: np.ravel(v).tolist() for k, v in {**logs, **steps}.items()})
    """
)


def test_complex_input_and_values_warn_nothing():
    """numpy's ComplexWarning (a complex input summed as an int32, for the lanes' operand) is
    not raised by the library: under `python -W error` a tap of complex values runs."""
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", _COMPLEX], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    scalar = "['z'] {'z': [(1-2j)]}"
    # lane 0 (real part 1) logs at step 0 only; lane 1 (real part 3) at steps 0, 1, 2: the
    # interval keeps steps 0 and 2
    unbuffered = [
        "['w'] {'w': [0j, 0j], 'step': [0, 0], 'valid': [True, True]}",
        "['w'] {'w': [(nan+0j), (6-2j)], 'step': [2, 2], 'valid': [False, True]}",
    ]
    buffered = [
        "['w'] {'w': [0j, 0j, (nan+0j), (6-2j)], 'step': [0, 0, 2, 2], "
        "'valid': [True, True, False, True]}"
    ]
    assert lines == [scalar, *unbuffered, scalar, *buffered]


def _failing_every_odd_step(seen):
    def callback(logs, steps):
        seen.append(np.asarray(steps["step"]).tolist())
        if np.any(np.asarray(steps["step"]) % 2):
            raise RuntimeError("the callback's own bug")

    return callback


def _stepped(xs):
    def body(c, x):
        el.log("x", x, step=c)
        return c + 1, None

    return lax.scan(body, 0, xs)[0]


@pytest.mark.parametrize("buffer", [None, 2])
def test_on_error_warn_says_the_first_failure_once_and_goes_on(buffer):
    """jax-tap's behaviour on request: a callback that raises is said once per tap (with its
    traceback), every event still reaches it, and the call returns its output."""
    seen = []
    tapped = el.tap(
        _stepped, callback=_failing_every_odd_step(seen), on_error="warn", buffer=buffer
    )
    xs = jnp.arange(5.0)
    with pytest.warns(el.CallbackFailedWarning) as caught:
        outs = [jax.jit(tapped)(xs), tapped(xs)]
        jax.effects_barrier()
    assert [int(o) for o in outs] == [5, 5]
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "callback raised on the events of" in message and "['x']" in message
    assert "RuntimeError: the callback's own bug" in message  # the traceback
    flat = [s for block in seen for s in np.ravel(block).tolist()]
    assert flat == [0, 1, 2, 3, 4] * 2  # every event delivered, the failing ones too

    # another tap of the same callback says its own first failure
    with pytest.warns(el.CallbackFailedWarning):
        el.tap(_stepped, callback=_failing_every_odd_step([]), on_error="warn")(xs)
        jax.effects_barrier()


def test_on_error_raise_is_the_default_and_fails_the_call():
    with pytest.raises(Exception, match="the callback's own bug"):
        el.tap(_stepped, callback=_failing_every_odd_step([]))(jnp.arange(3.0))
        jax.effects_barrier()


def test_on_error_takes_raise_or_warn():
    with pytest.raises(ValueError, match="on_error must be \"raise\".*got 'ignore'"):
        el.tap(_stepped, on_error="ignore")
