"""AbstractLogger: spool or tap a function into a backend, written on a background thread."""

import abc
import functools
import hashlib
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int, PRNGKeyArray

from .. import _compat
from .._logdict import LogDict
from .._policy import Policy, with_options
from .._retrace import fun_key, note_compile
from .._spool import build, build_wrapper, spool as _spool
from .._tap import check_tap_options, tap_with
from .._warn import warn_user
from ._packed import Packed, pack, stand_in, unpack
from ._run_config import RunConfig, as_config
from ._writer import ON_FULL, STALL_TIMEOUT, Writer

_T = TypeVar("_T")
Record = dict[str, Any]


def to_host(tree: _T) -> _T:
    """`jax.device_get(tree)`: its arrays as numpy arrays, waiting for the device. On an
    accelerator every copy is started first, so that they overlap; on the CPU, where starting
    one costs about 10 us an array and saves nothing, each array is read directly."""
    if _accelerator():
        return jax.device_get(tree)
    return jax.tree.map(np.asarray, tree)


@functools.cache
def _accelerator() -> bool:
    return jax.default_backend() != "cpu"


def with_events(logs: LogDict) -> LogDict:
    """`logs` on the host (numpy), without the keys that hold no event (a count of 0): their
    values are never fetched. Waits for the device to compute them."""
    counts = to_host(logs.count)
    empty = [key for key in logs if not np.any(counts[key])]
    if empty:
        logs = logs._without(empty)
    return to_host(logs)


def records(
    logs: LogDict, warn: Callable[[str, type[Warning]], None] | None = None
) -> Iterator[Record]:
    """One record per event for stacked keys (the real rows only), one per key otherwise:
    `{"key": ..., "value": ..., "count": ..., <step name>: ...}`, all plain Python/numpy. A
    key without events (a count of 0) has none. `warn(message, category)` says when a
    stack's buffer held fewer events than it kept (default: `warnings.warn`)."""
    logs = with_events(logs)
    for key, value in logs.items():
        count = np.asarray(logs.count[key])
        steps = {name: per_key[key] for name, per_key in logs.steps.items() if key in per_key}
        leaves = jax.tree.leaves(value)
        if key in logs.rows and leaves:  # an event axis: a record per real event or window
            length = leaves[0].shape[0]
            if logs.reductions.get(key) == "Stack" and np.any(count > logs.rows[key]):
                (warn or warn_user)(
                    f"eqx_logs: key {key!r} kept {int(np.max(count))} events but its buffer "
                    f"holds {int(np.max(logs.rows[key]))}: the rest are not written. With "
                    "`interval`, this happens when the logged `step` repeats; pass "
                    "`reduce=eqx_logs.Stack(capacity=N)` or log a step that grows with every "
                    "event.",
                    UserWarning,
                )
            for i in range(int(np.max(logs.rows[key]))):
                row = jax.tree.map(lambda x: x[i], value)
                # steps line up with the rows, except for Collect (whose rows are elements)
                row_steps = {
                    n: s[i] if np.ndim(s) and np.shape(s)[0] == length else s
                    for n, s in steps.items()
                }
                yield {"key": key, "value": row, **row_steps}
        else:
            yield {"key": key, "value": value, "count": count, **steps}


_NONFINITE_RUNS = "nonfinite-runs"  # `Writer.memo`'s key: the runs reported non-finite


_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")


def safe_name(key: str) -> str:
    """`key` as a file name that stays inside its directory: `../../x` becomes `x`,
    `a/b` becomes `a__b`, and anything outside `[A-Za-z0-9._=-]` becomes `_`."""
    parts = [_UNSAFE.sub("_", p) for p in key.split("/")]
    parts = [p for p in parts if p.strip(".")]
    return "__".join(parts) or "_"


_HASHED = re.compile(r"-[0-9a-f]{8}$")


def distinct_name(name: str, key: str, limit: int) -> str:
    """`name` (what a backend can store for `key`) made distinct for distinct keys: `key`
    itself where `name` is `key`, fits in `limit` characters and cannot be mistaken for a
    hashed name; otherwise `name`, cut to `limit - 9` characters, plus `-` and a short hash
    of `key`."""
    if name == key and len(key) <= limit and not _HASHED.search(key):
        return key
    return f"{name[: limit - 9]}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def unique_name(key: str) -> str:
    """`safe_name(key)` as a file name distinct for every key (`distinct_name`): `a/b`,
    `a__b` and `a__b-3ec69c85` get three names, and long keys fit a file name."""
    return distinct_name(safe_name(key), key, 120)


