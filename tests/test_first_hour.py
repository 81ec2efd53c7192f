"""The traps of the loop a newcomer writes, and the warnings that point at the user's line:
each warning is asserted where it is due, and correct code is asserted silent."""

import contextlib
import functools
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_logs
from eqx_logs.loggers import JsonlLogger, NonfiniteWarning, read_jsonl

pytestmark = pytest.mark.fast


@contextlib.contextmanager
def _silent():
    """A block in which any warning fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _train_step(w, x, i):
    eqx_logs.log("loss", jnp.sum(w * x), step=i)
    return w + 1


# -- a Python scalar step compiles the step again for each value ------------------------------


def _compiles(fun):
    """`fun` with a counter of its traces (each is a compilation of the spooled step)."""
    traces = []

    @functools.wraps(fun)
    def counted(*args, **kwargs):
        traces.append(None)
        return fun(*args, **kwargs)

    return counted, traces


@pytest.mark.parametrize("form", ["spool", "logger.spool", "logger.jit", "tap"])
def test_a_python_int_step_is_named_once_after_a_few_compilations(form, tmp_path):
    step, traces = _compiles(_train_step)
    logger = JsonlLogger(tmp_path / "a.jsonl")
    make = {
        "spool": lambda: eqx_logs.spool(step, interval=2),
        "logger.spool": lambda: logger.spool(step, logger.init(), interval=2),
        "logger.jit": lambda: logger.jit(step, logger.init(), interval=2),
        "tap": lambda: eqx_logs.tap(step, callback=lambda logs, steps: None),
    }[form]
    stepped = make()
    w = jnp.ones(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(8):
            stepped(w, w, i)  # python-int-call
    logger.close()
    assert len(traces) == 8  # the trap is real: a compilation per value
    said = [w for w in caught if "compiled" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]  # once, not per call
    message = str(said[0].message)
    assert "Python int `i`" in message and "`jnp.int32(i)`" in message, message
    assert "_train_step was compiled 4 times" in message, message
    # attributed to the user's call, not to eqx_logs, Equinox or JAX
    assert said[0].filename == __file__, said[0].filename
    assert open(__file__).readlines()[said[0].lineno - 1].rstrip().endswith("# python-int-call")


def test_an_array_step_and_a_few_static_values_compile_silently():
    step, traces = _compiles(_train_step)
    spooled = eqx_logs.spool(step, interval=2)
    w = jnp.ones(3)
    with _silent():
        for i in range(8):
            spooled(w, w, jnp.int32(i))
        assert len(traces) == 1
        for n in (1, 2, 3):  # a configuration scalar with a few values
            spooled(w, w, n)
    assert len(traces) == 4


def test_a_static_argument_of_an_enclosing_jit_is_the_users_choice():
    tapped = eqx_logs.tap(_train_step, callback=lambda logs, steps: None)
    w = jnp.ones(3)
    with _silent():
        for i in range(6):
            jax.jit(tapped, static_argnums=2)(w, w, i)


def test_a_keyword_and_a_float_are_named_by_their_path():
    def step(w, cfg):
        eqx_logs.log("loss", jnp.sum(w) * cfg["lr"])
        return w

    spooled = eqx_logs.spool(step)
    with pytest.warns(
        UserWarning, match=r"Python float `cfg\['lr'\]`.*jnp\.float32\(cfg\['lr'\]\)"
    ):
        for lr in (0.1, 0.2, 0.3, 0.4):
            spooled(jnp.ones(2), cfg={"lr": lr})


# -- step-less events beside a stepped key under `interval` ----------------------------------


def _mlp():
    return eqx.nn.MLP(2, 1, 4, 1, key=jax.random.key(0))


def test_stepless_events_in_a_per_step_loop_are_said_and_scope_step_keeps_them_by_step(tmp_path):
    model = eqx_logs.instrument(_mlp(), stats=("mean",))
    x = jnp.ones(2)

    def step(model, x, i):
        eqx_logs.log("loss", jnp.sum(model(x)), step=i)
        return model

    def scoped(model, x, i):
        with eqx_logs.scope(step=i):
            loss = jnp.sum(model(x))
        eqx_logs.log("loss", loss, step=i)
        return model

    with pytest.warns(
        UserWarning, match=r"interval=5\): 'layers\[0\]/mean' \(1 per call, logged at "
    ) as got:
        eqx_logs.spool(step, interval=5)(model, x, jnp.int32(0))  # stepless-call
    message = str(got[0].message)
    assert "eqx_logs.scope(step=i)" in message and "'loss' carries one" in message
    assert got[0].filename == __file__
    # with the step in scope: silent, and thinned like the loss, checked in the file written
    path = tmp_path / "a.jsonl"
    with JsonlLogger(path) as logger, _silent():
        jitted = logger.jit(scoped, logger.init(), interval=5)
        for i in range(20):
            jitted(model, x, jnp.int32(i))
    rows = read_jsonl(path)
    for key in ("loss", "layers[0]/mean", "layers[1]/mean"):
        assert [r["step"] for r in rows if r["key"] == key] == [0, 5, 10, 15], key


def test_stepless_keys_that_fill_whole_intervals_per_call_are_silent():
    def chunk(w, start):  # 10 iterations per call, interval 5: numbered alike
        def body(c, i):
            eqx_logs.log("loss", jnp.sum(w), step=start + i)
            eqx_logs.log("norm", jnp.sum(w * w))
            return c, None

        return jax.lax.scan(body, 0, jnp.arange(10))[0]

    with _silent():
        _, logs = eqx_logs.spool(chunk, interval=5)(jnp.ones(2), jnp.int32(0))
    np.testing.assert_array_equal(logs.count["norm"], 2)
    # and without a stepped key there is nothing to follow
    with _silent():
        eqx_logs.spool(lambda w: eqx_logs.log("x", w), interval=5)(jnp.ones(2))


# -- no warning for correct code: a spool, tap or plant of `jax.vmap(model)` ------------------


def test_transformed_models_are_wrapped_without_equinoxs_warning(tmp_path):
    model = _mlp()
    x = jnp.ones((3, 2))
    logger = JsonlLogger(tmp_path / "a.jsonl")
    with _silent():
        out, _ = eqx_logs.spool(jax.vmap(model))(x)
        eqx_logs.spool(jax.grad(lambda x: model(x).sum()))(x[0])
        eqx_logs.tap(jax.vmap(model), callback=lambda logs, steps: None)(x)
        eqx_logs.plant(jax.vmap(model), {})(x)
        logger.spool(jax.vmap(model), logger.init())(x)
        logger.tap(jax.vmap(model), logger.init())(x)
        jitted = logger.jit(jax.vmap(model), logger.init())(x)
        logger.close()
    np.testing.assert_allclose(out, jax.vmap(model)(x))
    np.testing.assert_allclose(jitted, jax.vmap(model)(x))


# -- exclude and rules that match nothing ------------------------------------------------------


def _tagged(x):
    eqx_logs.log("loss", x.sum(), tags="train")
    eqx_logs.log("grad/w", x, tags="debug")
    return x


@pytest.mark.parametrize(
    "options, said",
    [
        (
            dict(exclude="debg"),
            r"exclude='debg'\): no event traced carries that tag; did you mean 'debug'",
        ),
        (dict(exclude="Debug"), r"exclude='Debug'\).*did you mean 'debug'"),
        (
            dict(policy=eqx_logs.Policy(rules={"grads/*": "max"})),
            r"rules=\{'grads/\*': ...\}.*did you mean 'grad/w'",
        ),
        (
            dict(policy=eqx_logs.Policy(rules={"grad": "max"})),
            r"rules=\{'grad': ...\}.*did you mean 'grad/\*'",
        ),
        (
            dict(policy=eqx_logs.Policy(rules={"Grad/*": "max"})),
            r"rules=\{'Grad/\*': ...\}.*'grad/w'",
        ),
    ],
)
def test_an_exclude_tag_or_rule_that_resembles_a_logged_one_is_said(options, said):
    x = jnp.ones(3)
    with pytest.warns(UserWarning, match=said) as got:
        _, logs = eqx_logs.spool(_tagged, **options)(x)  # typo-call
    assert got[0].filename == __file__
    assert "grad/w" in logs  # nothing changed: the typo is said, not acted on
    if "exclude" in options:  # (a tap refuses rules other than "drop")
        with pytest.warns(UserWarning, match=said):
            eqx_logs.tap(_tagged, callback=lambda logs, steps: None, **options)(x)


@pytest.mark.parametrize(
    "options, said",
    [
        (dict(exclude="degub"), r"exclude='degub'\): no event traced .*did you mean 'debug'"),
        (dict(exclude="dbeug"), r"exclude='dbeug'\).*did you mean 'debug'"),
        (
            dict(tags=("train", "degub")),
            r"tags=\('train', 'degub'\)\): no event traced carries 'degub'\. Did you mean "
            r"'debug' for 'degub'\? The tags logged are \['debug', 'train'\]",
        ),
        (dict(tags="trian"), r"tags=\('trian',\)\) selected none.*Did you mean 'train'"),
        (dict(policy=eqx_logs.Policy(rules={"lsos": "max"})), r"'lsos'.*did you mean 'loss'"),
        (
            dict(policy=eqx_logs.Policy(rules={"gard/*": "max"})),
            r"rules=\{'gard/\*': ...\}.*did you mean 'grad/w'",
        ),
    ],
)
def test_swapped_letters_are_a_likely_typo(options, said):
    # before: difflib's ratio alone, 0.6 for "degub" and "debug", said nothing
    x = jnp.ones(3)
    with pytest.warns(UserWarning, match=said) as got:
        eqx_logs.spool(_tagged, **options)(x)  # typo-call
    assert got[0].filename == __file__
    if "policy" not in options:  # (a tap refuses rules other than "drop")
        with pytest.warns(UserWarning, match=said):
            eqx_logs.tap(_tagged, callback=lambda logs, steps: None, **options)(x)


def test_the_likely_typo_rule_against_an_enumeration():
    """`_spelling.closest` of plain names, for all short words over a small alphabet,
    against every string one typo away, enumerated (`helpers.one_edit_away`); and the
    rules it adds to that: case, and difflib's ratio 0.8 for the rest."""
    import difflib
    import itertools

    from helpers import one_edit_away

    from eqx_logs._spelling import closest

    for name in ["debug", "trian", "loss", "abab", "grad"]:
        alphabet = "".join(sorted(set(name))) + "x"
        typos = one_edit_away(name, alphabet)
        for n in range(len(name) - 1, min(len(name) + 1, 5) + 1):
            for word in map("".join, itertools.product(alphabet, repeat=n)):
                ratio = difflib.SequenceMatcher(None, name, word).ratio()  # (as difflib)
                want = (len(word) >= 4 and word in typos) or ratio >= 0.8
                assert (closest(word, [name]) == name) == want, (word, name)
        assert closest(name.upper(), [name]) == name
    assert closest("lr", ["rl"]) is None and closest("window", ["window_max"]) is None


