"""`NoiseScale` and `log_noise_scale`: the gradient noise scale B_simple (McCandlish et al.
2018, appendix A) against the two-batch-size estimator computed by hand in numpy, for a
linear regression whose per-example gradients are known in closed form: in a scan, under
jit, vmap (both ways), grad, across vmap lanes and across 4 CPU devices in a shard_map (a
subprocess); a Gaussian gradient-noise model whose B_simple is known; and the errors."""

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

import eqx_logs

HERE = os.path.dirname(os.path.abspath(__file__))
T, B, D = 12, 8, 3  # steps, batch, features
LR, DECAY = 0.05, 0.8
RTOL = 2e-4  # float32 on the device, float64 in numpy


# ---- the data and the model: linear regression, l_i = (x_i . w + b - y_i)^2 / 2 ----------


def data(seed: int, steps: int = T, batch: int = B) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, batch, D)).astype(np.float32)
    w_true = np.array([1.5, -2.0, 0.5], np.float32)
    y = (x @ w_true + 0.7 + 0.8 * rng.normal(size=(steps, batch))).astype(np.float32)
    return x, y


def init_params() -> dict:
    return {"w": np.zeros(D, np.float32), "b": np.float32(0.0)}


def per_example(params, x, y):
    """Each example's gradient in closed form: (residual * x_i, residual)."""
    r = x @ params["w"] + params["b"] - y
    return r[:, None] * x, r


# ---- the numpy reference ------------------------------------------------------------------


def np_terms(small, big, bs, bb):
    small, big = np.asarray(small, np.float64), np.asarray(big, np.float64)
    grad_sq = (bb * big - bs * small) / (bb - bs)
    trace = (small - big) / (1.0 / bs - 1.0 / bb)
    return trace, grad_sq


def np_ema(x, decay):
    """The bias-corrected EMA of the sequence `x` (along axis 0)."""
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    weights = (1 - decay) * decay ** (n - 1 - np.arange(n))
    return np.tensordot(weights, x, axes=1) / (1 - decay**n)


def np_noise(trace, grad_sq, decay):
    s, g = np_ema(trace, decay), np_ema(grad_sq, decay)
    return {"b_simple": s / g, "trace": s, "grad_sq": g}


def np_train(x, y, micro: int = 1):
    """Per step: |G_small|^2 (the mean squared norm of the gradients of micro-batches of
    `micro` examples) and |G_big|^2 (the batch gradient's squared norm), with SGD on the
    batch gradient, in float64."""
    w, b = np.zeros(D), 0.0
    smalls, bigs = [], []
    for xt, yt in zip(x.astype(np.float64), y.astype(np.float64), strict=True):
        r = xt @ w + b - yt
        gw, gb = r[:, None] * xt, r
        mw = gw.reshape(-1, micro, D).mean(1)
        mb = gb.reshape(-1, micro).mean(1)
        smalls.append(np.mean(np.sum(mw**2, 1) + mb**2))
        Gw, Gb = gw.mean(0), gb.mean()
        bigs.append(np.sum(Gw**2) + Gb**2)
        w, b = w - LR * Gw, b - LR * Gb
    return np.array(smalls), np.array(bigs)


def np_reference(x, y, decay=DECAY, micro=1):
    smalls, bigs = np_train(x, y, micro)
    return np_noise(*np_terms(smalls, bigs, micro, x.shape[1]), decay)


# ---- the JAX programs ----------------------------------------------------------------------


def event_of(params, x, y):
    """The NoiseScale event of one step, from the closed-form per-example gradients, and the
    batch gradient."""
    gw, gb = per_example(params, x, y)
    small = jnp.mean(jnp.sum(gw**2, axis=1) + gb**2)
    grads = {"w": jnp.mean(gw, axis=0), "b": jnp.mean(gb)}
    big = jnp.sum(grads["w"] ** 2) + grads["b"] ** 2
    return {"small": small, "big": big, "b_small": 1, "b_big": x.shape[0]}, grads


