"""The compat module's vocabulary holds on the installed JAX version."""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import eqx_logs as el
from eqx_logs import _compat
from eqx_logs._primitive import is_log, log_effect
from eqx_logs._spool import trace_filtered


def _eqns(f, *args, enabled=True):
    with _compat.logging_enabled(enabled):
        closed = jax.make_jaxpr(f)(*args)
    jaxpr, consts = _compat.unpack(closed)
    return closed, jaxpr, consts


def test_unpack_and_bind_eqn_reproduce_eval():
    c = np.arange(3.0, dtype=np.float32)

    def f(x):
        return jnp.sin(x) * c + 1.0

    closed, jaxpr, consts = _eqns(f, jnp.ones(3))
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, [jnp.ones(3)]))
    for eqn in jaxpr.eqns:
        invals = [v.val if isinstance(v, _compat.Literal) else env[v] for v in eqn.invars]
        env.update(zip(eqn.outvars, _compat.bind_eqn(eqn, invals)))
    np.testing.assert_allclose(env[jaxpr.outvars[0]], f(jnp.ones(3)))


def test_scan_while_cond_accessors():
    def f(x, n):
        def body(c, y):
            return (c[0] + y * x, c[1]), c[0]

        (a, _), ys = lax.scan(body, (x, 2.0), jnp.arange(4.0), reverse=True)
        w = lax.while_loop(lambda v: v < n, lambda v: v + x, a)
        return lax.cond(w > 0, lambda: w, lambda: -w) + ys.sum()

    _, jaxpr, _ = _eqns(f, jnp.float32(1.0), jnp.float32(10.0))
    by_name = {e.primitive.name: e for e in jaxpr.eqns}
    body, num_consts, num_carry = _compat.scan_parts(by_name[_compat.SCAN])
    body_jaxpr, _ = _compat.unpack(body)
    assert num_consts + num_carry + 1 == len(body_jaxpr.invars)
    assert _compat.scan_options(by_name[_compat.SCAN])["reverse"] is True
    assert _compat.scan_options(by_name[_compat.SCAN])["length"] == 4
    cond, cond_n, wbody, body_n = _compat.while_parts(by_name[_compat.WHILE])
    assert len(_compat.unpack(cond)[0].outvars) == 1
    assert len(_compat.unpack(wbody)[0].invars) == body_n + 1
    assert len(_compat.cond_branches(by_name[_compat.COND])) == 2
    assert len(list(_compat.sub_jaxprs(by_name[_compat.COND].params))) == 2


def test_strip_eqn_builds_new_jaxprs_and_leaves_the_original():
    def f(x):
        def body(c, _):
            el.log("c", c)
            return c + 1, None

        return lax.scan(body, x, None, length=2)[0]

    closed, jaxpr, _ = _eqns(f, jnp.float32(0.0))
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == _compat.SCAN]
    before = str(closed)
    stripped = _compat.strip_eqn(scan, is_log, log_effect)
    assert log_effect not in stripped.effects
    assert "eqx_logs.log" not in str(stripped)
    assert str(closed) == before and "eqx_logs.log" in before


def test_logging_enabled_is_part_of_the_jit_key():
    traces = []

    @jax.jit
    def f(x):
        traces.append(_compat.logging_enabled.value)
        return x + 1

    f(1.0)
    with _compat.logging_enabled(True):
        f(1.0)
    f(1.0)
    assert traces == [False, True]


def test_hoisting_detection_finds_jax_functions():
    # If JAX renames these, the loop-invariant hoisting guard would silently stop working.
    assert len(_compat.hoisting_codes) >= 1
    assert len(_compat.splitting_codes) >= 3


def test_is_traced_sees_tracers_of_every_transformation():
    from eqx_logs import _compat

    x = jnp.ones(2)
    assert not _compat.is_traced((x, {"a": 1.0}))
    for transform in (jax.jit, jax.grad, jax.vmap):
        seen = []

        def f(y):
            seen.append(_compat.is_traced(([y], {})))
            return y.sum()

        transform(f)(x)
        assert seen == [True]


def test_unnamed_vmap_axes_are_recorded_as_none():
    # JAX names an unnamed vmap axis with a sentinel object: `across` must not see it as an
    # axis (it made `across` name it in an error, and refuse an axis of a shard_map)
    def f(x):
        el.log("x", x)
        return x

    closed, _, _ = trace_filtered(jax.vmap(jax.vmap(f), axis_name="b"), (jnp.ones((2, 3)),), {})
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "eqx_logs.log"]
    assert eqn.params["axis_names"] == ("b", None)


def test_eqn_location_is_the_users_line_not_eqx_logs():
    # `eqn_location` skips the frames of every eqx_logs module (`log` binds its primitive in
    # eqx_logs, below the user's call), not only those of the `_compat` package beside it
    def f(x):
        el.log("x", x)  # the line named
        return x

    _, jaxpr, _ = _eqns(f, jnp.float32(1.0))
    (eqn,) = [e for e in jaxpr.eqns if is_log(e)]
    where = _compat.eqn_location(eqn)
    assert where == f"{__file__}:{f.__code__.co_firstlineno + 1} ({f.__qualname__})", where


def test_eqns_walks_every_depth_in_program_order():
    """`_compat.eqns`, the one walk over jaxprs: each equation, then (deep) those of the jaxprs
    it holds, against the jaxpr's own nesting read by hand."""

    def f(x):
        y = jnp.sin(x)

        def body(c, _):
            return lax.cond(c.sum() > 0, jnp.cos, jnp.tanh, c), None

        return lax.scan(body, y, length=2)[0] * 2.0

    closed = jax.make_jaxpr(f)(jnp.ones(3))
    top = list(closed.jaxpr.eqns)
    assert list(_compat.eqns(closed, deep=False)) == top

    def by_hand(jaxpr):
        out = []
        for eqn in jaxpr.eqns:
            out.append(eqn)
            for sub in _compat.sub_jaxprs(eqn.params):
                out += by_hand(_compat.unpack(sub)[0])
        return out

    deep = list(_compat.eqns(closed))
    assert deep == by_hand(closed.jaxpr)
    names = [e.primitive.name for e in deep]
    assert {"sin", "scan", "cond", "cos", "tanh", "mul"} <= set(names)
    assert names.index("scan") < names.index("cond") < names.index("cos") < names.index("mul")
    assert _compat.any_eqn(closed, lambda e: e.primitive.name == "tanh")
    assert not _compat.any_eqn(closed, lambda e: e.primitive.name == "exp")
