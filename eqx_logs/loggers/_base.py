"""AbstractLogger: spool or tap a function into a backend, written on a background thread."""

import abc
import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeVar, Unpack

import equinox as eqx
import jax
import numpy as np
from jaxtyping import ArrayLike, PRNGKeyArray

from .. import _compat
from .._logdict import LogDict
from .._reduce import (
    Policy,
    PolicyOptions,
    TapOptions,
    check_options,
    document_options,
    with_options,
    without_watch,
)
from .._spool import spool as _spool
from .._tap import check_buffer, check_tap_options, tap_with
from .._watch._api import watch_with
from .._watch._nonfinite import check_with
from .._wrapper import AbstractWrapper, build, build_wrapper
from ._host import Record
from ._jit import Donate, Jit, Last
from ._packed import Packed, unpack
from ._run_config import RunConfig, as_config
from ._sink import AbstractSink, Backend, Sink
from ._state import LoggerState, run_index
from ._steps import AtStep, Gate, Keeping, Skipping, StepArg
from ._transfer import Packing, nbytes_of, one_process
from ._writer import ON_FULL, STALL_TIMEOUT

_T = TypeVar("_T")


class _NoState:
    """The default of `logger.jit`'s (`spool`'s, `tap`'s) state: none given, refused naming
    `logger.init()` (rather than by Python's missing-argument error)."""

    def __repr__(self) -> str:
        return "<required>"


NO_STATE: Any = _NoState()


