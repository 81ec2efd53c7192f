"""`value_grad_and_norms`: each example's gradient norm from the layers' inputs and output
cotangents, checked against `jax.vmap(jax.grad)` of the one-example loss, which it never
forms; which parameters took the fallback is recorded by wrapping `_per_example._fallback`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_logs
from eqx_logs import _per_example

RTOL = 1e-5


def reference(loss_fn, model, *batch):
    """Each example's gradient norm, total and per parameter path, from `vmap(grad)`."""
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def one(*example):
        return jax.grad(lambda p: loss_fn(eqx.combine(p, static), *example))(params)

    grads = jax.vmap(one)(*batch)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    by_path = {
        jax.tree_util.keystr(p).removeprefix("."): np.sqrt(
            np.sum(np.square(np.asarray(g, np.float64)).reshape(g.shape[0], -1), axis=1)
        )
        for p, g in flat
    }
    total = np.sqrt(sum(v**2 for v in by_path.values()))
    return total, by_path


def mean_value_and_grad(loss_fn, model, *batch):
    def mean(m):
        return jnp.mean(jax.vmap(lambda *ex: loss_fn(m, *ex))(*batch))

    return eqx.filter_value_and_grad(mean)(model)


@pytest.fixture
def fallbacks(monkeypatch):
    """The paths of the parameters each call sent to the fallback."""
    seen = []
    original = _per_example._fallback

    def recording(loss_fn, model, batch, rest, leaves, treedef, chunk_size):
        paths = jax.tree_util.tree_flatten_with_path(model)[0]
        seen.append(sorted(jax.tree_util.keystr(paths[i][0]).removeprefix(".") for i in rest))
        return original(loss_fn, model, batch, rest, leaves, treedef, chunk_size)

    monkeypatch.setattr(_per_example, "_fallback", recording)
    return seen


def check(loss_fn, model, *batch, fallback=(), fallbacks=None, **options):
    """`value_grad_and_norms` against the references; `fallback`: the paths expected to
    take the fallback."""
    loss, grads, norms = eqx_logs.value_grad_and_norms(loss_fn, **options)(model, *batch)
    want_loss, want_grads = mean_value_and_grad(loss_fn, model, *batch)
    total, by_path = reference(loss_fn, model, *batch)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert jax.tree.structure(grads) == jax.tree.structure(want_grads)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-7)
    assert norms.shape == (jax.tree.leaves(batch)[0].shape[0],)
    np.testing.assert_allclose(norms, total, rtol=RTOL)
    _, _, layered = eqx_logs.value_grad_and_norms(loss_fn, by_layer=True, **options)(model, *batch)
    assert sorted(layered) == sorted(by_path)
    for path, want in by_path.items():
        np.testing.assert_allclose(layered[path], want, rtol=RTOL, atol=1e-6, err_msg=path)
    if fallbacks is not None:
        got = sorted({p for call in fallbacks for p in call})
        assert got == sorted(fallback), got
    return norms


def test_mlp(fallbacks):
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (6, 3))
    y = jax.random.normal(jax.random.key(2), (6, 2))

    def loss_fn(m, x, y):
        return jnp.sum((m(x) - y) ** 2)

    check(loss_fn, mlp, x, y, fallbacks=fallbacks)


def test_scalar_features_and_no_bias(fallbacks):
    keys = jax.random.split(jax.random.key(3), 3)
    model = (
        eqx.nn.Linear("scalar", 4, key=keys[0]),
        eqx.nn.Linear(4, "scalar", use_bias=False, key=keys[1]),
    )
    x = jax.random.normal(keys[2], (5,))

    def loss_fn(m, x):
        return jnp.tanh(m[1](jnp.tanh(m[0](x)))) ** 2

    check(loss_fn, model, x, fallbacks=fallbacks)


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP

    def __init__(self, width, heads, key):
        k1, k2 = jax.random.split(key)
        self.ln1 = eqx.nn.LayerNorm(width)
        self.attn = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.ln2 = eqx.nn.LayerNorm(width)
        self.mlp = eqx.nn.MLP(width, width, 2 * width, 1, key=k2)

    def __call__(self, x):  # (tokens, width)
        h = jax.vmap(self.ln1)(x)
        x = x + self.attn(h, h, h)
        return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))


def block_loss(block, x, y):
    return jnp.mean((block(x) - y) ** 2)


