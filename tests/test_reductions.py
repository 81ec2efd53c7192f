"""Every reduction against a numpy reference, alone and inside spool.

Alone: `init`/`update`/`finalize` in a Python loop with random validity flags, and `merge`.
Inside spool: straight-line logs, `lax.scan`, nested scans, `lax.while_loop`, `lax.cond`,
`jax.vmap` on both sides of spool, `jax.grad`. One spooled program logs the same value under
one key per reduction (a policy rule per key), so one compilation checks every reduction.
"""

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose, padded
from hypothesis import HealthCheck, given, settings, strategies as st
from hypothesis.extra import numpy as hnp
from jax import lax

import eqx_logs as el

SETTINGS = dict(
    deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)

# Key -> reduction. Values logged under every key are the same; each key has its reduction.
REDUCTIONS = {
    "stack": el.Stack(),
    "stack_first": el.Stack(capacity=3),
    "stack_last": el.Stack(capacity=3, keep="last"),
    "last": el.Last(),
    "first": el.First(),
    "sum": el.Sum(),
    "mean": el.Mean(),
    "min": el.Min(),
    "max": el.Max(),
    "var": el.Var(),
    "std": el.Std(),
    "count": el.Count(),
    "ema": el.EMA(0.75),
    "hist": el.Histogram(4, (-10.0, 10.0)),
    "collect": el.Collect(),
    "collect_cap": el.Collect(capacity=3),
    "window": el.Window(3, "mean"),
    "window_max": el.Window(2, el.Max(), capacity=2),
    "fanout": el.Fanout(mean="mean", recent=el.Stack(capacity=2, keep="last")),
}
# Keys whose reduction is also checked on int32 events.
INT_KEYS = (
    "stack",
    "stack_first",
    "stack_last",
    "last",
    "first",
    "sum",
    "min",
    "max",
    "count",
    "hist",
    "collect",
    "collect_cap",
    "window_max",
)
# The names spool accepts for these keys (rules get the string where there is one).
SPELLED = ("stack", "last", "first", "sum", "mean", "min", "max", "var", "std", "count", "collect")
# Inside a while loop the buffers need a capacity.
WHILE_CAPACITY = 12
WHILE_REDUCTIONS = {
    **REDUCTIONS,
    "stack": el.Stack(capacity=WHILE_CAPACITY),
    "collect": el.Collect(capacity=WHILE_CAPACITY),
    "window": el.Window(3, "mean", capacity=4),
}


def _policy(reductions):
    # The name where the key's reduction is the named one with default arguments.
    rules = {k: (k if k in SPELLED and r == type(r)() else r) for k, r in reductions.items()}
    return el.Policy(rules=rules)


POLICY = _policy(REDUCTIONS)
WHILE_POLICY = _policy(WHILE_REDUCTIONS)
COMBOS = [((), "float32"), ((3,), "float32"), ((), "int32"), ((3,), "int32")]


def keys_for(dtype) -> tuple[str, ...]:
    return INT_KEYS if np.dtype(dtype) == np.int32 else tuple(REDUCTIONS)


# ----------------------------------------------------------------------------------------
# The numpy reference
# ----------------------------------------------------------------------------------------


def _empty(shape, dtype):
    dtype = np.dtype(dtype)
    return np.full(shape, np.nan if np.issubdtype(dtype, np.inexact) else 0, dtype)


def reference(red, events, bound, shape, dtype):
    """What `red` must output for `events` (the valid ones, in order); `bound` is the static
    upper bound on the number of events (None inside while loops)."""
    dtype = np.dtype(dtype)
    ev = np.asarray(events, dtype).reshape((len(events), *shape))
    n = len(ev)
    if isinstance(red, el.Fanout):
        return {
            k: reference(r, events, bound, shape, dtype) for k, r in dict(red.reductions).items()
        }
    if isinstance(red, el.Stack):
        size = bound if red.capacity is None else red.capacity
        kept = ev[:size] if red.keep == "first" else ev[max(0, n - size) :]
        return padded(list(kept), size, shape, dtype)
    if isinstance(red, el.Collect):
        size = bound if red.capacity is None else red.capacity
        return padded(list(ev[:size]), size, shape, dtype).ravel()
    if isinstance(red, el.Window):
        windows = [
            reference(red.inner, ev[i : i + red.size], red.size, shape, dtype)
            for i in range(0, n, red.size)
        ]
        count = red.capacity if red.capacity is not None else math.ceil(bound / red.size)
        one = reference(red.inner, [], red.size, shape, dtype)
        return padded(windows[:count], count, one.shape, one.dtype)
    if isinstance(red, el.Count):
        return np.asarray(n, np.int32)
    if isinstance(red, el.Histogram):
        flat = ev.astype(np.float64).ravel()
        return np.histogram(flat, red.bins, red.range)[0].astype(np.int32)
    if isinstance(red, el.Sum):
        return ev.sum(0).astype(dtype) if n else np.zeros(shape, dtype)
    if isinstance(red, el.Last | el.First | el.Min | el.Max):
        if not n:
            return _empty(shape, dtype)
        pick = {el.Last: lambda e: e[-1], el.First: lambda e: e[0]}
        pick |= {el.Min: lambda e: e.min(0), el.Max: lambda e: e.max(0)}
        return pick[type(red)](ev).astype(dtype)
    # Floating outputs (float32 for float32 and int32 events), NaN without events.
    if not n:
        return _empty(shape, np.float32)
    x = ev.astype(np.float64)
    if isinstance(red, el.Mean):
        out = x.mean(0)
    elif isinstance(red, el.Std):
        out = x.std(0)
    elif isinstance(red, el.Var):
        out = x.var(0)
    elif isinstance(red, el.EMA):
        d = float(red.decay)
        w = (1 - d) * d ** (n - 1 - np.arange(n))
        out = np.tensordot(w, x, axes=1) / (1 - d**n)
    else:
        raise NotImplementedError(red)
    return out.astype(np.float32)


