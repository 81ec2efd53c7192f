"""Loggers: JsonlLogger (one line per real event of stacked keys, one per key for other
reductions, appends, read_jsonl round-trips), ConsoleLogger (a line per step), `records` on
Window outputs, and `safe_name`. Expected values come from numpy, not from earlier output.

Loggers write on a background thread: every test flushes or closes (`with logger:`) before it
reads anything back. Backends other than these two are in test_backends.py."""

import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import check_aligned
from jax import lax

import eqx_logs
from eqx_logs.loggers import ConsoleLogger, JsonlLogger, read_jsonl, records, safe_name

pytestmark = pytest.mark.fast  # in `make test-fast`

XS = np.arange(8.0, dtype=np.float32)


def conditional(xs):
    """Per step t: "all" = t always; "big" = t and "vec" = (t, -t) only when t > 2 (a cond,
    so the stack has NaN padding rows after the real events)."""

    def step(c, x):
        t = x.astype(jnp.int32)
        eqx_logs.log("all", x, step=t)

        def big():
            eqx_logs.log({"big": x, "vec": jnp.stack([x, -x])}, step=t)

        lax.cond(x > 2, big, lambda: None)
        return c, None

    return lax.scan(step, 0.0, xs)[0]


def spooled(f, xs=XS, **options):
    return eqx_logs.spool(f, **options)(jnp.asarray(xs))[1]


def lines_of(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_jsonl_stacked_one_line_per_real_event(tmp_path):
    logs = spooled(conditional)
    # the precondition: padding rows exist in what the logger is given
    assert logs["big"].shape == (8,) and int(logs.count["big"]) == 5
    assert np.isnan(np.asarray(logs["big"])[5:]).all()
    path = tmp_path / "logs.jsonl"
    with JsonlLogger(path) as logger:
        logger.write(logs)
    rows = lines_of(path)
    assert len(rows) == 8 + 5 + 5
    got = {k: [r for r in rows if r["key"] == k] for k in ("all", "big", "vec")}
    assert [r["value"] for r in got["all"]] == XS.tolist()
    assert [r["step"] for r in got["all"]] == list(range(8))
    assert [r["value"] for r in got["big"]] == [3.0, 4.0, 5.0, 6.0, 7.0]
    assert [r["step"] for r in got["big"]] == [3, 4, 5, 6, 7]
    assert [r["value"] for r in got["vec"]] == [[t, -t] for t in [3.0, 4.0, 5.0, 6.0, 7.0]]
    assert all(set(r) == {"run", "key", "value", "step"} for r in rows)
    assert all(r["run"] == 0 for r in rows)
    assert "nan" not in path.read_text().lower()


def test_jsonl_real_nan_event_is_kept(tmp_path):
    """Rows are chosen by count, not by NaN-ness: a real NaN event is a line."""

    def f(xs):
        def step(c, x):
            eqx_logs.log("loss", x, step=c)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    path = tmp_path / "logs.jsonl"
    with JsonlLogger(path) as logger:
        logger.write(spooled(f, [1.0, np.nan, 3.0]))
    rows = read_jsonl(path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["value"] == 1.0 and rows[2]["value"] == 3.0
    assert isinstance(rows[1]["value"], float) and math.isnan(rows[1]["value"])


def test_jsonl_nonfinite_values_are_read_back_as_floats(tmp_path):
    # the file keeps strict JSON's spelling, "nan", "inf", "-inf"; read_jsonl (and so the
    # plot command) gives floats: before, the string 'nan' broke min() and np.mean
    xs = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], np.float32)
    vec = np.stack([xs, -xs], axis=1)

    def f(xs):
        def step(c, x):
            eqx_logs.log({"x": x, "vec": jnp.stack([x, -x])}, step=c)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    path = tmp_path / "logs.jsonl"
    with JsonlLogger(path, config={"nan": float("nan")}) as logger:
        logger.write(spooled(f, xs))
    raw = path.read_text()
    assert '"nan"' in raw and '"-inf"' in raw and "NaN" not in raw and "Infinity" not in raw
    rows = read_jsonl(path)
    got = np.array([r["value"] for r in rows if r["key"] == "x"], np.float32)
    np.testing.assert_array_equal(got, xs)  # (NaN where xs has NaN)
    got_vec = np.array([r["value"] for r in rows if r["key"] == "vec"], np.float32)
    np.testing.assert_array_equal(got_vec, vec)
    assert all(type(x) is float for r in rows for x in np.ravel(r["value"]).tolist())
    assert min(got[np.isfinite(got)]) == 1.0 and np.isnan(np.mean(got))
    assert sorted(r["key"] for r in rows if r["step"] == 1) == ["vec", "x"]  # keys as they are

    from eqx_logs._plot import load_curves

    curves, skipped, _ = load_curves([str(path)], ["x"])
    xs_plot, ys_plot = curves["x"]["run 0"]
    assert xs_plot == [0.0, 1.0, 2.0, 3.0, 4.0] and not skipped
    np.testing.assert_array_equal(np.array(ys_plot, np.float32), xs)