class AbstractLogger(eqx.Module):
    """Writes logs to a backend. Loggers are Equinox modules.

    - `state = logger.init(key)` gives a [`eqx_logs.loggers.LoggerState`][] (the run index);
    - `logger.jit(step, state)` compiles a training step for the loop that calls one step per
        Python iteration, its logs written without a host callback in the step;
    - `logger.spool(fun, state)(...)` runs `fun`, spools its logs and writes them;
    - `logger.tap(fun, state)(...)` writes each event as it happens;
    - `logger.write(logs)` writes a `LogDict` you spooled yourself;
    - `logger.flush()` waits until everything is written; `logger.close()` (or `with logger:`)
        also closes files and runs.

    Both wrappers work inside `jax.jit`, `eqx.filter_jit` and `jax.vmap`: under `vmap` over
    states (`jax.vmap(logger.init)(jnp.arange(4))`) each lane writes to its own run.

    Writing happens on a background thread, in order; logs of arrays are handed to it as they
    are, and it fetches them from the device. If the backend raises there, the error is
    raised (as a `WriterError`) by the next call into the logger: from Python calls directly,
    and from inside compiled code as the `JaxRuntimeError` of the next host callback. Writes
    submitted after the failure are skipped and counted in the message. (In a
    [`eqx_logs.loggers.MultiLogger`][] the failure is reported as a `WriterWarning` instead,
    and the other loggers keep writing.)

    A backend can never hang the caller: writes wait in a bounded queue, `on_full` says what
    happens when it is full, and a backend that makes no progress for `stall_timeout`
    seconds is reported (`eqx_logs.loggers.WriterWarning`) and its writes are dropped and
    counted instead of waited for. `flush()` and `close()` wait at most that long for a stuck
    backend, and warn with the exact number of writes lost since the last `flush()` or
    `close()` (none lost: no warning).

    Over many processes (`jax.distributed`), process 0 writes by default: a spooled call's
    logs, and the events of a program over many devices, reach its host once. Inside a
    `shard_map` each device's events reach its own process; process k > 0 writes those to
    files or runs named with `.process<k>`. With `every_process=True`, every process writes
    every event, each to its own `.process<k>` files or runs.

    A logger made with `config=` records that configuration (the run's hyperparameters: a
    nested dict, an OmegaConf `DictConfig`, resolved, or a dataclass instance) with every run
    it opens, where its backend keeps one, so that runs can be compared in its UI: W&B's run
    config, trackio's run config, MLflow's params (flattened, `train.lr`; values cut to 500
    characters, the whole config also as the artifact `config.json`), TensorBoard's hparams
    (flattened; the HParams dashboard), a first JSONL line `{"config": {...}}` (which
    `read_jsonl` skips), `config.json` beside an `ArrayLogger`'s runs. The console and the
    progress bar show none. It is kept as plain JSON values (`logger.config`): values that are
    not JSON (a path, a function) as their `str`, NaN as `"nan"`.

    ```python
    logger = JsonlLogger("run.jsonl", config={"train": {"lr": 1e-3, "width": 32}})
    ```

    With Hydra, [`eqx_logs.config.instantiate_logger`][] records the whole resolved config.
    The config is recorded on the writer thread when a run is opened (before its first
    event), so neither the constructor nor the training loop waits for the backend.

    Subclasses implement `_open(run) -> handle`, `_write(handle, run, records)` and optionally
    `_close(handle)`; all three run on the writer thread (`_open` records `self.config`).

    **Arguments** (keyword-only, for every logger):

    - `config`: the configuration to record with every run (see above); `None`: none.
    - `every_process`: over many processes, every process writes a copy of its own
        (`.process<k>`), not process 0 alone.
    - `on_full`: when the writes waiting for the backend hold more than 256 MiB: `"block"`
        (the default) waits for room while the backend makes progress, so nothing is dropped
        from a slow backend, and never longer than `stall_timeout` for a stuck one; `"drop"`
        drops the new write at once, counted (a `WriterWarning` at the first drop, the count
        at `flush()`/`close()`), so training never waits for the backend.
    - `stall_timeout`: seconds after which a backend that has work and has finished none of it
        counts as stalled (measured from its last finished write, or from when work arrived
        while it was idle): reported with a `WriterWarning`, and every write while it stays
        stalled is dropped and counted, without waiting; `flush()` and `close()` give up
        waiting for it (`close()` abandons, and counts, what it has not written). Default 60;
        `None` or `float("inf")` never gives up: nothing is dropped for a slow backend, and
        a stuck one hangs the caller.

    !!! example

        The training loop that calls one compiled step per Python iteration: `logger.jit`
        compiles the step, its logs kept every `interval` steps. `step="step"` names the
        step parameter: its Python int is passed traced (one compiled step serves every
        iteration), and the steps the interval skips run without their logs, picked on the
        host. Every backend is used this way: each backend's example runs this `train`
        with its own logger.

        ```python
        from eqx_logs.loggers import JsonlLogger

        model = eqx.nn.MLP(2, 1, 8, 2, key=jax.random.key(0))
        optimizer = optax.sgd(0.1)
        opt_state = optimizer.init(eqx.filter(model, eqx.is_array))


        def train_step(model, opt_state, x, y, step):
            loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
            eqx_logs.log({"loss": loss}, step=step)
            updates, opt_state = optimizer.update(grads, opt_state, model)
            return eqx.apply_updates(model, updates), opt_state


        def train(logger, model, opt_state, steps=30):
            step = logger.jit(train_step, logger.init(), interval=10, step="step")
            for i in range(steps):
                model, opt_state = step(model, opt_state, x, y, i)
            return model, opt_state


        with JsonlLogger("run.jsonl") as logger:  # on leaving: all written, closed
            model, opt_state = train(logger, model, opt_state)
        ```
    """

    # keyword-only, so that backends' own fields may come without defaults before it
    # (`config`: not static, so a logger passed to `eqx.filter_jit` stays hashable)
    config: RunConfig | None = eqx.field(default=None, kw_only=True, converter=as_config)
    every_process: bool = eqx.field(default=False, static=True, kw_only=True)
    on_full: Literal["block", "drop"] = eqx.field(default="block", static=True, kw_only=True)
    stall_timeout: float | None = eqx.field(default=STALL_TIMEOUT, static=True, kw_only=True)
    # where the logs go: the writer thread, the runs' handles (one per logger, shared by its
    # copies; a plain object, see `_sink.py`)
    _sink: AbstractSink = eqx.field(static=True, default_factory=Sink, repr=False, init=False)

    def __check_init__(self):
        if self.on_full not in ON_FULL:
            raise ValueError(
                f"{type(self).__name__}(on_full={self.on_full!r}): on_full must be 'block' (wait "
                "for room while the backend makes progress) or 'drop' (drop writes that do not "
                "fit, counted)."
            )
        timeout = self.stall_timeout
        if timeout is not None and (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not timeout > 0  # NaN too
        ):
            raise ValueError(
                f"{type(self).__name__}(stall_timeout={timeout!r}): stall_timeout must be a "
                "number of seconds > 0, or None (or inf) to wait for a stuck backend forever."
            )
        _bind(self)

    # --- the backend, run on the writer thread -------------------------------------------

    @abc.abstractmethod
    def _open(self, run: int) -> Any:
        """Open run `run` (files, a remote run, ...) and return its handle."""

    @abc.abstractmethod
    def _write(self, handle: Any, run: int, records: list[Record]) -> None:
        """Write `records` (each `{"key", "value", <step names>...}`) to run `run`."""

    def _close(self, handle: Any) -> None:
        """Close what `_open` returned."""

    def _unstorable(self, leaf: np.ndarray) -> str | None:
        """Why this backend cannot store `leaf` (a value's array, as by `host_array`), or
        None. Checked before writing: a key it rejects is named, and the others are written."""
        del leaf
        return None

    def _submit_logs(
        self, state: LoggerState, logs: LogDict | Packed, size: int | None = None
    ) -> None:
        """Hand `logs` (arrays, on the device or not, or packed by `logger.jit`; `size`
        bytes in all) to the writer thread, which fetches and writes them. A backend that
        overrides it is given every write here (a `logger.jit` step's too, packed)."""
        self._sink.submit_logs(state, logs, size)

    # --- the public API --------------------------------------------------------------------

    def init(self, key: PRNGKeyArray | ArrayLike | None = None) -> LoggerState:
        """A new state. `key` picks the run: `None` is run 0, an integer is that run, and a
        `jax.random.key` gives a run index drawn from it. Vmap over keys or integers for one run
        per lane."""
        return LoggerState(run=run_index(key))

    @document_options
    def spool(
        self,
        fun: Callable[..., _T],
        state: LoggerState = NO_STATE,
        /,
        *,
        policy: Policy | None = None,
        keep: bool = False,
        **options: Unpack[PolicyOptions],
    ) -> Callable[..., _T]:
        """`fun`, spooled as by [`eqx_logs.spool`][] (same `policy`, `keep` and options); the
        logs are written to `state`'s run when the call completes, and `fun`'s output is
        returned. With `first_nonfinite`, a call whose logs hold a NaN or infinity warns
        ([`eqx_logs.loggers.NonfiniteWarning`][]) with the first such event.

        The policy's options, as for [`eqx_logs.Policy`][] (an option left out, or None,
        keeps `policy`'s):

        {policy_options}
        """
        _check_fun(self, "spool", fun)
        _check_state(self, "spool", state)
        check_options("logger.spool", options, also=("policy", "keep"))
        policy = with_options(policy, "logger.spool", **options)
        return build_wrapper(_LoggerSpooled, self, _spool(fun, policy=policy, keep=keep), state)

    @document_options
    def tap(
        self,
        fun: Callable[..., _T],
        state: LoggerState = NO_STATE,
        /,
        *,
        policy: Policy | None = None,
        buffer: int | None = None,
        **options: Unpack[TapOptions],
    ) -> Callable[..., _T]:
        """`fun`, tapped as by [`eqx_logs.tap`][]: each event is written to `state`'s run as it
        happens (`interval=k` writes every k-th event of each key, gated on the device).
        `buffer=k`: the events reach the writer in blocks of k, one host callback per block
        (see `eqx_logs.tap`), each event still written as a row of its own.

        The policy's options a tap uses, as for [`eqx_logs.Policy`][] (an option left out,
        or None, keeps `policy`'s):

        {tap_options}
        """
        _check_fun(self, "tap", fun)
        _check_state(self, "tap", state)
        check_tap_options("logger.tap", options, also=("policy", "buffer"))
        check_buffer("logger.tap", buffer)
        policy = with_options(policy, "logger.tap", **options)
        sink = self._sink
        host = sink.tap_host if buffer is None else sink.tap_block_host
        tapped = tap_with(fun, policy, host, state, self.every_process, buffer=buffer)
        return build_wrapper(_LoggerTapped, self, tapped)

    @document_options
    def jit(
        self,
        fun: Callable[..., _T],
        state: LoggerState = NO_STATE,
        /,
        *,
        donate: Donate = "none",
        policy: Policy | None = None,
        keep: bool = False,
        step: str | None = None,
        **options: Unpack[PolicyOptions],
    ) -> Callable[..., _T]:
        """`fun` compiled as by `eqx.filter_jit(fun)`, spooled, its logs written to `state`'s
        run: the form for the training loop that calls one compiled step per Python
        iteration.

        ```python
        step = logger.jit(train_step, logger.init(), interval=100, step="i")
        for i in range(steps):
            model, opt_state = step(model, opt_state, x, y, i)
        ```

        `step` names the parameter of `fun` that is the training step. Its argument is then
        passed to the compiled step as a traced scalar, whatever it is (a Python int
        compiles nothing new), and it is the step of every event inside `fun` logged
        without one of its own (as in `eqx_logs.scope(step=i)`). With `interval=k`, a call
        whose step is a Python int that is not a multiple of k runs a second compiled step
        (traced and compiled once, beside the first): `fun` with every log removed (nothing
        computed, returned or written for logs), where its trace finds every event at the
        call's step (logged without `step=`, or with `step=` that very argument); where some
        event is at another step (`step=2 * i`, a step passed into an inner `jax.jit`), that
        program keeps its logs, gated on the device, with a warning naming the event. A call
        at a multiple of k runs a third: the step with its logs, those at the call's step
        kept without a gate on the device (which would change how XLA compiles the rest of
        the step), so that the model trains as without logging, bit for bit on a CPU. A step
        given as a JAX array is never read on the host (that could wait for the device), and
        with `first_nonfinite` the search looks at every event: then every call runs its
        logs, gated on the device. The written rows are the same either way.

        The compiled step holds no host callback and no effect: each call takes JAX's fast
        dispatch path and returns once the step is dispatched, as a `jax.jit` call does. Its
        logs are handed, as arrays, to the logger's writer thread, which waits for the
        device, fetches the keys that hold events and writes them, in order: the loop never
        waits for the device because of logging. (`eqx.filter_jit` waits at every call, so
        that an `eqx.error_if` raises there; here it is JAX's runtime error, which holds the
        message, raised by a later call or where the outputs are read.) The arguments are
        bound and filtered as by `eqx.filter_jit` (a new value of a leaf that is not an array
        compiles the step anew); `donate` is as there, but `fun`'s own arrays (a model's) are
        never donated; the other options are [`eqx_logs.spool`][]'s. A backend error, a
        value the backend cannot store and, with `first_nonfinite`, a
        [`eqx_logs.loggers.NonfiniteWarning`][] come from the next call into the logger.

        It writes what `eqx.filter_jit(logger.spool(...))` and `eqx.filter_jit(logger.tap(...))`
        write, without the host callback those put in every step (`logger.tap` is for events
        streamed out of a long call, a `lax.scan` over many steps, while it runs). Called
        inside `jax.jit` or `jax.vmap`, it is `logger.spool(fun, state)` in `eqx.filter_jit`,
        with the host callback that needs. More in the guide: "The training loop and the
        loggers".

        The policy's options, as for [`eqx_logs.Policy`][] (an option left out, or None,
        keeps `policy`'s):

        {policy_options}
        """
        _check_fun(self, "jit", fun)
        _check_state(self, "jit", state)
        check_options("logger.jit", options, also=("donate", "policy", "keep", "step"))
        policy = with_options(policy, "logger.jit", **options)
        spooled, jitted, skip, kept, gate = _jitted_step(fun, policy, keep, donate, step)
        feed = self._sink.feed(state)
        return build_wrapper(_LoggerJitted, self, spooled, jitted, state, feed, skip, kept, gate)

    def write(self, logs: LogDict, state: LoggerState | None = None) -> None:
        """Write `logs` (as returned by [`eqx_logs.spool`][]) to `state`'s run (default run 0).

        Never waits for the device: the arrays are handed to the writer thread, which fetches
        them once computed and writes the events they hold (keys with a count of 0 write
        nothing). A value the backend cannot store is named at once (the other keys are
        written); a backend error, or the warning of a `first_nonfinite` spool that found a
        NaN, comes from the next call into the logger. Inside `jax.jit` (or `vmap`, `grad`),
        a host callback writes them when the compiled code gets there."""
        _write(self, logs, state)

    def flush(self) -> None:
        """Wait for pending host callbacks and writes (at most `stall_timeout` seconds for a
        stuck backend); warn (`WriterWarning`) with the number of writes lost since the last
        `flush`/`close`, if any; raise any error of the writer."""
        jax.effects_barrier()
        self._sink.flush()

    def close(self) -> None:
        """Flush, then close every run's files or remote run; say what was lost, as `flush`
        does (a stuck backend is given up on after `stall_timeout` seconds: what it has not
        written is counted as lost). The logger may be used again afterwards (runs are
        reopened, appending)."""
        jax.effects_barrier()
        self._sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _with_config(self, config: Any) -> "AbstractLogger":
        """This logger, recording `config` if it records none of its own: a copy that shares
        its sink (and so its queue and runs), which writes through the copy from now on."""
        if self.config is not None or config is None:
            return self
        config = as_config(config)
        copy = eqx.tree_at(lambda logger: logger.config, self, config, is_leaf=_is_none)
        _bind(copy)
        return copy


