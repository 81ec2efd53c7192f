"""`interval` in the per-step training loop (one jitted step per Python iteration), and
statistics computed only for kept events.

With `interval=k`, an event that carries `step` (`log(..., step=i)`) is kept where the step is
a multiple of k, whichever call it happens in; events without a step are numbered per key
within the call. Values logged only for the logs are computed inside the condition that keeps
the event, so skipped events cost nothing.
"""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_logs as el
from eqx_logs.loggers import JsonlLogger, read_jsonl

STEPS, INTERVAL = 300, 100


def train_step(w, i):
    loss = jnp.sum(w**2)
    el.log({"loss": loss, "norm": jnp.linalg.norm(w)}, step=i)
    return w * 0.99


def reference():
    """The per-step values, computed by hand."""
    w, out = np.ones(3, np.float32), []
    for i in range(STEPS):
        out.append((i, float(np.sum(w**2)), float(np.linalg.norm(w))))
        w = w * np.float32(0.99)
    return out


def kept_reference():
    return [r for r in reference() if r[0] % INTERVAL == 0]


def test_spool_per_step_loop():
    step = jax.jit(el.spool(train_step, interval=INTERVAL))
    w, kept = jnp.ones(3), []
    for i in range(STEPS):
        w, logs = step(w, i)
        if int(logs.count["loss"]):
            kept.append((int(logs.step["loss"][0]), float(logs["loss"][0]), float(logs["norm"][0])))
    np.testing.assert_allclose(kept, kept_reference(), rtol=1e-5)


def test_tap_per_step_loop():
    seen = []
    step = jax.jit(
        el.tap(
            train_step, interval=INTERVAL, callback=lambda logs, steps: seen.append((steps, logs))
        )
    )
    w = jnp.ones(3)
    for i in range(STEPS):
        w = step(w, i)
    jax.effects_barrier()
    got = [(int(s["step"]), float(v["loss"]), float(v["norm"])) for s, v in seen]
    np.testing.assert_allclose(got, kept_reference(), rtol=1e-5)


@pytest.mark.parametrize("kind", ["spool", "tap"])
def test_logger_per_step_loop(tmp_path, kind):
    path = tmp_path / "logs.jsonl"
    with JsonlLogger(str(path)) as logger:
        state = logger.init()
        wrap = logger.spool if kind == "spool" else logger.tap
        step = eqx.filter_jit(lambda w, i: wrap(train_step, state, interval=INTERVAL)(w, i))
        w = jnp.ones(3)
        for i in range(STEPS):
            w = step(w, jnp.int32(i))  # an array: filter_jit would retrace for each Python int
    records = [r for r in read_jsonl(path) if r["key"] == "loss"]
    got = [(r["step"], r["value"]) for r in records]
    np.testing.assert_allclose(got, [r[:2] for r in kept_reference()], rtol=1e-5)


def test_scan_keeps_multiples_of_the_step():
    # a chunk of steps 50..349 in one scan keeps steps 100, 200, 300 (not 50, 150, 250)
    def chunk(w, start):
        return lax.scan(lambda w, i: (train_step(w, start + i), None), w, jnp.arange(STEPS))[0]

    _, logs = jax.jit(el.spool(chunk, interval=INTERVAL))(jnp.ones(3), 50)
    np.testing.assert_array_equal(logs.step["loss"], [100, 200, 300])
    assert int(logs.count["loss"]) == 3
    seen = []
    el.tap(chunk, interval=INTERVAL, callback=lambda logs, steps: seen.append(int(steps["step"])))(
        jnp.ones(3), 50
    )
    jax.effects_barrier()
    assert seen == [100, 200, 300]


def test_without_a_step_events_are_numbered_within_the_call():
    def f(x):
        el.log("x", x)
        return x + 1

    step = jax.jit(el.spool(f, interval=INTERVAL))
    x = jnp.float32(0)
    for _ in range(3):  # every call keeps its first (only) event
        x, logs = step(x)
        assert int(logs.count["x"]) == 1


def _vmapped_model(x):
    el.log({"act": jnp.mean(x)})  # the line the warning must name
    return x * 2


def _step_calling_vmap(i, x):
    with el.scope(step=i):
        el.log({"loss": jnp.sum(x)})
    return jax.vmap(_vmapped_model)(x)


@pytest.mark.parametrize("how", ["spool", "logger.jit"])
def test_the_stepless_warning_names_the_log_line(tmp_path, how):
    # a key logged without a step inside `jax.vmap(model)`, beside a stepped one: the
    # warning is raised at the user's call of the spool, so its text must name the line of
    # the `log` itself (before, it named the key alone: the model's line was nowhere)
    lines, start = inspect.getsourcelines(_vmapped_model)
    log_line = start + next(n for n, line in enumerate(lines) if "el.log(" in line)
    where = f"{__file__}:{log_line} (_vmapped_model)"
    x = jnp.ones((3, 4))
    with pytest.warns(UserWarning, match="logged without a `step`") as caught:
        if how == "spool":
            el.spool(_step_calling_vmap, interval=2)(jnp.int32(0), x)
        else:
            logger = JsonlLogger(tmp_path / "run.jsonl")
            try:
                logger.jit(_step_calling_vmap, logger.init(), interval=2)(jnp.int32(0), x)
            finally:
                logger.close()
    (message,) = [str(w.message) for w in caught if "without a `step`" in str(w.message)]
    assert f"'act' (1 per call, logged at {where})" in message, message
    assert "'loss' (" not in message