def test_jsonl_stack_capacity_keep_last(tmp_path):
    """A ring buffer that saw more events than it holds: one line per kept event, oldest
    first."""

    def f(xs):
        def step(c, x):
            eqx_logs.log("x", x, step=x.astype(jnp.int32))
            return c, None

        return lax.scan(step, 0.0, xs)[0]

    path = tmp_path / "logs.jsonl"
    with JsonlLogger(path) as logger:
        logger.write(spooled(f, reduce=eqx_logs.Stack(capacity=3, keep="last")))
    rows = read_jsonl(path)
    assert [(r["step"], r["value"]) for r in rows] == [(5, 5.0), (6, 6.0), (7, 7.0)]


def test_jsonl_reductions_one_line_per_key(tmp_path):
    xs = np.array([3.0, -1.0, 4.0, 1.5, -5.0, 9.0], np.float32)

    def f(xs):
        def step(c, x):
            eqx_logs.log({"loss": x, "grad/w": 2 * x, "lr": 0.1 * x}, step=c)
            lax.cond(x > 0, lambda: eqx_logs.log("pos", x, step=c), lambda: None)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    policy = eqx_logs.Policy(
        reduce="mean",
        rules={"grad/*": eqx_logs.Fanout(max="max", std="std"), "lr": "drop"},
    )
    path = tmp_path / "logs.jsonl"
    with JsonlLogger(path) as logger:
        logger.write(spooled(f, xs, policy=policy))
    rows = {r["key"]: r for r in read_jsonl(path)}
    assert len(read_jsonl(path)) == 3 and set(rows) == {"loss", "grad/w", "pos"}
    assert math.isclose(rows["loss"]["value"], xs.mean(), rel_tol=1e-6)
    assert rows["loss"]["count"] == 6 and rows["loss"]["step"] == 5
    pos = xs[xs > 0]
    assert math.isclose(rows["pos"]["value"], pos.mean(), rel_tol=1e-6)
    assert rows["pos"]["count"] == len(pos) and rows["pos"]["step"] == 5
    assert set(rows["grad/w"]["value"]) == {"max", "std"}
    assert math.isclose(rows["grad/w"]["value"]["max"], 2 * xs.max(), rel_tol=1e-6)
    assert math.isclose(rows["grad/w"]["value"]["std"], np.std(2 * xs), rel_tol=1e-5)


def test_jsonl_appends(tmp_path):
    path = tmp_path / "logs.jsonl"
    path.write_text('{"key": "earlier", "value": 0}\n')

    def f(x):
        eqx_logs.log("a", x)

    with JsonlLogger(path) as logger:
        logger.write(spooled(f, 1.0))
        logger.write(spooled(f, 2.0))
    with JsonlLogger(path) as logger:  # a new logger on the same file appends too
        logger.write(spooled(f, 3.0))
    assert lines_of(path) == [
        {"key": "earlier", "value": 0},
        {"run": 0, "key": "a", "value": 1.0},
        {"run": 0, "key": "a", "value": 2.0},
        {"run": 0, "key": "a", "value": 3.0},
    ]