def to_python(x: Any) -> Any:
    """JSON-friendly: numpy scalars and arrays to Python numbers and lists; NaN and infinities
    become the strings `"nan"`, `"inf"`, `"-inf"`."""
    if isinstance(x, dict):  # a pytree value: JSON keys are strings
        return {k if isinstance(k, str) else str(k): to_python(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [to_python(v) for v in x]
    arr = host_array(x)
    if arr.ndim == 0:
        item = arr.item()
        if isinstance(item, complex):
            return [to_python(item.real), to_python(item.imag)]
        return item if not isinstance(item, float) or math.isfinite(item) else str(item)
    if arr.dtype.kind in "biu" or (arr.dtype.kind == "f" and np.isfinite(arr).all()):
        return arr.tolist()  # (in C: an element at a time in Python costs 100x as much)
    return [to_python(v) for v in arr]


def host_array(x: Any) -> np.ndarray:
    """`x` as a numpy array that plain numpy (and every backend) understands: float types
    numpy lacks (bfloat16, float8, ...) become float32, and narrow integer types (int4,
    uint2, ...) int8 or uint8, which hold them exactly."""
    x = np.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.floating) and not np.issubdtype(x.dtype, np.floating):
        return x.astype(np.float32)
    if jnp.issubdtype(x.dtype, jnp.integer) and not np.issubdtype(x.dtype, np.integer):
        return x.astype(np.int8 if jnp.iinfo(x.dtype).min < 0 else np.uint8)
    return x


def flat_items(key: str, value: Any) -> Iterator[tuple[str, np.ndarray]]:
    """A (possibly pytree) value as `(key/path, array)` pairs: `{"a": x}` under `k` gives
    `("k/a", x)`. Arrays as by `host_array`."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        name = "/".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
        yield (f"{key}/{name}" if name else key), host_array(leaf)


def finite(x: np.ndarray) -> np.ndarray:
    """The finite entries of `x`, flattened (all of them for integer and bool arrays)."""
    return x[np.isfinite(x)] if np.issubdtype(x.dtype, np.inexact) else x.ravel()


def is_scalar(x: np.ndarray) -> bool:
    """A single real number (a 0-d or one-element bool, integer or float array)."""
    return x.size == 1 and (np.issubdtype(x.dtype, np.number) or x.dtype == bool)


def not_complex(leaf: np.ndarray) -> str | None:
    """For a backend's `_unstorable`: why it cannot store `leaf` if complex, else None."""
    if np.iscomplexobj(leaf):
        return (
            "complex values (log `jnp.real(x)` and `jnp.imag(x)`, or `jnp.abs(x)`, under keys "
            "of their own)"
        )
    return None


def require(module: str, extra: str, who: str) -> Any:
    """Import an optional backend, or say which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{who} needs {module.split('.')[0]}: pip install '.[{extra}]' from the eqx_logs "
            f"checkout (or pip install {module.split('.')[0]})"
        ) from e


def steps_of(record: Record) -> dict[str, Any]:
    """The step values of a record (everything but key and value)."""
    return {k: v for k, v in record.items() if k not in ("key", "value")}


def rows_by_step(
    records: list[Record], step: str, histogram: Callable[[np.ndarray], Any]
) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """Records as rows for a tracker with a W&B-like `log(row, step=)` (W&B, trackio): each a
    dict from tag to a number (scalars) or `histogram(finite entries as float64)` (arrays).
    Returns the rows of records with a `step`, merged by step, and those without, in order."""
    by_step: dict[int, dict[str, Any]] = {}
    stepless: list[dict[str, Any]] = []
    for r in records:
        row: dict[str, Any] = {}
        for tag, value in flat_items(r["key"], r["value"]):
            if is_scalar(value):
                row[tag] = value.reshape(()).item()
            else:
                row[tag] = histogram(finite(value).astype(np.float64))
        if step in r:
            by_step.setdefault(int(np.asarray(r[step])), {}).update(row)
        else:
            stepless.append(row)
    return by_step, stepless


def process_suffix(every_process: bool) -> str:
    """What this process adds to the names of the files or runs it writes: nothing in a
    single-process run, nor on process 0 by default (it writes the run's events); otherwise
    `.process<k>` (with `every_process`, every process writes a copy of its own; without,
    only the events of its own devices inside a `shard_map` reach process k > 0)."""
    if jax.process_count() == 1:
        return ""
    index = jax.process_index()
    return f".process{index}" if every_process or index else ""


def process_path(path: str, every_process: bool) -> str:
    """`path` with `process_suffix` before its extension: `logs.jsonl` -> `logs.process1.jsonl`."""
    root, ext = os.path.splitext(path)
    return root + process_suffix(every_process) + ext


class LoggerState(eqx.Module):
    """What `AbstractLogger.init` returns: the run this state writes to. Under `jax.vmap`
    over states each lane writes to its own run."""

    run: Int[Array, ""]


def _run_index(key: PRNGKeyArray | ArrayLike | None) -> Int[Array, ""]:
    if key is None:
        return jnp.int32(0)
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.randint(key, (), 0, 2**31 - 1, dtype=jnp.int32)
    if key.dtype == jnp.uint32 and key.shape == (2,):  # a raw `jax.random.PRNGKey`
        return jax.random.randint(key, (), 0, 2**31 - 1, dtype=jnp.int32)
    if key.shape != () or not jnp.issubdtype(key.dtype, jnp.integer):
        raise TypeError(
            "logger.init(key) takes a jax.random.key, an integer run index or None; got an "
            f"array of shape {key.shape} and dtype {key.dtype}. For one run per seed use "
            "`jax.vmap(logger.init)(jax.random.split(key, n))`."
        )
    return key.astype(jnp.int32)


class NonfiniteWarning(RuntimeWarning):
    """A spooled call's logs held a NaN or an infinity (`first_nonfinite=True`): the message
    names the first such event."""


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
        `None` waits forever (a stuck backend then hangs the caller).
    """

    # keyword-only, so that backends' own fields may come without defaults before it
    # (`config`: not static, so a logger passed to `eqx.filter_jit` stays hashable)
    config: RunConfig | None = eqx.field(default=None, kw_only=True, converter=as_config)
    every_process: bool = eqx.field(default=False, static=True, kw_only=True)
    on_full: Literal["block", "drop"] = eqx.field(default="block", static=True, kw_only=True)
    stall_timeout: float | None = eqx.field(default=STALL_TIMEOUT, static=True, kw_only=True)
    _writer: Writer = eqx.field(
        static=True, default_factory=lambda: Writer("logger"), repr=False, init=False
    )

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
                "number of seconds > 0, or None to wait for a stuck backend forever."
            )
        # the writer (one per logger, shared by its copies) follows the logger's policy
        self._writer.on_full, self._writer.stall_timeout = self.on_full, timeout

    # --- the backend, run on the writer thread -------------------------------------------

    @abc.abstractmethod
    def _open(self, run: int) -> Any:
        """Open run `run` (files, a remote run, ...) and return its handle."""

    @abc.abstractmethod
    def _write(self, handle: Any, run: int, records: list[Record]) -> None:
        """Write `records` (each `{"key", "value", <step names>...}`) to run `run`."""

    def _close(self, handle: Any) -> None:
        """Close what `_open` returned."""

    # --- the public API --------------------------------------------------------------------

    def init(self, key: PRNGKeyArray | ArrayLike | None = None) -> LoggerState:
        """A new state. `key` picks the run: `None` is run 0, an integer is that run, and a
        `jax.random.key` gives a run index drawn from it. Vmap over keys or integers for one run
        per lane."""
        return LoggerState(run=_run_index(key))

    def spool(
        self,
        fun: Callable[..., _T],
        state: LoggerState,
        /,
        *,
        policy: Policy | None = None,
        reduce: Any = None,
        interval: int | None = None,
        window: int | None = None,
        tags: Any = None,
        exclude: Any = None,
        prefix: str | None = None,
        keep: bool = False,
        key: PRNGKeyArray | None = None,
        across: str | tuple[str, ...] | None = None,
        first_nonfinite: bool | None = None,
    ) -> Callable[..., _T]:
        """`fun`, spooled as by [`eqx_logs.spool`][] (same options); the logs are written to
        `state`'s run when the call completes, and `fun`'s output is returned. With
        `first_nonfinite`, a call whose logs hold a NaN or infinity warns
        ([`eqx_logs.loggers.NonfiniteWarning`][]) with the first such event."""
        policy = with_options(
            policy,
            "logger.spool",
            reduce=reduce,
            interval=interval,
            window=window,
            tags=tags,
            exclude=exclude,
            prefix=prefix,
            key=key,
            across=across,
            first_nonfinite=first_nonfinite,
        )
        return build_wrapper(_LoggerSpooled, self, _spool(fun, policy=policy, keep=keep), state)

    def tap(
        self,
        fun: Callable[..., _T],
        state: LoggerState,
        /,
        *,
        policy: Policy | None = None,
        interval: int | None = None,
        tags: Any = None,
        exclude: Any = None,
        prefix: str | None = None,
        **spool_only: Any,
    ) -> Callable[..., _T]:
        """`fun`, tapped as by [`eqx_logs.tap`][]: each event is written to `state`'s run as it
        happens (`interval=k` writes every k-th event of each key, gated on the device)."""
        check_tap_options("logger.tap", spool_only)
        options = dict(interval=interval, tags=tags, exclude=exclude, prefix=prefix)
        policy = with_options(policy, "logger.tap", **options)
        tapped = tap_with(fun, policy, self._tap_host, state, self.every_process)
        return build_wrapper(_LoggerTapped, self, tapped)

    def jit(
        self,
        fun: Callable[..., _T],
        state: LoggerState,
        /,
        *,
        donate: Literal["all", "all-except-first", "warn", "none"] = "none",
        policy: Policy | None = None,
        reduce: Any = None,
        interval: int | None = None,
        window: int | None = None,
        tags: Any = None,
        exclude: Any = None,
        prefix: str | None = None,
        keep: bool = False,
        key: PRNGKeyArray | None = None,
        across: str | tuple[str, ...] | None = None,
        first_nonfinite: bool | None = None,
    ) -> Callable[..., _T]:
        """`eqx.filter_jit(fun)`, spooled, its logs written to `state`'s run: the form for
        the training loop that calls one compiled step per Python iteration.

        ```python
        step = logger.jit(train_step, logger.init(), interval=100)
        for i in range(steps):
            model, opt_state = step(model, opt_state, x, y, jnp.int32(i))
        ```

        The compiled step holds no host callback and no effect, so each call takes JAX's
        fast dispatch path, as `eqx.filter_jit(train_step)` does. Its logs come out as
        arrays and are handed, as they are, to the logger's writer thread, which waits for
        the device, fetches the keys that hold events (the steps an `interval` skips hold
        none, and cost a transfer of their counts alone) and writes them, in order. The
        training loop never waits for the device because of logging. (Logging inside the
        step is as for [`eqx_logs.spool`][]: same options; `donate` as for
        `eqx.filter_jit`.) A backend error, a value the backend cannot store and, with
        `first_nonfinite`, a [`eqx_logs.loggers.NonfiniteWarning`][] come from the next call
        into the logger.

        In that loop `logger.jit` writes what `eqx.filter_jit(logger.spool(...))` and
        `eqx.filter_jit(logger.tap(...))` write, without the host callback those put in
        every step: each call is one step, its events are written once it has run.
        (`logger.tap` is for events streamed out of a long call, a `lax.scan` over many
        steps, while it runs.)
        Called inside `jax.jit` or `jax.vmap`, it is `logger.spool(fun, state)` in
        `eqx.filter_jit`, with the host callback that needs.
        """
        policy = with_options(
            policy,
            "logger.jit",
            reduce=reduce,
            interval=interval,
            window=window,
            tags=tags,
            exclude=exclude,
            prefix=prefix,
            key=key,
            across=across,
            first_nonfinite=first_nonfinite,
        )
        spooled = _spool(fun, policy=policy, keep=keep)
        jitted = build(eqx.filter_jit, build(_Packing, spooled), donate=donate)
        return build_wrapper(_LoggerJitted, self, spooled, jitted, state)

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
        self._writer.flush()

    def close(self) -> None:
        """Flush, then close every run's files or remote run; say what was lost, as `flush`
        does (a stuck backend is given up on after `stall_timeout` seconds: what it has not
        written is counted as lost). The logger may be used again afterwards (runs are
        reopened, appending)."""
        jax.effects_barrier()
        self._writer.close()

    def __enter__(self):
        return self

    def _with_config(self, config: Any) -> "AbstractLogger":
        """This logger, recording `config` if it records none of its own: a copy that shares
        its writer (and so its queue and runs)."""
        if self.config is not None or config is None:
            return self
        config = as_config(config)
        return eqx.tree_at(lambda logger: logger.config, self, config, is_leaf=_is_none)

    def __exit__(self, *exc):
        self.close()

    # --- plumbing ---------------------------------------------------------------------------
    #
    # What runs for every step calls methods through the class: Equinox hands out each bound
    # method of a module as a module of its own (`eqx.Module.__getattribute__`), which costs
    # about 50 us to build, as much as a small training step.

    def _check(self) -> None:
        self._writer.check()

    def _spool_host(self, state: LoggerState, logs: LogDict) -> None:
        # a host callback: raise a pending writer error, so that inside `jax.jit` too it
        # surfaces from the next call (as a JaxRuntimeError naming the WriterError)
        cls = type(self)
        cls._submit_logs(self, state, logs)
        cls._check(self)

    def _tap_host(self, state: LoggerState, logs: dict[str, Any], steps: dict[str, Any]) -> None:
        rows = [{"key": key, "value": value, **steps} for key, value in logs.items()]
        cls = type(self)
        cls._submit(self, int(state.run), rows)
        cls._check(self)

    def _unstorable(self, leaf: np.ndarray) -> str | None:
        """Why this backend cannot store `leaf` (a value's array, as by `host_array`), or
        None. Checked before writing: a key it rejects is named, and the others are written."""
        del leaf
        return None

    def _started(self) -> Writer:
        writer = self._writer
        if writer.finish is None:
            writer.name = type(self).__name__
            writer.finish = functools.partial(type(self)._finish, self)
            writer.write_logs = functools.partial(type(self)._write_logs, self)
        return writer

    def _submit_logs(
        self, state: LoggerState, logs: LogDict | Packed, size: int | None = None
    ) -> None:
        """Hand `logs` (arrays, on the device or not, or packed by `logger.jit`; `size`
        bytes in all) to the writer thread, which fetches them (`_fetch`) and writes them
        (`_write_logs`). Values the backend cannot store are named here, from their types
        and shapes."""
        cls = type(self)
        writer = cls._started(self)
        rejected = {}
        if cls._unstorable is not AbstractLogger._unstorable:  # a backend that checks
            if isinstance(logs, Packed):  # the same for every call of a step
                layout = logs.layout
                if layout not in writer.memo:
                    writer.memo[layout] = cls._rejected_logs(self, stand_in(layout))
                rejected = writer.memo[layout]
            else:
                rejected = cls._rejected_logs(self, logs)
                if rejected:
                    logs, size = logs._without(rejected), None
        if size is None:
            size = _nbytes(logs)
        drop = tuple(rejected) if isinstance(logs, Packed) else ()
        writer.submit(writer.write_logs, (state, logs, drop), size, ready=_fetch)
        _reject(self, rejected)

    def _rejected_logs(self, logs: LogDict) -> dict[str, str]:
        """`_rejected` of the rows of `logs`, from their leaves' types and shapes alone."""

        def row(key: str, leaf: Any) -> np.ndarray:
            shape = np.shape(leaf)[1:] if key in logs.rows else np.shape(leaf)
            return np.broadcast_to(host_array(np.zeros((), leaf.dtype)), shape)

        leaves = ((k, row(k, x)) for k, v in logs.items() for x in _leaves(v))
        return type(self)._rejected(self, leaves)

    def _submit(self, run: int, rows: list[Record]) -> None:
        """Hand records of host values (tap's events) to the writer thread."""
        cls = type(self)
        writer = cls._started(self)
        rejected = {}
        if cls._unstorable is not AbstractLogger._unstorable:
            leaves = ((r["key"], x) for r in rows for _, x in flat_items(r["key"], r["value"]))
            rejected = cls._rejected(self, leaves)
            rows = [r for r in rows if r["key"] not in rejected]
        size = sum(np.asarray(x).nbytes for r in rows for x in jax.tree.leaves(r["value"]))
        writer.submit(functools.partial(cls._write_run, self), (run, rows), size)
        _reject(self, rejected)

    def _rejected(self, leaves: Iterable[tuple[str, np.ndarray]]) -> dict[str, str]:
        """The keys among `(key, leaf)` whose leaf the backend cannot store, and why."""
        unstorable = type(self)._unstorable
        return {key: why for key, leaf in leaves if (why := unstorable(self, leaf)) is not None}

    def _write_logs(self, item: tuple[np.ndarray, LogDict | None]) -> None:
        """On the writer thread: write fetched logs (`_fetch`), one run per lane of a state
        under `vmap` (a run written nothing is opened all the same); keep the
        `first_nonfinite` report for the caller."""
        runs, logs = item
        writer = self._writer
        for lane in np.ndindex(runs.shape):
            run = int(runs[lane])
            if logs is None:  # no events
                if run not in writer.handles:
                    type(self)._write_run(self, (run, []))
                continue
            lane_logs = jax.tree.map(lambda x: x[lane], logs) if lane else logs
            rows = list(records(lane_logs, writer.notify))
            if rows or run not in writer.handles:
                type(self)._write_run(self, (run, rows))
            if lane_logs._nonfinite is not None and (event := lane_logs.first_nonfinite):
                # one report per run: a NaN carries on through the steps after it
                reported = writer.memo.setdefault(_NONFINITE_RUNS, set())
                if run not in reported:
                    reported.add(run)
                    writer.notify(
                        f"{type(self).__name__} (run {run}): {event}. Later non-finite "
                        "values of this run are not reported.",
                        NonfiniteWarning,
                    )

    def _write_run(self, item: tuple[int, list[Record]]) -> None:
        run, rows = item
        handles = self._writer.handles
        if run not in handles:
            handles[run] = self._open(run)
        self._write(handles[run], run, rows)

    def _finish(self) -> None:
        handles = self._writer.handles
        while handles:
            _, handle = handles.popitem()
            self._close(handle)


def _is_none(x: Any) -> bool:
    return x is None


def _write(logger: AbstractLogger, logs: LogDict | Packed, state: LoggerState | None) -> None:
    """`logger.write(logs, state)`: see there. (`logger.jit` writes its logs packed.)"""
    cls = type(logger)
    cls._check(logger)
    state = cls.init(logger) if state is None else state
    if isinstance(logs, Packed):
        if _one_process() or all(x.is_fully_addressable for x in (*logs.buffers, *logs.large)):
            cls._submit_logs(logger, state, logs, logs.layout.nbytes)
            return
        logs = unpack(logs, list(logs.buffers))  # arrays of many processes, as below
    if _compat.tracing() or not (
        _one_process()
        or all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves((state, logs)))
    ):  # (arrays of many processes: a program over their devices places the call)
        host = functools.partial(cls._spool_host, logger)
        _compat.host_callback(host, state, logs, every_process=logger.every_process)
    else:
        cls._submit_logs(logger, state, logs, _nbytes(logs))


