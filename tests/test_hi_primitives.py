"""JAX's "hi" primitives under spool, jit(spool), tap and vmap, with and without logs.

jax 0.12 binds several public functions as hi primitives (`HiPrim`s, one equation
`call_hi_primitive` each), which JAX expands into ordinary primitives only when it binds them:
`jnp.searchsorted` (and `interp`, `digitize`, `histogram`, `isin(method="binary_search")`),
`jnp.nonzero(size=)` (and `flatnonzero`, `argwhere`, `where(c, size=)`, `unique`,
`setdiff1d`), `jnp.ldexp`, `jnp.frexp`, `lax.custom_root` (and its derivative's
`_RootLinearMap`), Pallas's `fuser.fusible` and `tpu.einshape`, and, behind JAX options or
`defvjp(..., generic_batching=True)`, `lax.scan`, `jax.checkpoint`, `checkpoint_name`,
`jax.custom_jvp` and `jax.custom_vjp`. Every value is checked against numpy (or the same
function without eqx_logs). On jax 0.10, where the public functions bind ordinary primitives
(and only the options and `jax.experimental.hijax` bind hi ones, `VJPHiPrimitive`s), the same
checks run on them.
"""

import contextlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_close
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import hijax

import eqx_logs as el
from eqx_logs import _compat

X = np.array([0.3, -1.2, 0.0, 2.5, 0.0, 0.7, -0.4, 1.1], np.float32)
XP = np.linspace(-2.0, 3.0, 6, dtype=np.float32)
FP = XP**2
BINS = np.array([-1.0, 0.0, 0.5, 2.0], np.float32)
SIZE = 8  # the static size of nonzero, unique, ...


def _pad(a, fill, size=SIZE):
    a = np.asarray(a)
    return np.concatenate([a, np.full((size - len(a), *a.shape[1:]), fill, a.dtype)])


def _root(x, tangent_solve=lambda g, y: y / 2.0):
    """sqrt(x**2 + 1) by Newton's method, with implicit derivatives."""

    def f(y):
        return y**2 - (x**2 + 1.0)

    def solve(f, y0):
        return lax.fori_loop(0, 20, lambda i, y: y - f(y) / (2 * y), y0)

    return lax.custom_root(f, jnp.ones_like(x), solve, tangent_solve)


def _scalar_tangent_solve(g, y):
    return y / g(jnp.ones_like(y))  # calls the linearized function: a `_RootLinearMap`


def _np_unique(x):
    u = np.unique(x)
    return _pad(u, 0.0)


def _fusible(x):
    from jax.experimental.pallas import fuser

    @fuser.fusible
    def kernel(x_fusion, out_fusion):
        return jnp.sin(x_fusion()) * 2.0

    return kernel(x)


def _einshape(x):
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.einshape("ab->ba", x.reshape(2, 4))


