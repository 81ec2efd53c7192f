"""Batched predicates: under `spool(vmap(f))`, events of untaken branches and of finished
while-loop lanes do not count, so it equals `vmap(spool(f))` with the batch axis moved."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_logs as el


def _move_batch_axis(logs, reduce):
    """vmap(spool(f)) puts the batch axis first; spool(vmap(f)) puts it after the event axis
    of event-keeping reductions."""
    event_axes = 1 if reduce in ("stack", "collect") or not isinstance(reduce, str) else 0
    return jax.tree.map(
        lambda x: jnp.moveaxis(x, 0, event_axes) if x.ndim > event_axes else x, logs
    )


def _assert_same(f, xs, reduce, **kw):
    _, inner = el.spool(jax.vmap(f), reduce=reduce, **kw)(xs)
    _, outer = jax.vmap(el.spool(f, reduce=reduce, **kw))(xs)
    assert sorted(inner) == sorted(outer)
    for key in outer:
        want = np.asarray(_move_batch_axis(outer[key], reduce))
        np.testing.assert_allclose(np.asarray(inner[key]), want, rtol=1e-5, equal_nan=True)
        np.testing.assert_array_equal(inner.count[key], outer.count[key])
    return inner, outer


def _cond_in_scan(x):
    def step(c, i):
        lax.cond(c > 1.5, lambda: el.log("big", c), lambda: el.log("small", -c))
        lax.switch(i % 3, [lambda: el.log("s0", c), lambda: None, lambda: el.log("s2", c * 2)])
        return c + x, None

    return lax.scan(step, 0.0, jnp.arange(5))[0]


def _while_logging(x):
    def cond(c):
        el.log("test", c)
        return c < x

    def body(c):
        el.log("body", c)
        lax.cond(c > 1, lambda: el.log("inner_cond", c), lambda: None)
        return c + 1

    return lax.while_loop(cond, body, 0.0)


def _literals_logging(x):
    """Python literals logged where a batched predicate masks the events (issue 24): jax 0.10
    reads them from the jaxpr as `TypedFloat`s and `TypedInt`s, which have no `.shape`."""

    def cond(c):
        el.log({"test": 2})
        return c < x

    def body(c):
        el.log({"k": 1.0})
        lax.cond(c > 1, lambda: el.log("big", 3.0), lambda: None)
        return c + 1

    return lax.while_loop(cond, body, 0.0)


@pytest.mark.parametrize("reduce", [el.Stack(capacity=5), "sum", "count", "last"])
def test_batched_predicate_logging_python_literals(reduce):
    xs = np.array([0.0, 2.0, 3.5], np.float32)
    inner, _ = _assert_same(_literals_logging, jnp.asarray(xs), reduce)
    trips = np.ceil(xs).astype(np.int32)  # per lane, from Python: iterations c = 0, 1, ...
    want_counts = {"k": trips, "test": trips + 1, "big": np.maximum(trips - 2, 0)}
    for key, value in {"k": 1.0, "test": 2, "big": 3.0}.items():
        count = want_counts[key]
        np.testing.assert_array_equal(inner.count[key], count, err_msg=key)
        if reduce == "sum":
            np.testing.assert_allclose(inner[key], value * count, err_msg=key)
        elif isinstance(reduce, el.Stack):
            rows = np.arange(5)[:, None] < count  # (events, lanes)
            want = np.where(rows, value, np.nan if isinstance(value, float) else 0)
            np.testing.assert_allclose(inner[key], want, equal_nan=True, err_msg=key)


@pytest.mark.parametrize("reduce", ["stack", "mean", "count", "last", "max"])
def test_batched_cond_predicate(reduce):
    inner, _ = _assert_same(_cond_in_scan, jnp.array([0.2, 0.5, 1.0]), reduce)
    # lane 0 never exceeds 1.5 over 5 steps (c = 0, .2, .4, .6, .8): no "big" events.
    assert np.array_equal(inner.count["big"], [0, 1, 3])
    assert np.array_equal(inner.count["small"], [5, 4, 2])


@pytest.mark.parametrize("reduce", [el.Stack(capacity=6), "mean", "count", el.Stack(3, "last")])
def test_batched_while_predicate(reduce):
    inner, _ = _assert_same(_while_logging, jnp.array([0.0, 2.0, 3.5]), reduce)
    # cond_fun runs once more than the body, per lane; finished lanes log nothing more.
    assert np.array_equal(inner.count["body"], [0, 2, 4])
    assert np.array_equal(inner.count["test"], [1, 3, 5])
    assert np.array_equal(inner.count["inner_cond"], [0, 0, 2])


def test_batched_while_values_against_python():
    _, logs = el.spool(jax.vmap(_while_logging), reduce=el.Stack(capacity=5))(
        jnp.array([0.0, 2.0, 3.5])
    )
    for lane, x in enumerate([0.0, 2.0, 3.5]):
        n = int(np.ceil(x))
        want = np.full(5, np.nan, np.float32)
        want[:n] = np.arange(n)
        np.testing.assert_allclose(logs["body"][:, lane], want, equal_nan=True)


def test_nested_vmap_and_interval():
    f = jax.vmap(jax.vmap(_cond_in_scan))
    xs = jnp.array([[0.2, 0.5], [1.0, 2.0]])
    _, logs = el.spool(f, interval=2)(xs)
    _, ref = jax.vmap(jax.vmap(el.spool(_cond_in_scan, interval=2)))(xs)
    assert logs["big"].shape == (3, 2, 2)  # ceil(5 / 2) events, then both batch axes
    np.testing.assert_array_equal(logs.count["big"], ref.count["big"])
    np.testing.assert_allclose(
        logs["big"], np.moveaxis(np.asarray(ref["big"]), 2, 0), equal_nan=True
    )


def test_equinox_while_loop_under_vmap():
    def f(x):
        def body(c):
            el.log("w", c[1])
            return c[0] + 1, c[1] * 2

        return eqx.internal.while_loop(lambda c: c[0] < x, body, (0, 1.0), max_steps=8, kind="lax")

    _assert_same(f, jnp.array([0, 2, 5]), "mean")
    _assert_same(f, jnp.array([0, 2, 5]), el.Stack(capacity=8))


def test_grad_inside_vmap_with_batched_predicate():
    def loss(w, x):
        y = lax.cond(x > 0, lambda: (el.log("pos", w * x), w * x)[1], lambda: -w * x)
        return y**2

    g = jax.vmap(jax.grad(loss), in_axes=(None, 0))
    _, logs = el.spool(g)(jnp.float32(2.0), jnp.array([1.0, -1.0, 3.0]))
    np.testing.assert_array_equal(logs.count["pos"], [1, 0, 1])
    np.testing.assert_allclose(logs["pos"][0], [2.0, np.nan, 6.0], equal_nan=True)


@jax.custom_vjp
def _logs_its_cotangent(x):
    return x


def _logs_its_cotangent_fwd(x):
    return x, None


def _logs_its_cotangent_bwd(_, ct):
    el.log("ct", ct)
    return (ct,)


_logs_its_cotangent.defvjp(_logs_its_cotangent_fwd, _logs_its_cotangent_bwd)


@jax.custom_vjp
def _logs_both(x):
    el.log("primal", x)
    return x


def _logs_both_fwd(x):
    el.log("primal", x)
    return x, None


def _logs_both_bwd(_, ct):
    el.log("ct_both", ct)
    return (ct,)


_logs_both.defvjp(_logs_both_fwd, _logs_both_bwd)


@pytest.mark.parametrize("order", ["grad(vmap)", "grad(jit(vmap))", "vmap(grad)"])
def test_custom_vjp_backward_logs_in_a_batched_cond_count_the_lanes_that_take_it(order):
    # the backward rule of a custom_vjp in a cond whose predicate a vmap inside the spool
    # batches (one whose primal does not log, one whose primal logs too; in nested conds):
    # under grad(vmap(...)), JAX traces it when it transposes, after the vmap batched the
    # cond, so the masking interpreter never saw its logs (before: every lane logged, the
    # untaken ones a zero cotangent)
    w = jnp.array([0.5, 2.0, -1.0])
    xs = np.array([[1.0, 2.0, 0.5], [-5.0, -7.0, 1.0], [3.0, -4.0, -1.0], [0.5, 9.0, 2.0]])

    def f(w, x):
        def inner(x):
            return jnp.sum(_logs_its_cotangent(_logs_both(w * x)) ** 2)

        return lax.cond(x[0] > 0, lambda x: lax.cond(x[1] > 0, inner, jnp.sum, x), jnp.sum, x)

    def batch_loss(w, xs):
        batched = jax.vmap(f, in_axes=(None, 0))
        return jnp.sum((jax.jit(batched) if "jit" in order else batched)(w, xs))

    step = (
        jax.vmap(jax.grad(f), in_axes=(None, 0)) if order == "vmap(grad)" else jax.grad(batch_loss)
    )
    _, logs = el.spool(step)(w, jnp.asarray(xs, jnp.float32))
    taken = (xs[:, 0] > 0) & (xs[:, 1] > 0)
    h = np.asarray(w, np.float64) * xs
    for key, want in (("primal", h), ("ct", 2 * h), ("ct_both", 2 * h)):
        np.testing.assert_array_equal(np.ravel(logs.count[key]), taken, key)
        np.testing.assert_allclose(np.asarray(logs[key])[0][taken], want[taken], rtol=1e-6)
