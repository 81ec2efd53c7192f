"""plant with functions (`plant(f, {key: fn})`), `eqx_logs.at` (some events only, by their
index) and plant at `instrument`'s paths: each against the same program written by hand (the
model edited, the event index counted by hand), under jit, vmap (inside and outside) and grad.
"""

from typing import TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax import lax
from jax.sharding import PartitionSpec as P

import eqx_logs

fast = pytest.mark.fast  # in `make test-fast`: the quicker half

W = 4  # the width of the toy models


def _tree_close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_close(g, w)


# -- a function planted at a sown key --------------------------------------------------------


class Sown(eqx.Module):
    layers: list

    def __call__(self, x):
        for i, layer in enumerate(self.layers):
            x = eqx_logs.sow(f"h{i}", jnp.tanh(layer(x)))
        return x


def _sown_model():
    keys = jax.random.split(jax.random.key(0), 3)
    return Sown([eqx.nn.Linear(W, W, key=k) for k in keys])


def _sown_by_hand(model, x, fn):
    """`model(x)` with layer 1's output replaced by `fn` of it, written out."""
    for i, layer in enumerate(model.layers):
        x = jnp.tanh(layer(x))
        if i == 1:
            x = fn(x)
    return x


def test_a_planted_function_matches_the_model_edited_by_hand():
    model = _sown_model()
    shift = jnp.array([0.5, -0.25, 0.0, 1.0])  # one example's shape: fn sees one example
    calls = []

    def fn(h):
        calls.append(h.shape)
        return jnp.sin(3 * h) + shift

    x = jnp.linspace(-1, 1, W)
    xs = jax.random.normal(jax.random.key(1), (5, W))
    planted = eqx_logs.plant(model, {"h1": fn})
    want = _sown_by_hand(model, x, fn)
    calls.clear()
    assert_close(planted(x), want)
    assert calls == [(W,)]  # called once, where the value is sown
    assert_close(jax.jit(planted)(x), want)
    batch = jax.jit(jax.vmap(lambda x: _sown_by_hand(model, x, fn)))(xs)
    assert_close(jax.jit(jax.vmap(planted))(xs), batch)  # vmap outside
    inside = eqx_logs.plant(lambda xs: jax.vmap(model)(xs), {"h1": fn})
    calls.clear()
    assert_close(inside(xs), batch)  # vmap inside: fn is called on one example
    assert calls == [(W,)]

    # gradients: through fn, and into fn from the sown value
    def loss(y):
        return jnp.sum(y**2)

    g = jax.jit(jax.grad(lambda x: loss(planted(x))))(x)
    assert_close(g, jax.jit(jax.grad(lambda x: loss(_sown_by_hand(model, x, fn))))(x))
    assert np.abs(g).max() > 1e-3
    g = eqx.filter_jit(eqx.filter_grad(lambda m: loss(eqx_logs.plant(m, {"h1": fn})(x))))(model)
    by_hand = eqx.filter_jit(eqx.filter_grad(lambda m: loss(_sown_by_hand(m, x, fn))))
    _tree_close(g, by_hand(model))

    # a function closing over a traced value: differentiable with respect to it
    def scaled(s):
        return eqx_logs.plant(model, {"h1": lambda h: h * s})(x)

    s = jnp.float32(1.5)
    g = jax.jit(jax.grad(lambda s: loss(scaled(s))))(s)
    by_hand = jax.jit(jax.grad(lambda s: loss(_sown_by_hand(model, x, lambda h: h * s))))
    assert_close(g, by_hand(s))

    # a spool outside records the planted value, and what follows from it
    out, logs = eqx_logs.spool(planted)(x)
    h1 = jax.jit(lambda x: fn(jnp.tanh(model.layers[1](jnp.tanh(model.layers[0](x))))))(x)
    assert_close(logs["h1"], [h1])
    assert_close(logs["h2"], [want])


def _close6(got, want, what: str = "output"):
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=what)