def sgd(params, grads):
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def train(params, x, y, reduce=None):
    """A scan over steps, each logging its event with `log`."""
    reduce = eqx_logs.NoiseScale(DECAY) if reduce is None else reduce

    def step(params, xy):
        event, grads = event_of(params, *xy)
        eqx_logs.log("noise", event, reduce=reduce)
        return sgd(params, grads), None

    return jax.lax.scan(step, params, (x, y))[0]


def loss(params, x, y):
    return 0.5 * (jnp.dot(x, params["w"]) + params["b"] - y) ** 2


def train_with_log_noise_scale(params, x, y, micro=1):
    """The same with `log_noise_scale`, from per-example gradients by `vmap(grad)` (or the
    gradients of micro-batches of `micro` examples)."""

    def micro_loss(params, x, y):
        return jnp.mean(jax.vmap(loss, in_axes=(None, 0, 0))(params, x, y))

    def step(params, xy):
        x, y = xy
        xs, ys = x.reshape(-1, micro, D), y.reshape(-1, micro)
        each = jax.vmap(jax.grad(micro_loss), in_axes=(None, 0, 0))(params, xs, ys)
        norms = jnp.sqrt(jnp.sum(each["w"] ** 2, axis=1) + each["b"] ** 2)
        grads = jax.grad(micro_loss)(params, x, y)
        eqx_logs.log_noise_scale(
            "noise", norms, grads, b_small=micro, reduce=eqx_logs.NoiseScale(DECAY), step=0
        )
        return sgd(params, grads), None

    return jax.lax.scan(step, params, (x, y))[0]


def assert_noise(got, want, rtol=RTOL, what="noise"):
    assert set(got) == {"b_simple", "trace", "grad_sq"}, sorted(got)
    for k in want:
        g = np.asarray(got[k])
        assert g.dtype == np.float32, (k, g.dtype)
        np.testing.assert_allclose(g, want[k], rtol=rtol, err_msg=f"{what}[{k!r}]")


# ---- tests -----------------------------------------------------------------------------


def test_scan_matches_numpy_and_under_jit():
    x, y = data(0)
    want = np_reference(x, y)
    _, logs = eqx_logs.spool(train)(init_params(), x, y)
    assert_noise(logs["noise"], want)
    assert int(logs.count["noise"]) == T
    _, logs = jax.jit(eqx_logs.spool(train))(init_params(), x, y)
    assert_noise(logs["noise"], want, what="jit")


def test_straight_line_events_and_decay_zero():
    # events of straight-line code (folded in together by `update_many`); decay 0 keeps the
    # last step's estimate alone
    x, y = data(1, steps=4)

    def unrolled(params, reduce):
        for t in range(4):
            event, grads = event_of(params, x[t], y[t])
            eqx_logs.log("noise", event, reduce=reduce)
            params = sgd(params, grads)
        return params

    smalls, bigs = np_train(x, y)
    trace, grad_sq = np_terms(smalls, bigs, 1, B)
    for decay in (DECAY, 0.0):
        _, logs = eqx_logs.spool(unrolled)(init_params(), eqx_logs.NoiseScale(decay))
        assert_noise(logs["noise"], np_noise(trace, grad_sq, decay), what=f"decay={decay}")
    np.testing.assert_allclose(logs["noise"]["trace"], trace[-1], rtol=RTOL)


def test_vmap_of_spool_and_spool_of_vmap_per_lane():
    lanes = [data(seed) for seed in (2, 3, 4)]
    xs, ys = (np.stack(a) for a in zip(*lanes, strict=True))
    params = jax.tree.map(lambda p: np.stack([p] * 3), init_params())
    wants = [np_reference(x, y) for x, y in lanes]
    _, per_lane = jax.vmap(eqx_logs.spool(train))(params, xs, ys)
    _, batched = eqx_logs.spool(jax.vmap(train))(params, xs, ys)
    for logs, what in ((per_lane, "vmap(spool)"), (batched, "spool(vmap)")):
        for k in ("b_simple", "trace", "grad_sq"):
            assert logs["noise"][k].shape == (3,), (what, k)
        for i, want in enumerate(wants):
            got = jax.tree.map(lambda v, i=i: v[i], logs["noise"])
            assert_noise(got, want, what=f"{what} lane {i}")


