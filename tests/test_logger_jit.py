"""`logger.jit`: the per-step training loop's form. The compiled step holds no host callback
and no effect; its logs leave it as arrays and the writer thread fetches and writes them.

Each test compares the file against values computed by hand (numpy) or against the other
logger forms on the same loop, and counts real executions where the question is how often
something ran.
"""

import json
import os
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ROOT

import eqx_logs
from eqx_logs.loggers import (
    JsonlLogger,
    MultiLogger,
    NonfiniteWarning,
    TensorBoardLogger,
    WriterError,
    read_jsonl,
)

STEPS, INTERVAL = 30, 10


def train_step(w, i):
    loss = jnp.sum(w**2)
    eqx_logs.log({"loss": loss, "norm": jnp.linalg.norm(w)}, step=i)
    return w * jnp.float32(0.99)


def reference(steps=STEPS, interval=INTERVAL):
    """(key, step, value) of every kept event, in order, computed in numpy."""
    w, out = np.ones(3, np.float32), []
    for i in range(steps):
        if i % interval == 0:
            out += [("loss", i, float(np.sum(w**2))), ("norm", i, float(np.linalg.norm(w)))]
        w = w * np.float32(0.99)
    return out


def rows(path):
    return [(r["key"], r["step"], r["value"]) for r in read_jsonl(path)]


def loop(step, n=STEPS):
    w = jnp.ones(3, jnp.float32)
    for i in range(n):
        w = step(w, jnp.int32(i))
    return w


def assert_rows(got, want):
    assert [(k, s) for k, s, _ in got] == [(k, s) for k, s, _ in want]
    np.testing.assert_allclose([v for *_, v in got], [v for *_, v in want], rtol=1e-5)


def test_the_per_step_loop_writes_every_kept_event_in_order(tmp_path):
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        w = loop(logger.jit(train_step, logger.init(), interval=INTERVAL))
    assert_rows(rows(tmp_path / "a.jsonl"), reference())
    np.testing.assert_allclose(w, np.float32(0.99) ** STEPS * np.ones(3), rtol=1e-5)


@pytest.mark.parametrize("form", ["spool", "tap", "write"])
def test_it_writes_what_the_other_forms_write(tmp_path, form):
    with JsonlLogger(tmp_path / "jit.jsonl") as logger:
        loop(logger.jit(train_step, logger.init(), interval=INTERVAL))
    with JsonlLogger(tmp_path / "other.jsonl") as logger:
        state = logger.init()
        if form == "spool":
            loop(eqx.filter_jit(logger.spool(train_step, state, interval=INTERVAL)))
        elif form == "tap":
            loop(eqx.filter_jit(logger.tap(train_step, state, interval=INTERVAL)))
        else:
            spooled = eqx.filter_jit(eqx_logs.spool(train_step, interval=INTERVAL))

            def step(w, i):
                w, logs = spooled(w, i)
                logger.write(logs, state)
                return w

            loop(step)
    assert rows(tmp_path / "jit.jsonl") == rows(tmp_path / "other.jsonl")