# name: (function of X, numpy reference, the hi primitives it binds on jax 0.12)
CASES = {
    "searchsorted": (
        lambda x: jnp.searchsorted(jnp.sort(x), x),
        lambda x: np.searchsorted(np.sort(x), x),
        {"SearchSorted"},
    ),
    "searchsorted_methods": (
        lambda x: [
            jnp.searchsorted(jnp.sort(x), x, side="right", method=method)
            for method in ("scan", "scan_unrolled", "compare_all", "sort")
        ],
        lambda x: [np.searchsorted(np.sort(x), x, side="right")] * 4,
        {"SearchSorted"},
    ),
    "interp": (
        lambda x: jnp.interp(x, XP, FP),
        lambda x: np.interp(x, XP, FP),
        {"SearchSorted"},
    ),
    "digitize": (
        lambda x: jnp.digitize(x, BINS),
        lambda x: np.digitize(x, BINS),
        {"SearchSorted"},
    ),
    "histogram": (
        lambda x: jnp.histogram(x, bins=4, range=(-2.0, 3.0)),
        lambda x: np.histogram(x, bins=4, range=(-2.0, 3.0)),
        {"SearchSorted"},
    ),
    "histogram2d": (
        lambda x: jnp.histogram2d(x, x * x, bins=3, range=[[-2.0, 3.0], [0.0, 7.0]])[0],
        lambda x: np.histogram2d(x, x * x, bins=3, range=[[-2.0, 3.0], [0.0, 7.0]])[0],
        {"SearchSorted"},
    ),
    "isin": (
        lambda x: jnp.isin(jnp.round(x), BINS, method="binary_search"),
        lambda x: np.isin(np.round(x), BINS),
        {"SearchSorted"},
    ),
    "nonzero": (
        lambda x: jnp.nonzero(x, size=SIZE, fill_value=-1),
        lambda x: tuple(_pad(i, -1) for i in np.nonzero(x)),
        {"Nonzero"},
    ),
    "flatnonzero": (
        lambda x: jnp.flatnonzero(x.reshape(2, 4), size=SIZE),
        lambda x: _pad(np.flatnonzero(x), 0),
        {"Nonzero"},
    ),
    "argwhere": (
        lambda x: jnp.argwhere(x.reshape(2, 4) > 0, size=SIZE, fill_value=-1),
        lambda x: _pad(np.argwhere(x.reshape(2, 4) > 0), -1),
        {"Nonzero"},
    ),
    "where": (
        lambda x: jnp.where(x > 0, size=SIZE, fill_value=-1),
        lambda x: tuple(_pad(i, -1) for i in np.where(x > 0)),
        {"Nonzero"},
    ),
    "unique": (
        lambda x: jnp.unique(jnp.round(x), size=SIZE, fill_value=0.0),
        lambda x: _np_unique(np.round(x)),
        {"Nonzero"},
    ),
    "setdiff1d": (
        lambda x: jnp.setdiff1d(jnp.round(x), BINS, size=SIZE, fill_value=0.0),
        lambda x: _pad(np.setdiff1d(np.round(x), BINS), 0.0),
        {"Nonzero"},
    ),
    "ldexp": (
        lambda x: jnp.ldexp(x, jnp.arange(SIZE, dtype=jnp.int32)),
        lambda x: np.ldexp(x, np.arange(SIZE, dtype=np.int32)),
        {"Ldexp"},
    ),
    "frexp": (jnp.frexp, np.frexp, {"Frexp"}),
    "custom_root": (_root, lambda x: np.sqrt(x**2 + 1.0), {"CustomRoot"}),
    "custom_root_grad": (
        jax.grad(lambda x: jnp.sum(_root(x, _scalar_tangent_solve))),
        lambda x: x / np.sqrt(x**2 + 1.0),
        {"CustomRoot", "_RootLinearMap"},
    ),
    "fusible": (_fusible, lambda x: np.sin(x) * 2.0, {"Fusible"}),
    "einshape": (_einshape, lambda x: x.reshape(2, 4).T, {"Einshape"}),
}

# Hi primitives of jax 0.12 that no test here binds, and why.
UNBOUND = {
    "Einsum": "not bound by any public function (`jnp.einsum` binds `dot_general`)",
    "CheckpointNameFwd": "no caller in jax 0.12",
    "PrimalLeftTangentRight": "bound while JAX differentiates `jax.checkpoint` under "
    "`jax_remat3`, and left in no jaxpr (checked with grad, vjp, linearize, hessian)",
}


def _hi_kinds(closed) -> set[str]:
    """The hi primitives bound anywhere in `closed`."""
    kinds = set()
    for eqn in _compat.unpack(closed)[0].eqns:
        name = _compat.hi_name(eqn)
        kinds |= {name} if name else set()
        for sub in _compat.sub_jaxprs(eqn.params):
            kinds |= _hi_kinds(sub)
    return kinds


def _new_jax() -> bool:
    return hasattr(hijax, "HiPrim")


def _tap_events(fun, *args):
    """`(outputs, [logs of each event])` of `tap(fun)(*args)`."""
    events = []
    out = el.tap(fun, callback=lambda logs, steps: events.append(logs))(*args)
    jax.effects_barrier()
    return out, events


def _close_tree(got, want, what):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        assert_close(g, w, f"{what}, leaf {i}")


@pytest.mark.parametrize("name", list(CASES))
def test_hi_primitive(name):
    fun, ref, kinds = CASES[name]
    want = ref(X)
    if _new_jax():
        assert kinds <= _hi_kinds(jax.make_jaxpr(fun)(X)), f"{name} binds no {kinds}"
    _close_tree(fun(X), want, f"{name} without eqx_logs")

    def logged(x):
        el.log("x", x)
        out = fun(x)
        el.log("out", out)  # the hi primitive's results
        return out

    # without logs, and with logs before and of its results
    _close_tree(el.spool(fun)(X)[0], want, f"spool({name})")
    for how, spooled in [("spool", el.spool(logged)), ("jit(spool)", jax.jit(el.spool(logged)))]:
        out, logs = spooled(X)
        _close_tree(out, want, f"{how}({name})")
        _close_tree(logs["out"], jax.tree.map(lambda w: np.asarray(w)[None], want), how)
        assert_close(logs["x"], X[None], f"{how}({name}): logs['x']")
    out, events = _tap_events(logged, X)
    _close_tree(out, want, f"tap({name})")
    assert [list(e) for e in events] == [["x"], ["out"]]
    _close_tree(events[1]["out"], want, f"tap({name}): the event of 'out'")