def _is_none(x: Any) -> bool:
    return x is None


def _bind(logger: AbstractLogger) -> None:
    """Point `logger`'s sink at its backend methods, through its class (an Equinox module's
    bound method is a module of its own, about 30 us to build) and its writer's policy."""
    cls = type(logger)
    unstorable = cls._unstorable is not AbstractLogger._unstorable  # a backend that checks
    submit_logs = cls._submit_logs is not AbstractLogger._submit_logs
    # a `_write_many` defined no higher than `_write` (a subclass overriding `_write` alone
    # gets every write through it)
    many = next((c for c in cls.__mro__ if "_write_many" in vars(c)), None)
    writes = next(c for c in cls.__mro__ if "_write" in vars(c))
    if many is not None and not issubclass(many, writes):
        many = None
    logger._sink.bind(
        Backend(
            name=cls.__name__,
            on_full=logger.on_full,
            stall_timeout=logger.stall_timeout,
            open=functools.partial(cls._open, logger),
            write=functools.partial(cls._write, logger),
            close=functools.partial(cls._close, logger),
            unstorable=functools.partial(cls._unstorable, logger) if unstorable else None,
            submit_logs=functools.partial(cls._submit_logs, logger) if submit_logs else None,
            write_many=None if many is None else functools.partial(many._write_many, logger),
        )
    )


