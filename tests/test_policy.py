"""Policy: validation, rules, call-site reductions, tags/exclude/interval/prefix, spool
keyword overrides, Policy as a `filter_jit` argument, and memory on the accelerator."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_tree_allclose
from jax import lax

import eqx_logs as el

pytestmark = pytest.mark.fast  # in `make test-fast`

XS = jnp.arange(10.0)


def train(xs):
    """Per step t: grad/w = 2t, grad/b = -t, loss = t, lr = 0.1 t, debug/act = (t, t);
    "odd" = t only on odd steps (a data-dependent cond)."""

    def step(c, x):
        t = x.astype(jnp.int32)
        el.log({"grad/w": 2 * x, "grad/b": -x, "loss": x, "lr": 0.1 * x}, step=t)
        el.log("debug/act", x * jnp.ones(2), step=t)
        lax.cond(t % 2 == 1, lambda: el.log("odd", x, step=t), lambda: None)
        return c + x, None

    return lax.scan(step, 0.0, xs)[0]


def tagged(xs):
    def step(c, x):
        el.log("t", x, tags="train")
        el.log("e", x, tags=("eval",))
        el.log("d", x, tags=("train", "debug"))
        el.log("u", x)
        return c, None

    return lax.scan(step, 0.0, xs)[0]


def close(got, want, what="output"):
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6, err_msg=what)


# ----------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(interval=0), ValueError, r"Policy\(interval=0\): interval must be"),
        (dict(interval=-3), ValueError, r"Policy\(interval=-3\)"),
        (dict(interval=1.5), ValueError, r"Policy\(interval=1.5\)"),
        (dict(interval=True), ValueError, r"Policy\(interval=True\)"),
        (dict(window=0), ValueError, r"Policy\(window=0\): window must be"),
        (dict(window=2.0), ValueError, r"Policy\(window=2.0\)"),
        (dict(reduce="meen"), ValueError, r"Policy\(reduce\)='meen' is not a reduction.*'mean'"),
        (dict(reduce="drop"), ValueError, r"Policy\(reduce\)='drop' is not a reduction"),
        (dict(reduce=3), ValueError, r"Policy\(reduce\)=3 is not a reduction"),
        (dict(rules={"x/*": "meen"}), ValueError, r"Policy\(rules\['x/\*'\]\)='meen'"),
        (dict(rules=["a"]), TypeError, r"Policy\(rules=\['a'\]\)"),
        (dict(rules={1: "mean"}), TypeError, r"Policy\(rules\).*got 1"),
        (dict(tags=[1]), TypeError, r"Policy\(tags=\(1,\)\)"),
        (dict(exclude=3), TypeError, r"Policy\(exclude=3\)"),
        (dict(prefix=3), TypeError, r"Policy\(prefix=3\)"),
    ],
)
def test_policy_validation_names_field_and_value(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        el.Policy(**kwargs)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(interval=0), ValueError, r"interval=0"),
        (dict(window=0), ValueError, r"window=0"),
        (dict(reduce="meen"), ValueError, r"reduce\)='meen' is not a reduction"),
        (dict(policy="mean"), TypeError, r"spool\(policy=...\) takes an eqx_logs.Policy"),
        (dict(policy=el.Policy(), interval=0), ValueError, r"interval=0"),
    ],
)
def test_spool_options_are_validated_like_policy(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        el.spool(train, **kwargs)


def test_call_site_reduce_is_validated():
    def f(x):
        el.log("x", x, reduce="meen")
        return x

    with pytest.raises(ValueError, match=r"'meen' is not a reduction"):
        el.spool(f)(jnp.float32(1.0))


def test_names_and_aliases():
    assert el.Policy(reduce="append").reduce == el.Stack()
    assert el.Policy(reduce="replace").reduce == el.Last()
    for name, cls in [("first", el.First), ("var", el.Var), ("count", el.Count)]:
        assert el.Policy(reduce=name).reduce == cls()
    stack = el.spool(train, reduce="stack")(XS)[1]
    append = el.spool(train, reduce="append")(XS)[1]
    assert_tree_allclose(dict(append), dict(stack))
    replace = el.spool(train, reduce="replace")(XS)[1]
    close(replace["loss"], 9.0)
    close(replace["odd"], 9.0)


# ----------------------------------------------------------------------------------------
# Rules
# ----------------------------------------------------------------------------------------


def test_rules_fnmatch_first_match_wins_and_drop():
    policy = el.Policy(
        reduce="last",
        rules={"grad/w": "sum", "grad/*": "max", "lo[sx]s": "mean", "debug/*": "drop"},
    )
    _, logs = el.spool(train, policy=policy)(XS)
    assert sorted(logs) == ["grad/b", "grad/w", "loss", "lr", "odd"]
    assert "debug/act" not in logs.count and "debug/act" not in logs.step
    close(logs["grad/w"], 2 * 45.0)  # the first matching rule, not "grad/*"
    close(logs["grad/b"], 0.0)  # max of -t
    close(logs["loss"], 4.5)
    close(logs["lr"], 0.9)  # no rule: the policy's reduce
    np.testing.assert_array_equal(logs.count["grad/w"], 10)
    np.testing.assert_array_equal(logs.count["odd"], 5)
    # Order decides: with "grad/*" first, "grad/w" is a max too.
    policy = el.Policy(reduce="last", rules={"grad/*": "max", "grad/w": "sum"})
    _, logs = el.spool(train, policy=policy)(XS)
    close(logs["grad/w"], 18.0)
    # Patterns are case-sensitive and match whole keys; the likely typos are said
    policy = el.Policy(reduce="last", rules={"LOSS": "drop", "grad": "drop", "?": "drop"})
    with pytest.warns(UserWarning, match=r"rules=\{'LOSS': ...\}.*did you mean 'loss'") as got:
        _, logs = el.spool(train, policy=policy)(XS)
    assert "loss" in logs and "grad/w" in logs
    said = [str(w.message) for w in got]
    assert any("rules={'grad': ...}" in m and "mean 'grad/" in m for m in said), said
    assert not any("'?'" in m for m in said), said  # resembles nothing: silent


def test_rule_reductions_may_be_modules_and_apply_per_key():
    policy = el.Policy(
        rules={
            "grad/*": el.Fanout(mean="mean", max=el.Max()),
            "loss": el.Window(4, "sum"),
            "*": "count",
        }
    )
    _, logs = el.spool(train, policy=policy)(XS)
    close(logs["grad/w"]["mean"], 9.0)
    close(logs["grad/w"]["max"], 18.0)
    close(logs["loss"], [0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9])
    np.testing.assert_array_equal(logs.step["loss"], [3, 7, 9])
    assert int(logs["lr"]) == 10 and int(logs["odd"]) == 5 and int(logs["debug/act"]) == 10


# ----------------------------------------------------------------------------------------
# Call-site reductions
# ----------------------------------------------------------------------------------------


def sites(xs, reduce_a=None, reduce_b=None):
    def step(c, x):
        el.log("acc", x, reduce=reduce_a)
        el.log("acc", 10 * x, reduce=reduce_b)
        el.log("other", x)
        return c, None

    return lax.scan(step, 0.0, xs)[0]


def test_call_site_reduce_precedence():
    xs = jnp.arange(4.0)
    events = [0.0, 0.0, 1.0, 10.0, 2.0, 20.0, 3.0, 30.0]
    # The call site's reduction beats the policy's reduce; other keys keep the policy's.
    _, logs = el.spool(sites, reduce="stack")(xs, "mean")
    close(logs["acc"], np.mean(events))
    close(logs["other"], [0, 1, 2, 3])
    assert int(logs.count["acc"]) == 8
    # A matching rule beats the call site.
    _, logs = el.spool(sites, policy=el.Policy(rules={"ac?": "max"}))(xs, "mean")
    close(logs["acc"], 30.0)
    _, logs = el.spool(sites, policy=el.Policy(rules={"acc": "drop"}))(xs, "mean")
    assert sorted(logs) == ["other"]
    # Both sites naming the same reduction (aliases included), or one naming it.
    _, logs = el.spool(sites)(xs, "last", "replace")
    close(logs["acc"], 30.0)
    _, logs = el.spool(sites)(xs, None, el.Window(3, "sum"))
    close(logs["acc"], [1.0, 32.0, 33.0])


def test_two_sites_naming_different_reductions_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match=r"key 'acc'.*different reductions.*'mean'.*'sum'"):
        el.spool(sites)(jnp.arange(3.0), "mean", "sum")
    with pytest.raises(ValueError, match=r"key 'acc'"):
        el.spool(sites)(jnp.arange(3.0), el.Window(2), el.Window(3))


def _metric(name, value, how):
    el.log(name, value, reduce=how)


def helper_sites(x):
    _metric("acc", x, "mean")
    _metric("acc", x + 1, "sum")
    return x


def test_conflicting_reductions_through_one_helper_are_an_error():
    with pytest.raises(ValueError, match=r"key 'acc'"):
        el.spool(helper_sites)(jnp.float32(1.0))


def test_fanout_at_a_call_site():
    def f(x):
        el.log("a", x, reduce=el.Fanout(mean="mean", max="max"))
        return x

    _, logs = el.spool(f)(jnp.float32(2.0))
    close(logs["a"]["mean"], 2.0)


# ----------------------------------------------------------------------------------------
# tags, exclude, interval, prefix, window
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tags, exclude, kept",
    [
        (None, (), "tedu"),
        ("train", (), "td"),
        (("train", "eval"), (), "ted"),
        (None, "debug", "teu"),
        ("train", "debug", "t"),
        (None, ("eval", "train"), "u"),
    ],
)
def test_tags_and_exclude(tags, exclude, kept):
    xs = jnp.arange(3.0)
    for logs in (
        el.spool(tagged, tags=tags, exclude=exclude)(xs)[1],
        el.spool(tagged, policy=el.Policy(tags=tags, exclude=exclude))(xs)[1],
    ):
        assert sorted(logs) == sorted(kept)
        for k in kept:
            close(logs[k], [0, 1, 2])
            assert int(logs.count[k]) == 3


def test_interval_keeps_steps_that_are_multiples():
    _, logs = el.spool(train, interval=3, reduce="stack")(XS)
    close(logs["loss"], [0, 3, 6, 9])  # steps 0, 3, 6, 9
    np.testing.assert_array_equal(logs.step["loss"], [0, 3, 6, 9])
    # "odd" (odd steps only) keeps its steps that are multiples of 3; the bound is ceil(10 / 3)
    close(logs["odd"], [3, 9, np.nan, np.nan])
    np.testing.assert_array_equal(logs.step["odd"][:2], [3, 9])
    assert int(logs.count["loss"]) == 4 and int(logs.count["odd"]) == 2
    _, logs = el.spool(train, interval=3, reduce="mean")(XS)
    close(logs["loss"], 4.5)
    close(logs["odd"], 6.0)
    np.testing.assert_array_equal(logs.step["odd"], 9)


def test_interval_without_a_step_counts_events_per_key():
    def f(xs):
        def step(c, x):
            el.log("all", x)
            lax.cond(x.astype(jnp.int32) % 2 == 1, lambda: el.log("odd", x), lambda: None)
            return c, None

        return lax.scan(step, 0.0, xs)[0]

    _, logs = el.spool(f, interval=3)(XS)
    close(logs["all"], [0, 3, 6, 9])
    # "odd" has its own count: its events 0 and 3 are the values 1 and 7
    close(logs["odd"], [1, 7, np.nan, np.nan])
    assert int(logs.count["odd"]) == 2


def test_interval_in_a_while_loop_and_across_sites():
    def f(n):
        def body(i):
            el.log("i", i)
            el.log("i", -i)
            return i + 1

        return lax.while_loop(lambda i: i < n, body, 0)

    _, logs = el.spool(f, interval=3, reduce=el.Stack(capacity=5))(jnp.int32(4))
    # Events in order: 0, -0, 1, -1, 2, -2, 3, -3; every third.
    np.testing.assert_array_equal(logs["i"], [0, -1, 3, 0, 0])
    assert int(logs.count["i"]) == 3
    _, logs = el.spool(f, interval=2, reduce="sum")(jnp.int32(5))
    assert int(logs["i"]) == 0 + 1 + 2 + 3 + 4 and int(logs.count["i"]) == 5


def test_interval_under_spool_of_vmap_counts_per_lane():
    def f(xs):
        def step(c, x):
            lax.cond(x > 0, lambda: el.log("x", x), lambda: None)
            return c, None

        return lax.scan(step, 0.0, xs)[0]

    xs = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, -2.0, 3.0, -4.0, 5.0]])
    _, logs = el.spool(jax.vmap(f), interval=2, reduce="stack")(xs)
    close(logs["x"], [[1, 1], [3, 5], [5, np.nan]])  # (T, B)
    np.testing.assert_array_equal(logs.count["x"], [3, 2])


def test_prefix_applies_to_values_counts_and_steps_after_rules():
    policy = el.Policy(reduce="last", rules={"lr": "drop"}, prefix="run0/")
    _, logs = el.spool(train, policy=policy)(XS)
    assert sorted(logs) == ["run0/debug/act", "run0/grad/b", "run0/grad/w", "run0/loss", "run0/odd"]
    assert sorted(logs.count) == sorted(logs)
    assert sorted(logs.step) == sorted(logs)
    close(logs["run0/loss"], 9.0)
    np.testing.assert_array_equal(logs.step["run0/odd"], 9)


def test_window_wraps_every_reduction_and_follows_interval():
    _, logs = el.spool(train, reduce="mean", window=3)(XS)
    close(logs["loss"], [1.0, 4.0, 7.0, 9.0])  # a last, partial window
    np.testing.assert_array_equal(logs.step["loss"], [2, 5, 8, 9])
    close(logs["odd"], [3.0, 8.0, np.nan, np.nan])  # windows of its own events 1,3,5 | 7,9
    policy = el.Policy(reduce="mean", window=2, interval=2, rules={"grad/*": "max"})
    _, logs = el.spool(train, policy=policy)(XS)
    close(logs["loss"], [1.0, 5.0, 8.0])  # events 0, 2 | 4, 6 | 8
    close(logs["grad/w"], [4.0, 12.0, 16.0])  # the rule's reduction, windowed


# ----------------------------------------------------------------------------------------
# spool keywords override the policy
# ----------------------------------------------------------------------------------------


def test_spool_keywords_override_policy_fields():
    policy = el.Policy(reduce="mean", interval=2, prefix="p/", exclude="debug")
    _, logs = el.spool(tagged, policy=policy)(XS)
    assert sorted(logs) == ["p/e", "p/t", "p/u"]
    close(logs["p/t"], 4.0)  # mean of 0, 2, 4, 6, 8
    _, logs = el.spool(tagged, policy=policy, reduce="sum")(XS)
    close(logs["p/t"], 20.0)
    _, logs = el.spool(tagged, policy=policy, interval=1)(XS)
    close(logs["p/t"], 4.5)
    assert int(logs.count["p/t"]) == 10
    _, logs = el.spool(tagged, policy=policy, prefix="q/")(XS)
    assert sorted(logs) == ["q/e", "q/t", "q/u"]
    _, logs = el.spool(tagged, policy=policy, tags="eval")(XS)
    assert sorted(logs) == ["p/e"]
    _, logs = el.spool(tagged, policy=policy, exclude="train")(XS)
    assert sorted(logs) == ["p/e", "p/u"]
    _, logs = el.spool(tagged, policy=policy, window=2)(XS)
    close(logs["p/t"], [1.0, 5.0, 8.0])
    # The policy itself is unchanged.
    assert policy.interval == 2 and policy.prefix == "p/" and policy.reduce == el.Mean()
    _, logs = el.spool(tagged, policy=policy)(XS)
    close(logs["p/t"], 4.0)


def _sample_prog(xs):
    def step(c, x):
        el.log({"a": x, "b": x}, step=x.astype(jnp.int32))
        return c, None

    return lax.scan(step, 0.0, xs)[0]


def test_key_from_policy_or_spool():
    key = jax.random.key(7)
    _, via_spool = el.spool(_sample_prog, reduce=el.Sample(3), key=key)(XS)
    _, via_policy = el.spool(_sample_prog, policy=el.Policy(reduce=el.Sample(3), key=key))(XS)
    assert_tree_allclose(dict(via_spool), dict(via_policy))
    assert_tree_allclose(via_spool.step["a"], via_policy.step["a"])
    # A spool key overrides the policy's; log keys are sampled independently.
    differs, independent = False, False
    for seed in range(3):
        other = jax.random.key(seed)
        _, logs = el.spool(_sample_prog, policy=el.Policy(reduce=el.Sample(3), key=key), key=other)(
            XS
        )
        differs |= not np.array_equal(logs["a"], via_policy["a"])
        independent |= not np.array_equal(logs["a"], logs["b"])
        for k in "ab":
            got = np.asarray(logs[k])
            assert len(set(got.tolist())) == 3 and set(got.tolist()) <= set(range(10))
            np.testing.assert_array_equal(logs.step[k], got)
    assert differs and independent


# ----------------------------------------------------------------------------------------
# A Policy as an argument of eqx.filter_jit
# ----------------------------------------------------------------------------------------


def _ema_prog(xs):
    return lax.scan(lambda c, x: (el.log("x", x), c)[1:] + (None,), 0.0, xs)[0]


def _ema(xs, decay):
    n = len(xs)
    w = (1 - decay) * decay ** (n - 1 - np.arange(n))
    return np.sum(w * np.asarray(xs)) / (1 - decay**n)


def test_policy_array_fields_do_not_retrace_static_fields_do():
    traces = []

    @eqx.filter_jit
    def run(policy, xs):
        traces.append(policy)
        return el.spool(_ema_prog, policy=policy)(xs)[1]["x"]

    xs = jnp.array([1.0, 4.0, 2.0, 8.0])
    got = run(el.Policy(reduce=el.EMA(jnp.float32(0.9))), xs)
    close(got, _ema(xs, 0.9))
    got = run(el.Policy(reduce=el.EMA(jnp.float32(0.5))), xs)
    assert len(traces) == 1, "changing an array field retraced"
    close(got, _ema(xs, 0.5))  # and the new value is used
    got = run(el.Policy(rules={"x": el.EMA(jnp.float32(0.25))}), xs)
    assert len(traces) == 2  # a different structure
    got = run(el.Policy(rules={"x": el.EMA(jnp.float32(0.75))}), xs)
    assert len(traces) == 2
    close(got, _ema(xs, 0.75))
    got = run(el.Policy(reduce=el.EMA(jnp.float32(0.5)), interval=2), xs)
    assert len(traces) == 3, "changing interval must retrace"
    close(got, _ema(xs[::2], 0.5))
    run(el.Policy(reduce=el.EMA(jnp.float32(0.5)), prefix=""), xs)
    assert len(traces) == 3  # an equal policy


def test_policy_key_does_not_retrace():
    traces = []

    @eqx.filter_jit
    def run(policy, xs):
        traces.append(policy)
        return el.spool(_sample_prog, policy=policy)(xs)[1]["a"]

    samples = set()
    for seed in range(4):
        key = jax.random.key(seed)
        got = run(el.Policy(reduce=el.Sample(3), key=key), XS)
        want = el.spool(_sample_prog, reduce=el.Sample(3), key=key)(XS)[1]["a"]
        np.testing.assert_array_equal(got, want)
        samples.add(tuple(np.asarray(got).tolist()))
    assert len(traces) == 1
    assert len(samples) > 1
    run(el.Policy(reduce=el.Sample(2), key=jax.random.key(0)), XS)  # k is static
    assert len(traces) == 2


def test_policy_is_a_pytree_whose_leaves_are_its_arrays():
    key = jax.random.key(0)
    policy = el.Policy(reduce=el.EMA(jnp.float32(0.9)), rules={"a": "max"}, key=key)
    arrays = jax.tree.leaves(eqx.filter(policy, eqx.is_array))
    assert len(arrays) == 2
    flat, treedef = jax.tree.flatten(policy)
    again = jax.tree.unflatten(treedef, flat)
    assert again.interval == 1 and dict(again.rules) == {"a": el.Max()}


# ----------------------------------------------------------------------------------------
# An invalid event's non-finite value must not leak into Mean/Var/Std/EMA
# ----------------------------------------------------------------------------------------


def test_interval_skipped_nan_does_not_reach_mean():
    _, logs = el.spool(_ema_prog, reduce="mean", interval=2)(jnp.array([1.0, jnp.nan, 3.0]))
    close(logs["x"], 2.0)


def _guarded_log(xs):
    def step(c, x):
        lax.cond(x > 0, lambda: el.log("logx", jnp.log(x)), lambda: None)
        return c, None

    return lax.scan(step, 0.0, xs)[0]


def test_spool_of_vmap_equals_vmap_of_spool_with_nan_in_untaken_branch():
    xs = jnp.array([[1.0, -1.0], [np.e, 1.0]])
    _, inside = jax.vmap(el.spool(_guarded_log, reduce="mean"))(xs)
    close(inside["logx"], [0.0, 0.5])
    _, outside = el.spool(jax.vmap(_guarded_log), reduce="mean")(xs)
    close(outside["logx"], [0.0, 0.5])


# ----------------------------------------------------------------------------------------
# Memory: the reduction runs inside the loop
# ----------------------------------------------------------------------------------------

SIDE, STEPS = 256, 1000
ARRAY = SIDE * SIDE * 4  # bytes of one logged float32 array


def _big_loop(x):
    def step(c, _):
        c = c * 0.99 + 1.0
        el.log("a", c)
        return c, None

    return jnp.sum(lax.scan(step, x, None, length=STEPS)[0])


def _memory(**kwargs):
    x = jax.ShapeDtypeStruct((SIDE, SIDE), jnp.float32)
    stats = jax.jit(el.spool(_big_loop, **kwargs)).lower(x).compile().memory_analysis()
    assert stats is not None, "memory_analysis unavailable"
    return stats.temp_size_in_bytes, stats.output_size_in_bytes


def test_memory_of_reductions_in_a_long_scan():
    temp, out = _memory(reduce="mean")
    assert temp + out < 10 * ARRAY, (temp / ARRAY, out / ARRAY)
    assert out >= ARRAY  # the mean itself
    temp100, out100 = _memory(reduce="stack", interval=100)
    assert 10 * ARRAY <= out100 < 12 * ARRAY, out100 / ARRAY
    assert temp100 < 10 * ARRAY, temp100 / ARRAY
    temp1, out1 = _memory(reduce="stack")
    assert 90 < out1 / out100 < 110, (out1 / ARRAY, out100 / ARRAY)
    assert out1 >= STEPS * ARRAY


def _lanes_program(x):
    def step(c, i):
        c = jnp.sin(c) + i
        el.log({"s": c.sum(), "v": c})
        return c, None

    return lax.scan(step, x, jnp.arange(3.0))[0]


def _lanes_reference(xs):
    """Per step and lane, `s` of `_lanes_program` in numpy: shape (steps, lanes)."""
    c, out = np.asarray(xs, np.float32), []
    for i in range(3):
        c = np.sin(c) + i
        out.append(c.sum(-1))
    return np.stack(out)


@pytest.mark.parametrize("reduce", ["mean", "sum", "max", "var", "stack", "first", "last"])
def test_across_merges_named_vmap_lanes(reduce):
    """`across` names a vmap's `axis_name` as it names a mesh axis: the lanes' results are
    merged with the reduction's `merge`, lane 0's events first."""
    xs = jnp.arange(8.0).reshape(4, 2) / 8
    s = _lanes_reference(xs)
    want = {
        "mean": s.mean(),
        "sum": s.sum(),
        "max": s.max(),
        "var": s.var(),
        "stack": s.T.reshape(-1),
        "first": s[0, 0],
        "last": s[-1, -1],
    }[reduce]
    fn = jax.vmap(_lanes_program, axis_name="b")
    _, logs = el.spool(fn, reduce=reduce, across="b")(xs)
    np.testing.assert_allclose(logs["s"], want, rtol=1e-5, atol=1e-6)
    assert int(logs.count["s"]) == s.size
    # without `across`, the lanes stay apart
    _, apart = el.spool(fn, reduce=reduce)(xs)
    assert np.shape(apart["s"])[-1 if reduce == "stack" else 0] == 4


def test_across_one_of_two_nested_vmaps():
    xs = jnp.arange(16.0).reshape(2, 4, 2) / 16
    fn = jax.vmap(jax.vmap(_lanes_program, axis_name="inner"), axis_name="outer")
    _, logs = el.spool(fn, reduce="mean", across="inner")(xs)
    want = [_lanes_reference(x).mean() for x in xs]  # one mean per outer lane
    np.testing.assert_allclose(logs["s"], want, rtol=1e-5)
    _, logs = el.spool(fn, reduce="mean", across=("outer", "inner"))(xs)
    np.testing.assert_allclose(logs["s"], _lanes_reference(xs.reshape(8, 2)).mean(), rtol=1e-5)


def test_across_errors_name_the_axes_and_sites():
    xs = jnp.ones((4, 2))
    with pytest.raises(ValueError, match=r"across=\('x',\).*named vmap.*axis 'x'.*\['b'\]"):
        el.spool(jax.vmap(_lanes_program, axis_name="b"), across="x")(xs)

    def two_sites(xs):  # one key under two different vmaps
        jax.vmap(_lanes_program, axis_name="b")(xs)
        return jax.vmap(_lanes_program, axis_name="c")(xs)

    with pytest.raises(ValueError, match=r"key 's'.*vmap axes \('c',\).*\('b',\)"):
        el.spool(two_sites, across="b")(xs)