def _reject(logger: AbstractLogger, rejected: dict[str, str]) -> None:
    if rejected:
        raise ValueError(
            f"{type(logger).__name__} cannot store "
            + "; ".join(f"key {k!r}: {why}" for k, why in rejected.items())
            + ". The other keys of this write were written."
        )


@functools.cache
def _one_process() -> bool:
    # (asked once arrays exist, so after any `jax.distributed.initialize`)
    return jax.process_count() == 1


def _nbytes(logs: LogDict) -> int:
    """Roughly the bytes `logs` holds: its values' (counts and steps are a few more)."""
    leaves = map(_leaves, logs.values())
    return sum(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for xs in leaves for x in xs)


def _leaves(value: Any) -> list[Any]:
    return [np.asarray(x) if not hasattr(x, "dtype") else x for x in jax.tree.leaves(value)]


def _fetch(
    items: list[tuple[LoggerState, LogDict | Packed, tuple[str, ...]]],
) -> list[tuple[np.ndarray, LogDict | None]]:
    """On the writer thread, before the backend's turn: wait for the device, then fetch the
    run indices and counts (or small leaves, packed) of every write queued in a row (one
    transfer), and the keys that hold events of those that have any (another). `(runs, None)`
    for a write without events. `drop`: keys not to write (a backend cannot store them)."""
    heads = to_host([(s.run, _head(logs)) for s, logs, _ in items])
    more = {  # packed writes whose counts hold an event: all of their small leaves now
        i: list(logs.buffers)
        for i, ((_, logs, _), (_, head)) in enumerate(zip(items, heads))
        if isinstance(logs, Packed) and logs.layout.counts and _any_event(logs, head)
    }
    for i, buffers in to_host(more).items():
        heads[i] = (heads[i][0], buffers)
    keep = {}
    for i, ((_, logs, drop), (_, head)) in enumerate(zip(items, heads)):
        if isinstance(logs, Packed) and not isinstance(head, list):
            continue  # (the counts alone, none of them an event)
        if isinstance(logs, Packed):
            logs = unpack(logs, head)
            logs = logs._without(drop) if drop else logs
            head = logs.count  # (numpy arrays)
        count = head
        empty = [key for key in logs if not count[key].any()]  # (numpy arrays)
        if len(empty) < len(logs) or logs._nonfinite is not None:
            keep[i] = logs._without(empty) if empty else logs
    fetched = to_host(keep)
    return [(runs, fetched.get(i)) for i, (runs, _) in enumerate(heads)]


