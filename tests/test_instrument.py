"""instrument, log_stats, first_nonfinite: against numpy on values threaded out by hand, and
cotangents from `jax.vjp` by hand."""

from functools import partial

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_close
from jax import lax

import eqx_logs
import eqx_logs.loggers

fast = pytest.mark.fast  # in `make test-fast`: the quicker half

ALL = ("mean", "std", "rms", "absmax", "min", "max", "norm", "nonfinite")


def np_stats(x, stats=ALL) -> dict[str, np.ndarray]:
    """The statistics, in numpy (float64), of one array."""
    x = np.asarray(x, np.float64)
    out = {
        "mean": x.mean(),
        "std": x.std(),
        "rms": np.sqrt(np.mean(x**2)),
        "absmax": np.abs(x).max(),
        "min": x.min(),
        "max": x.max(),
        "norm": np.sqrt(np.sum(x**2)),
        "nonfinite": np.sum(~np.isfinite(x)),
    }
    return {k: out[k] for k in stats}


def mlp(key=0, depth=2):
    return eqx.nn.MLP(3, 2, 8, depth, activation=jnp.tanh, key=jax.random.key(key))


def hand_activations(model: eqx.nn.MLP, x):
    """Each layer's output of an eqx.nn.MLP (one example), threaded out by hand."""
    outs = []
    for layer in model.layers[:-1]:
        x = layer(x)
        outs.append(x)
        x = model.activation(x)
    outs.append(model.layers[-1](x))
    return outs


# -- log_stats --------------------------------------------------------------------------


@fast
def test_log_stats_against_numpy():
    tree = {
        "w": jax.random.normal(jax.random.key(0), (3, 4)) * 3 + 1,
        "b": jnp.array([1.0, jnp.nan, -jnp.inf, 2.0]),
        "i": jnp.arange(5),
        "none": None,
        "fn": jnp.tanh,
    }

    def f(tree):
        eqx_logs.log_stats("grad", tree, stats=ALL)
        return 0

    _, logs = eqx_logs.spool(f)(tree)
    want_keys = {f"grad/['{k}']/{s}" for k in ("w", "b", "i") for s in ALL}
    assert set(logs) == want_keys
    for name in ("w", "i"):
        for stat, want in np_stats(tree[name]).items():
            np.testing.assert_allclose(logs[f"grad/['{name}']/{stat}"][0], want, rtol=1e-5)
    assert int(logs["grad/['b']/nonfinite"][0]) == 2
    assert np.isnan(logs["grad/['b']/mean"][0])


@fast
def test_log_stats_of_a_model_and_a_lone_array_and_scope():
    model = mlp()

    def f(model, x):
        with eqx_logs.scope("s"):
            eqx_logs.log_stats("params", model, stats=("norm",), step=3)
        eqx_logs.log_stats("x", x, stats=("max",))
        return x

    _, logs = eqx.filter_jit(eqx_logs.spool(f))(model, jnp.arange(3.0))
    assert_close(logs["x/max"], [2.0])
    for i, layer in enumerate(model.layers):
        got = logs[f"s/params/layers[{i}].weight/norm"]
        assert_close(got, [np.linalg.norm(np.asarray(layer.weight))])
        assert int(logs.step[f"s/params/layers[{i}].bias/norm"][0]) == 3


@fast
def test_log_stats_under_vmap_is_over_all_lanes():
    xs = jax.random.normal(jax.random.key(5), (6, 3))

    def f(xs):
        return jax.vmap(lambda x: eqx_logs.log_stats("x", 2 * x, stats=("std", "max")))(xs)

    _, logs = eqx_logs.spool(f)(xs)
    assert_close(logs["x/std"], [np.std(2 * np.asarray(xs))])
    assert_close(logs["x/max"], [np.max(2 * np.asarray(xs))])

    def g(xs):  # under grad: the statistics take no derivative, the gradient is unchanged
        def per_example(x):
            eqx_logs.log_stats("x", x, stats=("norm",))
            return jnp.sum(jnp.sin(x))

        return jnp.sum(jax.vmap(per_example)(xs))

    grads, logs = eqx_logs.spool(jax.grad(g))(xs)
    assert_close(grads, np.cos(np.asarray(xs)))
    assert_close(logs["x/norm"], [np.linalg.norm(np.asarray(xs))])


@fast
def test_log_stats_errors_and_nothing_outside_a_spool():
    with pytest.raises(ValueError, match=r"unknown statistic\(s\) \['median'\].*choose from"):
        eqx_logs.log_stats("g", jnp.ones(2), stats=("mean", "median"))
    with pytest.raises(ValueError, match="no array leaves"):
        eqx_logs.spool(lambda: eqx_logs.log_stats("g", {"a": None}))()
    empty = {"a": jnp.zeros((0, 3)), "b": jnp.ones(2)}
    with pytest.raises(
        ValueError, match=r"test_instrument.py.*\"g/\['a'\]\" \(shape \(0, 3\)\) has no"
    ):
        eqx_logs.spool(lambda t: eqx_logs.log_stats("g", t))(empty)
    model = eqx_logs.instrument(eqx.nn.Sequential([eqx.nn.Lambda(lambda x: x[:0])]))
    with pytest.raises(ValueError, match=r"'layers\[0\]' \(shape \(0,\)\) has no elements"):
        eqx_logs.spool(model)(jnp.ones(3))

    def f(x):
        eqx_logs.log_stats("x", x)
        return x * 2

    assert len(jax.make_jaxpr(f)(jnp.ones(3)).eqns) == 1  # no statistic computed


# -- instrument: values --------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_instrument_mlp_forward_stats_match_hand(jit):
    model = mlp()
    im = eqx_logs.instrument(model, stats=ALL)
    xs = jax.random.normal(jax.random.key(1), (5, 3))

    def f(m, xs):
        return jax.vmap(m)(xs)

    run = eqx_logs.spool(f)
    out, logs = (eqx.filter_jit(run) if jit else run)(im, xs)
    assert_close(out, jax.vmap(model)(xs))
    per_example = [hand_activations(model, x) for x in xs]
    for i in range(len(model.layers)):
        batch = np.stack([acts[i] for acts in per_example])
        for stat, want in np_stats(batch).items():
            got = logs[f"layers[{i}]/{stat}"]
            assert got.shape == (1,)  # one event, over the whole batch (the vmap inside)
            np.testing.assert_allclose(got, [want], rtol=2e-5, atol=1e-6, err_msg=stat)
    assert all(k.startswith("layers[") for k in logs)  # the model itself is not logged


def test_instrument_cotangent_stats_match_vjp_by_hand():
    model = mlp(depth=3)
    im = eqx_logs.instrument(model, stats=("mean", "rms", "absmax", "norm"), grads=True)
    x = jax.random.normal(jax.random.key(2), (3,))

    def loss(m, x):
        return jnp.sum(jnp.sin(m(x)) ** 2)

    grads, logs = eqx_logs.spool(eqx.filter_grad(loss))(im, x)

    cts = _hand_cotangents(model, x, lambda y: jnp.sum(jnp.sin(y) ** 2))
    for i, ct in enumerate(cts):
        for stat, want in np_stats(ct, ("mean", "rms", "absmax", "norm")).items():
            got = logs[f"layers[{i}]/grad/{stat}"]
            np.testing.assert_allclose(got, [want], rtol=2e-5, atol=1e-7, err_msg=f"{i} {stat}")
    # the gradients are those of the plain model
    want = eqx.filter_grad(loss)(model, x)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
        assert_close(g, w)


@fast
def test_instrument_outside_a_spool_is_the_original_program():
    model = mlp()
    im = eqx_logs.instrument(model, grads=True)
    x = jnp.ones((4, 3))

    def loss(m, x):
        return jnp.sum(jax.vmap(m)(x))

    def text(m):
        return eqx.filter_jit(eqx.filter_value_and_grad(loss)).lower(m, x).as_text()

    assert text(im) == text(model)
    # the same arrays at the same paths, the same classes
    paths = jax.tree_util.tree_flatten_with_path
    assert [(p, id(x)) for p, x in paths(im)[0]] == [(p, id(x)) for p, x in paths(model)[0]]
    assert all(isinstance(a, type(b)) for a, b in zip(im.layers, model.layers))


