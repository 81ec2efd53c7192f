"""watch: the outputs of named primitives and the carries of loops, in code the tests did not
write (optax, diffrax, optimistix, lineax), against the same values threaded out by hand or
computed in numpy; under jit, vmap and grad."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import at_default_level
from jax import lax

import eqx_logs as el

fast = pytest.mark.fast


# -- a while loop and a scan written here, with their iterates in numpy ------------------


def newton_sqrt(a):
    """sqrt(a) by Newton's iteration in a while loop: the carry is (iteration, x)."""

    def cond(c):
        i, x = c
        return (jnp.abs(x * x - a) > 1e-5 * a) & (i < 40)

    def body(c):
        i, x = c
        return i + 1, 0.5 * (x + a / x)

    return lax.while_loop(cond, body, (0, a))[1]


def np_newton(a: float) -> list[float]:
    """The carries `newton_sqrt` takes after each iteration, in float32 as JAX computes them."""
    x, xs = np.float32(a), []
    while abs(x * x - a) > 1e-5 * a and len(xs) < 40:
        x = np.float32(0.5) * (x + np.float32(a) / x)
        xs.append(x)
    return xs


STACK = el.Stack(capacity=40)


@fast
def test_a_while_loops_carry_at_each_iteration_against_numpy():
    spooled = el.spool(newton_sqrt, watch="while", reduce=STACK)
    out, logs = spooled(jnp.float32(10.0))
    want = np_newton(10.0)
    assert set(logs) == {"watch/while[0]/carry/0", "watch/while[0]/carry/1"}
    assert logs.count["watch/while[0]/carry/1"] == len(want)
    np.testing.assert_allclose(logs["watch/while[0]/carry/1"][: len(want)], want, rtol=1e-6)
    np.testing.assert_array_equal(
        logs["watch/while[0]/carry/0"][: len(want)], 1 + np.arange(len(want))
    )
    assert float(out) == pytest.approx(want[-1])
    # eager and jitted equal, in every part
    _, jitted = jax.jit(spooled)(jnp.float32(10.0))
    assert jax.tree.all(
        jax.tree.map(lambda a, b: np.array_equal(a, b, equal_nan=True), logs, jitted)
    )
    assert dict(logs.count) == dict(jitted.count)


def test_under_vmap_each_lane_is_its_own_run():
    """Lanes stop after different numbers of iterations: a finished lane's carries are left
    out, as its own run would have none."""
    spooled = el.spool(newton_sqrt, watch="while", reduce=STACK)
    xs = jnp.array([2.0, 10.0, 1000.0], jnp.float32)
    _, batched = jax.vmap(spooled)(xs)
    for i, a in enumerate([2.0, 10.0, 1000.0]):
        want = np_newton(a)
        key = "watch/while[0]/carry/1"
        assert int(batched.count[key][i]) == len(want)
        np.testing.assert_allclose(batched[key][i][: len(want)], want, rtol=1e-6)
        _, alone = spooled(xs[i])
        np.testing.assert_array_equal(batched[key][i], alone[key])


def fixed_newton(a):
    """Six Newton steps in a scan: differentiable."""

    def body(x, _):
        return 0.5 * (x + a / x), None

    return lax.scan(body, a, None, length=6)[0]


@fast
def test_under_grad_the_forward_carries_are_recorded_once_and_fun_traced_once():
    traced = []

    def f(a):
        traced.append(1)
        return fixed_newton(a)

    def loss(a):
        out, logs = el.spool(f, watch="scan")(a)
        return out, logs

    (grad, logs) = jax.grad(loss, has_aux=True)(jnp.float32(5.0))
    assert len(traced) == 1
    x, want = np.float32(5.0), []
    for _ in range(6):
        x = np.float32(0.5) * (x + np.float32(5.0) / x)
        want.append(x)
    assert logs.count["watch/scan[0]/carry/0"] == 6
    np.testing.assert_allclose(logs["watch/scan[0]/carry/0"], want, rtol=1e-6)
    assert float(grad) == pytest.approx(0.5 / np.sqrt(5.0), rel=1e-4)
    # a spool around the derivative watches its forward pass only, by default
    _, inside = el.spool(jax.grad(fixed_newton), watch="scan")(jnp.float32(5.0))
    assert dict(inside.count) == {"watch/scan[0]/carry/0": 6}
    np.testing.assert_allclose(inside["watch/scan[0]/carry/0"], want, rtol=1e-6)
    _, both = el.spool(jax.grad(fixed_newton), watch=el.Watch("scan", backward=True))(
        jnp.float32(5.0)
    )
    assert len(both.count) > 1 and all(n == 6 for n in both.count.values())


def test_cotangents_with_grads_true_against_vjp():
    def f(a):
        return jnp.sum(jnp.linalg.cholesky(a @ a.T + 3 * jnp.eye(3)) ** 2)

    a = jnp.arange(9.0).reshape(3, 3) / 10
    watched = el.watch(f, "cholesky", stats=None, grads=True)
    (_, logs) = el.spool(lambda a: jax.grad(watched)(a))(a)
    chol = np.linalg.cholesky(np.asarray(a @ a.T + 3 * jnp.eye(3), np.float64))
    np.testing.assert_allclose(logs["watch/cholesky[0]"][0], chol, rtol=1e-5)
    # the cotangent of sum(L**2) with respect to L is 2 L
    np.testing.assert_allclose(logs["watch/cholesky[0]/grad"][0], 2 * chol, rtol=1e-5)
    # tagged "backward" (and "watch"), as log_grad's events
    _, backward = el.spool(lambda a: jax.grad(watched)(a), tags="backward")(a)
    assert set(backward) == {"watch/cholesky[0]/grad"}


