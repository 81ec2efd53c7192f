"""JAX 0.12's backward-pass logs (`custom_vjp.defvjp_with_logs`, `custom_gradient(with_logs=
True)`) reach spool and tap as events inside `jax.grad`: under their own keys, tagged
"backward", with the step "iteration" (the forward iteration of the scan around the custom
call, -1 outside any scan). The reference is JAX's own `jax.vjp(...).with_logs`, which stacks
a scan's logs by forward iteration; values by hand where they are simple. On JAX 0.10 the API
does not exist, and nothing changes (`test_absent_before_jax_0_12`).
"""

import inspect
import pathlib
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_close

import eqx_logs as el
from eqx_logs import _compat

WITH_LOGS = hasattr(jax.custom_vjp, "defvjp_with_logs")
needs_logs = pytest.mark.skipif(not WITH_LOGS, reason="JAX < 0.12 has no backward-pass logs")
DOCS = pathlib.Path(__file__).parent.parent / "docs"


def test_absent_before_jax_0_12():
    """The feature follows JAX's version: on 0.10 JAX's API is absent and eqx_logs wraps none
    of JAX's transpose rules (the rest of the suite, goldens included, runs unchanged)."""
    major, minor = (int(p) for p in jax.__version__.split(".")[:2])
    assert WITH_LOGS == ((major, minor) >= (0, 12)) == _compat.BACKWARD_LOGS
    has_option = "with_logs" in inspect.signature(jax.custom_gradient).parameters
    assert has_option == WITH_LOGS


def _sin_with_logs():
    """sin, whose backward rule logs the cotangent's size and a pair (a pytree value)."""

    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    def fwd(x):
        return jnp.sin(x), jnp.cos(x)

    def bwd(cos, g):
        return (cos * g,), {"gnorm": jnp.abs(g), "pair": (g, 2.0 * g)}

    f.defvjp_with_logs(fwd, bwd)
    return f


def _scanned(f, checkpoint=False):
    def loss(xs):
        def body(c, x):
            return c + f(x * c), None

        body = jax.checkpoint(body) if checkpoint else body
        return jax.lax.scan(body, jnp.float32(1.0), xs)[0]

    return loss


def _by_iteration(logs, key):
    """`logs[key]`'s events in forward order (by their step "iteration"), as JAX stacks them."""
    order = np.argsort(np.asarray(logs.iteration[key]))
    return jax.tree.map(lambda v: np.asarray(v)[order], logs[key])


@needs_logs
@pytest.mark.parametrize("checkpoint", [False, True])
def test_scan_events_in_grad_jit_and_by_forward_iteration(checkpoint):
    f = _sin_with_logs()
    loss = _scanned(f, checkpoint)
    xs = jnp.array([0.5, -1.0, 2.0, 0.25], jnp.float32)
    _, vjp = jax.vjp(loss, xs)
    (want_grad,), want = vjp.with_logs(jnp.float32(1.0))

    grad, logs = el.spool(jax.grad(loss))(xs)
    assert_close(grad, want_grad, "grad")
    assert set(logs) == {"gnorm", "pair"}
    # the backward pass runs the last forward iteration first; the step says which it was
    np.testing.assert_array_equal(logs.iteration["gnorm"], [3, 2, 1, 0])
    np.testing.assert_array_equal(logs.count["gnorm"], 4)  # once per iteration, not more
    assert_close(_by_iteration(logs, "gnorm"), want["gnorm"], "gnorm")
    for got, ref in zip(_by_iteration(logs, "pair"), want["pair"]):
        assert_close(got, ref, "pair")

    # jit around or inside the spool, value_and_grad: the same events
    for spooled in (
        jax.jit(el.spool(jax.grad(loss))),
        el.spool(jax.jit(jax.grad(loss))),
        el.spool(lambda x: jax.value_and_grad(loss)(x)[1]),
    ):
        _, again = spooled(xs)
        assert_close(again["gnorm"], logs["gnorm"], "gnorm under jit")
        np.testing.assert_array_equal(again.iteration["gnorm"], logs.iteration["gnorm"])

    # tagged "backward": a policy selects them by it
    assert set(el.spool(jax.grad(loss), tags="backward")(xs)[1]) == {"gnorm", "pair"}
    assert not el.spool(jax.grad(loss), exclude="backward")(xs)[1]