@fast
def test_instrument_reads_through_and_where():
    model = mlp(depth=3)
    im = eqx_logs.instrument(model, where="layers[1]")
    assert im.layers[1].weight is model.layers[1].weight
    assert im.layers[1].out_features == 8
    _, logs = eqx_logs.spool(im)(jnp.ones(3))
    assert sorted({k.split("/")[0] for k in logs}) == ["layers[1]"]

    im = eqx_logs.instrument(model, where=("layers[0]", "layers[3]"), stats=("max",))
    _, logs = eqx_logs.spool(im)(jnp.ones(3))
    assert sorted(logs) == ["layers[0]/max", "layers[3]/max"]

    im = eqx_logs.instrument(model, where=lambda path, m: m.out_features == 2, stats=("max",))
    _, logs = eqx_logs.spool(im)(jnp.ones(3))
    assert sorted(logs) == ["layers[3]/max"]

    # instrumenting again replaces the options
    im2 = eqx_logs.instrument(im, stats=("min",), where="layers[*]")
    _, logs = eqx_logs.spool(im2)(jnp.ones(3))
    assert sorted(logs) == [f"layers[{i}]/min" for i in range(4)]

    with pytest.raises(ValueError, match=r"selects no submodule of MLP; its submodules are"):
        eqx_logs.instrument(model, where="encoder*")
    with pytest.raises(ValueError, match="unknown statistic"):
        eqx_logs.instrument(model, stats=("avg",))


class Block(eqx.Module):
    attention: eqx.nn.MultiheadAttention
    norm: eqx.nn.LayerNorm
    conv: eqx.nn.Conv1d
    seq: eqx.nn.Sequential

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.attention = eqx.nn.MultiheadAttention(2, 8, key=k1)
        self.norm = eqx.nn.LayerNorm(8)
        self.conv = eqx.nn.Conv1d(8, 8, 3, padding=1, key=k2)
        self.seq = eqx.nn.Sequential(
            [
                eqx.nn.Linear(8, 8, key=k3),
                eqx.nn.Lambda(jax.nn.relu),
                eqx.nn.Dropout(0.5, inference=True),
            ]
        )

    def __call__(self, x):  # x: (seq, 8)
        h = jax.vmap(self.norm)(x + self.attention(x, x, x))
        h = h + self.conv(h.T).T
        return jax.vmap(lambda v: self.seq(v, key=None))(h)


def test_instrument_equinox_layers_match_hand():
    block = Block(jax.random.key(0))
    ib = eqx_logs.instrument(block, stats=("mean", "norm"))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    out, logs = eqx_logs.spool(ib)(x)
    assert_close(out, block(x))
    # by hand
    attn = block.attention(x, x, x)
    normed = jax.vmap(block.norm)(x + attn)
    conv = block.conv(normed.T)
    h = normed + conv.T
    lin = jax.vmap(block.seq.layers[0])(h)
    relu = jax.nn.relu(lin)
    q = jax.vmap(block.attention.query_proj)(x)  # a submodule of a submodule, under vmap
    expected = {  # vmapped over positions: the statistics are over all of them
        "attention": attn,
        "norm": normed,
        "conv": conv,
        "seq": relu,
        "seq.layers[0]": lin,
        "seq.layers[1]": relu,
        "seq.layers[2]": relu,
        "attention.query_proj": q,
    }
    for path, value in expected.items():
        for stat, want in np_stats(value, ("mean", "norm")).items():
            got = np.asarray(logs[f"{path}/{stat}"])
            np.testing.assert_allclose(got, [want], rtol=2e-5, atol=1e-6, err_msg=path)


def test_instrument_stateful_layer_in_sequential():
    seq = eqx.nn.Sequential(
        [eqx.nn.Linear(3, 4, key=jax.random.key(0)), eqx.nn.BatchNorm(4, "b", mode="batch")]
    )
    model, state = eqx.nn.make_with_state(lambda: seq)()
    im = eqx_logs.instrument(model, stats=("mean",))
    xs = jax.random.normal(jax.random.key(1), (6, 3))

    def f(m, state, xs):
        return jax.vmap(m, in_axes=(0, None), out_axes=(0, None), axis_name="b")(xs, state)

    (out, new_state), logs = eqx_logs.spool(f)(im, state, xs)
    want_out, want_state = f(model, state, xs)
    assert_close(out, want_out)
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state)):
        assert_close(a, b)
    assert_close(logs["layers[1]/mean"], [np.mean(np.asarray(want_out))])


class Stacked(eqx.Module):
    layers: eqx.nn.Linear  # stacked with eqx.filter_vmap


def test_instrument_scan_over_layers_one_event_per_layer():
    n, width = 5, 6
    keys = jax.random.split(jax.random.key(0), n)
    layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(width, width, key=k))(keys)
    model = Stacked(layers)
    im = eqx_logs.instrument(model, stats=("rms", "absmax"), grads=True)
    x = jax.random.normal(jax.random.key(1), (width,))

    def apply(model, x):
        dynamic, static = eqx.partition(model.layers, eqx.is_array)

        def body(h, d):
            return jnp.tanh(eqx.combine(d, static)(h)), None

        return jnp.sum(lax.scan(body, x, dynamic)[0] ** 2)

    grads, logs = eqx_logs.spool(eqx.filter_grad(apply))(im, x)
    h, outs = x, []
    for i in range(n):
        layer = jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, layers)
        outs.append(layer(h))
        h = jnp.tanh(outs[-1])
    assert logs["layers/rms"].shape == (n,)
    assert_close(logs["layers/rms"], [np_stats(o, ("rms",))["rms"] for o in outs])
    assert_close(logs["layers/absmax"], [np.abs(o).max() for o in outs])
    assert logs["layers/grad/rms"].shape == (n,)  # the backward pass: layers in reverse
    ct_last = 2 * np.tanh(outs[-1]) * (1 - np.tanh(outs[-1]) ** 2)
    assert_close(logs["layers/grad/rms"][0], np.sqrt(np.mean(ct_last**2)))


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam (see conftest.py)
def test_instrument_checkpoint_logs_once_and_optax_trains():
    model = mlp(depth=2)
    im = eqx_logs.instrument(model, stats=("mean",), grads=True)
    x = jax.random.normal(jax.random.key(3), (8, 3))
    optim = optax.adam(1e-2)
    opt_state = optim.init(eqx.filter(im, eqx.is_array))

    def loss(m, x):
        return jnp.mean(jax.vmap(eqx.filter_checkpoint(m))(x) ** 2)

    @eqx.filter_jit
    def step(m, opt_state, x):
        def body(m):
            loss_value, grads = eqx.filter_value_and_grad(loss)(m, x)
            updates, new_state = optim.update(grads, opt_state, eqx.filter(m, eqx.is_array))
            return eqx.apply_updates(m, updates), new_state, loss_value

        return eqx_logs.spool(body, reduce="mean")(m)

    (new, _, loss_value), logs = step(im, opt_state, x)
    assert int(logs.count["layers[0]/mean"]) == 1  # not twice: checkpoint recomputes
    assert int(logs.count["layers[0]/grad/mean"]) == 1

    @eqx.filter_jit  # the same step on the plain model (one compile, not one per operation)
    def plain_step(model, x):
        plain_state = optim.init(eqx.filter(model, eqx.is_array))
        grads = eqx.filter_grad(loss)(model, x)
        updates, _ = optim.update(grads, plain_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates)

    want = plain_step(model, x)
    for a, b in zip(jax.tree.leaves(eqx.filter(new, eqx.is_array)), jax.tree.leaves(want)):
        assert_close(a, b)
    acts = jax.vmap(lambda v: hand_activations(model, v)[0])(x)
    assert_close(logs["layers[0]/mean"], np.mean(np.asarray(acts)))  # over the batch


