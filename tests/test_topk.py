"""TopK: the k largest (or smallest) elements of all events, with ids, event ordinals and
steps. Every result is checked against numpy: a stable argsort of all elements of all events,
concatenated in the order they were logged (NaN ranked above every number)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, devices_env

import eqx_logs

HERE = os.path.basename(__file__)


def reference(values, k, largest=True, ids=None, steps=None, id_dtype=np.int32):
    """TopK by numpy: `values` a list of events (arrays), `ids` one array per event (or None:
    flat positions), `steps` a dict name -> one int per event."""
    flat = [np.ravel(np.asarray(v).astype(np.float64)) for v in values]
    v = np.concatenate(flat)
    event = np.concatenate([np.full(x.size, e, np.int64) for e, x in enumerate(flat)])
    pos = np.concatenate([np.arange(x.size) for x in flat])
    ident = pos if ids is None else np.concatenate([np.ravel(i) for i in ids])
    nan = np.isnan(v)
    if largest:
        rest = np.flatnonzero(~nan)
        order = np.concatenate([np.flatnonzero(nan), rest[np.argsort(-v[rest], kind="stable")]])
    else:
        order = np.argsort(v, kind="stable")  # NaN last
    order = order[:k]
    n = len(order)
    out = {
        "value": np.full(k, np.nan),
        "id": np.full(k, -1, np.int64),
        "event": np.full(k, -1, np.int64),
    }
    out["value"][:n], out["id"][:n], out["event"][:n] = v[order], ident[order], event[order]
    for name, per_event in (steps or {}).items():
        out[name] = np.full(k, -1, np.int64)
        out[name][:n] = np.asarray(per_event)[event[order]]
    return out


def check(got, want, dtype=None, fill=None):
    """`got` (a TopK output of one leaf) equals `want` (`reference`); empty slots of an
    integer dtype hold `fill`."""
    assert set(got) == set(want), (sorted(got), sorted(want))
    filled = want["event"] >= 0
    value = np.asarray(got["value"])
    if dtype is not None:
        assert value.dtype == np.dtype(dtype), (value.dtype, dtype)
    np.testing.assert_array_equal(value[filled].astype(np.float64), want["value"][filled])
    if fill is None:
        assert np.all(np.isnan(value[~filled].astype(np.float64)))
    else:
        assert np.all(value[~filled] == fill)
    for name in want:
        if name != "value":
            np.testing.assert_array_equal(np.asarray(got[name]), want[name], err_msg=name)
    assert np.asarray(got["event"]).dtype == np.int32


def _scanned(k=5, largest=True, with_ids=True):
    reduce = eqx_logs.TopK(k, largest=largest)

    def f(xs):
        def body(c, i):
            x = xs[i]
            if with_ids:
                ids = jnp.arange(x.shape[0], dtype=jnp.int32) * 10 + i
                eqx_logs.log("x", x, ids=ids, reduce=reduce, step=i)
            else:
                eqx_logs.log("x", x, reduce=reduce, step=i)
            return c, None

        return jax.lax.scan(body, 0, jnp.arange(xs.shape[0], dtype=jnp.int32))[0]

    return f


def _ids_of(xs):
    return [np.arange(xs.shape[1], dtype=np.int32) * 10 + i for i in range(xs.shape[0])]


@pytest.mark.parametrize("largest", [True, False])
def test_scan_with_ids_and_steps_ties_included(largest):
    xs = np.random.default_rng(0).integers(0, 6, (7, 5)).astype(np.float32)  # many ties
    _, logs = eqx_logs.spool(_scanned(6, largest))(jnp.asarray(xs))
    want = reference(list(xs), 6, largest, _ids_of(xs), {"step": np.arange(7)})
    check(logs["x"], want, np.float32)
    # jit gives the same
    _, jitted = jax.jit(eqx_logs.spool(_scanned(6, largest)))(jnp.asarray(xs))
    check(jitted["x"], want, np.float32)


def test_without_ids_the_id_is_the_flat_position():
    xs = np.random.default_rng(1).normal(size=(4, 2, 3)).astype(np.float32)
    _, logs = eqx_logs.spool(_scanned(5, True, with_ids=False))(jnp.asarray(xs))
    check(logs["x"], reference(list(xs), 5, True, None, {"step": np.arange(4)}))

    def straight(xs):  # straight-line events (folded in together), no steps
        for x in xs:
            eqx_logs.log("x", x, reduce=eqx_logs.TopK(4, largest=False))

    _, logs = eqx_logs.spool(straight)(jnp.asarray(xs))
    check(logs["x"], reference(list(xs), 4, False))


def test_policy_chosen_topk_ranks_a_plain_log():
    xs = np.random.default_rng(2).normal(size=(3, 4)).astype(np.float32)

    def f(xs):
        for i, x in enumerate(xs):
            eqx_logs.log("x", x, step=i)

    _, logs = eqx_logs.spool(f, policy=eqx_logs.Policy(rules={"x": eqx_logs.TopK(3)}))(xs)
    check(logs["x"], reference(list(xs), 3))  # no steps recorded beside the elements
    _, logs = eqx_logs.spool(f, reduce="topk")(xs)  # by name: TopK(8)
    check(logs["x"], reference(list(xs), 8))


@pytest.mark.parametrize("largest", [True, False])
def test_nan_ranks_above_every_number_and_negative_zero_ties(largest):
    xs = np.array(
        [[1.0, np.nan, -0.0, 3.0], [0.0, 3.0, np.nan, -np.inf], [np.inf, -0.0, 1.0, np.nan]],
        np.float32,
    )
    _, logs = eqx_logs.spool(_scanned(12, largest))(jnp.asarray(xs))
    want = reference(list(xs), 12, largest, _ids_of(xs), {"step": np.arange(3)})
    check(logs["x"], want)
    got = np.asarray(logs["x"]["value"])
    assert np.isnan(got[0]) if largest else np.isnan(got[-1])
    # the signs of zeros are the logged ones, in event order
    zeros = [(e, p) for e, p in zip(want["event"], want["id"]) if xs[e, (p - e) // 10] == 0]
    assert [e for e, _ in zeros] == sorted(e for e, _ in zeros)


@pytest.mark.parametrize(
    "dtype", ["int8", "uint8", "int32", "uint32", "bfloat16", "float16", "bool"]
)
def test_every_dtype_with_fewer_elements_than_k(dtype):
    rng = np.random.default_rng(3)
    raw = rng.integers(-128 if dtype in ("int8", "int32") else 0, 128, (3, 2))
    if dtype == "int8":
        raw[0, 0], raw[1, 1] = -128, 127  # the extremes: no overflow in the ordering
    if dtype == "uint32":
        raw[0, 0] = 2**32 - 1
    if dtype == "bool":
        raw = raw % 2
    xs = jnp.asarray(raw.astype(jnp.dtype(dtype)))
    for largest in (True, False):
        _, logs = eqx_logs.spool(_scanned(9, largest))(xs)  # 6 elements: 3 empty slots
        want = reference(list(np.asarray(xs)), 9, largest, _ids_of(xs), {"step": np.arange(3)})
        if jnp.issubdtype(xs.dtype, jnp.inexact):
            fill = None
        elif dtype == "bool":
            fill = not largest
        else:
            fill = np.iinfo(dtype).min if largest else np.iinfo(dtype).max
        check(logs["x"], want, xs.dtype, fill)


def test_a_pytree_value_has_a_topk_per_leaf():
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(4, 3)).astype(np.float32), rng.integers(0, 9, (4, 3)).astype(np.int32)

    def f(a, b):
        def body(c, i):
            ids = jnp.array([7, 8, 9], jnp.int32) + i * 3
            value = {"a": a[i], "b": (b[i],)}
            eqx_logs.log("t", value, ids=ids, reduce=eqx_logs.TopK(4), step=i, epoch=2 * i)
            return c, None

        jax.lax.scan(body, 0, jnp.arange(4, dtype=jnp.int32))

    _, logs = eqx_logs.spool(f)(a, b)
    ids = [np.array([7, 8, 9]) + 3 * i for i in range(4)]
    steps = {"step": np.arange(4), "epoch": 2 * np.arange(4)}
    check(logs["t"]["a"], reference(list(a), 4, True, ids, steps))
    check(logs["t"]["b"][0], reference(list(b), 4, True, ids, steps), np.int32)


def test_ids_apply_to_every_key_of_a_dict():
    rng = np.random.default_rng(5)
    xs, ys = rng.normal(size=(2, 3, 4)).astype(np.float32)

    def f(xs, ys):
        for i in range(3):
            ids = jnp.arange(4, dtype=jnp.int32) + 100 * i
            eqx_logs.log({"x": xs[i], "y": ys[i]}, ids=ids, reduce="topk", step=i)

    _, logs = eqx_logs.spool(f)(xs, ys)
    ids = [np.arange(4) + 100 * i for i in range(3)]
    for key, vals in (("x", xs), ("y", ys)):
        check(logs[key], reference(list(vals), 8, True, ids, {"step": np.arange(3)}))


def test_cond_and_while_loop_events():
    xs = np.random.default_rng(6).normal(size=(6, 3)).astype(np.float32)
    top = eqx_logs.TopK(4)

    def f(xs, n):
        def body(c, i):
            def logged(_):
                eqx_logs.log("x", xs[i], ids=jnp.arange(3, dtype=jnp.int32), reduce=top, step=i)

            jax.lax.cond(i % 2 == 1, logged, lambda _: None, None)
            return c, None

        jax.lax.scan(body, 0, jnp.arange(6, dtype=jnp.int32))

        def loop(i, c):  # a while loop (traced bounds): no bound on the events
            eqx_logs.log("w", xs[i], reduce=top, step=i)
            return c

        jax.lax.fori_loop(0, n, loop, 0)

    _, logs = eqx_logs.spool(f)(xs, jnp.int32(5))
    odd = list(xs[1::2])
    want = reference(odd, 4, True, [np.arange(3)] * 3, {"step": np.arange(1, 6, 2)})
    check(logs["x"], want)
    check(logs["w"], reference(list(xs[:5]), 4, True, None, {"step": np.arange(5)}))


def test_vmap_of_spool_is_spool_of_each_lane():
    xs = np.random.default_rng(7).normal(size=(3, 4, 5)).astype(np.float32)  # (lanes, T, n)
    f = eqx_logs.spool(_scanned(5))
    _, batched = jax.vmap(f)(jnp.asarray(xs))
    for lane in range(3):
        _, one = f(jnp.asarray(xs[lane]))
        for name in batched["x"]:
            np.testing.assert_array_equal(batched["x"][name][lane], one["x"][name])
        check(one["x"], reference(list(xs[lane]), 5, True, _ids_of(xs[lane]), {"step": range(4)}))


def test_spool_of_vmap_per_lane_and_merged_across_lanes():
    xs = np.random.default_rng(8).integers(0, 5, (3, 4, 5)).astype(np.float32)  # ties
    inner = jax.vmap(_scanned(6), axis_name="b")
    _, per_lane = eqx_logs.spool(inner)(jnp.asarray(xs))
    assert per_lane["x"]["value"].shape == (3, 6)  # (lanes, k)
    for lane in range(3):
        got = {n: v[lane] for n, v in per_lane["x"].items()}
        check(got, reference(list(xs[lane]), 6, True, _ids_of(xs[lane]), {"step": range(4)}))
    _, merged = eqx_logs.spool(inner, across="b")(jnp.asarray(xs))
    # lane 0's events, then lane 1's, ...: the event ordinals continue from lane to lane
    events = [x for lane in xs for x in lane]
    ids = [i for lane in xs for i in _ids_of(lane)]
    want = reference(events, 6, True, ids, {"step": np.tile(np.arange(4), 3)})
    check(merged["x"], want)
    _, merged_jit = jax.jit(eqx_logs.spool(inner, across="b"))(jnp.asarray(xs))
    check(merged_jit["x"], want)


def test_under_grad_each_forward_event_once():
    xs = np.random.default_rng(9).normal(size=(5, 4)).astype(np.float32)

    def loss(w, xs):
        def body(c, i):
            per_example = (xs[i] * w) ** 2
            ids = jnp.arange(4, dtype=jnp.int32) + 4 * i
            eqx_logs.log("loss", per_example, ids=ids, reduce=eqx_logs.TopK(3), step=i)
            return c + jnp.sum(per_example), None

        return jax.lax.scan(body, jnp.float32(0), jnp.arange(5, dtype=jnp.int32))[0]

    g, logs = eqx_logs.spool(jax.grad(loss))(jnp.float32(1.5), jnp.asarray(xs))
    np.testing.assert_allclose(g, 2 * 1.5 * np.sum(xs**2), rtol=1e-5)
    assert int(logs.count["loss"]) == 5
    per_example = [(x * np.float32(1.5)) ** 2 for x in xs]
    ids = [np.arange(4) + 4 * i for i in range(5)]
    got = logs["loss"]
    want = reference(per_example, 3, True, ids, {"step": np.arange(5)})
    np.testing.assert_allclose(np.asarray(got["value"]), want["value"], rtol=1e-6)
    for name in ("id", "event", "step"):
        np.testing.assert_array_equal(got[name], want[name])


def test_a_loss_spike_names_its_example_and_step():
    losses = np.random.default_rng(10).uniform(0.1, 1.0, (50, 8)).astype(np.float32)
    losses[34, 5] = 40.0
    order = np.random.default_rng(11).permutation(400).reshape(50, 8).astype(np.int32)
    order[34, 5] = 5  # example 5 of the dataset

    def train(losses, order):
        def step(c, i):
            eqx_logs.log(
                "loss", losses[i], ids=order[i], reduce=eqx_logs.TopK(3), step=i
            )  # per-example losses, with the examples' indices
            return c + jnp.mean(losses[i]), None

        return jax.lax.scan(step, jnp.float32(0), jnp.arange(50, dtype=jnp.int32))[0]

    _, logs = jax.jit(eqx_logs.spool(train))(losses, order)
    top = logs["loss"]
    assert (int(top["id"][0]), int(top["step"][0]), float(top["value"][0])) == (5, 34, 40.0)
    check(top, reference(list(losses), 3, True, list(order), {"step": np.arange(50)}))


def _raises(kind, fn, *parts):
    """`fn()` raises `kind`, its message holding each of `parts` (regexes)."""
    with pytest.raises(kind) as info:
        fn()
    for part in parts:
        assert re.search(part, str(info.value)), (part, str(info.value))


def test_errors_name_the_key_and_the_call_site():
    x = jnp.ones((2, 3))
    site = rf"{HERE}:\d+"

    def bad_shape(x):
        eqx_logs.log("acts", x, ids=jnp.arange(3), reduce="topk")

    _raises(ValueError, lambda: eqx_logs.spool(bad_shape)(x), "'acts'", site, r"\(2, 3\)")

    def bad_dtype(x):
        eqx_logs.log("acts", x, ids=jnp.ones((2, 3)), reduce="topk")

    _raises(TypeError, lambda: eqx_logs.spool(bad_dtype)(x), "'acts'", site, "integer array")

    def with_mean(x):
        eqx_logs.log("acts", x, ids=jnp.zeros((2, 3), jnp.int32), reduce="mean")

    _raises(ValueError, lambda: eqx_logs.spool(with_mean)(x), "'acts'", site, "not take ids")

    def plain(x):  # ids, and a reduction chosen by the spool: never averaged as values
        eqx_logs.log("acts", x, ids=jnp.zeros((2, 3), jnp.int32))

    for how in ({"reduce": "mean"}, {"policy": eqx_logs.Policy(rules={"a*": "sum"})}, {}):
        spooled = eqx_logs.spool(plain, **how)
        _raises(ValueError, lambda: spooled(x), "'acts'", site, "not take ids")
    # with TopK from the Policy, the ids are used
    _, logs = eqx_logs.spool(plain, policy=eqx_logs.Policy(rules={"a*": eqx_logs.TopK(2)}))(x)
    np.testing.assert_array_equal(logs["acts"]["id"], [0, 0])

    def clash(x):
        eqx_logs.log("acts", x, reduce=eqx_logs.TopK(2), event=1)

    _raises(ValueError, lambda: eqx_logs.spool(clash)(x), "'acts'", site, "'event'", "rename")

    for k in (0, -3, 2.0, "8", True):
        with pytest.raises(ValueError, match=rf"TopK\(k={k!r}\)"):
            eqx_logs.TopK(k)
    with pytest.raises(TypeError, match="largest"):
        eqx_logs.TopK(3, largest=1)


SHARDED = """
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import eqx_logs