def test_transformer_block(fallbacks):
    block = Block(8, 2, jax.random.key(4))
    x = jax.random.normal(jax.random.key(5), (4, 6, 8))
    y = jax.random.normal(jax.random.key(6), (4, 6, 8))
    check(block_loss, block, x, y, fallbacks=fallbacks)  # (the LayerNorms' too)


def test_norm_layers(fallbacks):
    keys = jax.random.split(jax.random.key(22), 4)
    model = (
        eqx.nn.RMSNorm(4),
        eqx.nn.LayerNorm((2, 3), use_bias=False),
        eqx.nn.Linear(6, 4, key=keys[0]),
        eqx.nn.RMSNorm(4, use_weight=False),
    )
    model = eqx.tree_at(
        lambda m: (m[0].weight, m[1].weight),
        model,
        (jax.random.normal(keys[1], (4,)), jax.random.normal(keys[2], (2, 3))),
    )
    x = jax.random.normal(keys[3], (3, 5, 2, 3))

    def loss_fn(m, x):  # (5 tokens of shape (2, 3))
        h = jax.vmap(m[1])(x).reshape(5, 6)
        h = jax.vmap(m[0])(jax.vmap(m[2])(h))
        return jnp.sum(jnp.sin(jax.vmap(m[3])(h)))

    check(loss_fn, model, x, fallbacks=fallbacks)


def test_long_sequence_takes_the_gram_form():
    # 40 tokens, 3 in, 3 out: |X^T G|^2 is the cheaper form; 2 tokens of width 16: the Gram.
    for tokens, width in ((40, 3), (2, 16)):
        lin = eqx.nn.Linear(width, width, key=jax.random.key(7))
        x = jax.random.normal(jax.random.key(8), (3, tokens, width))

        def loss_fn(m, x):
            return jnp.sum(jnp.sin(jax.vmap(m)(x)))

        check(loss_fn, lin, x)


class Tagger(eqx.Module):
    emb: eqx.nn.Embedding
    out: eqx.nn.Linear

    def __call__(self, ids):
        return jax.vmap(self.out)(jax.vmap(self.emb)(ids))


def test_embedding_with_repeated_tokens(fallbacks):
    k1, k2 = jax.random.split(jax.random.key(9))
    model = Tagger(eqx.nn.Embedding(5, 4, key=k1), eqx.nn.Linear(4, 3, key=k2))
    ids = jnp.array([[0, 1, 0, 0, 2, 1], [3, 3, 3, 3, 3, 3], [4, 0, 1, 2, 3, 4]])
    targets = jnp.array([[0, 1, 2, 0, 1, 2], [1, 1, 1, 1, 1, 1], [2, 0, 1, 2, 0, 1]])

    def loss_fn(m, ids, t):
        logits = m(ids)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), t[:, None], 1))

    check(loss_fn, model, ids, targets, fallbacks=fallbacks)


def test_a_layer_called_several_times(fallbacks):
    lin = eqx.nn.Linear(4, 4, key=jax.random.key(10))
    x = jax.random.normal(jax.random.key(11), (5, 3, 4))

    def loss_fn(m, x):
        h = jnp.tanh(jax.vmap(m)(x))  # on every token
        h = jnp.tanh(jax.vmap(m)(h))  # again
        pooled = m(jnp.mean(h, axis=0))  # and on one vector
        return jnp.sum(pooled**2) + jnp.sum(h**2)

    check(loss_fn, lin, x, fallbacks=fallbacks)

    def scanned(m, x):
        def step(h, _):
            return jnp.tanh(m(h)), None

        return jnp.sum(jax.lax.scan(step, x[0], None, length=3)[0] ** 2)

    check(scanned, lin, x, fallbacks=fallbacks)  # (the backward pass runs it in reverse)

    def nested(m, x):
        def inner(h, t):
            return jnp.tanh(m(h) * t), None

        def outer(h, t):
            return jax.lax.scan(inner, h, t)[0], None

        times = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3) / 4.0
        return jnp.sum(jax.lax.scan(outer, x[0], times)[0] ** 2)

    check(nested, lin, x, fallbacks=fallbacks)

    def conditional(m, x):  # called at some iterations only, which differ by example
        def step(h, i):
            h = jax.lax.cond(jnp.sum(x[i]) > 0.0, lambda h: jnp.tanh(m(h)), jnp.cos, h)
            return h, None

        return jnp.sum(jax.lax.scan(step, x[0], jnp.arange(3))[0] ** 2)

    check(conditional, lin, x, fallbacks=fallbacks)