def _check_fun(logger: AbstractLogger, method: str, fun: Any) -> None:
    """`logger.<method>(fun, state)` wraps `fun`: a `TypeError` naming the call if it is not
    callable (found at once, not at the first call, nor as `eqx_logs.spool`'s)."""
    if callable(fun):
        return
    name = f"{type(logger).__name__}.{method}"
    wrapper = "eqx_logs.tap" if method == "tap" else "eqx_logs.spool"
    bare = f" (it has no bare form, as `{wrapper}()` has)" if fun is None else ""
    raise TypeError(
        f"{name} expects a callable, got {type(fun).__name__}: it takes the function to run, "
        f"then the logger's state, `logger.{method}(fun, logger.init())`{bare}."
    )


def _jitted_step(
    fun: Callable, policy: Policy, keep: bool, donate: Donate, step: str | None
) -> tuple[Any, Jit, Jit | None, Jit | None, Gate | None]:
    """`logger.jit`'s programs: `(spooled, jitted, skip, kept, gate)`, `fun` spooled, the
    compiled step that runs it (its logs gated on the device), and, with a `step` parameter
    and an interval (and no `first_nonfinite`), the compiled steps for the steps the host
    sees the interval skip (without logs) and keep (without a gate), and the host's gate
    that chooses between them (else None)."""
    if step is None:
        spooled = _spool(fun, policy=policy, keep=keep)
        return spooled, Jit(build(Packing, spooled), donate), None, None, None
    at = StepArg.of(fun, step, "logger.jit")
    if policy.watch is not None:
        # watched inside the call's step scope: the watched values carry the call's step,
        # as its logs do (the spool's rewrite would run outside it)
        fun = watch_with(fun, policy.watch, "logger.jit")
        policy = without_watch(policy)
    if policy.first_nonfinite == "any":  # checked inside it too: the checks carry the step
        fun, policy = check_with(fun), policy.replace(first_nonfinite=True)
    spooled = _spool(build_wrapper(AtStep, fun, at), policy=policy, keep=keep)
    packing, last = build(Packing, spooled), Last()
    jitted, skip, kept, gate = Jit(packing, donate, step=at, last=last), None, None, None
    # (`first_nonfinite` looks at every event, those an interval skips too)
    if policy.interval > 1 and not policy.first_nonfinite:
        gate = Gate(at, policy.interval)
        skipping = build_wrapper(Skipping, packing, at, policy.interval)
        skip = Jit(skipping, donate, step=at, last=last)
        keeping = build_wrapper(Keeping, packing, at, policy.interval)
        kept = Jit(keeping, donate, step=at, last=last)
    return spooled, jitted, skip, kept, gate


