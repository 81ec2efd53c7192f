"""custom_jvp / custom_vjp under spool and tap: user code runs once, derivatives use the user's
rule, and events of the rules are captured or loudly reported, never silently lost.

Execution counts come from a host callback inside the user's code, compared with the same
program without spool or tap.
"""

import warnings

import diffrax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close

import eqx_logs as el
from eqx_logs._primitive import LostEventsWarning


class Counter:
    """Counts executions of the code it is called in (a host callback per call)."""

    def __init__(self):
        self.n = 0

    def __call__(self, x):
        def bump(_):
            self.n += 1

        jax.debug.callback(bump, x)

    def take(self) -> int:
        jax.effects_barrier()
        n, self.n = self.n, 0
        return n


def _vjp_fn(counter):
    @jax.custom_vjp
    def f(x):
        counter(x)
        el.log("f", x)
        return jnp.sin(x)

    def fwd(x):
        return f(x), jnp.cos(x)

    def bwd(cos, g):
        return (5.0 * cos * g,)

    f.defvjp(fwd, bwd)
    return f


def _jvp_fn(counter):
    @jax.custom_jvp
    def h(x):
        counter(x)
        el.log("h", x)
        return x**3

    @h.defjvp
    def h_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return h(x), 7.0 * t

    return h


def _program(counter):
    f, h = _vjp_fn(counter), _jvp_fn(counter)

    def g(x):
        return f(x) + h(x)

    return g


@pytest.mark.parametrize("jit", [False, True])
def test_user_code_runs_once(jit):
    counter = Counter()
    g = _program(counter)
    maybe_jit = jax.jit if jit else (lambda f: f)
    x = jnp.float32(0.5)

    maybe_jit(g)(x)
    plain = counter.take()
    assert plain == 2
    out, logs = maybe_jit(el.spool(g))(x)
    assert counter.take() == plain
    assert_close(out, g(x))
    counter.take()
    assert_close(logs["f"], [0.5])
    assert_close(logs["h"], [0.5])
    events = []
    maybe_jit(el.tap(g, callback=lambda logs, steps: events.append(logs)))(x)
    assert counter.take() == plain
    assert [sorted(e) for e in events] == [["f"], ["h"]]

    maybe_jit(jax.grad(g))(x)
    plain = counter.take()
    gr = maybe_jit(jax.grad(lambda x: el.spool(g)(x)[0]))(x)
    assert counter.take() == plain
    assert_close(gr, 5.0 * np.cos(0.5) + 7.0)  # the user's rules, not the true derivative
    gr, logs = maybe_jit(el.spool(jax.grad(g)))(x)
    assert counter.take() == plain
    assert_close(gr, 5.0 * np.cos(0.5) + 7.0)
    assert_close(logs["f"], [0.5])
    maybe_jit(jax.grad(el.tap(g, callback=lambda logs, steps: None)))(x)
    assert counter.take() == plain


def test_grad_of_spool_takes_events_from_the_forward_rule():
    # Under differentiation the forward rule runs instead of the primal: its events count.
    @jax.custom_vjp
    def f(x):
        el.log("x", x)
        return x * 2

    def fwd(x):
        el.log("x", 10 * x)
        return x * 2, None

    f.defvjp(fwd, lambda _, g: (3 * g,))

    def loss(x):
        out, logs = el.spool(f)(x)
        return out, logs

    (gr, logs) = jax.grad(loss, has_aux=True)(jnp.float32(1.0))
    assert_close(gr, 3.0)
    assert_close(logs["x"], [10.0])
    _, logs = loss(jnp.float32(1.0))
    assert_close(logs["x"], [1.0])


def test_jvp_rule_events():
    @jax.custom_jvp
    def f(x):
        el.log("x", x)
        return jnp.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        el.log("x", 10 * x)  # a key of the primal: in place of its events
        el.log("tangent", t)  # a key the primal does not log: passed on
        return jnp.sin(x), 2.0 * t

    x, t = jnp.float32(1.0), jnp.float32(3.0)
    with pytest.warns(LostEventsWarning, match="custom_jvp function f"):
        (out, logs), (dout, _) = jax.jvp(el.spool(f), (x,), (t,))
    assert_close(dout, 6.0)
    assert_close(logs["x"], [10.0])
    assert "tangent" not in logs

    def outer(x, t):
        return jax.jvp(el.spool(f), (x,), (t,))

    ((_, inner), _), outer_logs = el.spool(outer)(x, t)
    assert_close(inner["x"], [10.0])
    assert_close(outer_logs["tangent"], [3.0])
    assert "x" not in outer_logs  # consumed by the inner spool

    events = []
    with pytest.warns(LostEventsWarning, match="custom_jvp function f"):
        jax.jvp(el.tap(f, callback=lambda logs, steps: events.append(logs)), (x,), (t,))
        jax.effects_barrier()
    assert [float(e["x"]) for e in events] == [10.0]


def _vjp_logging_bwd():
    @jax.custom_vjp
    def g(x):
        return jnp.sin(x)

    def fwd(x):
        return jnp.sin(x), jnp.cos(x)

    def bwd(cos, ct):
        el.log("bwd", ct)
        return (cos * ct,)

    g.defvjp(fwd, bwd)
    return g


@pytest.mark.parametrize("jit", [False, True])
def test_backward_rule_outside_the_spool_warns(jit):
    g = _vjp_logging_bwd()

    def loss(x):
        return el.spool(g)(x)[0]

    maybe_jit = jax.jit if jit else (lambda f: f)
    with pytest.warns(LostEventsWarning, match=r"custom_vjp function g at .*spool\(jax.grad"):
        gr = maybe_jit(jax.grad(loss))(jnp.float32(0.3))
    assert_close(gr, np.cos(0.3))