def _any_event(logs: Packed, counts: np.ndarray) -> bool:
    """Whether the buffer of a packed write's counts (`_head`) counts an event."""
    return bool(counts[list(logs.layout.counts[1])].any())


def _head(logs: LogDict | Packed) -> Any:
    """What `_fetch` reads of every write first: the counts; for a packed write, the buffer
    that holds them (or every buffer)."""
    if not isinstance(logs, Packed):
        return logs.count
    if logs.layout.counts is not None:
        return logs.buffers[logs.layout.counts[0]]
    return list(logs.buffers)


# What `logger.spool`, `logger.tap` and `logger.jit` return: pytrees of the wrapped function
# (an Equinox model's arrays are leaves) and the state, like `eqx.filter_jit(fun)`.


class _LoggerSpooled(eqx.Module):
    logger: AbstractLogger
    spooled: Callable
    state: LoggerState

    # `jax.jit(spool(f))` hashes the function: by identity, like a closure (the fields may be
    # arrays, a model's or a logger state).
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    @property
    def __wrapped__(self):
        return self.spooled.__wrapped__

    def __call__(self, *args, **kwargs):
        logger = self.logger
        type(logger)._check(logger)
        out, logs = self.spooled(*args, **kwargs)
        _write(logger, logs, self.state)
        return out