mesh = Mesh(np.array(jax.devices()), ("d",))
xs = np.random.default_rng(12).integers(0, 7, (3, 8)).astype(np.float32)  # (T, 2 per device)

def local(x):  # x: (T, 2) on one device
    def body(c, i):
        ids = jax.lax.axis_index("d").astype(jnp.int32) * 2 + jnp.arange(2, dtype=jnp.int32)
        eqx_logs.log("x", x[i], ids=ids, reduce=eqx_logs.TopK(5), step=i)
        return c, None
    jax.lax.scan(body, 0, jnp.arange(3, dtype=jnp.int32))
    return x

f = jax.shard_map(local, mesh=mesh, in_specs=P(None, "d"), out_specs=P(None, "d"))
out = {}
_, logs = jax.jit(eqx_logs.spool(f, across="d"))(xs)
out["merged"] = {n: (np.asarray(v).tolist(), str(v.dtype)) for n, v in logs["x"].items()}
_, logs = eqx_logs.spool(f)(xs)
out["per_device"] = {n: (np.asarray(v).tolist(), str(v.dtype)) for n, v in logs["x"].items()}
out["xs"] = xs.tolist()
print(json.dumps(out))
"""


def test_inside_shard_map_merged_across_devices():
    env = {**devices_env(4), "PYTHONPATH": ROOT}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SHARDED)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    xs = np.asarray(out["xs"], np.float32)
    blocks = [xs[:, 2 * d : 2 * d + 2] for d in range(4)]  # device d's events: (T, 2)
    ids = [np.arange(2) + 2 * d for d in range(4)]
    per_device = {n: np.asarray(v, dtype) for n, (v, dtype) in out["per_device"].items()}
    assert per_device["value"].shape == (4, 5)  # (devices, k)
    for d in range(4):
        got = {n: v[d] for n, v in per_device.items()}
        check(got, reference(list(blocks[d]), 5, True, [ids[d]] * 3, {"step": range(3)}))
    # device 0's events, then device 1's, ...
    events = [row for d in range(4) for row in blocks[d]]
    all_ids = [ids[d] for d in range(4) for _ in range(3)]
    want = reference(events, 5, True, all_ids, {"step": np.tile(np.arange(3), 4)})
    check({n: np.asarray(v, dtype) for n, (v, dtype) in out["merged"].items()}, want)