def _check_state(logger: AbstractLogger, method: str, state: LoggerState) -> None:
    """`logger.<method>(fun, state)` writes each call's logs to the one run of `state`: a
    state of many runs (`jax.vmap(logger.init)(...)`, not mapped by a `vmap` around the call)
    is refused here, once, rather than by the writer thread at the first call. (The state is
    fixed when the step is made: its calls need no check.) Anything but a `LoggerState` is
    refused naming `logger.init()`."""
    if not isinstance(state, LoggerState):
        raise TypeError(_not_a_state(logger, method, state))
    shape = np.shape(state.run)
    if not shape:
        return
    runs = " x ".join(map(str, shape))
    raise ValueError(
        f"{type(logger).__name__}.{method}(fun, state): the state is a batch of {runs} runs "
        f"(its run index has shape {shape}, as made by `jax.vmap(logger.init)(...)`), but "
        "the wrapped function writes each call's logs to one run. Call it under `jax.vmap`, the "
        f"states mapped, one run per lane: `jax.vmap(lambda state, x: logger.{method}(fun, "
        "state)(x))(states, xs)`; or make the state of one run with `logger.init()` (or "
        "`logger.init(run)`) outside `vmap`."
    )


def _not_a_state(logger: AbstractLogger, method: str, state: Any) -> str:
    name = f"{type(logger).__name__}.{method}"
    write = f"`logger.{method}(fun, logger.init())`"
    if state is NO_STATE:
        got = "no state"
    elif getattr(state, "__self__", None) is logger or (
        callable(state) and getattr(state, "__name__", None) == "init"
    ):
        got = "`logger.init`, the method itself: call it, `logger.init()`"
    elif isinstance(state, AbstractLogger):
        got = f"a logger (a {type(state).__name__}), not its state"
    else:
        kind = type(state).__name__
        an = "an" if kind[:1].lower() in "aeiou" else "a"
        got = "None" if state is None else f"{an} {kind}, {state!r}"[:200]
    return (
        f"{name}(fun, state) takes the function, then the logger's state, a `LoggerState` "
        f"made by `logger.init()` (the run the logs go to; `logger.init(run)` for another "
        f"run); got {got}. Write {write}."
    )


