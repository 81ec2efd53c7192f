"""`logger.jit(fun, state, interval=k, step="i")`: the parameter `i` is the step, passed traced
(a Python int compiles nothing new) and the step of every event without one of its own; a call
whose step is a Python int not a multiple of k runs `fun` without its logs (a second compiled
program), once the trace with logs found every event at the call's step.

Every test compares the file with an independent reference (numpy, a loop written by hand
with `jax.jit`, `nnx.jit`) and with the loop without `step=` (`logger.jit(fun, state,
interval=k)` given `jnp.int32(i)`, logging with `step=i`), and counts real executions (a
`jax.pure_callback`), traces (a list appended to in the body) and writes handed to the
backend where the question is what ran.
"""

import functools
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_logs
from eqx_logs.loggers import JsonlLogger, NonfiniteWarning, read_jsonl


def rows(path):
    """(key, step, value) of every row of a JSONL file, in order."""
    return [(r["key"], r["step"], r["value"]) for r in read_jsonl(path)]


def assert_rows(got, want, rtol=1e-6):
    assert [(k, s) for k, s, _ in got] == [(k, s) for k, s, _ in want]
    np.testing.assert_allclose([v for *_, v in got], [v for *_, v in want], rtol=rtol)


def line_of(marker):
    """The line of this file holding `marker` (a comment at a `log` call)."""
    with open(__file__) as f:
        (line,) = [n for n, text in enumerate(f, 1) if text.rstrip().endswith(marker)]
    return line


def int_steps(n):
    return list(range(n))


def jnp_steps(n):
    return [jnp.int32(i) for i in range(n)]


GATED_ON_DEVICE = jax.devices()[0].platform in ("gpu", "cuda", "rocm")


# --- 1. a real training step -----------------------------------------------------------------

X = jax.random.normal(jax.random.key(1), (16, 3))
Y = jnp.sum(X, axis=1, keepdims=True)
ADAM = optax.adam(1e-2)
TRAIN_STEPS, TRAIN_INTERVAL = 25, 5


def _mse(model):
    return jnp.mean((jax.vmap(model)(X) - Y) ** 2)


def _mlp():
    return eqx.nn.MLP(3, 1, 8, 1, key=jax.random.key(0))


def make_train_step(traces, all_at_i):
    """An Equinox MLP trained with Adam, logging the loss and the gradients' norm without a
    step (or with `step=i`, `all_at_i`) and the parameters' norm with `step=i`."""

    def train_step(model, opt_state, i):
        traces.append(None)
        loss, grads = eqx.filter_value_and_grad(_mse)(model)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
        if all_at_i:
            eqx_logs.log(metrics, step=i)
        else:
            eqx_logs.log(metrics)
        eqx_logs.log("param_norm", optax.tree.norm(eqx.filter(model, eqx.is_array)), step=i)
        updates, opt_state = ADAM.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    return train_step


def hand_loop():
    """The loop written by hand: a `jax.jit` step returning its metrics, read with `float`
    at the kept steps. (rows, final model)"""
    model = _mlp()
    params, static = eqx.partition(model, eqx.is_array)

    @jax.jit
    def step(params, opt_state):
        model = eqx.combine(params, static)
        loss, grads = eqx.filter_value_and_grad(_mse)(model)
        updates, opt_state = ADAM.update(grads, opt_state)
        metrics = (loss, optax.tree.norm(grads), optax.tree.norm(params))
        return eqx.apply_updates(params, updates), opt_state, metrics

    opt_state, out = ADAM.init(params), []
    for i in range(TRAIN_STEPS):
        params, opt_state, (loss, grad_norm, param_norm) = step(params, opt_state)
        if i % TRAIN_INTERVAL == 0:
            out += [("loss", i, float(loss)), ("grad_norm", i, float(grad_norm))]
            out += [("param_norm", i, float(param_norm))]
    return out, eqx.combine(params, static)