def _loops(x):
    """Hi primitives in scan and cond bodies, and logs of their results there."""

    def body(carry, i):
        y = x + i
        s = jnp.searchsorted(jnp.sort(y), 0.5 * y)
        (nz,) = jnp.nonzero(y > 1.0, size=SIZE, fill_value=-1)
        u = jnp.unique(jnp.round(y), size=SIZE, fill_value=0.0)
        m, e = jnp.frexp(y)
        r = _root(y)
        el.log("scan", {"s": s, "nz": nz, "u": u, "m": m, "e": e, "r": r})
        return carry + jnp.sum(r), None

    total, _ = lax.scan(body, jnp.float32(0.0), jnp.arange(3, dtype=jnp.float32))

    def taken(x):
        v = jnp.interp(x, XP, FP)
        el.log("cond", v)
        (where,) = jnp.where(x > 0, size=SIZE, fill_value=0)
        return jnp.sum(v) + jnp.sum(where).astype(v.dtype)

    return lax.cond(x[0] > 0, taken, lambda x: jnp.sum(x), x) + total


def _np_loops(x):
    """`_loops` in numpy: its output and its events."""
    scan, total = [], 0.0
    for i in range(3):
        y = x + i
        m, e = np.frexp(y)
        r = np.sqrt(y**2 + 1.0)
        nz = _pad(np.nonzero(y > 1.0)[0], -1)
        u = _np_unique(np.round(y))
        s = np.searchsorted(np.sort(y), 0.5 * y)
        scan.append({"s": s, "nz": nz, "u": u, "m": m, "e": e, "r": r})
        total += r.sum()
    if x[0] > 0:
        v = np.interp(x, XP, FP)
        cond = [v]
        out = v.sum() + _pad(np.nonzero(x > 0)[0], 0).sum() + total
    else:
        cond, out = [], x.sum() + total
    return out, scan, cond


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["cond_taken", "cond_not_taken"])
def test_hi_primitives_in_scan_and_cond_bodies(sign):
    x = sign * X
    want, scan, cond = _np_loops(x)
    stacked = {k: np.stack([s[k] for s in scan]) for k in scan[0]}
    assert_close(_loops(x), want, "without eqx_logs")
    for how, spooled in [("spool", el.spool(_loops)), ("jit(spool)", jax.jit(el.spool(_loops)))]:
        out, logs = spooled(x)
        assert_close(out, want, how)
        for k, v in stacked.items():
            assert_close(logs["scan"][k], v, f"{how}: logs['scan'][{k!r}]")
        assert int(logs.count["cond"]) == len(cond)
        if cond:
            assert_close(logs["cond"][:1], np.stack(cond), f"{how}: logs['cond']")
    out, events = _tap_events(_loops, x)
    assert_close(out, want, "tap")
    assert [list(e) for e in events] == [["scan"]] * 3 + [["cond"]] * len(cond)
    for i, event in enumerate(events[:3]):
        for k, v in scan[i].items():
            assert_close(event["scan"][k], v, f"tap: event {i} of 'scan'[{k!r}]")
    if cond:
        assert_close(events[3]["cond"], cond[0], "tap: the event of 'cond'")


def _lane(x):
    s = jnp.searchsorted(jnp.sort(x), x)
    (nz,) = jnp.nonzero(x > 0.5, size=SIZE, fill_value=-1)
    out = {"s": s, "nz": nz, "interp": jnp.interp(x, XP, FP), "ldexp": jnp.ldexp(x, s)}
    el.log("out", out)
    return out


def _np_lane(x):
    s = np.searchsorted(np.sort(x), x)
    nz = _pad(np.nonzero(x > 0.5)[0], -1)
    return {"s": s, "nz": nz, "interp": np.interp(x, XP, FP), "ldexp": np.ldexp(x, s)}


def test_hi_primitives_under_vmap():
    xs = np.stack([X, 2.0 * X[::-1]])
    lanes = [_np_lane(x) for x in xs]
    want = {k: np.stack([lane[k] for lane in lanes]) for k in lanes[0]}
    _close_tree(jax.vmap(_lane)(xs), want, "vmap without eqx_logs")
    # a vmap outside the spool: independent runs, one event each
    out, logs = jax.vmap(el.spool(_lane))(xs)
    _close_tree(out, want, "vmap(spool)")
    _close_tree(jax.tree.map(lambda v: v[:, 0], dict(logs["out"])), want, "vmap(spool) logs")
    # a vmap inside the spool: one event, batched
    out, logs = el.spool(jax.vmap(_lane))(xs)
    _close_tree(out, want, "spool(vmap)")
    _close_tree(jax.tree.map(lambda v: v[0], dict(logs["out"])), want, "spool(vmap) logs")
    out, logs = jax.jit(el.spool(jax.vmap(_lane)))(xs)
    _close_tree(out, want, "jit(spool(vmap))")
    _close_tree(jax.tree.map(lambda v: v[0], dict(logs["out"])), want, "jit(spool(vmap)) logs")