def step_reference(red, steps, bound):
    """The documented alignment of `logs.step[key]`: Stack keeps one step per slot, Window
    the last step of each window, every other reduction the last step."""
    if isinstance(red, el.Stack):
        return reference(red, steps, bound, (), np.int32)
    if isinstance(red, el.Window):
        return reference(el.Window(red.size, el.Last(), red.capacity), steps, bound, (), np.int32)
    return reference(el.Last(), steps, bound, (), np.int32)


def tolerance(red):
    if isinstance(red, el.Var):  # Var and Std
        return dict(rtol=1e-4, atol=1e-3)
    return dict(rtol=1e-5, atol=1e-5)


def check(got, want, red, what):
    if isinstance(red, el.Fanout):
        assert isinstance(got, dict) and set(got) == set(dict(red.reductions)), what
        for k, r in dict(red.reductions).items():
            check(got[k], want[k], r, f"{what}[{k!r}]")
        return
    assert_tree_allclose(got, want, what=what, **tolerance(red))


def check_logs(logs, reductions, keys, lanes_events, lanes_steps, bound, shape, dtype):
    """Check every key of `logs` against the reference for one lane's events and steps."""
    assert set(logs) == set(keys)
    for k in keys:
        red = reductions[k]
        check(logs[k], reference(red, lanes_events, bound, shape, dtype), red, f"logs[{k!r}]")
        assert int(logs.count[k]) == len(lanes_events), f"count[{k!r}]"
        want_steps = step_reference(red, lanes_steps, bound)
        assert_tree_allclose(logs.step[k], want_steps, what=f"step[{k!r}]")


# ----------------------------------------------------------------------------------------
# Strategies
# ----------------------------------------------------------------------------------------


def elements(dtype):
    if np.dtype(dtype) == np.int32:
        return st.integers(-20, 20)
    # A grid of exactly representable floats (bin edges of `hist` included).
    return st.integers(-80, 80).map(lambda i: i / 8)


def values(draw, dtype, shape):
    return draw(hnp.arrays(dtype, shape, elements=elements(dtype)))


# ----------------------------------------------------------------------------------------
# (a) init / update / finalize, (b) merge
# ----------------------------------------------------------------------------------------

BOUND = 12  # max_events given to init in the direct tests


@functools.cache
def _jitted(key):
    red = REDUCTIONS[key]
    return dict(
        update=jax.jit(lambda s, v, ok: red.update(s, v, ok)),
        update_true=jax.jit(lambda s, v: red.update(s, v, True)),
        merge=jax.jit(lambda a, b: red.merge(a, b)),
        finalize=jax.jit(lambda s: red.finalize(s)),
    )


def _fold(key, shape, dtype, xs, valid, python_true=False):
    red, fns = REDUCTIONS[key], _jitted(key)
    state = red.init(jax.ShapeDtypeStruct(shape, np.dtype(dtype)), BOUND)
    for x, ok in zip(xs, valid):
        if python_true:
            state = fns["update_true"](state, jnp.asarray(x))
        else:
            state = fns["update"](state, jnp.asarray(x), jnp.asarray(ok))
    return state


@st.composite
def direct_case(draw, key):
    n = draw(st.integers(1, BOUND))
    shape = draw(st.sampled_from([(), (3,)]))
    dtype = draw(st.sampled_from(["float32", "int32"] if key in INT_KEYS else ["float32"]))
    xs = values(draw, dtype, (n, *shape))
    python_true = draw(st.booleans())
    valid = np.ones(n, bool) if python_true else draw(hnp.arrays(np.bool_, (n,)))
    split = draw(st.integers(0, n))
    return xs, valid, python_true, split


