"""`first_nonfinite="any"` is the spool's own search: the policy's tag filters keep it,
`logger.jit(..., step="i")` gives its report the step and writes none of its checks, and a
non-finite input is reported at the user's line (issue 54). Each report is compared with
numpy (which step, which operation) and with this file's own line numbers."""

import inspect
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_logs as el
from eqx_logs.loggers import JsonlLogger, NonfiniteWarning, read_jsonl


def _line_of(fun, marker: str) -> int:
    lines, start = inspect.getsourcelines(fun)
    return start + next(i for i, s in enumerate(lines) if marker in s)


def log_of(x):
    y = jnp.log(x - 1.0)  # THE LOG
    el.log("y", y, tags="train")
    return y


def test_a_tag_filter_keeps_the_search():
    """`tags="train"` or `exclude="watch"` (options or Policy), and rules or windows for every
    key, select the user's events; the checks are the search's own and run all the same."""
    x = jnp.array([2.0, 3.0, 0.5])
    with np.errstate(all="ignore"):
        assert not np.all(np.isfinite(np.log(np.asarray(x) - np.float32(1))))  # numpy: a NaN
    site = f"{__file__}:{_line_of(log_of, 'THE LOG')} (log_of)"
    cases = [
        {"tags": "train"},
        {"exclude": "watch"},
        {"exclude": "watch", "watch": "log"},  # (the watched key excluded, the search kept)
        {"policy": el.Policy(tags=("train",))},
        {"policy": el.Policy(exclude=("watch",))},
        {"rules": {"*": "drop"}, "tags": "train"},  # (every key of the user's dropped)
        {"window": 2, "rules": {"first*": "mean"}},
    ]
    for options in cases:
        spooled = el.spool(log_of, first_nonfinite="any", **options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, logs = spooled(x)
            _, fine = spooled(x + 1.0)
        assert [str(w.message) for w in caught] == [], options
        report = logs.first_nonfinite
        assert report is not None, options
        assert report.operation == "log at log[0]" and report.site == site, options
        assert fine.first_nonfinite is None, options
        # the user's key as the filters say
        assert ("y" in logs) == ("rules" not in options or "window" in options), options
        assert not any(k.startswith("watch/") for k in logs), options
    # a policy without the search takes none of an inner search's checks (passed on)
    outer = el.spool(el.spool(log_of, first_nonfinite="any", keep=True))
    (_, inner), logs = outer(x)
    assert inner.first_nonfinite is not None and set(logs) == {"y"}


# -- the lane of a vmap inside the spool --------------------------------------------------


def _np_first_lane(values) -> int:
    """numpy: the first lane (flattened, row-major) whose value is not finite."""
    bad = ~np.isfinite(np.asarray(values)).reshape(len(values), -1).all(axis=1)
    return int(np.argmax(bad)) if bad.any() else -1


def test_any_under_a_vmap_inside_names_the_lane():
    def one(v):
        y = jnp.log(v - 1.0)  # THE LANE'S LOG
        el.log("y", y)
        return y

    def f(xs):
        return jax.vmap(one)(xs)

    xs = jnp.array([2.0, 3.0, 0.5, 4.0])
    with np.errstate(all="ignore"):
        lane = _np_first_lane(np.log(np.asarray(xs) - np.float32(1)))
    assert lane == 2
    _, logs = el.spool(f, first_nonfinite="any")(xs)
    report = logs.first_nonfinite
    assert report.lane == lane and report.operation == "log at log[0]"
    assert report.site == f"{__file__}:{_line_of(one, 'THE LANE')} ({one.__qualname__})"
    _, logged = el.spool(f, first_nonfinite=True)(xs)  # the same program, True's lane
    assert logged.first_nonfinite.lane == lane
    assert jax.jit(el.spool(f, first_nonfinite="any"))(xs)[1].first_nonfinite == report
    assert el.spool(jax.jit(f), first_nonfinite="any")(xs)[1].first_nonfinite == report
    assert el.spool(f, first_nonfinite="any")(xs + 2.0)[1].first_nonfinite is None

    # batched on another axis, through a matmul, nested, and under grad
    w = jnp.full((3, 3), 1.0)
    cols = jnp.ones((3, 5)).at[:, 3].set(5.0)
    with np.errstate(all="ignore"):
        lane = _np_first_lane(np.exp(10.0 * (np.asarray(cols).T @ np.asarray(w).T)))
    assert lane == 3
    spooled = el.spool(
        lambda c: jax.vmap(lambda v: jnp.exp(w @ v * 10.0), in_axes=1)(c), first_nonfinite="any"
    )
    report = spooled(cols)[1].first_nonfinite
    assert report.lane == lane and report.operation.startswith("exp at")

    grid = jnp.ones((3, 4)).at[1, 2].set(-1.0).at[2, 0].set(-1.0)
    with np.errstate(all="ignore"):
        lane = _np_first_lane(np.log(np.asarray(grid)).reshape(-1))
    assert lane == 6
    nested = el.spool(lambda g: jax.vmap(jax.vmap(jnp.log))(g), first_nonfinite="any")
    assert nested(grid)[1].first_nonfinite.lane == lane

    def loss(scale, x):
        return jnp.sum(jax.vmap(lambda v: jnp.sqrt(scale * v))(x))

    x = jnp.array([1.0, 2.0, -1.0, -3.0])
    with np.errstate(all="ignore"):
        lane = _np_first_lane(np.sqrt(np.float32(1.0) * np.asarray(x)))
    report = el.spool(jax.grad(loss), first_nonfinite="any")(1.0, x)[1].first_nonfinite
    assert report.lane == lane == 2 and report.operation.startswith("sqrt at")
    assert not report.backward

    # an Equinox model over a batch: the first example whose hidden layer takes a square root
    # of a negative number
    mlp = eqx.nn.MLP(2, 1, 4, 1, activation=jnp.sqrt, key=jax.random.key(2))
    mlp = eqx.tree_at(lambda m: m.layers[0].bias, mlp, jnp.full(4, 1.0))
    batch = jax.random.normal(jax.random.key(4), (6, 2))
    first = mlp.layers[0]
    pre = np.asarray(batch) @ np.asarray(first.weight).T + np.asarray(first.bias)
    with np.errstate(all="ignore"):
        assert _np_first_lane(np.sqrt(pre)) == 3  # (one example of six)
        # Equinox's MLP maps its activation over the hidden units with a vmap of its own:
        # the lanes are (example, unit), flattened
        lane = _np_first_lane(np.sqrt(pre).reshape(-1))
    spooled = eqx.filter_jit(el.spool(lambda m, b: jax.vmap(m)(b), first_nonfinite="any"))
    report = spooled(mlp, batch)[1].first_nonfinite
    assert report.lane == lane and report.operation.startswith("sqrt at"), report
    assert report.lane // 4 == 3


# -- logger.jit(..., step="i") over an Equinox MLP trained with optax ---------------------

X = jax.random.normal(jax.random.key(1), (32, 2))
Y = 1.0 + 0.1 * jnp.abs(X[:, 0])
OPT = optax.sgd(0.9)  # too large: the prediction overshoots below 0 at some step


def loss_fn(model, x, y):
    pred = jax.vmap(model)(x)
    return jnp.mean((jnp.log(pred) - jnp.log(y)) ** 2)  # THE NAIVE LOG


def train_step(model, opt_state, i):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, X, Y)
    el.log("loss", loss)
    updates, opt_state = OPT.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state