def test_diffrax_dense_output():
    diffrax = pytest.importorskip("diffrax")
    ts = jnp.linspace(0.0, 2.0, 5)

    def solve(y0, hook):
        def vector_field(t, y, args):
            hook(y)
            return -0.5 * y

        term = diffrax.ODETerm(vector_field)
        saveat = diffrax.SaveAt(dense=True)
        sol = diffrax.diffeqsolve(
            term, diffrax.Tsit5(), 0.0, 2.0, 0.1, y0, saveat=saveat, max_steps=64
        )
        return jax.vmap(sol.evaluate)(ts), sol.evaluate(0.7, 1.3)

    y0 = jnp.array([1.0, 2.0])
    calls = []
    want = jax.jit(lambda y0: solve(y0, lambda y: jax.debug.callback(calls.append, y)))(y0)
    jax.effects_barrier()
    assert_close(want[0], np.exp(-0.5 * np.asarray(ts))[:, None] * np.asarray(y0), "exp decay")

    def logged(y0):
        return solve(y0, lambda y: el.log("y", y))

    for how, spooled in [
        ("spool", el.spool(logged, reduce="mean")),
        ("jit(spool)", jax.jit(el.spool(logged, reduce="mean"))),
    ]:
        out, logs = spooled(y0)
        _close_tree(out, want, f"{how}: sol.evaluate")
        assert int(logs.count["y"]) == len(calls) > 0, how
        assert_close(logs["y"], np.mean(calls, axis=0), f"{how}: the mean of 'y'")


class _Cube(getattr(hijax, "HiPrim", None) or hijax.VJPHiPrimitive):
    """A hi primitive of our own (`HiPrim` on jax 0.12, `VJPHiPrimitive` on jax 0.10)."""

    def __init__(self, aval):
        self.in_avals = (aval,)
        self.out_aval = aval
        self.params = {}
        super().__init__()

    def expand(self, x):
        return x * x * x

    def batch(self, axis_data, args, dims):
        ((x,), (d,)) = args, dims
        return _Cube(jax.typeof(x))(x), d


def test_user_defined_hi_primitive():
    def f(x):
        y = _Cube(jax.typeof(x))(x)
        el.log("y", y)
        return y + 1.0

    assert _hi_kinds(jax.make_jaxpr(f)(X)) == {"_Cube"}
    for how, spooled in [("spool", el.spool(f)), ("jit(spool)", jax.jit(el.spool(f)))]:
        out, logs = spooled(X)
        assert_close(out, X**3 + 1.0, how)
        assert_close(logs["y"], X[None] ** 3, how)
    xs = np.stack([X, -X])
    out, logs = jax.vmap(el.spool(f))(xs)
    assert_close(out, xs**3 + 1.0, "vmap(spool)")
    assert_close(logs["y"][:, 0], xs**3, "vmap(spool)")
    out, logs = el.spool(jax.vmap(f))(xs)
    assert_close(out, xs**3 + 1.0, "spool(vmap)")
    assert_close(logs["y"][0], xs**3, "spool(vmap)")
    out, events = _tap_events(f, X)
    assert_close(out, X**3 + 1.0, "tap")
    assert_close(events[0]["y"], X**3, "tap")


@contextlib.contextmanager
def _option(name):
    """JAX's option `name` on (where this JAX version has it)."""
    if name is None or name not in jax.config.values:
        yield
        return
    before = jax.config.values[name]
    jax.config.update(name, True)
    try:
        yield
    finally:
        jax.config.update(name, before)


def _scan(logs):
    def f(x):
        def body(c, xi):
            if logs:
                el.log("inside", xi)
            return c + jnp.sin(xi), c

        return lax.scan(body, jnp.float32(0.0), x)

    return f


def _checkpoint(logs):
    @jax.checkpoint
    def f(x):
        if logs:
            el.log("inside", x)
        return jnp.sin(checkpoint_name(2.0 * x, "a"))

    return f