class _Packing(eqx.Module):
    spooled: Callable

    def __call__(self, *args, **kwargs):  # traced by `eqx.filter_jit`
        fun = self.spooled.__wrapped__
        note_compile("logger.jit", fun_key(fun), fun, args, kwargs)
        out, logs = self.spooled(*args, **kwargs)
        return out, pack(logs)


class _LoggerJitted(eqx.Module):
    logger: AbstractLogger
    spooled: Callable
    jitted: Callable  # `spooled`, its logs packed, in `eqx.filter_jit`
    state: LoggerState

    __hash__ = object.__hash__
    __eq__ = object.__eq__

    @property
    def __wrapped__(self):
        return self.spooled.__wrapped__

    def __call__(self, *args, **kwargs):
        if _compat.tracing():  # inside jit or vmap: a LogDict, for a host callback
            out, logs = self.spooled(*args, **kwargs)
        else:
            out, logs = self.jitted(*args, **kwargs)
        _write(self.logger, logs, self.state)
        return out


class _LoggerTapped(eqx.Module):
    logger: AbstractLogger
    tapped: Callable

    # `jax.jit(spool(f))` hashes the function: by identity, like a closure (the fields may be
    # arrays, a model's or a logger state).
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    @property
    def __wrapped__(self):
        return self.tapped.__wrapped__

    def __call__(self, *args, **kwargs):
        logger = self.logger
        type(logger)._check(logger)
        return self.tapped(*args, **kwargs)