def test_a_derivative_inside_the_plant_is_that_of_what_is_planted():
    """`plant(jax.grad(f), values)` (it raised, and before that was silently the sown value's
    derivative): a planted value has a zero derivative, a planted function `fn` that of `fn`
    at the sown value. To 1e-6 of the model edited by hand, in reverse mode inside and
    outside the plant, in forward mode (`jax.jacfwd`) and under a vmap inside; `fn`'s logs are
    its call's alone."""
    model = _sown_model()
    x = jnp.linspace(-1, 1, W)
    xs = jax.random.normal(jax.random.key(1), (3, W))
    v = jnp.array([0.5, -0.25, 0.0, 1.0])
    cases = {
        "value": (v, lambda h: v),
        "linear": (lambda h: 2 * h, lambda h: 2 * h),
        "nonlinear": (lambda h: jnp.sin(3 * h) + v, lambda h: jnp.sin(3 * h) + v),
    }

    def loss(x):  # (x enters beyond the sown value too)
        return jnp.sum(jnp.sin(model(x)) * x)

    def edited(fn):
        return lambda x: jnp.sum(jnp.sin(_sown_by_hand(model, x, fn)) * x)

    @jax.jit
    def by_hand(x, xs):  # (one program: the references)
        refs = {}
        for name, (_, fn) in cases.items():
            g = jax.grad(edited(fn))
            refs[name] = g(x), jax.jacfwd(edited(fn))(x), jax.vmap(g)(xs)
        return refs, jax.grad(loss)(x)

    refs, unplanted = by_hand(x, xs)
    for name, (planted, _) in cases.items():
        grad, jac, batch = refs[name]
        values = {"h1": planted}
        got = eqx_logs.plant(jax.grad(loss), values)(x)
        _close6(got, grad, f"{name}: jax.grad inside")
        assert np.abs(np.asarray(got - unplanted)).max() > 1e-2  # (the plant changes it)
        if name == "linear":  # (the rest for the two others)
            continue
        _close6(jax.grad(eqx_logs.plant(loss, values))(x), grad, f"{name}: jax.grad outside")
        _close6(eqx_logs.plant(jax.jacfwd(loss), values)(x), jac, f"{name}: jax.jacfwd inside")
        if callable(planted):  # (a value planted under a vmap inside has the batch's shape)
            got = eqx_logs.plant(jax.vmap(jax.grad(loss)), values)(xs)
            _close6(got, batch, f"{name}: under a vmap inside")

    # a pytree with an integer leaf (no tangent), which the planted function changes too
    def sows_a_pytree(x):
        h = eqx_logs.sow("h", {"a": jnp.tanh(x), "n": jnp.int32(3)})
        return jnp.sum(jnp.sin(h["a"]) * x) * h["n"].astype(jnp.float32)

    def bumped(h):
        return {"a": jnp.sin(3 * h["a"]) + v, "n": h["n"] + 1}

    got = eqx_logs.plant(jax.grad(sows_a_pytree), {"h": bumped})(x)
    _close6(got, jax.grad(lambda x: 4 * jnp.sum(jnp.sin(jnp.sin(3 * jnp.tanh(x)) + v) * x))(x))

    # through a checkpoint, whose backward pass computes the sown value again (no event
    # there: what is planted must then be the same for every event)
    for name in ("value", "nonlinear"):
        got = eqx_logs.plant(jax.grad(eqx.filter_checkpoint(loss)), {"h1": cases[name][0]})(x)
        _close6(got, refs[name][0], f"{name}: through a checkpoint")
    with pytest.raises(ValueError, match=r"'h1' .* is planted by event .* `jax.checkpoint`"):
        eqx_logs.plant(jax.grad(jax.checkpoint(loss)), {"h1": eqx_logs.at(0, jnp.sin)})(x)

    # a planted function that logs: its call's event only, the planted value
    def fn(h):
        eqx_logs.log("fn", h)
        return jnp.sin(3 * h) + v

    got, logs = eqx_logs.spool(eqx_logs.plant(jax.grad(loss), {"h1": fn}))(x)
    _close6(got, refs["nonlinear"][0])
    assert logs["fn"].shape == (1, W)
    _close6(logs["h1"][0], jnp.sin(3 * logs["fn"][0]) + v)