def test_across_vmap_lanes_mean_and_after():
    lanes = [data(seed) for seed in (5, 6)]
    xs, ys = (np.stack(a) for a in zip(*lanes, strict=True))
    params = jax.tree.map(lambda p: np.stack([p] * 2), init_params())
    terms = [np_train(x, y) for x, y in lanes]
    smalls, bigs = (np.stack(a) for a in zip(*terms, strict=True))  # (lanes, T)

    def run(lanes_mode):
        reduce = eqx_logs.NoiseScale(DECAY, lanes=lanes_mode)
        f = jax.vmap(lambda p, x, y: train(p, x, y, reduce), axis_name="b")
        return eqx_logs.spool(f, across="b")(params, xs, ys)[1]["noise"]

    # "mean": the per-step estimate from the lanes' small and big averaged per step
    want = np_noise(*np_terms(smalls.mean(0), bigs.mean(0), 1, B), DECAY)
    assert_noise(run("mean"), want, what="mean")
    # "after": lane 1's steps after lane 0's, one sequence of 2T events
    trace, grad_sq = np_terms(smalls.reshape(-1), bigs.reshape(-1), 1, B)
    assert_noise(run("after"), np_noise(trace, grad_sq, DECAY), what="after")


def test_under_grad_forward_values_once():
    x, y = data(7)

    def objective(params):
        final = train(params, x, y)
        return jnp.sum(final["w"] ** 2) + final["b"] ** 2

    g, logs = eqx_logs.spool(jax.grad(objective))(init_params())
    assert int(logs.count["noise"]) == T
    assert_noise(logs["noise"], np_reference(x, y))
    want_g = jax.grad(objective)(init_params())  # the gradient itself is unchanged
    np.testing.assert_allclose(g["w"], want_g["w"], rtol=1e-6)


def test_log_noise_scale_with_vmap_grad_per_example_and_micro_batches():
    x, y = data(8)
    _, logs = eqx_logs.spool(train_with_log_noise_scale)(init_params(), x, y)
    assert_noise(logs["noise"], np_reference(x, y), what="per example")
    assert int(logs.step["noise"]) == 0
    micro = eqx_logs.spool(lambda p, x, y: train_with_log_noise_scale(p, x, y, micro=4))
    _, logs = jax.jit(micro)(init_params(), x, y)
    assert_noise(logs["noise"], np_reference(x, y, micro=4), what="micro-batches of 4")


def test_log_noise_scale_default_reduce_and_dtypes():
    # NoiseScale() by default (decay 0.99); bfloat16 gradients give float32 averages
    x, y = data(9, steps=5)
    smalls, bigs = np_train(x, y)
    want = np_noise(*np_terms(smalls, bigs, 1, B), 0.99)

    def step(params, xy):
        gw, gb = per_example(params, *xy)
        norms = jnp.sqrt(jnp.sum(gw**2, axis=1) + gb**2)
        grads = {"w": jnp.mean(gw, axis=0), "b": jnp.mean(gb), "static": "ignored"}
        eqx_logs.log_noise_scale("noise", norms, grads)
        eqx_logs.log_noise_scale(
            "half",
            norms.astype(jnp.bfloat16),
            jax.tree.map(lambda g: g.astype(jnp.bfloat16), {"w": grads["w"], "b": grads["b"]}),
        )
        return sgd(params, {"w": grads["w"], "b": grads["b"]}), None

    _, logs = eqx_logs.spool(lambda p: jax.lax.scan(step, p, (x, y)))(init_params())
    assert_noise(logs["noise"], want)
    assert_noise(logs["half"], want, rtol=0.1, what="bfloat16")  # (bfloat16's 8 bits)