def test_instrument_under_reductions_and_policies():
    model = mlp(depth=1)
    im = eqx_logs.instrument(model, stats=("rms",))
    xs = jax.random.normal(jax.random.key(4), (12, 3))

    def run(m, xs):
        def body(c, x):
            return c + m(x)[0], None

        return lax.scan(body, 0.0, xs)[0]

    _, stacked = eqx_logs.spool(run)(im, xs)
    every = np.asarray(stacked["layers[1]/rms"])
    want = np.array([np_stats(hand_activations(model, x)[1], ("rms",))["rms"] for x in xs])
    assert_close(every, want)
    _, logs = eqx_logs.spool(run, interval=3)(im, xs)
    assert_close(logs["layers[1]/rms"], every[::3])
    _, logs = eqx_logs.spool(run, window=4, reduce="max")(im, xs)
    assert_close(logs["layers[1]/rms"], every.reshape(3, 4).max(axis=1))
    _, logs = eqx_logs.spool(run, reduce=eqx_logs.Histogram(4, (0.0, 2.0)))(im, xs)
    want_hist = np.histogram(every, bins=4, range=(0.0, 2.0))[0]
    np.testing.assert_array_equal(logs["layers[1]/rms"], want_hist)


# -- first_nonfinite ----------------------------------------------------------------------


class Poison(eqx.Module):
    """At step `at`, makes this layer's output non-finite (`forward`), or the cotangent
    reaching it from later layers (backward)."""

    layer: eqx.nn.Linear
    at: int = eqx.field(static=True)
    backward: bool = eqx.field(static=True)

    def __call__(self, x, t):
        y = self.layer(x)
        if self.backward:
            return _nan_cotangent(y, t == self.at)
        return jnp.where(t == self.at, jnp.inf, 1.0) * y


@jax.custom_vjp
def _nan_cotangent(y, now):
    return y


def _nan_fwd(y, now):
    return y, now


def _nan_bwd(now, ct):
    return jnp.where(now, jnp.nan, ct), None


_nan_cotangent.defvjp(_nan_fwd, _nan_bwd)


class Net(eqx.Module):
    layers: list

    def __call__(self, x, t):
        for layer in self.layers:
            x = jnp.tanh(layer(x, t) if isinstance(layer, Poison) else layer(x))  # (instrumented)
        return jnp.sum(x**2)


def make_net(depth, poison_at, step, backward):
    keys = jax.random.split(jax.random.key(0), depth)
    layers = [eqx.nn.Linear(4, 4, key=k) for k in keys]
    layers[poison_at] = Poison(layers[poison_at], step, backward)
    return Net(layers)


def train(net, steps, **spool_options):
    x = jnp.linspace(-1, 1, 4)

    @eqx.filter_jit
    def run(net):
        def body(net, t):
            with eqx_logs.scope(step=t):  # every event inside carries the step
                grads = eqx.filter_grad(lambda n: n(x, t))(net)
                eqx_logs.log("loss", net(x, t))
            net = jax.tree.map(lambda p, g: p - 1e-3 * g, net, grads)
            return net, None

        return eqx_logs.spool(lambda n: lax.scan(body, n, jnp.arange(steps)), **spool_options)(net)

    return run(net)[1]


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("poison_at,step", [(1, 4), (3, 0)])
def test_first_nonfinite_names_the_layer_step_and_pass(poison_at, step, backward):
    net = eqx_logs.instrument(make_net(4, poison_at, step, backward), grads=True)
    logs = train(net, 7, first_nonfinite=True, reduce="last")
    event = logs.first_nonfinite
    assert event is not None
    # forward: the poisoned layer's output (after its Linear's, which is finite); backward:
    # the cotangent the poison makes non-finite, that of its Linear's output
    path = f"layers[{poison_at}]" + (".layer/grad/" if backward else "/")
    assert event.key.startswith(path), event
    assert event.backward is backward
    assert event.iterations == (step,)  # the scan over training steps
    # the forward pass runs twice per step (under grad, then for the loss), backward once
    assert event.event == (step if backward else 2 * step)
    assert event.steps == {"step": step}  # from the scope around the step
    assert event.site.endswith("(__call__)") and "test_instrument.py" in event.site
    assert f"layers[{poison_at}]" in str(event) and ("backward" in str(event)) is backward
    assert f"loop iteration {step}" in str(event)


def test_first_nonfinite_none_when_finite_and_counts_interval_skipped_events():
    net = eqx_logs.instrument(make_net(3, 1, 100, False), stats=("mean",))
    logs = train(net, 5, first_nonfinite=True)
    assert logs.first_nonfinite is None
    net = eqx_logs.instrument(make_net(3, 2, 3, False), stats=("mean",))
    logs = train(net, 5, first_nonfinite=True, interval=4)  # steps 0 and 4 kept
    event = logs.first_nonfinite
    assert (event.key, event.event, event.iterations) == ("layers[2]/mean", 6, (3,))
    assert int(logs.count["layers[2]/mean"]) == 4  # two events at each kept step
    np.testing.assert_array_equal(logs.step["layers[2]/mean"][:4], [0, 0, 4, 4])
    with pytest.raises(ValueError, match="first_nonfinite=True"):
        train(net, 2).first_nonfinite


@fast
def test_first_nonfinite_steps_lanes_and_straight_line_order():
    def f(xs):
        eqx_logs.log("before", jnp.ones(2))

        def body(c, x):
            eqx_logs.log({"a": jnp.log(x), "b": c}, step=c)
            return c + 1, None

        lax.scan(body, 0, xs)
        eqx_logs.log("after", jnp.full(2, jnp.nan))
        return 0

    xs = jnp.array([[1.0, 2.0], [3.0, 4.0], [1.0, -1.0], [0.0, 1.0]])
    _, logs = eqx_logs.spool(f, first_nonfinite=True)(xs)
    event = logs.first_nonfinite
    assert (event.key, event.event, event.steps, event.backward) == ("a", 2, {"step": 2}, False)
    assert event.iterations == (2,)

    def g(xs):
        return jax.vmap(lambda x: eqx_logs.log("v", jnp.sqrt(x)))(xs)

    _, logs = eqx_logs.spool(g, first_nonfinite=True)(jnp.array([1.0, 4.0, -1.0, -2.0]))
    assert logs.first_nonfinite.lane == 2
    assert logs.first_nonfinite.event == 0


# -- sow and plant ------------------------------------------------------------------------


class Sown(eqx.Module):
    layers: list

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = eqx_logs.sow(f"h{i}", jnp.tanh(layer(x)))
        return x


@fast
def test_plant_matches_the_model_edited_by_hand():
    keys = jax.random.split(jax.random.key(0), 3)
    model = Sown([eqx.nn.Linear(4, 4, key=k) for k in keys])
    x = jnp.linspace(-1, 1, 4)
    value = jnp.array([0.5, -0.5, 0.25, 0.0])

    def by_hand(x):
        h = jnp.tanh(model.layers[0](x))
        h = value  # layer 1's output replaced
        return jnp.tanh(model.layers[2](h))

    assert_close(model(x), eqx_logs.plant(model, {})(x))
    assert_close(eqx_logs.plant(model, {"h1": value})(x), by_hand(x))
    assert_close(jax.jit(eqx_logs.plant(model, {"h1": value}))(x), by_hand(x))
    # spool outside records the planted value
    out, logs = eqx_logs.spool(eqx_logs.plant(model, {"h1": value}))(x)
    assert_close(logs["h1"], [value])
    assert_close(logs["h2"], [by_hand(x)])
    # gradients: with respect to the input (the planted value is a constant), and to the value
    g = jax.grad(lambda x: jnp.sum(eqx_logs.plant(model, {"h1": value})(x)))(x)
    assert_close(g, np.zeros(4))
    g = jax.grad(lambda v: jnp.sum(eqx_logs.plant(model, {"h1": v})(x)))(value)
    assert_close(g, jax.grad(lambda h: jnp.sum(jnp.tanh(model.layers[2](h))))(value))