@needs_logs
def test_vmap_of_the_spool_is_each_lane_alone():
    loss = _scanned(_sin_with_logs())
    xss = jnp.array([[0.5, -1.0, 2.0], [0.1, 0.2, 0.3]], jnp.float32)
    grads, logs = jax.vmap(el.spool(jax.grad(loss)))(xss)
    for i in range(2):
        grad, lane = el.spool(jax.grad(loss))(xss[i])
        assert_close(grads[i], grad)
        assert_close(logs["gnorm"][i], lane["gnorm"], f"lane {i}")
        np.testing.assert_array_equal(logs.iteration["gnorm"][i], lane.iteration["gnorm"])


@needs_logs
def test_custom_gradient_with_logs_under_spool_and_tap():
    @jax.custom_gradient(with_logs=True)
    def clip(x):
        return x, lambda g: ((jnp.clip(g, -1.0, 1.0),), {"incoming": g})

    def loss(x):
        with el.scope("clip"):  # (scopes around the backward pass name the keys)
            return jnp.sum(3.0 * clip(x))

    x = jnp.array([2.0, -0.5], jnp.float32)
    grad, logs = el.spool(jax.grad(loss))(x)
    assert_close(grad, [1.0, 1.0], "clipped")
    assert_close(logs["incoming"], [[3.0, 3.0]], "incoming")  # by hand: d(3x)/dx
    np.testing.assert_array_equal(logs.iteration["incoming"], [-1])  # outside any scan

    seen = []
    tapped = el.tap(jax.grad(loss), callback=lambda logs, steps: seen.append((logs, steps)))
    assert_close(tapped(x), [1.0, 1.0])
    jax.effects_barrier()
    assert len(seen) == 1
    got, steps = seen[0]
    assert_close(got["incoming"], [3.0, 3.0], "tapped")
    assert int(steps["iteration"]) == -1


@needs_logs
def test_tap_streams_scan_events_with_their_iteration():
    loss = _scanned(_sin_with_logs())
    xs = jnp.array([0.5, -1.0, 2.0], jnp.float32)
    (_, want) = jax.vjp(loss, xs)[1].with_logs(jnp.float32(1.0))
    seen = []
    el.tap(jax.grad(loss), callback=lambda logs, steps: seen.append((logs, steps)))(xs)
    jax.effects_barrier()
    assert [int(s["iteration"]) for _, s in seen] == [2, 1, 0]
    for logs, steps in seen:
        assert_close(logs["gnorm"], want["gnorm"][int(steps["iteration"])])


@needs_logs
def test_cond_events_only_where_taken():
    f = _sin_with_logs()

    def loss(x, p):
        return jax.lax.cond(p, f, jnp.cos, x)

    x = jnp.float32(1.0)
    _, logs = el.spool(jax.grad(loss))(x, True)
    want = jax.vjp(lambda x: loss(x, True), x)[1].with_logs(jnp.float32(1.0))[1]
    assert_close(logs["gnorm"], [want["gnorm"].branches[1]])  # (JAX's slot of the branch)
    _, logs = el.spool(jax.grad(loss))(x, False)
    np.testing.assert_array_equal(logs.count["gnorm"], 0)

    # a batched predicate (a vmap inside the derivative): each lane's event where it is taken
    def batch(xs, ps):
        return jnp.sum(jax.vmap(loss)(xs, ps))

    xs, ps = jnp.array([1.0, 2.0, 3.0], jnp.float32), jnp.array([True, False, True])
    _, logs = el.spool(jax.grad(batch))(xs, ps)
    np.testing.assert_array_equal(logs.count["gnorm"], [1, 0, 1])
    assert_close(logs["gnorm"], [[1.0, np.nan, 1.0]])


@needs_logs
def test_plain_jax_is_unchanged():
    """Outside every spool and tap JAX's logs are JAX's: `with_logs` returns them, and nothing
    warns (a batched cond around the custom call is rewritten by eqx_logs' masking even
    there)."""
    f = _sin_with_logs()

    def batch(xs, ps):
        return jnp.sum(jax.vmap(lambda x, p: jax.lax.cond(p, f, jnp.cos, x))(xs, ps))

    xs, ps = jnp.array([1.0, 2.0, 3.0], jnp.float32), jnp.array([True, False, True])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (grad,), logs = jax.vjp(lambda x: batch(x, ps), xs)[1].with_logs(jnp.float32(1.0))
    assert_close(grad, np.where(ps, np.cos(xs), -np.sin(xs)))
    assert_close(logs["gnorm"], [1.0, 0.0, 1.0])