@pytest.mark.parametrize("key", list(REDUCTIONS))
@settings(max_examples=30, **SETTINGS)
@given(data=st.data())
def test_update_finalize_against_numpy(key, data):
    xs, valid, python_true, _ = data.draw(direct_case(key))
    shape, dtype = xs.shape[1:], xs.dtype
    red = REDUCTIONS[key]
    state = _fold(key, shape, dtype, xs, valid, python_true)
    got = _jitted(key)["finalize"](state)
    want = reference(red, list(xs[valid]), BOUND, shape, dtype)
    check(got, want, red, f"{key} on {xs.tolist()} valid={valid.tolist()}")


def _window_merge_reference(red, a_events, b_events, shape, dtype):
    """Window.merge: the windows of `a` (its last, partial window closed), then those of `b`."""
    count = red.capacity if red.capacity is not None else math.ceil(BOUND / red.size)
    windows = []
    for events in (a_events, b_events):
        windows += [
            reference(red.inner, events[i : i + red.size], red.size, shape, dtype)
            for i in range(0, len(events), red.size)
        ]
    one = reference(red.inner, [], red.size, shape, dtype)
    return padded(windows[:count], count, one.shape, one.dtype)


@pytest.mark.parametrize("key", list(REDUCTIONS))
@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_merge_equals_one_state_fed_both(key, data):
    xs, valid, _, split = data.draw(direct_case(key))
    shape, dtype = xs.shape[1:], xs.dtype
    red, fns = REDUCTIONS[key], _jitted(key)
    a = _fold(key, shape, dtype, xs[:split], valid[:split])
    b = _fold(key, shape, dtype, xs[split:], valid[split:])
    got = fns["finalize"](fns["merge"](a, b))
    what = f"merge of {key} split at {split}: {xs.tolist()} {valid.tolist()}"
    a_events, b_events = list(xs[:split][valid[:split]]), list(xs[split:][valid[split:]])
    if isinstance(red, el.Window):
        want = _window_merge_reference(red, a_events, b_events, shape, dtype)
        check(got, want, red, what)
        if len(a_events) % red.size:
            return
    want = reference(red, a_events + b_events, BOUND, shape, dtype)
    check(got, want, red, what)
    both = fns["finalize"](_fold(key, shape, dtype, xs, valid))
    check(got, both, red, f"merge of {key} vs one state")


@functools.cache
def _sample_merge(k):
    def run(key, xa, va, xb, vb):
        ka, kb, km = jax.random.split(key, 3)
        states = []
        for subkey, xs, valid in ((ka, xa, va), (kb, xb, vb)):
            red = el.Sample(k, key=subkey)
            state = red.init(jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype), None)
            step = lambda s, x_ok, red=red: (red.update(s, *x_ok), None)  # noqa: E731
            states.append(lax.scan(step, state, (xs, valid))[0])
        red = el.Sample(k, key=km)
        return red.finalize(red.merge(*states))

    return jax.jit(run)


@settings(max_examples=20, **SETTINGS)
@given(
    k=st.integers(1, 4),
    va=hnp.arrays(np.bool_, (5,)),
    vb=hnp.arrays(np.bool_, (6,)),
    seed=st.integers(0, 2**31 - 1),
)
def test_sample_merge_is_a_subset_of_the_union(k, va, vb, seed):
    xa = np.arange(1.0, 6.0, dtype=np.float32)
    xb = np.arange(6.0, 12.0, dtype=np.float32)
    key = jax.random.key(seed)
    got = _sample_merge(k)(key, xa, va, xb, vb)
    _check_sample(got, list(xa[va]) + list(xb[vb]), k, f"k={k} {va.tolist()} {vb.tolist()}")
    np.testing.assert_array_equal(got, _sample_merge(k)(key, xa, va, xb, vb))


def test_sample_merge_is_uniform_over_many_keys():
    k, draws = 2, 2000
    xa = jnp.arange(3.0)
    xb = jnp.arange(3.0, 8.0)
    va, vb = jnp.ones(3, bool), jnp.ones(5, bool)
    run = jax.jit(jax.vmap(_sample_merge(k), in_axes=(0, None, None, None, None)))
    got = np.asarray(run(jax.random.split(jax.random.key(3), draws), xa, va, xb, vb))
    got = got.astype(int)
    assert np.all(got[:, 0] != got[:, 1])
    p = k / 8
    freq = np.bincount(got.ravel(), minlength=8)
    sd = math.sqrt(draws * p * (1 - p))
    assert np.all(np.abs(freq - draws * p) < 5 * sd), freq