def test_the_compiled_step_holds_no_callback_and_no_effect():
    jaxpr = jax.make_jaxpr(eqx_logs.spool(train_step, interval=INTERVAL))(jnp.ones(3), jnp.int32(0))
    assert not jaxpr.effects

    def primitives(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn.primitive.name
            for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
                yield from primitives(sub)

    assert not [p for p in primitives(jaxpr.jaxpr) if "callback" in p]
    # and what logger.jit compiles is that function: its lowering has no host call either
    with JsonlLogger("/dev/null") as logger:
        step = logger.jit(train_step, logger.init(), interval=INTERVAL)
        text = step.jitted.lower(jnp.ones(3), jnp.int32(0)).as_text()
    assert "callback" not in text and "custom_call" not in text


def _busy_step():
    """A step of `n` matrix products (as long as `n` says), logging the sum; its input."""
    m = jax.random.normal(jax.random.key(0), (256, 256)) / 16

    def step(w, n, i):
        w = jax.lax.fori_loop(0, n, lambda _, w: jnp.tanh(w @ m), w)
        eqx_logs.log("w", jnp.sum(w), step=i)
        return w

    return step, jnp.ones((8, 256), jnp.float32)


def test_writing_never_waits_for_the_device(tmp_path):
    """A step that keeps the device busy for about a second, in `jax.jit` (which returns at
    once; `eqx.filter_jit` waits for each call to report Equinox's runtime errors; for
    `logger.jit`, see the next test): `logger.write` returns at once too, the writer waits
    for the arrays (that wait is not the backend's: no stall with `stall_timeout=0.2`), and
    the event is written."""
    step, w0 = _busy_step()
    spooled = jax.jit(eqx_logs.spool(step))
    logger = JsonlLogger(tmp_path / "a.jsonl", stall_timeout=0.2)
    # Compile first: a first call slowed by compilation must not pass for a second of work.
    jax.block_until_ready(spooled(w0, jnp.int32(1), jnp.int32(0)))
    n, took, i = 100, 0.0, 0
    while took < 0.8:  # about a second of work (steps 0, 1, ... are written)
        n *= 2 if took < 0.1 else 1.6
        start = time.monotonic()
        w, logs = jax.block_until_ready(spooled(w0, jnp.int32(n), jnp.int32(i)))
        logger.write(logs)
        took, i = time.monotonic() - start, i + 1
    logger.flush()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no stall warning
        start = time.monotonic()
        w, logs = spooled(w0, jnp.int32(n), jnp.int32(i))
        logger.write(logs)
        returned = time.monotonic() - start
        logger.close()
        closed = time.monotonic() - start
    assert returned < took / 3, (returned, took)
    assert closed >= took / 2  # close waited for the device
    got = read_jsonl(tmp_path / "a.jsonl")
    assert [r["step"] for r in got] == list(range(i + 1))
    np.testing.assert_allclose(got[-1]["value"], float(jnp.sum(w)), rtol=1e-5)


def test_the_compiled_step_returns_before_the_device_is_done(tmp_path):
    """`logger.jit` dispatches the step and returns, as `jax.jit` does (`eqx.filter_jit`
    waits for every call: measured beside it); the next step queues behind it on the
    device, and every event is written with its value."""
    step, w0 = _busy_step()
    waiting = eqx.filter_jit(eqx_logs.spool(step))
    jax.block_until_ready(waiting(w0, jnp.int32(1), jnp.int32(0)))
    n, took = 100, 0.0
    while took < 0.8:  # about a second of work
        n *= 2 if took < 0.1 else 1.6
        start = time.monotonic()
        waiting(w0, jnp.int32(n), jnp.int32(0))  # Equinox returns once the device is done
        took = time.monotonic() - start
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init())
        jax.block_until_ready(jitted(w0, jnp.int32(1), jnp.int32(0)))  # compiled
        start = time.monotonic()
        w1 = jitted(w0, jnp.int32(n), jnp.int32(1))
        w2 = jitted(w1, jnp.int32(n), jnp.int32(2))
        returned = time.monotonic() - start
        jax.block_until_ready(w2)
        done = time.monotonic() - start
    assert returned < took / 3 and done >= took, (returned, done, took)
    got = read_jsonl(tmp_path / "a.jsonl")
    assert [r["step"] for r in got] == [0, 1, 2]
    np.testing.assert_allclose([r["value"] for r in got[1:]], [jnp.sum(w1), jnp.sum(w2)], rtol=1e-5)


class _Outputs(eqx.Module):
    spooled: Callable

    def __call__(self, *args):
        return self.spooled(*args)[0]


@pytest.mark.parametrize("donate", ["none", "all", "all-except-first", "warn"])
def test_arguments_are_donated_as_by_filter_jit(tmp_path, donate):
    """Which arguments' buffers a call donates, against `eqx.filter_jit(donate=...)`; the
    function's own arrays (a model's) are passed to every call and never donated."""

    class Scale(eqx.Module):
        a: jax.Array

        def __call__(self, w, v, i):
            eqx_logs.log("w", jnp.sum(w), step=i)
            return w * self.a, v + 1

    def deleted(step, scale):
        w, v = jnp.ones(4, jnp.float32), jnp.zeros(4, jnp.float32)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (donation unusable on some backends)
            for i in range(3):
                w2, v2 = step(scale())(w, v, jnp.int32(i))
                gone = (w.is_deleted(), v.is_deleted())
                w, v = w2, v2
        return gone, (float(w[0]), float(v[0]))

    model = Scale(jnp.float32(2))
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(model, logger.init(), donate=donate)
        got = deleted(lambda _: jitted, lambda: model)
    assert not model.a.is_deleted()  # (Equinox donates it too: its next call would fail)
    fresh = lambda: Scale(jnp.float32(2))  # noqa: E731
    want = deleted(lambda s: eqx.filter_jit(_Outputs(eqx_logs.spool(s)), donate=donate), fresh)
    assert got == want and got[1] == (8.0, 3.0)
    assert [r["value"] for r in read_jsonl(tmp_path / "a.jsonl")] == [4.0, 8.0, 16.0]


def test_keyword_arguments_are_bound_as_by_filter_jit(tmp_path):
    """Arguments are bound to the function's signature, as `eqx.filter_jit` binds them: a
    call by keywords compiles what a positional one did, and `donate="all-except-first"`
    keeps the first parameter's buffers however it is passed."""
    traces = []

    def step(w, v, i):
        traces.append(i)
        eqx_logs.log("w", jnp.sum(w), step=i)
        return w * 2, v + 1

    def deleted(jitted):
        gone = []
        for call in ("positional", "keywords", "mixed"):
            w, v, i = jnp.ones(2, jnp.float32), jnp.zeros(2, jnp.float32), jnp.int32(len(gone))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (donation unusable on some backends)
                if call == "positional":
                    out = jitted(w, v, i)
                elif call == "keywords":
                    out = jitted(i=i, v=v, w=w)
                else:
                    out = jitted(w, i=i, v=v)
            assert float(out[0][0]) == 2.0 and float(out[1][0]) == 1.0
            gone.append((w.is_deleted(), v.is_deleted()))
        return gone

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        got = deleted(logger.jit(step, logger.init(), donate="all-except-first"))
    assert len(traces) == 1
    assert got == deleted(eqx.filter_jit(step, donate="all-except-first"))
    assert got[1] == (False, True)  # (this CPU client takes donations)
    assert [r["step"] for r in read_jsonl(tmp_path / "a.jsonl")] == [0, 1, 2]


