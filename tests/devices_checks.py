"""Checks run on 4 forced CPU devices, in a subprocess of `test_devices.py` (the device count
is fixed when JAX starts). Prints one JSON object: check name -> result. Every reference is
independent of spool: the same shard_map returning its values by hand, or numpy."""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import eqx_logs

results: dict[str, object] = {}


def check(name):
    def wrap(fn):
        try:
            results[name] = fn()
        except Exception as e:  # reported, and the test of this check fails with it
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        return fn

    return wrap


def close(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True))


def spec_of(x) -> str:
    return str(getattr(x.sharding, "spec", None))


mesh = Mesh(np.array(jax.devices()), ("d",))
mesh2 = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
x8 = jnp.arange(8.0) / 8


def scan_body(c, i):
    c = jnp.sin(c) + i
    return c


def logged(x):
    def step(c, i):
        c = scan_body(c, i)
        eqx_logs.log({"v": c, "s": c.sum()}, step=i.astype(jnp.int32))
        return c, None

    c = jax.lax.scan(step, x, jnp.arange(3.0))[0]
    return jax.lax.psum(c.sum(), "d") + c


def logged_sums(x):  # `logged`'s "s" alone, without its step (a Sample merges one state)
    def step(c, i):
        c = scan_body(c, i)
        eqx_logs.log({"s": c.sum()})
        return c, None

    return jax.lax.scan(step, x, jnp.arange(3.0))[0]


def by_hand(x):  # the same, its values returned as outputs
    def step(c, i):
        c = scan_body(c, i)
        return c, (c, c.sum())

    c, (vs, ss) = jax.lax.scan(step, x, jnp.arange(3.0))
    return jax.lax.psum(c.sum(), "d") + c, vs[:, None], ss[:, None]


def sm(f, out_specs=P("d")):
    return jax.shard_map(f, mesh=mesh, in_specs=P("d"), out_specs=out_specs)


def partly_manual(mesh2):
    """A shard_map over axis "a" of a 2x2 mesh, axis "b" left to the compiler, logging each
    device's sum."""
    return jax.shard_map(
        lambda x: (eqx_logs.log({"m": x.sum()}), x * 2)[1],
        mesh=mesh2,
        in_specs=P("a"),
        out_specs=P("a"),
        axis_names={"a"},
    )


hand_out, hand_v, hand_s = jax.jit(sm(by_hand, (P("d"), P(None, "d"), P(None, "d"))))(x8)
hand_v = np.asarray(hand_v).reshape(3, 4, 2)  # (events, devices, local)


@check("stack")
def _():
    out, logs = eqx_logs.spool(sm(logged))(x8)
    return {
        "out": close(out, hand_out),
        "v": close(logs["v"], hand_v),
        "s": close(logs["s"], hand_s),
        "shape": list(logs["s"].shape),
        "spec": spec_of(logs["s"]),
        "count": np.asarray(logs.count["s"]).tolist(),
        "steps": close(logs.step["s"], np.repeat(np.arange(3)[:, None], 4, 1)),
    }


@check("jit")
def _():
    out, logs = jax.jit(eqx_logs.spool(sm(logged)))(x8)
    return {"out": close(out, hand_out), "v": close(logs["v"], hand_v), "spec": spec_of(logs["v"])}


@check("reductions")
def _():
    s = np.asarray(hand_s)  # (3, 4)
    want = {
        "mean": s.mean(0),
        "var": s.var(0),
        "max": s.max(0),
        "last": s[-1],
        "sum": s.sum(0),
    }
    got = {}
    for name, ref in want.items():
        _, logs = jax.jit(eqx_logs.spool(sm(logged), reduce=name, tags=None))(x8)
        got[name] = close(logs["s"], ref)
    _, logs = eqx_logs.spool(sm(logged), interval=2)(x8)
    got["interval"] = close(logs["s"], s[::2])
    return got


@check("mesh2")
def _():
    # both axes manual: one output axis per mesh axis, in mesh order
    f2 = jax.shard_map(
        lambda x: (eqx_logs.log({"m": x.sum()}), x * 2)[1],
        mesh=mesh2,
        in_specs=P(("a", "b")),
        out_specs=P(("a", "b")),
    )
    _, logs = eqx_logs.spool(f2)(x8)
    want = np.asarray(x8).reshape(2, 2, 2).sum(-1)[None]
    # only "a" manual, "b" left to the compiler
    f1 = partly_manual(mesh2)
    _, logs1 = jax.jit(eqx_logs.spool(f1))(x8)
    return {
        "both": close(logs["m"], want),
        "shape": list(logs["m"].shape),
        "partial": close(logs1["m"], np.asarray(x8).reshape(2, 4).sum(-1)[None]),
    }


