"""Equinox's loops under vmap (and so diffrax, optimistix): every lane gets its own events.

Equinox makes a batched loop predicate unbatched (`unvmap_any`), so the loop body runs for
lanes that are already done. Each lane of `vmap(spool(f))`, of `spool(vmap(f))` (batch axis
moved) and of `tap` must see exactly the events that `spool(f)`/`tap(f)` see for that lane
alone. The references are the solo runs, and the number of vector-field evaluations counted
by a host callback in a solo solve.
"""

import diffrax
import equinox.internal as eqxi
import jax
import jax.numpy as jnp
import numpy as np
import optimistix as optx
import pytest
from jax import lax

import eqx_logs as el

KINDS = ["lax", "checkpointed", "bounded"]
REDUCES = ["count", "mean", el.Stack(capacity=8)]


def _loop(kind):
    def f(n):
        def body(c):
            i, acc = c
            el.log({"i": i, "acc": acc})
            return i + 1, acc + jnp.sin(i.astype(jnp.float32))

        def cond(c):
            return c[0] < n

        return eqxi.while_loop(cond, body, (0, 0.0), max_steps=8, kind=kind)[1]

    return f


def _solo(f, xs, **kw):
    outs = [el.spool(f, **kw)(x) for x in xs]
    return [o for o, _ in outs], [logs for _, logs in outs]


def _assert_lanes(f, xs, reduce, rtol=1e-5):
    """vmap(spool(f)) and spool(vmap(f)) against spool(f) on each lane alone, whose logs it
    returns. (A batched
    program may round differently from the unbatched one: diffrax's steps then differ by a
    few ulps, hence `rtol` for it.)"""
    solo_out, solo = _solo(f, xs, reduce=reduce)
    outer_out, outer = jax.vmap(el.spool(f, reduce=reduce))(xs)
    # traced unbatched first, then batched (the lane values are then batched apart later)
    staged_out, staged = jax.vmap(jax.jit(el.spool(f, reduce=reduce)))(xs)
    inner_out, inner = el.spool(jax.vmap(f), reduce=reduce)(xs)
    event_axis = isinstance(reduce, el.Stack)
    for i, logs in enumerate(solo):
        for out in (outer_out, staged_out, inner_out):
            np.testing.assert_allclose(out[i], solo_out[i], rtol=rtol, atol=1e-6)
        assert sorted(outer) == sorted(staged) == sorted(inner) == sorted(logs)
        for key in logs:
            want = np.asarray(logs[key])
            lane_inner = inner[key][:, i] if event_axis else inner[key][i]
            for lane in (outer[key][i], staged[key][i], lane_inner):
                np.testing.assert_allclose(lane, want, rtol=rtol, equal_nan=True)
            counts = [outer.count[key][i], staged.count[key][i], inner.count[key][i]]
            assert counts == [logs.count[key]] * 3, key
    return solo


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduce", REDUCES, ids=str)
def test_equinox_while_loop_lanes(kind, reduce):
    _assert_lanes(_loop(kind), jnp.array([2, 5, 0]), reduce)


@pytest.mark.parametrize("kind", KINDS)
def test_equinox_while_loop_counts(kind):
    _, logs = jax.vmap(el.spool(_loop(kind), reduce="count"))(jnp.array([2, 5]))
    np.testing.assert_array_equal(logs["i"], [2, 5])
    _, logs = el.spool(jax.vmap(_loop(kind)), reduce="count")(jnp.array([2, 5]))
    np.testing.assert_array_equal(logs["i"], [2, 5])


@pytest.mark.parametrize("kind", KINDS)
def test_equinox_while_loop_interval(kind):
    # interval counts each lane's own events: lane n=5 keeps events 0, 2, 4; lane n=2 keeps 0
    _assert_lanes_interval = jax.vmap(el.spool(_loop(kind), reduce="count", interval=2))
    _, logs = _assert_lanes_interval(jnp.array([2, 5]))
    np.testing.assert_array_equal(logs["i"], [1, 3])
    _, logs = el.spool(jax.vmap(_loop(kind)), reduce="count", interval=2)(jnp.array([2, 5]))
    np.testing.assert_array_equal(logs["i"], [1, 3])