def _model():
    model = eqx.nn.MLP(2, "scalar", 8, 1, key=jax.random.key(0))
    return eqx.tree_at(lambda m: m.layers[-1].bias, model, jnp.float32(3.0))


def _np_first_nonfinite(steps: int) -> tuple[int, list[float]]:
    """The first step at which numpy's forward pass, on the weights of the loop without
    logging, takes the log of a prediction that is not positive; and the losses before."""
    model = _model()
    opt_state = OPT.init(eqx.filter(model, eqx.is_array))
    plain = eqx.filter_jit(train_step)
    x, y, losses = np.asarray(X), np.asarray(Y), []
    for i in range(steps):
        first, second = model.layers
        hidden = np.maximum(x @ np.asarray(first.weight).T + np.asarray(first.bias), 0)
        pred = hidden @ np.asarray(second.weight)[0] + np.asarray(second.bias)
        assert np.all(np.isfinite(pred))
        if np.any(pred <= 0):
            return i, losses
        losses.append(float(np.mean((np.log(pred) - np.log(y)) ** 2)))
        model, opt_state = plain(model, opt_state, i)
    raise AssertionError("numpy finds no non-finite value")


def test_logger_jit_with_a_step_reports_it_and_writes_no_checks(tmp_path):
    steps = 10
    first, losses = _np_first_nonfinite(steps)
    assert 0 < first < steps - 1  # (the case: steps before it and after it)
    site = f"{__file__}:{_line_of(loss_fn, 'THE NAIVE LOG')} (loss_fn)"
    for interval in (1, 3):
        path = tmp_path / f"run{interval}.jsonl"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with JsonlLogger(path) as logger:
                step = logger.jit(
                    train_step, logger.init(), step="i", first_nonfinite="any", interval=interval
                )
                model = _model()
                opt_state = OPT.init(eqx.filter(model, eqx.is_array))
                for i in range(steps):
                    model, opt_state = step(model, opt_state, i)
        records = read_jsonl(path)
        # the user's key only, at the interval's steps: no checks, no row without a step
        assert [(r["key"], r["step"]) for r in records] == [
            ("loss", i) for i in range(0, steps, interval)
        ]
        kept = [r["value"] for r in records if r["step"] < first]
        np.testing.assert_allclose(kept, losses[::interval][: len(kept)], rtol=1e-5)
        # one warning: the report, with the step numpy says, the operation and the line
        assert [w.category for w in caught] == [NonfiniteWarning], [str(w.message) for w in caught]
        message = str(caught[0].message)
        assert "the output of log at " in message and f", step={first};" in message, message
        assert f"forward pass, at {site}." in message, message


