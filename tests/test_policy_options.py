"""The policy's options are declared once (`eqx_logs/_reduce/_options.py`): every entry point
takes each of them, with the declared type, and documents each in its docstring, so that a
new option cannot be forgotten in one place; an unknown keyword is named, with the closest
one."""

import dataclasses
import inspect
from typing import Unpack

import jax
import pytest

import eqx_logs as el
import eqx_logs.config
from eqx_logs._reduce import OPTIONS, TAP_OPTIONS, PolicyOptions, TapOptions
from eqx_logs._tap._api import SPOOL_ONLY
from eqx_logs.loggers import AbstractLogger, JsonlLogger

pytestmark = pytest.mark.fast  # in `make test-fast`

# a value for each option, other than its default
VALUES = {
    "reduce": "mean",
    "interval": 2,
    "window": 3,
    "tags": ("train",),
    "exclude": ("debug",),
    "rules": {"grad/*": "max"},
    "prefix": "p/",
    "watch": ("while",),
    "key": jax.random.key(0),
    "across": ("i",),
    "first_nonfinite": True,
}

SPOOLS = [el.Policy, el.Policy.replace, el.spool, AbstractLogger.spool, AbstractLogger.jit]
TAPS = [el.tap, AbstractLogger.tap]


def f(x):
    el.log("x", x)
    return x


def test_the_declaration_is_whole():
    assert set(VALUES) == set(OPTIONS) == PolicyOptions.__optional_keys__
    assert set(TAP_OPTIONS) == TapOptions.__optional_keys__
    assert set(OPTIONS) - set(TAP_OPTIONS) <= set(SPOOL_ONLY)  # a tap says why it has not
    assert [f.name for f in dataclasses.fields(el.Policy)] == list(OPTIONS)
    fields = {f.name for f in dataclasses.fields(eqx_logs.config.PolicyConfig)}
    assert set(OPTIONS) - {"key"} | {"seed"} <= fields


@pytest.mark.parametrize("fun", [*SPOOLS, *TAPS, eqx_logs.config.policy])
def test_every_entry_point_takes_and_documents_the_options(fun):
    options = inspect.signature(fun).parameters[
        "options" if fun is not el.Policy.replace else "changes"
    ]
    names = TAP_OPTIONS if fun in TAPS else OPTIONS
    assert options.kind is inspect.Parameter.VAR_KEYWORD
    assert options.annotation == Unpack[TapOptions if fun in TAPS else PolicyOptions]
    doc = inspect.getdoc(el.Policy if fun is el.Policy.replace else fun)
    assert "_options}" not in doc
    for name in names:
        assert f"- `{name}` (default `{OPTIONS[name].default!r}`): " in doc


def test_each_option_reaches_the_policy(tmp_path):
    logger = JsonlLogger(tmp_path / "a.jsonl")
    state = logger.init()
    for name, value in VALUES.items():
        want = el.Policy(**{name: value})
        assert getattr(want, name) is not getattr(el.Policy(), name)
        assert el.Policy().replace(**{name: value}) == want
        assert el.spool(f, **{name: value}).policy == want
        assert el.spool(**{name: value})(f).policy == want
        assert logger.spool(f, state, **{name: value}).spooled.policy == want
        logger.jit(f, state, **{name: value})
        if name in TAP_OPTIONS:
            assert el.tap(f, **{name: value}).policy == want
            logger.tap(f, state, **{name: value})
        if name != "key":
            config = eqx_logs.config.policy(**{name: value})
            assert config == want or name == "tags" and config.tags == want.tags
    logger.close()


def test_none_keeps_the_policys_value():
    policy = el.Policy(interval=4, tags="train")
    assert el.spool(f, policy=policy, interval=None, tags=None).policy is policy
    assert policy.replace(interval=None, window=2) == el.Policy(interval=4, tags="train", window=2)


@pytest.mark.parametrize(
    "call, where, near",
    [
        (lambda: el.Policy(intervall=2), r"eqx_logs\.Policy", "interval"),
        (lambda: el.spool(f, kep=True), r"eqx_logs\.spool", "keep"),
        (lambda: el.spool(f, polcy=None), r"eqx_logs\.spool", "policy"),
        (lambda: el.spool(tag="train"), r"eqx_logs\.spool", "tags"),
        (lambda: el.tap(f, prefx="a"), r"eqx_logs\.tap", "prefix"),
    ],
)
def test_an_unknown_keyword_is_named_with_the_closest(call, where, near):
    with pytest.raises(TypeError, match=rf"{where}\(\) got an unexpected .* Did you mean '{near}'"):
        call()


def test_an_unknown_config_key_is_named_as_the_config_writes_it():
    """`config.policy` (what Hydra instantiates) names a key that is no option as the config
    writes it (`logging.sed=1`), with the closest option."""
    with pytest.raises(TypeError, match=r"logging\.sed=1: .* Did you mean logging\.seed\?"):
        eqx_logs.config.policy(sed=1)
    with pytest.raises(TypeError, match=r"train\.intervall=3: .* Did you mean train\.interval\?"):
        eqx_logs.config.policy(config_key="train", intervall=3)