@check("pmap")
def _():
    def f(x):
        eqx_logs.log({"p": x.sum()})
        return x * 2

    xs = jnp.arange(12.0).reshape(4, 3)
    out, logs = eqx_logs.spool(jax.pmap(f, axis_name="i"))(xs)
    return {"out": close(out, xs * 2), "p": close(logs["p"], xs.sum(1)[None])}


def ragged(x):
    """Each device logs "big" in the steps where its running sum exceeds 2.5: a different
    number of events per device."""

    def step(c, i):
        c = c + 1.0
        jax.lax.cond(c.sum() > 2.5, lambda: eqx_logs.log({"big": c.sum()}), lambda: None)
        return c, None

    return jax.lax.scan(step, x, jnp.arange(3.0))[0]


def ragged_sums():
    """The running sums `ragged` compares, per device and step, in numpy."""
    return np.asarray(x8).reshape(4, 2).sum(1)[:, None] + 2.0 * np.arange(1, 4)[None]


@check("cond_per_device")
def _():
    # each device keeps a different number of events: counts and rows per device
    _, logs = eqx_logs.spool(sm(ragged))(x8)
    sums = ragged_sums()
    counts = (sums > 2.5).sum(1)
    ok = True
    for d in range(4):
        kept = sums[d][sums[d] > 2.5]
        ok &= close(np.asarray(logs["big"])[: len(kept), d], kept)
    return {
        "counts": close(logs.count["big"], counts),
        "rows": close(logs.rows["big"], counts),
        "values": bool(ok),
    }


@check("vmap_inside")
def _():
    def f(x):
        def one(row):
            eqx_logs.log({"r": row.sum()})
            return row

        return jax.vmap(one)(x.reshape(2, -1)).reshape(-1)

    xs = jnp.arange(16.0)
    _, logs = eqx_logs.spool(sm(f))(xs)
    want = np.asarray(xs).reshape(4, 2, 2).sum(-1)[None]  # (events, devices, lanes)
    return {"r": close(logs["r"], want)}


@check("grad")
def _():
    def loss(w, x):
        h = jnp.tanh(w * x)
        eqx_logs.log({"h": h.sum()})
        return jax.lax.psum((h**2).sum(), "d")

    def total(w, x):
        return jax.shard_map(loss, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())(w, x)

    def spooled(w, x):
        out, logs = eqx_logs.spool(total)(w, x)
        return out, logs

    (g, logs) = jax.grad(spooled, has_aux=True)(0.7, x8)
    want_g = jax.grad(total)(0.7, x8)
    want_h = np.tanh(0.7 * np.asarray(x8)).reshape(4, 2).sum(1)[None]
    return {"grad": close(g, want_g), "h": close(logs["h"], want_h)}


@check("inside_and_outside")
def _():
    def f(x):
        eqx_logs.log({"k": x.sum()})
        return sm(lambda y: (eqx_logs.log({"k": y.sum()}), y)[1])(x)

    try:
        eqx_logs.spool(f)(x8)
    except ValueError as e:
        return {"message": str(e)}
    return {"message": None}