def test_gaussian_noise_model_approaches_trace_over_grad_sq():
    # g_i = G + noise with covariance Sigma: B_simple -> tr(Sigma) / |G|^2
    d, batch, steps = 6, 256, 200
    G = jnp.array([1.0, -0.5, 0.25, 0.0, 0.5, 0.5])
    scales = jnp.array([0.5, 1.0, 1.5, 2.0, 0.7, 1.2])  # Sigma = diag(scales^2)
    truth = float(jnp.sum(scales**2) / jnp.sum(G**2))

    def step(c, key):
        g = G[None] + scales[None] * jax.random.normal(key, (batch, d))
        eqx_logs.log_noise_scale("noise", jnp.linalg.norm(g, axis=1), jnp.mean(g, axis=0))
        return c, None

    keys = jax.random.split(jax.random.key(0), steps)
    _, logs = jax.jit(eqx_logs.spool(lambda: jax.lax.scan(step, 0, keys)))()
    got = logs["noise"]
    np.testing.assert_allclose(got["b_simple"], truth, rtol=0.1)
    np.testing.assert_allclose(got["trace"], float(jnp.sum(scales**2)), rtol=0.05)
    np.testing.assert_allclose(got["grad_sq"], float(jnp.sum(G**2)), rtol=0.1)


def test_no_events_and_traced_bad_sizes_are_nan():
    def f(x, flag, b_big):
        def logged(x):
            event = {"small": x, "big": x / 2, "b_small": 1, "b_big": b_big}
            eqx_logs.log("noise", event, reduce=eqx_logs.NoiseScale())

        jax.lax.cond(flag, logged, lambda x: None, x)

    _, logs = jax.jit(eqx_logs.spool(f))(1.0, False, 4)  # no events
    assert int(logs.count["noise"]) == 0
    assert all(np.isnan(v) for v in logs["noise"].values())
    _, logs = jax.jit(eqx_logs.spool(f))(1.0, True, 4)
    want = np_noise(*np_terms([1.0], [0.5], 1, 4), 0.99)
    assert_noise(logs["noise"], want)
    _, logs = jax.jit(eqx_logs.spool(f))(1.0, True, 1)  # traced b_big <= b_small: NaN
    assert int(logs.count["noise"]) == 1
    assert all(np.isnan(v) for v in logs["noise"].values())