def _write(logger: AbstractLogger, logs: LogDict | Packed, state: LoggerState | None) -> None:
    """`logger.write(logs, state)`: see there. (`logger.jit` writes its logs packed.)"""
    sink = logger._sink
    sink.check()
    state = type(logger).init(logger) if state is None else state
    if isinstance(logs, Packed):
        if one_process() or all(x.is_fully_addressable for x in (*logs.buffers, *logs.large)):
            sink.submit(state, logs, logs.layout.nbytes)
            return
        logs = unpack(logs, list(logs.buffers))  # arrays of many processes, as below
    if _compat.tracing() or not (
        one_process()
        or all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves((state, logs)))
    ):  # (arrays of many processes: a program over their devices places the call)
        _compat.host_callback(sink.spool_host, state, logs, every_process=logger.every_process)
    else:
        sink.submit(state, logs, nbytes_of(logs))


# What `logger.spool`, `logger.tap` and `logger.jit` return: pytrees of the wrapped function
# (an Equinox model's arrays are leaves) and the state, like `eqx.filter_jit(fun)`.


class _LoggerSpooled(AbstractWrapper):
    logger: AbstractLogger
    spooled: Callable
    state: LoggerState

    shown: ClassVar[str] = "spool"

    @property
    def __wrapped__(self):
        return self.spooled.__wrapped__

    def __call__(self, *args, **kwargs):
        logger = self.logger
        logger._sink.check()
        out, logs = self.spooled(*args, **kwargs)
        _write(logger, logs, self.state)
        return out


