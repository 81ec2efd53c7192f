"""`eqx_logs.Quantiles` against `numpy.quantile(all_values, q, method="lower")` over every
element of every event, within the stated relative error: hard inputs (40 decades of both
signs, heavy tails, constants, zeros, infinities, NaNs counted aside), every dtype, merging
(exactly the counts of the concatenated values), and the transforms (scan with a fixed-size
state, jit, vmap on both sides of spool and `across=`, grad, shard_map on 4 CPU devices);
two processes in `test_per_example_distributed.py`.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, devices_env
from jax import lax

import eqx_logs as el
from eqx_logs._reduce._quantiles import QuantileSketch, quantile_name

HERE = os.path.dirname(os.path.abspath(__file__))

QS = (0.0, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0)
A = 0.01
RED = el.Quantiles(q=QS, relative_error=A, sketch=True)


def scanned(reduce, **spool_kwargs):
    """A spool of a scan logging each row of its input as one event under "x"."""

    def f(xs):
        def step(c, x):
            el.log("x", x)
            return c, None

        return lax.scan(step, 0, xs)[0]

    return el.spool(f, reduce=reduce, **spool_kwargs)


def check(out, values, qs=QS, a=A, what=""):
    """`out` (a Quantiles output) is numpy's lower quantile of `values` (NaNs aside) within
    relative error `a`: exactly 0 for zeros, exactly the infinities; NaN without values."""
    values = np.asarray(values, np.float64).ravel()
    finite = values[~np.isnan(values)]
    for q in qs:
        got = np.asarray(out[quantile_name(q)])
        if not len(finite):
            assert np.isnan(got), f"{what} q={q}: {got} without values"
            continue
        want = np.quantile(finite, q, method="lower")
        if want == 0 or np.isinf(want):
            assert got == want, f"{what} q={q}: {got} != {want}"
        else:
            error = abs(float(got) - want) / abs(want)
            assert error <= a, f"{what} q={q}: {got} vs {want}, relative error {error:.3g} > {a}"


def _rng(seed=0):
    return np.random.default_rng(seed)


def _log_uniform(shape, decades=(-20, 20), seed=0):
    rng = _rng(seed)
    signs = rng.choice([-1.0, 1.0], shape)
    return signs * 10.0 ** rng.uniform(*decades, shape)


HARD = {
    # 40 decades of magnitudes, both signs
    "log_uniform_40_decades": lambda: _log_uniform((16, 250)),
    # float32's whole normal range
    "log_uniform_74_decades": lambda: _log_uniform((16, 250), (-37, 38), seed=1),
    "pareto": lambda: _rng(2).pareto(0.5, (16, 250)) + 1,
    "cauchy": lambda: _rng(3).standard_cauchy((16, 250)),
    "constant": lambda: np.full((16, 250), -3.7),
    "all_zeros": lambda: np.zeros((16, 250)),
    "zeros_mixed_in": lambda: np.where(
        _rng(4).random((16, 250)) < 0.4, 0.0, _log_uniform((16, 250))
    ),
    "negatives_only": lambda: -np.abs(_log_uniform((16, 250), seed=5)),
    "few_values": lambda: np.array([[3.0, -1.0, 7.5]]),
    "nans_and_infinities": lambda: np.concatenate(
        [_rng(6).normal(size=(4, 20)), np.array([[np.nan, np.inf, -np.inf, np.nan] * 5])]
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(HARD))
def test_hard_inputs_against_numpy(name):
    xs = HARD[name]().astype(np.float32)
    _, logs = scanned(RED)(jnp.asarray(xs))
    out = logs["x"]
    check(out, xs, what=name)
    for q in QS:
        assert out[quantile_name(q)].dtype == jnp.float32 and out[quantile_name(q)].shape == ()
    sketch = out["sketch"]
    assert int(sketch.nan) == int(np.isnan(xs).sum())
    assert int(sketch.count) == int((~np.isnan(xs)).sum())
    assert logs.count["x"] == len(xs)


DTYPES = {
    "float16": lambda: (_log_uniform((8, 100), (-4, 4)), jnp.float16),
    "bfloat16": lambda: (_log_uniform((8, 100), (-30, 30)), jnp.bfloat16),
    "int8": lambda: (_rng(7).integers(-128, 128, (8, 100)), jnp.int8),
    "uint8": lambda: (_rng(8).integers(0, 256, (8, 100)), jnp.uint8),
    "int16": lambda: (_rng(9).integers(-(2**15), 2**15, (8, 100)), jnp.int16),
    "int32": lambda: (_rng(10).integers(-(2**31), 2**31 - 1, (8, 100)), jnp.int32),
    "uint32": lambda: (_rng(11).integers(0, 2**32 - 1, (8, 100)), jnp.uint32),
    "bool": lambda: (_rng(12).random((8, 100)) < 0.3, jnp.bool_),
}


@pytest.mark.parametrize("name", sorted(DTYPES))
def test_every_dtype_against_numpy(name):
    values, dtype = DTYPES[name]()
    xs = jnp.asarray(values).astype(dtype)
    _, logs = scanned(RED)(xs)
    out = logs["x"]
    exact = np.asarray(xs.astype(jnp.float32), np.float64)  # what the events hold
    check(out, exact, what=name)
    assert all(out[quantile_name(q)].dtype == jnp.float32 for q in QS)


@pytest.mark.parametrize("name", ["float64", "int64"])
def test_64_bit_values_against_numpy(name):
    # float64 reads out in float64, over a wider range with magnitudes to match
    red = el.Quantiles(q=QS, relative_error=1e-3, min_magnitude=1e-100, max_magnitude=1e100)
    with jax.enable_x64(True):
        if name == "float64":
            xs = jnp.asarray(_log_uniform((8, 200), (-90, 90), seed=13), jnp.float64)
        else:
            xs = jnp.asarray(_rng(14).integers(-(2**62), 2**62, (8, 200)), jnp.int64)
        _, logs = scanned(red)(xs)
        out = logs["x"]
        want = jnp.float64 if name == "float64" else jnp.float32
        assert all(out[quantile_name(q)].dtype == want for q in QS)
        exact = np.asarray(xs) if name == "float64" else np.asarray(xs.astype(jnp.float32))
    check(out, exact, a=1e-3, what=name)


def test_float32_subnormals_count_as_zero_and_big_float64_magnitudes_clamp():
    tiny = np.float32(1e-40)  # a subnormal, below the default min_magnitude
    xs = jnp.asarray(np.array([[tiny, -tiny, 0.0, 2.0]], np.float32))
    _, logs = scanned(el.Quantiles(q=(0.0, 0.5, 1.0)))(xs)
    assert logs["x"]["p0"] == 0 and logs["x"]["p50"] == 0
    assert abs(float(logs["x"]["p100"]) - 2.0) <= 2.0 * A
    with jax.enable_x64(True):  # beyond max_magnitude: the top bucket, about max_magnitude
        xs = jnp.asarray(np.array([[1e300, -1e300, 1.0]]), jnp.float64)
        _, logs = scanned(el.Quantiles(q=(0.0, 1.0)))(xs)
        top = float(np.finfo(np.float32).max)
        assert abs(float(logs["x"]["p100"]) - top) <= A * top
        assert abs(float(logs["x"]["p0"]) + top) <= A * top


def test_no_values_and_only_nans_give_nan():
    def f(xs, keep):
        def step(c, x_k):
            x, k = x_k
            lax.cond(k, lambda: el.log("x", x), lambda: None)
            return c, None

        return lax.scan(step, 0, (xs, keep))[0]

    xs = jnp.ones((3, 5))
    _, logs = el.spool(f, reduce=RED)(xs, jnp.zeros(3, bool))
    check(logs["x"], [], what="no events")
    assert int(logs["x"]["sketch"].count) == 0 and int(logs.count["x"]) == 0
    _, logs = scanned(RED)(jnp.full((2, 3), jnp.nan))
    check(logs["x"], [], what="only NaN")
    assert int(logs["x"]["sketch"].nan) == 6


def test_untaken_events_add_nothing():
    def f(xs, keep):
        def step(c, x_k):
            x, k = x_k
            lax.cond(k, lambda: el.log("x", x), lambda: None)
            return c, None

        return lax.scan(step, 0, (xs, keep))[0]

    xs = _log_uniform((12, 50), seed=15).astype(np.float32)
    keep = _rng(16).random(12) < 0.5
    _, logs = el.spool(f, reduce=RED)(jnp.asarray(xs), jnp.asarray(keep))
    check(logs["x"], xs[keep])
    assert int(logs["x"]["sketch"].count) == keep.sum() * 50


def test_batched_predicates_count_per_lane_and_a_while_loop():
    def f(xs, keep):
        def step(c, x_k):
            x, k = x_k
            lax.cond(k, lambda: el.log("x", x), lambda: None)
            return c, None

        return lax.scan(step, 0, (xs, keep))[0]

    xs = _log_uniform((3, 6, 10), seed=26).astype(np.float32)
    keep = _rng(27).random((3, 6)) < 0.5
    keep[0] = False  # a lane without events: NaN there
    _, logs = el.spool(jax.vmap(f), reduce=RED)(jnp.asarray(xs), jnp.asarray(keep))
    for i in range(3):
        lane = jax.tree.map(lambda v, i=i: v[i], logs["x"])
        check(lane, xs[i][keep[i]], what=f"lane {i}")
        assert int(lane["sketch"].count) == keep[i].sum() * 10

    def g(n):
        def body(i):
            el.log("w", jnp.sin(jnp.arange(5.0) * i))
            return i + 1.0

        return lax.while_loop(lambda i: i < n, body, 0.0)

    _, logs = el.spool(g, reduce=RED)(7.0)
    check(logs["w"], np.sin(np.arange(5.0)[None] * np.arange(7.0)[:, None]).astype(np.float32))
    # inside Window: one set of quantiles per window of 3 events
    _, logs = el.spool(g, reduce=el.Window(3, el.Quantiles(q=(0.5, 0.9)), capacity=3))(7.0)
    rows = np.sin(np.arange(5.0)[None] * np.arange(7.0)[:, None]).astype(np.float32)
    for w in range(3):
        one = {k: np.asarray(v)[w] for k, v in logs["w"].items()}
        check(one, rows[3 * w : 3 * w + 3], qs=(0.5, 0.9), what=f"window {w}")


def test_update_with_valid_false_leaves_the_state_unchanged():
    red = el.Quantiles()
    struct = jax.ShapeDtypeStruct((4,), jnp.float32)
    state = red.update(red.init(struct, None), jnp.arange(4.0), True)
    after = red.update(state, jnp.full((4,), 9.0), jnp.asarray(False))
    np.testing.assert_array_equal(after.counts, state.counts)


def test_straight_line_events_and_a_pytree_value():
    xs = _log_uniform((3, 40), seed=17).astype(np.float32)
    ints = _rng(18).integers(-100, 100, (3, 7)).astype(np.int8)

    def f(xs, ints):
        for i in range(3):  # straight-line: folded in by update_many
            el.log("t", {"a": xs[i], "b": ints[i]})
        return 0

    _, logs = el.spool(f, reduce=RED)(jnp.asarray(xs), jnp.asarray(ints))
    check(logs["t"]["a"], xs, what="a")
    check(logs["t"]["b"], ints, what="b")
    assert int(logs["t"]["b"]["sketch"].count) == ints.size


def test_merge_is_exactly_the_sketch_of_the_concatenated_values():
    red = el.Quantiles(sketch=True)
    a = _log_uniform((5, 30), seed=19).astype(np.float32)
    b = np.concatenate([_rng(20).standard_cauchy((3, 30)), np.full((1, 30), np.nan)])
    b = b.astype(np.float32)
    _, la = scanned(red)(jnp.asarray(a))
    _, lb = scanned(red)(jnp.asarray(b))
    _, lab = scanned(red)(jnp.asarray(np.concatenate([a, b])))
    merged = la["x"]["sketch"] + lb["x"]["sketch"]
    assert isinstance(merged, QuantileSketch)
    np.testing.assert_array_equal(merged.counts, lab["x"]["sketch"].counts)
    assert int(merged.nan) == 30
    got = merged.quantile(QS)
    check(dict(zip(map(quantile_name, QS), got)), np.concatenate([a, b]), what="merged")
    # the reduction's own merge, on states
    struct = jax.ShapeDtypeStruct((30,), jnp.float32)

    @jax.jit
    def fed(rows):
        def step(s, r):
            return red.update(s, r, True), None

        return lax.scan(step, red.init(struct, None), rows)[0]

    both = red.merge(fed(a), fed(b))
    np.testing.assert_array_equal(both.counts, fed(np.concatenate([a, b])).counts)
    np.testing.assert_array_equal(both.counts, lab["x"]["sketch"].counts)


def test_sketches_of_different_options_do_not_merge():
    xs = jnp.ones((1, 3))
    _, a = scanned(el.Quantiles(sketch=True))(xs)
    _, b = scanned(el.Quantiles(relative_error=0.02, sketch=True))(xs)
    with pytest.raises(ValueError, match="relative_error"):
        a["x"]["sketch"] + b["x"]["sketch"]


def _program(steps: int):
    def f(x):
        def step(c, i):
            el.log("x", jnp.sin(x * i.astype(jnp.float32)))
            return c, None

        return lax.scan(step, 0, jnp.arange(steps))[0]

    return jax.jit(el.spool(f, reduce=el.Quantiles()))


def test_scan_state_is_fixed_whatever_the_number_of_events():
    x = jnp.linspace(-3.0, 3.0, 64)
    sizes = []
    for steps in (10, 1000):
        memory = _program(steps).lower(x).compile().memory_analysis()
        sizes.append((memory.temp_size_in_bytes, memory.output_size_in_bytes))
    assert sizes[0] == sizes[1], sizes
    _, logs = _program(1000)(x)
    values = np.sin(np.asarray(x)[None] * np.arange(1000, dtype=np.float32)[:, None])
    check(logs["x"], values, qs=(0.5, 0.9, 0.99))


def test_jit_of_spool_equals_spool():
    xs = jnp.asarray(_log_uniform((6, 50), seed=21), jnp.float32)
    _, eager = scanned(RED)(xs)
    _, jitted = jax.jit(scanned(RED))(xs)
    for q in QS:
        assert jitted["x"][quantile_name(q)] == eager["x"][quantile_name(q)]
    np.testing.assert_array_equal(jitted["x"]["sketch"].counts, eager["x"]["sketch"].counts)


def test_vmap_of_spool_per_lane_equals_spool_of_each_lane():
    xs = jnp.asarray(_log_uniform((3, 6, 40), seed=22), jnp.float32)  # (lanes, events, ...)
    _, logs = jax.vmap(scanned(RED))(xs)
    assert logs["x"]["p50"].shape == (3,)
    assert logs["x"]["sketch"].counts.shape[0] == 3
    one_lane = jax.jit(scanned(RED))
    for i in range(3):
        _, one = one_lane(xs[i])
        for q in QS:
            assert logs["x"][quantile_name(q)][i] == one["x"][quantile_name(q)]
        np.testing.assert_array_equal(logs["x"]["sketch"].counts[i], one["x"]["sketch"].counts)
        check(jax.tree.map(lambda v, i=i: v[i], logs["x"]), np.asarray(xs[i]))


def _logged_lane(x):  # one lane: events (T, n)
    def step(c, row):
        el.log("x", row)
        return c, None

    return lax.scan(step, 0, x)[0]


def test_spool_of_vmap_per_lane_and_merged_across_lanes():
    xs = _log_uniform((3, 6, 40), seed=23).astype(np.float32)  # (lanes, events, ...)
    _, logs = el.spool(jax.vmap(_logged_lane), reduce=RED)(jnp.asarray(xs))
    assert logs["x"]["p50"].shape == (3,)
    for i in range(3):
        check(jax.tree.map(lambda v, i=i: v[i], logs["x"]), xs[i], what=f"lane {i}")
    named = jax.vmap(_logged_lane, axis_name="b")
    _, merged = el.spool(named, reduce=RED, across="b")(jnp.asarray(xs))
    assert merged["x"]["p50"].shape == ()
    check(merged["x"], xs, what="across lanes")
    lanes = logs["x"]["sketch"].counts
    np.testing.assert_array_equal(merged["x"]["sketch"].counts, np.sum(lanes, axis=0))


def test_under_grad_each_forward_event_once():
    xs = jnp.asarray(_log_uniform((5, 30), (-5, 5), seed=24), jnp.float32)

    def loss(w, xs):
        def step(c, x):
            y = w * x
            el.log("y", y)
            return c + jnp.sum(jnp.tanh(y)), None

        return lax.scan(step, jnp.float32(0), xs)[0]

    w = jnp.float32(1.5)
    g, logs = el.spool(jax.grad(loss), reduce=RED)(w, xs)
    np.testing.assert_allclose(g, jax.grad(loss)(w, xs), rtol=1e-6)
    assert int(logs["y"]["sketch"].count) == xs.size  # once each, not again in the backward
    check(logs["y"], np.asarray(xs) * 1.5)


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: el.Quantiles(q=(0.5, 1.5)), r"Quantiles\(q=\(0\.5, 1\.5\)\): 1\.5 is outside"),
        (lambda: el.Quantiles(q=(-0.1,)), r"-0\.1 is outside \[0, 1\]"),
        (lambda: el.Quantiles(q=()), r"Quantiles\(q=\(\)\): q is empty"),
        (lambda: el.Quantiles(q=(0.5, 0.5)), r"share the output name 'p50'"),
        (lambda: el.Quantiles(q=("a",)), r"'a' is not a number"),
        (lambda: el.Quantiles(relative_error=0.0), r"Quantiles\(relative_error=0\.0\)"),
        (lambda: el.Quantiles(relative_error=1.0), r"relative_error=1\.0\): must be in \(0, 1\)"),
        (lambda: el.Quantiles(relative_error=1e-7), r"relative_error=1e-07"),
        (lambda: el.Quantiles(relative_error=1e-5), r"buckets per leaf"),
        (lambda: el.Quantiles(min_magnitude=0.0), r"Quantiles\(min_magnitude=0\.0\)"),
        (lambda: el.Quantiles(max_magnitude=float("inf")), r"max_magnitude=inf"),
        (
            lambda: el.Quantiles(min_magnitude=2.0, max_magnitude=1.0),
            r"min_magnitude=2\.0, max_magnitude=1\.0\): needs min_magnitude < max_magnitude",
        ),
        (lambda: el.Quantiles(sketch=1), r"Quantiles\(sketch=1\)"),
    ],
)
def test_bad_options_are_errors_naming_option_and_value(make, pattern):
    with pytest.raises((ValueError, TypeError), match=pattern):
        make()


def test_names_and_a_single_q_and_the_name_quantiles():
    red = el.Quantiles(q=[0.999, 0.07])  # a list, kept as a tuple (static: hashable)
    assert red.q == (0.999, 0.07)
    xs = jnp.asarray(_rng(25).normal(size=(4, 50)), jnp.float32)
    _, logs = scanned(red)(xs)
    assert sorted(logs["x"]) == ["p7", "p99.9"]
    check(logs["x"], np.asarray(xs), qs=(0.999, 0.07))
    _, logs = scanned(el.Quantiles(q=0.5))(xs)
    assert sorted(logs["x"]) == ["p50"]
    _, logs = scanned("quantiles")(xs)
    assert sorted(logs["x"]) == ["p50", "p90", "p99"]
    check(logs["x"], np.asarray(xs), qs=(0.5, 0.9, 0.99))


def test_rank_is_numpys_for_decimal_q_and_large_counts():
    # floor(q * (n - 1)) read as the decimal q: 0.9 * 10 is 9 (numpy's float64 product)
    from eqx_logs._reduce._quantiles import _lower_rank

    ms = np.array([0, 1, 10, 99, 100, 1000, 12345, 2**24 + 1, 2**31 - 1, 2**32 - 1], np.uint64)
    for q in (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.25, 1.0):
        got = np.asarray(_lower_rank(q, jnp.asarray(ms.astype(np.uint32))))
        want = [int(np.floor(q * float(m))) for m in ms]
        np.testing.assert_array_equal(got.astype(np.uint64), want, err_msg=f"q={q}")


SHARD_MAP = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P
import eqx_logs as el

mesh = Mesh(np.array(jax.devices()), ("d",))
red = el.Quantiles(q=(0.0, 0.1, 0.5, 0.9, 0.99, 1.0), sketch=True)

def f(x):  # each device: (1, T, n) of its own events
    def step(c, row):
        el.log("x", row)
        return c, None
    return lax.scan(step, jnp.zeros(1), x[0])[0]

sm = jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
rng = np.random.default_rng(0)
xs = (rng.choice([-1.0, 1.0], (4, 5, 64)) * 10.0 ** rng.uniform(-20, 20, (4, 5, 64)))
xs = xs.astype(np.float32)
_, per = jax.jit(el.spool(sm, reduce=red))(jnp.asarray(xs))
_, merged = jax.jit(el.spool(sm, reduce=red, across="d"))(jnp.asarray(xs))
out = {
    "per": {k: np.asarray(v).tolist() for k, v in per["x"].items() if k != "sketch"},
    "merged": {k: float(v) for k, v in merged["x"].items() if k != "sketch"},
    "per_counts_sum": np.asarray(per["x"]["sketch"].counts).sum(0).tolist(),
    "merged_counts": np.asarray(merged["x"]["sketch"].counts).tolist(),
    "xs": xs.tolist(),
}
print(json.dumps(out))
"""