def test_other_leaves_are_compiled_in_as_by_filter_jit(tmp_path):
    """A leaf that is not an array (a Python number, a function in a model, a string) is a
    constant of the compiled step, a new value compiling it anew, as in `eqx.filter_jit`;
    outputs that are not arrays come back; an unhashable one is named."""
    traces = []

    def step(model, x, scale, name, i):
        traces.append(scale)
        eqx_logs.log(name, jnp.sum(model(x)) * scale, step=i)
        return model, name

    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.relu, key=jax.random.key(0))
    x = jnp.ones(3, jnp.float32)
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init())
        for i, scale in enumerate([1.0, 1.0, 2.0, 1.0]):
            out, name = jitted(model, x, scale, "y", jnp.int32(i))
        assert traces == [1.0, 2.0] and name == "y"
        assert out.activation is jax.nn.relu and eqx.tree_equal(out, model)
        with pytest.raises(TypeError, match=r"logger.jit: the argument at args\[2\].*set"):
            jitted(model, x, {1.0}, "y", jnp.int32(9))
    y = float(jnp.sum(model(x)))
    got = read_jsonl(tmp_path / "a.jsonl")
    np.testing.assert_allclose([r["value"] for r in got], [y, y, 2 * y, y], rtol=1e-6)


def test_a_logger_jit_made_again_compiles_once(tmp_path):
    """As `eqx.filter_jit`: a step made again for the same function (each epoch) reuses
    what the first one compiled; each writes its own events."""
    traces = []

    def step(w, i):
        traces.append(i)
        eqx_logs.log("w", jnp.sum(w), step=i)
        return w * 2

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        for epoch in range(3):
            jitted = logger.jit(step, logger.init(), interval=2)
            w = jitted(jnp.ones(2, jnp.float32), jnp.int32(2 * epoch))
            w = jitted(w, jnp.int32(2 * epoch + 1))
    assert len(traces) == 1
    assert [(r["step"], r["value"]) for r in read_jsonl(tmp_path / "a.jsonl")] == [
        (0, 2.0),
        (2, 2.0),
        (4, 2.0),
    ]


def test_donated_buffers_reach_the_file_with_their_values(tmp_path):
    """The logged weights are donated to the next step before the writer fetches them."""

    def step(w, i):
        eqx_logs.log("w", w, step=i)
        return w * 2

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init(), donate="all")
        w = jnp.ones(4, jnp.float32)
        for i in range(5):
            w = jitted(w, jnp.int32(i))
    got = read_jsonl(tmp_path / "a.jsonl")
    assert [r["step"] for r in got] == list(range(5))
    np.testing.assert_array_equal([r["value"] for r in got], [[2.0**i] * 4 for i in range(5)])


def test_steps_without_events_write_nothing_and_reductions_follow_the_interval(tmp_path):
    def step(w, i):
        eqx_logs.log("loss", jnp.sum(w), step=i)
        return w + 1

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init(), interval=4, reduce="mean")
        w = jnp.zeros(2, jnp.float32)
        for i in range(10):
            w = jitted(w, jnp.int32(i))
    got = read_jsonl(tmp_path / "a.jsonl")
    got = [(r["step"], r["value"], r["count"]) for r in got]
    assert got == [(0, 0.0, 1), (4, 8.0, 1), (8, 16.0, 1)]