def test_plant_per_event_in_loops_and_replay_under_vmap():
    def f(xs):
        def body(c, x):
            return c * 0.5 + eqx_logs.sow("x", x), None

        return lax.scan(body, 0.0, xs)[0]

    rows = jnp.array([10.0, 20.0, 30.0, 40.0])
    want = 0.0
    for r in rows:
        want = want * 0.5 + r
    assert_close(eqx_logs.plant(f, {"x": rows})(jnp.ones(4)), want)

    def w(x):
        def body(c):
            i, acc = c
            return i + 1, acc + eqx_logs.sow("acc", acc)

        return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1]

    assert_close(eqx_logs.plant(w, {"acc": jnp.array([1.0, 2.0, 3.0])})(1.0), 7.0)

    def batched(xs):
        return jax.vmap(f)(xs)

    xs = jax.random.normal(jax.random.key(0), (3, 4))
    _, logs = eqx_logs.spool(batched)(xs)
    assert logs["x"].shape == (4, 3)  # events, lanes
    assert_close(eqx_logs.plant(batched, logs)(jnp.zeros((3, 4))), batched(xs))


@fast
def test_plant_errors():
    def f(x):
        eqx_logs.log("logged", x)
        return eqx_logs.sow("h", x * 2) + 1

    with pytest.raises(
        ValueError,
        match=r"'y' is not sown in .*f; the keys sown there are \['h'\] "
        r"\(logged, not sown: \['logged'\]",
    ):
        eqx_logs.plant(f, {"y": 1.0})(jnp.ones(3))
    with pytest.raises(ValueError, match=r"'h' is sown with shape \(3,\).*got \(2, 2\)"):
        eqx_logs.plant(f, {"h": jnp.ones((2, 2))})(jnp.ones(3))

    def g(xs):
        return lax.scan(lambda c, x: (c + eqx_logs.sow("x", x), None), 0.0, xs)[0]

    with pytest.raises(ValueError, match=r"'x' is sown 5 times .* but 2 rows were planted"):
        eqx_logs.plant(g, {"x": jnp.ones(2)})(jnp.ones(5))
    with pytest.raises(TypeError, match="values must be a dict"):
        eqx_logs.plant(g, [1.0])
    # outside any spool or plant, sow is the identity and adds nothing
    assert len(jax.make_jaxpr(lambda x: eqx_logs.sow("h", x))(1.0).eqns) == 0


@fast
def test_first_nonfinite_inside_a_shard_map_names_the_device():
    # (on one device here; several, with the lowest-numbered reported: tests/test_devices.py)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dev",))
    P = jax.sharding.PartitionSpec

    def f(x):
        def body(x):
            def step(c, i):
                eqx_logs.log("x", jnp.log(c), step=i)
                return c - 1.0, None

            return lax.scan(step, x, jnp.arange(4))[0]

        return jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())(x)

    x = jnp.array([5.0, 2.5])  # log(c) is NaN from step 3 (numpy: c = 2.5 - 3 < 0)
    want = next(i for i in range(4) if np.any(np.asarray(x) - i < 0))
    _, logs = eqx_logs.spool(f, first_nonfinite=True)(x)
    report = logs.first_nonfinite
    assert (report.key, report.event, report.iterations, report.steps) == (
        "x",
        want,
        (want,),
        {"step": want},
    )
    assert report.device == 0 and report.lane is None
    assert "loop iteration 3, device 0;" in str(report)
    assert jax.jit(eqx_logs.spool(f, first_nonfinite=True))(x)[1].first_nonfinite == report
    _, fine = eqx_logs.spool(f, first_nonfinite=True)(x + 10)
    assert fine.first_nonfinite is None
    _, logs = eqx_logs.spool(f)(x)  # the values as without the search
    with np.errstate(invalid="ignore"):
        want_x = np.log(np.asarray(x) - np.arange(4)[:, None])[:, None]  # (events, devices, 2)
    assert_close(logs["x"], want_x)


@fast
def test_statistics_of_huge_finite_values_stay_finite():
    x = jnp.array([3e20, -1e20, 2e20, 0.0], jnp.float32)  # squares overflow float32

    def f(x):
        eqx_logs.log_stats("x", x, stats=ALL)
        eqx_logs.log_stats("zero", jnp.zeros(3), stats=("mean", "std", "rms", "norm"))
        eqx_logs.log_stats("inf", x.at[1].set(jnp.inf), stats=("mean", "rms"))
        return 0

    _, logs = eqx_logs.spool(f, first_nonfinite=True)(x)
    for stat, want in np_stats(np.asarray(x, np.float64)).items():
        np.testing.assert_allclose(logs[f"x/{stat}"], [want], rtol=1e-5, err_msg=stat)
    for stat in ("mean", "std", "rms", "norm"):
        assert float(logs[f"zero/{stat}"][0]) == 0.0
    assert not np.isfinite(logs["inf/rms"][0]) and not np.isfinite(logs["inf/mean"][0])
    assert logs.first_nonfinite.key == "inf/mean"  # not the huge finite values

    # a mean that dwarfs the spread: the variance in two passes, not from the two sums
    y = 1e4 + jax.random.normal(jax.random.key(0), (1000,)) * 1e-2
    _, logs = eqx_logs.spool(lambda y: eqx_logs.log_stats("y", y, stats=("std", "mean")))(y)
    want = np_stats(np.asarray(y, np.float64), ("std", "mean"))
    np.testing.assert_allclose(logs["y/std"], [want["std"]], rtol=2e-2)
    np.testing.assert_allclose(logs["y/mean"], [want["mean"]], rtol=1e-6)


def test_tap_refuses_and_logger_spool_warns_with_first_nonfinite(tmp_path):
    def f(x):
        eqx_logs.log("y", jnp.log(x))
        return x

    with pytest.raises(ValueError, match=r"tap streams each event .* first_nonfinite=True"):
        eqx_logs.tap(f, policy=eqx_logs.Policy(first_nonfinite=True))
    logger = eqx_logs.loggers.JsonlLogger(str(tmp_path / "logs.jsonl"))
    with logger:
        state = logger.init(0)
        logger.spool(f, state, first_nonfinite=True)(jnp.array([1.0, 2.0]))
        logger.flush()
        with pytest.warns(eqx_logs.loggers.NonfiniteWarning, match=r"event 0 of key 'y'"):
            logger.spool(f, state, first_nonfinite=True)(jnp.array([1.0, -2.0]))
            logger.flush()
    rows = eqx_logs.loggers.read_jsonl(str(tmp_path / "logs.jsonl"))
    assert len(rows) == 2  # both calls written


def test_scope_steps_reach_every_event_through_inner_jits_and_backward_passes():
    model = mlp(depth=1)
    im = eqx_logs.instrument(model, stats=("mean",), grads=True)
    inner = eqx.filter_jit(lambda m, x: m(x))  # traced once per scope, never reused across
    xs = jax.random.normal(jax.random.key(6), (4, 3))

    @eqx.filter_jit
    def step(m, x, i):  # the per-step loop: one jitted call per step
        def body(m):
            with eqx_logs.scope("train", step=i):
                loss, grads = eqx.filter_value_and_grad(lambda m: jnp.sum(inner(m, x)))(m)
                eqx_logs.log("loss", loss)
                eqx_logs.log("other", loss, step=100)  # a step named at the call wins
            return loss

        return eqx_logs.spool(body, interval=2)(m)

    for i in range(4):
        loss, logs = step(im, xs[i], i)
        kept = i % 2 == 0  # interval=2 by the step, across calls
        for key in ("train/loss", "train/layers[0]/mean", "train/layers[1]/grad/mean"):
            assert int(logs.count[key]) == int(kept), (key, i)
            if kept:
                assert int(logs.step[key][0]) == i
        assert int(logs.step["train/other"][0]) == 100
        if kept:
            assert_close(logs["train/loss"], [loss])
            h = jax.vmap(lambda v: v)(model.layers[0](xs[i]))
            assert_close(logs["train/layers[0]/mean"], [np.mean(np.asarray(h))])

    with pytest.raises(
        ValueError, match=r"scope\(step=...\) at .*test_instrument.py:\d+ .* outside"
    ):
        with eqx_logs.scope(step=3):
            pass


