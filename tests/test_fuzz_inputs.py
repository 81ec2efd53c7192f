"""Bad input, fuzzed: every rejection is a clear error that names the key, the step or the
option the user wrote, raised at the call site, never an internal error of JAX or numpy.

Each case draws what a user could pass by mistake (strings, objects and dates in numpy arrays,
integers beyond int32, pytrees too deep or with keys of mixed types, wrong option types and
ranges) and checks the type of the error and that its message names what was wrong."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import eqx_logs as el

pytestmark = pytest.mark.fast  # in `make test-fast`

EXAMPLES = 120  # per test: 240 in all (every kind of bad value and step, many times over)

KEYS = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
HUGE = st.one_of(st.integers(min_value=2**31), st.integers(max_value=-(2**31) - 1))


def _deep(depth: int):
    value = 1.0
    for _ in range(depth):
        value = [value]
    return value


BAD_VALUES = st.one_of(
    st.text(max_size=5).map(lambda s: np.array([s])),
    st.just(np.array([object()])),
    st.integers(0, 10**6).map(lambda d: np.array([d], "datetime64[D]")),
    st.integers(0, 10**6).map(lambda d: np.array([d], "timedelta64[s]")),
    HUGE,
    HUGE.filter(lambda x: -(2**63) <= x < 2**63).map(np.int64),
    st.integers(3000, 5000).map(_deep),
    st.just({1: 1.0, "a": 2.0}),
    st.none(),
    st.text(max_size=5),
    st.just(lambda: 1.0),
    st.just({"a": None}),  # (an empty container, `()` or `{}`, is an event with no value)
)

BAD_STEPS = st.one_of(
    st.floats(allow_nan=False),
    HUGE,
    HUGE.filter(lambda x: -(2**63) <= x < 2**63).map(np.int64),
    st.just(np.zeros(2, np.int32)),
    st.text(max_size=5),
    st.booleans(),
    st.none(),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(key=KEYS, value=BAD_VALUES, step=st.one_of(st.none(), BAD_STEPS), where=st.booleans())
def test_bad_log_calls_name_the_key_or_step(key, value, step, where):
    steps = {} if step is None else {"it": step}
    bad_value = where or step is None

    def f(x):
        el.log(key, value if bad_value else x, **steps)
        return x

    with pytest.raises((TypeError, ValueError, OverflowError)) as info:
        el.spool(f)(jnp.float32(1.0))
    message = str(info.value)
    assert "test_fuzz_inputs.py" in message  # the call site
    assert (repr(key) in message) if bad_value else ("it" in message), message


def _bad_count():
    return st.one_of(
        st.integers(max_value=0),
        st.integers(min_value=2**31),
        st.floats(),
        st.text(max_size=3),
        st.booleans(),
        st.just([1]),
    )


OPTIONS = st.one_of(
    _bad_count().map(lambda v: ("Stack", "capacity", lambda: el.Stack(capacity=v))),
    _bad_count().map(lambda v: ("Window", "size", lambda: el.Window(v))),
    _bad_count().map(lambda v: ("Sample", "k", lambda: el.Sample(v))),
    _bad_count().map(lambda v: ("Histogram", "bins", lambda: el.Histogram(v, range=(0, 1)))),
    st.one_of(st.text(max_size=3), st.just(1), st.just((1,)), st.just(("a", 1))).map(
        lambda v: ("Histogram", "range", lambda: el.Histogram(3, range=v))
    ),
    st.one_of(st.text(max_size=3), st.just([0.5]), st.floats(min_value=1.0)).map(
        lambda v: ("EMA", "decay", lambda: el.EMA(decay=v))
    ),
    _bad_count().map(lambda v: ("Policy", "interval", lambda: el.Policy(interval=v))),
    _bad_count().map(lambda v: ("Policy", "window", lambda: el.Policy(window=v))),
    _bad_count().map(
        lambda v: ("spool", "interval", lambda: el.spool(lambda x: x, interval=v)(1.0))
    ),
)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=OPTIONS)
def test_bad_options_name_the_option(case):
    owner, option, make = case
    with pytest.raises((TypeError, ValueError)) as info:
        make()
    message = str(info.value)
    assert option in message, message
    assert owner in message or "Policy" in message, message