def test_errors():
    with pytest.raises(ValueError, match=r"NoiseScale\(decay=1.0\): decay must be in \[0, 1\)"):
        eqx_logs.NoiseScale(1.0)
    with pytest.raises(ValueError, match=r"decay=-0.1"):
        eqx_logs.NoiseScale(-0.1)
    with pytest.raises(TypeError, match=r"NoiseScale\(decay='x'\).*real number"):
        eqx_logs.NoiseScale("x")
    with pytest.raises(ValueError, match=r"lanes='sum'.*'after'.*'mean'"):
        eqx_logs.NoiseScale(lanes="sum")
    norms, grads = jnp.ones(4), {"w": jnp.ones(3)}

    def spooled(fn):
        return eqx_logs.spool(fn)()

    # static sizes: an error naming the key and the call site
    with pytest.raises(
        ValueError,
        match=r"log_noise_scale\('gns'\) at .*test_noise_scale.*"
        r"b_small=4, b_big=4",
    ):
        spooled(lambda: eqx_logs.log_noise_scale("gns", norms, grads, b_small=4, b_big=4))
    with pytest.raises(ValueError, match=r"'gns'.*b_small=1, b_big=1"):  # a batch of one
        spooled(lambda: eqx_logs.log_noise_scale("gns", jnp.ones(1), grads))
    with pytest.raises(ValueError, match=r"'gns'.*norms must have shape \(batch,\).*\(2, 2\)"):
        spooled(lambda: eqx_logs.log_noise_scale("gns", jnp.ones((2, 2)), grads))
    with pytest.raises(ValueError, match=r"'gns'.*grads has no inexact array leaves"):
        spooled(lambda: eqx_logs.log_noise_scale("gns", norms, {"n": 3}))
    with pytest.raises(TypeError, match=r"'gns'.*real floating-point norms.*int32"):
        spooled(lambda: eqx_logs.log_noise_scale("gns", jnp.ones(4, jnp.int32), grads))
    # a static event logged by hand: an error at trace time
    bad = {"small": 1.0, "big": 0.5, "b_small": 8, "b_big": 8}
    with pytest.raises(ValueError, match=r"NoiseScale.*b_small=8, b_big=8"):
        spooled(lambda: eqx_logs.log("n", bad, reduce=eqx_logs.NoiseScale()))
    # events that are not the four scalars
    with pytest.raises(
        ValueError,
        match=r"keys \['small', 'big', 'b_small', 'b_big'\].*"
        r"\['big', 'small'\]",
    ):
        spooled(lambda: eqx_logs.log("n", {"small": 1.0, "big": 0.5}, reduce=eqx_logs.NoiseScale()))
    with pytest.raises(ValueError, match=r"'small' must be a scalar.*\(3,\)"):
        event = {"small": jnp.ones(3), "big": 0.5, "b_small": 1, "b_big": 4}
        spooled(lambda: eqx_logs.log("n", event, reduce=eqx_logs.NoiseScale()))


# ---- 4 CPU devices: data parallelism in a shard_map (a subprocess) ----------------------

DEVICES = 4

DEVICES_SCRIPT = """
import json, sys
sys.path.insert(0, HERE)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import eqx_logs
import test_noise_scale as t

n = len(jax.devices())
assert n == 4, n
mesh = Mesh(np.array(jax.devices()), ("d",))
x, y = t.data(10, batch=4 * t.B)


def local(reduce, global_event):
    def run(params, x, y):  # this device's (T, B, D) examples
        def step(params, xy):
            event, grads = t.event_of(params, *xy)
            grads = jax.lax.pmean(grads, "d")  # data parallel: the global batch's gradient
            if global_event:
                gw, gb = t.per_example(params, *xy)
                norms = jnp.sqrt(jnp.sum(gw**2, axis=1) + gb**2)
                eqx_logs.log_noise_scale(
                    "noise", norms, grads, b_big=n * t.B, axis_name="d", reduce=reduce
                )
            else:
                eqx_logs.log("noise", event, reduce=reduce)
            return t.sgd(params, grads), None

        return jax.lax.scan(step, params, (x, y))[0]

    return jax.shard_map(
        run, mesh=mesh, in_specs=(P(), P(None, "d"), P(None, "d")), out_specs=P()
    )


out = {}
for name, lanes, global_event, across in [
    ("local_mean", "mean", False, "d"),
    ("local_after", "after", False, "d"),
    ("local_each", "after", False, None),
    ("global_each", "after", True, None),
    ("global_mean", "mean", True, "d"),
    ("global_after", "after", True, "d"),
]:
    reduce = eqx_logs.NoiseScale(t.DECAY, lanes=lanes)
    f = eqx_logs.spool(local(reduce, global_event), across=across)
    _, logs = jax.jit(f)(t.init_params(), x, y)
    out[name] = {k: np.asarray(v).tolist() for k, v in logs["noise"].items()}
print(json.dumps(out))
"""