@pytest.mark.parametrize("kind", KINDS)
def test_statistics_under_a_vmap_inside_are_over_the_lanes_still_running(kind):
    """`log_stats` in an Equinox loop under `spool(vmap(f))`: the body runs for lanes that
    are done, and each statistic is over the lanes still running (and, in a cond on a batched
    predicate, over those that take its branch: an event of each such lane), computed here
    in numpy."""
    ns = np.array([1, 3, 2])
    x0 = np.array([[5.0, -1.0], [0.5, 2.0], [1.0, 1.5]], np.float32)
    stats = ("mean", "std", "absmax")

    def f(n, x0):
        def body(c):
            i, x = c
            el.log_stats("x", x, stats=stats)
            lax.cond(x[0] > 1.5, lambda: el.log_stats("big", x, stats=stats), lambda: None)
            return i + 1, x * 2

        return eqxi.while_loop(lambda c: c[0] < n, body, (0, x0), max_steps=8, kind=kind)[1]

    def running(k, big=False):  # the lanes that run iteration k (and take the branch)
        x = {lane: x0[lane] * 2.0**k for lane in range(3) if k < ns[lane]}
        return {lane: v for lane, v in x.items() if not big or v[0] > 1.5}

    def want(xs):
        x = np.concatenate(list(xs.values())).astype(np.float64)
        return {"mean": x.mean(), "std": x.std(), "absmax": np.abs(x).max()}

    spooled = el.spool(jax.vmap(f), reduce=el.Stack(capacity=8))
    for fn in (spooled, jax.jit(spooled)):
        _, logs = fn(jnp.asarray(ns), jnp.asarray(x0))
        assert int(logs.count["x/mean"]) == 3  # an event per iteration
        for k in range(3):
            for name, value in want(running(k)).items():
                np.testing.assert_allclose(logs[f"x/{name}"][k], value, rtol=1e-5)
        for lane in range(3):  # lane 0 at iteration 0, lane 1 at 2, lane 2 at 1
            ks = [k for k in range(3) if lane in running(k, big=True)]
            assert len(ks) == 1 and int(logs.count["big/mean"][lane]) == 1
            for name, value in want(running(ks[0], big=True)).items():
                np.testing.assert_allclose(logs[f"big/{name}"][0, lane], value, rtol=1e-5)


def _tap_events(fun, *args):
    seen = []
    el.tap(fun, callback=lambda logs, steps: seen.append((logs, steps)))(*args)
    jax.effects_barrier()
    return seen


@pytest.mark.parametrize("kind", KINDS)
def test_equinox_while_loop_tap(kind):
    f, xs = _loop(kind), jnp.array([2, 5])
    solo = [[float(e["i"]) for e, _ in _tap_events(f, x)] for x in xs]
    assert solo == [[0, 1], [0, 1, 2, 3, 4]]
    # vmap outside tap: one call per live lane and event
    seen = []
    jax.vmap(el.tap(f, callback=lambda logs, steps: seen.append(logs)))(xs)
    jax.effects_barrier()
    assert sorted(float(e["i"]) for e in seen) == sorted(solo[0] + solo[1])
    # vmap inside tap: one call per event, batched, with the lanes where it happened
    per_lane = [[], []]
    for logs, steps in _tap_events(jax.vmap(f), xs):
        valid = np.asarray(steps.get("valid", np.ones(2, bool)))
        for lane in np.flatnonzero(valid):
            per_lane[lane].append(float(logs["i"][lane]))
    assert per_lane == solo


# -- diffrax and optimistix -------------------------------------------------------------------


def _tsit5(vector_field, y0, adjoint=diffrax.RecursiveCheckpointAdjoint()):
    """An adaptive Tsit5 solve over [0, 3] (6 evaluations of the field a step)."""
    return diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        diffrax.Tsit5(),
        t0=0.0,
        t1=3.0,
        dt0=0.1,
        y0=y0,
        stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
        adjoint=adjoint,
        max_steps=256,
    )


def _solve(k, adjoint=diffrax.RecursiveCheckpointAdjoint()):
    def vector_field(t, y, args):
        el.log({"y": y, "t": t})
        return -k * y * (1 + jnp.sin(10 * t) ** 2)

    sol = _tsit5(vector_field, jnp.array(1.0), adjoint)
    return sol.ys[-1], sol.stats["num_steps"], sol.stats["num_rejected_steps"]


