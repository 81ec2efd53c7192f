"""The key plan (issue 36, item 2): each key's sites are collected, then merged once with all of
them in hand, so a key's layout (its batch axes, lanes as events) does not depend on the order
in which its sites come in the program; a site traced later (a custom derivative rule) is
checked against the frozen record, never merged into it."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_logs as el
from eqx_logs._interpret import _keys
from eqx_logs._interpret._manual import ManualAxes
from eqx_logs._interpret._plan import Plan
from eqx_logs._reduce import Policy
from eqx_logs._rules import RULES
from eqx_logs._scope import logging_as

XS = jnp.arange(12.0).reshape(4, 3)


def _whole_then_lanes(xs):
    el.log("k", xs * 10.0)  # unbatched: the whole batch as one value
    jax.vmap(lambda x: el.log("k", x))(xs)
    return xs.sum()


def _lanes_then_whole(xs):
    jax.vmap(lambda x: el.log("k", x))(xs)
    el.log("k", xs * 10.0)
    return xs.sum()


@pytest.mark.parametrize("jit", [False, True])
def test_a_key_laid_out_the_same_whichever_site_comes_first(jit):
    """A key logged per lane inside a vmap and as the whole batch outside it: the events are
    per lane (the batch axis of the vmap) in both orders. Before the plan was pure, the order
    decided it: the whole batch first made every event one (4, 3) value with a scalar count."""
    runs = {}
    for f in (_whole_then_lanes, _lanes_then_whole):
        spooled = el.spool(f, reduce="stack")
        _, runs[f] = (jax.jit(spooled) if jit else spooled)(XS)
    a, b = runs[_whole_then_lanes], runs[_lanes_then_whole]
    assert a.count["k"].shape == b.count["k"].shape == (4,)
    np.testing.assert_array_equal(a.count["k"], [2, 2, 2, 2])
    x = np.asarray(XS)
    np.testing.assert_array_equal(a["k"], np.stack([10 * x, x]))  # (events, lanes, 3)
    np.testing.assert_array_equal(b["k"], np.stack([x, 10 * x]))


def _mapped(xs, first: bool):
    """A key logged inside `lax.map(batch_size=3)` over 7 rows (vmaps over 3 and over 1: each
    lane is an event) and once unbatched, before or after."""
    if first:
        el.log("k", -xs[0])
    lax.map(lambda x: el.log("k", x), xs, batch_size=3)
    if not first:
        el.log("k", -xs[0])
    return xs.sum()


@pytest.mark.parametrize("first", [True, False])
def test_lanes_as_events_decided_from_all_sites(first):
    xs = jnp.arange(14.0).reshape(7, 2)
    _, logs = el.spool(lambda xs: _mapped(xs, first), reduce="stack")(xs)
    x = np.asarray(xs)
    rows = [x[i] for i in range(7)]
    want = [-x[0], *rows] if first else [*rows, -x[0]]
    np.testing.assert_array_equal(logs["k"], np.stack(want))
    assert int(logs.count["k"]) == 8
    _, eager = el.spool(lambda xs: _mapped(xs, first), reduce="stack")(xs)
    _, jitted = jax.jit(el.spool(lambda xs: _mapped(xs, first), reduce="stack"))(xs)
    np.testing.assert_array_equal(eager["k"], jitted["k"])


def _sites(f, *args) -> dict[str, list[_keys.Site]]:
    with logging_as(""):  # (logs are bound only where a spool or tap traces)
        closed = jax.make_jaxpr(f)(*args)
    plan = Plan(Policy(), RULES, lambda key, r: None, lambda tags: True, ManualAxes(), "test")
    plan.count(closed)
    return plan.sites


def _layout(info: _keys.KeyInfo):
    return (
        info.nbatch,
        info.lanes_as_events,
        [(x.shape, x.dtype) for x in info.leaves],
        {n: (s.shape, s.dtype) for n, s in info.steps.items()},
        sorted(info.sites),
    )


@pytest.mark.parametrize(
    "f, args",
    [
        (_whole_then_lanes, (XS,)),
        (lambda xs: _mapped(xs, True), (jnp.arange(14.0).reshape(7, 2),)),
        (
            # unbatched sites with Python numbers (weakly typed) beside batched float16 ones
            lambda xs: (
                el.log("k", 1.0),
                jax.vmap(lambda x: el.log("k", x.astype(jnp.float16)))(xs),
                el.log("k", 2.0),
            )[0],
            (jnp.arange(4.0),),
        ),
    ],
)
def test_merge_does_not_depend_on_the_order_of_sites(f, args):
    sites = _sites(f, *args)
    assert sites
    for key, found in sites.items():
        assert len(found) >= 2
        layouts = [_layout(_keys.merge(key, order, ())) for order in itertools.permutations(found)]
        assert all(layout == layouts[0] for layout in layouts[1:]), key


def test_merge_names_both_sites_whatever_the_order():
    def f(x):
        el.log("k", x)
        el.log("k", jnp.zeros(4))
        return x

    found = _sites(f, jnp.ones(3))["k"]
    for order in (found, found[::-1]):
        with pytest.raises(ValueError, match="shape") as caught:
            _keys.merge("k", order, ())
        assert all(s.site in str(caught.value) for s in found)


@jax.custom_jvp
def _scaled(x):
    el.log("k", x)
    return 2.0 * x


@_scaled.defjvp
def _scaled_jvp(primals, tangents):
    (x,), (dx,) = primals, tangents
    el.log("k", jnp.stack([x, x]))  # a shape the primal's events do not have
    return 2.0 * x, 2.0 * dx


def test_a_rule_traced_late_is_checked_not_merged():
    """`jax.grad(spool(f))`: JAX traces the custom JVP rule when it differentiates the
    spool's evaluation, after the plan froze the key's record. Its other shape is the error
    naming the key and both call sites (not JAX's broadcasting error from a record it was
    never checked against)."""
    with pytest.raises(ValueError, match="key 'k' is logged with shape") as caught:
        jax.grad(lambda x: el.spool(_scaled)(x)[0].sum())(jnp.ones(3))
    assert "(_scaled)" in str(caught.value) and "(_scaled_jvp)" in str(caught.value)


def test_a_rule_logging_as_its_primal_passes():
    @jax.custom_vjp
    def f(x):
        el.log("k", x)
        return 2.0 * x

    def bwd(_, g):
        el.log("k", g)
        return (2.0 * g,)

    f.defvjp(lambda x: (f(x), None), bwd)
    g, logs = el.spool(jax.grad(lambda x: f(x).sum()), reduce="stack")(jnp.arange(3.0))
    np.testing.assert_array_equal(g, [2.0, 2.0, 2.0])
    # the forward event, then the rule's (the cotangent of the sum)
    np.testing.assert_array_equal(logs["k"], [[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]])