@needs_logs
def test_derivative_outside_the_spool():
    """As for `log` in a backward rule: `jax.grad(spool(f))` loses them, with a warning naming
    the keys and the custom function; an enclosing spool gets them once; `with_logs` still
    returns them."""
    f = _sin_with_logs()

    def loss(x):
        return 3.0 * el.spool(f)(x)[0]

    x = jnp.float32(0.5)
    with pytest.warns(el.LostEventsWarning, match=r"'gnorm', 'pair' at .*custom_vjp function f"):
        assert_close(jax.grad(loss)(x), 3.0 * np.cos(0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", el.LostEventsWarning)
        grad, logs = el.spool(jax.grad(loss))(x)
    assert_close(grad, 3.0 * np.cos(0.5))
    assert_close(logs["gnorm"], [3.0])
    np.testing.assert_array_equal(logs.count["gnorm"], 1)
    with pytest.warns(el.LostEventsWarning, match="'gnorm', 'pair'"):  # (lost to the spool)
        (_, jax_logs) = jax.vjp(loss, x)[1].with_logs(jnp.float32(1.0))
    assert_close(jax_logs["gnorm"], 3.0)


@needs_logs
def test_a_key_that_is_not_a_string_is_an_error():
    @jax.custom_gradient(with_logs=True)
    def f(x):
        return x, lambda g: ((g,), {7: g})

    with pytest.raises(TypeError, match=r"key 7 .* Name the rule's logs with strings"):
        el.spool(jax.grad(f))(jnp.float32(1.0))


def _probe(h):
    """Identity; its backward rule logs the norm of the incoming cotangent."""

    @jax.custom_gradient(with_logs=True)
    def probe(h):
        return h, lambda g: ((g,), {"grad_norm": jnp.linalg.norm(g)})

    return probe(h)


class _Stack(eqx.Module):
    """Equinox's scan over layers: the layers' parameters stacked, one scan iteration each,
    each layer's output probed."""

    layers: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, 3)
        self.layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 4, key=k))(keys)

    def __call__(self, x):
        params, static = eqx.partition(self.layers, eqx.is_array)

        def body(h, p):
            return _probe(jnp.tanh(eqx.combine(p, static)(h))), None

        return jax.lax.scan(body, x, params)[0]


@needs_logs
def test_an_equinox_model_trained_with_optax():
    model = _Stack(jax.random.key(0))
    x, y = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32), jnp.ones(4, jnp.float32)
    opt = optax.sgd(0.1)

    def loss(model):
        return jnp.mean((model(x) - y) ** 2)

    @eqx.filter_jit
    def step(model, opt_state):
        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates, opt_state = opt.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, value

    _, logs = el.spool(step)(model, opt.init(eqx.filter(model, eqx.is_array)))
    want = jax.vjp(loss, model)[1].with_logs(jnp.float32(1.0))[1]
    np.testing.assert_array_equal(logs.iteration["grad_norm"], [2, 1, 0])
    assert_close(_by_iteration(logs, "grad_norm"), want["grad_norm"], "grad_norm")
    # by hand for the last layer: d mean((h - y)^2) / dh = 2 (h - y) / 4
    last = 2.0 * (model(x) - y) / 4.0
    assert_close(logs["grad_norm"][0], np.linalg.norm(last), "last layer")


@needs_logs
def test_the_guide_example_runs_and_prints_what_it_says():
    """docs/semantics.md shows this on a `py` block (the pages' `python` blocks run on every
    JAX version): here it runs, on 0.12, and prints what its comments claim."""
    text = (DOCS / "semantics.md").read_text()
    (code,) = re.findall(r"```py\n(.*?)```", text, flags=re.S)
    printed = []
    namespace = {"print": lambda *a: printed.append(" ".join(map(str, a)))}
    imports = "import jax\nimport jax.numpy as jnp\nimport eqx_logs\n"  # (the page's first block)
    exec(compile(imports + code, str(DOCS / "semantics.md"), "exec"), namespace)
    expected = [m.split(":")[0].strip() for m in re.findall(r"print\(.*\)\s+# (.*)", code)]
    assert len(printed) == len(expected) > 0
    for line, want in zip(printed, expected):
        assert " ".join(line.split()).startswith(" ".join(want.split())), (line, want)