class _LoggerJitted(AbstractWrapper):
    logger: AbstractLogger
    spooled: Callable
    jitted: Jit  # `spooled`, its logs packed, compiled (as by `eqx.filter_jit`, without its wait)
    state: LoggerState
    feed: Callable[[Packed], None]  # hands the packed logs of a call to the writer thread
    # with `step=` and an interval: the step for the calls whose step `gate` says the
    # interval skips, without its logs where the trace finds that none can be kept, and the
    # step for those it keeps, without the gate on the device (see `_steps.py`)
    skip: Jit | None
    kept: Jit | None
    gate: Gate | None

    shown: ClassVar[str] = "jit"
    compiles: ClassVar[bool] = True

    @property
    def __wrapped__(self):
        return self.spooled.__wrapped__

    def __call__(self, *args, **kwargs):
        if _compat.tracing():  # inside jit or vmap: a LogDict, for a host callback
            out, logs = self.spooled(*args, **kwargs)
            _write(self.logger, logs, self.state)
        else:
            kept = None if self.gate is None else self.gate.kept(args, kwargs)
            if kept is False:
                assert self.skip is not None
                out, packed = self.skip(*args, **kwargs)
                if packed is None:  # (every event at the call's step: none kept here)
                    return out
            else:
                assert kept is None or self.kept is not None
                out, packed = (self.jitted if kept is None else self.kept)(*args, **kwargs)
            if one_process():
                self.feed(packed)
            else:  # (arrays of many processes, maybe)
                _write(self.logger, packed, self.state)
        return out


class _LoggerTapped(AbstractWrapper):
    logger: AbstractLogger
    tapped: Callable

    shown: ClassVar[str] = "tap"

    @property
    def __wrapped__(self):
        return self.tapped.__wrapped__

    def __call__(self, *args, **kwargs):
        self.logger._sink.check()
        return self.tapped(*args, **kwargs)