def np_data_parallel(x, y):
    """Per step and device: small and big of the device's examples, SGD on the global batch
    gradient; and the global batch's small and big. (devices, T) and (T,)."""
    w, b = np.zeros(D), 0.0
    small, big, small_g, big_g = [], [], [], []
    for xt, yt in zip(x.astype(np.float64), y.astype(np.float64), strict=True):
        r = xt @ w + b - yt
        gw, gb = r[:, None] * xt, r
        sq = np.sum(gw**2, 1) + gb**2
        dw, db = gw.reshape(DEVICES, B, D).mean(1), gb.reshape(DEVICES, B).mean(1)
        small.append(sq.reshape(DEVICES, B).mean(1))
        big.append(np.sum(dw**2, 1) + db**2)
        Gw, Gb = gw.mean(0), gb.mean()
        small_g.append(sq.mean())
        big_g.append(np.sum(Gw**2) + Gb**2)
        w, b = w - LR * Gw, b - LR * Gb
    return np.array(small).T, np.array(big).T, np.array(small_g), np.array(big_g)


def test_across_devices_in_shard_map():
    script = DEVICES_SCRIPT.replace("HERE", repr(HERE))
    env = {**devices_env(DEVICES), "PYTHONPATH": ROOT}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=HERE,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    x, y = data(10, batch=DEVICES * B)
    small, big, small_g, big_g = np_data_parallel(x, y)

    def check(name, want, shape=()):
        for k in want:
            g = np.asarray(got[name][k])
            assert g.shape == shape, (name, k, g.shape)
            np.testing.assert_allclose(g, want[k], rtol=RTOL, err_msg=f"{name}[{k!r}]")

    # each device its own micro-batch's terms, merged with lanes="mean": the devices' small and
    # big averaged per step, at b_big = the device's batch
    check("local_mean", np_noise(*np_terms(small.mean(0), big.mean(0), 1, B), DECAY))
    # lanes="after": device 1's steps after device 0's, ...
    seq = np_terms(small.reshape(-1), big.reshape(-1), 1, B)
    check("local_after", np_noise(*seq, DECAY))
    # without across: one output per device, each its own
    each = [np_noise(*np_terms(small[k], big[k], 1, B), DECAY) for k in range(DEVICES)]
    check("local_each", {k: np.array([e[k] for e in each]) for k in each[0]}, (DEVICES,))
    # log_noise_scale(axis_name="d") with the global gradient: every device logs the global
    # batch's event (b_big = 4 B); the same merged either way, or per device
    glob = np_noise(*np_terms(small_g, big_g, 1, DEVICES * B), DECAY)
    check("global_each", {k: np.full(DEVICES, v) for k, v in glob.items()}, (DEVICES,))
    check("global_mean", glob)
    check("global_after", glob)


def test_reference_is_not_trivial():
    # the numpy estimator itself: the local and global estimates differ, and "mean" differs
    # from "after" (so the device test tells the semantics apart)
    x, y = data(10, batch=DEVICES * B)
    small, big, small_g, big_g = np_data_parallel(x, y)
    mean = np_noise(*np_terms(small.mean(0), big.mean(0), 1, B), DECAY)["b_simple"]
    after = np_noise(*np_terms(small.reshape(-1), big.reshape(-1), 1, B), DECAY)["b_simple"]
    glob = np_noise(*np_terms(small_g, big_g, 1, DEVICES * B), DECAY)["b_simple"]
    assert abs(mean - after) > 1e-3 * abs(mean) and abs(mean - glob) > 1e-3 * abs(mean)


def test_a_refused_event_names_the_key_and_the_line():
    """A reduction's error about an event (here sizes known when tracing) says which key and
    where it was logged (a note the store adds to any ValueError or TypeError a reduction
    raises), for a hand-written event as for `log_noise_scale`."""

    def f(x):
        event = {"small": x, "big": x, "b_small": 4, "b_big": 2}
        eqx_logs.log("my/noise", event, reduce=eqx_logs.NoiseScale())
        return x

    with pytest.raises(ValueError, match="b_small < b_big") as info:
        eqx_logs.spool(f)(jnp.float32(1.0))
    notes = "\n".join(getattr(info.value, "__notes__", ()))
    assert "'my/noise'" in notes and "test_noise_scale.py" in notes, notes