def _custom_vjp(logs, **options):
    @jax.custom_vjp
    def f(x):
        if logs:
            el.log("inside", x)
        return jnp.sin(x)

    def fwd(x):
        if logs:
            el.log("inside", x)
        return jnp.sin(x), x

    def bwd(x, g):
        return (g * jnp.cos(x),)

    f.defvjp(fwd, bwd, **options)
    return f


def _optimize_remat_grad(logs):
    f = jax.checkpoint(_custom_vjp(logs, optimize_remat=True))
    return jax.grad(lambda x: jnp.sum(f(x)))


def _custom_jvp(logs):
    @jax.custom_jvp
    def f(x):
        if logs:
            el.log("inside", x)
        return jnp.sin(x)

    @f.defjvp
    def _(primals, tangents):
        ((x,), (t,)) = primals, tangents
        return jnp.sin(x), jnp.cos(x) * t

    return f


def _generic_batching_vjp(logs):
    if "generic_batching" not in inspect.signature(jax.custom_vjp.defvjp).parameters:
        return _custom_vjp(logs)  # jax < 0.12
    return _custom_vjp(logs, generic_batching=True)


# JAX option (None: none), the function (with logs inside it or not), its numpy reference,
# and the hi primitives it binds on jax 0.12.
OPTIONAL = {
    "scan3": ("jax_scan3", _scan, lambda x: (np.sin(x).sum(), np.cumsum(np.sin(x)) - np.sin(x))),
    "remat3": ("jax_remat3", _checkpoint, lambda x: np.sin(2.0 * x)),
    "custom_vjp3": ("jax_custom_vjp3", _custom_vjp, np.sin),
    "custom_jvp3": ("jax_custom_jvp3", _custom_jvp, np.sin),
    "optimize_remat": ("jax_custom_vjp3", _optimize_remat_grad, np.cos),
    "generic_batching": (None, _generic_batching_vjp, np.sin),
}
OPTIONAL_KINDS = {
    "scan3": {"Scan3"},
    "remat3": {"RematTraced", "CheckpointName"},
    "custom_vjp3": {"CustomVJPTraced"},
    "custom_jvp3": {"CustomJVPTraced"},
    "optimize_remat": {"CustomVJPTraced", "OptRemat"},
    "generic_batching": {"CustomVJPTraced"},
}


@pytest.mark.parametrize("name", list(OPTIONAL))
def test_hi_primitives_behind_options(name):
    option, make, ref = OPTIONAL[name]
    want, x = ref(X), jnp.asarray(X)  # (jax_scan3 indexes a numpy operand with a tracer)

    def outside(x):  # logs outside the hi primitive
        el.log("x", x)
        out = make(False)(x)
        el.log("out", out)
        return out

    with _option(option):
        closed = jax.make_jaxpr(make(True))(x)
        if _new_jax():
            assert OPTIONAL_KINDS[name] <= _hi_kinds(closed)
        _close_tree(make(False)(x), want, f"{name} without eqx_logs")
        for how, spooled in [
            ("spool", el.spool(outside)),
            ("jit(spool)", jax.jit(el.spool(outside))),
        ]:
            out, logs = spooled(x)
            _close_tree(out, want, f"{how}({name})")
            _close_tree(logs["out"], jax.tree.map(lambda w: np.asarray(w)[None], want), how)
        out, events = _tap_events(outside, x)
        _close_tree(out, want, f"tap({name})")
        _close_tree(events[1]["out"], want, f"tap({name})")
        # logs inside the hi primitive's own function: captured, or a loud error, never lost
        inside = make(True)
        if _hi_kinds(closed):
            match = rf"hi primitive '({'|'.join(OPTIONAL_KINDS[name])})'.*contains logs"
            with pytest.raises(NotImplementedError, match=match):
                el.spool(inside)(x)
            with pytest.raises(NotImplementedError, match=match):
                el.tap(inside)(x)
        else:
            out, logs = el.spool(inside)(x)
            _close_tree(out, want, f"spool({name}) with logs inside")
            assert int(logs.count["inside"]) > 0


def test_every_hi_primitive_has_a_test():
    if not _new_jax():
        pytest.skip("jax < 0.12 binds no hi primitive from its public functions")
    from jax.experimental.pallas import fuser, tpu  # noqa: F401 (they define hi primitives)

    defined, stack = set(), [hijax.HiPrim]
    while stack:
        for sub in stack.pop().__subclasses__():
            stack.append(sub)
            if sub.__module__.startswith("jax."):
                defined.add(sub.__name__)
    tested = set().union(*(kinds for _, _, kinds in CASES.values()), *OPTIONAL_KINDS.values())
    assert defined - tested - set(UNBOUND) == set(), "hi primitives without a test here"
    assert tested | set(UNBOUND) <= defined