def test_an_equinox_model_with_optax_trains_as_without_logging(tmp_path, standard_promotion):
    """A real training step (an Equinox MLP, optax adam): the model after the loop equals
    the one trained without logging, and the logged losses equal those returned."""
    model = eqx.nn.MLP(4, 1, 16, 2, key=jax.random.key(0))
    opt = optax.adam(1e-2)
    x = jax.random.normal(jax.random.key(1), (32, 4))
    y = jnp.sum(x, axis=1, keepdims=True)

    def step(model, opt_state, i):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(
            model
        )
        eqx_logs.log({"loss": loss, "grad_norm": optax.tree.norm(grads)}, step=i)
        updates, opt_state = opt.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    plain = eqx.filter_jit(step)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    m0, o0 = model, opt_state
    losses = []
    for i in range(12):
        model, opt_state, loss = plain(model, opt_state, jnp.int32(i))
        losses.append(float(loss))
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init(), interval=3)
        m, o = m0, o0
        for i in range(12):
            m, o, _ = jitted(m, o, jnp.int32(i))
    for a, b in zip(jax.tree.leaves(eqx.filter(m, eqx.is_array)), jax.tree.leaves(model)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    got = [r for r in read_jsonl(tmp_path / "a.jsonl") if r["key"] == "loss"]
    assert [r["step"] for r in got] == [0, 3, 6, 9]
    np.testing.assert_allclose([r["value"] for r in got], losses[::3], rtol=1e-5)


def test_a_backend_error_and_a_nonfinite_value_come_from_the_next_call(tmp_path):
    def step(x, i):
        eqx_logs.log("y", jnp.log(x), step=i)
        return x

    class Failing(JsonlLogger):
        def _write(self, handle, run, records):
            raise OSError("disk on fire")

    logger = Failing(tmp_path / "a.jsonl")
    jitted = logger.jit(step, logger.init())
    jitted(jnp.float32(1.0), jnp.int32(0))
    logger._sink.writer._wait()  # the writer has failed by now
    with pytest.raises(WriterError, match="disk on fire"):
        jitted(jnp.float32(1.0), jnp.int32(1))
    logger.close()

    with JsonlLogger(tmp_path / "b.jsonl") as logger:
        jitted = logger.jit(step, logger.init(), first_nonfinite=True)
        jitted(jnp.float32(-1.0), jnp.int32(7))
        with pytest.warns(NonfiniteWarning, match=r"event 0 of key 'y'.*step=7") as caught:
            logger.flush()
    assert caught[0].filename == __file__  # the user's call
    assert [r["step"] for r in read_jsonl(tmp_path / "b.jsonl")] == [7]


def test_inside_jit_and_vmap_it_falls_back_to_a_host_callback(tmp_path):
    def step(w, i):
        eqx_logs.log("s", jnp.sum(w), step=i)
        return w + 1

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        states = jax.vmap(logger.init)(jnp.arange(3))

        @jax.jit
        def outer(states, ws, i):
            return jax.vmap(lambda s, w: logger.jit(step, s)(w, i))(states, ws)

        ws = jnp.arange(6.0).reshape(3, 2)
        out = outer(states, ws, jnp.int32(5))
    np.testing.assert_array_equal(out, ws + 1)
    got = sorted((r["run"], r["step"], r["value"]) for r in read_jsonl(tmp_path / "a.jsonl"))
    assert got == [(0, 5, 1.0), (1, 5, 5.0), (2, 5, 9.0)]


@pytest.mark.parametrize("method", ["jit", "spool", "tap"])
def test_a_batch_of_states_outside_vmap_is_refused_at_once(tmp_path, method):
    # before: the writer thread's IndexError (a WriterError at a later call)
    def step(w, i):
        eqx_logs.log("s", jnp.sum(w), step=i)
        return w + 1

    ws = jnp.arange(6.0).reshape(3, 2)
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        states = jax.vmap(logger.init)(jnp.arange(3))
        make = getattr(logger, method)
        with pytest.raises(ValueError, match=r"batch of 3 runs \(its run index has shape \(3,\)"):
            make(step, states)
        # what the message says to do instead: under vmap, the states mapped; or one state
        out = jax.vmap(lambda state, w: make(step, state)(w, jnp.int32(5)))(states, ws)
        make(step, logger.init(7))(ws[0], jnp.int32(6))
    np.testing.assert_array_equal(out, ws + 1)
    got = sorted((r["run"], r["step"], r["value"]) for r in read_jsonl(tmp_path / "a.jsonl"))
    assert got == [(0, 5, 1.0), (1, 5, 5.0), (2, 5, 9.0), (7, 6, 1.0)]


def test_a_vmapped_spool_written_with_vmapped_states_writes_each_run(tmp_path):
    """`logger.write(logs, states)` outside jit: the writer splits the lanes, one run each."""
    spooled = jax.jit(jax.vmap(eqx_logs.spool(train_step)))
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        states = jax.vmap(logger.init)(jnp.arange(2))
        _, logs = spooled(jnp.stack([jnp.ones(3), 2 * jnp.ones(3)]), jnp.array([0, 1]))
        logger.write(logs, states)
    got = [(r["run"], r["key"], r["step"], r["value"]) for r in read_jsonl(tmp_path / "a.jsonl")]
    assert got == [
        (0, "loss", 0, 3.0),
        (0, "norm", 0, pytest.approx(np.sqrt(3))),
        (1, "loss", 1, 12.0),
        (1, "norm", 1, pytest.approx(np.sqrt(12))),
    ]


def test_a_value_the_backend_cannot_store_is_named_at_the_call(tmp_path):
    def step(x, i):
        eqx_logs.log({"z": jax.lax.complex(x, x), "ok": x}, step=i)
        return x

    logger = TensorBoardLogger(tmp_path)
    jitted = logger.jit(step, logger.init())
    with pytest.raises(ValueError, match="TensorBoardLogger cannot store key 'z': complex"):
        jitted(jnp.float32(2.0), jnp.int32(0))
    logger.close()
    from helpers import read_tensorboard

    got, _ = read_tensorboard(tmp_path / "run_0")
    assert got == {"ok": [(0, 2.0)]}


def test_a_multilogger_writes_each_backend(tmp_path):
    logger = MultiLogger(JsonlLogger(tmp_path / "a.jsonl"), JsonlLogger(tmp_path / "b.jsonl"))
    with logger:
        loop(logger.jit(train_step, logger.init(), interval=INTERVAL))
    assert rows(tmp_path / "a.jsonl") == rows(tmp_path / "b.jsonl")
    assert_rows(rows(tmp_path / "a.jsonl"), reference())


def test_a_backend_that_hands_logs_on_its_own_way_gets_each_step(tmp_path):
    # a backend overriding `_submit_logs` is given every step's logs there, packed
    class Counting(JsonlLogger):
        def _submit_logs(self, state, logs, size=None):
            submitted.append(logs)
            super()._submit_logs(state, logs, size)

    submitted = []
    with Counting(tmp_path / "log.jsonl") as logger:
        loop(logger.jit(train_step, logger.init(), interval=INTERVAL))
    assert len(submitted) == STEPS
    assert_rows(rows(tmp_path / "log.jsonl"), reference())


def test_threads_writing_concurrently_keep_each_ones_order(tmp_path):
    """Two training loops in two threads, one logger, one run each: every event is written,
    each run's in its order."""
    with JsonlLogger(tmp_path / "a.jsonl") as logger:

        def run(r):
            loop(logger.jit(train_step, logger.init(r), interval=1), n=40)

        threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    got = read_jsonl(tmp_path / "a.jsonl")
    for r in range(2):
        mine = [(x["key"], x["step"], x["value"]) for x in got if x["run"] == r]
        assert_rows(mine, reference(40, 1))


def test_memory_stays_flat_over_many_steps(tmp_path):
    """The writes queued for the writer hold device arrays; they are let go once fetched."""
    big = jnp.ones(2**16, jnp.float32)

    def step(w, i):
        eqx_logs.log("w", w, step=i)
        return w

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init(), interval=500)
        for i in range(2000):
            jitted(big, jnp.int32(i))
            if i == 999:
                logger.flush()
                live = len(jax.live_arrays())
        logger.flush()
        assert len(jax.live_arrays()) <= live + 2
        assert logger._sink.writer.pending_bytes == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "a.jsonl")] == [0, 500, 1000, 1500]