@check("across")
def _():
    s = np.asarray(hand_s)  # (events, devices)
    v = hand_v  # (events, devices, local)
    got = {}
    want = {
        "mean": s.mean(),
        "sum": s.sum(),
        "max": s.max(),
        "min": s.min(),
        "var": s.var(),
        "count": np.float32(s.size),
        "stack": s.T.reshape(-1),  # device 0's events, then device 1's, ...
        "first": s[0, 0],
        "last": s[-1, -1],
    }

    # one program: `logged`'s "s" under each reduction's name, a rule per key
    def copies(x):
        def step(c, i):
            c = scan_body(c, i)
            eqx_logs.log({name: c.sum() for name in want}, step=i.astype(jnp.int32))
            return c, None

        return jax.lax.scan(step, x, jnp.arange(3.0))[0]

    policy = eqx_logs.Policy(rules={name: name for name in want})
    _, logs = jax.jit(eqx_logs.spool(sm(copies), policy=policy, across="d"))(x8)
    for name, ref in want.items():
        got[name] = close(logs[name], ref)
    _, logs = eqx_logs.spool(sm(logged), across=("d",))(x8)
    got["count_total"] = int(logs.count["s"]) == s.size
    got["v"] = close(logs["v"], v.transpose(1, 0, 2).reshape(-1, 2))
    got["steps"] = close(logs.step["s"], np.tile(np.arange(3), 4))

    # per device a different number of events: Stack concatenates the real ones
    _, logs = eqx_logs.spool(sm(ragged), across="d")(x8)
    sums = ragged_sums()
    kept = sums[sums > 2.5]  # row-major: device by device
    got["ragged"] = close(np.asarray(logs["big"])[: len(kept)], kept)
    got["ragged_rows"] = int(logs.rows["big"]) == len(kept)
    # a 2-D mesh merged over one axis, then over both
    f2 = jax.shard_map(
        lambda x: (eqx_logs.log({"m": x.sum()}), x * 2)[1],
        mesh=mesh2,
        in_specs=P(("a", "b")),
        out_specs=P(("a", "b")),
    )
    per = np.asarray(x8).reshape(2, 2, 2).sum(-1)
    _, logs = eqx_logs.spool(f2, across="b", reduce="sum")(x8)
    got["mesh2_b"] = close(logs["m"], per.sum(1))
    _, logs = eqx_logs.spool(f2, across=("a", "b"))(x8)
    got["mesh2_both"] = close(logs["m"], per.reshape(-1))
    # Histogram: the devices' counts summed; Sample: k of all devices' events (each a real
    # one, none twice; the same draw for the same key is test_reductions.py's)
    hist = eqx_logs.Histogram(bins=4, range=(float(s.min()), float(s.max()) + 1e-3))
    _, logs = jax.jit(eqx_logs.spool(sm(logged), reduce=hist, across="d"))(x8)
    got["histogram"] = close(logs["s"], np.histogram(s, 4, range=hist.range)[0])
    sample = eqx_logs.Sample(k=5, key=jax.random.key(3))
    _, logs = jax.jit(eqx_logs.spool(sm(logged_sums), reduce=sample, across="d"))(x8)
    drawn = np.asarray(logs["s"])
    got["sample"] = (
        drawn.shape == (5,)
        and all(np.isclose(s, v).any() for v in drawn)
        and len({round(float(v), 5) for v in drawn}) == 5
    )
    try:
        eqx_logs.spool(sm(logged), across="x")(x8)
        got["typo"] = None
    except ValueError as e:
        got["typo"] = str(e)
    return got


def ticking(x):
    """`ragged` with an event of no value, "tick" (step=i), where "big" is logged, and "bare"
    (no value, no step) at every step."""

    def step(c, i):
        c = c + 1.0
        step = i.astype(jnp.int32)
        jax.lax.cond(c.sum() > 2.5, lambda: eqx_logs.log("tick", (), step=step), lambda: None)
        eqx_logs.log("bare", ())
        return c, None

    return jax.lax.scan(step, x, jnp.arange(3.0))[0]


@check("no_value")
def _():
    kept = ragged_sums() > 2.5  # (devices, steps)
    steps = [np.nonzero(kept[d])[0] for d in range(4)]
    _, logs = eqx_logs.spool(sm(ticking))(x8)
    _, total = jax.jit(eqx_logs.spool(sm(ticking), across="d"))(x8)
    all_steps = np.concatenate(steps)  # device by device
    return {
        "value": logs["tick"] == () and total["tick"] == (),
        "counts": close(logs.count["tick"], kept.sum(1)),
        "bare": close(logs.count["bare"], [3, 3, 3, 3]),
        "steps": all(
            close(np.asarray(logs.step["tick"])[: len(s), d], s) for d, s in enumerate(steps)
        ),
        "across": int(total.count["tick"]) == kept.sum() and int(total.count["bare"]) == 12,
        "across_steps": close(np.asarray(total.step["tick"])[: len(all_steps)], all_steps),
    }