def test_instrument_inside_a_diffrax_solve_against_euler_by_hand():
    # A neural ODE's vector field instrumented, solved by diffrax (Euler, 10 fixed steps, its
    # checkpointed while loop): forward statistics per step against the activations of the
    # same Euler steps threaded out by hand; under grad, cotangent statistics against jax.vjp
    # of that hand-written loop, and the forward keys' events counted against the vector
    # field's real runs (the loop re-runs steps in its backward pass).
    stats = ("mean", "std", "absmax", "norm")
    model = eqx.nn.MLP(3, 3, 8, 2, activation=jnp.tanh, key=jax.random.key(0))
    im = eqx_logs.instrument(model, stats=stats, grads=True)
    runs, dt, n = [0], 0.1, 10
    y0 = jnp.array([0.5, -0.2, 0.1])

    def solve(m, y0):
        def field(t, y, args):
            jax.debug.callback(lambda: runs.__setitem__(0, runs[0] + 1))
            return m(y)

        term = diffrax.ODETerm(field)
        sol = diffrax.diffeqsolve(term, diffrax.Euler(), 0.0, n * dt, dt, y0, max_steps=16)
        return sol.ys[-1]

    def loss(m, y0):
        return jnp.sum(solve(m, y0) ** 2)

    def by_hand(eps):  # eps[step][layer] is added to that layer's output
        y, acts = y0, []
        for s in range(n):
            h, outs = y, []
            for i, layer in enumerate(model.layers):
                h = layer(h) + eps[s][i]
                outs.append(h)
                if i < len(model.layers) - 1:
                    h = model.activation(h)
            acts.append(outs)
            y = y + dt * h
        return jnp.sum(y**2), acts

    eps = [[jnp.zeros(layer.out_features) for layer in model.layers] for _ in range(n)]
    _, acts = by_hand(eps)
    _, vjp = jax.vjp(lambda e: by_hand(e)[0], eps)
    (cts,) = vjp(jnp.ones(()))
    layers = range(len(model.layers))

    grad = eqx_logs.spool(eqx.filter_grad(loss), reduce=eqx_logs.Stack(capacity=64))
    grads, logs = eqx.filter_jit(grad)(im, y0)
    jax.effects_barrier()
    assert runs[0] > n  # the checkpointed loop recomputed steps in the backward pass
    for i in layers:
        for stat in stats:
            key = f"layers[{i}]/{stat}"
            assert int(logs.count[key]) == runs[0]  # every run of the layer, as it ran
            got = np.asarray(logs[key][: runs[0]])
            want = np.array([np_stats(acts[s][i])[stat] for s in range(n)])
            np.testing.assert_allclose(got[:n], want, rtol=2e-5, atol=1e-6, err_msg=key)
            # each recomputation is one of the forward pass's steps
            assert np.isclose(got[n:, None], want[None, :], rtol=2e-5, atol=1e-6).any(1).all()
            key = f"layers[{i}]/grad/{stat}"
            assert int(logs.count[key]) == n  # one backward step per forward step, last first
            want = [np_stats(cts[s][i])[stat] for s in reversed(range(n))]
            np.testing.assert_allclose(logs[key][:n], want, rtol=2e-5, atol=1e-7, err_msg=key)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(eqx.filter_grad(loss)(model, y0))):
        assert_close(g, w)

    # the forward pass alone: a spool inside the grad, its events as many as the forward
    # solve's steps; the cotangents reach the one outside
    def inner(m, y0):
        y, logs = eqx_logs.spool(solve, reduce=eqx_logs.Stack(capacity=16))(m, y0)
        return jnp.sum(y**2), logs

    grad = eqx_logs.spool(eqx.filter_grad(inner, has_aux=True), reduce=eqx_logs.Stack(capacity=64))
    (_, forward), backward = eqx.filter_jit(grad)(im, y0)
    for i in layers:
        for stat in stats:
            key = f"layers[{i}]/{stat}"
            assert int(forward.count[key]) == n
            want = [np_stats(acts[s][i])[stat] for s in range(n)]
            np.testing.assert_allclose(forward[key][:n], want, rtol=2e-5, atol=1e-6, err_msg=key)
        assert int(backward.count[f"layers[{i}]/grad/mean"]) == n


# -- statistics under a vmap outside the spool: one run per lane -----------------------------


def _lane(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


@fast
def test_statistics_under_vmap_of_spool_are_per_lane():
    # a vmap outside the spool is a batch of runs: each lane's statistics are its own; a
    # vmap inside it (the model's batch) is reduced over, in every lane
    xs = jnp.array([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]])
    batches = jax.random.normal(jax.random.key(1), (3, 5, 2))

    def f(x, batch):
        eqx_logs.log_stats("x", x, stats=("mean", "std", "max", "nonfinite"))
        jax.vmap(lambda b: eqx_logs.log_stats("b", b * x, stats=("mean", "norm")))(batch)

        def body(c, row):
            eqx_logs.log_stats("row", row + c, stats=("absmax",))
            return c + 1.0, None

        lax.scan(body, 0.0, batch)
        return jnp.sum(x)

    spooled = eqx_logs.spool(f)
    alones = [spooled(xs[i], batches[i])[1] for i in range(3)]  # each lane run alone
    for vmapped in (jax.vmap(spooled), jax.jit(jax.vmap(spooled)), jax.vmap(jax.jit(spooled))):
        _, logs = vmapped(xs, batches)
        for i, alone in enumerate(alones):
            x, batch = np.asarray(xs[i], np.float64), np.asarray(batches[i], np.float64)
            for key in alone:
                assert_close(_lane(logs, i)[key], alone[key], key)
            assert_close(logs["x/mean"][i], [x.mean()])
            assert_close(logs["x/std"][i], [x.std()])
            assert_close(logs["b/mean"][i], [(batch * x).mean()])
            assert_close(logs["b/norm"][i], [np.linalg.norm(batch * x)])
            want = [np.abs(batch[k] + k).max() for k in range(5)]
            assert_close(logs["row/absmax"][i], want)

    # two vmaps outside: lanes of lanes; spool(vmap(f)) still reduces over the batch
    _, logs = jax.vmap(jax.vmap(spooled))(jnp.stack([xs, 2 * xs]), jnp.stack([batches] * 2))
    assert_close(logs["x/mean"][1, 0], [2 * 1.5])
    _, logs = eqx_logs.spool(jax.vmap(f))(xs, batches)
    assert_close(logs["x/mean"], [np.asarray(xs).mean()])

    got = []  # tap under a vmap: one callback per lane, with that lane's statistics
    tapped = eqx_logs.tap(f, callback=lambda logs, steps: got.append(logs.get("x/mean")))
    jax.vmap(tapped)(xs, batches)
    jax.effects_barrier()
    got = [x for x in got if x is not None]
    assert_close(sorted(np.ravel(got)), sorted(np.asarray(xs).mean(axis=1)))