@pytest.mark.parametrize(
    "adjoint", [diffrax.RecursiveCheckpointAdjoint(), diffrax.DirectAdjoint()], ids=type
)
def test_diffrax_vmap(adjoint):
    # A batched solve may round differently from the same solve alone (its steps then differ
    # by a few ulps, and it may take a step more or less), so each lane is checked against its
    # own step counts: Tsit5 evaluates its vector field once, then 6 times per step, and once
    # more when a rejected first step is retried. Without lane values every lane logged the
    # slowest lane's evaluations.
    # (one solve each way: the count and the mean of every key, side by side)
    ks, reduce = jnp.array([1.0, 6.0]), el.Fanout(count="count", mean="mean")

    def f(k):
        return _solve(k, adjoint)

    (_, steps, rejected), outer = jax.vmap(el.spool(f, reduce=reduce))(ks)
    (_, steps_inner, _), inner = el.spool(jax.vmap(f), reduce=reduce)(ks)
    np.testing.assert_array_equal(steps, steps_inner)
    np.testing.assert_array_equal(outer["y"]["count"], inner["y"]["count"])
    low, high = 1 + 6 * np.asarray(steps), 1 + 6 * np.asarray(steps) + np.asarray(rejected)
    assert steps[0] != steps[1]
    count = outer["y"]["count"]
    assert np.all(low <= count) and np.all(count <= high), (count, low, high)
    for key in ("y", "t"):
        np.testing.assert_allclose(outer[key]["mean"], inner[key]["mean"], rtol=1e-5)


def test_diffrax_statistics_under_a_vmap_inside_leave_out_the_lanes_that_are_done():
    """`log_stats` in a vector field under `spool(vmap(solve))`: once the slow-decaying lane
    (|y| >= 4.8 throughout) has finished, its frozen state no longer enters the statistics,
    so the remaining evaluations' absmax is the fast lane's alone (|y| <= 1); so is that of
    a first stage only the fast lane retries (diffrax's `unvmap_any`)."""

    def f(k, y0):
        def vector_field(t, y, args):
            el.log_stats("y", y, stats=("absmax",))
            return -k * y

        return _tsit5(vector_field, y0).stats["num_steps"]

    ks, y0 = jnp.array([1.0, 6.0]), jnp.array([[100.0, 50.0], [1.0, -0.5]])
    steps, logs = el.spool(jax.vmap(f), reduce=el.Stack(capacity=1024))(ks, y0)
    absmax = np.asarray(logs["y/absmax"][: int(logs.count["y/absmax"])])
    alone = absmax <= 1.01  # the fast lane's alone (or its retried first stage)
    assert np.all(alone | (absmax >= 4.8))
    last = int(np.flatnonzero(~alone)[-1]) + 1  # the slow lane's last evaluation
    assert np.all(alone[last:]) and len(absmax) - last >= 6 * (int(steps[1]) - int(steps[0]))
    assert steps[1] > steps[0]  # (Tsit5: 6 evaluations a step)


def test_diffrax_like_shared_first_stage():
    """diffrax's pattern, exactly: every lane evaluates the first stage if any lane needs to
    (`unvmap_any(first_step | made_jump)`), then runs the remaining stages in an Equinox loop;
    a lane counts only its own evaluations."""

    def step(needs_first):
        start = jnp.where(eqxi.unvmap_any(needs_first), 0, 1)

        def body(c):
            i, acc = c
            # batched under vmap, as diffrax's state is
            el.log("stage", i + 0 * needs_first.astype(jnp.int32))
            return i + 1, acc + i

        def cond(c):
            return c[0] < 4

        return eqxi.while_loop(cond, body, (start, 0), max_steps=4, kind="checkpointed")[1]

    flags = jnp.array([False, True, False])
    solo = [el.spool(step, reduce=el.Stack(capacity=4))(f)[1] for f in flags]
    assert [int(s.count["stage"]) for s in solo] == [3, 4, 3]
    _, outer = jax.vmap(el.spool(step, reduce=el.Stack(capacity=4)))(flags)
    _, inner = el.spool(jax.vmap(step), reduce=el.Stack(capacity=4))(flags)
    for i, s in enumerate(solo):
        np.testing.assert_array_equal(outer["stage"][i], s["stage"])
        np.testing.assert_array_equal(inner["stage"][:, i], s["stage"])
        assert outer.count["stage"][i] == inner.count["stage"][i] == s.count["stage"]