def test_jsonl_creates_its_directory(tmp_path):
    path = tmp_path / "a" / "b" / "logs.jsonl"
    logger = JsonlLogger(path)
    assert logger.path == os.fspath(path)
    logger.write(spooled(lambda x: eqx_logs.log("a", x), 1.0))
    logger.close()
    assert lines_of(path) == [{"run": 0, "key": "a", "value": 1.0}]


def test_read_jsonl_round_trips(tmp_path):
    """Values (float32, int32, bool, vectors, dicts) and several step names come back equal
    to what was logged (float32 exactly, as JSON keeps a Python float's digits)."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=5).astype(np.float32)

    def f(xs):
        def step(c, x):
            i = c.astype(jnp.int32)
            eqx_logs.log(
                {
                    "f": x,
                    "i": 7 * i - 3,
                    "b": x > 0,
                    "v": jnp.stack([x, x**2, -x]),
                    "d": {"x": x, "n": i},
                },
                step=i,
                epoch=i // 2,
            )
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    path = tmp_path / "logs.jsonl"
    with JsonlLogger(path) as logger:
        logger.write(spooled(f, xs))
    with open(path, "a") as file:
        file.write("\n")  # a blank line is not a record
    rows = read_jsonl(path)
    assert len(rows) == 5 * 5
    get = {k: [r for r in rows if r["key"] == k] for k in "fibvd"}
    for k, got in get.items():
        assert [r["step"] for r in got] == list(range(5)), k
        assert [r["epoch"] for r in got] == [i // 2 for i in range(5)], k
    assert [r["value"] for r in get["f"]] == [float(x) for x in xs]
    assert [r["value"] for r in get["i"]] == [7 * i - 3 for i in range(5)]
    assert [r["value"] for r in get["b"]] == [bool(x > 0) for x in xs]
    assert all(type(r["value"]) is bool for r in get["b"])
    want_v = np.stack([xs, xs * xs, -xs], axis=1)
    assert [r["value"] for r in get["v"]] == want_v.tolist()
    assert [r["value"] for r in get["d"]] == [{"x": float(x), "n": i} for i, x in enumerate(xs)]


def console_lines(capsys, logger, logs) -> list[str]:
    logger.write(logs)
    logger.flush()  # written on the logger's thread
    out = capsys.readouterr().out
    assert out.endswith("\n")
    return out.splitlines()


def test_console_last_only_aligned(capsys):
    def f(xs):
        def step(c, x):
            t = x.astype(jnp.int32)
            eqx_logs.log({"a": x, "loss": x / 3, "grad/layer0": -x}, step=t)
            return c, None

        return lax.scan(step, 0.0, xs)[0]

    lines = console_lines(capsys, ConsoleLogger(last_only=True), spooled(f))
    (row,) = check_aligned(lines)  # one line: the last step's
    assert list(row) == ["step", "a", "grad/layer0", "loss"], lines
    assert row["step"] == "7"
    want = {"a": XS[-1], "loss": XS[-1] / 3, "grad/layer0": -XS[-1]}
    for key, value in want.items():
        assert math.isclose(float(row[key]), value, rel_tol=1e-3), (key, row[key])
    assert lines == ["step=    7  a=7  grad/layer0=-7  loss=2.333"]


def test_console_every_event_a_line_per_step(capsys):
    """A line per step with every key logged at it (not a block per key), in step order."""
    logs = spooled(conditional)
    assert ConsoleLogger().last_only is False  # every event by default
    lines = console_lines(capsys, ConsoleLogger(last_only=False), logs)
    assert console_lines(capsys, ConsoleLogger(), logs) == lines
    rows = check_aligned(lines)
    assert [row["step"] for row in rows] == [str(t) for t in range(8)], lines
    for t, row in enumerate(rows):
        want = {"step": str(t), "all": str(t)}
        if t > 2:
            want |= {"big": str(t), "vec": f"[{t}, -{t}]"}
        assert row == want, lines
    assert lines[0] == "step=    0  all=0"
    assert lines[3] == "step=    3  all=3  big=3  vec=[3, -3]"
    assert "nan" not in "\n".join(lines)


def test_console_decimal_points_line_up(capsys):
    """Values of different sizes in a column: their decimal points in one column, in one
    write and in the next ones (the widths are kept per run); 4 significant digits."""
    xs = np.array([0.5, 123.25, -0.0125, 7.0, 2e-5, 0.25], np.float32)

    def f(xs):
        def step(c, x):
            eqx_logs.log({"loss": x, "lr": 0.1 * x, "n": c * 100}, step=c)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    logger = ConsoleLogger()
    first = console_lines(capsys, logger, spooled(f, xs[:3]))
    later = console_lines(capsys, logger, spooled(f, xs[3:]))
    assert first == [
        "step=    0  loss=  0.5       lr= 0.05      n=  0",
        "step=    1  loss=123.2       lr=12.32      n=100",
        "step=    2  loss= -0.0125    lr=-0.00125   n=200",
    ]
    rows = check_aligned(first + later)  # the next write keeps the columns
    assert [float(row["loss"]) for row in rows] == pytest.approx(xs.tolist(), rel=1e-3)
    assert later[1] == "step=    1  loss=  2e-05     lr= 2e-06     n=100", later


def test_console_columns_stay_as_the_step_grows_a_digit(capsys):
    """Steps 8, 9 -> 10 -> 99, 100 -> 1000, a write each (as `logger.jit` makes them): every
    key's `name=` starts in the same column on every line, the step right-aligned in
    `step_width` columns (a wider step widens them, once)."""

    def train_step(w, step):
        eqx_logs.log({"loss": w / (1 + step.astype(jnp.float32)), "lr": 0.1 * w}, step=step)
        return w

    steps = [8, 9, 10, 99, 100, 1000]
    with ConsoleLogger() as logger:
        step = logger.jit(train_step, logger.init())
        for i in steps:
            step(jnp.float32(1.0), jnp.int32(i))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  loss=")[0] for line in lines] == [f"step={i:>5}" for i in steps]
    for key in ["loss=", "lr="]:
        columns = {line.index(key) for line in lines}
        assert len(columns) == 1, (key, lines)
    rows = check_aligned(lines)
    assert [float(row["loss"]) for row in rows] == pytest.approx([1 / (1 + i) for i in steps], 1e-3)

    with ConsoleLogger(step_width=2) as logger:  # steps wider than that widen it, once
        step = logger.jit(train_step, logger.init())
        for i in steps:
            step(jnp.float32(1.0), jnp.int32(i))
    lines = capsys.readouterr().out.splitlines()
    assert [line.index("loss=") for line in lines] == [9, 9, 9, 9, 10, 11], lines
    with pytest.raises(ValueError, match="step_width=-1"):
        ConsoleLogger(step_width=-1)


def test_console_events_without_step_and_repeated_steps(capsys):
    """Events without a step: a line each, after the stepped ones; a key logged twice at a
    step: a second line; keys logged at different steps share the lines of their steps."""

    def f(xs):
        def step(c, x):
            eqx_logs.log("loss", x, step=c)
            lax.cond(c % 2 == 0, lambda: eqx_logs.log("even", 10 * x, step=c), lambda: None)
            eqx_logs.log("lr", 0.5 * x)  # no step
            return c + 1, None

        def twice():
            eqx_logs.log("loss", xs[0] + 1, step=0)  # step 0 again

        twice()
        return lax.scan(step, 0, xs)[0]

    lines = console_lines(capsys, ConsoleLogger(), spooled(f, np.arange(1.0, 4.0)))
    rows = check_aligned(lines)
    assert rows == [
        {"step": "0", "even": "10", "loss": "2"},
        {"step": "0", "loss": "1"},
        {"step": "1", "loss": "2"},
        {"step": "2", "even": "30", "loss": "3"},
        {"lr": "0.5"},
        {"lr": "1"},
        {"lr": "1.5"},
    ], lines


def test_console_reductions(capsys):
    xs = np.array([2.0, 4.0, 9.0], np.float32)

    def f(xs):
        def step(c, x):
            eqx_logs.log({"mean_me": x, "m": x}, step=c)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    logs = spooled(f, xs, policy=eqx_logs.Policy(reduce="mean", rules={"m": "max"}))
    lines = console_lines(capsys, ConsoleLogger(), logs)
    (row,) = check_aligned(lines)  # the steps, then the count of events, then the keys
    assert list(row)[:2] == ["step", "count"] and sorted(list(row)[2:]) == ["m", "mean_me"]
    assert row["step"] == "2" and row["count"] == "3", lines
    assert float(row["mean_me"]) == pytest.approx(xs.mean(), rel=1e-3)
    assert float(row["m"]) == pytest.approx(9.0)


def windowed(xs, reduce):
    """Events only where x < 3 (a cond), reduced by `reduce` (a Window): later windows never
    see an event and are padding."""

    def f(xs):
        def step(c, x):
            t = x.astype(jnp.int32)
            lax.cond(x < 3, lambda: eqx_logs.log("a", x, step=t), lambda: None)
            return c, None

        return lax.scan(step, 0.0, xs)[0]

    return spooled(f, xs, reduce=reduce)


def test_records_window_skips_padding_windows(tmp_path):
    xs = np.arange(10.0, dtype=np.float32)
    logs = windowed(xs, eqx_logs.Window(2, "mean"))
    assert np.asarray(logs["a"]).shape == (5,)  # 5 windows allocated, 2 seen
    rows = list(records(logs))
    real = xs[xs < 3]
    want = [real[0:2].mean(), real[2:3].mean()]
    assert [float(r["value"]) for r in rows] == pytest.approx(want)
    assert [int(r["step"]) for r in rows] == [1, 2]
    path = tmp_path / "logs.jsonl"
    with JsonlLogger(path) as logger:
        logger.write(logs)
    assert [(r["value"], r["step"]) for r in read_jsonl(path)] == [(0.5, 1), (2.0, 2)]


def test_records_window_of_integers_skips_padding_windows():
    logs = windowed(np.arange(10.0, dtype=np.float32), eqx_logs.Window(2, "count"))
    rows = list(records(logs))
    assert [(int(r["value"]), int(r["step"])) for r in rows] == [(2, 1), (1, 2)]


def test_records_window_keeps_a_real_nan_window():
    def f(xs):
        def step(c, x):
            eqx_logs.log("loss", x, step=c)
            return c + 1, None

        return lax.scan(step, 0, xs)[0]

    logs = spooled(f, [1.0, np.nan, 3.0, 4.0], reduce=eqx_logs.Window(2, "mean"))
    rows = list(records(logs))
    assert [int(r["step"]) for r in rows] == [1, 3]
    assert np.isnan(rows[0]["value"]) and float(rows[1]["value"]) == 3.5


NASTY_KEYS = [
    "../../x",
    "..",
    ".",
    "",
    "/",
    "/etc/passwd",
    "a/../../b",
    "a/./b",
    "..\\..\\x",
    "~/x",
    "a b/c:d*e?",
    "grad/layer0",
]


def test_safe_name_parent_traversal():
    assert safe_name("../../x") == "x"


@pytest.mark.parametrize("key", NASTY_KEYS)
def test_safe_name_stays_inside(tmp_path, key):
    name = safe_name(key)
    assert name and name not in (".", "..")
    assert os.sep not in name and "/" not in name
    if os.altsep:
        assert os.altsep not in name
    target = (tmp_path / name).resolve()
    assert target.parent == tmp_path.resolve()
    target.write_text("ok")  # a valid file name there
    assert Path(tmp_path, name).read_text() == "ok"


def test_safe_name_keeps_keys_apart():
    assert safe_name("grad/layer0") == "grad__layer0"
    names = [safe_name(k) for k in ["grad/layer0", "grad/layer1", "loss", "run0/loss"]]
    assert len(set(names)) == 4


def test_records_are_host_values():
    """`records` hands out numpy/Python values, not device arrays."""
    rows = list(records(spooled(conditional)))
    for r in rows:
        for leaf in jax.tree.leaves(r):
            assert not isinstance(leaf, jax.Array), r