@fast
def test_instrument_and_cotangent_statistics_under_vmap_of_spool_are_per_lane():
    model = eqx_logs.instrument(mlp(), grads=True)
    xs = jax.random.normal(jax.random.key(2), (4, 6, 3))  # 4 runs of a batch of 6

    def loss(model, x):
        return jnp.sum(jax.vmap(model)(x) ** 2)

    spooled = eqx_logs.spool(eqx.filter_grad(loss))
    grads, logs = jax.vmap(spooled, in_axes=(None, 0))(model, xs)
    assert len(logs) == 30  # 3 layers x 5 statistics x (forward, backward)
    for i in range(4):
        want_grads, alone = spooled(model, xs[i])
        assert_close(_lane(grads.layers[0].weight, i), want_grads.layers[0].weight)
        for key in alone:
            assert_close(_lane(logs, i)[key], alone[key], key)
        acts = jax.vmap(lambda x: hand_activations(model, x))(xs[i])
        for layer, act in enumerate(acts):
            assert_close(logs[f"layers[{layer}]/rms"][i], [np_stats(act)["rms"]])


@fast
def test_first_nonfinite_under_vmap_of_spool_reports_each_lane():
    def f(x):
        eqx_logs.log({"x": x})
        eqx_logs.log_stats("s", x * 2, stats=("mean", "nonfinite"))
        return jnp.sum(x)

    xs = jnp.ones((4, 3)).at[3, 1].set(jnp.nan)
    _, logs = jax.vmap(eqx_logs.spool(f, first_nonfinite=True))(xs)
    reports = logs.first_nonfinite
    assert reports[:3] == [None, None, None]
    assert reports[3].key == "x" and reports[3].event == 0
    assert_close(logs["s/nonfinite"], [[0], [0], [0], [1]])
    assert_close(logs["s/mean"][:3], [[2.0]] * 3)

    def g(x):  # only the statistics: each lane reports its own
        eqx_logs.log_stats("s", x, stats=("mean",))
        return 0.0

    _, logs = jax.vmap(jax.vmap(eqx_logs.spool(g, first_nonfinite=True)))(xs.reshape(2, 2, 3))
    reports = logs.first_nonfinite
    assert reports[0] == [None, None] and reports[1][0] is None
    assert reports[1][1].key == "s/mean"


@fast
def test_cotangent_statistics_carry_the_instrument_tag():
    model = eqx_logs.instrument(mlp(), grads=True, stats=("norm",))
    grad = eqx.filter_grad(lambda m, x: jnp.sum(m(x)))
    x = jnp.ones(3)
    forward = {f"layers[{i}]/norm" for i in range(3)}
    backward = {f"layers[{i}]/grad/norm" for i in range(3)}
    _, logs = eqx_logs.spool(grad, tags="instrument")(model, x)
    assert set(logs) == forward | backward
    _, logs = eqx_logs.spool(grad, tags="backward")(model, x)
    assert set(logs) == backward
    _, logs = eqx_logs.spool(grad, exclude="instrument")(model, x)
    assert set(logs) == set()
    _, logs = eqx_logs.spool(grad, exclude="backward")(model, x)
    assert set(logs) == forward

    def log_grad_only(x):  # log_grad's cotangents: tagged "backward" only
        return jnp.sum(eqx_logs.log_grad("g", x) ** 2)

    _, logs = eqx_logs.spool(jax.grad(log_grad_only), tags="backward")(x)
    assert_close(logs["g"], [2 * np.ones(3)])


@fast
def test_first_nonfinite_ignores_a_finite_values_overflowing_norm():
    big = jnp.full((16,), 3e38, jnp.float32)

    def f(x):
        eqx_logs.log_stats("x", x, stats=("norm",))
        return 0.0

    _, logs = eqx_logs.spool(f, first_nonfinite=True)(big)
    assert np.isposinf(logs["x/norm"][0])  # float32 cannot hold 1.2e39
    assert logs.first_nonfinite is None  # every value is finite
    for bad in (jnp.nan, jnp.inf, -jnp.inf):
        _, logs = eqx_logs.spool(f, first_nonfinite=True)(big.at[5].set(bad))
        assert np.isnan(logs["x/norm"][0])
        assert logs.first_nonfinite.key == "x/norm"  # the value is not finite

    linear = eqx.nn.Linear(16, 16, key=jax.random.key(0))
    linear = eqx.tree_at(lambda m: m.weight, linear, jnp.eye(16) * 3e38)
    model = eqx_logs.instrument(eqx.nn.Sequential([linear]), stats=("norm",))
    _, logs = eqx_logs.spool(lambda m, x: m(x), first_nonfinite=True)(model, jnp.ones(16))
    assert np.isposinf(logs["layers[0]/norm"][0])
    assert logs.first_nonfinite is None


def test_statistics_export_with_a_symbolic_batch():
    def f(x):
        eqx_logs.log_stats("x", x, stats=("mean", "norm", "absmax"))
        return jnp.sum(x)

    (b,) = jax.export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, 3), jnp.float32)
    # inside the spool the batch is reduced over; outside it, one statistic per lane
    for fun in (eqx_logs.spool(jax.vmap(f)), jax.vmap(eqx_logs.spool(f))):
        exported = jax.export.export(jax.jit(fun))(spec)
        for size in (1, 4):
            xs = jnp.arange(size * 3.0).reshape(size, 3)
            _, logs = exported.call(xs)
            _, want = fun(xs)
            for key in want:
                assert_close(logs[key], want[key], key)
    _, logs = jax.export.export(jax.jit(eqx_logs.spool(jax.vmap(f))))(spec).call(jnp.ones((4, 3)))
    assert_close(logs["x/norm"], [np.sqrt(12.0)])


# -- statistics in a cond whose predicate a vmap inside the spool batches ------------------
#
# JAX runs every branch for every lane; an untaken branch changes nothing, so a statistic in
# a branch is over the lanes that take it (one value, in each of those lanes' events).

XS = np.array(
    [[1.0, 2.0, 0.5], [-5.0, -7.0, 1.0], [3.0, 4.0, -1.0], [0.5, -9.0, 2.0], [2.0, 2.0, 2.0]],
    np.float32,
)


def _both_branches(x):
    def positive():
        eqx_logs.log_stats("s", x, stats=ALL)

    def negative():
        eqx_logs.log_stats("s", -2 * x, stats=ALL)

    lax.cond(jnp.sum(x) > 0, positive, negative)
    return jnp.sum(x)


def _want_both_branches(xs) -> dict[str, np.ndarray]:
    """Per lane: the statistics, over the lanes that take the same branch, of what it logs."""
    xs = np.asarray(xs, np.float64)
    taken = xs.sum(axis=1) > 0
    pos, neg = np_stats(xs[taken]), np_stats(-2 * xs[~taken])
    return {stat: np.where(taken, pos[stat], neg[stat]) for stat in ALL}


def _assert_both_branches(logs, xs):
    for stat, want in _want_both_branches(xs).items():
        key = f"s/{stat}"
        np.testing.assert_array_equal(np.asarray(logs.count[key]), [1] * len(xs), key)
        assert_close(logs[key], [want], key)