# -- primitives, inside jit, with statistics ------------------------------------------------


@fast
def test_a_primitive_inside_a_jitted_function_with_its_statistics():
    @jax.jit
    def layer(w, x):
        return jnp.tanh(w @ x)

    def f(w, x):
        return layer(w, layer(w, x)).sum()

    w = jnp.array([[0.5, -1.0, 0.25], [1.5, 0.2, -0.3], [0.1, 0.7, 2.0]])
    x = jnp.array([1.0, 2.0, 3.0])
    _, logs = el.spool(f, watch="tanh")(w, x)
    h1 = np.tanh(np.asarray(w, np.float64) @ np.asarray(x, np.float64))
    h2 = np.tanh(np.asarray(w, np.float64) @ h1)
    # a jit is transparent: its equations are addressed as if inlined (the two calls of
    # `layer` are tanh[0] and tanh[1])
    for j, h in enumerate([h1, h2]):
        stats = {
            "mean": h.mean(),
            "std": h.std(),
            "rms": np.sqrt((h**2).mean()),
            "absmax": np.abs(h).max(),
            "nonfinite": 0,
        }
        for s, v in stats.items():
            np.testing.assert_allclose(logs[f"watch/tanh[{j}]/{s}"][0], v, rtol=1e-5, atol=1e-7)
    assert len(logs) == 10


def test_where_and_max_depth_filter_addresses():
    def f(xs):
        def outer(c, x):
            def inner(d, y):
                return d + jnp.sin(y), None

            return lax.scan(inner, c, x)[0], None

        c = lax.scan(outer, 0.0, xs)[0]
        return jnp.sin(c)

    xs = jnp.arange(6.0).reshape(2, 3)
    _, logs = el.spool(f, watch=el.Watch("sin", stats=None))(xs)
    assert set(logs) == {"watch/sin[0]", "watch/scan[0]/scan[0]/sin[0]"}
    assert logs.count["watch/scan[0]/scan[0]/sin[0]"] == 6
    np.testing.assert_allclose(
        logs["watch/scan[0]/scan[0]/sin[0]"], np.sin(np.arange(6.0)), rtol=1e-6
    )
    _, top = el.spool(f, watch=el.Watch("sin", stats=None, max_depth=0))(xs)
    assert set(top) == {"watch/sin[0]"}
    _, some = el.spool(f, watch=el.Watch("sin", stats=None, where="watch/scan*"))(xs)
    assert set(some) == {"watch/scan[0]/scan[0]/sin[0]"}


@fast
def test_a_name_matching_nothing_is_said_with_the_closest():
    with pytest.warns(
        UserWarning, match=r"watch='cholesy' matches nothing.*did you mean 'cholesky'"
    ):
        el.spool(lambda m: jnp.linalg.cholesky(m), watch="cholesy")(jnp.eye(2))
    with pytest.raises(TypeError, match="eqx_logs.Watch"):
        el.Watch(3)
    with pytest.raises(TypeError, match=r"watch=3"):
        el.spool(lambda x: x, watch=3)


def test_tap_delivers_the_watched_events():
    got = []
    tapped = el.tap(newton_sqrt, callback=lambda logs, steps: got.append(logs), watch="while")
    out = tapped(jnp.float32(10.0))
    want = np_newton(10.0)
    carries = [float(e["watch/while[0]/carry/1"]) for e in got if "watch/while[0]/carry/1" in e]
    np.testing.assert_allclose(carries, want, rtol=1e-6)
    assert float(out) == pytest.approx(want[-1])


def test_the_scope_around_the_call_and_the_policy_option():
    def f(a):
        with el.scope("solver"):
            return el.watch(newton_sqrt, "while")(a)

    _, logs = el.spool(f, reduce="last")(jnp.float32(10.0))
    np.testing.assert_allclose(
        logs["solver/watch/while[0]/carry/1"], np_newton(10.0)[-1], rtol=1e-6
    )
    policy = el.Policy(watch=["while"], reduce="last")
    _, logs = el.spool(newton_sqrt, policy=policy)(jnp.float32(10.0))
    np.testing.assert_allclose(logs["watch/while[0]/carry/1"], np_newton(10.0)[-1], rtol=1e-6)


def test_a_loggers_forms_write_the_watched_carries(tmp_path):
    """`logger.jit(step="i", interval=2)`: the carries of the kept calls, each at its call's
    step (watched inside the step's scope: no warning, the calls between intervals run
    without logs); `logger.tap` and `logger.spool` write the same values. Read back with the
    backend's reader, against numpy."""
    from eqx_logs.loggers import JsonlLogger, read_jsonl

    spec = el.Watch("while", where="*/carry/1")

    def step(a, i):
        return newton_sqrt(a)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with JsonlLogger(tmp_path / "jit.jsonl") as logger:
            jitted = logger.jit(step, logger.init(), watch=spec, reduce=STACK, interval=2, step="i")
            for i in range(5):
                jitted(jnp.float32(2 + i), i)
        with JsonlLogger(tmp_path / "tap.jsonl") as logger:
            logger.tap(step, logger.init(), watch=spec)(jnp.float32(3.0), 0)
        with JsonlLogger(tmp_path / "spool.jsonl") as logger:
            logger.spool(step, logger.init(), watch=spec, reduce=STACK)(jnp.float32(3.0), 0)
    rows = [(r["key"], r["step"], r["value"]) for r in read_jsonl(tmp_path / "jit.jsonl")]
    want = [("watch/while[0]/carry/1", i, v) for i in (0, 2, 4) for v in np_newton(2 + i)]
    assert [r[:2] for r in rows] == [w[:2] for w in want]
    np.testing.assert_allclose([r[2] for r in rows], [w[2] for w in want], rtol=1e-6)
    for name in ("tap", "spool"):
        values = [r["value"] for r in read_jsonl(tmp_path / f"{name}.jsonl")]
        np.testing.assert_allclose(values, np_newton(3.0), rtol=1e-6)