def test_repeated_steps_beyond_the_buffer_are_counted(tmp_path):
    def epoch(w, e):  # every batch of an epoch logs the same step
        return lax.scan(lambda w, _: (train_step(w, e), None), w, None, length=10)[0]

    # the buffer holds ceil(10 / 5) = 2 events; all 10 are kept, the first 2 stored
    _, logs = el.spool(epoch, interval=5)(jnp.ones(3), 0)
    assert int(logs.count["loss"]) == 10 and int(logs.rows["loss"]) == 2
    np.testing.assert_allclose(logs["loss"], [3.0, 3.0 * 0.99**2], rtol=1e-5)
    # a logger says so, at its next call (it writes on its own thread)
    with JsonlLogger(str(tmp_path / "logs.jsonl")) as logger:
        with pytest.warns(UserWarning, match="'loss'.*10 events.*2") as caught:
            logger.write(logs)
            logger.flush()
    assert caught[0].filename == __file__  # the user's call
    # a reduction of fixed size, or a capacity, holds them all
    _, logs = el.spool(epoch, interval=5, reduce="count")(jnp.ones(3), 0)
    assert int(logs["loss"]) == 10
    _, logs = el.spool(epoch, interval=5, reduce=el.Stack(capacity=10))(jnp.ones(3), 0)
    assert int(logs.rows["loss"]) == 10


def _primitives(closed):
    """Primitive names of a jaxpr by nesting: those at top level, and those inside conds."""
    top, in_cond = [], []

    def walk(jaxpr, inside):
        for eqn in jaxpr.eqns:
            (in_cond if inside else top).append(eqn.primitive.name)
            for value in eqn.params.values():
                subs = value if isinstance(value, tuple) else (value,)
                for s in subs:
                    inner = getattr(s, "jaxpr", s)
                    if hasattr(inner, "eqns"):
                        walk(inner, inside or eqn.primitive.name == "cond")

    walk(closed.jaxpr, False)
    return top, in_cond


@pytest.mark.parametrize("kind", ["spool", "tap"])
def test_skipped_events_do_not_compute_the_statistic(kind):
    def step(w, i):
        el.log("sv", jnp.linalg.svd(w, compute_uv=False), step=i)
        return w * 0.5

    wrap = el.spool if kind == "spool" else el.tap
    closed = jax.make_jaxpr(wrap(step, interval=INTERVAL))(jnp.eye(4), 3)
    top, in_cond = _primitives(closed)
    assert "svd" in in_cond and "svd" not in top
    # always kept: computed inline, no cond
    closed = jax.make_jaxpr(wrap(step))(jnp.eye(4), 3)
    top, in_cond = _primitives(closed)
    assert "svd" in top and "cond" not in top


def _step_with_statistics():
    def step(w, i):  # a new function for each program: JAX caches traces by function
        g = jnp.sin(w) * 3.0
        el.log("norm", jnp.linalg.norm(g), step=i)  # computed only for the log
        el.log("sv", jnp.linalg.svd(w, compute_uv=False), step=i)
        el.log_stats("w", w, step=i)
        return w - 0.1 * g

    return step


@pytest.mark.parametrize("interval", [None, 3])
def test_on_a_gpu_the_step_computes_rather_than_branches(monkeypatch, interval):
    # XLA:GPU decides a conditional on the host, waiting for the device (`_branching.py`):
    # there the step computes what a `lax.cond` would skip, with the same values. Tested on
    # the CPU made one of the platforms that compute (the choice is `lax.platform_dependent`'s,
    # made when the program is lowered for its platform).
    from eqx_logs import _branching

    assert set(_branching.SELECTING) == {"cuda", "rocm"}
    w = jnp.eye(4) + jnp.arange(16.0).reshape(4, 4) / 10
    huge = w.at[0, 0].set(1e30)  # `log_stats`'s careful path
    programs = {}
    for selecting in (("cuda", "rocm"), ("cpu", "cuda", "rocm")):
        monkeypatch.setattr(_branching, "SELECTING", selecting)
        fn = jax.jit(el.spool(_step_with_statistics(), interval=interval))
        compiled = fn.lower(w, 0).compile()
        programs[selecting] = (
            compiled.as_text().count(" conditional("),
            [[compiled(x, i) for i in range(4)] for x in (w, huge)],
        )
    (n_branching, want), (n_computing, got) = programs.values()
    assert n_branching >= 1 and n_computing == 0
    for runs_got, runs_want in zip(got, want):
        for i, (a, b) in enumerate(zip(runs_got, runs_want)):
            assert jax.tree.structure(a) == jax.tree.structure(b)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
                np.testing.assert_allclose(x, y, rtol=1e-6)
            assert int(b[1].count["norm"]) == (1 if interval is None or i % 3 == 0 else 0)


