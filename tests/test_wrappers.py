"""`spool(model)`, `tap(model)`, `logger.spool(model, state)` of an Equinox module are pytrees
whose leaves are the model's arrays, as `eqx.filter_jit(model)` is: Equinox's filtered
transformations and `eqx.tree_at` treat them as they treat the model."""

import functools
import warnings
from collections.abc import Callable

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


class Named(eqx.Module):
    """A model with a static string field called `name` (issue 24): `eqx.filter_jit` of a
    wrapper of it raised `TypeError: __name__ must be set to a string object`."""

    layers: tuple[eqx.nn.Linear, eqx.nn.Linear]
    name: str = eqx.field(static=True, default="mlp")

    def __call__(self, x):
        h = el.sow("h", jnp.tanh(self.layers[0](x)))
        el.log(f"{self.name}/norm", jnp.linalg.norm(h))
        return jnp.sum(self.layers[1](h))


class NamedInit(eqx.Module):
    """`Named` with a custom `__init__` that leaves the static field at its class default
    (issue 34): Equinox then flattens the module with its wrapper fields, and a copy of it has
    `__name__` set to its `Missing` sentinel; `eqx.filter_jit(spool(model))` raised
    `TypeError: __name__ must be set to a string object` again."""

    layers: tuple[eqx.nn.Linear, eqx.nn.Linear]
    name: str = eqx.field(static=True, default="mlp")

    def __init__(self, layers):
        self.layers = layers

    def __call__(self, x):
        return Named.__call__(self, x)  # pyright: ignore[reportArgumentType]


class ManyStatic(eqx.Module):
    """A custom `__init__` and static fields of several types (str, int, tuple, callable),
    some set, some left at their defaults."""

    layers: tuple[eqx.nn.Linear, eqx.nn.Linear]
    name: str = eqx.field(static=True, default="mlp")
    depth: int = eqx.field(static=True, default=2)
    sizes: tuple[int, ...] = eqx.field(static=True, default=(4, 8, 3))
    activation: Callable = eqx.field(static=True)

    def __init__(self, layers, depth=2, activation=jnp.tanh):
        self.layers = layers
        self.depth = depth
        self.activation = activation

    def __call__(self, x):
        h = el.sow("h", self.activation(self.layers[0](x)))
        el.log(f"{self.name}/norm", jnp.linalg.norm(h))
        return jnp.sum(self.layers[1](h))


MODELS = {"fields": Named, "custom __init__": NamedInit, "many static": ManyStatic}
XN = np.linspace(-1.0, 1.0, 4, dtype=np.float32)
WRAPPERS = ["spool", "tap", "logger.spool", "logger.tap", "logger.jit", "plant", "instrument"]


def _named_reference(m, planted=None):
    """numpy: `m(XN)` (with `h` planted), its events, and its layers' outputs."""
    (w0, b0), (w1, b1) = [(np.asarray(k.weight), np.asarray(k.bias)) for k in m.layers]
    first = w0 @ XN + b0
    h = np.tanh(first) if planted is None else planted
    y = w1 @ h + b1
    return np.sum(y), {"h": h, "mlp/norm": np.linalg.norm(h)}, {"layers[0]": first, "layers[1]": y}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("jit_outside", [True, False], ids=["filter_jit(wrap)", "wrap(filter_jit)"])
@pytest.mark.parametrize("kind", WRAPPERS)
def test_wrappers_of_a_module_with_a_name_field(tmp_path, kind, jit_outside, model):
    k1, k2 = jax.random.split(jax.random.key(2))
    m = MODELS[model]((eqx.nn.Linear(4, 8, key=k1), eqx.nn.Linear(8, 3, key=k2)))
    planted = np.zeros(8, np.float32) if kind == "plant" else None
    want_out, want_logs, layers = _named_reference(m, planted)
    assert_close(m(XN), _named_reference(m)[0])  # the reference is the model's
    tapped, logger = [], JsonlLogger(str(tmp_path / "logs.jsonl"))
    wrap = {
        "spool": el.spool,
        "tap": lambda f: el.tap(f, callback=lambda logs, steps: tapped.append(logs)),
        "logger.spool": lambda f: logger.spool(f, logger.init()),
        "logger.tap": lambda f: logger.tap(f, logger.init()),
        "logger.jit": lambda f: logger.jit(f, logger.init()),
        "plant": lambda f: el.plant(f, {"h": planted}),
        "instrument": lambda f: el.instrument(f, stats=("mean", "rms")),
    }[kind]
    if kind == "instrument" and not jit_outside:
        # eqx.filter_jit keeps the model's arrays as a flat list: no submodule to instrument
        with pytest.raises(TypeError, match=r"layers\[0\].*eqx\.filter_jit\(eqx_logs\.instrument"):
            wrap(eqx.filter_jit(m))
        return
    f = eqx.filter_jit(wrap(m)) if jit_outside else wrap(eqx.filter_jit(m))

    if kind == "spool":
        out, logs = f(XN)
    elif kind in ("plant", "instrument"):
        out, logs = el.spool(f)(XN)
    else:
        out = f(XN)
        logger.close()
        if kind == "tap":
            logs = {k: v for event in tapped for k, v in event.items()}  # one per log call
            assert len(tapped) == 2
        else:
            logs = {r["key"]: np.asarray(r["value"]) for r in read_jsonl(tmp_path / "logs.jsonl")}
    assert_close(out, want_out)
    if kind == "instrument":
        for path, y in layers.items():
            want_logs[f"{path}/mean"], want_logs[f"{path}/rms"] = np.mean(y), np.sqrt(np.mean(y**2))
    assert sorted(logs) == sorted(want_logs)
    for key, want in want_logs.items():
        got = np.asarray(logs[key])
        logged = ("tap", "logger.spool", "logger.tap", "logger.jit")
        assert_close(got if kind in logged else got[0], want, key)

    # named as a function is (through flattening too), so what wraps functions takes it: as
    # `eqx.filter_jit(model)` is (which `filter_jit(instrument(model))` is)
    # (`eqx.filter_jit(m)` of a model with a custom `__init__` is itself named `Missing` by
    # Equinox: `filter_jit(instrument(m))` is that, and callable, which is checked above)
    named = () if kind == "instrument" and model != "fields" else (f,)
    for g in (f, jax.tree.map(lambda x: x, f)) if kind != "instrument" else named:
        assert isinstance(getattr(g, "__name__", ""), str)
        assert isinstance(getattr(g, "__qualname__", ""), str)
        functools.wraps(g)(lambda: None)
        assert_close(el.nolog(g)(XN)[0] if kind == "spool" else el.nolog(g)(XN), want_out)
    logger.close()