def test_exclude_and_rules_that_resemble_nothing_are_silent():
    """A shared configuration may exclude a tag (Hydra's `exclude: [debug]`) or name a key the
    program does not log: correct code."""
    x = jnp.ones(3)
    with _silent():
        eqx_logs.spool(_tagged, exclude=("other", "debug"))(x)
        # (a key this program does not log beside one it does: `loss_ema`, `*x`)
        rules = {"grad/*": "max", "optimizer/*": "mean", "loss_ema": "mean", "*x": "max"}
        eqx_logs.spool(_tagged, policy=eqx_logs.Policy(rules=rules))(x)


# -- tap and spool's options ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["first_nonfinite", "reduce", "window", "keep", "key", "across"])
def test_tap_names_spool_for_spools_options(name, tmp_path):
    with pytest.raises(
        TypeError, match=rf"has no `{name}`: that is a spool option.*eqx_logs\.spool"
    ):
        eqx_logs.tap(_tagged, **{name: True})
    logger = JsonlLogger(tmp_path / "a.jsonl")
    with pytest.raises(TypeError, match=rf"logger\.tap\(\) has no `{name}`"):
        logger.tap(_tagged, logger.init(), **{name: True})
    logger.close()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'bogus'"):
        eqx_logs.tap(_tagged, bogus=1)


