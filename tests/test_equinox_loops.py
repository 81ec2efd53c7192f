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


def _assert_lanes(f, xs, reduce):
    """vmap(spool(f)) and spool(vmap(f)) against spool(f) on each lane alone."""
    solo_out, solo = _solo(f, xs, reduce=reduce)
    outer_out, outer = jax.vmap(el.spool(f, reduce=reduce))(xs)
    inner_out, inner = el.spool(jax.vmap(f), reduce=reduce)(xs)
    event_axis = isinstance(reduce, el.Stack)
    for i, logs in enumerate(solo):
        np.testing.assert_allclose(outer_out[i], solo_out[i], rtol=1e-5)
        np.testing.assert_allclose(inner_out[i], solo_out[i], rtol=1e-5)
        assert sorted(outer) == sorted(inner) == sorted(logs)
        for key in logs:
            want = np.asarray(logs[key])
            lane_inner = inner[key][:, i] if event_axis else inner[key][i]
            np.testing.assert_allclose(outer[key][i], want, rtol=1e-5, equal_nan=True)
            np.testing.assert_allclose(lane_inner, want, rtol=1e-5, equal_nan=True)
            assert outer.count[key][i] == inner.count[key][i] == logs.count[key], key


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


def _solve(k, adjoint=diffrax.RecursiveCheckpointAdjoint(), hook=None):
    def vector_field(t, y, args):
        if hook is None:
            el.log({"y": y, "t": t})
        else:
            hook()
        return -k * y * (1 + jnp.sin(10 * t) ** 2)

    sol = diffrax.diffeqsolve(
        diffrax.ODETerm(vector_field),
        diffrax.Tsit5(),
        t0=0.0,
        t1=3.0,
        dt0=0.1,
        y0=jnp.array(1.0),
        stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-5),
        adjoint=adjoint,
        max_steps=256,
    )
    return sol.ys[-1]


def _evaluations(k) -> int:
    """How many times the vector field really runs in a plain (unspooled) solve."""
    calls = []
    jax.block_until_ready(_solve(k, hook=lambda: jax.debug.callback(lambda: calls.append(1))))
    jax.effects_barrier()
    return len(calls)


@pytest.mark.parametrize(
    "adjoint", [diffrax.RecursiveCheckpointAdjoint(), diffrax.DirectAdjoint()], ids=type
)
def test_diffrax_vmap(adjoint):
    ks = jnp.array([1.0, 6.0])

    def f(k):
        return _solve(k, adjoint)

    _, counts = jax.vmap(el.spool(f, reduce="count"))(ks)
    # each lane makes as many vector-field evaluations as its own solve does
    want = [_evaluations(k) for k in ks]
    assert want[0] != want[1]
    np.testing.assert_array_equal(counts["y"], want)
    _assert_lanes(f, ks, "mean")


def test_optimistix_vmap():
    def root(a):
        def fn(y, args):
            el.log("y", y)
            return y**3 - a

        solver = optx.Newton(rtol=1e-5, atol=1e-5)
        return optx.root_find(fn, solver, jnp.array(1.0)).value

    as_ = jnp.array([1.5, 50.0])
    _, solo = _solo(root, as_, reduce="count")
    assert solo[0]["y"] != solo[1]["y"]
    _assert_lanes(root, as_, "count")
    _assert_lanes(root, as_, el.Stack(capacity=16))
