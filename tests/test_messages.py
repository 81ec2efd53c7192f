"""What a newcomer's mistakes are told: each message names the key or call site and what to do
instead, and is raised where the mistake is made (not later, on the host, mid-run)."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import eqx_logs
import eqx_logs.loggers

pytestmark = pytest.mark.fast


def _line_of(marker: str) -> int:
    """The line of this file holding `marker` (a comment), for the call sites in messages."""
    with open(__file__) as f:
        for i, line in enumerate(f, 1):
            if line.rstrip().endswith(marker):
                return i
    raise AssertionError(marker)


def test_shape_conflict_names_each_site_beside_its_shape():
    def f(x):
        eqx_logs.log("x", x[:2])  # site-two
        eqx_logs.log("x", x)  # site-three

    with pytest.raises(ValueError) as info:
        eqx_logs.spool(f)(jnp.zeros(3))
    msg = str(info.value)
    two, three = _line_of("# site-two"), _line_of("# site-three")
    # "(2,) (at ...:<two> ...) and with shape (3,) (at ...:<three> ...)"
    pattern = rf"shape \(2,\) \(at [^)]*:{two}\b.*shape \(3,\) \(at [^)]*:{three}\b"
    assert re.search(pattern, msg), msg


def test_dtype_conflict_names_each_site_beside_its_dtype():
    def f(x):
        eqx_logs.log("x", x)  # site-float
        eqx_logs.log("x", x.astype(jnp.int32))  # site-int

    with pytest.raises(TypeError) as info:
        eqx_logs.spool(f)(jnp.zeros(3))
    msg = str(info.value)
    a, b = _line_of("# site-float"), _line_of("# site-int")
    assert re.search(rf"dtype float32 \(at [^)]*:{a}\b.*dtype int32 \(at [^)]*:{b}\b", msg), msg


def test_log_with_only_keyword_arguments_says_they_are_steps():
    with pytest.raises(TypeError, match=r"log\(loss=\.\.\.\) .* logs no value") as info:
        eqx_logs.spool(lambda x: eqx_logs.log(loss=x))(1.0)
    assert "keyword arguments are step names" in str(info.value)
    assert "log({'loss': x})" in str(info.value)
    # a float value passed as a keyword beside a dict: the step check says the same
    with pytest.raises(TypeError, match=r"to log 'loss' as a value, pass it in the dict"):
        eqx_logs.spool(lambda x: eqx_logs.log({"a": x}, loss=x))(1.0)


def test_tap_checks_the_callbacks_arity_when_called():
    def f(x):
        eqx_logs.log("x", x)

    def one(logs):
        pass

    with pytest.raises(TypeError, match=r"callback .*one\(logs\) cannot be called as"):
        eqx_logs.tap(f, callback=one)  # at tap(), before any tracing or running
    with pytest.raises(TypeError, match=r"cannot be called as callback\(logs, steps\)"):
        eqx_logs.tap(callback=lambda a, b, c: None)(f)
    with pytest.raises(TypeError, match="callback must be a function"):
        eqx_logs.tap(f, callback="print")
    # what can be called with two positional arguments passes, and runs
    seen = []
    eqx_logs.tap(f, callback=lambda logs, steps, extra=None: seen.append(logs))(2.0)
    eqx_logs.tap(f, callback=lambda *args: seen.append(args[0]))(3.0)
    jax.effects_barrier()
    assert [float(s["x"]) for s in seen] == [2.0, 3.0]


def test_missing_key_lists_the_keys_there_are():
    _, logs = eqx_logs.spool(lambda x: eqx_logs.log({"loss": x, "accuracy": x}))(1.0)
    with pytest.raises(KeyError) as info:
        logs["los"]
    msg = str(info.value)
    assert "Did you mean 'loss'?" in msg and "'accuracy', 'loss'" in msg, msg
    assert logs.get("los") is None and "los" not in logs  # dict semantics otherwise unchanged
    _, empty = eqx_logs.spool(lambda x: x)(1.0)
    with pytest.raises(KeyError, match="Its keys: none"):
        empty["loss"]


def test_tags_selecting_nothing_warn_with_the_tags_logged():
    def f(x):
        eqx_logs.log("loss", x, tags="train")
        eqx_logs.log("act", x, tags=("debug", "model"))

    with pytest.warns(UserWarning, match=r"spool\(tags=\('trian',\)\) selected none") as rec:
        _, logs = eqx_logs.spool(f, tags=["trian"])(1.0)
    assert dict(logs) == {}
    assert "['debug', 'model', 'train']" in str(rec[0].message)
    with pytest.warns(UserWarning, match=r"tap\(tags=\('trian',\)\) selected none"):
        eqx_logs.tap(f, tags=["trian"], callback=lambda logs, steps: None)(1.0)
    # a tag that selects something, or no tag filter at all: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, logs = eqx_logs.spool(f, tags=["train"])(2.0)
        _, everything = eqx_logs.spool(f, exclude=["train", "debug"])(2.0)
    assert set(logs) == {"loss"} and set(everything) == set()


def test_unbounded_loop_message_names_fori_loop_with_traced_bounds():
    def f(n):
        def body(i, c):
            eqx_logs.log("c", c)
            return c + 1.0

        return lax.fori_loop(0, n, body, 0.0)

    with pytest.raises(ValueError) as info:
        eqx_logs.spool(f)(jnp.int32(3))
    msg = str(info.value)
    assert "key 'c'" in msg and "fori_loop` whose bounds are traced" in msg, msg
    assert "Stack(capacity=N)" in msg


def test_a_buffer_larger_than_the_device_fails_at_trace_time():
    """A 1000x1000 value in a 100,000-step scan: 372.5 GiB of stack. Found by `eval_shape`
    (nothing runs, nothing is allocated), naming the key, the size and the fixes; with
    `interval=1000` it fits."""

    def f(x):
        def body(c, i):
            eqx_logs.log({"big": {"w": c}}, step=i)
            return c + 1, None

        return lax.scan(body, x, jnp.arange(100_000))[0]

    from eqx_logs._interpret import memory_limit as _memory_limit

    assert _memory_limit() < 372 * 2**30  # the device (here the host: a CPU) has less
    x = jax.ShapeDtypeStruct((1000, 1000), jnp.float32)
    with pytest.raises(ValueError) as info:
        jax.eval_shape(eqx_logs.spool(f), x)
    msg = str(info.value)
    gib = 100_000 * 1000 * 1000 * 4 / 2**30
    assert "key 'big'" in msg and f"Stack buffer of {gib:.1f} GiB" in msg, msg
    assert "100000 events of float32[1000, 1000]" in msg, msg
    assert "`interval=k`" in msg and "reduce='mean'" in msg and "capacity=N" in msg
    _, logs = jax.eval_shape(eqx_logs.spool(f, interval=1000), x)
    assert logs["big"]["w"].shape == (100, 1000, 1000)


@pytest.mark.parametrize("method", ["jit", "spool", "tap"])
@pytest.mark.parametrize("fun", [None, 3])
def test_a_logger_wrapper_of_a_non_callable_names_the_call(tmp_path, method, fun):
    from eqx_logs.loggers import JsonlLogger

    logger = JsonlLogger(tmp_path / "l.jsonl")
    got = type(fun).__name__
    # refused at once, by the call made (before: an AttributeError of functools.partial, the
    # message of eqx_logs.spool, or, for tap, nothing until the first call)
    with pytest.raises(TypeError, match=rf"^JsonlLogger\.{method} expects a callable, got {got}"):
        getattr(logger, method)(fun, logger.init())
    assert not (tmp_path / "l.jsonl").exists()


def _counted_step(w, x, i):
    eqx_logs.log("loss", jnp.sum(w * x), step=i)
    return w


@pytest.mark.parametrize("form", ["logger.jit", "spool"])
def test_a_python_int_step_is_said_again_as_its_compilations_grow(tmp_path, form):
    """A Python-int step compiles once per step: said at 4 compilations, then at 16, 64, 256,
    ... (a 300-step loop compiling for minutes is not silent after the first), each time with
    the count and the seconds spent compiling, at the user's line. An array step: silent."""
    from eqx_logs.loggers import JsonlLogger

    logger = JsonlLogger(tmp_path / "l.jsonl")
    make = {
        "logger.jit": lambda: logger.jit(_counted_step, logger.init()),
        "spool": lambda: eqx_logs.spool(_counted_step),
    }[form]
    step, w = make(), jnp.ones(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(20):
            step(w, w, i)  # python-int-step
    said = [str(w.message) for w in caught if "compiled" in str(w.message)]
    assert len(said) == 2, said
    for n, message, warning in zip((4, 16), said, caught):
        assert f"_counted_step was compiled {n} times so far, taking " in message, message
        assert "Python int `i` (0, 1, 2, 3, ...)" in message and "`jnp.int32(i)`" in message
        assert (warning.filename, warning.lineno) == (__file__, _line_of("# python-int-step"))
    first, second = (float(re.search(r"taking ([\d.]+) s", m).group(1)) for m in said)
    assert 0 < first <= second, said
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step = make()
        for i in range(20):
            step(w, w, jnp.int32(i))
    logger.close()


@pytest.mark.parametrize("form", ["logger.jit", "logger.spool", "spool", "tap"])
def test_jax_jit_of_a_wrapper_with_a_non_array_argument_says_call_it_directly(tmp_path, form):
    """`jax.jit(logger.jit(step, state))(model, ...)` of a model with a non-array leaf (an
    MLP's activation) fails in JAX, before eqx_logs runs, with a message that formats the
    wrapper: its name and what to do, not its pytree's repr of internal objects. With array
    arguments alone, the same call works (inside `jax.jit`, `logger.jit` is `logger.spool`
    with its host callback)."""
    import equinox as eqx

    from eqx_logs.loggers import JsonlLogger, read_jsonl

    def loss(model, x):
        y = jax.vmap(model)(x)
        eqx_logs.log({"loss": jnp.sum(y)})
        return y

    logger = JsonlLogger(tmp_path / "l.jsonl")
    make = {
        "logger.jit": lambda f: logger.jit(f, logger.init()),
        "logger.spool": lambda f: logger.spool(f, logger.init()),
        "spool": eqx_logs.spool,
        "tap": lambda f: eqx_logs.tap(f, callback=lambda logs, steps: None),
    }[form]
    model, x = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.PRNGKey(0)), jnp.ones((3, 2))
    with pytest.raises(TypeError) as info:
        jax.jit(make(loss))(model, x)  # jit-of-a-wrapper
    msg = str(info.value)
    # (JAX removes its frames: the last is the user's line)
    assert (str(info.traceback[-1].path), info.traceback[-1].lineno + 1) == (
        __file__,
        _line_of("# jit-of-a-wrapper"),
    )
    assert len(msg.splitlines()) < 4 and "object at 0x" not in msg, msg
    assert "path model.activation" in msg, msg  # (JAX's part)
    name = f"JsonlLogger.{form[7:]}" if form.startswith("logger.") else f"eqx_logs.{form}"
    assert f"argument to {name}(test_jax_jit_of_a_wrapper_with_a_non_array_argument" in msg
    assert "call it directly" in msg and "under `eqx.filter_jit`, not under `jax.jit`" in msg
    if form == "logger.jit":
        assert "logger.jit compiles the step itself" in msg, msg
    # arrays alone: works under `jax.jit`, and logs
    out = jax.jit(make(lambda w, x: loss(lambda v: w * v, x)))(jnp.ones(2), x)
    if form == "spool":
        out, logs = out
        assert logs["loss"].tolist() == [6.0]
    assert out.shape == (3, 2)
    logger.close()
    if form.startswith("logger."):
        assert [r["value"] for r in read_jsonl(tmp_path / "l.jsonl")] == [6.0]