def test_tap_refuses_a_policy_whose_reduction_it_would_ignore():
    policy = eqx_logs.Policy(reduce="mean", window=2, rules={"grad/*": "max", "debug/*": "drop"})
    with pytest.raises(
        ValueError, match=r"Policy\(reduce=Mean\(\), window=2\)\): .*would be ignored"
    ):
        eqx_logs.tap(_tagged, policy=policy)
    # what a tap uses; a rule's reduction is ignored (one Policy's rules serve spool and tap)
    ok = eqx_logs.Policy(interval=2, tags="train", exclude="x", rules={"grad/*": "max"})
    with _silent():
        eqx_logs.tap(_tagged, policy=ok, callback=lambda logs, steps: None)(jnp.ones(3))


# -- one problem, one report ---------------------------------------------------------------------


def test_a_nan_carrying_on_is_reported_once_per_run(tmp_path):
    def step(w, i):
        eqx_logs.log("w", jnp.sum(w), step=i)
        return w * 10.0

    path = tmp_path / "a.jsonl"
    with JsonlLogger(path) as logger:
        runs = [logger.init(0), logger.init(1)]
        jitted = [logger.jit(step, s, first_nonfinite=True) for s in runs]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for state_step in jitted:
                w = jnp.full(2, 1e36, jnp.float32)
                for i in range(4):
                    w = state_step(w, jnp.int32(i))  # 1e39 at i=3: inf, which carries on
                    logger.flush()
    reports = [str(w.message) for w in caught if issubclass(w.category, NonfiniteWarning)]
    assert len(reports) == 2, reports  # one per run
    for run, report in enumerate(reports):
        assert re.search(
            rf"\(run {run}\): first non-finite value: event 0 of key 'w', step=3", report
        )
        assert "not reported" in report
    assert all(w.filename == __file__ for w in caught), [w.filename for w in caught]
    assert len(read_jsonl(path)) == 8  # every event written, the non-finite ones too
