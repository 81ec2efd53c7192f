"""Logs inside real libraries' code: optimistix's solvers, lineax's linear operators, Flax NNX
training steps (issue 24, item 6). Errors name what the user wrote; what can work, works."""

import jax
import jax.numpy as jnp
import lineax as lx
import numpy as np
import optimistix as optx
import pytest
from helpers import assert_close, at_default_level

import eqx_logs as el
from eqx_logs import _compat

# -- 1. optimistix's NelderMead vmaps its simplex inside the user's function --------------------


def _nelder_mead(t):
    def fn(y, args):
        el.log({"y": y})
        return jnp.sum((y - args) ** 2)

    solver = optx.NelderMead(rtol=1e-4, atol=1e-4)
    return optx.minimise(fn, solver, jnp.zeros(2), args=t, max_steps=200).value


# Four targets would do as well, but NelderMead amplifies a one-ulp difference in `fn`
# (seen here in one lane of four: XLA compiles the batched sum differently once the program
# holds the spool's states) into another path: lanes are compared with runs alone exactly.
_TARGETS = jnp.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])


def test_nelder_mead_under_the_users_vmap_names_the_inner_vmap():
    """`spool(vmap(solve))`: one call site logs under the user's vmap only (a point) and under
    it and NelderMead's own (the simplex). The error says so, and what to write instead."""
    with pytest.raises(ValueError) as info:
        el.spool(jax.vmap(_nelder_mead), reduce="mean")(_TARGETS)
    message = str(info.value)
    assert "key 'y' is logged with shape (3, 2)" in message
    assert "under 1 vmap axis and under 2 vmap axes at the same call site" in message
    assert "test_real_libraries.py" in message and "(fn)" in message
    assert "NelderMead" in message
    assert "`jax.vmap(eqx_logs.spool(f))` instead of `eqx_logs.spool(jax.vmap(f))`" in message
    assert "different keys" not in message  # the old advice, which could not apply


def test_different_sites_under_different_vmaps_name_both():
    def f(x):
        el.log("v", x)
        jax.vmap(lambda r: el.log("v", r))(jnp.stack([x, x, x]))
        return x

    with pytest.raises(ValueError, match=r"under 1 vmap axis and under 2 vmap axes at .*:\d+"):
        el.spool(jax.vmap(f))(jnp.ones((4, 2)))


@pytest.mark.parametrize("reduce", ["stack", "mean", "count"])
def test_nelder_mead_spool_inside_the_users_vmap_is_per_lane(reduce):
    """The fix the error gives: each lane of `vmap(spool(solve))` is what `spool(solve)`
    gives for that lane alone (the key takes NelderMead's simplex batch)."""
    red = el.Stack(capacity=400) if reduce == "stack" else reduce
    # (to a float's last bits, as a user's default compile gives them: `at_default_level`)
    out, logs = at_default_level(jax.vmap(el.spool(_nelder_mead, reduce=red)))(_TARGETS)
    np.testing.assert_allclose(out, _TARGETS, atol=1e-3)  # converged
    for i, t in enumerate(_TARGETS):
        solo_out, solo = at_default_level(el.spool(_nelder_mead, reduce=red))(t)
        assert_close(out[i], solo_out, f"solution {i}")
        np.testing.assert_array_equal(logs.count["y"][i], solo.count["y"])
        np.testing.assert_allclose(logs["y"][i], solo["y"], rtol=1e-6, equal_nan=True)
    assert int(np.max(logs.count["y"])) > 10  # every evaluation counted, not just one


# -- 2. a log inside a lineax linear operator's function --------------------------------------

_M = jnp.array([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]])
_B = jnp.array([1.0, 2.0, 3.0])


def _linear_solve(a, b, solver, log=True, calls=None):
    def mv(x):
        if log:
            el.log("x", x)
        else:  # the oracle: every call of the operator's function, on the host
            jax.debug.callback(lambda v: calls.append(np.asarray(v)), x)
        return a @ x

    struct = jax.ShapeDtypeStruct(b.shape, b.dtype)
    op = lx.FunctionLinearOperator(mv, struct, lx.positive_semidefinite_tag)
    return lx.linear_solve(op, b, solver=solver).value