@pytest.mark.parametrize("key", list(REDUCTIONS))
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_invalid_nonfinite_event_leaves_state_unchanged(key, bad):
    red, fns = REDUCTIONS[key], _jitted(key)
    struct = jax.ShapeDtypeStruct((3,), np.float32)
    xs = np.array([[1, 2, 3], [bad, bad, -bad], [3, 3, 3]], np.float32)
    valid = np.array([True, False, True])
    state = red.init(struct, BOUND)
    for x, ok in zip(xs, valid):
        state = fns["update"](state, jnp.asarray(x), jnp.asarray(ok))
    want = reference(red, list(xs[valid]), BOUND, (3,), np.float32)
    check(fns["finalize"](state), want, red, f"{key} after an invalid {bad} event")


def test_zero_events_give_documented_empty_values():
    def f(xs):
        lax.cond(xs[0] > 100, lambda: el.log({k: xs for k in REDUCTIONS}), lambda: None)
        return xs

    _, logs = el.spool(f, policy=POLICY)(jnp.ones(3))
    for k in ("last", "first", "mean", "min", "max", "var", "std", "ema"):
        assert logs[k].shape == (3,) and np.all(np.isnan(logs[k])), k
    for k in ("stack", "stack_first", "stack_last", "collect", "collect_cap", "window"):
        assert np.all(np.isnan(logs[k])), k
    assert logs["stack"].shape == (1, 3) and logs["collect"].shape == (3,)
    assert logs["window"].shape == (1, 3) and logs["window_max"].shape == (2, 3)
    np.testing.assert_array_equal(logs["sum"], [0, 0, 0])
    np.testing.assert_array_equal(logs["hist"], [0, 0, 0, 0])
    assert int(logs["count"]) == 0 and logs["count"].dtype == jnp.int32
    assert all(int(c) == 0 for c in logs.count.values())
    # Integer events: 0 instead of NaN.
    _, logs = el.spool(f, policy=POLICY)(jnp.ones(3, jnp.int32))
    for k in ("last", "first", "min", "max", "sum"):
        assert logs[k].dtype == jnp.int32 and np.all(np.asarray(logs[k]) == 0), k


# ----------------------------------------------------------------------------------------
# (c) inside spool. Programs are module-level functions so that spool's cache is reused.
# ----------------------------------------------------------------------------------------


def _log(x, keys, i):
    el.log({k: x for k in keys}, step=i)


def straight(xs, keys):
    for i in range(xs.shape[0]):
        _log(xs[i], keys, i)
    return xs


def scanned(xs, keys):
    def body(c, xi):
        _log(*xi[:1], keys, xi[1])
        return c + 1, None

    return lax.scan(body, 0, (xs, jnp.arange(xs.shape[0])))[0]


def nested(xs, keys):  # xs: (a, b, ...), events in row-major order
    a, b = xs.shape[:2]

    def outer(c, row_i):
        row, i = row_i

        def inner(c, x_j):
            _log(x_j[0], keys, i * b + x_j[1])
            return c, None

        lax.scan(inner, 0, (row, jnp.arange(b)))
        return c + 1, None

    return lax.scan(outer, 0, (xs, jnp.arange(a)))[0]


def while_prog(xs, m, keys):  # logs xs[0], ..., xs[m - 1]; m is traced
    def body(i):
        _log(xs[i], keys, i)
        return i + 1

    return lax.while_loop(lambda i: i < m, body, 0)


def cond_prog(xs, mask, keys):  # logs xs[i] where mask[i]
    def body(c, args):
        x, ok, i = args
        lax.cond(ok, lambda: _log(x, keys, i), lambda: None)
        return c + ok.astype(jnp.int32), None

    return lax.scan(body, 0, (xs, mask, jnp.arange(xs.shape[0])))[0]


def vmapped_cond(xs, mask, keys):
    return jax.vmap(lambda x, m: cond_prog(x, m, keys))(xs, mask)


def vmapped_while(xs, m, keys):
    return jax.vmap(lambda x, n: while_prog(x, n, keys))(xs, m)


def grad_prog(w, xs, keys):
    def body(c, xi):
        y = xi[0] * w
        _log(y, keys, xi[1])
        return c + jnp.sum(jnp.sin(y)), None

    return lax.scan(body, 0.0, (xs, jnp.arange(xs.shape[0])))[0]


grad_of_prog = jax.grad(grad_prog)


def _check_single(logs, xs, valid, bound, reductions=REDUCTIONS):
    shape, dtype = xs.shape[1:], xs.dtype
    steps = [i for i in range(len(xs)) if valid[i]]
    check_logs(logs, reductions, keys_for(dtype), list(xs[valid]), steps, bound, shape, dtype)