class ConvNet(eqx.Module):
    conv: eqx.nn.Conv1d
    head: eqx.nn.Linear

    def __call__(self, x):
        return self.head(jnp.ravel(jnp.tanh(self.conv(x))))


def test_conv_falls_back_exactly(fallbacks):
    k1, k2, k3 = jax.random.split(jax.random.key(12), 3)
    model = ConvNet(eqx.nn.Conv1d(2, 3, 3, key=k1), eqx.nn.Linear(3 * 6, 2, key=k2))
    x = jax.random.normal(k3, (7, 2, 8))

    def loss_fn(m, x):
        return jnp.sum(m(x) ** 2)

    check(loss_fn, model, x, fallback=("conv.bias", "conv.weight"), fallbacks=fallbacks)
    check(loss_fn, model, x, chunk_size=3)  # (7 examples: a short last chunk)
    check(loss_fn, model, x, chunk_size=None)


def test_a_weight_read_outside_its_call_falls_back(fallbacks):
    mlp = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(13))
    x = jax.random.normal(jax.random.key(14), (4, 3))

    def decayed(m, x):  # an L2 penalty reads every weight
        penalty = sum(jnp.sum(w**2) for w in jax.tree.leaves(eqx.filter(m, eqx.is_array)))
        return jnp.sum(m(x) ** 2) + 0.1 * penalty

    every = ("layers[0].bias", "layers[0].weight", "layers[1].bias", "layers[1].weight")
    check(decayed, mlp, x, fallback=every, fallbacks=fallbacks)
    fallbacks.clear()

    def tied(m, x):  # the last layer's weight also used by hand (a tied output)
        h = m(x)
        return jnp.sum(h**2) + jnp.sum((m.layers[1].weight @ jnp.ones(8)) ** 2)

    check(tied, mlp, x, fallback=("layers[1].bias", "layers[1].weight"), fallbacks=fallbacks)


def test_a_layer_whose_events_are_consumed_falls_back(fallbacks):
    mlp = eqx.nn.MLP(3, 2, 8, 1, key=jax.random.key(15))
    x = jax.random.normal(jax.random.key(16), (4, 3))

    def loss_fn(m, x):  # the user's own spool takes the first layer's events
        h, _ = eqx_logs.spool(m.layers[0])(x)
        return jnp.sum(m.layers[1](jnp.tanh(h)) ** 2)

    check(loss_fn, mlp, x, fallback=("layers[0].bias", "layers[0].weight"), fallbacks=fallbacks)


def test_under_filter_jit_and_a_user_spool():
    block = Block(8, 2, jax.random.key(17))
    x = jax.random.normal(jax.random.key(18), (3, 5, 8))
    y = jax.random.normal(jax.random.key(19), (3, 5, 8))

    def loss_fn(m, x, y):
        loss = block_loss(m, x, y)
        eqx_logs.log("example_loss", loss)
        return loss

    step = eqx.filter_jit(eqx_logs.spool(eqx_logs.value_grad_and_norms(loss_fn)))
    (loss, grads, norms), logs = step(block, x, y)
    total, _ = reference(block_loss, block, x, y)
    np.testing.assert_allclose(norms, total, rtol=RTOL)
    losses = jax.vmap(lambda x, y: block_loss(block, x, y))(x, y)
    assert list(logs) == ["example_loss"]  # (nothing private leaks)
    np.testing.assert_allclose(logs["example_loss"], losses[None], rtol=RTOL)
    np.testing.assert_array_equal(logs.count["example_loss"], np.ones(3, np.int32))
    np.testing.assert_allclose(loss, jnp.mean(losses), rtol=RTOL)


def test_user_logs_once_with_the_fallback_and_regrad():
    k1, k2, k3 = jax.random.split(jax.random.key(26), 3)
    model = ConvNet(eqx.nn.Conv1d(2, 3, 3, key=k1), eqx.nn.Linear(3 * 6, 2, key=k2))
    x = jax.random.normal(k3, (5, 2, 8))

    def plain(m, x):
        return jnp.sum(m(x) ** 2)

    def loss_fn(m, x):  # (the head's events consumed: its gradient taken again, no logs)
        eqx_logs.log("example_loss", plain(m, x))
        h = jnp.ravel(jnp.tanh(m.conv(x)))
        out, _ = eqx_logs.spool(m.head)(h)
        return jnp.sum(out**2)

    (loss, grads, norms), logs = eqx_logs.spool(eqx_logs.value_grad_and_norms(loss_fn))(model, x)
    np.testing.assert_allclose(norms, reference(plain, model, x)[0], rtol=RTOL)
    _, want = mean_value_and_grad(plain, model, x)
    for got, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, w, rtol=RTOL, atol=1e-7)
    assert list(logs) == ["example_loss"]
    losses = jax.vmap(lambda x: plain(model, x))(x)
    np.testing.assert_allclose(logs["example_loss"], losses[None], rtol=RTOL)
    np.testing.assert_array_equal(logs.count["example_loss"], np.ones(5, np.int32))