_CG = lx.CG(rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("closed_over", ["traced", "constant"])
@pytest.mark.parametrize("solver", [_CG, lx.GMRES(rtol=1e-6, atol=1e-6)], ids=["cg", "gmres"])
def test_log_in_a_linear_operator_of_an_iterative_solve(closed_over, solver):
    """CG and GMRES call the operator's function inside lineax's `linear_solve` primitive,
    whose implementation JAX traces only when it lowers it: each call is one event, in order,
    as the host sees them. The function closes over a traced matrix (a closure-converted
    jaxpr among the primitive's parameters) or a constant (a Python function there); both
    were lost or refused before."""
    if closed_over == "traced":
        spooled = el.spool(_linear_solve, reduce=el.Stack(capacity=30))
        out, logs = spooled(_M, _B, solver)
    else:
        spooled = el.spool(lambda b: _linear_solve(_M, b, solver), reduce=el.Stack(capacity=30))
        out, logs = spooled(_B)
    calls = []
    _linear_solve(_M, _B, solver, log=False, calls=calls)
    jax.effects_barrier()
    n = len(calls)
    assert n >= 2
    assert int(logs.count["x"]) == n
    np.testing.assert_allclose(logs["x"][:n], np.stack(calls), rtol=1e-5, atol=1e-6)
    assert_close(out, jnp.linalg.solve(_M, _B), "solution")


def test_log_in_a_linear_operator_keeps_its_derivatives():
    """The solve's implicit derivatives (lineax's JVP rule) are kept, with the spool inside
    or outside the derivative, and `vmap` on either side of the spool is per lane."""

    def loss(a, b):
        return jnp.sum(_linear_solve(a, b, _CG) ** 2)

    want = jax.grad(lambda a, b: jnp.sum(jnp.linalg.solve(a, b) ** 2), argnums=(0, 1))(_M, _B)

    def spooled_loss(a, b):
        return el.spool(loss, reduce="count")(a, b)[0]

    inside = jax.grad(spooled_loss, argnums=(0, 1))(_M, _B)
    outside, logs = el.spool(jax.grad(loss, argnums=(0, 1)), reduce="count")(_M, _B)
    for got in (inside, outside):
        assert_close(got[0], want[0], "d/dA")
        assert_close(got[1], want[1], "d/db")
    assert int(logs["x"]) > 0

    # CG on a diagonal matrix needs one iteration per distinct eigenvalue b touches: the
    # lanes make different numbers of calls
    diagonal = jnp.diag(jnp.arange(1.0, 7.0))
    bs = jnp.array([[1.0, 0, 0, 0, 0, 0], [1.0, 1, 1, 1, 1, 1], [1.0, 1, 0, 0, 0, 0]])
    solve_b = lambda b: _linear_solve(diagonal, b, _CG)  # noqa: E731
    out, batched = el.spool(jax.vmap(solve_b), reduce="count")(bs)
    _, lanes = jax.vmap(el.spool(solve_b, reduce="count"))(bs)
    solo = [int(el.spool(solve_b, reduce="count")(b)[1]["x"]) for b in bs]
    assert len(set(solo)) == 3, solo
    np.testing.assert_array_equal(batched["x"], solo)
    np.testing.assert_array_equal(lanes["x"], solo)
    assert_close(out, bs / jnp.arange(1.0, 7.0)[None], "solutions")


def test_log_in_a_materialised_linear_operator():
    """With a direct solver (the default, LU here) lineax materialises the operator before
    its primitive, once, under a vmap over the basis: one event per basis vector (a lane),
    and the primitive's own copy of the function, never called, logs nothing."""
    out, logs = el.spool(_linear_solve)(_M, _B, lx.AutoLinearSolver(well_posed=True))
    assert_close(out, jnp.linalg.solve(_M, _B), "solution")
    np.testing.assert_allclose(logs["x"][0], np.eye(3))
    np.testing.assert_array_equal(logs.count["x"], [1, 1, 1])


def test_location_of_an_equinox_primitive_is_the_users_call():
    """An equation that Equinox binds for lineax, inside lineax's jit, is located at the
    user's `lx.linear_solve` call, not in Equinox's `filter_primitive_bind` (an equation's
    traceback stops at its jit: the equations around it are searched too)."""

    def find(jaxpr, outer):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "linear_solve":
                return eqn, outer
            for sub in _compat.sub_jaxprs(eqn.params):
                found = find(_compat.unpack(sub)[0], [*outer, eqn])
                if found:
                    return found
        return None

    closed = jax.make_jaxpr(lambda a, b: _linear_solve(a, b, _CG, log=False, calls=[]))(_M, _B)
    eqn, outer = find(closed.jaxpr, [])
    assert outer  # inside lineax's jit
    assert "site-packages" in _compat.eqn_location(eqn)  # its own traceback: Equinox only
    where = _compat.eqn_location(eqn, outer)
    assert "test_real_libraries.py" in where and "(_linear_solve)" in where, where


# -- 3. optimistix's Newton root find, differentiated inside and outside the spool -------------


def _cube_root(a):
    def fn(y, a):
        el.log("y", y)
        return y**3 - a

    solver = optx.Newton(rtol=1e-6, atol=1e-6)
    return optx.root_find(fn, solver, jnp.array(1.0), args=a, max_steps=20).value


def _newton_iterates(a, y, n):
    out = [y]
    for _ in range(n - 1):
        y = y - (y**3 - a) / (3 * y**2)
        out.append(y)
    return np.array(out)


def test_newton_root_find_gradient_with_the_spool_inside_and_outside():
    """`jax.grad(spool(f))` used to fail on the linear solve inside optimistix's implicit
    derivative (a lineax primitive holding the logging function). Both orders give the hand
    derivative of a**(1/3), 1 / (3 a**(2/3)) = 1/12 at a = 8, and the Newton iterates."""
    a = jnp.array(8.0)
    stack = el.Stack(capacity=16)
    root, logs = el.spool(_cube_root, reduce=stack)(a)
    assert_close(root, 2.0, "root")
    n = int(logs.count["y"])
    np.testing.assert_allclose(logs["y"][:n], _newton_iterates(8.0, 1.0, n), rtol=1e-5)

    def spooled(a):
        return el.spool(_cube_root, reduce=stack)(a)

    (root_in, logs_in), grad_in = jax.value_and_grad(spooled, has_aux=True)(a)
    grad_out, logs_out = el.spool(jax.grad(_cube_root), reduce=stack)(a)
    assert_close(root_in, 2.0, "root")
    assert_close(grad_in, 1.0 / 12.0, "grad(spool(f))")
    assert_close(grad_out, 1.0 / 12.0, "spool(grad(f))")
    # the forward events come first in both orders; the implicit derivative then evaluates
    # `fn` at the root (its Jacobian), and those events follow
    for got in (logs_in, logs_out):
        np.testing.assert_allclose(got["y"][:n], logs["y"][:n], rtol=1e-6)
        m = int(got.count["y"])
        assert m > n
        np.testing.assert_allclose(got["y"][n:m], 2.0, rtol=1e-6)


# -- 4. Flax NNX: a training step that updates the model in place -----------------------------


def _nnx_setup():
    nnx = pytest.importorskip("flax.nnx")
    optax = pytest.importorskip("optax")

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.out = nnx.Linear(4, 1, rngs=rngs)

        def __call__(self, x):
            h = nnx.relu(self.bn(self.lin(x)))
            el.log("h", jnp.mean(h))
            return self.out(h)

    def make():
        model = Model(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)

    def step(model, optimizer, x, y):
        def loss_fn(m):
            return jnp.mean((m(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        el.log("loss", loss)
        optimizer.update(model, grads)
        return loss

    return nnx, make, step


def _state(nnx, *objects):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(objects))]


_X = jax.random.normal(jax.random.key(0), (8, 3))
_Y = jnp.ones((8, 1))


@pytest.mark.parametrize("order", ["spool(nnx.jit)", "nnx.jit(spool)", "spool", "tap"])
def test_nnx_step_updates_the_model_in_place(order):
    """The model's parameters, BatchNorm statistics and the optimizer's state after N steps
    equal those of the same loop without eqx_logs, and the logs are the losses."""
    nnx, make, step = _nnx_setup()
    model, optimizer = make()
    plain = nnx.jit(step)
    want = [float(plain(model, optimizer, _X, _Y)) for _ in range(4)]
    want_state = _state(nnx, model, optimizer)

    seen = []
    wrapped = {
        "spool(nnx.jit)": el.spool(nnx.jit(step)),
        "nnx.jit(spool)": nnx.jit(el.spool(step)),
        "spool": el.spool(step),
        "tap": el.tap(step, callback=lambda logs, steps: seen.append(logs.get("loss"))),
    }[order]
    model, optimizer = make()
    losses = []
    for _ in range(4):
        out = wrapped(model, optimizer, _X, _Y)
        if order == "tap":
            losses.append(float(out))
        else:
            losses.append(float(out[0]))
            assert_close(out[1]["loss"], [out[0]], "logged loss")
    jax.effects_barrier()
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    if order == "tap":
        np.testing.assert_allclose([x for x in seen if x is not None], want, rtol=1e-5)
    for got, ref in zip(_state(nnx, model, optimizer), want_state):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert int(optimizer.step[...]) == 4


def test_spool_of_an_nnx_model_updates_its_statistics():
    """`spool(model)`: the BatchNorm statistics the forward pass writes reach the model (the
    spool holds the model itself, not a copy), and later changes to it are seen."""
    nnx, make, _ = _nnx_setup()
    model, _ = make()
    twin, _ = make()
    spooled = el.spool(model)
    for _ in range(2):
        out, logs = spooled(_X)
        assert_close(out, twin(_X), "output")
        assert logs.count["h"] == 1
    for got, ref in zip(_state(nnx, model), _state(nnx, twin)):
        np.testing.assert_allclose(got, ref, rtol=1e-6)
    model.out.bias[...] = jnp.full((1,), 5.0)
    twin.out.bias[...] = jnp.full((1,), 5.0)
    assert_close(spooled(_X)[0], twin(_X), "output after an outside change")


# -- eqx.internal.noinline: its function is a parameter, in no jaxpr ---------------------------


def _noinline_program(noinline: bool):
    import equinox as eqx

    def layer(x, w):
        el.log("pre", x * w)
        return jnp.tanh(x * w)

    call = eqx.internal.noinline(layer) if noinline else layer

    def f(x):
        return call(call(x, 2.0), 0.5).sum()

    return f


@pytest.mark.parametrize(
    "form",
    ["spool", "jit(spool)", "vmap(spool)", "spool(vmap)", "spool(grad)", "grad(spool)", "remat"],
)
def test_logs_in_an_equinox_noinline_function_are_those_of_the_inlined_one(form):
    """`eqx.internal.noinline(f)` calls `f` from its lowering: its logs were dropped silently.
    Now they are captured as if `f` were inlined (the reference), once per forward call under
    `grad` (AD's JVP and transpose calls recompute the forward pass: no events of their own),
    with the same outputs and derivatives."""

    def wrap(f):
        return {
            "spool": lambda: el.spool(f)(jnp.arange(3.0)),
            "jit(spool)": lambda: jax.jit(el.spool(f))(jnp.arange(3.0)),
            "vmap(spool)": lambda: jax.vmap(el.spool(f))(jnp.arange(6.0).reshape(2, 3)),
            "spool(vmap)": lambda: el.spool(jax.vmap(f))(jnp.arange(6.0).reshape(2, 3)),
            "spool(grad)": lambda: el.spool(jax.grad(f))(jnp.arange(3.0)),
            "grad(spool)": lambda: (
                jax.grad(lambda x: el.spool(f)(x)[0])(jnp.arange(3.0)),
                el.spool(f)(jnp.arange(3.0))[1],
            ),
            "remat": lambda: el.spool(jax.grad(jax.checkpoint(f)))(jnp.arange(3.0)),
        }[form]()

    out, logs = wrap(_noinline_program(True))
    want_out, want = wrap(_noinline_program(False))
    assert_close(out, want_out, form)
    assert sorted(logs) == ["pre"]
    assert_close(logs["pre"], want["pre"], form)
    assert_close(logs.count["pre"], want.count["pre"], form)