def test_flax_stateful_example_planted_and_differentiated_inside():
    """Flax's own `test_stateful_example` (tests/nnx/integration_test.py: a Linear that
    counts its calls, one SGD step under `nnx.jit`), its Linear sowing `y_mean` (the mean of
    its output, which it subtracts), its step taking `nnx.value_and_grad`, planted:
    `plant(train_step, {"y_mean": jnp.float32(0.0)})` raised "differentiated inside the
    planted function". Against the Linear edited by hand (the sow replaced in its code), a
    value and a function planted, the derivative taken inside the plant and outside it."""
    nnx = pytest.importorskip("flax.nnx")
    A = TypeVar("A")

    class State(nnx.Variable[A]):
        pass

    class Linear(nnx.Module):
        def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
            key = rngs.params()
            self.w = nnx.Param(jax.random.uniform(key, (din, dout)))
            self.b = nnx.Param(jnp.zeros((dout,)))
            self.count = State(jnp.array(0))

        def __call__(self, x):
            self.count[...] += 1
            y = x @ self.w + self.b[None]
            return y - self.centre(y)

        def centre(self, y):
            return eqx_logs.sow("y_mean", jnp.mean(y))

    def edited(fn):
        class Edited(Linear):
            def centre(self, y):
                return fn(jnp.mean(y))

        return Edited

    def loss_fn(model, x, y):
        y_pred = model(x)
        return jax.numpy.mean((y_pred - y) ** 2)

    @nnx.jit
    def train_step(model, x, y):
        # compute gradient
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        # SGD update
        nnx.update(
            model,
            jax.tree.map(lambda w, g: w - 0.1 * g, nnx.state(model, nnx.Param), grads),
        )
        return loss, grads

    x = jnp.ones((8, 12))
    y = Linear(din=12, dout=2, rngs=nnx.Rngs(0))(x)  # the forward pass: the step's target
    for planted, fn in [
        (jnp.float32(0.0), lambda m: jnp.float32(0.0)),
        (lambda m: jnp.sin(m) + m**2, lambda m: jnp.sin(m) + m**2),
    ]:
        model, by_hand = Linear(12, 2, rngs=nnx.Rngs(0)), edited(fn)(12, 2, rngs=nnx.Rngs(0))
        model(x)
        by_hand(x)
        assert model.count[...] == 1
        # inside the plant
        loss, grads = eqx_logs.plant(train_step, {"y_mean": planted})(model, x, y)
        want_loss, want_grads = train_step(by_hand, x, y)
        assert model.count[...] == 2
        _close6(loss, want_loss, "loss")
        assert np.abs(np.asarray(want_grads["w"][...])).max() > 1.0  # (a step that moves)
        _tree_close6(grads, want_grads)
        _tree_close6(nnx.state(model), nnx.state(by_hand))
        # outside it
        loss, grads = nnx.value_and_grad(eqx_logs.plant(loss_fn, {"y_mean": planted}))(model, x, y)
        want_loss, want_grads = nnx.value_and_grad(loss_fn)(by_hand, x, y)
        _close6(loss, want_loss, "loss outside")
        _tree_close6(grads, want_grads)