@check("explicit")
def _():
    # `jax.make_mesh`'s default: Explicit axes, whose types name each value's sharding
    explicit = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(x8, jax.NamedSharding(explicit, P("d")))

    def smx(f):
        return jax.shard_map(f, mesh=explicit, in_specs=P("d"), out_specs=P("d"))

    s = np.asarray(hand_s)
    out, logs = jax.jit(eqx_logs.spool(smx(logged)))(x)
    _, mean = jax.jit(eqx_logs.spool(smx(logged), reduce="mean"))(x)
    _, total = jax.jit(eqx_logs.spool(smx(logged), reduce="mean", across="d"))(x)
    # a stack across the devices (it failed: its buffer was not on their mesh)
    _, stacked = eqx_logs.spool(smx(logged), reduce="stack", across="d")(x)
    _, big = eqx_logs.spool(smx(ragged))(x)
    mesh2x = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    f1 = partly_manual(mesh2x)
    _, logs1 = jax.jit(eqx_logs.spool(f1))(jax.device_put(x8, jax.NamedSharding(mesh2x, P("a"))))
    # over one axis of two: each row of devices ("a") stacks its own ("b") in order
    f2 = jax.shard_map(
        lambda x: (eqx_logs.log({"m": x}), x * 2)[1],
        mesh=mesh2x,
        in_specs=P(("a", "b")),
        out_specs=P(("a", "b")),
    )
    x2 = jax.device_put(x8, jax.NamedSharding(mesh2x, P(("a", "b"))))
    _, rows = jax.jit(eqx_logs.spool(f2, reduce="stack", across="b"))(x2)
    return {
        "out": close(out, hand_out),
        "v": close(logs["v"], hand_v),
        "spec": spec_of(logs["s"]),
        "mean": close(mean["s"], s.mean(0)),
        "across": close(total["s"], s.mean()),
        "across_stack": close(stacked["s"], s.T.reshape(-1))
        and close(stacked["v"], hand_v.transpose(1, 0, 2).reshape(-1, 2))
        and close(stacked.step["s"], np.tile(np.arange(3), 4)),
        # (events first: the "b" devices' in order, then the rows "a")
        "across_stack_2d": np.shape(rows["m"]) == (2, 2, 2)
        and close(np.moveaxis(rows["m"], 1, 0).reshape(2, 4), np.asarray(x8).reshape(2, 4)),
        "ragged_counts": close(big.count["big"], (ragged_sums() > 2.5).sum(1)),
        "partial": close(logs1["m"], np.asarray(x8).reshape(2, 4).sum(-1)[None]),
    }


def tapped(f, **options):
    """`jit(tap(f))(x8)`'s events as `(key, value, {step: int})` sorted by device and step."""
    got = []

    def callback(logs, steps):
        for k, v in logs.items():
            got.append((k, np.asarray(v).tolist(), {n: int(s) for n, s in steps.items()}))

    jax.jit(eqx_logs.tap(f, callback=callback, **options))(x8)
    jax.effects_barrier()
    return sorted(got, key=lambda e: (e[0], e[2].get("d", 0), e[2].get("step", 0)))


@check("tap")
def _():
    s = np.asarray(hand_s)  # (events, devices)
    every = tapped(sm(logged), tags=None)
    every_s = [e for e in every if e[0] == "s"]
    # each device's events once, with its coordinate on the mesh axis
    want = [("s", s[t, d], {"d": d, "step": t}) for d in range(4) for t in range(3)]
    ok = len(every_s) == len(want) and all(
        g[2] == w[2] and np.isclose(g[1], w[1]) for g, w in zip(every_s, want)
    )
    # `interval` counts per device: each device keeps its events 0, 2, ... of its own, and
    # here the devices log different numbers of events
    big = tapped(sm(ragged), interval=2)
    sums = ragged_sums()
    want_big = []
    for d in range(4):
        kept = sums[d][sums[d] > 2.5]
        want_big += [(d, v) for v in kept[::2]]
    got_big = [(e[2]["d"], e[1]) for e in big]
    pm = []
    jax.jit(
        eqx_logs.tap(
            jax.pmap(lambda x: (eqx_logs.log({"p": x.sum()}), x)[1], axis_name="i"),
            callback=lambda logs, steps: pm.append((int(steps["i"]), float(logs["p"]))),
        )
    )(jnp.arange(8.0).reshape(4, 2))
    jax.effects_barrier()
    f1 = partly_manual(mesh2)
    try:
        jax.jit(eqx_logs.tap(f1, callback=lambda logs, steps: None))(x8)
        partial = None
    except ValueError as e:
        partial = str(e)
    return {
        "partial": partial,
        "stack": bool(ok),
        "v_rows": sum(e[0] == "v" for e in every) == 12,
        "interval": len(got_big) == len(want_big)
        and all(g[0] == w[0] and np.isclose(g[1], w[1]) for g, w in zip(got_big, want_big)),
        "pmap": sorted(pm) == [(i, float(2 * i + 2 * i + 1)) for i in range(4)],
    }