def test_an_adam_trained_mlp_writes_what_the_hand_written_loop_reads(tmp_path, standard_promotion):
    want, want_model = hand_loop()

    def run(path, step, all_at_i, steps):
        traces, model = [], _mlp()
        opt_state = ADAM.init(eqx.filter(model, eqx.is_array))
        with JsonlLogger(path) as logger:
            kw = {"step": "i"} if step else {}
            jitted = logger.jit(
                make_train_step(traces, all_at_i), logger.init(), interval=TRAIN_INTERVAL, **kw
            )
            for i in steps(TRAIN_STEPS):
                model, opt_state = jitted(model, opt_state, i)
        return rows(path), model, len(traces)

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no warning: every call's step is i)
        got, model, traces = run(tmp_path / "step.jsonl", True, False, int_steps)
    assert traces == 2  # with its logs, without: 25 Python ints compile nothing more
    plain, plain_model, plain_traces = run(tmp_path / "plain.jsonl", False, True, jnp_steps)
    assert plain_traces == 1
    assert_rows(got, plain, rtol=1e-5)  # the same file (two programs: rounding apart)
    # the hand loop's rows, in the order each call logs them
    assert sorted(got, key=lambda r: (r[1], r[0])) == sorted(got, key=lambda r: r[1])
    by_step = lambda rs: sorted(rs, key=lambda r: (r[1], r[0]))  # noqa: E731
    assert_rows(by_step(got), by_step(want), rtol=1e-5)
    assert [s for _, s, _ in got] == [s for s in range(0, TRAIN_STEPS, 5) for _ in range(3)]
    # the skipped calls trained too: the model of 25 Adam steps
    leaves = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))  # noqa: E731
    for a, b, c in zip(leaves(model), leaves(want_model), leaves(plain_model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)


# --- 2. skipped calls compute no logs ----------------------------------------------------------


def _counting_step(executions, traces):
    """A step whose logged value is made by a host callback that counts its executions: it
    feeds only the log."""

    def counted(x):
        executions.append(None)
        return np.asarray(x * 3, np.float32)

    def step(w, i):
        traces.append(None)
        spec = jax.ShapeDtypeStruct((), jnp.float32)
        eqx_logs.log("tripled", jax.pure_callback(counted, spec, jnp.sum(w)))
        eqx_logs.log("sum", jnp.sum(w), step=i)
        return w + 1

    return step


def _counting_reference(n, k):
    out = []
    for i in range(0, n, k):
        s = float(2 * (1 + i))
        out += [("tripled", i, 3 * s), ("sum", i, s)]
    return out


@pytest.mark.parametrize("kind", ["int", "numpy", "jnp"])
def test_skipped_calls_compute_hand_over_and_trace_nothing_of_their_logs(tmp_path, kind):
    n, k = 30, 5
    executions, traces, submitted = [], [], []

    class Counting(JsonlLogger):
        def _submit_logs(self, state, logs, size=None):
            submitted.append(None)
            super()._submit_logs(state, logs, size)

    steps = {"int": range(n), "numpy": np.arange(n), "jnp": jnp_steps(n)}[kind]
    with Counting(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(_counting_step(executions, traces), logger.init(), interval=k, step="i")
        w = jnp.ones(2, jnp.float32)
        for i in steps:
            w = jitted(w, i)
        np.testing.assert_array_equal(w, np.full(2, 1.0 + n, np.float32))
    kept = n // k
    if kind == "jnp":  # never read on the host: every call runs its logs, gated on the device
        assert traces == [None]
        assert len(submitted) == n
        # a value made for logs alone is computed inside the branch that keeps the event
        # (`_deferred.py`), but not on GPUs, where every call computes it (`_branching.py`)
        assert len(executions) == (n if GATED_ON_DEVICE else kept)
    else:  # the steps between intervals run the program without logs
        assert len(traces) == 2
        assert len(submitted) == kept
        assert len(executions) == kept
    assert_rows(rows(tmp_path / "a.jsonl"), _counting_reference(n, k))


def test_the_loop_without_step_computes_the_logged_value_as_the_jnp_steps_do(tmp_path):
    """The reference for the count above: `logger.jit` without `step=`, given `jnp.int32`."""
    n, k = 30, 5
    executions, traces = [], []
    step = _counting_step(executions, traces)

    def at_i(w, i):
        with eqx_logs.scope(step=i):
            return step(w, i)

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(at_i, logger.init(), interval=k)
        w = jnp.ones(2, jnp.float32)
        for i in jnp_steps(n):
            w = jitted(w, i)
    assert len(executions) == (n if GATED_ON_DEVICE else n // k) and len(traces) == 1
    assert_rows(rows(tmp_path / "a.jsonl"), _counting_reference(n, k))


# --- 3. a log at another step: warned, and every call runs its logs ---------------------------


def make_other_step(kind, traces, reference):
    """`w` logged at the call's step, `other` at another step (`2 * i`), or at `i` passed to
    an inner `eqx.filter_jit` (a traced value of its own). `reference`: `w` with `step=i`."""

    @eqx.filter_jit
    def inner(w, i):
        eqx_logs.log("other", jnp.sum(w) * 2, step=i)  # <site: inner>
        return w

    def step(w, i):
        traces.append(None)
        if reference:
            eqx_logs.log("w", jnp.sum(w), step=i)
        else:
            eqx_logs.log("w", jnp.sum(w))
        if kind == "2i":
            eqx_logs.log("other", jnp.sum(w) * 2, step=2 * i)  # <site: 2i>
        else:
            w = inner(w, i)
        return w + 1

    return step


@pytest.mark.parametrize("kind", ["2i", "inner"])
def test_a_log_at_another_step_is_warned_with_its_line_and_nothing_is_skipped(tmp_path, kind):
    n, k = 14, 4
    traces = []
    site = re.escape(f"{__file__}:{line_of(f'# <site: {kind}>')}")
    with JsonlLogger(tmp_path / "step.jsonl") as logger:
        jitted = logger.jit(
            make_other_step(kind, traces, False), logger.init(), interval=k, step="i"
        )
        w = jnp.ones(2, jnp.float32)
        with pytest.warns(UserWarning, match=r"logger\.jit\(step='i', interval=4\)") as caught:
            for i in range(n):
                w = jitted(w, i)
    assert [str(c.message) for c in caught if "logger.jit(step=" in str(c.message)] == [
        str(caught[0].message)
    ]  # once, at the first trace
    assert re.search(site, str(caught[0].message))
    # two programs (kept steps; skipped steps, which keep the logs: its trace found the event
    # at another step); the rows below show that no event was lost
    assert len(traces) == 2

    with JsonlLogger(tmp_path / "plain.jsonl") as logger:
        jitted = logger.jit(make_other_step(kind, [], True), logger.init(), interval=k)
        w = jnp.ones(2, jnp.float32)
        for i in jnp_steps(n):
            w = jitted(w, i)
    got = rows(tmp_path / "step.jsonl")
    assert got == rows(tmp_path / "plain.jsonl")
    # numpy: w = 1 + i; `w` kept where i % k == 0, `other` where its step does
    scale = 2 if kind == "2i" else 1
    want = [("w", i, 2.0 * (1 + i)) for i in range(n) if i % k == 0]
    want += [("other", scale * i, 4.0 * (1 + i)) for i in range(n) if scale * i % k == 0]
    assert sorted(got) == sorted(want)


# --- 4. the step by keyword, keyword-only ----------------------------------------------------


def test_the_step_by_keyword_or_keyword_only_writes_what_the_positional_one_does(tmp_path):
    n, k = 12, 3
    traces = {"positional": [], "keyword": [], "keyword-only": []}

    def body(w, i, name):
        traces[name].append(None)
        eqx_logs.log("w", jnp.sum(w))
        return w * 2

    def positional(w, i):
        return body(w, i, "positional")

    def by_keyword(w, i):
        return body(w, i, "keyword")

    def keyword_only(w, *, i):
        return body(w, i, "keyword-only")

    calls = {
        "positional": (positional, lambda f, w, i: f(w, i)),
        # alternately by keyword, all by keyword, mixed with the positional form
        "keyword": (
            by_keyword,
            lambda f, w, i: f(w, i=i) if i % 3 == 0 else f(w=w, i=i) if i % 3 == 1 else f(w, i),
        ),
        "keyword-only": (keyword_only, lambda f, w, i: f(w, i=i)),
    }
    got = {}
    for name, (fun, call) in calls.items():
        path = tmp_path / f"{name}.jsonl"
        with JsonlLogger(path) as logger:
            jitted = logger.jit(fun, logger.init(), interval=k, step="i")
            w = jnp.ones(2, jnp.float32)
            for i in range(n):
                w = call(jitted, w, i)
        np.testing.assert_array_equal(w, np.full(2, 2.0**n, np.float32))
        got[name] = rows(path)
        assert len(traces[name]) == 2, name
    want = [("w", i, 2.0 * 2.0**i) for i in range(0, n, k)]
    for name in calls:
        assert got[name] == want, name


# --- 5. errors --------------------------------------------------------------------------------


def test_a_step_that_is_no_parameter_or_is_not_passed_raises_naming_it(tmp_path):
    def step(w, i):
        eqx_logs.log("w", jnp.sum(w))
        return w

    def with_default(w, i=0):
        eqx_logs.log("w", jnp.sum(w))
        return w

    def variadic(w, *steps):
        return w

    w = jnp.ones(2, jnp.float32)
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        with pytest.raises(TypeError, match=r"'nope'.*\(it has w, i\)"):
            logger.jit(step, logger.init(), interval=2, step="nope")
        with pytest.raises(TypeError, match=r"'steps'"):
            logger.jit(variadic, logger.init(), step="steps")
        jitted = logger.jit(step, logger.init(), interval=2, step="i")
        with pytest.raises(TypeError, match=r"'i'"):
            jitted(w)
        with pytest.raises(TypeError, match=r"no argument 'i', and the parameter has no default"):
            jitted(w)
        jitted(w, 2)  # it works after the failed calls
        # (a step left to its default is the default: test_logger_jit.py)
        logger.jit(with_default, logger.init(), interval=2, step="i")(w)
    assert rows(tmp_path / "a.jsonl") == [("w", 2, 2.0), ("w", 0, 2.0)]


# --- 6. first_nonfinite: nothing skipped --------------------------------------------------------


def test_first_nonfinite_finds_a_nan_at_a_step_an_interval_would_skip(tmp_path):
    traces = []

    def step(x, i):
        traces.append(None)
        eqx_logs.log("y", jnp.log(x))
        return x

    xs = [1.0, 2.0, 3.0, -1.0, 5.0, 6.0, 7.0]  # log(-1) is NaN, at step 3
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init(), interval=5, step="i", first_nonfinite=True)
        for i, x in enumerate(xs):
            jitted(jnp.float32(x), i)
        with pytest.warns(NonfiniteWarning, match=r"key 'y'.*step=3"):
            logger.flush()
    assert len(traces) == 1  # every call ran its logs
    assert_rows(rows(tmp_path / "a.jsonl"), [("y", 0, 0.0), ("y", 5, float(np.log(6.0)))])


# --- 7. donation in both programs -------------------------------------------------------------


@pytest.mark.parametrize("step", ["i", None])
def test_donated_buffers_are_donated_by_both_programs(tmp_path, step):
    static = eqx.filter(_mlp(), eqx.is_array, inverse=True)

    def fresh():
        return eqx.filter(_mlp(), eqx.is_array)  # (the arrays alone: every leaf donated)

    def apply(params, x):
        return eqx.combine(params, static)(x)

    def scaled(params, x, i):
        traces.append(None)
        eqx_logs.log("out", jnp.sum(apply(params, x)), step=i)
        return jax.tree.map(lambda a: 1.5 * a, params)

    x = jnp.ones(3, jnp.float32)
    deleted, traces = [], []
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        kw = {"step": step} if step else {}
        jitted = logger.jit(scaled, logger.init(), interval=3, donate="all", **kw)
        params = fresh()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (donation unusable on some backends)
            for i in range(6):
                new = jitted(params, x + 0, i if step else jnp.int32(i))
                deleted.append(all(a.is_deleted() for a in jax.tree.leaves(params)))
                params = new
    assert deleted == [True] * 6  # kept calls (0, 3) and skipped ones alike
    assert len(traces) == (2 if step else 1)
    want = fresh()
    outs = []
    for i in range(6):
        if i % 3 == 0:
            outs.append(("out", i, float(jnp.sum(apply(want, x)))))
        want = jax.tree.map(lambda a: 1.5 * a, want)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert_rows(rows(tmp_path / "a.jsonl"), outs, rtol=1e-5)


# --- 8. inside the user's jax.jit ------------------------------------------------------------


def test_inside_jax_jit_events_take_the_step_arguments_value(tmp_path):
    def step(w, i):
        eqx_logs.log("w", jnp.sum(w))
        eqx_logs.log("twice", 2 * jnp.sum(w), step=i)
        return w + 1

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init(), interval=2, step="i")
        outer = jax.jit(lambda w, i: jitted(w, i))
        w = jnp.zeros(2, jnp.float32)
        for i in range(5):
            w = outer(w, jnp.int32(10 + i))
    np.testing.assert_array_equal(w, np.full(2, 5.0, np.float32))
    want = []
    for i in range(5):
        if (10 + i) % 2 == 0:
            want += [("w", 10 + i, 2.0 * i), ("twice", 10 + i, 4.0 * i)]
    assert sorted(rows(tmp_path / "a.jsonl")) == sorted(want)


# --- 9. a logger.jit made again each epoch -------------------------------------------------------


def test_a_logger_jit_made_again_each_epoch_compiles_nothing_new(tmp_path):
    traces = []

    def step(w, i):
        traces.append(None)
        eqx_logs.log("w", jnp.sum(w))
        return w + 1

    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        w = jnp.zeros(2, jnp.float32)
        for epoch in range(3):
            jitted = logger.jit(step, logger.init(), interval=5, step="i")
            for i in range(10 * epoch, 10 * epoch + 10):
                w = jitted(w, i)
    assert len(traces) == 2
    assert rows(tmp_path / "a.jsonl") == [("w", i, 2.0 * i) for i in range(0, 30, 5)]


# --- 10. Flax NNX ----------------------------------------------------------------------------


def test_an_nnx_model_and_optimizer_updated_in_place_train_as_under_nnx_jit(tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.hidden = nnx.Linear(3, 8, rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, x):
            return self.out(nnx.relu(self.hidden(x)))

    traces = []

    def step(model, optimizer, i):
        traces.append(None)
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(X) - Y) ** 2))(model)
        eqx_logs.log({"loss": loss})
        optimizer.update(model, grads)
        return loss

    def make():
        model = Net(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)

    n, k = 12, 4
    ref_model, ref_opt = make()
    plain = nnx.jit(step)
    losses = [float(plain(ref_model, ref_opt, jnp.int32(i))) for i in range(n)]
    traces.clear()

    model, optimizer = make()
    with JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init(), interval=k, step="i")
        got = [float(jitted(model, optimizer, i)) for i in range(n)]
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    assert len(traces) == 2
    want = jax.tree.leaves(nnx.state((ref_model, ref_opt)))
    have = jax.tree.leaves(nnx.state((model, optimizer)))
    assert len(have) == len(want)
    for a, b in zip(have, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert_rows(rows(tmp_path / "a.jsonl"), [("loss", i, losses[i]) for i in range(0, n, k)], 1e-5)


# --- what a trace found holds for the arguments it was traced with -----------------------------


# The program for skipped steps is looked at at each of its traces (a new static argument or
# shape, another `functools.partial` or callable object of the same type): a trace that logs
# at another step keeps its logs (gated on the device), whatever earlier traces found.
@pytest.mark.parametrize("turned_on_by", ["a static bool", "a larger shape"])
def test_a_log_at_another_step_turned_on_in_a_new_trace_is_not_skipped(tmp_path, turned_on_by):
    """From call 1 on, a log at another step (`2 * i`) is turned on by an argument that
    compiles the step anew (a Python bool, compiled in as by `eqx.filter_jit`; an array of
    another shape): that new trace with logs must be looked at before any call traced so is
    skipped. The loop without `step=` writes `dbg` at every step 2i that is a multiple of 4,
    i = 2, 4, 6, ...; one that trusts what the first trace (`w` alone) found runs call 2 (a
    Python int, not a multiple of 4) without its logs and loses `dbg` at step 4."""
    n, k = 12, 4

    def make(reference):
        def step(w, i, debug):
            eqx_logs.log("w", jnp.sum(w), **({"step": i} if reference else {}))
            if debug or w.shape[0] > 2:
                eqx_logs.log("dbg", jnp.sum(w), step=2 * i)
            return w + 1

        return step

    def arguments(w, i):
        if turned_on_by == "a static bool":
            return w, i >= 1
        return (w if i == 0 else jnp.concatenate([w[:2], jnp.zeros(1, jnp.float32)])), False

    def run(path, reference):
        with JsonlLogger(path) as logger:
            kw = {} if reference else {"step": "i"}
            jitted = logger.jit(make(reference), logger.init(), interval=k, **kw)
            w = jnp.zeros(2, jnp.float32)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # (the warning of the 2i site)
                for i in range(n):
                    x, debug = arguments(w, i)
                    w = jitted(x, jnp.int32(i) if reference else i, debug)
        return rows(path)

    want = [("w", i, 2.0 * i) for i in range(0, n, k)]
    want += [("dbg", 2 * i, 2.0 * i) for i in range(1, n) if 2 * i % k == 0]
    plain = run(tmp_path / "plain.jsonl", True)
    assert sorted(plain) == sorted(want)
    assert run(tmp_path / "step.jsonl", False) == plain


def test_a_partial_that_turns_on_a_log_at_another_step_is_not_skipped(tmp_path):
    """Two `functools.partial`s of one function, one turning on a log at another step: each is
    its own function (`eqx.filter_jit` compiles each apart). What the first one's trace found
    (every event at the call's step) says nothing of the second's: the second loop, resumed at
    step 1, must write `dbg` at every step 2i that is a multiple of 4, i = 2, 4, 6, as the loop
    without `step=` does."""
    k = 4

    def make(reference):
        def step(w, i, debug):
            eqx_logs.log("w", jnp.sum(w), **({"step": i} if reference else {}))
            if debug:
                eqx_logs.log("dbg", jnp.sum(w), step=2 * i)
            return w + 1

        return step

    def run(path, reference):
        step = make(reference)
        at = jnp.int32 if reference else int
        kw = {} if reference else {"step": "i"}
        w = jnp.zeros(2, jnp.float32)
        with JsonlLogger(path) as logger, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (the warning of the 2i site)
            quiet = logger.jit(
                functools.partial(step, debug=False), logger.init(), interval=k, **kw
            )
            for i in range(8):
                w = quiet(w, at(i))
            loud = logger.jit(functools.partial(step, debug=True), logger.init(), interval=k, **kw)
            for i in range(1, 8):
                w = loud(w, at(i))
        return rows(path)

    want = [("w", 0, 0.0), ("w", 4, 8.0), ("w", 4, 22.0)]
    want += [("dbg", 2 * i, 2.0 * (7 + i)) for i in (2, 4, 6)]
    plain = run(tmp_path / "plain.jsonl", True)
    assert sorted(plain) == sorted(want)
    assert run(tmp_path / "step.jsonl", False) == plain


def test_a_diffrax_solve_in_the_step_logs_at_the_call_step_and_is_skipped(tmp_path):
    """A log in a diffrax vector field (inside its while loop, without `step=`) takes the
    call's step, so the calls between intervals run without it: the vector field's
    evaluations logged are counted by a callback on the logged value only, and the rows
    (the mean of every evaluation's state) equal the same loop without `step=`, whose
    events carry `scope(step=i)`, and a numpy check of their count."""
    import diffrax

    computed = []

    def counted(x):
        shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
        return jax.pure_callback(lambda v: (computed.append(1), v)[1], shape, x)

    def vector_field(t, y, args):
        eqx_logs.log({"y_mean": counted(jnp.mean(y))}, reduce="mean")
        return -args * y

    def solve(y0, a):
        sol = diffrax.diffeqsolve(
            diffrax.ODETerm(vector_field), diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, args=a
        )
        return sol.ys[-1]

    def step(y0, a, i):
        del i  # (the step of the events inside: the call's)
        return solve(y0, a)

    def reference(y0, a, i):
        with eqx_logs.scope(step=i):
            return step(y0, a, i)

    n, k = 6, 3
    y0, a = jnp.ones(3, jnp.float32), jnp.float32(0.5)
    with JsonlLogger(tmp_path / "step.jsonl") as logger:
        fn = logger.jit(step, logger.init(), interval=k, step="i")
        outs, evaluated = [], []
        for i in range(n):
            outs.append(jax.block_until_ready(fn(y0, a, i)))
            evaluated.append(len(computed))
            computed.clear()
    # the kept calls evaluate the logged value at every step of the solve, the others never
    assert [e > 0 for e in evaluated] == [i % k == 0 for i in range(n)], evaluated
    with JsonlLogger(tmp_path / "plain.jsonl") as logger:
        fn = logger.jit(reference, logger.init(), interval=k)
        want = [fn(y0, a, jnp.int32(i)) for i in range(n)]
    got, ref = rows(tmp_path / "step.jsonl"), rows(tmp_path / "plain.jsonl")
    assert [s for _, s, _ in got] == [0, 3] and [s for _, s, _ in ref] == [0, 3]
    np.testing.assert_allclose([v for *_, v in got], [v for *_, v in ref], rtol=1e-6)
    np.testing.assert_allclose(np.stack(outs), np.stack(want), rtol=1e-6)