def _logs_four(x):
    for i in range(4):
        eqx_logs.log({"loss": x + i})
    return x


def _logs_with_the_class(x):
    eqx_logs.log({"loss": x}, reduce=eqx_logs.Mean)  # site-class
    return x


def _logger_spool(**options):
    logger = eqx_logs.loggers.ConsoleLogger()
    return logger.spool(_logs_four, logger.init(), **options)


CLASS_GIVEN = {
    "spool": ("eqx_logs.spool(reduce)", lambda: eqx_logs.spool(_logs_four, reduce=eqx_logs.Mean)),
    "Policy": ("Policy(reduce)", lambda: eqx_logs.Policy(reduce=eqx_logs.Mean)),
    "replace": ("Policy(reduce)", lambda: eqx_logs.Policy().replace(reduce=eqx_logs.Mean)),
    "rules": (
        "eqx_logs.spool(rules['loss'])",
        lambda: eqx_logs.spool(_logs_four, rules={"loss": eqx_logs.Mean}),
    ),
    "logger.spool": ("logger.spool(reduce)", lambda: _logger_spool(reduce=eqx_logs.Mean)),
    "log": (
        f"test_messages.py:{_line_of('# site-class')} (_logs_with_the_class): reduce",
        lambda: eqx_logs.spool(_logs_with_the_class)(1.0),
    ),
    "Window": ("eqx_logs.Window: inner", lambda: eqx_logs.Window(2, eqx_logs.Mean)),
    "Fanout": ("eqx_logs.Fanout: mean", lambda: eqx_logs.Fanout(mean=eqx_logs.Mean)),
}