@check("loggers")
def _():
    # a sharded jit (no shard_map): the whole program calls back once, with whole values
    import tempfile

    from eqx_logs.loggers import JsonlLogger, read_jsonl

    sharded = jax.device_put(jnp.arange(8.0), jax.NamedSharding(mesh, P("d")))

    def loss(x):
        def step(c, i):
            c = jnp.sin(c) + i
            eqx_logs.log({"n": jnp.sum(c**2)}, step=i.astype(jnp.int32))
            return c, None

        return jax.lax.scan(step, x, jnp.arange(4.0))[0]

    def want():
        c, out = np.arange(8.0), []
        for i in range(4):
            c = np.sin(c) + i
            out.append((c**2).sum())
        return out

    with tempfile.TemporaryDirectory() as d:
        logger = JsonlLogger(f"{d}/spool.jsonl")
        jax.jit(logger.spool(loss, logger.init()))(sharded)
        logger.spool(loss, logger.init(1))(sharded)  # eager
        tap_logger = JsonlLogger(f"{d}/tap.jsonl")
        jax.jit(tap_logger.tap(loss, tap_logger.init()))(sharded)
        jax.jit(tap_logger.tap(sm(logged), tap_logger.init(1)))(x8)
        logger.close()
        tap_logger.close()
        spooled = read_jsonl(f"{d}/spool.jsonl")
        tapped_rows = read_jsonl(f"{d}/tap.jsonl")
    rows = lambda records, run: [r["value"] for r in records if r["run"] == run]  # noqa: E731
    per_device = [r for r in tapped_rows if r["run"] == 1 and r["key"] == "s"]
    return {
        "spool_jit": close(rows(spooled, 0), want()),
        "spool_eager": close(rows(spooled, 1), want()),
        "tap": close(rows(tapped_rows, 0), want()),
        "tap_shard_map": sorted((r["d"], r["step"]) for r in per_device)
        == [(d, t) for d in range(4) for t in range(3)],
    }


@check("explicit_no_mesh_context")
def _():
    # a value sharded over Explicit axes, logged in a jit called without `jax.set_mesh`: the
    # stack buffer takes the value's sharding from the value's own mesh
    explicit = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    x = jax.device_put(jnp.ones((8, 3)), jax.NamedSharding(explicit, P("d")))

    def body(h, _):
        h = jnp.tanh(h * 1.5)
        eqx_logs.log({"h": h})
        return h, h

    def f(x):
        return jax.lax.scan(body, x, None, length=3)

    (_, hs), logs = jax.jit(eqx_logs.spool(f))(x)
    return {"h": close(logs["h"], hs), "spec": spec_of(logs["h"])}


# -- first_nonfinite: each device searches its own events; the lowest-numbered device that
# found one is reported. The reference: numpy, on each device's block of the input.

STEPS = 6


def descending(x):
    """Each device's block goes down by 1 a step; `log(c)` is not finite from the step where
    an element reaches 0."""

    def step(c, i):
        c = c - 1.0
        eqx_logs.log({"half": c * 0.5, "log_c": jnp.log(c)}, step=i.astype(jnp.int32))
        return c, None

    return jax.lax.scan(step, x, jnp.arange(float(STEPS)))[0]


def descending_lanes(x):
    """`descending` with the block's elements as `vmap` lanes, inside the shard_map."""
    return jax.vmap(descending)(x)


def np_first_bad(x, devices=4):
    """(device, iteration, lane) of the report, in numpy: on each device, the first step
    where an element of its block is <= 0 after the step's decrement; of several devices,
    the lowest-numbered; None where none."""
    blocks = np.asarray(x).reshape(devices, -1)
    for d, block in enumerate(blocks):
        for i in range(STEPS):
            bad = block - (i + 1) <= 0
            if bad.any():
                return d, i, int(np.argmax(bad))
    return None


def report_is(report, want, key="log_c", lane=False):
    if want is None:
        return report is None
    d, i, j = want
    return (
        report is not None
        and report.key == key
        and report.device == d
        and report.iterations == (i,)
        and report.event == i  # that device's i-th event of the key
        and report.steps == {"step": i}
        and report.lane == (j if lane else None)
        and "devices_checks.py" in report.site
        and f"device {d}" in str(report)
    )