@pytest.mark.parametrize("shape, dtype", COMBOS)
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_spool_straight_line(shape, dtype, data):
    n = data.draw(st.sampled_from([1, 5]))
    xs = values(data.draw, dtype, (n, *shape))
    _, logs = el.spool(straight, policy=POLICY)(jnp.asarray(xs), keys_for(dtype))
    _check_single(logs, xs, np.ones(n, bool), n)


@pytest.mark.parametrize("shape, dtype", COMBOS)
@settings(max_examples=15, **SETTINGS)
@given(data=st.data())
def test_spool_scan(shape, dtype, data):
    xs = values(data.draw, dtype, (7, *shape))
    out, logs = el.spool(scanned, policy=POLICY)(jnp.asarray(xs), keys_for(dtype))
    assert int(out) == 7
    _check_single(logs, xs, np.ones(7, bool), 7)


@pytest.mark.parametrize("shape, dtype", COMBOS)
@settings(max_examples=12, **SETTINGS)
@given(data=st.data())
def test_spool_nested_scan(shape, dtype, data):
    xs = values(data.draw, dtype, (3, 4, *shape))
    _, logs = el.spool(nested, policy=POLICY)(jnp.asarray(xs), keys_for(dtype))
    _check_single(logs, xs.reshape(12, *shape), np.ones(12, bool), 12)


@pytest.mark.parametrize("shape, dtype", COMBOS)
@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_spool_while_loop(shape, dtype, data):
    xs = values(data.draw, dtype, (WHILE_CAPACITY, *shape))
    m = data.draw(st.integers(0, WHILE_CAPACITY))
    out, logs = el.spool(while_prog, policy=WHILE_POLICY)(
        jnp.asarray(xs), jnp.int32(m), keys_for(dtype)
    )
    assert int(out) == m
    valid = np.arange(WHILE_CAPACITY) < m
    _check_single(logs, xs, valid, None, WHILE_REDUCTIONS)


@pytest.mark.parametrize("key", ["stack", "collect", "window"])
def test_while_loop_without_capacity_names_key_and_suggests_capacity(key):
    red = REDUCTIONS[key]
    xs = jnp.arange(4.0)
    with pytest.raises(ValueError, match=r"key 'w'.*while_loop.*Stack\(capacity="):
        el.spool(while_prog, reduce=red)(xs, jnp.int32(2), ("w",))
    # With a capacity the same program works.
    _, logs = el.spool(while_prog, reduce=WHILE_REDUCTIONS[key])(xs, jnp.int32(2), ("w",))
    assert int(logs.count["w"]) == 2


@pytest.mark.parametrize("shape, dtype", COMBOS)
@settings(max_examples=20, **SETTINGS)
@given(data=st.data())
def test_spool_cond_counts_only_taken_events(shape, dtype, data):
    xs = values(data.draw, dtype, (12, *shape))
    mask = data.draw(hnp.arrays(np.bool_, (12,)))
    out, logs = el.spool(cond_prog, policy=POLICY)(jnp.asarray(xs), mask, keys_for(dtype))
    assert int(out) == mask.sum()
    _check_single(logs, xs, mask, 12)


# -- vmap on both sides of spool ---------------------------------------------------------------

B = 3


def _lanes(reductions, keys, xs, valid, bound):
    """Per-lane (values, counts, steps) references."""
    shape, dtype = xs.shape[2:], xs.dtype
    lanes = []
    for b in range(B):
        events = list(xs[b][valid[b]])
        steps = list(np.flatnonzero(valid[b]))
        lanes.append(
            {
                k: (
                    reference(reductions[k], events, bound, shape, dtype),
                    len(events),
                    step_reference(reductions[k], steps, bound),
                )
                for k in keys
            }
        )
    return lanes


def _stack_lanes(red, outs, spool_outside):
    """Combine per-lane outputs: vmap(spool) puts the batch axis first; spool(vmap) puts it
    after the event/window axis for Stack, Collect, Window, Sample, first otherwise."""
    if isinstance(red, el.Fanout):
        named = dict(red.reductions).items()
        return {k: _stack_lanes(r, [o[k] for o in outs], spool_outside) for k, r in named}
    event_axis = isinstance(red, el.Stack | el.Collect | el.Window | el.Sample)
    return np.stack(outs, axis=1 if (spool_outside and event_axis) else 0)


def _check_batched(logs, reductions, keys, lanes, spool_outside):
    assert set(logs) == set(keys)
    for k in keys:
        red = reductions[k]
        want = _stack_lanes(red, [lane[k][0] for lane in lanes], spool_outside)
        check(logs[k], want, red, f"logs[{k!r}]")
        np.testing.assert_array_equal(logs.count[k], [lane[k][1] for lane in lanes], k)
        step_red = red if isinstance(red, el.Stack | el.Window) else el.Last()
        want_steps = _stack_lanes(step_red, [lane[k][2] for lane in lanes], spool_outside)
        assert_tree_allclose(logs.step[k], want_steps, what=f"step[{k!r}]")