@pytest.mark.parametrize("where, call", CLASS_GIVEN.values(), ids=list(CLASS_GIVEN))
def test_a_reductions_class_says_did_you_mean_an_instance(where, call):
    """`reduce=eqx_logs.Mean` (the class): every option that takes a reduction says what to
    write (`as_reduction`, the one place they all pass through), naming the option (at the
    call that takes it, before any tracing but `log`'s own); what it says to write gives
    numpy's mean."""
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert f"{where}=eqx_logs.Mean is a class, not a reduction" in msg, msg
    assert "did you mean `eqx_logs.Mean()`?" in msg, msg
    meant = eval(msg.split("did you mean `")[1].split("`")[0], {"eqx_logs": eqx_logs})
    _, logs = eqx_logs.spool(_logs_four, reduce=meant)(jnp.float32(1.0))
    assert float(logs["loss"]) == np.mean([1.0, 2.0, 3.0, 4.0])


def test_a_reductions_class_with_arguments_names_them():
    with pytest.raises(ValueError, match=r"did you mean `eqx_logs\.EMA\(decay=\.\.\.\)`\?"):
        eqx_logs.spool(_logs_four, reduce=eqx_logs.EMA)
    with pytest.raises(ValueError, match=r"`eqx_logs\.Histogram\(bins=\.\.\., range=\.\.\.\)`"):
        eqx_logs.Policy(rules={"loss": eqx_logs.Histogram})
    with pytest.raises(
        ValueError, match=r"\(reduce\)='meen' is not a reduction: did you mean 'mean'"
    ):
        eqx_logs.spool(_logs_four, reduce="meen")


