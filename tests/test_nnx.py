"""Flax NNX objects through every wrapper: state changed in place (Variables, the array
attributes of an `nnx.Pytree`, a BatchNorm's statistics, a Dropout's key, an Optimizer's state,
a Variable shared by two submodules, attributes added by `sow`) leaves the caller's objects
exactly as `nnx.jit` leaves them, or raises naming what cannot be carried."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_logs as el
from eqx_logs import loggers

nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")


class Counter(nnx.Pytree):
    """A plain array attribute, updated in place (no Variable)."""

    def __init__(self):
        self.data = jnp.zeros(())


class Model(nnx.Module):
    def __init__(self, rngs):
        self.enc = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.head = nnx.Linear(4, 1, rngs=rngs)
        self.tied = self.enc.kernel  # one Param in two places: it must stay one

    def __call__(self, x):
        h = nnx.relu(self.drop(self.bn(self.enc(x))))
        el.log("h", jnp.mean(h))
        return self.head(h) + jnp.sum(self.tied[...])


def make():
    model = Model(nnx.Rngs(params=0, dropout=1))
    optimizer = nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)
    return model, optimizer, Counter()


def step(model, optimizer, counter, x, y, i):
    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    el.log({"loss": loss}, step=i)
    optimizer.update(model, grads)
    counter.data = counter.data + 1.0
    return loss


X = jax.random.normal(jax.random.key(0), (8, 3))
Y = jnp.ones((8, 1))
STEPS = 3


def _state(*objects):
    leaves = jax.tree.leaves(nnx.state(objects))
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in leaves
    ]


@pytest.fixture(scope="module")
def reference():
    """`nnx.jit(step)`'s losses and final state."""
    model, optimizer, counter = make()
    jitted = nnx.jit(step)
    losses = [float(jitted(model, optimizer, counter, X, Y, jnp.int32(i))) for i in range(STEPS)]
    assert model.tied is model.enc.kernel
    return losses, _state(model, optimizer, counter)


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