@pytest.mark.parametrize("spool_outside", [False, True], ids=["vmap_of_spool", "spool_of_vmap"])
@pytest.mark.parametrize("shape, dtype", [((3,), "float32"), ((), "int32")])
@settings(max_examples=15, **SETTINGS)
@given(data=st.data())
def test_vmap_cond_with_batched_predicate(spool_outside, shape, dtype, data):
    xs = values(data.draw, dtype, (B, 12, *shape))
    mask = data.draw(hnp.arrays(np.bool_, (B, 12)))
    keys = keys_for(dtype)
    if spool_outside:
        out, logs = el.spool(vmapped_cond, policy=POLICY)(jnp.asarray(xs), mask, keys)
    else:
        out, logs = _vmap_of_spool(cond_prog, keys)(jnp.asarray(xs), mask)
    np.testing.assert_array_equal(out, mask.sum(1))
    lanes = _lanes(REDUCTIONS, keys, xs, mask, 12)
    _check_batched(logs, REDUCTIONS, keys, lanes, spool_outside)


@functools.cache
def _vmap_of_spool(prog, keys):
    policy = WHILE_POLICY if prog is while_prog else POLICY
    return jax.jit(jax.vmap(lambda x, m: el.spool(prog, policy=policy)(x, m, keys)))


@pytest.mark.parametrize("spool_outside", [False, True], ids=["vmap_of_spool", "spool_of_vmap"])
@settings(max_examples=15, **SETTINGS)
@given(data=st.data())
def test_vmap_while_loop_with_batched_predicate(spool_outside, data):
    xs = values(data.draw, "float32", (B, WHILE_CAPACITY, 3))
    m = data.draw(hnp.arrays(np.int32, (B,), elements=st.integers(0, WHILE_CAPACITY)))
    keys = tuple(REDUCTIONS)
    if spool_outside:
        out, logs = el.spool(vmapped_while, policy=WHILE_POLICY)(jnp.asarray(xs), m, keys)
    else:
        out, logs = _vmap_of_spool(while_prog, keys)(jnp.asarray(xs), m)
    np.testing.assert_array_equal(out, m)
    valid = np.arange(WHILE_CAPACITY)[None, :] < m[:, None]
    lanes = _lanes(WHILE_REDUCTIONS, keys, xs, valid, None)
    _check_batched(logs, WHILE_REDUCTIONS, keys, lanes, spool_outside)


def test_spool_of_vmap_reduces_per_lane_not_over_batch_or_features():
    xs = jnp.arange(24.0).reshape(2, 4, 3)  # (B, T, features)
    _, logs = el.spool(vmapped_cond, reduce="mean")(xs, jnp.ones((2, 4), bool), ("x",))
    assert logs["x"].shape == (2, 3)
    np.testing.assert_allclose(logs["x"], np.asarray(xs).mean(1))
    np.testing.assert_array_equal(logs.count["x"], [4, 4])
    _, logs = el.spool(vmapped_cond, reduce="stack")(xs, jnp.ones((2, 4), bool), ("x",))
    assert logs["x"].shape == (4, 2, 3)  # (T, B, ...)
    np.testing.assert_array_equal(logs["x"], np.moveaxis(np.asarray(xs), 1, 0))


# -- grad ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(), (3,)])
@settings(max_examples=10, **SETTINGS)
@given(data=st.data())
def test_spool_of_grad_records_forward_values_once(shape, data):
    xs = values(data.draw, "float32", (7, *shape))
    w = np.float32(1.5)
    keys = tuple(REDUCTIONS)
    g, logs = el.spool(grad_of_prog, policy=POLICY)(w, jnp.asarray(xs), keys)
    np.testing.assert_allclose(g, np.sum(np.cos(xs * w) * xs), rtol=1e-4, atol=1e-4)
    _check_single(logs, xs * w, np.ones(7, bool), 7)


# ----------------------------------------------------------------------------------------
# Sample
# ----------------------------------------------------------------------------------------


def _check_sample(sample, events, k, what):
    """`sample` is a subset of `events` without repetition, min(n, k) of them, NaN after."""
    sample = np.asarray(sample)
    n = len(events)
    assert sample.shape[0] == k, what
    real = sample[: min(n, k)]
    assert not np.any(np.isnan(real)), what
    assert np.all(np.isnan(sample[min(n, k) :])), what
    chosen = [tuple(np.atleast_1d(r)) for r in real]
    pool = [tuple(np.atleast_1d(e)) for e in events]
    assert len(set(chosen)) == len(chosen), f"{what}: repeated {chosen}"
    assert set(chosen) <= set(pool), f"{what}: {chosen} not in {pool}"