def test_inside_shard_map_per_device_and_merged_across_devices():
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SHARD_MAP)],
        env={**devices_env(4), "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    xs = np.asarray(got["xs"], np.float32)
    qs = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0)
    for d in range(4):
        one = {k: np.asarray(v)[d] for k, v in got["per"].items()}
        check(one, xs[d], qs=qs, what=f"device {d}")
    check(got["merged"], xs, qs=qs, what="across devices")
    assert got["merged_counts"] == got["per_counts_sum"]


def test_jax_export_with_symbolic_shapes_quantiles_topk_and_noise_scale():
    """Issue 53's reductions in a program exported with a symbolic batch size, called at
    two sizes: as the spool called directly."""
    from jax import export

    def f(x):
        el.log("q", x, reduce=el.Quantiles(q=(0.1, 0.5, 0.9)))
        ids = jnp.arange(x.shape[0], dtype=jnp.int32)
        el.log("t", x, ids=ids, reduce=el.TopK(3), step=0)
        small, big = jnp.mean(x**2), jnp.mean(x) ** 2
        el.log("n", {"small": small, "big": big, "b_small": 1, "b_big": 8}, reduce="noise_scale")
        return jnp.sum(x)

    (b,) = export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b,), jnp.float32)
    exported = export.export(jax.jit(el.spool(f)))(spec)
    for n in (5, 11):
        x = jnp.asarray(_log_uniform((n,), seed=n), jnp.float32)
        got, want = exported.call(x), el.spool(f)(x)
        jax.tree.map(np.testing.assert_array_equal, got, want)
        assert np.asarray(got[1]["t"]["id"])[0] == int(np.argmax(np.asarray(x)))