def test_on_a_gpu_vmap_and_grad_keep_their_rules(monkeypatch):
    # the computing branch (`_branching.py`, the CPU made one of the platforms that compute)
    # under `jax.vmap(spool(f))` (each lane its own run) and `jax.grad` (each event once)
    from eqx_logs import _branching

    monkeypatch.setattr(_branching, "SELECTING", ("cpu", "cuda", "rocm"))
    calls = []

    def loss(w, i):
        g = jnp.sin(w) * 3.0
        el.log("norm", jnp.linalg.norm(g), step=i)
        el.log_stats("w", w, step=i)
        jax.debug.callback(lambda: calls.append(1))
        return jnp.sum(g**2)

    ws = jnp.stack([jnp.full((2, 3), 0.5), jnp.full((2, 3), 2.0)])
    steps = jnp.array([0, 1], jnp.int32)
    spooled = el.spool(loss, interval=2)
    _, lanes = jax.jit(jax.vmap(spooled))(ws, steps)
    for k in range(2):
        _, alone = jax.jit(spooled)(ws[k], steps[k])
        for a, b in zip(jax.tree.leaves(lanes), jax.tree.leaves(alone)):
            np.testing.assert_allclose(a[k], b, rtol=1e-6)
    assert int(lanes.count["norm"][0]) == 1 and int(lanes.count["norm"][1]) == 0
    calls.clear()
    grad, logs = jax.jit(jax.grad(spooled, has_aux=True))(ws[0], steps[0])
    jax.effects_barrier()
    assert len(calls) == 1 and int(logs.count["norm"]) == 1
    np.testing.assert_allclose(grad, jax.grad(loss)(ws[0], 0), rtol=1e-6)
    np.testing.assert_allclose(
        logs["norm"][0], np.linalg.norm(np.sin(0.5) * 3.0 * np.ones(6)), rtol=1e-5
    )


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam (see conftest.py)
def test_optax_training_loop():
    """A real optax training loop, one jitted step per iteration: the logged loss and gradient
    norm of the kept steps equal those of the same loop run without spool."""
    import optax

    optimizer = optax.adam(0.1)
    x = jnp.linspace(-1.0, 1.0, 16)
    y = 3.0 * x + 1.0

    def loss_fn(params):
        return jnp.mean((params["w"] * x + params["b"] - y) ** 2)

    def step(params, opt_state, i):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        el.log({"loss": loss, "grad_norm": optax.tree.norm(grads)}, step=i)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {"w": jnp.float32(0.0), "b": jnp.float32(0.0)}
    spooled = jax.jit(el.spool(step, interval=10))
    plain = jax.jit(step)
    p1, s1 = params, optimizer.init(params)
    p2, s2 = params, optimizer.init(params)
    kept = {}
    for i in range(30):
        want = (float(loss_fn(p2)), float(optax.tree.norm(jax.grad(loss_fn)(p2))))
        (p1, s1), logs = spooled(p1, s1, i)
        p2, s2 = plain(p2, s2, i)
        if int(logs.count["loss"]):
            kept[int(logs.step["loss"][0])] = (float(logs["loss"][0]), float(logs["grad_norm"][0]))
            np.testing.assert_allclose(kept[i], want, rtol=1e-5)
    assert sorted(kept) == [0, 10, 20]
    np.testing.assert_allclose(p1["w"], p2["w"], rtol=1e-6)


def test_interval_by_step_keeps_every_event_of_a_kept_step():
    # several events share a step (two sites per iteration, or one call of a per-step loop):
    # all of them are kept where the step is a multiple of k, and the buffer holds them all
    def f(xs):
        def body(c, t):
            el.log("a", t.astype(jnp.float32), step=t)
            el.log("a", t.astype(jnp.float32) * 10, step=t)
            return c, None

        return lax.scan(body, 0, xs)[0]

    _, logs = el.spool(f, interval=4)(jnp.arange(9))
    n = int(logs.count["a"])
    assert n == 6 and int(logs.rows["a"]) == 6
    np.testing.assert_array_equal(logs["a"][:n], [0, 0, 4, 40, 8, 80])
    np.testing.assert_array_equal(logs.step["a"][:n], [0, 0, 4, 4, 8, 8])

    @jax.jit
    def step(x, i):
        def g(x):
            el.log("b", x, step=i)
            el.log("b", 2 * x, step=i)
            return x

        return el.spool(g, interval=2)(x)[1]

    for i in range(3):
        logs = step(jnp.float32(i), i)
        assert int(logs.count["b"]) == (2 if i % 2 == 0 else 0)
        if i % 2 == 0:
            np.testing.assert_array_equal(logs["b"], [i, 2 * i])