def _tree_close6(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _close6(g, w)


@fast
def test_a_planted_function_must_keep_the_shape_and_dtype():
    model = _sown_model()
    x = jnp.ones(W)
    with pytest.raises(
        ValueError,
        match=r"function planted at 'h1' returned float32\[2\], but 'h1' is sown as "
        r"float32\[4\] \(at .*test_plant.py:\d+ \(__call__\)\)",
    ):
        eqx_logs.plant(model, {"h1": lambda h: h[:2]})(x)
    with pytest.raises(ValueError, match=r"returned int32\[4\], but 'h1' is sown as float32"):
        eqx_logs.plant(model, {"h1": lambda h: h.astype(jnp.int32)})(x)
    with pytest.raises(ValueError, match=r"called on one example: the shapes above"):
        eqx_logs.plant(lambda xs: jax.vmap(model)(xs), {"h1": lambda h: h[:2]})(jnp.ones((3, W)))
    # a second derivative inside the plant is not given: refused, naming the way out
    with pytest.raises(ValueError, match=r"'h1' is planted, and differentiated twice inside"):
        eqx_logs.plant(jax.hessian(lambda x: jnp.sum(model(x))), {"h1": jnp.sin})(x)
    grad = jax.grad(lambda x: jnp.sum(model(x)))  # (nothing planted: as it is)
    assert_close(eqx_logs.plant(grad, {})(x), jax.jit(grad)(x))
    with pytest.raises(ValueError, match=r"'h1' \(at .*test_plant.py:\d+ .* consumed by a spool"):
        eqx_logs.plant(eqx_logs.spool(model), {"h1": jnp.sin})(x)
    with pytest.raises(TypeError, match=r"at\(index, replacement\): index is an event's index"):
        eqx_logs.at(1.5, jnp.sin)
    with pytest.raises(ValueError, match="index .* is negative"):
        eqx_logs.at(-1, jnp.sin)


# -- plant at instrument's paths -------------------------------------------------------------


def _mlp():
    return eqx.nn.MLP(3, 2, 8, 2, activation=jnp.tanh, key=jax.random.key(0))


def _mlp_by_hand(model: eqx.nn.MLP, x, patch: dict):
    """An eqx.nn.MLP's forward pass (one example), layer `i`'s output replaced by
    `patch[i]` of it."""
    last = len(model.layers) - 1
    for i, layer in enumerate(model.layers):
        x = layer(x)
        if i in patch:
            x = patch[i](x)
        if i < last:
            x = model.activation(x)
    return x


def _ablate(h):
    return h.at[:4].set(0.0) * 2  # half the units off, the others doubled


def test_plant_at_instrument_paths_matches_the_model_edited_by_hand():
    model = _mlp()
    im = eqx_logs.instrument(model, stats=("mean", "rms"), grads=True)
    x = jnp.array([0.5, -1.0, 2.0])
    xs = jax.random.normal(jax.random.key(1), (6, 3))

    planted = eqx_logs.plant(im, {"layers[1]": _ablate})
    patch = {1: _ablate}

    def loss(y):
        return jnp.sum(jnp.sin(y) ** 2)

    @eqx.filter_jit
    def by_hand(model, x, xs):  # (one program: the references)
        out = _mlp_by_hand(model, x, patch)
        batch = jax.vmap(lambda x: _mlp_by_hand(model, x, patch))(xs)
        grads = eqx.filter_grad(lambda m: loss(_mlp_by_hand(m, x, patch)))(model)
        h0 = jax.vmap(model.layers[0])(xs)
        h1 = jax.vmap(_ablate)(jax.vmap(model.layers[1])(jnp.tanh(h0)))
        ct = jax.grad(lambda h: loss(jax.vmap(model.layers[2])(jnp.tanh(h))))(h1)
        return out, model(x), batch, grads, h0, h1, ct

    want, unpatched, batch, want_grads, h0, h1, ct = by_hand(model, x, xs)
    assert_close(planted(x), want)
    assert np.abs(np.asarray(want - unpatched)).max() > 1e-2  # (the patch changes something)
    assert_close(jax.jit(planted)(x), want)
    assert_close(jax.jit(jax.vmap(planted))(xs), batch)
    assert_close(eqx_logs.plant(lambda xs: jax.vmap(im)(xs), {"layers[1]": _ablate})(xs), batch)

    # gradients with respect to the model's weights, through the patch
    g = eqx.filter_jit(
        eqx.filter_grad(lambda m: loss(eqx_logs.plant(m, {"layers[1]": _ablate})(x)))
    )(im)
    _tree_close(g, want_grads)
    # and inside the plant
    inside = eqx.filter_grad(lambda m, x: loss(m(x)))
    _tree_close(eqx_logs.plant(inside, {"layers[1]": _ablate})(im, x), want_grads)

    # the statistics are those of the planted value (and of its cotangent), over the batch
    def batch_loss(m, xs):
        return loss(jax.vmap(eqx_logs.plant(m, {"layers[1]": _ablate}))(xs))

    _, logs = eqx_logs.spool(eqx.filter_grad(batch_loss))(im, xs)
    h0, h1, ct = (np.asarray(a, np.float64) for a in (h0, h1, ct))
    assert_close(logs["layers[0]/mean"], [np.mean(h0)])
    assert_close(logs["layers[1]/mean"], [np.mean(h1)])
    assert_close(logs["layers[1]/rms"], [np.sqrt(np.mean(np.square(h1)))])
    assert_close(logs["layers[1]/grad/rms"], [np.sqrt(np.mean(np.square(ct)))])
    assert {k.split("/")[0] for k in logs} == {"layers[0]", "layers[1]", "layers[2]"}
    assert "layers[1]" not in logs  # the sown output is the plant's alone
    # per lane under a vmap outside the spool
    _, logs = jax.vmap(eqx_logs.spool(planted))(xs)
    assert_close(logs["layers[1]/mean"][:, 0], np.mean(h1, axis=1))

    # outside any plant, no instrumented submodule sows
    assert "eqx_logs.sow" not in str(jax.make_jaxpr(eqx_logs.spool(im))(x))
    assert "eqx_logs.sow" not in str(jax.make_jaxpr(eqx_logs.plant(im, {}))(x))


def test_plant_arrays_at_instrument_paths_and_a_function_that_logs():
    model = _mlp()
    im = eqx_logs.instrument(model, stats=("mean",))
    xa = jax.random.normal(jax.random.key(2), (4, 3))
    xb = jax.random.normal(jax.random.key(3), (4, 3))

    def batched(m, xs):
        return jax.vmap(m)(xs)

    # a function may log: here, to read layers[0]'s output on xb (rows: events, batch, ...)
    def record(h):
        eqx_logs.log("h0", h)
        return h

    v = jnp.linspace(-1.0, 1.0, 8)

    @eqx.filter_jit
    def by_hand(model, xa, xb):
        return (
            jax.vmap(model.layers[0])(xb),
            jax.vmap(model)(xb),
            _mlp_by_hand(model, xa[0], {1: lambda h: v}),
            _mlp_by_hand(model, xa[0], {0: jnp.cos, 1: _ablate}),
        )

    h0, out_b, with_v, nested = by_hand(model, xa, xb)
    _, logs = eqx_logs.spool(eqx_logs.plant(batched, {"layers[0]": record}))(im, xb)
    assert logs["h0"].shape == (1, 4, 8)
    assert_close(logs["h0"][0], h0)
    # planted on xa, one row per event: layers[0] as on xb, so the output is xb's
    got = eqx_logs.plant(batched, {"layers[0]": logs["h0"]})(im, xa)
    assert_close(got, out_b)
    # one value for every event
    assert_close(eqx_logs.plant(im, {"layers[1]": v})(xa[0]), with_v)

    # nested plants, a spool between them, scopes
    def scoped(m, x):
        with eqx_logs.scope("enc"):
            return eqx_logs.spool(eqx.filter_checkpoint(m))(x)[0]

    inner = eqx_logs.plant(scoped, {"enc/layers[0]": jnp.cos})
    assert_close(eqx_logs.plant(inner, {"enc/layers[1]": _ablate})(im, xa[0]), nested)

    # a tap sees the statistics, not the sown outputs
    seen = []
    tapped = eqx_logs.tap(
        eqx_logs.plant(im, {"layers[1]": _ablate}),
        callback=lambda logs, _: seen.append(sorted(logs)),
    )
    tapped(xa[0])
    jax.effects_barrier()
    assert seen == [["layers[0]/mean"], ["layers[1]/mean"], ["layers[2]/mean"]]


@fast
def test_plant_at_an_unknown_path_names_the_paths():
    im = eqx_logs.instrument(_mlp(), where="layers[*]")
    with pytest.raises(
        ValueError,
        match=r"'layers\[5\]' is not sown in MLP; the keys sown there are \[\]; the paths of "
        r"its instrumented submodules are \['layers\[0\]', 'layers\[1\]', 'layers\[2\]'\]\.",
    ):
        eqx_logs.plant(im, {"layers[5]": jnp.sin})(jnp.ones(3))
    with pytest.raises(ValueError, match=r"call the model instrumented \(`eqx_logs.instrument"):
        eqx_logs.plant(_mlp(), {"layers[1]": jnp.sin})(jnp.ones(3))


# -- eqx_logs.at: some events only, by their index -------------------------------------------


class Stacked(eqx.Module):
    layers: eqx.nn.Linear  # stacked with eqx.filter_vmap


N = 5  # layers in the stack


def _stack():
    keys = jax.random.split(jax.random.key(4), N)
    return Stacked(eqx.filter_vmap(lambda k: eqx.nn.Linear(W, W, key=k))(keys))


def _scanned(model, x):
    dynamic, static = eqx.partition(model.layers, eqx.is_array)

    def body(h, d):
        return jnp.tanh(eqx.combine(d, static)(h)), None

    return lax.scan(body, x, dynamic)[0]


def _stack_by_hand(model, x, patch: dict):
    for i in range(N):
        layer = jax.tree.map(lambda a: a[i] if eqx.is_array(a) else a, model.layers)
        h = layer(x)
        x = jnp.tanh(patch[i](h) if i in patch else h)
    return x


def _steer(h):
    return h + jnp.array([1.0, -1.0, 0.5, 0.0])


def test_at_a_layer_of_a_scanned_stack():
    model = _stack()
    im = eqx_logs.instrument(model, stats=("rms",))
    x = jnp.linspace(-1.0, 1.0, W)
    v = jnp.full(W, 0.25)

    def square(h):
        return h * h

    @eqx.filter_jit
    def by_hand(model, x):  # (one program: the references)
        def loss(x):
            return jnp.sum(_stack_by_hand(model, x, {2: square}) ** 2)

        ablated = [_stack_by_hand(model, x, {i: jnp.zeros_like}) for i in range(N)]
        return (
            _stack_by_hand(model, x, {2: _steer}),
            _stack_by_hand(model, x, {1: _steer, 3: _steer}),
            _stack_by_hand(model, x, {4: lambda h: v}),
            jnp.stack(ablated),
            jax.grad(loss)(x),
            jax.grad(lambda x: jnp.sum(_stack_by_hand(model, x, {4: lambda h: v}) ** 2))(x),
        )

    steered, twice, with_v, ablated, grad, const_grad = by_hand(model, x)

    def planted(value):
        return eqx_logs.plant(_scanned, {"layers": value})

    assert_close(planted(eqx_logs.at(2, _steer))(im, x), steered)
    assert_close(jax.jit(planted(eqx_logs.at([1, 3], _steer)))(im, x), twice)
    assert_close(planted(eqx_logs.at(4, v))(im, x), with_v)
    # the index traced: a vmap over which layer to ablate
    assert_close(
        jax.jit(jax.vmap(lambda i: planted(eqx_logs.at(i, jnp.zeros_like))(im, x)))(jnp.arange(N)),
        ablated,
    )
    # gradients through the patched layer only
    g = jax.jit(jax.grad(lambda x: jnp.sum(planted(eqx_logs.at(2, square))(im, x) ** 2)))(x)
    assert_close(g, grad)
    # taken inside the plant: the layer's index is carried from the scan to its transpose
    inside = jax.grad(lambda im, x: jnp.sum(_scanned(im, x) ** 2), argnums=1)
    _close6(eqx_logs.plant(inside, {"layers": eqx_logs.at(2, square)})(im, x), grad)
    _close6(eqx_logs.plant(inside, {"layers": eqx_logs.at(4, v)})(im, x), const_grad)
    # the statistics are of the planted value
    _, logs = eqx_logs.spool(planted(eqx_logs.at(2, jnp.zeros_like)))(im, x)
    assert logs["layers/rms"].shape == (N,)
    assert_close(logs["layers/rms"][2], 0.0)
    assert logs["layers/rms"][1] > 0.05 and logs["layers/rms"][3] > 0.05

    with pytest.raises(ValueError, match=r"'layers' is sown 5 times .* names event 5"):
        planted(eqx_logs.at(5, _steer))(im, x)


def _branchy(x, p):
    """Events of "h": 0 here, 1 in a cond's true branch only, then one per iteration of a
    while loop (3): their indices after the cond depend on the branch taken."""
    h = eqx_logs.sow("h", x)
    h = lax.cond(p > 0, lambda h: eqx_logs.sow("h", 2 * h), lambda h: h - 1, h)

    def body(c):
        i, h = c
        return i + 1, 0.5 * eqx_logs.sow("h", h + 1)

    return lax.while_loop(lambda c: c[0] < 3, body, (0, h))[1]


def _branchy_by_hand(x, p, index, fn):
    """`_branchy` with the `index`-th event of "h" replaced by `fn` of it, counted by hand
    (in numpy)."""
    x = np.asarray(x, np.float64)
    k = 0

    def event(h):
        nonlocal k
        k += 1
        return fn(h) if k - 1 == index else h

    h = event(x)
    h = event(2 * h) if p > 0 else h - 1
    for _ in range(3):
        h = 0.5 * event(h + 1)
    return h


def _cube(h):
    return h**3 - 1


def test_at_counts_events_in_conds_while_loops_and_vmaps():
    x = jnp.array([0.5, -0.25])
    run = jax.jit(lambda x, p, i: eqx_logs.plant(_branchy, {"h": eqx_logs.at(i, _cube)})(x, p))
    for p in (1.0, -1.0):
        for i in range(5):
            want = _branchy_by_hand(x, p, i, _cube)
            assert_close(run(x, jnp.float32(p), jnp.int32(i)), want, f"p={p} event {i}")

    # per lane: a vmap outside whose lanes take different branches (so count differently)
    ps = jnp.array([1.0, -1.0, 1.0, -1.0])
    idx = jnp.array([1, 1, 3, 3])
    xs = jnp.stack([x, 2 * x, -x, x + 1])
    want = [_branchy_by_hand(a, float(p), int(i), _cube) for a, p, i in zip(xs, ps, idx)]
    assert_close(jax.vmap(run)(xs, ps, idx), want)
    # a vmap inside: each lane's events counted apart too
    inside = eqx_logs.plant(jax.vmap(_branchy), {"h": eqx_logs.at(3, _cube)})
    want = [_branchy_by_hand(a, float(p), 3, _cube) for a, p in zip(xs, ps)]
    assert_close(inside(xs, ps), want)
    # and derivatives through the cond that applies the function (forward mode: reverse mode
    # does not go through a while loop), against central differences
    jac = jax.jit(jax.jacfwd(lambda x: run(x, jnp.float32(1.0), jnp.int32(2))))(x)
    eps = 1e-4
    for j in range(2):
        d = np.eye(2)[j] * eps
        up = _branchy_by_hand(np.asarray(x) + d, 1.0, 2, _cube)
        down = _branchy_by_hand(np.asarray(x) - d, 1.0, 2, _cube)
        np.testing.assert_allclose(np.asarray(jac)[:, j], (up - down) / (2 * eps), rtol=1e-3)


def _sown_in_shard_map_scan(x, spec):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dev",))

    def body(x):
        def step(c, _):
            return 2 * eqx_logs.sow("h", c) + 1, None

        return lax.scan(step, x, None, length=3)[0]

    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x)


