"""More primitives (custom_linear_solve and the solvers built on it, custom_root, custom_vmap),
jax.export, layouts that do not depend on neighbours, and errors that name what the user
wrote."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax import export, lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

import eqx_logs as el

A = jnp.array([[4.0, 1.0, 0.0], [1.0, 3.0, 1.0], [0.0, 1.0, 2.0]])
B = jnp.array([1.0, 2.0, 3.0])


def _solver(method, hook):
    def solve(b):
        def matvec(x):
            hook(x)
            return A @ x

        return method(matvec, b, tol=1e-6)[0]

    return solve


@pytest.mark.parametrize(
    "method", [jax.scipy.sparse.linalg.cg, jax.scipy.sparse.linalg.gmres], ids=["cg", "gmres"]
)
def test_sparse_solvers(method):
    calls = []
    reference = jax.jit(_solver(method, lambda x: jax.debug.callback(calls.append, x)))
    jax.block_until_ready(reference(B))
    jax.effects_barrier()
    solve = _solver(method, lambda x: el.log("x", x))
    x, logs = el.spool(solve, reduce=el.Stack(capacity=64))(B)
    assert_close(x, np.linalg.solve(A, B))
    assert int(logs.count["x"]) == len(calls) > 0
    np.testing.assert_allclose(logs["x"][: len(calls)], np.stack(calls), rtol=1e-5, atol=1e-6)
    # derivatives stay implicit (A is symmetric: d sum(x) / db = A^-1 1)
    want = np.linalg.solve(A, np.ones(3))
    assert_close(jax.grad(lambda b: jnp.sum(el.spool(solve, reduce="count")(b)[0]))(B), want)
    g, logs = el.spool(jax.grad(lambda b: jnp.sum(solve(b))), reduce="count")(B)
    assert_close(g, want)
    assert int(logs["x"]) >= len(calls)  # the forward solve, then the transposed one


def test_custom_linear_solve_logs_of_the_forward_solve():
    def f(b):
        def matvec(x):
            el.log("matvec", x)
            return 2 * x

        def solve(matvec, b):
            el.log("solve", b)
            return b / 2

        return lax.custom_linear_solve(matvec, b, solve, symmetric=True)

    x, logs = el.spool(f)(jnp.ones(2))
    assert_close(x, [0.5, 0.5])
    assert list(logs) == ["solve"]  # the user's solve never calls matvec
    assert_close(logs["solve"], [[1.0, 1.0]])


def test_custom_root():
    def root(a):
        def f(x):
            el.log("f", x)
            return x**2 - a

        def solver(f, x0):
            return lax.fori_loop(0, 5, lambda i, x: x - f(x) / (2 * x), x0)

        return lax.custom_root(f, 1.0, solver, lambda g, y: y / 2.0)

    x, logs = el.spool(root, reduce="count")(2.0)
    assert_close(x, np.sqrt(2.0))
    assert int(logs["f"]) == 5


def test_custom_vmap():
    @jax.custom_batching.custom_vmap
    def f(x):
        el.log("f", x)
        return x + 1

    @f.def_vmap
    def _(axis_size, in_batched, x):
        return x + 1, in_batched[0]

    out, logs = el.spool(f)(jnp.float32(1.0))
    assert_close(out, 2.0)
    assert_close(logs["f"], [1.0])


def test_lax_map_batches():
    def f(xs, batch_size):
        def g(x):
            el.log("x", x)
            return 2 * x

        return lax.map(g, xs, batch_size=batch_size)

    out, logs = el.spool(lambda xs: f(xs, 3))(jnp.arange(6.0))
    assert_close(out, 2 * np.arange(6.0))
    np.testing.assert_array_equal(logs["x"], np.arange(6.0).reshape(2, 3))  # (batches, lanes)
    # with a remainder (a vmap over 1 beside vmaps over 3), each lane is an event, in order
    out, logs = el.spool(lambda xs: f(xs, 3))(jnp.arange(7.0))
    assert_close(out, 2 * np.arange(7.0))
    np.testing.assert_array_equal(logs["x"], np.arange(7.0))
    assert int(logs.count["x"]) == 7
    _, logs = el.spool(lambda xs: f(xs, 3), reduce="mean", interval=2)(jnp.arange(7.0))
    assert_close(logs["x"], np.mean([0.0, 2.0, 4.0, 6.0]))


def test_pmap_on_one_device_spooled_and_tapped():
    def f(x):
        el.log("x", x + 1.0)
        return x

    out, logs = el.spool(jax.pmap(f))(jnp.arange(1.0))  # many devices: test_devices.py
    assert_close(out, np.arange(1.0))
    assert_close(logs["x"], np.ones((1, 1)))
    got = []
    el.tap(jax.pmap(f, axis_name="i"), callback=lambda logs, steps: got.append((logs, steps)))(
        jnp.arange(1.0)
    )
    jax.effects_barrier()
    assert [(float(logs["x"]), int(steps["i"])) for logs, steps in got] == [(1.0, 0)]


def test_bad_tags_name_the_argument():
    with pytest.raises(TypeError, match=r"tags at .*test_primitives.py.*got 1"):
        el.log("x", 1.0, tags=1)


def test_layout_does_not_depend_on_neighbours():
    def f(x):
        mean = lax.pmean(x, "batch")  # not batched
        el.log("alone", mean)
        el.log({"together": mean, "x": x})
        return x

    _, logs = el.spool(jax.vmap(f, axis_name="batch"))(jnp.arange(3.0))
    assert logs["alone"].shape == logs["together"].shape == (1,)
    assert logs["x"].shape == (1, 3)
    assert_close(logs["together"], [1.0])


def _scan_logging(xs):
    def step(c, x):
        el.log("c", c, step=x.astype(jnp.int32))
        return c + x, None

    return lax.scan(step, 0.0, xs)[0]


def test_export_serializes_and_keeps_symbolic_lengths():
    exported = export.export(jax.jit(el.spool(_scan_logging, interval=2)))(jnp.arange(5.0))
    out, logs = export.deserialize(exported.serialize()).call(jnp.arange(5.0))
    want_out, want = el.spool(_scan_logging, interval=2)(jnp.arange(5.0))
    assert_close(out, want_out)
    assert_close(logs["c"], want["c"])
    np.testing.assert_array_equal(logs.step["c"], [0, 2, 4])
    (n,) = export.symbolic_shape("n")
    for reduce in ("stack", "mean", el.Window(2, "sum")):  # (a window count is symbolic too)
        spooled = jax.jit(el.spool(_scan_logging, interval=2, reduce=reduce))
        exported = export.export(spooled)(jax.ShapeDtypeStruct((n,), jnp.float32))
        out, logs = exported.call(jnp.arange(7.0))
        _, want = el.spool(_scan_logging, interval=2, reduce=reduce)(jnp.arange(7.0))
        assert_close(logs["c"], want["c"])


def _example_logging(x):
    """One example of 3 features: logs straight-line, in a scan, in a cond and a while loop
    whose predicates a vmap batches, and a Python literal."""
    el.log({"x": x, "literal": 1.0})

    def step(c, i):
        el.log("c", c, step=i)
        lax.cond(c > 2.0, lambda: el.log("big", c), lambda: None)
        return c + x[0], None

    c = lax.scan(step, 0.0, jnp.arange(4))[0]

    def body(v):
        el.log("w", v)
        return v + 1.0

    return c + lax.while_loop(lambda v: v < x[1], body, 0.0)


@pytest.mark.parametrize(
    "options",
    [
        dict(reduce=el.Stack(capacity=6)),
        dict(reduce="mean", interval=2),
        dict(reduce=el.Stack(capacity=6), interval=2, across="batch"),
        dict(reduce=el.Window(2, "sum", capacity=3), across="batch"),
    ],
    ids=lambda options: ",".join(f"{k}={v}" for k, v in options.items()),
)
def test_export_with_a_symbolic_batch(options):
    """`jax.export` of a spool around or inside a vmap whose batch size is symbolic (issue 24:
    the counters were numpy arrays, which cannot have a symbolic shape; `across` merged the
    lanes in a Python loop), called at two sizes, against the spool itself."""
    (b,) = export.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct((b, 3), jnp.float32)
    if "across" in options:  # the lanes merged: straight-line and scanned logs are enough

        def f(x):
            el.log("x", x)
            return _scan_logging(x)

        orders = {"spool(vmap)": el.spool(jax.vmap(f, axis_name="batch"), **options)}
    else:
        orders = {
            "spool(vmap)": el.spool(jax.vmap(_example_logging), **options),
            "vmap(spool)": jax.vmap(el.spool(_example_logging, **options)),
        }
    for order, fun in orders.items():
        exported = export.deserialize(export.export(jax.jit(fun))(spec).serialize())
        for size in (2, 5):
            x = jnp.arange(size * 3.0).reshape(size, 3) / 4
            out, logs = exported.call(x)
            want_out, want = fun(x)
            assert_close(out, want_out, f"{order}, batch {size}: output")
            assert sorted(logs) == sorted(want)
            for key in want:
                what = f"{order}, batch {size}: logs[{key!r}]"
                np.testing.assert_allclose(logs[key], want[key], equal_nan=True, err_msg=what)
                np.testing.assert_array_equal(logs.count[key], want.count[key], err_msg=what)


# A primitive that lowers on CUDA alone: code for one kind of device, as a `pallas` kernel is.
_cuda_only = Primitive("eqx_logs_test_cuda_only")
_cuda_only.def_abstract_eval(lambda x: x)
_cuda_only.def_impl(lambda x: x)  # (never run here)
mlir.register_lowering(_cuda_only, lambda ctx, x: [x], platform="cuda")
batching.primitive_batchers[_cuda_only] = lambda args, dims: (_cuda_only.bind(*args), dims[0])
ad.deflinear2(_cuda_only, lambda ct, x: [_cuda_only.bind(ct)])


def _per_platform(x):
    """The user's `lax.platform_dependent`, logging in both branches; on CUDA, a kernel that
    does not lower on a CPU."""

    def cpu(x):
        el.log({"branch": jnp.float32(1), "x": x})
        return jnp.sin(x) * 2

    def cuda(x):
        el.log({"branch": jnp.float32(2), "x": x})
        return _cuda_only.bind(x)

    return lax.platform_dependent(x, cpu=cpu, cuda=cuda)


def test_platform_dependent_lowers_the_branch_of_its_platform_alone():
    """Rebuilt with its logs, a `lax.platform_dependent` stays one: lowered for a CPU, the CUDA
    branch is not lowered (it would fail), under every wrapper and transformation."""
    x = jnp.array([0.5, 1.0, 2.0], jnp.float32)
    want = np.sin(np.asarray(x)) * 2
    with pytest.raises(NotImplementedError, match="cuda_only"):  # the two, lowered for a CPU
        jax.jit(lambda x: lax.switch(0, [lambda x: x, _cuda_only.bind], x))(x)
    for spooled in (el.spool(_per_platform), jax.jit(el.spool(_per_platform))):
        out, logs = spooled(x)
        assert_close(out, want)
        np.testing.assert_array_equal(logs["branch"], [1.0])  # the CPU branch's event alone
        np.testing.assert_array_equal(logs["x"], x[None])
        assert int(logs.count["branch"]) == 1
    xs = jnp.stack([x, x + 1])
    _, lanes = jax.vmap(el.spool(_per_platform))(xs)
    for i in range(2):
        np.testing.assert_array_equal(lanes["x"][i], xs[i][None])
    grads, logs = jax.grad(el.spool(lambda x: jnp.sum(_per_platform(x))), has_aux=True)(x)
    assert_close(grads, 2 * np.cos(np.asarray(x)))
    np.testing.assert_array_equal(logs["branch"], [1.0])  # recorded once
    events = []
    tapped = jax.jit(el.tap(_per_platform, callback=lambda logs, steps: events.append(logs)))
    assert_close(tapped(x), want)
    jax.effects_barrier()
    assert [float(e["branch"]) for e in events] == [1.0]
    assert_close(jax.jit(el.nolog(_per_platform))(x), want)
    exported = export.export(jax.jit(el.spool(_per_platform)))(x)
    out, logs = export.deserialize(exported.serialize()).call(x)
    assert_close(out, want)
    np.testing.assert_array_equal(logs["branch"], [1.0])