one_bad = jnp.array([9.0, 9, 9, 9, 3.5, 9, 9, 9])  # device 2, at step 3
two_bad = jnp.array([9.0, 9, 4.5, 9, 9, 9, 1.5, 9])  # device 1 at step 4, device 3 at step 1
fine = jnp.full(8, 9.0)


@check("first_nonfinite")
def _():
    spooled = eqx_logs.spool(sm(descending), first_nonfinite=True)
    jitted = jax.jit(spooled)
    got, reports = {}, {}
    for name, x in (("one", one_bad), ("two", two_bad), ("fine", fine)):
        report = reports[name] = spooled(x)[1].first_nonfinite
        got[name] = report_is(report, np_first_bad(x))
        got[f"{name}_jit"] = jitted(x)[1].first_nonfinite == report
    got["two_lowest_not_earliest"] = np_first_bad(two_bad)[:2] == (1, 4)
    lanes = eqx_logs.spool(sm(descending_lanes), first_nonfinite=True)
    x = jnp.array([9.0, 9, 9, 3.5, 9, 9, 2.5, 9])  # device 1 lane 1 at step 3; device 3 at 2
    got["lane"] = report_is(lanes(x)[1].first_nonfinite, np_first_bad(x), lane=True)
    # a vmap outside the spool: one search per run, each as it alone
    batch = jnp.stack([one_bad, fine, two_bad])
    runs = jax.vmap(spooled)(batch)[1].first_nonfinite
    got["runs"] = [r == reports[name] for r, name in zip(runs, ("one", "fine", "two"))]
    # an event before the shard_map is first: outside any device
    before = eqx_logs.spool(
        lambda x: (eqx_logs.log({"x0": jnp.log(x[0] - 9)}), sm(descending)(x))[1],
        first_nonfinite=True,
    )
    report = before(one_bad)[1].first_nonfinite
    got["before"] = report.key == "x0" and report.device is None and ", device" not in str(report)
    # pmap: its devices in order; a 2x2 mesh: row-major over its axes
    pm = eqx_logs.spool(
        jax.pmap(lambda x: eqx_logs.log({"p": jnp.log(x)}), axis_name="i"), first_nonfinite=True
    )
    report = pm(jnp.array([[1.0], [2.0], [-1.0], [0.0]]))[1].first_nonfinite
    got["pmap"] = report.key == "p" and report.device == 2
    sm2 = jax.shard_map(descending, mesh=mesh2, in_specs=P(("a", "b")), out_specs=P(("a", "b")))
    report = eqx_logs.spool(sm2, first_nonfinite=True)(two_bad)[1].first_nonfinite
    got["mesh2"] = report_is(report, np_first_bad(two_bad))  # device 1: a=0, b=1
    # Explicit mesh axes (`jax.make_mesh`'s default): the copies are laid out over the mesh
    explicit = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    smx = jax.shard_map(descending, mesh=explicit, in_specs=P("d"), out_specs=P("d"))
    x = jax.device_put(two_bad, jax.NamedSharding(explicit, P("d")))
    report = jax.jit(eqx_logs.spool(smx, first_nonfinite=True))(x)[1].first_nonfinite
    got["explicit"] = report_is(report, np_first_bad(two_bad))
    return got


@check("first_nonfinite_any")
def _():
    def body(x):  # `descending` with no log: the search checks `log`'s output
        def step(c, i):
            c = c - 1.0
            return c, jnp.log(c)

        return jax.lax.scan(step, x, jnp.arange(float(STEPS)))[1]

    f = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P(None, "d"))
    spooled = eqx_logs.spool(f, first_nonfinite="any")
    got = {}
    for name, x in (("one", one_bad), ("two", two_bad), ("fine", fine)):
        report = spooled(x)[1].first_nonfinite
        want = np_first_bad(x)
        got[f"{name}_jit"] = jax.jit(spooled)(x)[1].first_nonfinite == report
        if want is None:
            got[name] = report is None
            continue
        got[name] = (
            report.device == want[0]
            and report.iterations == (want[1],)
            and report.operation == "log at shard_map[0]/scan[0]/log[0]"
            and "devices_checks.py" in report.site
            and report.key == "first_nonfinite/checked@d"
        )
    return got


print(json.dumps(results))
sys.exit(0)