@fast
def test_statistics_in_a_batched_cond_are_over_the_lanes_that_take_each_branch():
    spooled = eqx_logs.spool(jax.vmap(_both_branches))
    _, logs = spooled(XS)
    _assert_both_branches(logs, XS)
    _, jitted = jax.jit(spooled)(XS)
    for key in logs:
        assert_close(jitted[key], logs[key], key)
        np.testing.assert_array_equal(np.asarray(jitted.count[key]), np.asarray(logs.count[key]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_statistics_of_half_precision_in_a_batched_cond(dtype):
    # computed in float32 (with strict dtype promotion, as the whole suite runs)
    xs = jnp.asarray(XS, dtype)
    _, logs = eqx_logs.spool(jax.vmap(_both_branches))(xs)
    for stat in ALL:
        assert logs[f"s/{stat}"].dtype == (jnp.int32 if stat == "nonfinite" else jnp.float32)
    _assert_both_branches(logs, np.asarray(xs, np.float32))
    _, logs = eqx_logs.spool(lambda x: eqx_logs.log_stats("x", x, stats=("rms",)))(xs)
    assert_close(logs["x/rms"], [np_stats(np.asarray(xs, np.float32))["rms"]])


@fast
def test_statistics_in_a_batched_cond_in_a_scan_and_a_batched_while_loop():
    def f(x):
        def body(c, i):
            # lanes with x[0] > i: steps 0, 1, 2 in lane 2, none in lane 1
            lax.cond(
                x[0] > i,
                lambda: eqx_logs.log_stats("s", x + i, stats=("mean", "min", "norm")),
                lambda: None,
            )
            return c, None

        lax.scan(body, 0.0, jnp.arange(3.0))

        def loop(c):
            eqx_logs.log_stats("w", x * c, stats=("mean", "max"))
            return c + 1.0

        lax.while_loop(lambda c: c < jnp.abs(x[0]), loop, 0.0)  # 1, 5, 3, 1, 2 iterations
        return jnp.sum(x)

    for spooled in (
        eqx_logs.spool(jax.vmap(f), reduce=eqx_logs.Stack(capacity=5)),
        jax.jit(eqx_logs.spool(jax.vmap(f), reduce=eqx_logs.Stack(capacity=5))),
    ):
        _, logs = spooled(XS)
        xs = np.asarray(XS, np.float64)
        for key, lanes, value in (
            ("s", lambda i: xs[:, 0] > i, lambda i: xs + i),
            ("w", lambda i: i < np.abs(xs[:, 0]), lambda i: xs * i),
        ):
            steps = range(3) if key == "s" else range(5)
            stats = ("mean", "min", "norm") if key == "s" else ("mean", "max")
            for stat in stats:
                events = [[] for _ in xs]  # per lane, in order
                for i in steps:
                    taking = lanes(i)
                    if taking.any():
                        want = np_stats(value(i)[taking])[stat]
                        for lane in np.flatnonzero(taking):
                            events[lane].append(want)
                got = np.asarray(logs[f"{key}/{stat}"])
                counts = np.ravel(logs.count[f"{key}/{stat}"])
                assert list(counts) == [len(e) for e in events], (key, stat)
                for lane, want in enumerate(events):
                    assert_close(got[: len(want), lane], want, f"{key}/{stat} lane {lane}")


@fast
def test_statistics_in_a_batched_cond_with_vmaps_outside_the_spool():
    # vmap(spool(vmap(f))): each run is spool(vmap(f)) of its batch
    runs = np.stack([XS, 0.5 - XS[::-1]])
    spooled = eqx_logs.spool(jax.vmap(_both_branches))
    _, logs = jax.vmap(spooled)(runs)
    for r in range(2):
        _assert_both_branches(_lane(logs, r), runs[r])

    # vmap(spool(f)): each lane is a run of its own, with the branch it takes
    _, logs = jax.vmap(eqx_logs.spool(_both_branches))(XS)
    for i, x in enumerate(np.asarray(XS, np.float64)):
        want = np_stats(x if x.sum() > 0 else -2 * x)
        for stat in ALL:
            assert_close(logs[f"s/{stat}"][i], [want[stat]], f"s/{stat} lane {i}")

    # an array the vmaps leave unbatched (a weight): its statistics if any lane takes the branch
    w = jnp.array([1.0, -3.0, 2.5])

    def g(x, w):
        lax.cond(
            jnp.sum(x) > 0, lambda: eqx_logs.log_stats("w", w, stats=("mean", "norm")), lambda: None
        )
        return x

    want = np_stats(w, ("mean", "norm"))
    taken = np.asarray(XS).sum(axis=1) > 0
    _, inside = eqx_logs.spool(jax.vmap(g, in_axes=(0, None)))(XS, w)
    _, outside = jax.vmap(eqx_logs.spool(g), in_axes=(0, None))(XS, w)
    _, both = jax.vmap(eqx_logs.spool(jax.vmap(g, in_axes=(0, None))), in_axes=(0, None))(runs, w)
    for stat in ("mean", "norm"):
        key = f"w/{stat}"
        np.testing.assert_array_equal(np.ravel(inside.count[key]), taken)
        assert_close(np.ravel(inside[key])[taken], [want[stat]] * taken.sum(), key)
        np.testing.assert_array_equal(np.ravel(outside.count[key]), taken)
        assert_close(np.ravel(outside[key])[taken], [want[stat]] * taken.sum(), key)
        for r in range(2):
            taken_r = runs[r].sum(axis=1) > 0
            np.testing.assert_array_equal(np.ravel(both.count[key][r]), taken_r)
            assert_close(np.ravel(both[key][r])[taken_r], [want[stat]] * taken_r.sum(), key)


@fast
def test_a_numpy_weight_in_a_batched_cond_under_vmaps_inside_and_outside():
    # a numpy array that the vmaps leave unbatched (in_axes=None), its statistics and a value
    # computed from it, in a batched cond: before, the spool staged it as it was, and JAX
    # refused it (AssertionError: non-canonical constant of type ndarray)
    runs = np.stack([XS, 0.5 - XS[::-1]])
    w = np.array([1.0, -3.0, 2.5], np.float32)

    def g(x, w):
        def take():
            eqx_logs.log_stats("w", w, stats=("mean", "norm"))
            eqx_logs.log("wx", jnp.sum(w * x))

        lax.cond(jnp.sum(x) > 0, take, lambda: None)
        return x

    spooled = eqx_logs.spool(jax.vmap(g, in_axes=(0, None)))
    for _, logs in (
        jax.vmap(spooled, in_axes=(0, None))(runs, w),
        jax.jit(jax.vmap(spooled, in_axes=(0, None)))(runs, w),
    ):
        want = np_stats(w, ("mean", "norm"))
        for r in range(2):
            taken = runs[r].sum(axis=1) > 0
            for key in ("w/mean", "w/norm", "wx"):
                np.testing.assert_array_equal(np.ravel(logs.count[key][r]), taken, key)
            for stat in ("mean", "norm"):
                got = np.ravel(logs[f"w/{stat}"][r])[taken]
                assert_close(got, [want[stat]] * taken.sum(), stat)
            wx = np.asarray(runs[r], np.float64) @ np.asarray(w, np.float64)
            assert_close(np.ravel(logs["wx"][r])[taken], wx[taken], "wx")


@fast
def test_statistics_in_a_batched_cond_no_lane_takes_and_first_nonfinite():
    def f(x):
        take = lambda: eqx_logs.log_stats("s", x, stats=("mean", "nonfinite"))  # noqa: E731
        lax.cond(x[1] > 0, take, lambda: None)  # lanes 0, 2 and 4
        return jnp.sum(x)

    # no lane takes the branch: as a key with no events
    _, none = eqx_logs.spool(jax.vmap(f))(-np.abs(XS))
    _, alone = eqx_logs.spool(f)(-np.abs(XS[0]))
    for key in ("s/mean", "s/nonfinite"):
        np.testing.assert_array_equal(np.ravel(none.count[key]), [0] * len(XS))
        assert int(alone.count[key]) == 0
        np.testing.assert_array_equal(np.ravel(none[key]), [np.ravel(alone[key])[0]] * len(XS))

    # a NaN in a lane that does not take the branch is in no statistic: nothing to report
    nan_untaken = XS.copy()
    nan_untaken[1, 0] = np.nan
    for spooled in (
        eqx_logs.spool(jax.vmap(f), first_nonfinite=True),
        jax.vmap(eqx_logs.spool(f, first_nonfinite=True)),
    ):
        _, logs = spooled(nan_untaken)
        reports = logs.first_nonfinite
        assert reports is None or reports == [None] * len(XS), reports
        taken = [0, 2, 4]
        np.testing.assert_array_equal(np.ravel(logs.count["s/mean"]), [1, 0, 1, 0, 1])
        np.testing.assert_array_equal(np.ravel(logs["s/nonfinite"])[taken], [0, 0, 0])
    _, logs = eqx_logs.spool(jax.vmap(f), first_nonfinite=True)(nan_untaken)
    assert_close(np.ravel(logs["s/mean"])[taken], [XS[taken].mean()] * 3)

    # in a lane that takes it: the statistic over the lanes that take it is NaN, in each of
    # their events; the report names the first
    nan_taken = XS.copy()
    nan_taken[2, 0] = np.nan
    _, logs = eqx_logs.spool(jax.vmap(f), first_nonfinite=True)(nan_taken)
    np.testing.assert_array_equal(np.ravel(logs["s/nonfinite"])[taken], [1, 1, 1])
    assert logs.first_nonfinite.key == "s/mean"
    assert logs.first_nonfinite.lane == 0 and logs.first_nonfinite.event == 0


@fast
def test_instrument_in_a_batched_cond_is_over_the_lanes_that_take_it():
    model = eqx_logs.instrument(mlp(), stats=("mean", "rms", "min", "max"))

    def f(model, x):
        return lax.cond(jnp.sum(x) > 0, lambda: model(x), lambda: jnp.zeros(2))

    taken = XS.sum(axis=1) > 0
    acts = jax.vmap(lambda x: hand_activations(model, x))(XS[taken])
    for spooled in (eqx_logs.spool, lambda f: eqx.filter_jit(eqx_logs.spool(f))):
        _, logs = spooled(jax.vmap(f, in_axes=(None, 0)))(model, XS)
        assert len(logs) == 12  # 3 layers x 4 statistics
        for layer, act in enumerate(acts):
            want = np_stats(act)
            for stat in ("mean", "rms", "min", "max"):
                key = f"layers[{layer}]/{stat}"
                np.testing.assert_array_equal(np.ravel(logs.count[key]), taken, key)
                assert_close(np.ravel(logs[key])[taken], [want[stat]] * taken.sum(), key)


def _hand_cotangents(model: eqx.nn.MLP, x, loss_of_output):
    """Each layer's output's cotangent for one example (an additive perturbation of each
    output, differentiated at zero), by `jax.vjp` of the plain model."""

    def perturbed(eps):
        h = x
        for i, layer in enumerate(model.layers):
            h = layer(h) + eps[i]
            if i < len(model.layers) - 1:
                h = model.activation(h)
        return loss_of_output(h)

    eps = [jnp.zeros(layer.out_features) for layer in model.layers]
    return jax.vjp(perturbed, eps)[1](jnp.ones(()))[0]


@fast
@pytest.mark.parametrize("order", ["grad(vmap)", "vmap(grad)"])
def test_cotangent_statistics_in_a_batched_cond_are_over_the_lanes_that_take_it(order):
    # instrument(grads=True) in a cond whose predicate a vmap inside the spool batches: the
    # backward statistics are over the lanes that take the branch, as the forward ones are.
    # Under grad(vmap(...)) JAX transposes the custom_vjp after the vmap batched the cond, so
    # its backward rule saw no mask (before: over every lane, zeros of the others included,
    # one event per call)
    plain = mlp()
    model = eqx_logs.instrument(plain, stats=("mean", "rms", "min", "max"), grads=True)

    def out(h):
        return jnp.sum(jnp.sin(h) ** 2)

    def f(model, x):
        return out(lax.cond(jnp.sum(x) > 0, lambda: model(x), lambda: jnp.zeros(2)))

    if order == "grad(vmap)":
        step = eqx.filter_grad(lambda m, xs: jnp.sum(jax.vmap(f, in_axes=(None, 0))(m, xs)))
    else:
        step = jax.vmap(eqx.filter_grad(f), in_axes=(None, 0))
    _, logs = eqx_logs.spool(step)(model, XS)
    taken = XS.sum(axis=1) > 0
    cts = [_hand_cotangents(plain, x, out) for x in XS[taken]]
    for layer in range(3):
        want = np_stats(np.stack([ct[layer] for ct in cts]), ("mean", "rms", "min", "max"))
        for stat, value in want.items():
            key = f"layers[{layer}]/grad/{stat}"
            np.testing.assert_array_equal(np.ravel(logs.count[key]), taken, key)
            assert_close(np.ravel(logs[key])[taken], [value] * taken.sum(), key)


@fast
@pytest.mark.parametrize("order", ["grad(vmap)", "vmap(grad)"])
def test_log_grad_in_a_batched_cond_logs_the_lanes_that_take_it(order):
    w = jnp.array([0.5, 2.0, -1.0])

    def f(w, x):
        def branch(x):
            return jnp.sum(eqx_logs.log_grad("dh", jnp.tanh(w * x)) ** 2)

        return lax.cond(x[0] > 0, branch, jnp.sum, x)

    if order == "grad(vmap)":
        step = jax.grad(lambda w, xs: jnp.sum(jax.vmap(f, in_axes=(None, 0))(w, xs)))
    else:
        step = jax.vmap(jax.grad(f), in_axes=(None, 0))
    _, logs = eqx_logs.spool(step)(w, XS)
    taken = XS[:, 0] > 0
    np.testing.assert_array_equal(np.ravel(logs.count["dh"]), taken)
    want = 2 * np.tanh(np.asarray(w, np.float64) * XS[taken])  # d sum(h**2) / dh
    assert_close(np.asarray(logs["dh"])[0][taken], want)


def test_masked_statistics_batching_keeps_the_mask_with_its_axes():
    """`stats_p`'s mask operand, batched along any axis, with the array batched along any
    axis, or not at all: inside the spool (`lanes=None`) and outside it (`lanes=0`)."""
    from eqx_logs._stats import stats_p

    def bind(x, mask, lanes):
        return jnp.stack(
            [s.astype(jnp.float32) for s in stats_p.bind(x, mask, stats=ALL, lanes=lanes, nbatch=0)]
        )

    def want(x, mask=None):  # the statistics of the kept elements; of none: 0
        x = np.asarray(x, np.float64) if mask is None else np.asarray(x, np.float64)[mask]
        return np.zeros(len(ALL)) if x.size == 0 else np.array(list(np_stats(x).values()))

    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 3, 5)).astype(np.float32)  # 4 lanes of (3, 5)
    lanes = np.array([True, False, True, False])
    rows = rng.random((4, 3)) > 0.4  # per lane and row
    for d in range(3):
        xd = np.moveaxis(x, 0, d)
        for mask in (lanes, rows):
            inside = jax.vmap(partial(bind, lanes=None), in_axes=(d, 0), out_axes=None)(xd, mask)
            assert_close(inside, want(x, mask), f"inside, axis {d}")
        outside = jax.vmap(partial(bind, lanes=0), in_axes=(d, 0))(xd, rows)
        for i in range(4):
            assert_close(outside[i], want(x[i], rows[i]), f"outside, axis {d}, lane {i}")
        # two vmaps: over rows (at `d_row`), then over lanes, the mask batched by the second
        for d_row in range(2):

            def over_rows(x, m, lanes, d_row=d_row):
                rows_first = x if d_row == 0 else x.T
                out_axes = None if lanes is None else 0
                fun = partial(bind, mask=m, lanes=lanes)
                return jax.vmap(fun, in_axes=d_row, out_axes=out_axes)(rows_first)

            got = jax.vmap(partial(over_rows, lanes=None), in_axes=(d, 0), out_axes=None)(xd, lanes)
            assert_close(got, want(x, lanes), f"two inside, axes {d}, {d_row}")
            got = jax.vmap(partial(over_rows, lanes=0), in_axes=(d, 0))(xd, lanes)
            for i, r in np.ndindex(4, 3):
                assert_close(got[i, r], want(x[i, r], lanes[i]), f"two outside, {d}, {d_row}")
    # the array the same in every lane, the mask batched
    got = jax.vmap(lambda m: bind(x[0], m, None), out_axes=None)(lanes)
    assert_close(got, want(x[0]))
    got = jax.vmap(lambda m: bind(x[0], m, 0))(rows)
    for i in range(4):
        assert_close(got[i], want(x[0], rows[i]), f"unbatched array, lane {i}")
