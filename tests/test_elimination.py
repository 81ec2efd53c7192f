"""Events a spool drops (by tags, exclude or a "drop" rule) cost nothing: the computations
feeding only them are eliminated, so the compiled program is that of the log-free function."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import eqx_logs as el


def _hlo_ops(fn, *args) -> int:
    text = jax.jit(fn).lower(*args).compile().as_text()
    return sum(" = " in line for line in text.splitlines())


def _model(x, *, log):
    def step(c, _):
        c = jnp.tanh(c @ c.T) + 1.0
        if log:
            expensive = jnp.linalg.norm(jnp.sin(c) @ jnp.cos(c))
            el.log({"debug_norm": expensive}, tags="debug")
            el.log({"train_loss": jnp.sum(c)}, tags="train")
        return c, None

    return lax.scan(step, x, None, length=10)[0]


def _train_only(x):
    def step(c, _):
        c = jnp.tanh(c @ c.T) + 1.0
        el.log({"train_loss": jnp.sum(c)}, tags="train")
        return c, None

    return lax.scan(step, x, None, length=10)[0]


@pytest.mark.parametrize(
    "options",
    [dict(exclude="debug"), dict(tags="train"), dict(policy=el.Policy(rules={"debug*": "drop"}))],
)
def test_dropped_events_are_eliminated(options):
    x = jnp.ones((8, 8))
    dropped = _hlo_ops(el.spool(lambda x: _model(x, log=True), **options), x)
    reference = _hlo_ops(el.spool(_train_only), x)
    everything = _hlo_ops(el.spool(lambda x: _model(x, log=True)), x)
    assert dropped == reference
    assert everything > reference  # the check can fail: keeping the debug log costs ops
    _, logs = el.spool(lambda x: _model(x, log=True), **options)(x)
    assert list(logs) == ["train_loss"]