def test_the_transform_inside_a_scope_takes_its_steps():
    def step(a, i):
        with el.scope(step=i):
            return el.watch(newton_sqrt, "while", where="*/carry/1")(a)

    _, logs = el.spool(step, reduce=STACK)(jnp.float32(2.0), jnp.int32(7))
    n = len(np_newton(2.0))
    key = "watch/while[0]/carry/1"
    np.testing.assert_allclose(logs[key][:n], np_newton(2.0), rtol=1e-6)
    assert logs.steps["step"][key][:n].tolist() == [7] * n


def test_nothing_is_watched_outside_a_spool():
    watched = el.watch(newton_sqrt, "while")
    np.testing.assert_allclose(watched(jnp.float32(10.0)), newton_sqrt(jnp.float32(10.0)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.jit(watched)(jnp.float32(10.0))


# -- real libraries: optax, diffrax, optimistix, lineax -------------------------------------


@pytest.mark.usefixtures("standard_promotion")  # optax's Adam (see conftest.py)
def test_optax_adam_first_step_sqrt_is_the_gradients_magnitude():
    """Adam's first step divides by sqrt(nu_hat), and nu_hat = g**2 there."""
    import optax

    params = {"a": jnp.array([1.0, -2.0]), "b": jnp.array([[0.5, 3.0]])}
    grads = {"a": jnp.array([0.3, -0.1]), "b": jnp.array([[2.0, -4.0]])}
    opt = optax.adam(1e-3)

    def step(grads, params):
        updates, _ = opt.update(grads, opt.init(params), params)
        return optax.apply_updates(params, updates)

    new, logs = jax.jit(el.spool(step, watch=el.Watch("sqrt", stats=None)))(grads, params)
    assert set(logs) == {"watch/sqrt[0]", "watch/sqrt[1]"}  # one per leaf, in leaf order
    np.testing.assert_allclose(logs["watch/sqrt[0]"][0], np.abs(grads["a"]), rtol=1e-4)
    np.testing.assert_allclose(logs["watch/sqrt[1]"][0], np.abs(grads["b"]), rtol=1e-4)
    want = jax.tree.map(lambda p, g: p - 1e-3 * np.sign(g), params, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), new, want)


def np_cube_root_newton(a: float, y: float = 1.0, n: int = 7) -> list[float]:
    out = []
    for _ in range(n):
        y = np.float32(y - (y**3 - a) / (3 * y**2))
        out.append(float(y))
    return out


def _root(a):
    import optimistix as optx

    solver = optx.Newton(rtol=1e-6, atol=1e-6)
    return optx.root_find(lambda y, a: y**3 - a, solver, jnp.array(1.0), args=a, max_steps=32).value


ROOT_KEY = "watch/while[0]/carry/3"  # optimistix's Newton: the iterate y, in its carry


def test_optimistix_newton_iterates_under_jit_vmap_and_grad():
    spooled = el.spool(_root, watch=el.Watch("while", where=ROOT_KEY), reduce=el.Stack(capacity=32))
    out, logs = jax.jit(spooled)(jnp.float32(8.0))
    n = int(logs.count[ROOT_KEY])
    assert set(logs) == {ROOT_KEY}
    np.testing.assert_allclose(logs[ROOT_KEY][:n], np_cube_root_newton(8.0, n=n), rtol=1e-5)
    assert abs(logs[ROOT_KEY][n - 1] - 2.0) < 1e-5 and float(out) == pytest.approx(2.0)
    # each lane its own run: lanes stop after different numbers of iterations
    # (bit for bit, as a user's default compile gives them: `at_default_level`)
    _, batched = at_default_level(jax.vmap(spooled))(jnp.array([8.0, 1000.0]))
    for i, a in enumerate([8.0, 1000.0]):
        _, alone = at_default_level(spooled)(jnp.float32(a))
        assert int(batched.count[ROOT_KEY][i]) == int(alone.count[ROOT_KEY])
        np.testing.assert_array_equal(batched[ROOT_KEY][i], alone[ROOT_KEY])
    assert int(batched.count[ROOT_KEY][0]) != int(batched.count[ROOT_KEY][1])
    # under grad (optimistix differentiates implicitly: a custom_jvp), the forward once
    grad, graded = jax.grad(spooled, has_aux=True)(jnp.float32(8.0))
    assert float(grad) == pytest.approx(1 / 12, rel=1e-4)
    assert int(graded.count[ROOT_KEY]) == n
    np.testing.assert_array_equal(graded[ROOT_KEY], logs[ROOT_KEY])


def test_diffrax_steps_are_the_outer_loops_iterations():
    import diffrax

    def solve(y0):
        return diffrax.diffeqsolve(
            diffrax.ODETerm(lambda t, y, args: -y),
            diffrax.Tsit5(),
            0.0,
            1.0,
            0.1,
            y0,
            stepsize_controller=diffrax.PIDController(rtol=1e-6, atol=1e-8),
            saveat=diffrax.SaveAt(steps=True),
            max_steps=64,
        )

    watch = el.Watch("while", stats=None, where="watch/while[0]/carry/*")  # the steps' loop
    sol, logs = jax.jit(el.spool(solve, watch=watch, reduce=el.Stack(capacity=64)))(
        jnp.array([1.0, 2.0])
    )
    counts = {int(c) for c in logs.count.values()}
    assert counts == {int(sol.stats["num_steps"])}  # one event per step, accepted or not
    # the carry leaf that is y holds, after the last step, the solution at t1
    n = int(sol.stats["num_accepted_steps"])
    y1 = np.asarray(sol.ys[n - 1])
    np.testing.assert_allclose(y1, np.exp(-1.0) * np.array([1.0, 2.0]), rtol=1e-5)
    assert n >= 5
    (steps,) = counts
    last = [np.asarray(v[steps - 1]) for v in logs.values() if np.shape(v)[1:] == (2,)]
    assert any(np.allclose(v, y1, rtol=1e-6) for v in last)


def checkpointed_halving(x):
    """The issue's repro: Equinox's checkpointed while loop (a custom_vjp whose forward rule
    runs another loop, carrying checkpoints), three halvings of `x`."""
    import equinox as eqx

    def body(c):
        i, v = c
        return i + 1, v * 0.5

    loop = eqx.internal.while_loop
    return loop(lambda c: c[0] < 3, body, (0, x), max_steps=4, kind="checkpointed")[1]


def test_under_grad_equinox_checkpointed_loop_keeps_its_addresses():
    """`jax.grad(spool(f, watch=...))`: the forward rule runs instead of the primal, but the
    address still names the primal's carry leaf (Equinox's carry: step, two flags, then the
    user's `(i, v)`), each value once."""
    w = el.Watch("while", where="watch/while[0]/carry/3", stats=None)

    def loss(x):
        return el.spool(checkpointed_halving, watch=w, reduce=el.Stack(capacity=4))(x)

    key = "watch/while[0]/carry/3"
    plain = loss(8.0)[1]
    np.testing.assert_array_equal(plain[key], [1, 2, 3, 0])  # i after each iteration
    grad, graded = jax.grad(loss, has_aux=True)(8.0)
    np.testing.assert_array_equal(graded[key], [1, 2, 3, 0])
    assert int(graded.count[key]) == 3
    assert float(grad) == 0.125  # d(x / 8)/dx

    # every leaf, reduced to the last: the same keys and values with and without grad
    # (there was a dtype conflict at a key the forward rule's loop made)
    def every(x):
        return el.spool(checkpointed_halving, watch="while", reduce="last")(x)

    _, last = every(8.0)
    _, graded = jax.grad(every, has_aux=True)(8.0)
    assert sorted(graded) == sorted(last) == [f"watch/while[0]/carry/{i}" for i in range(5)]
    assert float(last["watch/while[0]/carry/4"]) == 1.0  # 8 * 0.5**3
    for k in last:
        assert graded[k].dtype == last[k].dtype
        np.testing.assert_array_equal(graded[k], last[k])

    # a spool around the derivative: its forward rule's loop (3 iterations) only; Equinox's
    # backward pass recomputes in a loop of its own (4), watched with backward=True
    def loops(watch):
        _, logs = el.spool(jax.grad(checkpointed_halving), watch=watch, reduce="last")(8.0)
        return {k.split("/carry/")[0]: int(n) for k, n in logs.count.items()}

    assert loops(el.Watch("while", stats=None)) == {"watch/while[0]": 3}
    both = loops(el.Watch("while", stats=None, backward=True))
    assert both == {"watch/while[0]": 3, "watch/while[1]": 4}


def test_under_grad_the_replayed_primal_calls_no_callback_again():
    """Differentiated, a custom_vjp's primal runs once more for its watched values alone: a
    host callback in it (a zero-output effect, which computes no watched value) still runs
    as often as without watch, counted on the host."""
    import equinox as eqx

    calls = []

    def f(x):
        def body(c):
            i, v = c
            jax.debug.callback(lambda i: calls.append(int(i)), i)
            return i + 1, v * 0.5

        loop = eqx.internal.while_loop
        return loop(lambda c: c[0] < 3, body, (0, x), max_steps=4, kind="checkpointed")[1]

    def loss(watch):
        return lambda x: el.spool(f, watch=watch, reduce="last")(x)

    jax.grad(loss(None), has_aux=True)(8.0)
    jax.effects_barrier()
    unwatched, calls[:] = list(calls), []
    _, logs = jax.grad(loss("while"), has_aux=True)(8.0)
    jax.effects_barrier()
    assert sorted(calls) == sorted(unwatched) and len(unwatched) >= 3
    assert float(logs["watch/while[0]/carry/4"]) == 1.0  # 8 * 0.5**3, watched once more


def test_under_grad_diffrax_default_adjoint_watches_the_state():
    """diffrax's Tsit5 with its default adjoint (`RecursiveCheckpointAdjoint`: Equinox's
    checkpointed loop): under grad the state's key holds the states `SaveAt(steps=True)`
    saves without grad, one per step (it held a checkpoint counter)."""
    import diffrax

    def solve(y0):
        term = diffrax.ODETerm(lambda t, y, args: -y)
        saveat = diffrax.SaveAt(steps=True)
        return diffrax.diffeqsolve(
            term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, saveat=saveat, max_steps=16
        )

    watch = el.Watch("while", stats=None, where="watch/while[0]/carry/*")
    spooled = el.spool(solve, watch=watch, reduce=el.Stack(capacity=16))
    y0 = jnp.array([1.0, 2.0])
    sol, logs = jax.jit(spooled)(y0)
    n = int(sol.stats["num_steps"])
    ys = np.asarray(sol.ys[:n])
    assert n == 10
    np.testing.assert_allclose(ys[-1], np.exp(-1.0) * np.array([1.0, 2.0]), rtol=1e-5)
    (key,) = [k for k, v in logs.items() if v.shape[1:] == (2,) and np.allclose(v[:n], ys)]

    def loss(y0):
        sol, logs = spooled(y0)
        return jnp.sum(sol.ys[n - 1]), logs

    grad, graded = jax.jit(jax.grad(loss, has_aux=True))(y0)
    np.testing.assert_allclose(grad, np.exp(-1.0) * np.ones(2), rtol=1e-4)
    assert sorted(graded) == sorted(logs)
    assert int(graded.count[key]) == n
    np.testing.assert_array_equal(graded[key][:n], ys)


def test_a_vmap_inside_batching_a_while_predicate_logs_each_lane_as_alone():
    """`spool(jax.vmap(f), watch="while")` where the vmap batches the loop's predicate: the
    loop runs while any lane runs; each lane's carry is logged for the iterations it runs,
    equal to the lane run alone (no events for a finished lane)."""

    def f(n):
        return lax.while_loop(lambda c: c < n, lambda c: c + 1, 0)

    n = jnp.array([2, 5])
    key = "watch/while[0]/carry/0"
    out, logs = el.spool(jax.vmap(f), watch="while", reduce=el.Stack(capacity=8))(n)
    np.testing.assert_array_equal(out, [2, 5])
    np.testing.assert_array_equal(logs.count[key], [2, 5])
    for i in range(2):
        _, alone = el.spool(f, watch="while", reduce=el.Stack(capacity=8))(n[i])
        np.testing.assert_array_equal(logs[key][:, i], alone[key])
        np.testing.assert_array_equal(alone[key][: int(n[i])], 1 + np.arange(int(n[i])))
    # two vmaps: a predicate batched on two axes
    m = jnp.array([[1, 4], [3, 2]])
    _, last = el.spool(jax.vmap(jax.vmap(f)), watch="while", reduce="last")(m)
    np.testing.assert_array_equal(last[key], m)
    np.testing.assert_array_equal(last.count[key], m)


def test_calls_are_transparent_and_a_jits_name_is_not_watched():
    """The documented addresses: a cholesky inside a jitted function is `watch/cholesky[0]`
    (calls are transparent), one inside a while loop `watch/while[0]/cholesky[0]`; a jitted
    function's name watches nothing, and the warning says why."""

    @jax.jit
    def solve(a):
        return jnp.linalg.cholesky(a)

    def f(a):
        def body(c):
            i, m = c
            return i + 1, jnp.linalg.cholesky(m) + jnp.eye(2)

        return solve(a), lax.while_loop(lambda c: c[0] < 1, body, (0, a))[1]

    a = jnp.array([[4.0, 2.0], [2.0, 3.0]])
    _, logs = el.spool(f, watch=el.Watch("cholesky", stats=None), reduce="last")(a)
    assert sorted(logs) == ["watch/cholesky[0]", "watch/while[0]/cholesky[0]"]
    want = np.linalg.cholesky(np.asarray(a))
    np.testing.assert_allclose(np.tril(logs["watch/cholesky[0]"]), want, rtol=1e-6)
    np.testing.assert_allclose(np.tril(logs["watch/while[0]/cholesky[0]"]), want, rtol=1e-6)
    with pytest.warns(UserWarning, match=r"watch='solve'.*jitted function's name"):
        _, none = el.spool(f, watch="solve")(a)
    assert dict(none) == {}


def test_the_watch_warnings_name_the_callers_line(tmp_path):
    """ "matches nothing" and "where= keeps none" point at the line that calls: a spool, an
    `eqx.filter_jit` of one, and a logger's `jit` and `spool`."""
    import sys

    import equinox as eqx

    from eqx_logs.loggers import JsonlLogger

    x = jnp.float32(2.0)
    nowhere = el.Watch("while", where="nowhere")

    def caught(call):
        line = sys._getframe(1).f_lineno
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            call()
        (w,) = [w for w in got if "watch=" in str(w.message) or "where=" in str(w.message)]
        assert (w.filename, w.lineno) == (__file__, line), str(w.message)

    caught(lambda: el.spool(newton_sqrt, watch="whle")(x))
    caught(lambda: el.spool(newton_sqrt, watch=nowhere)(x))
    caught(lambda: eqx.filter_jit(el.spool(newton_sqrt, watch="whle"))(x))
    with JsonlLogger(tmp_path / "log.jsonl") as logger:
        step = logger.jit(lambda a, i: newton_sqrt(a), logger.init(), watch="whle", step="i")
        caught(lambda: step(x, 0))
        elsewhere = el.Watch("while", max_depth=0, where="*/carry/1")  # (a trace of its own)
        caught(lambda: logger.spool(newton_sqrt, logger.init(), watch=elsewhere)(x))


def test_lineax_linear_solve_and_its_lu():
    import lineax as lx

    a = jnp.array([[3.0, 1.0], [1.0, 2.0]])
    b = jnp.array([1.0, 1.0])

    def solve(a, b):
        return lx.linear_solve(lx.MatrixLinearOperator(a), b, lx.LU()).value

    x, logs = el.spool(solve, watch=el.Watch("linear_solve", "lu", stats=None))(a, b)
    want = np.linalg.solve(np.asarray(a, np.float64), np.asarray(b, np.float64))
    np.testing.assert_allclose(logs["watch/linear_solve[0]/0"][0], want, rtol=1e-6)
    np.testing.assert_allclose(x, want, rtol=1e-6)
    # LAPACK's packed LU of a: U above the diagonal, L's multipliers below
    np.testing.assert_allclose(
        logs["watch/lu[0]/0"][0], [[3.0, 1.0], [1 / 3, 2 - 1 / 3]], rtol=1e-6
    )
    # under grad: the same forward values
    spooled = el.spool(lambda a, b: solve(a, b).sum(), watch="linear_solve")
    g, graded = jax.grad(spooled, argnums=1, has_aux=True)(a, b)
    np.testing.assert_allclose(g, np.linalg.solve(np.asarray(a).T, np.ones(2)), rtol=1e-5)
    assert int(graded.count["watch/linear_solve[0]/0/mean"]) == 1


# -- first_nonfinite="any": the first operation with a NaN or an infinity --------------------


def diverging(xs):
    def body(c, x):
        y = jnp.log(c + x)  # THE LOG: c + x < 0 at the fourth step
        return c + 0.5 * jnp.exp(y), y

    c, ys = lax.scan(body, 1.0, xs)
    return jnp.sum(ys) / c


def _line_of(fun, marker: str) -> int:
    import inspect

    lines, start = inspect.getsourcelines(fun)
    return start + next(i for i, s in enumerate(lines) if marker in s)


@fast
def test_any_operation_forward_against_numpy():
    xs = jnp.array([1.0, 2.0, 0.5, -10.0, 3.0])
    c, first = 1.0, None  # numpy: the first step whose log is not finite
    with np.errstate(all="ignore"):
        for i, x in enumerate(np.asarray(xs)):
            y = np.log(np.float32(c + x))
            if not np.isfinite(y) and first is None:
                first = i
            c = c + 0.5 * np.exp(y)
    spooled = el.spool(diverging, first_nonfinite="any")
    _, logs = spooled(xs)
    report = logs.first_nonfinite
    assert report.iterations == (first,) == (3,)
    assert report.operation == "log at scan[0]/log[0]" and not report.backward
    assert report.site.endswith(f":{_line_of(diverging, 'THE LOG')} (diverging.<locals>.body)")
    assert "the output of log at scan[0]/log[0], loop iteration 3" in str(report)
    _, jitted = jax.jit(spooled)(xs)
    assert jitted.first_nonfinite == report
    assert int(logs.count["first_nonfinite/checked"]) == int(
        jitted.count["first_nonfinite/checked"]
    )
    _, fine = spooled(jnp.abs(xs))
    assert fine.first_nonfinite is None


@fast
def test_any_operation_inside_a_shard_map_names_the_device():
    # the body is checked on each device (one here; the lowest-numbered of several reported:
    # tests/test_devices.py), under a key of its own; the input checked outside, as before
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dev",))
    P = jax.sharding.PartitionSpec
    sharded = jax.shard_map(diverging, mesh=mesh, in_specs=P(), out_specs=P())
    xs = jnp.array([1.0, 2.0, 0.5, -10.0, 3.0])
    spooled = el.spool(sharded, first_nonfinite="any")
    _, logs = spooled(xs)
    report = logs.first_nonfinite
    _, alone = el.spool(diverging, first_nonfinite="any")(xs)  # the same, outside any device
    assert alone.first_nonfinite.device is None
    assert report.iterations == alone.first_nonfinite.iterations == (3,)
    assert report.operation == "log at shard_map[0]/scan[0]/log[0]" and report.device == 0
    assert report.site == alone.first_nonfinite.site
    assert report.key == "first_nonfinite/checked@dev"
    assert "loop iteration 3, device 0;" in str(report)
    assert jax.jit(spooled)(xs)[1].first_nonfinite == report
    assert spooled(jnp.abs(xs))[1].first_nonfinite is None
    _, given = spooled(xs.at[1].set(jnp.nan))  # an input: before the shard_map, on no device
    assert given.first_nonfinite.operation == "the function's input 0"
    assert given.first_nonfinite.device is None


@jax.custom_vjp
def _through(x):
    return x


_through.defvjp(lambda x: (x, x), lambda x, ct: (ct / x,))  # THE DIVISION, in the backward pass


def test_any_operation_backward_and_inputs_and_lanes():
    def f(x):
        return jnp.sum(2.0 * _through(x))  # THE CALL

    _, logs = el.spool(jax.grad(f), first_nonfinite="any")(jnp.array([1.0, 0.0]))
    report = logs.first_nonfinite
    assert report.backward and report.iterations == () and report.operation.startswith("div at")
    # the site: the line of this file that led there (the call of the custom_vjp function)
    assert report.site.endswith(f":{_line_of(f, 'THE CALL')} ({f.__qualname__})")
    # the forward pass alone is finite there
    _, forward = el.spool(f, first_nonfinite="any")(jnp.array([1.0, 0.0]))
    assert forward.first_nonfinite is None
    # a non-finite input is named as such
    _, given = el.spool(f, first_nonfinite="any")(jnp.array([1.0, jnp.inf]))
    assert given.first_nonfinite.operation == "the function's input 0"
    # under vmap: each lane its own run, its own report
    xs = jnp.array([[1.0, 2.0, 0.5, -10.0, 3.0], [1.0, -5.0, 1.0, 1.0, 1.0], [1.0] * 5])
    _, batched = jax.vmap(el.spool(diverging, first_nonfinite="any"))(xs)
    for i in range(3):
        _, alone = el.spool(diverging, first_nonfinite="any")(xs[i])
        assert batched.first_nonfinite[i] == alone.first_nonfinite
    assert [r and r.iterations for r in batched.first_nonfinite] == [(3,), (1,), None]
    with pytest.raises(TypeError, match=r'first_nonfinite=.anything.*"any"'):
        el.Policy(first_nonfinite="anything")


def test_any_operation_in_a_diffrax_solve_that_blows_up():
    """y' = y**2 by Euler's method overflows; the report names the vector field's square, at
    the step where numpy's Euler iteration first squares a value past float32's range."""
    import diffrax

    dt = 0.05

    def solve(y0):
        term = diffrax.ODETerm(lambda t, y, args: y**2)  # THE SQUARE
        return diffrax.diffeqsolve(
            term, diffrax.Euler(), 0.0, 3.0, dt, y0, adjoint=diffrax.ForwardMode(), max_steps=80
        ).ys

    def np_first(y0: float) -> int:
        y = np.float32(y0)
        with np.errstate(over="ignore"):
            for n in range(80):
                if not np.isfinite(y * y):
                    return n
                y = y + np.float32(dt) * (y * y)
        raise AssertionError("no overflow")

    spooled = jax.jit(el.spool(solve, first_nonfinite="any"))
    _, logs = spooled(jnp.float32(1.0))
    report = logs.first_nonfinite
    assert report.operation.startswith("integer_pow at while[0]/") and not report.backward
    assert report.iterations == (np_first(1.0),)
    assert f"test_watch.py:{_line_of(solve, 'THE SQUARE')} (" in report.site
    # each lane its own run
    _, batched = jax.vmap(spooled)(jnp.array([1.0, 0.5]))
    assert [r.iterations for r in batched.first_nonfinite] == [(np_first(1.0),), (np_first(0.5),)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64", "complex64"])
def test_any_operation_finds_one_element_the_program_masks_away(dtype):
    """One element of a large product overflows and the program drops it with a `where`: the
    search still names the product, at each floating dtype, under strict promotion. Where the
    bad element is, is computed in numpy."""
    n = 1 << 12  # (the sum of n ones is finite in float16)
    big = float(jnp.finfo(dtype).max)

    def f(x, s):
        y = x * s  # THE PRODUCT
        return jnp.sum(jnp.where(jnp.isfinite(y), y, jnp.zeros((), y.dtype)))

    x = np.ones(n)
    x[n // 3] = big
    with np.errstate(all="ignore"):
        y = x.astype(jnp.dtype(dtype)) * np.asarray(4, jnp.dtype(dtype))
    assert np.flatnonzero(~np.isfinite(y)).tolist() == [n // 3]
    with jax.numpy_dtype_promotion("strict"), jax.enable_x64(dtype == "float64"):
        spooled = jax.jit(el.spool(f, first_nonfinite="any"))
        x, four = jnp.asarray(x, dtype), jnp.asarray(4, dtype)
        _, logs = spooled(x, four)
        assert logs.first_nonfinite.operation.startswith("mul at ")
        assert f"test_watch.py:{_line_of(f, 'THE PRODUCT')} (" in logs.first_nonfinite.site
        _, fine = spooled(jnp.ones(n, dtype), four)
        assert fine.first_nonfinite is None


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_any_operation_scaling_by_a_literal(dtype):
    """Scaling by a literal of at most 1, or adding one, is not checked (it cannot overflow:
    numpy agrees at the dtype's largest value); scaling by 3 can, and is named."""
    top = jnp.finfo(dtype).max
    with np.errstate(over="ignore"):
        assert np.isfinite(np.array([top * 0.5, top / 2, top + 1, top - 1], dtype)).all()
        assert not np.isfinite(np.array(top, dtype) * np.array(3, dtype))

    def f(x):
        shrunk = 0.5 * x + 1.0 - x / 2.0 + (x - 1.0)
        return shrunk * 3.0  # THE TRIPLING

    with jax.numpy_dtype_promotion("strict"):
        spooled = jax.jit(el.spool(f, first_nonfinite="any"))
        _, logs = spooled(jnp.full(4, top, dtype))
        report = logs.first_nonfinite
        assert report.operation.startswith("mul at ")
        assert f"test_watch.py:{_line_of(f, 'THE TRIPLING')} (" in report.site
        _, fine = spooled(jnp.full(4, 2.0, dtype))
        assert fine.first_nonfinite is None


def test_any_operation_with_empty_and_scalar_outputs():
    def f(x, empty):
        return jnp.sum(jnp.exp(empty)) + jnp.exp(x) * 2.0  # THE EXP

    spooled = el.spool(f, first_nonfinite="any")
    _, logs = spooled(jnp.float32(1.0), jnp.zeros((0, 3)))
    assert logs.first_nonfinite is None
    _, logs = spooled(jnp.float32(100.0), jnp.zeros((0, 3)))  # exp(100) overflows float32
    assert logs.first_nonfinite.operation.startswith("exp at ")


def test_any_operation_in_optax_adam_with_no_epsilon():
    """optax's adam with `eps=0`: a parameter whose gradient is 0 at the first step gets
    `0 / (sqrt(0) + 0)`, a NaN made inside optax, which the search names (a `div`, as
    `jax.debug_nans` does), at the line of the `update` call; numpy computes the same update.
    Under jit, vmap (a lane whose gradients are all nonzero finds nothing) and grad."""
    import optax

    opt = optax.adam(1e-2, eps=0.0)

    def step(w, scale):
        g = scale * w
        updates, _ = opt.update(g, opt.init(w), w)  # THE UPDATE
        return optax.apply_updates(w, updates)

    w, scale = np.array([1.0, 2.0], np.float32), np.array([1.0, 0.0], np.float32)
    with np.errstate(invalid="ignore"):  # adam's first step by hand: m / sqrt(v), bias-corrected
        g = scale * w
        m, v = 0.1 * g / (1 - 0.9), 0.001 * g**2 / (1 - 0.999)
        assert np.isnan(m / np.sqrt(v)).tolist() == [False, True]
    spooled = jax.jit(el.spool(step, first_nonfinite="any"))
    with jax.numpy_dtype_promotion("standard"):  # (optax's bias correction: 0.9 ** count)
        _, logs = spooled(w, scale)
        _, batched = jax.vmap(spooled, in_axes=(None, 0))(w, np.stack([scale, np.ones(2)]))
        grad = jax.grad(lambda w, s: jnp.sum(step(w, s)))
        _, grads = el.spool(grad, first_nonfinite="any")(w, scale)
    report = logs.first_nonfinite
    assert report.operation.startswith("div at ") and not report.backward
    assert report.site.endswith(f":{_line_of(step, 'THE UPDATE')} ({step.__qualname__})")
    assert batched.first_nonfinite[0] == report and batched.first_nonfinite[1] is None
    assert grads.first_nonfinite.operation.startswith("div at ")
    assert not grads.first_nonfinite.backward


def test_any_operation_in_a_singular_lineax_solve():
    """lineax's LU solve of a singular matrix (scipy's factorisation has a zero pivot): the
    first non-finite value is the `linear_solve`'s output (an Equinox primitive, not looked
    into), at the user's line; its inputs are finite. Under jit and vmap (an identity lane
    finds nothing)."""
    import lineax as lx
    import scipy.linalg

    def solve(A, b):
        operator = lx.MatrixLinearOperator(A)
        return lx.linear_solve(operator, b, lx.LU(), throw=False).value  # THE SOLVE

    A = np.array([[1.0, 2.0], [2.0, 4.0]], np.float32)
    b = np.ones(2, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", scipy.linalg.LinAlgWarning)
        lu, _ = scipy.linalg.lu_factor(A)
    assert np.diag(lu).tolist() == [2.0, 0.0]
    spooled = jax.jit(el.spool(solve, first_nonfinite="any"))
    _, logs = spooled(A, b)
    report = logs.first_nonfinite
    assert report.operation == "linear_solve at linear_solve[0]/0" and not report.backward
    assert report.site.endswith(f":{_line_of(solve, 'THE SOLVE')} ({solve.__qualname__})")
    _, batched = jax.vmap(spooled, in_axes=(0, None))(np.stack([A, np.eye(2, dtype=A.dtype)]), b)
    assert batched.first_nonfinite[0] == report and batched.first_nonfinite[1] is None


def test_any_operation_in_an_optimistix_newton_root_find():
    """Newton's method on `sqrt(y) - 2` from y0 = 20 steps to a negative iterate (numpy's
    Newton step `-y + 4 sqrt(y)`): the square root of the next iteration is the first NaN,
    named at the user's function inside optimistix's loop, at the iteration the watched
    carry shows the negative iterate; optimistix's own starting `inf` (its step size) is not
    reported. Under jit, vmap (a lane from y0 = 10 converges: nothing) and grad."""
    import optimistix as optx

    def root(y0):
        fn = lambda y, args: jnp.sqrt(y) - 2.0  # noqa: E731  THE ROOT
        solver = optx.Newton(rtol=1e-6, atol=1e-6)
        return optx.root_find(fn, solver, y0, max_steps=16, throw=False).value

    ys = [np.float32(20.0)]  # numpy's iterates, up to the first negative one
    while ys[-1] >= 0:
        ys.append(-ys[-1] + np.float32(4) * np.sqrt(ys[-1]))
    spooled = jax.jit(el.spool(root, first_nonfinite="any"))
    _, logs = spooled(jnp.float32(20.0))
    report = logs.first_nonfinite
    assert report.operation == "sqrt at while[0]/sqrt[0]" and not report.backward
    assert report.iterations == (len(ys) - 1,)
    lambda_name = f"{root.__qualname__}.<locals>.<lambda>"
    assert report.site.endswith(f":{_line_of(root, 'THE ROOT')} ({lambda_name})")
    watched = el.spool(root, watch=el.Watch("while", where=ROOT_KEY), reduce=el.Stack(16))
    _, carries = watched(jnp.float32(20.0))
    np.testing.assert_allclose(carries[ROOT_KEY][: len(ys) - 1], ys[1:], rtol=1e-5)
    _, batched = jax.vmap(spooled)(jnp.array([20.0, 10.0]))
    assert batched.first_nonfinite[0] == report and batched.first_nonfinite[1] is None
    _, grads = el.spool(jax.grad(root), first_nonfinite="any")(jnp.float32(20.0))
    assert grads.first_nonfinite.operation == report.operation
    assert grads.first_nonfinite.iterations == report.iterations


def test_any_operation_passes_over_a_causal_masks_infinities():
    """`jnp.where(mask, logits, -inf)` then softmax: the `-inf` is the code's own (the
    softmax's `logits - max` holds it), not reported; a row masked whole makes
    `-inf - -inf`, a NaN, reported at that subtraction, as numpy's softmax makes it."""

    def attention(q, k, mask):
        logits = jnp.where(mask, q @ k.T, -jnp.inf)
        return jax.nn.softmax(logits, axis=-1)  # THE SOFTMAX

    q = k = jnp.ones((4, 3))
    causal = jnp.tril(jnp.ones((4, 4), bool))
    spooled = jax.jit(el.spool(attention, first_nonfinite="any"))
    _, logs = spooled(q, k, causal)
    assert logs.first_nonfinite is None
    empty = causal.at[2].set(False)  # row 2 masked whole
    with np.errstate(invalid="ignore"):
        row = np.full(4, -np.inf, np.float32)
        assert np.isnan(row - row.max()).all()
    _, logs = spooled(q, k, empty)
    assert logs.first_nonfinite.operation.startswith("sub at ")