def _shard_by_hand(x, patch: dict):
    x = np.asarray(x, np.float64)
    for i in range(3):
        x = 2 * (patch[i](x) if i in patch else x) + 1
    return x


def test_at_inside_a_shard_map():
    x = jnp.array([0.5])
    every = dict.fromkeys(range(3), _cube)
    varying = lambda x: _sown_in_shard_map_scan(x, P("dev"))  # noqa: E731
    got = eqx_logs.plant(varying, {"h": eqx_logs.at(1, _cube)})(x)
    assert_close(got, _shard_by_hand(x, {1: _cube}))
    assert_close(eqx_logs.plant(varying, {"h": _cube})(x), _shard_by_hand(x, every))
    # a value that does not vary over the mesh: a function of it is fine, an index is not
    invariant = lambda x: _sown_in_shard_map_scan(x, P())  # noqa: E731
    assert_close(eqx_logs.plant(invariant, {"h": _cube})(x), _shard_by_hand(x, every))
    with pytest.raises(ValueError, match=r"'h' is sown inside a shard_map .* `eqx_logs.at` with"):
        eqx_logs.plant(invariant, {"h": eqx_logs.at(1, _cube)})(x)

    # derivatives inside the plant: each device's event index carried to the backward pass
    def by_hand(x, at):
        for i in range(3):
            x = 2 * (_cube(x) if i in at else x) + 1
        return jnp.sum(x)

    for f, value, at in [(varying, eqx_logs.at(1, _cube), {1}), (invariant, _cube, {0, 1, 2})]:
        got = eqx_logs.plant(jax.grad(lambda x: jnp.sum(f(x))), {"h": value})(x)
        _close6(got, jax.grad(by_hand)(x, at))