# -- a non-finite input: reported at the user's line ----------------------------------------


def test_a_nonfinite_input_is_reported_at_the_users_line(tmp_path):
    def f(x):
        return jnp.sin(x) * 2.0

    x = jnp.array([1.0, jnp.nan])
    assert not np.all(np.isfinite(np.asarray(x)))  # numpy: the input is not finite
    this = test_a_nonfinite_input_is_reported_at_the_users_line
    spooled = el.spool(f, first_nonfinite="any")
    calls = {
        "eager": lambda: spooled(x),  # EAGER
        "filter_jit": lambda: eqx.filter_jit(spooled)(x),  # FILTER_JIT
        "jax.jit": lambda: jax.jit(spooled)(x),  # JAX_JIT
    }
    for name, call in calls.items():
        report = call()[1].first_nonfinite
        line = _line_of(this, name.upper().replace(".", "_"))
        assert report.operation == "the function's input 0", name
        assert report.site == f"{__file__}:{line} (<lambda>)", (name, report.site)
    assert spooled(x.at[1].set(0.0))[1].first_nonfinite is None

    def step(x, i):
        return f(x), i

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with JsonlLogger(tmp_path / "a.jsonl") as logger:
            jitted = logger.jit(step, logger.init(), step="i", first_nonfinite="any")
            jitted(x, 4)  # LOGGER_JIT
    line = _line_of(this, "LOGGER_JIT")
    assert [w.category for w in caught] == [NonfiniteWarning]
    message = str(caught[0].message)
    assert "the function's input 0, step=4;" in message, message
    assert f"at {__file__}:{line} ({this.__name__})." in message, message
    assert read_jsonl(tmp_path / "a.jsonl") == []  # (nothing logged: no checks either)
    # through logger.spool, under a prefix: the checks are not written either
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with JsonlLogger(tmp_path / "b.jsonl") as logger:
            spooled = logger.spool(log_of, logger.init(), first_nonfinite="any", prefix="p/")
            spooled(jnp.array([2.0, 3.0]))
    assert [r["key"] for r in read_jsonl(tmp_path / "b.jsonl")] == ["p/y"]
    assert caught == []


@pytest.mark.parametrize("first_nonfinite", [True, "any"])
def test_the_report_of_a_logged_nan_names_the_step_in_logger_jit(tmp_path, first_nonfinite):
    """The report of "any" carries the call's step as `first_nonfinite=True`'s does."""

    def step(x, i):
        y = jnp.log(x - 1.0)  # THE LOG OF THE STEP
        el.log("y", y)
        return x - 0.5, i

    x, first = np.float32(2.6), None  # numpy: the first step whose log is not finite
    for i in range(6):
        with np.errstate(all="ignore"):
            if first is None and not np.isfinite(np.log(x - np.float32(1))):
                first = i
        x = x - np.float32(0.5)
    assert first == 4
    line = _line_of(step, "THE LOG OF THE STEP")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with JsonlLogger(tmp_path / "a.jsonl") as logger:
            jitted = logger.jit(step, logger.init(), step="i", first_nonfinite=first_nonfinite)
            x = jnp.float32(2.6)
            for i in range(6):
                x, _ = jitted(x, i)
    assert [w.category for w in caught] == [NonfiniteWarning], [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert f"step={first};" in message, message
    if first_nonfinite == "any":
        assert f"the output of log at log[0], step={first};" in message
        assert f"at {__file__}:{line} (" in message, message
    assert [r["step"] for r in read_jsonl(tmp_path / "a.jsonl")] == list(range(6))