WRAPPERS = {
    "spool": lambda log: el.spool(step),
    "spool(nnx.jit)": lambda log: el.spool(nnx.jit(step)),
    "nnx.jit(spool)": lambda log: nnx.jit(el.spool(step)),
    "tap": lambda log: el.tap(step, callback=lambda logs, steps: None),
    "nnx.jit(tap)": lambda log: nnx.jit(el.tap(step, callback=lambda logs, steps: None)),
    "plant": lambda log: el.plant(step, {}),
    "logger.spool": lambda log: log.spool(step, log.init()),
    "logger.tap": lambda log: log.tap(step, log.init()),
    "logger.jit": lambda log: log.jit(step, log.init()),
    "logger.jit(interval=2)": lambda log: log.jit(step, log.init(), interval=2),
    "logger.jit(nnx.jit)": lambda log: log.jit(nnx.jit(step), log.init()),
    "logger.jit(donate='all')": lambda log: log.jit(step, log.init(), donate="all"),
    "jax.jit(spool) of a split": None,  # the functional form Flax documents, below
}


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_every_wrapper_carries_nnx_state_as_nnx_jit(name, reference, tmp_path):
    """Losses, parameters, BatchNorm statistics, the Dropout key's count, the optimizer's
    state and a `nnx.Pytree`'s array attribute after the loop equal `nnx.jit`'s; the tied
    Param stays one object; the logged losses are the returned ones."""
    want_losses, want_state = reference
    model, optimizer, counter = make()
    logger = loggers.JsonlLogger(tmp_path / "run.jsonl")
    if name == "jax.jit(spool) of a split":

        @jax.jit
        def functional(graphdef, state, x, y, i):
            model, optimizer, counter = nnx.merge(graphdef, state)
            out = el.spool(step)(model, optimizer, counter, x, y, i)
            return out, nnx.state((model, optimizer, counter))

        graphdef, state = nnx.split((model, optimizer, counter))

        def wrapped(model, optimizer, counter, x, y, i):
            nonlocal state
            out, state = functional(graphdef, state, x, y, i)
            nnx.update((model, optimizer, counter), state)
            return out
    else:
        wrapped = WRAPPERS[name](logger)
    losses = []
    for i in range(STEPS):
        out = wrapped(model, optimizer, counter, X, Y, jnp.int32(i))
        losses.append(float(_loss(out)))
        if isinstance(out, tuple):
            np.testing.assert_allclose(out[1]["loss"], [out[0]], rtol=1e-6)
    logger.close()
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(_state(model, optimizer, counter), want_state, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert float(counter.data) == STEPS
    assert model.tied is model.enc.kernel
    if name.startswith("logger."):
        rows = [r for r in loggers.read_jsonl(tmp_path / "run.jsonl") if r["key"] == "loss"]
        kept = range(0, STEPS, 2) if "interval" in name else range(STEPS)
        assert [r["step"] for r in rows] == list(kept)
        np.testing.assert_allclose([r["value"] for r in rows], [want_losses[i] for i in kept])


def test_an_nnx_pytree_alone_is_carried():
    """An `nnx.Pytree` whose plain array attribute is updated in place, alone or beside a
    module: `nnx.jit` gives 1.0, so does each wrapper (it stayed 0.0, or raised a wrong
    "changes the structure" error)."""

    def bump(c, *rest):
        c.data = c.data + 1.0
        el.log("data", c.data)
        return c.data

    for rest in [(), (nnx.Linear(2, 2, rngs=nnx.Rngs(0)),)]:
        for wrap in (nnx.jit, el.spool, el.tap, lambda f: el.plant(f, {})):
            c = Counter()
            wrap(bump)(c, *rest)
            assert float(c.data) == 1.0, (wrap, rest)


def test_flax_carry_pytree_sow():
    """Flax's own `test_carry_pytree_sow` (an `nnx.scan` over a method with an `nnx.Pytree`
    carry that sows, under `nnx.jit`), spooled, with a log in the scanned step: the carry, the
    sown intermediates popped from the model, and the logs."""

    class CarryAsPytree(nnx.Pytree):
        def __init__(self, data):
            self.data = data

    class Sowing(nnx.Module):
        def __init__(self, num_steps):
            self.fc = nnx.Linear(10, 10, rngs=nnx.Rngs(0))
            self.num_steps = num_steps

        def _step(self, state):
            new_data = state.data + 1
            self.sow(nnx.Intermediate, "data", new_data)
            el.log("data", new_data)
            state.data = new_data
            return state

        @nnx.jit(static_argnames=("method",))
        def __call__(self, state, method):
            state_axes = nnx.StateAxes({nnx.Intermediate: 0, ...: nnx.Carry})
            return nnx.scan(method, in_axes=(state_axes, nnx.Carry), out_axes=nnx.Carry, length=5)(
                self, state
            )

    model = Sowing(num_steps=5)
    run = el.spool(lambda m, c: m(c, method=Sowing._step))
    final, logs = run(model, CarryAsPytree(jnp.array(0.0)))
    intermediates = nnx.pop(model, nnx.Intermediate)
    assert float(final.data) == 5
    np.testing.assert_array_equal(intermediates["data"][0], np.arange(1.0, 6.0))
    np.testing.assert_array_equal(logs["data"], np.arange(1.0, 6.0))


@pytest.mark.parametrize("wrap", ["spool", "logger.jit"])
def test_sow_adds_the_attribute_as_nnx_jit_does(wrap, tmp_path):
    """`sow` adds an attribute in place: carried out as `nnx.jit` carries it (it used to be
    refused)."""

    class Sows(nnx.Module):
        def __init__(self):
            self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            h = self.lin(x)
            self.sow(nnx.Intermediate, "h", h)
            el.log("h", jnp.sum(h))
            return h

    logger = loggers.JsonlLogger(tmp_path / "run.jsonl")
    want, got = Sows(), Sows()
    nnx.jit(lambda m, x: m(x))(want, jnp.ones(2))
    fun = {"spool": el.spool, "logger.jit": lambda f: logger.jit(f, logger.init())}[wrap]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        fun(lambda m, x: m(x))(got, jnp.ones(2))
    logger.close()
    assert nnx.graphdef(got) == nnx.graphdef(want)
    for a, b in zip(_state(got), _state(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize(
    "transform", [eqx.filter_jit, eqx.filter_vmap], ids=["filter_jit", "filter_vmap"]
)
@pytest.mark.parametrize("wrapper", ["spool", "tap", "logger.spool", "logger.jit"])
def test_a_transform_that_drops_nnx_state_raises(transform, wrapper, tmp_path):
    """`eqx.filter_jit(spool(step))`: Equinox rebuilds the wrapper and the objects inside its
    trace and drops them after, as it does for `eqx.filter_jit(step)`; a call that changes
    them raises, naming `nnx.jit` and `logger.jit`, rather than lose the update in silence. A
    call that changes nothing is left alone."""
    logger = loggers.JsonlLogger(tmp_path / "run.jsonl")
    wrap = {
        "spool": el.spool,
        "tap": lambda f: el.tap(f, callback=lambda logs, steps: None),
        "logger.spool": lambda f: logger.spool(f, logger.init()),
        "logger.jit": lambda f: logger.jit(f, logger.init()),
    }[wrapper]

    def bump(c, x):
        c.data = c.data + jnp.sum(x)
        el.log("x", jnp.sum(x))
        return x

    def read(c, x):
        el.log("x", jnp.sum(x))
        return x + c.data

    batched = transform is eqx.filter_vmap
    x = jnp.ones((2, 3)) if batched else jnp.ones(3)

    def counter():
        c = Counter()
        c.data = jnp.zeros(2) if batched else c.data
        return c

    with pytest.raises(ValueError, match="nnx.jit") as info:
        transform(wrap(bump))(counter(), x)
    assert "does not carry NNX state" in str(info.value)
    out = transform(wrap(read))(counter(), x)
    np.testing.assert_allclose(out[0] if isinstance(out, tuple) else out, x)
    logger.close()


def test_an_equinox_model_beside_nnx_objects():
    """An Equinox model and an NNX module in one call: the Equinox model is a pytree as
    before (traced, not carried), the NNX module carried."""
    mlp = eqx.nn.MLP(3, 1, 4, 1, key=jax.random.key(0))
    lin = nnx.Linear(3, 1, rngs=nnx.Rngs(0))

    def f(mlp, lin, x):
        lin.bias[...] = lin.bias[...] + 1.0
        y = mlp(x) + lin(x)
        el.log("y", y)
        return y

    want = mlp(X[0]) + lin(X[0]) + 1.0
    out, logs = el.spool(f)(mlp, lin, X[0])
    np.testing.assert_allclose(out, want, rtol=1e-6)
    np.testing.assert_allclose(logs["y"][0], want, rtol=1e-6)
    np.testing.assert_allclose(lin.bias[...], 1.0 + nnx.Linear(3, 1, rngs=nnx.Rngs(0)).bias[...])


class Block(nnx.Module):
    def __init__(self, din, rngs):
        self.lin = nnx.Linear(din, 4, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.lin(x))


class Stack(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(3, rngs), Block(4, rngs)])
        self.head = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _mse(model, x):
    return jnp.mean(model(x) ** 2)


def test_instrument_an_nnx_model(tmp_path):
    """`instrument` of an NNX model: each submodule's output statistics by attribute path,
    and its cotangent's with `grads=True`, against numpy; the instrumented model shares the
    original's Variables, and a `logger.jit` training step of it trains as `nnx.jit` of the
    original does. (It used to return no logs and no error.)"""
    model = Stack(nnx.Rngs(0))
    inst = el.instrument(model, stats=("mean", "rms"), grads=True)
    x = X[:5]
    _, logs = el.spool(nnx.grad(_mse))(inst, x)
    paths = ["blocks[0]", "blocks[0].lin", "blocks[1]", "blocks[1].lin", "head"]
    assert sorted(logs) == sorted(
        f"{p}/{g}{s}" for p in paths for g in ("", "grad/") for s in ("mean", "rms")
    )
    h0 = np.asarray(model.blocks[0].lin(x))
    y = np.asarray(model(x))
    np.testing.assert_allclose(logs["blocks[0].lin/mean"][0], h0.mean(), rtol=1e-5)
    np.testing.assert_allclose(logs["head/rms"][0], np.sqrt(np.mean(y**2)), rtol=1e-5)
    dy = 2 * y / y.size  # d mean(y**2) / dy
    np.testing.assert_allclose(logs["head/grad/mean"][0], dy.mean(), rtol=1e-5)
    np.testing.assert_allclose(logs["head/grad/rms"][0], np.sqrt(np.mean(dy**2)), rtol=1e-5)

    where = el.instrument(model, where="blocks[*].lin", stats=("mean",))
    assert sorted(el.spool(where)(x)[1]) == ["blocks[0].lin/mean", "blocks[1].lin/mean"]
    with pytest.raises(ValueError, match=r"selects no submodule.*blocks\[0\]\.lin"):
        el.instrument(model, where="decoder*")

    def train(model, optimizer, x, i):
        loss, grads = nnx.value_and_grad(_mse)(model, x)
        el.log("loss", loss, step=i)
        optimizer.update(model, grads)
        return loss

    reference = Stack(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    want = [float(nnx.jit(train)(reference, ref_opt, x, jnp.int32(i))) for i in range(3)]
    logger = loggers.JsonlLogger(tmp_path / "run.jsonl")
    optimizer = nnx.Optimizer(inst, optax.sgd(0.1), wrt=nnx.Param)
    step = logger.jit(train, logger.init())
    got = [float(step(inst, optimizer, x, jnp.int32(i))) for i in range(3)]
    logger.close()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(_state(model), _state(reference), strict=True):  # (shared Variables)
        np.testing.assert_allclose(a, b, rtol=1e-5)
    rows = loggers.read_jsonl(tmp_path / "run.jsonl")
    assert {r["key"] for r in rows} >= {"loss", "head/grad/rms", "blocks[1].lin/mean"}


def test_logger_jit_finds_the_graph_once_per_structure(tmp_path, monkeypatch):
    """`logger.jit(step, state, interval=2, step="i")` of an NNX step given Python ints (the
    kept and the skipped steps' programs): Flax's graph flatten runs on the host while a
    structure is new, not at each call (it did, with `nnx.update` and a new compiled-step
    wrapper, at every call); losses, state and rows equal `nnx.jit`'s loop."""
    from flax.nnx import graph, graphlib

    steps = 6
    model, optimizer, counter = make()
    jitted = nnx.jit(step)
    want = [float(jitted(model, optimizer, counter, X, Y, jnp.int32(i))) for i in range(steps)]
    want_state = _state(model, optimizer, counter)

    flattens = []
    real = graphlib.flatten

    def counted(*args, **kwargs):
        flattens.append(1)
        return real(*args, **kwargs)

    model, optimizer, counter = make()
    logger = loggers.JsonlLogger(tmp_path / "run.jsonl")
    stepped = logger.jit(step, logger.init(), interval=2, step="i")
    got = []
    for i in range(steps):
        if i == 2:  # (both programs compiled and their structure found)
            monkeypatch.setattr(graphlib, "flatten", counted)
            monkeypatch.setattr(graph, "flatten", counted)
        got.append(float(stepped(model, optimizer, counter, X, Y, i)))
    monkeypatch.undo()
    logger.close()
    assert flattens == []
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(_state(model, optimizer, counter), want_state, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert model.tied is model.enc.kernel and float(counter.data) == steps
    rows = [r for r in loggers.read_jsonl(tmp_path / "run.jsonl") if r["key"] == "loss"]
    assert [r["step"] for r in rows] == [0, 2, 4]
    np.testing.assert_allclose([r["value"] for r in rows], want[::2], rtol=1e-5)


class Sows(nnx.Module):
    def __init__(self, rngs):
        self.enc = nnx.Linear(3, 4, rngs=rngs)
        self.head = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        h = nnx.relu(self.enc(x))
        self.sow(nnx.Intermediate, "h", jnp.mean(h))
        return self.head(h)


def _sows_step(model, optimizer, x, y, i):
    def loss_fn(m):
        return jnp.mean((m(x) - y) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    el.log("loss", loss, step=i)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("change", ["sow and pop", "replace, set, tie"])
def test_logger_jit_follows_nnx_objects_changed_between_calls(tmp_path, change):
    """Objects changed by the loop between calls: sown intermediates popped at each step
    (the call adds them: a structure written back by `nnx.update`); or a submodule replaced
    by a new one of the same shape (the same pytree structure, other Variables), a Variable
    set by hand, a tied Param tied to another. `logger.jit` (kept and skipped steps' programs,
    each keeping the structure it saw last) reads and writes the objects of each call: losses,
    state and the popped intermediates equal `nnx.jit`'s loop doing the same."""

    def run(stepped):
        if change == "sow and pop":
            model = Sows(nnx.Rngs(0))
            args = (nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param),)
            fun = _sows_step
        else:
            model, optimizer, counter = make()
            args, fun = (optimizer, counter), step
        losses, sown = [], []
        for i in range(6):
            losses.append(float(stepped(fun)(model, *args, X, Y, i)))
            if change == "sow and pop":
                sown.append(float(nnx.pop(model, nnx.Intermediate)["h"][0]))
            elif i == 1:
                model.head = nnx.Linear(4, 1, rngs=nnx.Rngs(7))
            elif i == 2:
                model.enc.bias[...] = jnp.full(4, 0.5)
            elif i == 3:
                model.tied = model.head.kernel
        return losses, sown, _state(model, *args)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (sow outside nnx.capture)
        jitted = {}

        def by_nnx(fun):
            f = jitted.setdefault(fun, nnx.jit(fun))
            return lambda *a: f(*a[:-1], jnp.int32(a[-1]))

        want = run(by_nnx)
        logger = loggers.JsonlLogger(tmp_path / "run.jsonl")
        made = {}
        got = run(
            lambda fun: made.setdefault(fun, logger.jit(fun, logger.init(), interval=2, step="i"))
        )
        logger.close()
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    for a, b in zip(got[2], want[2], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    rows = [r for r in loggers.read_jsonl(tmp_path / "run.jsonl") if r["key"] == "loss"]
    assert [r["step"] for r in rows] == [0, 2, 4]
    np.testing.assert_allclose([r["value"] for r in rows], want[0][::2], rtol=1e-5)


def test_logger_jit_of_nnx_jit_skips_the_logs_of_skipped_steps(tmp_path):
    """`logger.jit(nnx.jit(step), state, interval=3, step="i")`, which the guide lists beside
    `logger.jit(step, ...)`: no warning (it warned at every run that the events carry another
    step: the step given to the inner `jax.jit` is a new tracer) and the steps the interval
    skips run without their logs (the logged value, made by a counted host callback, is
    computed at the kept steps alone); losses and state equal `nnx.jit`'s loop."""
    computed = []

    def logged_step(model, optimizer, x, y, i):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        spec = jax.ShapeDtypeStruct((), loss.dtype)
        el.log("loss", jax.pure_callback(lambda v: (computed.append(1), v)[1], spec, loss), step=i)
        optimizer.update(model, grads)
        return loss

    def fresh():
        model = Stack(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)

    steps = 6
    model, optimizer = fresh()
    plain = nnx.jit(logged_step)
    want = [float(plain(model, optimizer, X, Y, jnp.int32(i))) for i in range(steps)]
    want_state = _state(model, optimizer)

    model, optimizer = fresh()
    logger = loggers.JsonlLogger(tmp_path / "run.jsonl")
    stepped = logger.jit(nnx.jit(logged_step), logger.init(), interval=3, step="i")
    computed.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [float(stepped(model, optimizer, X, Y, i)) for i in range(steps)]
    logger.close()
    assert len(computed) == 2  # steps 0 and 3
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(_state(model, optimizer), want_state, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    rows = loggers.read_jsonl(tmp_path / "run.jsonl")
    assert [(r["key"], r["step"]) for r in rows] == [("loss", 0), ("loss", 3)]
    np.testing.assert_allclose([r["value"] for r in rows], [want[0], want[3]], rtol=1e-5)


@pytest.mark.parametrize("form", ["in a tuple", "by keyword", "shared with a tuple's"])
def test_logger_jit_carries_nnx_objects_in_every_form(tmp_path, form):
    """The forms `logger.jit` carries by a split at each call rather than per structure: the
    objects inside a tuple argument, passed by keyword, or a model passed itself while a
    tuple holds its submodule (one graph: the submodule's Variables stay the model's). State
    and losses equal `nnx.jit`'s."""

    def train(model, optimizer, counter, x, y, i, extra=()):
        loss = step(model, optimizer, counter, x, y, i)
        for lin in extra:  # (the shared submodule, changed through the tuple)
            lin.bias[...] = lin.bias[...] + 1.0
        return loss

    def tupled(objects, x, y, i):
        return train(*objects, x, y, i)

    def keywords(x, y, i, *, model, optimizer, counter):
        return train(model, optimizer, counter, x, y, i)

    fun = {"in a tuple": tupled, "by keyword": keywords, "shared with a tuple's": train}[form]

    def call(f, model, optimizer, counter, i):
        if form == "in a tuple":
            return f((model, optimizer, counter), X, Y, i)
        if form == "by keyword":
            return f(X, Y, i, model=model, optimizer=optimizer, counter=counter)
        return f(model, optimizer, counter, X, Y, i, extra=(model.head,))

    def run(f):
        model, optimizer, counter = make()
        losses = [float(call(f, model, optimizer, counter, jnp.int32(i))) for i in range(2)]
        assert model.tied is model.enc.kernel
        return losses, _state(model, optimizer, counter)

    want = run(nnx.jit(fun))
    with loggers.JsonlLogger(tmp_path / "run.jsonl") as logger:
        got = run(logger.jit(fun, logger.init()))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["itself", "in a tuple"])
def test_logger_jit_donating_a_step_that_changes_nothing_keeps_the_arrays(tmp_path, form):
    """`donate="all"` of a step that only reads the model: its arrays are donated to the call,
    so they are written back even though the step changed nothing (they were left deleted in
    the model, and its next use failed); the output equals the model applied eagerly."""

    def read(model, x):
        y = model(x)
        el.log("y", jnp.sum(y))
        return y

    def tupled(objects, x):
        return read(objects[0], x)

    lin = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    want = np.asarray(lin(X))
    with loggers.JsonlLogger(tmp_path / "run.jsonl") as logger:
        fun = read if form == "itself" else tupled
        stepped = logger.jit(fun, logger.init(), donate="all")
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (donation unusable on some backends)
                out = stepped(lin, X) if form == "itself" else stepped((lin,), X)
            np.testing.assert_allclose(out, want, rtol=1e-6)
            assert not lin.kernel[...].is_deleted()
    np.testing.assert_allclose(lin(X), want, rtol=1e-6)


def test_logger_jit_carries_an_nnx_object_that_is_no_pytree(tmp_path):
    """An `nnx.Object` (not a JAX pytree: JAX sees it as one leaf) passed itself: carried by
    a split at each call, its Variable updated as by `nnx.jit` (3.0 after three calls)."""

    class Tally(nnx.Object):
        def __init__(self):
            self.total = nnx.Variable(jnp.zeros(()))

    def bump(tally, x):
        tally.total[...] = tally.total[...] + jnp.sum(x)
        el.log("total", tally.total[...])
        return tally.total[...]

    want, got = Tally(), Tally()
    with loggers.JsonlLogger(tmp_path / "run.jsonl") as logger:
        stepped = logger.jit(bump, logger.init())
        for _ in range(3):
            nnx.jit(bump)(want, jnp.ones(()))
            stepped(got, jnp.ones(()))
    assert float(got.total[...]) == float(want.total[...]) == 3.0
    assert [r["value"] for r in loggers.read_jsonl(tmp_path / "run.jsonl")] == [1.0, 2.0, 3.0]


def test_logger_jit_keeps_no_model_alive(tmp_path):
    """`logger.jit`'s structure of the NNX objects it carries holds their ids, not them: a
    model the loop no longer uses is freed (with its arrays), and a new one passed to the
    same step is found and trained."""
    import gc
    import weakref

    x, y = jnp.ones((8, 4)), jnp.ones((8, 1))

    def step(model, optimizer, i):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        el.log({"loss": loss})
        optimizer.update(model, grads)

    def make(seed):
        model = nnx.Linear(4, 1, rngs=nnx.Rngs(seed))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    with loggers.JsonlLogger(tmp_path / "a.jsonl") as logger:
        jitted = logger.jit(step, logger.init(), interval=2, step="i")
        model, optimizer = make(0)
        for i in range(3):
            jitted(model, optimizer, i)
        alive = weakref.ref(model)
        del model, optimizer
        gc.collect()
        assert alive() is None
        model, optimizer = make(1)
        reference, reference_optimizer = make(1)
        for i in range(3):
            jitted(model, optimizer, i)
            nnx.jit(step)(reference, reference_optimizer, jnp.int32(i))
    np.testing.assert_allclose(model.kernel[...], reference.kernel[...], rtol=1e-6)
    assert not np.array_equal(model.kernel[...], make(1)[0].kernel[...])