def test_optimistix_vmap():
    def root(a):
        def fn(y, args):
            el.log("y", y)
            return y**3 - a

        solver = optx.Newton(rtol=1e-5, atol=1e-5)
        return optx.root_find(fn, solver, jnp.array(1.0)).value

    as_ = jnp.array([1.5, 50.0])
    solo = _assert_lanes(root, as_, "count")
    assert solo[0]["y"] != solo[1]["y"]
    _assert_lanes(root, as_, el.Stack(capacity=16))


def _stiff(k, hook):
    """An implicit solve: diffrax's Kvaerno5 calls optimistix's Newton, which solves with
    lineax, all in Equinox's loops."""

    def vector_field(t, y, args):
        hook(y)
        return -k * y + jnp.sin(t)

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        diffrax.Kvaerno5(),
        t0=0.0,
        t1=1.0,
        dt0=0.1,
        y0=jnp.ones(3),
        stepsize_controller=diffrax.PIDController(rtol=1e-4, atol=1e-6),
    )
    return sol.ys[-1]


def test_diffrax_implicit_solver_counts():
    # the reference: how often the vector field really runs, counted by a host callback
    # (one compiled reference for every k: the callback counts under the value of k it gets)
    ks = jnp.array([2.0, 40.0])
    counts = {}

    def bump(k):
        counts[float(k)] = counts.get(float(k), 0) + 1

    reference = jax.jit(lambda k: _stiff(k, lambda y: jax.debug.callback(bump, k)))
    solutions = [jax.block_until_ready(reference(k)) for k in ks]
    jax.effects_barrier()
    runs = [counts[float(k)] for k in ks]
    assert runs[0] != runs[1]

    def f(k):
        return _stiff(k, lambda y: el.log("y", jnp.mean(y)))

    spooled = jax.jit(el.spool(f, reduce="count"))
    for k, n, solution in zip(ks, runs, solutions):
        out, logs = spooled(k)
        assert int(logs["y"]) == n
        np.testing.assert_allclose(out, solution, rtol=1e-6)
    _, outer = jax.vmap(el.spool(f, reduce="count"))(ks)
    _, inner = el.spool(jax.vmap(f), reduce="count")(ks)
    # a batched solve may take a step more or less than the solo one (see test_diffrax_vmap)
    np.testing.assert_array_equal(outer["y"], inner["y"])
    assert outer["y"][0] != outer["y"][1]
    np.testing.assert_allclose(outer["y"], runs, rtol=0.2)


def test_grad_of_spooled_solve_has_no_log_left():
    # diffrax's backward pass re-runs the vector field from a jaxpr Equinox captured under the
    # spool. With no spool around the grad, those logs are dropped when bound, so the program
    # has no effect (an effectful program would dispatch on JAX's slow path).
    def loss(k):
        (y, _, _), logs = el.spool(_solve, reduce="mean")(k)
        return y + 0.0 * logs["t"]

    k = jnp.float32(1.0)
    traced = jax.jit(jax.grad(loss)).trace(k)  # (traced once: its jaxpr, then compiled)
    assert traced.jaxpr.effects == set()
    want = jax.jit(jax.grad(lambda k: _solve(k)[0]))(k)
    np.testing.assert_allclose(traced.lower().compile()(k), want, rtol=1e-5)


def test_backward_pass_events_reach_an_enclosing_spool():
    # the backward pass re-runs the vector field: under an enclosing spool those evaluations
    # are its events; with the forward's (the inner spool's), as many as the vector field
    # runs, counted by a host callback
    runs = [0]

    def count(y):
        el.log("y", jnp.mean(y))
        jax.debug.callback(lambda: runs.__setitem__(0, runs[0] + 1))

    def loss(k):
        y, logs = el.spool(lambda k: _stiff(k, count), reduce="count")(k)
        return jnp.sum(y), logs

    k = jnp.float32(3.0)
    want = jax.jit(jax.grad(lambda k: jnp.sum(_stiff(k, lambda y: None))))(k)
    (grad, forward), backward = el.spool(jax.grad(loss, has_aux=True), reduce="count")(k)
    jax.effects_barrier()
    np.testing.assert_allclose(grad, want, rtol=1e-5)
    assert 0 < int(forward["y"]) < runs[0]
    assert int(forward["y"]) + int(backward["y"]) == runs[0]