def test_backward_rule_reaches_an_enclosing_spool():
    g = _vjp_logging_bwd()

    def loss(x):
        return 2.0 * el.spool(g)(x)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("error", LostEventsWarning)
        gr, logs = el.spool(jax.grad(loss))(jnp.float32(0.3))
    assert_close(gr, 2.0 * np.cos(0.3))
    assert_close(logs["bwd"], [2.0])


def test_forward_rule_key_unknown_to_the_primal_passes_on():
    @jax.custom_vjp
    def f(x):
        return x * 2

    def fwd(x):
        el.log("fwd_only", x)
        return x * 2, None

    f.defvjp(fwd, lambda _, g: (2 * g,))

    def loss(x):
        return el.spool(f)(x)[0]

    with pytest.warns(LostEventsWarning, match="fwd_only|custom_vjp function f"):
        jax.grad(loss)(jnp.float32(1.0))
    gr, logs = el.spool(jax.grad(loss))(jnp.float32(1.5))
    assert_close(gr, 2.0)
    assert_close(logs["fwd_only"], [1.5])


def test_rule_logging_more_often_than_primal_is_an_error():
    @jax.custom_vjp
    def f(x):
        el.log("x", x)
        return x

    def fwd(x):
        el.log("x", x)
        el.log("x", x)
        return x, None

    f.defvjp(fwd, lambda _, g: (g,))
    with pytest.raises(ValueError, match="'x' more often than its primal"):
        jax.grad(lambda x: el.spool(f)(x)[0])(jnp.float32(1.0))


def test_a_key_keeps_its_dtype_with_and_without_a_derivative():
    # the primal logs float32, the JVP rule bfloat16: under differentiation the rule's events
    # replace the primal's, so the key's layout would depend on `jax.grad`. Refused with or
    # without a derivative wherever the spool sees both; a cast makes every order agree.
    def make(cast):
        @jax.custom_jvp
        def g(x):
            el.log("k", x)
            return jnp.sin(x)

        @g.defjvp
        def g_jvp(primals, tangents):
            (x,), (dx,) = primals, tangents
            el.log("k", x.astype(cast))
            return jnp.sin(x), jnp.cos(x) * dx

        return lambda x: jnp.sum(g(x))

    f, x = make(jnp.bfloat16), jnp.linspace(0.0, 1.0, 3)
    match = r"'k' is logged with dtype float32 .* bfloat16 in the derivative rule of the custom_jvp"
    with pytest.raises(TypeError, match=match):
        el.spool(f)(x)
    with pytest.raises(TypeError, match="'k' is logged with dtype float32"):
        jax.grad(lambda x: el.spool(f)(x)[0])(x)

    f = make(jnp.float32)
    _, plain = el.spool(f)(x)
    grads, derived = el.spool(jax.grad(f))(x)
    (_, outer), _ = jax.jvp(el.spool(f), (x,), (x,))
    assert_close(grads, np.cos(np.asarray(x)))
    for logs in (plain, derived, outer):
        assert logs["k"].dtype == jnp.float32 and logs["k"].shape == (1, 3)
        assert_close(logs["k"], [x])

    @jax.custom_vjp  # the same for a custom_vjp's forward rule
    def h(x):
        el.log("k", x)
        return x

    h.defvjp(lambda x: (el.log("k", x.astype(jnp.float16)) or x, None), lambda _, g: (g,))
    with pytest.raises(TypeError, match="float16 in the derivative rule of the custom_vjp"):
        el.spool(h)(x)


# -- diffrax: the adjoint is a custom_vjp around Equinox's checkpointed loop ------------------


def _solve(k, counter=None, adjoint=diffrax.RecursiveCheckpointAdjoint()):
    def vector_field(t, y, args):
        if counter is not None:
            counter(y)
        el.log("y", y)
        return -k * y

    term = diffrax.ODETerm(vector_field)
    # 10 steps of 0.1: max_steps bounds them (DirectAdjoint's loop compiles in levels of 16)
    sol = diffrax.diffeqsolve(
        term, diffrax.Tsit5(), 0.0, 1.0, 0.1, jnp.array(1.0), adjoint=adjoint, max_steps=16
    )
    return sol.ys[-1]


@pytest.mark.parametrize(
    "adjoint", [diffrax.RecursiveCheckpointAdjoint(), diffrax.DirectAdjoint()], ids=type
)
def test_diffrax_solve_runs_once(adjoint):
    counter, k = Counter(), jnp.float32(0.7)
    values = []

    def recording(x):  # the vector field's runs counted, its inputs kept as a reference
        counter(x)
        jax.debug.callback(lambda v: values.append(float(v)), x)

    jax.block_until_ready(_solve(k, recording, adjoint))
    plain = counter.take()
    assert plain == len(values) > 10
    out, logs = jax.jit(el.spool(lambda k: _solve(k, counter, adjoint), reduce="mean"))(k)
    assert counter.take() == plain
    assert int(logs.count["y"]) == plain
    assert_close(logs["y"], np.mean(values))
    assert_close(out, np.exp(-0.7))

    want = jax.block_until_ready(jax.grad(lambda k: _solve(k, counter, adjoint))(k))
    plain = counter.take()
    spooled = jax.grad(
        lambda k: el.spool(lambda k: _solve(k, counter, adjoint), reduce="mean")(k)[0]
    )
    gr = spooled(k)
    assert counter.take() == plain
    assert_close(gr, want)
    assert_close(want, -np.exp(-0.7))  # d/dk of y(1) = exp(-k)