def test_packed_logs_of_every_dtype_and_size_come_back_whole(tmp_path):
    """`logger.jit` packs small leaves into one buffer per dtype: every dtype, a value too
    large to pack, steps and counts come back as the unpacked LogDict writes them."""
    from eqx_logs.loggers import ArrayLogger, read_arrays

    def step(x, i):
        eqx_logs.log(
            {
                "f32": x,
                "bf16": x.astype(jnp.bfloat16),
                "f16": x.astype(jnp.float16),
                "i8": (x * 10).astype(jnp.int8),
                "u8": (x * 10).astype(jnp.uint8),
                "i32": i,
                "bool": x > 0.5,
                "c64": jax.lax.complex(x, -x),
                "big": jnp.tile(x, 700),  # 2,100 elements: travels as it is
                "tree": {"a": x[0], "b": (i, x[1:])},
            },
            step=i,
        )
        eqx_logs.log("mean", jnp.sum(x), step=i, reduce="mean")
        return x + jnp.float32(0.25)

    x0 = jnp.array([0.0, 0.5, 1.0], jnp.float32)
    with ArrayLogger(tmp_path / "jit") as logger:
        jitted = logger.jit(step, logger.init(), interval=2)
        x = x0
        for i in range(5):
            x = jitted(x, jnp.int32(i))
    spooled = jax.jit(eqx_logs.spool(step, interval=2))
    with ArrayLogger(tmp_path / "write") as logger:
        x = x0
        for i in range(5):
            x, logs = spooled(x, jnp.int32(i))
            logger.write(logs)
    got, want = read_arrays(tmp_path / "jit"), read_arrays(tmp_path / "write")
    assert sorted(got) == sorted(want) and len(got) == 11
    for key in want:
        assert [int(e["step/step"]) for e in got[key]] == [0, 2, 4], key
        for a, b in zip(got[key], want[key]):
            assert sorted(a) == sorted(b), key
            for name in a:
                u, v = np.asarray(a[name]), np.asarray(b[name])
                assert u.dtype == v.dtype and u.shape == v.shape, (key, name)
                np.testing.assert_array_equal(u, v)
    # against numpy: the values at step 4
    np.testing.assert_array_equal(got["big"][2]["value"], np.tile(np.float32(x0 + 1.0), 700))
    np.testing.assert_array_equal(got["i8"][2]["value"], ((x0 + 1.0) * 10).astype(np.int8))


