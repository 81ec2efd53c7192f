"""The core issue: `log` anywhere, `spool` captures every event through every transformation."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_logs as el

pytestmark = pytest.mark.fast  # in `make test-fast`


def assert_close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, equal_nan=True)


def sin_scan(x, n=4):
    """Logs c_0 .. c_{n-1} with c_{t+1} = 1.5 sin(c_t)."""

    def step(c, _):
        el.log("c", c)
        return jnp.sin(c) * 1.5, None

    return lax.scan(step, x, None, length=n)[0]


def sin_scan_reference(x, n=4):
    out = [np.float32(x)]
    for _ in range(n - 1):
        out.append(np.float32(np.sin(out[-1]) * 1.5))
    return np.array(out, np.float32)


# -- basics ----------


def test_single_call_has_leading_axis_one():
    out, logs = el.spool(lambda x: (el.log({"x": x, "y": 2 * x}), x + 1)[1])(jnp.arange(3.0))
    assert_close(out, [1, 2, 3])
    assert logs["x"].shape == (1, 3)
    assert_close(logs["y"][0], [0, 2, 4])
    assert int(logs.count["x"]) == 1


def test_name_value_form_and_python_scalars():
    def f(x):
        el.log("a", x)
        el.log("b", 3)
        el.log("c", 2.5)
        return x

    _, logs = el.spool(f)(jnp.float32(1.0))
    assert_close(logs["a"], [1.0])
    assert logs["b"].dtype == jnp.int32 and int(logs["b"][0]) == 3
    assert_close(logs["c"], [2.5])


def test_pytree_values_stay_pytrees():
    def f(x):
        def step(c, _):
            el.log("p", {"w": c * jnp.ones(2), "b": (c, c + 1)})
            return c + 1, None

        return lax.scan(step, x, None, length=3)[0]

    _, logs = el.spool(f)(jnp.float32(0.0))
    assert logs["p"]["w"].shape == (3, 2)
    assert_close(logs["p"]["b"][0], [0, 1, 2])
    assert_close(logs["p"]["b"][1], [1, 2, 3])


def test_several_sites_interleave_in_execution_order():
    def f(x):
        def step(c, _):
            el.log("k", c)
            el.log("k", -c)
            return c + 1, None

        el.log("k", 100.0)
        return lax.scan(step, x, None, length=2)[0]

    _, logs = el.spool(f)(jnp.float32(1.0))
    assert_close(logs["k"], [100, 1, -1, 2, -2])


def test_shape_mismatch_names_key_and_shapes():
    def f(x):
        el.log("k", x)
        el.log("k", jnp.stack([x, x]))
        return x

    with pytest.raises(ValueError, match=r"'k'.*\(\).*\(2,\)"):
        el.spool(f)(jnp.float32(1.0))


def test_dtype_mismatch_names_key_and_dtypes():
    def f(x):
        el.log("k", x)
        el.log("k", jnp.int32(1))
        return x

    with pytest.raises(TypeError, match=r"'k'.*float32.*int32"):
        el.spool(f)(jnp.float32(1.0))


def test_weak_python_scalar_adapts_to_dtype():
    def f(x):
        el.log("k", x)
        el.log("k", 2.0)
        return x

    _, logs = el.spool(f)(jnp.float16(1.0))
    assert logs["k"].dtype == jnp.float16
    assert_close(logs["k"], [1.0, 2.0])


def test_steps_are_aligned_with_values():
    def f(xs):
        def body(i, c):
            c = c + xs[i]
            el.log({"carry": c}, step=i, episode=i // 2)
            return c

        return lax.fori_loop(0, 3, body, 0.0)

    _, logs = el.spool(f)(jnp.arange(3.0))
    assert_close(logs["carry"], [0, 1, 3])
    assert np.array_equal(logs.step["carry"], [0, 1, 2])
    assert np.array_equal(logs.episode["carry"], [0, 0, 1])
    with pytest.raises(AttributeError, match="no step named 'epoch'"):
        logs.epoch


def test_scopes_nest_and_are_stable_across_retraces():
    def f(x):
        with el.scope("model"):
            with el.scope("layer1"):
                el.log("norm", x)
            el.log("out", x)
        return x

    spooled = el.spool(f)
    for shape in [(), (2,)]:  # two traces
        _, logs = spooled(jnp.ones(shape))
        assert list(logs) == ["model/layer1/norm", "model/out"]


def test_logdict_is_a_pytree_through_jit():
    def f(x):
        el.log("x", x, step=3)
        return x

    out, logs = jax.jit(el.spool(f))(jnp.float32(2.0))
    assert isinstance(logs, el.LogDict)
    leaves, treedef = jax.tree_util.tree_flatten(logs)
    # value, step: the count and the rows (real events) are known at trace time, so they
    # are in the structure, numpy arrays, not outputs of the jitted program
    assert len(leaves) == 2
    assert type(logs.count["x"]) is np.ndarray and type(logs.rows["x"]) is np.ndarray
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert np.array_equal(back.step["x"], [3]) and int(back.count["x"]) == 1
    assert int(back.rows["x"]) == 1
    assert jax.tree_util.tree_structure(el.spool(f)(jnp.float32(2.0))[1]) == treedef

    def g(x):  # rows that differ from the count: a leaf of their own
        lax.fori_loop(0, x.astype(jnp.int32), lambda i, c: (el.log("w", c), c)[1], 0.0)
        return x

    _, logs = jax.jit(el.spool(g, reduce=el.Stack(capacity=2)))(jnp.float32(3.0))
    assert len(jax.tree_util.tree_leaves(logs)) == 3  # value, count, rows
    assert int(logs.count["w"]) == 3 and int(logs.rows["w"]) == 2


# -- scans, loops, conds ----------


def test_nested_scans_flatten_in_execution_order():
    def f(x):
        def inner(c, j):
            el.log("e", c * 10 + j)
            return c, None

        def outer(c, i):
            lax.scan(inner, i, jnp.arange(3.0))
            return c, None

        return lax.scan(outer, x, jnp.arange(2.0))[0]

    _, logs = el.spool(f)(jnp.float32(0.0))
    assert_close(logs["e"], [0, 1, 2, 10, 11, 12])


@pytest.mark.parametrize("unroll", [1, 2, 3])
def test_reverse_scan_yields_execution_order(unroll):
    def f(xs):
        def step(c, x):
            el.log("x", x)
            return c + x, None

        return lax.scan(step, 0.0, xs, reverse=True, unroll=unroll)[0]

    _, logs = el.spool(f)(jnp.arange(5.0))
    assert_close(logs["x"], [4, 3, 2, 1, 0])


def test_lax_map_and_fori_loop():
    def f(xs):
        ys = lax.map(lambda x: (el.log("m", x), x * 2)[1], xs)
        return lax.fori_loop(0, 2, lambda i, c: (el.log("i", i), c + 1)[1], ys.sum())

    out, logs = el.spool(f)(jnp.arange(3.0))
    assert_close(out, 8.0)
    assert_close(logs["m"], [0, 1, 2])
    assert np.array_equal(logs["i"], [0, 1])


def test_cond_branches_with_different_keys_or_nothing():
    def f(x):
        def step(c, i):
            lax.cond(
                i % 3 == 0,
                lambda: el.log("even", i),
                lambda: lax.cond(
                    i % 3 == 1, lambda: el.log("odd", i.astype(jnp.float32)), lambda: None
                ),
            )
            return c, None

        return lax.scan(step, x, jnp.arange(7))[0]

    _, logs = el.spool(f)(jnp.float32(0.0))
    # bound: 7 possible events each; real events compacted to the front.
    assert logs["even"].shape == (7,) and logs["even"].dtype == jnp.int32
    assert np.array_equal(logs["even"], [0, 3, 6, 0, 0, 0, 0])
    assert int(logs.count["even"]) == 3
    assert_close(logs["odd"], [1, 4, np.nan, np.nan, np.nan, np.nan, np.nan])
    assert int(logs.count["odd"]) == 2


def test_switch_counts_only_taken_branch():
    def f(i, x):
        return lax.switch(
            i,
            [
                lambda x: (el.log("a", x), x)[1],
                lambda x: (el.log("b", x), el.log("a", -x), x)[2],
                lambda x: x,
            ],
            x,
        )

    for i, (a, b) in enumerate([([5.0], [np.nan]), ([-5.0], [5.0]), ([np.nan], [np.nan])]):
        _, logs = el.spool(f)(jnp.int32(i), jnp.float32(5.0))
        assert_close(logs["a"], a)
        assert_close(logs["b"], b)


def test_while_loop_stack_error_names_key():
    def f(x):
        def body(c):
            el.log("w", c)
            return c + 1

        return lax.while_loop(lambda c: c < 3, body, x)

    with pytest.raises(ValueError, match=r"key 'w'.*while_loop.*no static"):
        el.spool(f)(jnp.float32(0.0))


def test_while_cond_fun_logs_are_not_dropped():
    def f(x):
        def cond(c):
            el.log("in_cond", c)
            return c < 3

        return lax.while_loop(cond, lambda c: c + 1, x)

    with pytest.raises(ValueError, match=r"key 'in_cond'"):
        el.spool(f)(jnp.float32(0.0))


def test_fori_loop_with_traced_bounds_is_a_while_loop():
    def f(n):
        return lax.fori_loop(0, n, lambda i, c: (el.log("i", i), c + 1)[1], 0)

    with pytest.raises(ValueError, match=r"key 'i'"):
        el.spool(f)(jnp.int32(3))


@pytest.mark.parametrize("kind", ["lax", "checkpointed", "bounded"])
def test_equinox_while_loop(kind):
    def f(x):
        def body(c):
            el.log("w", c[1])
            return c[0] + 1, c[1] * 2

        return eqx.internal.while_loop(lambda c: c[0] < 3, body, (0, x), max_steps=5, kind=kind)

    if kind == "bounded":
        out, logs = el.spool(f)(jnp.float32(1.0))
        assert_close(out[1], 8.0)
        n = int(logs.count["w"])
        assert n == 3 and logs["w"].shape[0] >= 5
        assert_close(logs["w"][:n], [1, 2, 4])
        assert np.all(np.isnan(logs["w"][n:]))
    else:
        with pytest.raises(ValueError, match=r"key 'w'.*Stack\(capacity"):
            el.spool(f)(jnp.float32(1.0))
    out, logs = el.spool(f, reduce=el.Stack(capacity=6))(jnp.float32(1.0))
    assert_close(out[1], 8.0)
    assert_close(logs["w"], [1, 2, 4, np.nan, np.nan, np.nan])
    assert int(logs.count["w"]) == 3


def _while_with_logs(x, n):
    def cond(c):
        el.log("cond", c[0])
        return c[0] < n

    def body(c):
        el.log("body", c[1])
        return c[0] + 1, c[1] * 2

    return lax.while_loop(cond, body, (0, x))


@pytest.mark.parametrize("keep", ["first", "last"])
@pytest.mark.parametrize("n", [0, 2, 5])
def test_while_loop_with_capacity_against_python(keep, n):
    capacity = 4
    out, logs = el.spool(_while_with_logs, reduce=el.Stack(capacity=capacity, keep=keep))(
        jnp.float32(1.0), n
    )
    conds = list(range(n + 1))  # cond_fun runs once more than the body
    bodies = [2.0**i for i in range(n)]
    for key, events in [("cond", conds), ("body", bodies)]:
        kept = events[:capacity] if keep == "first" else events[-capacity:]
        fill = 0 if key == "cond" else np.nan
        assert_close(logs[key], kept + [fill] * (capacity - len(kept)))
        assert int(logs.count[key]) == len(events)
    assert int(out[0]) == n


def test_while_loop_per_lane_under_vmap_of_spool():
    spooled = el.spool(_while_with_logs, reduce=el.Stack(capacity=8))
    _, logs = jax.vmap(spooled, in_axes=(0, None))(jnp.array([1.0, 3.0]), 3)
    assert_close(logs["body"][:, :3], [[1, 2, 4], [3, 6, 12]])
    assert np.array_equal(logs.count["cond"], [4, 4])


def test_stack_validation_and_merge():
    with pytest.raises(ValueError, match="capacity"):
        el.Stack(capacity=0)
    with pytest.raises(ValueError, match="keep"):
        el.Stack(keep="middle")
    struct = jax.ShapeDtypeStruct((2,), jnp.float32)
    for keep, expected in [("first", [0, 1, 2]), ("last", [2, 3, 4])]:
        stack = el.Stack(capacity=3, keep=keep)
        a, b = stack.init(struct, None), stack.init(struct, None)
        for i in range(2):
            a = stack.update(a, jnp.full(2, float(i)), True)
        for i in range(2, 5):
            b = stack.update(b, jnp.full(2, float(i)), True)
        b = stack.update(b, jnp.full(2, 99.0), False)
        out = stack.finalize(stack.merge(a, b))
        assert_close(out[:, 0], expected)


# -- vmap ----------


def test_vmap_axes_are_never_merged():
    xs = jnp.array([0.5, 1.0, 2.0])
    _, inner = el.spool(jax.vmap(sin_scan))(xs)
    _, outer = jax.vmap(el.spool(sin_scan))(xs)
    ref = np.stack([sin_scan_reference(x) for x in [0.5, 1.0, 2.0]])  # (B, T)
    assert inner["c"].shape == (4, 3)
    assert outer["c"].shape == (3, 4)
    assert_close(inner["c"], ref.T)
    assert_close(outer["c"], ref)
    assert np.array_equal(outer.count["c"], [4, 4, 4])


def test_filter_vmap_and_filter_grad():
    _, logs = el.spool(eqx.filter_vmap(sin_scan))(jnp.array([1.0, 2.0]))
    assert logs["c"].shape == (4, 2)
    g, logs = el.spool(eqx.filter_grad(sin_scan))(jnp.float32(1.0))
    assert_close(g, jax.grad(sin_scan)(1.0))
    assert_close(logs["c"], sin_scan_reference(1.0))


# -- AD ----------


@pytest.mark.parametrize(
    "transform",
    [
        jax.grad,
        jax.value_and_grad,
        jax.jacrev,
        jax.jacfwd,
        jax.hessian,
        lambda f: lambda x: jax.jvp(f, (x,), (1.0,)),
        lambda f: lambda x: jax.vjp(f, x)[1](1.0),
        lambda f: lambda x: jax.linearize(f, x)[1](1.0),
        lambda f: jax.grad(jax.checkpoint(f)),
        lambda f: jax.grad(eqx.filter_checkpoint(f)),
        lambda f: jax.grad(lambda x: jax.checkpoint(f)(x) * 2),
    ],
)
def test_ad_records_each_forward_event_once_with_primal_values(transform):
    _, logs = el.spool(transform(sin_scan))(jnp.float32(1.0))
    assert_close(logs["c"], sin_scan_reference(1.0))
    assert int(logs.count["c"]) == 4


def test_checkpoint_inside_scan_under_grad_does_not_duplicate():
    def f(x):
        def step(c, _):
            c = jax.checkpoint(lambda c: (el.log("c", c), jnp.sin(c))[1])(c)
            return c, None

        return lax.scan(step, x, None, length=3)[0]

    _, logs = el.spool(jax.grad(f))(jnp.float32(1.0))
    assert_close(logs["c"], [1.0, np.sin(1.0), np.sin(np.sin(1.0))])


def test_custom_jvp_logs_and_rule_is_kept():
    @jax.custom_jvp
    def f(x):
        el.log("fx", x)
        return jnp.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 100.0 * t[0]))
    out, logs = el.spool(f)(jnp.float32(1.0))
    assert_close(out, np.sin(1.0))
    assert_close(logs["fx"], [1.0])
    g, logs = el.spool(jax.grad(f))(jnp.float32(1.0))
    assert_close(g, 100.0)
    assert_close(logs["fx"], [1.0])
    # grad of a spooled function still uses the custom rule, and logs carry no gradient.
    assert_close(jax.grad(lambda x: el.spool(f)(x)[0])(jnp.float32(1.0)), 100.0)


def test_custom_vjp_forward_and_backward_logs():
    @jax.custom_vjp
    def f(x):
        el.log("primal", x)
        return jnp.sin(x)

    def fwd(x):
        el.log("fwd", x)
        return jnp.sin(x), x

    def bwd(x, g):
        el.log("bwd", g)
        return (7.0 * g,)

    f.defvjp(fwd, bwd)
    _, logs = el.spool(f)(jnp.float32(2.0))
    assert list(logs) == ["primal"]
    g, logs = el.spool(jax.grad(lambda x: 3.0 * f(x)))(jnp.float32(2.0))
    assert_close(g, 21.0)
    assert_close(logs["fwd"], [2.0])
    assert_close(logs["bwd"], [3.0])
    # outside the spool, the rules' keys have no place: lost, with a warning naming them
    with pytest.warns(el.LostEventsWarning, match=r"\((fwd|bwd)\), in a custom derivative"):
        assert_close(jax.grad(lambda x: el.spool(f)(x)[0])(jnp.float32(2.0)), 7.0)


def test_log_grad_logs_the_cotangent():
    def loss(w, x):
        h = el.log_grad("dh", jnp.tanh(w * x))
        return jnp.sum(h**2)

    w, x = jnp.float32(0.7), jnp.array([1.0, -2.0, 0.5])
    g, logs = el.spool(jax.grad(loss))(w, x)
    assert_close(g, jax.grad(loss)(w, x))
    assert_close(logs["dh"][0], 2 * np.tanh(0.7 * np.array([1.0, -2.0, 0.5])))
    # Outside any spool log_grad is the identity and adds nothing.
    assert "custom_vjp" not in str(jax.make_jaxpr(jax.grad(loss))(w, x))


def test_grad_of_spool_logs_carry_no_gradient():
    def f(x):
        _, logs = el.spool(sin_scan)(x)
        return jnp.sum(logs["c"])

    assert_close(jax.grad(f)(jnp.float32(1.0)), 0.0)
    assert_close(jax.grad(lambda x: el.spool(sin_scan)(x)[0])(1.0), jax.grad(sin_scan)(1.0))


# -- jit, filter_jit, nested spools ----------


def test_jit_nested_jit_and_filter_jit_both_orders_repeatedly():
    inner = jax.jit(sin_scan)
    f = jax.jit(lambda x: inner(x) + 1)
    ref = sin_scan_reference(1.0)
    for _ in range(3):
        for spooled in [
            el.spool(f),
            jax.jit(el.spool(f)),
            eqx.filter_jit(el.spool(sin_scan)),
            el.spool(eqx.filter_jit(sin_scan)),
        ]:
            _, logs = spooled(jnp.float32(1.0))
            assert_close(logs["c"], ref)


def test_nested_spool_consumes_unless_keep():
    def outer(x, keep):
        y, inner_logs = el.spool(sin_scan, keep=keep)(x)
        el.log("o", y)
        return inner_logs["c"]

    inner, logs = el.spool(outer)(jnp.float32(1.0), False)
    assert_close(inner, sin_scan_reference(1.0))
    assert list(logs) == ["o"]
    inner, logs = el.spool(outer)(jnp.float32(1.0), True)
    assert_close(logs["c"], sin_scan_reference(1.0))
    assert_close(inner, sin_scan_reference(1.0))


def test_nolog_removes_every_log():
    out, logs = el.spool(el.nolog(sin_scan))(jnp.float32(1.0))
    assert len(logs) == 0
    assert_close(out, sin_scan(1.0))
    assert "eqx_logs" not in str(jax.make_jaxpr(el.nolog(sin_scan))(1.0))


def test_log_outside_spool_adds_nothing():
    jaxpr = str(jax.make_jaxpr(sin_scan)(1.0))
    assert "eqx_logs" not in jaxpr

    def plain(x):
        return lax.scan(lambda c, _: (jnp.sin(c) * 1.5, None), x, None, length=4)[0]

    def hlo(f):
        text = jax.jit(f).lower(1.0).as_text()
        return text[text.index("func.func") :]  # drop the module name

    assert hlo(sin_scan) == hlo(plain)


# -- never mutate cached jaxprs ----------


def _module_body(c, x):
    el.log("x", x)
    return c + x, None


def test_cached_jaxprs_are_not_mutated():
    f = jax.jit(sin_scan)
    ref = sin_scan_reference(1.0)
    for _ in range(2):
        assert_close(el.spool(f)(jnp.float32(1.0))[1]["c"], ref)
    assert_close(f(1.0), sin_scan(1.0))
    assert "eqx_logs" not in str(jax.make_jaxpr(f)(1.0))
    assert_close(el.spool(f)(jnp.float32(1.0))[1]["c"], ref)
    for _ in range(2):
        out, logs = el.spool(lambda xs: lax.scan(_module_body, 0.0, xs)[0])(jnp.arange(3.0))
        assert_close(logs["x"], [0, 1, 2])
    assert len(el.spool(el.nolog(f))(jnp.float32(1.0))[1]) == 0
    assert_close(el.spool(f)(jnp.float32(1.0))[1]["c"], ref)


# -- filtering and caching ----------


def test_static_arguments_and_no_retrace():
    traces = []

    def f(x, n, name):
        traces.append(None)
        el.log(name, x * n)
        return x

    spooled = el.spool(f)
    for _ in range(3):
        _, logs = spooled(jnp.float32(2.0), 3, "k")
    assert len(traces) == 1
    assert_close(logs["k"], [6.0])
    _, logs = spooled(jnp.float32(2.0), 4, "k")  # new static value: one more trace
    assert len(traces) == 2
    _, logs = spooled(jnp.ones(2), 4, "j")  # new shape
    assert len(traces) == 3 and list(logs) == ["j"]


def test_equinox_module_as_function():
    class Model(eqx.Module):
        w: jax.Array
        name: str = eqx.field(static=True)

        def __call__(self, x):
            el.log(self.name, self.w * x)
            return self.w * x

    m = Model(jnp.float32(3.0), "wx")
    out, logs = el.spool(m)(jnp.float32(2.0))
    assert_close(out, 6.0)
    assert_close(logs["wx"], [6.0])


def test_tags_exclude_interval_prefix():
    def f(xs):
        def step(c, x):
            el.log("a", x, tags="train")
            el.log("b", x, tags=("eval", "debug"))
            return c, None

        return lax.scan(step, 0.0, xs)[0]

    xs = jnp.arange(7.0)
    _, logs = el.spool(f, tags="train")(xs)
    assert list(logs) == ["a"]
    _, logs = el.spool(f, exclude="debug")(xs)
    assert list(logs) == ["a"]
    _, logs = el.spool(f, interval=3, prefix="run/")(xs)
    assert_close(logs["run/a"], [0, 3, 6])
    assert int(logs.count["run/b"]) == 3


def test_bare_and_option_decorators():
    @el.spool
    def f(x):
        el.log("x", x)
        return x

    @el.spool(prefix="p/")
    def g(x):
        el.log("x", x)
        return x

    assert list(f(jnp.float32(1.0))[1]) == ["x"]
    assert list(g(jnp.float32(1.0))[1]) == ["p/x"]


# -- errors ----------


@pytest.mark.parametrize(
    "call, error, pattern",
    [
        (lambda x: el.log({1: x}), TypeError, "keys must be non-empty strings"),
        (lambda x: el.log(x, x), TypeError, "needs a string name"),
        (lambda x: el.log("s", "text"), TypeError, "'s'.*str"),
        (lambda x: el.log("o", object()), TypeError, "'o'.*object"),
        (lambda x: el.log("x", x, step=1.5), TypeError, "step=1.5.*integer scalar"),
        (lambda x: el.log("x", x, step=x), TypeError, "step=.*integer scalar"),
        (lambda x: el.log("x", x, count=1), ValueError, "reserved"),
        (lambda x: el.log("x", x, reduce="meen"), ValueError, "'meen' is not a reduction"),
        (lambda x: el.log("x", x, tags=(1,)), TypeError, "tags"),
    ],
)
def test_bad_input_errors_name_the_problem_and_leave_no_state(call, error, pattern):
    def f(x):
        call(x)
        return x

    with pytest.raises(error, match=pattern) as info:
        el.spool(f)(jnp.float32(1.0))
    assert "test_core.py" in str(info.value)  # names the call site
    assert_close(el.spool(sin_scan)(jnp.float32(1.0))[1]["c"], sin_scan_reference(1.0))
    assert "eqx_logs" not in str(jax.make_jaxpr(sin_scan)(1.0))


def test_unhandled_primitive_is_named():
    # a higher-order primitive of some library, with a log in its jaxpr and no rule
    my_call_p = jax.extend.core.Primitive("my_call")
    my_call_p.multiple_results = True
    my_call_p.def_abstract_eval(lambda *args, jaxpr: [v.aval for v in jaxpr.jaxpr.outvars])

    def f(x):
        closed = jax.make_jaxpr(lambda y: (el.log("p", y), y * 2)[1])(x)
        return my_call_p.bind(x, jaxpr=closed)[0]

    with pytest.raises(NotImplementedError, match="'my_call'.*test_core.py"):
        el.spool(f)(jnp.ones(2))


def test_bad_spool_options():
    with pytest.raises(ValueError, match="interval"):
        el.spool(sin_scan, interval=0)
    with pytest.raises(ValueError, match="'meen' is not a reduction"):
        el.spool(sin_scan, reduce="meen")
    with pytest.raises(TypeError, match="callable"):
        el.spool(3)


def test_unbatched_value_under_vmap_is_logged_once_without_batch_axis():
    """As in JAX itself, a value that does not depend on the vmapped inputs is not batched
    (this is also what keeps jacfwd and hessian from adding an axis to primal logs)."""

    def f(x):
        el.log("const", jnp.float32(7.0))
        el.log("x", x)
        return x

    _, logs = el.spool(jax.vmap(f))(jnp.arange(3.0))
    assert logs["const"].shape == (1,) and logs["x"].shape == (1, 3)
    _, logs = jax.vmap(el.spool(f))(jnp.arange(3.0))
    assert logs["const"].shape == (3, 1)


def test_scope_applies_to_a_jitted_function_called_under_two_scopes():
    @jax.jit
    def layer(x):
        el.log("norm", x)
        return x * 2

    def f(x):
        x = layer(x)
        with el.scope("a"):
            x = layer(x)
            with el.scope("b"):
                x = layer(x)
        return x

    _, logs = el.spool(f)(jnp.float32(1.0))
    assert {k: float(v[0]) for k, v in logs.items()} == {
        "norm": 1.0,
        "a/norm": 2.0,
        "a/b/norm": 4.0,
    }
    with el.scope("outer"):
        _, logs = el.spool(f)(jnp.float32(1.0))
    assert sorted(logs) == ["outer/a/b/norm", "outer/a/norm", "outer/norm"]


def _invariant_logs(x, nested=False):
    """Logs loop-invariant values inside loops: JAX's scan partial eval hoists such
    equations out of the loop unless eqx_logs keeps them in."""

    def inner(c, _):
        el.log("inner", x * 2)
        return c, None

    def body(c, _):
        el.log("x", x)
        lax.cond(x > 0, lambda: el.log("cond", x + 1), lambda: None)
        if nested:
            lax.scan(inner, c, None, length=2)
        jax.jit(lambda: el.log("jit", x))()
        return jnp.sin(c) * x, None

    return lax.scan(body, x, None, length=3)[0]


_AD_TRANSFORMS = {
    "none": lambda f: f,
    "grad": jax.grad,
    "grad_checkpoint": lambda f: jax.grad(jax.checkpoint(f)),
    "linearize": lambda f: lambda x: jax.linearize(f, x)[1](1.0),
    "vjp": lambda f: lambda x: jax.vjp(f, x)[1](1.0),
    "hessian": jax.hessian,
}


@pytest.mark.parametrize("name", list(_AD_TRANSFORMS))
def test_loop_invariant_logs_fire_every_iteration_under_ad(name):
    _, logs = el.spool(_AD_TRANSFORMS[name](_invariant_logs))(jnp.float32(0.5))
    assert_close(logs["x"], [0.5] * 3)
    assert_close(logs["cond"], [1.5] * 3)
    assert_close(logs["jit"], [0.5] * 3)


@pytest.mark.parametrize("name", list(_AD_TRANSFORMS))
def test_loop_invariant_logs_in_nested_scans_under_ad(name):
    _, logs = el.spool(_AD_TRANSFORMS[name](functools.partial(_invariant_logs, nested=True)))(
        jnp.float32(0.5)
    )
    assert_close(logs["inner"], [1.0] * 6)
    assert_close(logs["x"], [0.5] * 3)
