"""Every built-in reduction x every dtype x straight line / `lax.scan` / `lax.cond` /
`lax.while_loop`, against numpy computed on the host from the same inputs.

The output dtypes (stated in each reduction's docstring) are fixed by the events' dtype, the
same in every context; statistics are never rounded to a dtype narrower than the one they
were computed in:

- Stack, Collect, Sample, Last, First, Min, Max: the events' dtype.
- Sum: `jnp.sum`'s for bool and integers: those narrower than JAX's default integer widen to
  it (int32, or int64 under x64; unsigned ones to uint32 / uint64), wider ones are kept;
  float16 and bfloat16 are summed, and reported, in float32; other dtypes are kept.
- Mean, Var, Std, EMA: float32 and float64 kept, float16 and bfloat16 computed and reported
  in float32, bool and integers give JAX's default float (float32, or float64 under x64),
  as `jnp.mean`.
- Count, Histogram: int32. Window: its inner reduction's dtype, per window.

Every combination is meaningful (a bool's mean is a fraction, its min a logical and), so none
raises. One compiled program per dtype covers every context and reduction (a policy rule per
key); where it fails, each test runs its own combination alone, to name the culprit.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import eqx_logs as el

N = 6  # events per context
KEEP = np.array([True, False, True, True, False, True])  # the cond context's predicates
CONTEXTS = ("straight", "scan", "cond", "while")
RANGE = (-201.0, 299.4)  # the histogram's range: no event lies on a bin edge

# name -> reduction (the Sample's k exceeds the events: it keeps them all, in order)
REDUCTIONS = {
    "stack": el.Stack(),
    "stack_cap": el.Stack(capacity=8),
    "stack_last": el.Stack(capacity=4, keep="last"),
    "collect": el.Collect(capacity=8),
    "sample": el.Sample(8, key=jax.random.key(0)),
    "last": el.Last(),
    "first": el.First(),
    "sum": el.Sum(),
    "count": el.Count(),
    "mean": el.Mean(),
    "min": el.Min(),
    "max": el.Max(),
    "var": el.Var(),
    "std": el.Std(),
    "ema": el.EMA(0.75),
    "histogram": el.Histogram(4, RANGE),
    "window_mean": el.Window(4, "mean", capacity=2),
    "window_sum": el.Window(4, "sum", capacity=2),
    "fanout": el.Fanout(max="max", var="var"),
}
UNBOUNDED = {"stack"}  # needs a static bound: not inside a while loop

X32 = ("bool", "int8", "int16", "int32", "uint8", "uint16", "uint32")
X32 += ("float16", "bfloat16", "float32")
X64 = X32 + ("int64", "uint64", "float64")
# spooled under x64: the new dtypes, and one of each kind whose rule x64 changes
X64_SPOOLED = ("bool", "int8", "uint32", "int64", "float64")
# spooled under x64 and with an interval: the reductions whose rules these could change
LIGHT = tuple(n for n in REDUCTIONS if n not in ("sample", "histogram", "collect"))
NAMES = {"bfloat16": ml_dtypes.bfloat16, "bool": np.bool_}

# Per column: an integer sum that overflows the narrow dtypes (int32's wraps without x64, as in
# `jnp.sum`), a run that float16 (bfloat16) would accumulate wrongly on its own
# (2048 + 1 == 2048), and negative values for signed types.
COLUMNS = {
    "bool": [[1, 0, 1, 1, 0, 1], [0, 0, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]],
    "int8": [[100, 120, 90, -5, 7, 110], [-128, -100, 3, -50, 0, 127], [1, 2, 3, 4, 5, 6]],
    "int16": [[30000, 20000, -1000, 5, 7, 3000], [-32768, -1, 2, -30000, 0, 3], [4, 3, 2, 1, 0, 9]],
    "int32": [[2**30, 2**30, 2**29, -5, 7, 2**30], [-(2**31), 1, 2, 3, 4, 5], [7, 0, -7, 1, 2, 3]],
    "int64": [[2**40, 3, -(2**50), 2**62, 5, 6], [-(2**63), 1, 2, 3, 4, 5], [7, 0, -7, 1, 2, 3]],
    "uint8": [[200, 250, 100, 3, 7, 255], [0, 1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4]],
    "uint16": [[60000, 50000, 100, 3, 7, 65535], [0, 1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4]],
    "uint32": [[3 * 10**9, 10**9, 100, 3, 7, 2], [0, 1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4]],
    "uint64": [[2**63, 2**40, 100, 3, 7, 2], [0, 1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4]],
    "float16": [[2048, 1, 1, 1, 1, 1], [0.25, -3.5, 100.5, 7, -60, 1.75], [1, 2, 3, 4, 5, 6]],
    "bfloat16": [[256, 1, 1, 1, 1, 1], [0.25, -3.5, 100.5, 7, -60, 1.75], [1, 2, 3, 4, 5, 6]],
    "float32": [[1e7, 0.5, 0.25, -3, 1, 2], [0.1, -3.5, 100.5, 7, -60, 1.75], [1, 2, 3, 4, 5, 6]],
    "float64": [[1e15, 0.5, 0.25, -3, 1, 2], [0.1, -3.5, 100.5, 7, -60, 1.75], [1, 2, 3, 4, 5, 6]],
}


def _dtype(name: str) -> np.dtype:
    return np.dtype(NAMES.get(name, name))


def _events(name: str) -> np.ndarray:
    """The N events of a dtype, each of shape (3,)."""
    dtype = _dtype(name)
    return np.array([np.array(c, dtype=object).astype(dtype) for c in COLUMNS[name]]).T.copy()


# -- the dtype rules, written out for numpy -------------------------------------------------


HALVES = (np.dtype(np.float16), _dtype("bfloat16"))


def _sum_dtype(dtype: np.dtype, x64: bool) -> np.dtype:
    if dtype == np.bool_:
        return np.dtype(np.int64 if x64 else np.int32)
    if dtype.kind in "iu":
        default = np.dtype(f"{dtype.kind}{8 if x64 else 4}")
        return default if dtype.itemsize < default.itemsize else dtype
    return np.dtype(np.float32) if dtype in HALVES else dtype


def _float_dtype(dtype: np.dtype, x64: bool) -> np.dtype:
    if dtype in HALVES:
        return np.dtype(np.float32)
    if dtype.kind == "f":
        return dtype
    return np.dtype(np.float64 if x64 else np.float32)


def _fill(dtype: np.dtype):
    return np.nan if dtype.kind == "f" or dtype == _dtype("bfloat16") else 0


def padded(events: list, bound: int, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """`events` stacked and padded to `bound` rows of NaN (inexact dtypes, bfloat16 too) or 0."""
    out = np.full((bound, *shape), _fill(dtype), dtype)
    out[: len(events)] = events[:bound]
    return out


def _windows(events: np.ndarray, reduce, size: int, capacity: int, dtype: np.dtype):
    rows = [reduce(events[i : i + size]) for i in range(0, len(events), size)]
    return padded(rows, capacity, events.shape[1:], dtype)


def expected(name: str, events: np.ndarray, bound: int, x64: bool):
    """The output of reduction `name` for `events` (the real ones, in order), on the host.
    `bound` is the static bound on their number."""
    dtype = events.dtype
    wide = events.astype(np.float64)  # exact for every event above (but int64/uint64 extremes)
    fdtype = _float_dtype(dtype, x64)
    sdtype = _sum_dtype(dtype, x64)
    n, shape = len(events), events.shape[1:]

    def total(e):
        if sdtype.kind in "iub":
            return e.astype(sdtype).sum(0, dtype=sdtype)
        return e.astype(np.float64).sum(0).astype(sdtype)

    def mean(e):
        return e.astype(np.float64).mean(0).astype(fdtype)

    def var(e):
        return e.astype(np.float64).var(0).astype(fdtype)

    if name == "stack":
        return padded(list(events), bound, shape, dtype)
    if name in ("stack_cap", "sample"):
        return padded(list(events), 8, shape, dtype)
    if name == "collect":
        return padded(list(events), 8, shape, dtype).ravel()
    if name == "stack_last":
        return padded(list(events[-4:]), 4, shape, dtype)
    if name in ("last", "first"):
        if not n:
            return np.full(shape, _fill(dtype), dtype)
        return events[-1 if name == "last" else 0]
    if name == "sum":
        return total(events)
    if name == "count":
        return np.int32(n)
    if name == "mean":
        return mean(events)
    if name in ("min", "max"):
        return (events.min if name == "min" else events.max)(0)
    if name == "var":
        return var(events)
    if name == "std":
        return np.sqrt(events.astype(np.float64).var(0)).astype(fdtype)
    if name == "ema":
        d = 0.75
        weights = (1 - d) * d ** np.arange(n - 1, -1, -1.0)
        return ((weights[:, None] * wide).sum(0) / (1 - d**n)).astype(fdtype)
    if name == "histogram":
        values = events.astype(np.float32).ravel()
        return np.histogram(values, 4, range=RANGE)[0].astype(np.int32)
    if name == "window_mean":
        return _windows(events, mean, 4, 2, fdtype)
    if name == "window_sum":
        return _windows(events, total, 4, 2, sdtype)
    if name == "fanout":
        return {"max": events.max(0), "var": var(events)}
    raise AssertionError(name)


def _tolerance(dtype: np.dtype) -> dict:
    """One rounding in the output dtype (halves are computed in float32, rounded once)."""
    if dtype == np.float16:
        return dict(rtol=2**-10, atol=0)
    if dtype == _dtype("bfloat16"):
        return dict(rtol=2**-7, atol=0)
    if dtype == np.float32:
        return dict(rtol=1e-5, atol=1e-6)
    return dict(rtol=1e-9, atol=0)


def check(got, want, what: str) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{what}: {got}"
        for k in want:
            check(got[k], want[k], f"{what}[{k!r}]")
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        wide = [np.asarray(x, np.float64) for x in (got, want)]
        np.testing.assert_allclose(*wide, equal_nan=True, err_msg=what, **_tolerance(want.dtype))


# -- the programs ---------------------------------------------------------------------------


def program(contexts, names, interval: int):
    """A jitted spool of every context in `contexts`, logging the same events under one key
    per reduction name (`"{context}/{name}"`)."""

    def log(context, x):
        el.log({f"{context}/{n}": x for n in names if context != "while" or n not in UNBOUNDED})

    def f(xs, keep, n):
        for context in contexts:
            if context == "straight":
                for i in range(N):
                    log(context, xs[i])
            elif context == "scan":
                lax.scan(lambda c, x: (log(context, x), (c, None))[1], None, xs)
            elif context == "cond":  # in a scan: one cond, so one copy of every update

                def step(c, x_keep):
                    x, k = x_keep
                    lax.cond(k, functools.partial(log, context), lambda x: None, x)
                    return c, None

                lax.scan(step, None, (xs, keep))
            else:

                def body(i):
                    log(context, xs[i])
                    return i + 1

                lax.while_loop(lambda i: i < n, body, jnp.zeros((), jnp.int32))
        return None

    rules = {f"*/{name}": REDUCTIONS[name] for name in names}
    return jax.jit(el.spool(f, policy=el.Policy(rules=rules, interval=interval)))


def run(dtype_name: str, x64: bool, interval: int, contexts=CONTEXTS, names=tuple(REDUCTIONS)):
    with jax.enable_x64(x64):
        xs = jnp.asarray(_events(dtype_name))
        assert xs.dtype == _dtype(dtype_name), xs.dtype
        _, logs = program(contexts, names, interval)(xs, jnp.asarray(KEEP), jnp.int32(N))
        return jax.tree.map(np.asarray, dict(logs)), {k: int(c) for k, c in logs.count.items()}


@functools.cache
def shared(dtype_name: str, x64: bool, interval: int, names: tuple):
    """Every context and reduction of one dtype in one program; the exception if it fails."""
    try:
        return run(dtype_name, x64, interval, CONTEXTS, names)
    except Exception as e:  # each test then runs its own combination, to say which fails
        return e


def outcome(dtype_name: str, x64: bool, interval: int, context: str, name: str, names):
    result = shared(dtype_name, x64, interval, names)
    if isinstance(result, Exception):
        result = run(dtype_name, x64, interval, (context,), (name,))
    logs, counts = result
    key = f"{context}/{name}"
    return logs[key], counts[key]


def _check_case(
    dtype_name: str, x64: bool, interval: int, context: str, name: str, names=tuple(REDUCTIONS)
):
    if context == "while" and name in UNBOUNDED:  # no static bound: an error naming the key
        with jax.enable_x64(x64):
            value = jnp.asarray(_events(dtype_name))[0]

            def f(n):
                def body(i):
                    el.log({"while/stack": value})
                    return i + 1

                return lax.while_loop(lambda i: i < n, body, 0)

            with pytest.raises(ValueError, match=r"key 'while/stack' is logged inside a `lax.w"):
                el.spool(f, reduce="stack", interval=interval)(jnp.int32(N))
        return
    got, count = outcome(dtype_name, x64, interval, context, name, names)
    events = _events(dtype_name)
    if context == "cond":
        events = events[KEEP]
    events = events[::interval]
    bound = -(-N // interval)
    check(got, expected(name, events, bound, x64), f"{dtype_name} {context}/{name}")
    assert count == len(events), (count, len(events))


def _params(values, fast=()):
    """`values` as parameters, those in `fast` marked fast (tuples: several arguments)."""

    def param(v):
        marks = [pytest.mark.fast] if v in fast else []
        return (
            pytest.param(*v, marks=marks) if isinstance(v, tuple) else pytest.param(v, marks=marks)
        )

    return [param(v) for v in values]


@pytest.mark.parametrize("name", list(REDUCTIONS))
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("dtype_name", _params(X32, fast=("int8",)))
def test_dtype(dtype_name, context, name):
    """The issue's case first: an int8 sum in a scan or cond was JAX's carry (branch) type
    error, naming no key."""
    _check_case(dtype_name, False, 1, context, name)


@pytest.mark.parametrize("name", LIGHT)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("dtype_name", X64_SPOOLED)
def test_dtype_x64(dtype_name, context, name):
    """Under x64 (a subset: `test_state_dtypes` takes every dtype and reduction)."""
    _check_case(dtype_name, True, 1, context, name, LIGHT)


@pytest.mark.parametrize("name", LIGHT)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("dtype_name", ["int8"])
def test_dtype_interval(dtype_name, context, name):
    """`interval=2`: every other event of each key, in every context."""
    _check_case(dtype_name, False, 2, context, name, LIGHT)


@pytest.mark.parametrize(
    "x64, dtype_name",
    _params([(False, d) for d in X32] + [(True, d) for d in X64], fast=[(True, "int8")]),
)
def test_state_dtypes(x64, dtype_name):
    """Every method of every reduction keeps the state's dtypes (and structure) as `init`
    made them, so that loop carries and cond branches agree with straight-line code; and
    `finalize` gives the documented dtype and shape. Traced only (no compilation), so every
    dtype is checked, under x64 too."""
    with jax.enable_x64(x64):
        dtype = _dtype(dtype_name)
        events = _events(dtype_name)
        value = jax.ShapeDtypeStruct(events.shape[1:], dtype)
        for name, reduction in REDUCTIONS.items():

            def methods(valid, x, r=reduction):
                s0 = r.init(value, N)
                s1 = r.update(s0, x, valid)
                s2 = r.update(s1, x, True)
                s3 = r.update_many(s2, [x, x])
                s4 = r.init_many(value, N, [x] * N)
                s5 = r.merge(s3, s4)
                return [s0, s1, s2, s3, s4, s5], r.finalize(s5)

            bool_ = jax.ShapeDtypeStruct((), np.bool_)
            states, out = jax.eval_shape(methods, bool_, value)
            init = jax.tree.structure(states[0]), [x.dtype for x in jax.tree.leaves(states[0])]
            for what, state in zip(
                ("update", "update", "update_many", "init_many", "merge"), states[1:]
            ):
                got = jax.tree.structure(state), [x.dtype for x in jax.tree.leaves(state)]
                assert got == init, f"{dtype_name} {name}: state {what} {got} != init's {init}"
            want = expected(name, events, N, x64)
            for o, w in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
                got, want_ = (o.dtype, o.shape), (np.asarray(w).dtype, np.shape(w))
                assert got == want_, f"{dtype_name} {name}: finalize gives {got}, not {want_}"


# -- Python numbers beside arrays under one key ----------


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "int8"])
@pytest.mark.parametrize("reduce", ["stack", "mean", "sum", "max"])
def test_python_numbers_take_their_keys_dtype_before_reducing(dtype_name, reduce):
    """A Python number is weakly typed: logged under a key whose other events are arrays of
    a dtype, it is that dtype (as `jnp.asarray(0.1, dtype)`) before it is stacked or
    reduced; against numpy on the events so cast, eagerly, jitted and scanned."""
    dtype = jnp.dtype(dtype_name)
    python = 0.1 if jnp.issubdtype(dtype, jnp.floating) else 100
    events = np.array([np.asarray(1.0, dtype), np.asarray(python, dtype)])
    wide = events.astype(np.float64)
    want = {
        "stack": events,
        "mean": wide.mean(),
        "sum": wide.sum(),
        "max": events.max(),
    }[reduce]

    def f(x):
        el.log("k", jnp.asarray(1, dtype), reduce=None if reduce == "stack" else reduce)
        el.log("k", python, reduce=None if reduce == "stack" else reduce)
        return x

    def scanned(x):
        return lax.scan(lambda c, _: (f(c), None), x, None, length=1)[0]

    for name, fun in {
        "eager": el.spool(f),
        "jit": jax.jit(el.spool(f)),
        "scan": el.spool(scanned),
    }.items():
        _, logs = fun(jnp.float32(0.0))
        got = np.asarray(logs["k"])
        if reduce in ("stack", "max"):  # the events' dtype, exactly
            assert got.dtype == dtype, (name, got.dtype)
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-6, err_msg=name)


def test_a_python_number_that_does_not_fit_its_keys_dtype_names_the_key_and_site():
    def f(x):
        el.log("k", jnp.int8(3))
        el.log("k", 200)  # (no int8)
        return x

    for fun in (el.spool(f), jax.jit(el.spool(f))):
        with pytest.raises(OverflowError, match=r"key 'k' holds int8.*test_dtypes\.py:\d+"):
            fun(jnp.float32(0.0))
    with pytest.raises(OverflowError, match="key 'k' holds int8"):
        el.tap(f, callback=lambda logs, steps: None, buffer=4)(jnp.float32(0.0))


def test_an_event_without_a_step_has_the_step_minus_one():
    """A key whose sites log a step, all but one: that one's events get -1 (no step), in
    every form and under `vmap`."""

    def f(x):
        el.log("k", x, step=5)
        el.log("k", x + 1.0)

        def body(c, i):
            el.log("k", c, step=i)
            el.log("k", c)
            return c, None

        lax.scan(body, x, jnp.arange(2, dtype=jnp.int32))
        return x

    want = [5, -1, 0, -1, 1, -1]
    for fun in (el.spool(f), jax.jit(el.spool(f))):
        _, logs = fun(jnp.float32(1.0))
        assert np.asarray(logs.step["k"]).tolist() == want
    _, logs = jax.vmap(el.spool(f))(jnp.arange(2.0))
    assert np.asarray(logs.step["k"]).tolist() == [want, want]