def test_steps_without_events_cost_the_writer_no_write(tmp_path, monkeypatch):
    """A step whose counts hold no event is done once its counts are read: the backend's
    write path runs for the steps with events (and the first, which opens the run) only."""
    from eqx_logs.loggers._sink import Sink

    calls = []
    write_logs = Sink._write_logs
    monkeypatch.setattr(
        Sink, "_write_logs", lambda self, item: (calls.append(item), write_logs(self, item))
    )
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        loop(logger.jit(train_step, logger.init(), interval=INTERVAL), n=50)
    assert_rows(rows(tmp_path / "a.jsonl"), reference(50))
    assert len(calls) == 5  # steps 0, 10, 20, 30, 40
    assert logger._sink.writer.pending_bytes == 0


def test_a_step_that_logs_nothing_is_handed_to_the_writer_once(tmp_path, monkeypatch):
    """A step without any log (its layout has no leaf): its first call opens the run, the
    others hand the writer thread nothing (each write cost the loop about 20 us a call);
    a step that logs, on the same logger, still writes every kept step."""
    from eqx_logs.loggers._writer import Writer

    submitted = []
    submit = Writer.submit
    monkeypatch.setattr(
        Writer, "submit", lambda self, *a, **k: (submitted.append(a[1]), submit(self, *a, **k))
    )
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        state = logger.init()
        loop(logger.jit(eqx_logs.nolog(train_step), state), n=50)
        logger.flush()
        assert len(submitted) == 1 and int(state.run) in logger._sink.handles
        loop(logger.jit(train_step, state, interval=INTERVAL), n=STEPS)
    assert_rows(rows(tmp_path / "a.jsonl"), reference())
    assert len(submitted) == 1 + STEPS


def test_the_device_buffers_of_a_step_are_freed_on_the_loops_thread(tmp_path, monkeypatch):
    """The writer thread reads each step's buffers and hands them back: the training loop's
    thread (the one that allocated them) frees them, with its next step or at `flush`, so
    that the two threads do not contend for the allocator."""
    from eqx_logs.loggers import _sink

    freed = []

    class Watched(_sink.Packed):  # a step's packed logs, saying where they are freed
        def __del__(self):
            freed.append(threading.current_thread())

    feed = _sink.Feed.__call__
    monkeypatch.setattr(
        _sink.Feed,
        "__call__",
        lambda self, p: feed(self, Watched(*p.tree_flatten()[0], p.layout)),
    )
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        loop(logger.jit(train_step, logger.init(), interval=INTERVAL), n=40)
        logger.flush()
        assert len(freed) == 40
    assert set(freed) == {threading.main_thread()}
    assert_rows(rows(tmp_path / "a.jsonl"), reference(40))


# --- the last output's leaves taken back (`Jit._flatten`) --------------------------------------


class _Box:
    """A mutable pytree node: its field can be changed in place between calls."""

    def __init__(self, value):
        self.value = value


jax.tree_util.register_pytree_node(_Box, lambda b: ((b.value,), None), lambda _, c: _Box(*c))


class _Holder(eqx.Module):
    weights: list  # a list: changed in place by the caller below
    box: _Box
    scale: jax.Array


def _double(holder, t):
    eqx_logs.log({"sum": jnp.sum(holder.weights[0]) + jnp.sum(holder.box.value)}, step=t)
    return eqx.tree_at(lambda h: h.scale, holder, holder.scale * 2), jnp.sum(holder.scale)


@pytest.mark.parametrize("step", [None, "t"])
def test_an_output_changed_in_place_is_read_again_when_passed_back(tmp_path, step):
    """An argument that is the last call's output is taken as that output's leaves, but only
    where nothing in it can change in place: a list or a mutable pytree node inside it,
    changed by the caller between calls, is read again. Each row equals numpy's sum of what
    the caller set."""
    kw = {} if step is None else {"step": step}
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        fn = logger.jit(_double, logger.init(), **kw)
        holder = _Holder([jnp.ones(3)], _Box(jnp.ones(2)), jnp.float32(1.0))
        want, scales = [], []
        for t in range(6):
            holder.weights[0] = jnp.full(3, float(t))  # in place, in the last output
            holder.box.value = jnp.full(2, 10.0 * t)
            want.append(3.0 * t + 20.0 * t)
            holder, scale = fn(holder, t if step else jnp.int32(t))
            scales.append(float(scale))
    rows = [r["value"] for r in read_jsonl(tmp_path / "a.jsonl") if r["key"] == "sum"]
    np.testing.assert_allclose(rows, want)
    np.testing.assert_allclose(scales, [2.0**t for t in range(6)])