@functools.cache
def _sample_fold(k):
    def fold(key, xs, valid):
        red = el.Sample(k, key=key)
        state = red.init(jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype), None)

        def body(s, x_ok):
            return red.update(s, *x_ok), None

        return red.finalize(lax.scan(body, state, (xs, valid))[0])

    return jax.jit(fold)


@settings(max_examples=30, **SETTINGS)
@given(
    k=st.integers(1, 4),
    valid=hnp.arrays(np.bool_, (12,)),
    seed=st.integers(0, 2**31 - 1),
    shape=st.sampled_from([(), (3,)]),
)
def test_sample_direct_is_reproducible_subset_without_repetition(k, valid, seed, shape):
    # Distinct events so repetition is visible.
    xs = (np.arange(12, dtype=np.float32) + 1).reshape(12, *([1] * len(shape)))
    xs = np.broadcast_to(xs, (12, *shape)).copy()
    key = jax.random.key(seed)
    got = _sample_fold(k)(key, xs, valid)
    _check_sample(got, list(xs[valid]), k, f"k={k} valid={valid.tolist()}")
    np.testing.assert_array_equal(got, _sample_fold(k)(key, xs, valid))


def _sample_prog(xs):
    def body(c, x_i):
        el.log("x", x_i[0], step=x_i[1])
        return c, None

    return lax.scan(body, 0, (xs, jnp.arange(xs.shape[0])))[0]


def test_sample_in_spool_is_reproducible_and_steps_line_up():
    xs = jnp.arange(10.0) * 10
    samples = []
    for seed in range(6):
        _, logs = el.spool(_sample_prog, reduce=el.Sample(3), key=jax.random.key(seed))(xs)
        _, again = el.spool(_sample_prog, reduce=el.Sample(3), key=jax.random.key(seed))(xs)
        np.testing.assert_array_equal(logs["x"], again["x"])
        _check_sample(logs["x"], list(np.asarray(xs)), 3, f"seed {seed}")
        np.testing.assert_array_equal(logs.step["x"] * 10, logs["x"])  # aligned with values
        assert int(logs.count["x"]) == 10
        samples.append(tuple(np.asarray(logs["x"])))
    assert len(set(samples)) > 1, "different keys should give different samples"
    # Fewer events than k: all of them, NaN after.
    _, logs = el.spool(_sample_prog, reduce=el.Sample(4), key=jax.random.key(0))(xs[:2])
    _check_sample(logs["x"], [0.0, 10.0], 4, "n < k")


def test_sample_in_cond_while_and_vmap():
    key = jax.random.key(1)
    xs = np.arange(1.0, 13.0, dtype=np.float32)
    mask = np.arange(12) % 3 == 0
    _, logs = el.spool(cond_prog, reduce=el.Sample(2), key=key)(xs, mask, ("x",))
    _check_sample(logs["x"], list(xs[mask]), 2, "cond")
    _, logs = el.spool(while_prog, reduce=el.Sample(2), key=key)(xs, jnp.int32(5), ("x",))
    _check_sample(logs["x"], list(xs[:5]), 2, "while")
    assert int(logs.count["x"]) == 5
    xb = np.stack([xs, xs + 100])
    mb = np.stack([mask, ~mask])
    _, logs = el.spool(vmapped_cond, reduce=el.Sample(2), key=key)(xb, mb, ("x",))
    assert logs["x"].shape == (2, 2)  # (k, B)
    for b in range(2):
        _check_sample(logs["x"][:, b], list(xb[b][mb[b]]), 2, f"lane {b}")


def test_sample_without_key_is_an_error_naming_key():
    with pytest.raises(ValueError, match="key"):
        el.spool(_sample_prog, reduce=el.Sample(2))(jnp.arange(3.0))


def test_sample_is_uniform_over_many_keys():
    n, k, draws = 6, 2, 2000
    xs = jnp.arange(n, dtype=jnp.float32)

    @jax.jit
    def many(keys):
        return jax.vmap(lambda key: el.spool(_sample_prog, reduce=el.Sample(k), key=key)(xs))(keys)[
            1
        ]["x"]

    got = np.asarray(many(jax.random.split(jax.random.key(0), draws))).astype(int)
    assert got.shape == (draws, k)
    assert np.all(got[:, 0] != got[:, 1])
    # Each event is chosen with probability k / n.
    p = k / n
    freq = np.bincount(got.ravel(), minlength=n)
    sd = math.sqrt(draws * p * (1 - p))
    assert np.all(np.abs(freq - draws * p) < 5 * sd), freq
    # Each unordered pair with probability 1 / C(n, k).
    pairs = {pair: 0 for pair in itertools.combinations(range(n), k)}
    for row in got:
        pairs[tuple(sorted(row))] += 1
    q = 1 / len(pairs)
    sd = math.sqrt(draws * q * (1 - q))
    assert all(abs(c - draws * q) < 5 * sd for c in pairs.values()), pairs