def test_float64_and_options():
    with jax.enable_x64(True):
        lin = eqx.nn.Linear(3, 2, key=jax.random.key(20), dtype=jnp.float64)
        x = jax.random.normal(jax.random.key(21), (4, 3), jnp.float64)

        def loss_fn(m, x):
            return jnp.sum(jnp.sin(m(x)))

        _, _, norms = eqx_logs.value_grad_and_norms(loss_fn)(lin, x)
        assert norms.dtype == jnp.float64
        np.testing.assert_allclose(norms, reference(loss_fn, lin, x)[0], rtol=1e-12)
    lin = eqx.nn.Linear(3, 2, key=jax.random.key(20))
    with pytest.raises(ValueError, match="chunk_size"):
        eqx_logs.value_grad_and_norms(loss_fn, chunk_size=0)
    with pytest.raises(ValueError, match="scalar for one example"):
        eqx_logs.value_grad_and_norms(lambda m, x: m(x))(lin, jnp.ones((4, 3)))
    decorated = eqx_logs.value_grad_and_norms(by_layer=True)(loss_fn)
    assert sorted(decorated(lin, jnp.ones((4, 3)))[2]) == ["bias", "weight"]


def test_instrument_per_example_norms():
    mlp = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(23))
    model = eqx_logs.instrument(mlp, grads=True, per_example=True)
    x = jax.random.normal(jax.random.key(24), (5, 3))

    def one(m, x):
        return jnp.sum(jnp.sin(m(x)))

    def mean_loss(m, x):
        return jnp.mean(jax.vmap(lambda x: one(m, x))(x))

    grads, logs = eqx_logs.spool(eqx.filter_jit(eqx.filter_grad(mean_loss)))(model, x)
    _, by_path = reference(one, mlp, x)
    for i in range(3):
        key = f"layers[{i}]/grad/per_example_norm"
        assert logs[key].shape == (1, 5)  # (one call, one value per example)
        # (of the mean loss's gradient: each example's own, over the batch size)
        np.testing.assert_allclose(logs[key][0] * 5, by_path[f"layers[{i}].weight"], rtol=RTOL)
        assert f"layers[{i}]/grad/rms" in logs  # (the statistics as before)
    want = eqx.filter_grad(mean_loss)(mlp, x)
    for got, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, w, rtol=RTOL)

    # independent runs (a vmap outside the spool): each its own, as alone
    xs = jnp.stack([x, 2.0 * x])
    _, runs = jax.vmap(lambda x: eqx_logs.spool(eqx.filter_grad(mean_loss))(model, x))(xs)
    _, second = reference(one, mlp, 2.0 * x)
    got = runs["layers[0]/grad/per_example_norm"]
    assert got.shape == (2, 1, 5)
    np.testing.assert_allclose(got[1, 0] * 5, second["layers[0].weight"], rtol=RTOL)


def test_instrument_per_example_refuses_tokens():
    block = eqx_logs.instrument(Block(8, 2, jax.random.key(25)), grads=True, per_example=True)
    x = jnp.ones((2, 3, 8))

    def mean_loss(m, x):
        return jnp.mean(jax.vmap(lambda x: block_loss(m, x, x))(x))

    with pytest.raises(ValueError, match="two jax.vmaps.*value_grad_and_norms"):
        eqx_logs.spool(eqx.filter_grad(mean_loss))(block, x)
    with pytest.raises(ValueError, match="two jax.vmaps"):  # (a jit between: the same)
        eqx_logs.spool(eqx.filter_grad(eqx.filter_jit(mean_loss)))(block, x)
    # outside a spool: the model's program, nothing refused
    grads = eqx.filter_grad(mean_loss)(block, x)
    assert grads.mlp.layers[0].weight.shape == (16, 8)
    with pytest.raises(ValueError, match="no eqx.nn.Linear"):
        eqx_logs.instrument(block, per_example=True, where="ln1")