def test_an_older_output_or_a_copy_passed_back_is_its_own_values(tmp_path):
    """The model and optimiser state passed back are the last output's (taken back), an older
    one (a checkpoint), or an equal rebuilt copy: each call's loss and row are those of the
    arrays passed, as by `eqx.filter_jit`."""
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1, momentum=0.9))
    x = jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)

    def step(model, opt_state, i):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        eqx_logs.log({"loss": loss}, step=i)
        updates, opt_state = opt.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state, loss

    plain = eqx.filter_jit(step)
    opt_state = opt.init(eqx.filter(model, eqx.is_array))
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        fn = logger.jit(step, logger.init(), step="i")
        m1, o1, _ = fn(model, opt_state, 0)
        m2, o2, _ = fn(m1, o1, 1)
        older, _, loss_older = fn(m1, o1, 2)  # m1 again: not the last output
        copy = jax.tree.map(lambda a: a, m2)  # equal leaves, another object
        _, _, loss_copy = fn(copy, o2, 3)
    want_older = plain(m1, o1, jnp.int32(2))[2]
    want_copy = plain(m2, o2, jnp.int32(3))[2]
    np.testing.assert_allclose(float(loss_older), float(want_older), rtol=1e-6)
    np.testing.assert_allclose(float(loss_copy), float(want_copy), rtol=1e-6)
    rows = [r["value"] for r in read_jsonl(tmp_path / "a.jsonl")]
    np.testing.assert_allclose(rows[2:], [float(want_older), float(want_copy)], rtol=1e-6)


def test_no_older_output_is_held_between_the_kept_and_the_skipped_steps(tmp_path):
    """The two programs of `logger.jit(..., step=, interval=)` share what they keep of the
    last output: after a loop, every array held is one of the latest model's (an older
    model held by the program of the kept steps would double the model's memory)."""
    model = eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))

    def step(model, i):
        eqx_logs.log({"w": jnp.sum(model.layers[0].weight)})
        return jax.tree.map(lambda a: a * 0.5 if eqx.is_array(a) else a, model)

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        fn = logger.jit(step, logger.init(), interval=4, step="i")
        for i in range(10):  # kept at 0, 4, 8; the last call (9) skipped
            model = fn(model, i)
        held = [a for _, _, leaves in fn.jitted._last.parts.values() for a in leaves]
        held += [a for _, _, leaves in fn.skip._last.parts.values() for a in leaves]
        latest = {id(a) for a in jax.tree.leaves(model)}
        assert held and all(id(a) in latest for a in held if eqx.is_array(a))
    rows = read_jsonl(tmp_path / "a.jsonl")
    assert [r["step"] for r in rows] == [0, 4, 8]


def test_a_step_left_to_its_default_is_bound_as_the_function_binds_it(tmp_path):
    """`logger.jit(step, state, step="i")` of `def step(w, x, i=0)` called `step(w, x)`: the
    step is the default, 0 (it was refused as a call passing no `i`); passed by position or
    keyword, the value passed. The interval's gate reads the same step: the default is kept,
    step 3 skipped; a keyword-only step with a default too. Rows against numpy."""
    traces = []

    def step(w, x, i=0):
        traces.append(i)
        eqx_logs.log("loss", jnp.sum(w * x))
        return w * jnp.float32(0.5)

    def keyword_only(w, *, i=5):
        eqx_logs.log("w", jnp.sum(w))
        return w

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        stepped = logger.jit(step, logger.init(), step="i", interval=2)
        w, x = jnp.ones(2, jnp.float32), jnp.full(2, 2.0, jnp.float32)
        for call in ("default", "default", "3", "i=4"):
            args = {"default": (), "3": (3,)}.get(call, ())
            w = stepped(w, x, *args, **({"i": 4} if call == "i=4" else {}))
        logger.jit(keyword_only, logger.init(), step="i")(jnp.ones(2, jnp.float32))
    want_w, want = np.ones(2, np.float32), []
    for i in (0, 0, 3, 4):
        if i % 2 == 0:
            want.append(("loss", i, float(np.sum(want_w * 2.0))))
        want_w = want_w * np.float32(0.5)
    assert_rows(rows(tmp_path / "a.jsonl"), want + [("w", 5, 2.0)])
    np.testing.assert_allclose(w, want_w)
    assert len(traces) == 2  # the kept steps' program and the skipped steps', once each


@pytest.mark.parametrize("wrong", ["logger.init", "logger", "0", "None", "missing"])
def test_a_wrong_or_missing_state_names_logger_init(tmp_path, wrong):
    """`logger.jit(step, logger.init)` (no parentheses), the logger, `0`, `None` or no state
    at all: a TypeError naming what was passed and `logger.init()` (it was `AttributeError:
    'BoundMethod' object has no attribute 'run'`, or Python's missing-argument error)."""
    logger = JsonlLogger(tmp_path / "a.jsonl")
    state = {"logger.init": logger.init, "logger": logger, "0": 0, "None": None}.get(wrong)
    said = {
        "logger.init": "got `logger.init`, the method itself: call it, `logger.init()`",
        "logger": "got a logger (a JsonlLogger), not its state",
        "0": "got an int, 0.",
        "None": "got None.",
        "missing": "got no state.",
    }[wrong]
    for method in ("jit", "spool", "tap"):
        make = getattr(logger, method)
        with pytest.raises(TypeError) as info:
            make(train_step) if wrong == "missing" else make(train_step, state)
        message = str(info.value)
        assert message.startswith(f"JsonlLogger.{method}(fun, state) takes"), message
        assert said in message and f"Write `logger.{method}(fun, logger.init())`" in message
    logger.close()


def _int_step(w, i):
    eqx_logs.log("w", jnp.sum(w), step=i)
    return w