# ----------------------------------------------------------------------------------------
# Construction, composition, edge cases
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: el.Stack(capacity=0), r"Stack\(capacity=0\)"),
        (lambda: el.Stack(keep="middle"), r"keep='middle'"),
        (lambda: el.Collect(capacity=-1), r"Collect\(capacity=-1\)"),
        (lambda: el.Window(0), r"Window\(size=0\)"),
        (lambda: el.Window(2, capacity=0), r"Window\(capacity=0\)"),
        (lambda: el.Window(2, "meen"), r"'meen' is not a reduction"),
        (lambda: el.Histogram(0, (0.0, 1.0)), r"Histogram\(bins=0\)"),
        (lambda: el.Histogram(3, (1.0, 0.0)), r"Histogram\(range=\(1.0, 0.0\)\)"),
        (lambda: el.EMA(1.0), r"EMA\(decay=1.0\)"),
        (lambda: el.EMA(-0.1), r"EMA\(decay=-0.1\)"),
        (lambda: el.Sample(0), r"Sample\(k=0\)"),
        (lambda: el.Fanout(), r"Fanout needs at least one"),
        (lambda: el.Fanout(a="meen"), r"'meen' is not a reduction"),
    ],
)
def test_reduction_validation_names_field_and_value(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_window_steps_and_partial_last_window():
    def f(xs):
        def body(c, x_i):
            el.log("w", x_i[0], step=x_i[1])
            return c, None

        return lax.scan(body, 0, (xs, jnp.arange(xs.shape[0]) * 10))[0]

    xs = jnp.arange(7.0)
    _, logs = el.spool(f, reduce=el.Window(3, "sum"))(xs)
    np.testing.assert_allclose(logs["w"], [0 + 1 + 2, 3 + 4 + 5, 6])
    np.testing.assert_array_equal(logs.step["w"], [20, 50, 60])
    assert int(logs.count["w"]) == 7
    _, logs = el.spool(f, reduce=el.Window(2, el.Stack()))(xs)  # inner keeps each window
    np.testing.assert_allclose(logs["w"], [[0, 1], [2, 3], [4, 5], [6, np.nan]])
    _, logs = el.spool(f, reduce=el.Fanout(w=el.Window(4, "max"), n="count"))(xs)
    np.testing.assert_allclose(logs["w"]["w"], [3, 6])
    assert int(logs["w"]["n"]) == 7


def test_ema_with_array_decay_and_decay_zero():
    xs = np.array([1.0, 2.0, 4.0], np.float32)

    def f(xs):
        return lax.scan(lambda c, x: (el.log("x", x), c)[1:] + (None,), 0, xs)[0]

    for decay in (0.0, 0.5, jnp.float32(0.9)):
        _, logs = el.spool(f, reduce=el.EMA(decay))(xs)
        want = reference(el.EMA(float(decay)), list(xs), 3, (), np.float32)
        np.testing.assert_allclose(logs["x"], want, rtol=1e-6)
    np.testing.assert_allclose(el.spool(f, reduce=el.EMA(0.0))(xs)[1]["x"], 4.0)


def test_histogram_ignores_outside_values_and_includes_right_edge():
    h = el.Histogram(4, (0.0, 4.0))
    state = h.init(jax.ShapeDtypeStruct((6,), jnp.float32), 1)
    x = np.array([-0.5, 0.0, 1.0, 3.5, 4.0, 4.5], np.float32)
    got = h.finalize(h.update(state, jnp.asarray(x), True))
    np.testing.assert_array_equal(got, np.histogram(x, 4, (0.0, 4.0))[0])
    np.testing.assert_array_equal(got, [1, 1, 0, 2])


def test_histogram_bins_values_near_edges_like_numpy():
    h = el.Histogram(4, (-10.0, 10.0))
    x = np.array([np.nextafter(np.float32(5), np.float32(0))], np.float32)
    state = h.init(jax.ShapeDtypeStruct((1,), jnp.float32), 1)
    got = h.finalize(h.update(state, jnp.asarray(x), True))
    np.testing.assert_array_equal(got, np.histogram(x, 4, (-10.0, 10.0))[0])


def test_min_max_keep_bool_dtype():
    struct = jax.ShapeDtypeStruct((2,), jnp.bool_)
    for red in (el.Min(), el.Max()):
        state = red.update(red.init(struct, 1), jnp.array([True, False]), True)
        assert red.finalize(state).dtype == jnp.bool_, red
