"""`spool(model)`, `tap(model)`, `logger.spool(model, state)` of an Equinox module are pytrees
whose leaves are the model's arrays, as `eqx.filter_jit(model)` is: Equinox's filtered
transformations and `eqx.tree_at` treat them as they treat the model."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import eqx_logs as el
from eqx_logs.loggers import JsonlLogger, read_jsonl

pytestmark = pytest.mark.fast  # in `make test-fast`


class Model(eqx.Module):
    linear: eqx.nn.Linear

    def __call__(self, x):
        y = jnp.tanh(self.linear(x))
        el.log("norm", jnp.linalg.norm(y))
        return jnp.sum(y**2)


def model(key=None):
    key = jax.random.key(0) if key is None else key
    return Model(eqx.nn.Linear(256, 256, key=key))


X = jnp.linspace(-1.0, 1.0, 256)


@pytest.mark.parametrize("wrap", ["spool", "tap"])
def test_leaves_are_the_models_arrays(wrap):
    m = model()
    wrapped = el.spool(m) if wrap == "spool" else el.tap(m, callback=lambda logs, steps: None)
    assert len(jax.tree.leaves(wrapped)) == len(jax.tree.leaves(m)) == 2
    assert eqx.tree_equal(wrapped.__wrapped__, m)
    # filter_jit traces the weights instead of baking them in as constants (and so does not
    # warn about it)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = eqx.filter_jit(wrapped).lower(X).as_text()
        eqx.filter_jit(wrapped)(X)
    assert len(text) < 20_000, len(text)  # a baked-in 256x256 weight is ~500k characters
    # plain jax.jit still takes it, as it took the closure (the weights become constants)
    out = jax.jit(wrapped)(X)
    assert_close(out[0] if wrap == "spool" else out, m(X))


def test_filter_grad_and_tree_at():
    m = model()
    spooled = el.spool(m)
    grads = eqx.filter_grad(lambda s, x: s(x)[0])(spooled, X)
    want = eqx.filter_grad(lambda m, x: m(x))(m, X)
    assert_close(grads.fun.linear.weight, want.linear.weight)
    assert_close(grads.fun.linear.bias, want.linear.bias)
    zeroed = eqx.tree_at(lambda s: s.fun.linear.bias, spooled, jnp.zeros(256))
    out, logs = zeroed(X)
    want_model = eqx.tree_at(lambda m: m.linear.bias, m, jnp.zeros(256))
    assert_close(out, want_model(X))
    y = np.tanh(np.asarray(want_model.linear.weight) @ np.asarray(X))
    assert_close(logs["norm"], [np.linalg.norm(y)])


def test_filter_vmap_over_models():
    keys = jax.random.split(jax.random.key(1), 3)
    spooled = eqx.filter_vmap(lambda k: el.spool(model(k)))(keys)
    out, logs = eqx.filter_vmap(lambda s: s(X))(spooled)
    assert logs["norm"].shape == (3, 1)
    for i, k in enumerate(keys):
        assert_close(out[i], model(k)(X))


def test_spool_of_filter_jit_model():
    m = model()
    out, logs = el.spool(eqx.filter_jit(m))(X)
    assert_close(out, m(X))
    assert logs["norm"].shape == (1,)


def test_decorated_method():
    class Trainer:
        def __init__(self, scale):
            self.scale = scale

        @el.spool(reduce="sum")
        def step(self, x):
            el.log("x", x * self.scale)
            return x + 1

    out, logs = Trainer(3.0).step(jnp.float32(2.0))
    assert_close(out, 3.0)
    assert_close(logs["x"], 6.0)


@pytest.mark.parametrize("kind", ["spool", "tap"])
def test_logger_wrappers(tmp_path, kind):
    m = model()
    with JsonlLogger(str(tmp_path / "logs.jsonl")) as logger:
        state = logger.init()
        wrapped = (logger.spool if kind == "spool" else logger.tap)(m, state)
        arrays = jax.tree.leaves(eqx.filter(wrapped, eqx.is_array))
        assert len(arrays) == len(jax.tree.leaves(m)) + 1  # and the run
        out = eqx.filter_jit(wrapped)(X)
    assert_close(out, m(X))
    (record,) = read_jsonl(tmp_path / "logs.jsonl")
    assert record["key"] == "norm"