def test_the_python_int_warning_of_logger_jit_recommends_step_first(tmp_path):
    """A Python-int `i` compiled in at each value (`logger.jit` without `step=`): the warning
    recommends `step="i"` first, as the README does, then `jnp.int32(i)`."""
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        stepped = logger.jit(_int_step, logger.init())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i in range(4):
                stepped(jnp.ones(2), i)
    said = [str(w.message) for w in caught if "compiled" in str(w.message)]
    assert len(said) == 1, said
    message = said[0]
    first = message.index('name it, `logger.jit(fun, state, step="i")`')
    assert first < message.index("Otherwise pass an array, `jnp.int32(i)`"), message
    assert [r["step"] for r in read_jsonl(tmp_path / "a.jsonl")] == [0, 1, 2, 3]


# Run at XLA's default level, as a user's compile is (`make test`'s -O0 and cheap passes
# rounded both programs alike): an Equinox MLP with adam, and a Flax NNX model with
# `nnx.Optimizer` changed in place, each trained with and without logging; prints, per
# model and interval, whether the trained arrays are equal and the written losses.
_KEPT_STEPS = """
import json, sys, equinox as eqx, jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import eqx_logs
from eqx_logs.loggers import JsonlLogger, read_jsonl

out, result = sys.argv[1], {}
kx, km = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (64, 2))
y = jnp.sin(x[:, :1]) * jnp.cos(x[:, 1:])
opt = optax.adam(1e-2)

def flat(tree):
    return np.concatenate([np.ravel(a) for a in jax.tree.leaves(eqx.filter(tree, eqx.is_array))])

def eqx_step(model, opt_state, x, y, i):
    loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean((jax.vmap(m)(x) - y) ** 2))(model)
    eqx_logs.log({"loss": loss, "grad_norm": optax.tree.norm(grads)})
    updates, opt_state = opt.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state

def nnx_make():
    model = nnx.Sequential(
        nnx.Linear(2, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, 1, rngs=nnx.Rngs(1))
    )
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

def nnx_step(model, optimizer, x, y, i):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    eqx_logs.log({"loss": loss})
    optimizer.update(model, grads)

def losses(path):
    return {r["step"]: r["value"] for r in read_jsonl(path) if r["key"] == "loss"}

model = eqx.nn.MLP(2, 1, 32, 2, key=km)
start = (model, opt.init(eqx.filter(model, eqx.is_array)))
plain, (m, o) = eqx.filter_jit(eqx_step), start
for i in range(200):
    m, o = plain(m, o, x, y, jnp.int32(i))
want = np.concatenate([flat(m), flat(o)])
n_model, n_opt = nnx_make()
n_plain = nnx.jit(nnx_step)
for i in range(200):
    n_plain(n_model, n_opt, x, y, jnp.int32(i))
n_want = flat(nnx.state(n_model))
for interval in (7, 1):
    with JsonlLogger(f"{out}/eqx{interval}.jsonl") as logger:
        step, (m, o) = logger.jit(eqx_step, logger.init(), interval=interval, step="i"), start
        for i in range(200):
            m, o = step(m, o, x, y, i)
    same = bool(np.array_equal(np.concatenate([flat(m), flat(o)]), want))
    result[f"eqx{interval}"] = [same, losses(f"{out}/eqx{interval}.jsonl")]
    n_model, n_opt = nnx_make()
    with JsonlLogger(f"{out}/nnx{interval}.jsonl") as logger:
        step = logger.jit(nnx_step, logger.init(), interval=interval, step="i")
        for i in range(200):
            step(n_model, n_opt, x, y, i)
    same = bool(np.array_equal(flat(nnx.state(n_model)), n_want))
    result[f"nnx{interval}"] = [same, losses(f"{out}/nnx{interval}.jsonl")]
print(json.dumps(result))
"""


def test_kept_steps_compute_what_the_unlogged_step_computes(tmp_path, jax_cache):
    """`interval=7, step="i"`: the steps the host sees kept run the step without a gate on
    the device (which changed how XLA compiled the update: an Equinox MLP with adam was
    1e-4 apart from the unlogged loop's by step 200), so an Equinox model and a Flax NNX
    model with `nnx.Optimizer` trained 200 steps are bit for bit those trained without
    logging (`eqx.filter_jit`, `nnx.jit`), and each written loss is bit for bit that of
    `interval=1` (no gate at all). Compiled at XLA's default level, as a user's are."""
    env = {**os.environ, "XLA_FLAGS": "", "PYTHONPATH": str(ROOT), **jax_cache}
    env["JAX_NUMPY_DTYPE_PROMOTION"] = "standard"  # (optax's adam promotes)
    run = subprocess.run(
        [sys.executable, "-c", _KEPT_STEPS, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    for model in ("eqx", "nnx"):
        (same, kept), (same_1, every) = result[f"{model}7"], result[f"{model}1"]
        assert same and same_1, model
        assert [int(s) for s in kept] == list(range(0, 200, 7))
        assert kept == {s: every[s] for s in kept}