WINDOW_SWAPPED = {  # Window's arguments, what the message says of them, what it says to write
    "name": (("mean", 2), "size='mean', inner=2): the arguments are swapped", "Window(2, 'mean')"),
    "reduction": ((eqx_logs.Max(), 2), "size=Max(), inner=2): the arguments", "Window(2, Max())"),
    "class": ((eqx_logs.Max, 2), "size=eqx_logs.Max, inner=2): the", "Window(2, eqx_logs.Max())"),
    "size left out": (
        ("max",),
        "size='max', inner='mean'): the window's size",
        "Window(100, 'max')",
    ),
}


@pytest.mark.parametrize("args, said, meant", WINDOW_SWAPPED.values(), ids=list(WINDOW_SWAPPED))
def test_window_with_its_arguments_swapped_says_so(args, said, meant):
    """`Window("mean", 2)`: Window's signature is `Window(size, inner)`; the message says the
    order to write, and what it says to write reduces each window as numpy does."""
    with pytest.raises(ValueError) as info:
        eqx_logs.Window(*args)
    msg = str(info.value)
    assert said in msg and f"`{meant}`" in msg, msg
    assert "`Window(size, inner='mean', capacity=None)`" in msg, msg
    window = eval(meant, {"Window": eqx_logs.Window, "Max": eqx_logs.Max, "eqx_logs": eqx_logs})
    _, logs = eqx_logs.spool(_logs_four, reduce=window)(jnp.float32(1.0))
    events = np.array([1.0, 2.0, 3.0, 4.0])
    inner = np.max if "ax" in meant else np.mean
    want = [inner(events[i : i + window.size]) for i in range(0, 4, window.size)]
    np.testing.assert_allclose(np.asarray(logs["loss"]), want)
