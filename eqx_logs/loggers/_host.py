"""The host side of the loggers, shared by the backends: logs fetched from the device
(`to_host`) and made records, names of files and runs, values as JSON, numpy arrays and
tracker rows."""

import contextlib
import functools
import hashlib
import logging
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from .._logdict import LogDict
from .._warn import warn_user

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
        steps = {name: per_key[key] for name, per_key in logs.steps.items() if key in per_key}
        stack = logs.reductions.get(key) == "Stack"
        count, rows = np.asarray(logs.count[key]), logs.rows.get(key)
        yield from key_records(key, value, count, rows, steps, stack, warn or warn_user)


def key_records(
    key: str,
    value: Any,
    count: np.ndarray,
    rows: Any,
    steps: dict[str, Any],
    stack: bool,
    warn: Callable[[str, type[Warning]], None],
) -> Iterator[Record]:
    """The records of one key with events (see `records`): `rows`, None for a key without an
    event axis; `stack`, whether it is a Stack's."""
    leaves = jax.tree.leaves(value)
    if not leaves:  # logged with no value (`log("tick", ())`): counted
        yield from _count_records(key, count, rows, steps, stack, warn)
        return
    if rows is None:
        yield {"key": key, "value": value, "count": count, **steps}
        return
    # an event axis: a record per real event or window
    length = leaves[0].shape[0]
    if stack and np.any(count > rows):
        warn(overflow_message(key, count, rows), UserWarning)
    for i in range(int(np.max(rows))):
        row = jax.tree.map(lambda x: x[i], value)
        # steps line up with the rows, except for Collect (whose rows are elements)
        row_steps = {
            n: s[i] if np.ndim(s) and np.shape(s)[0] == length else s for n, s in steps.items()
        }
        yield {"key": key, "value": row, **row_steps}


def _count_records(
    key: str,
    count: np.ndarray,
    rows: Any,
    steps: dict[str, Any],
    stack: bool,
    warn: Callable[[str, type[Warning]], None],
) -> Iterator[Record]:
    """The records of a key logged with no value: the value of each is the number of events it
    stands for. A Stack's events (a row of steps each) give a record per run of consecutive
    events at the same steps (one per event where each has a step of its own); other
    reductions, one record of all the key's events, with the steps of its last row."""
    if rows is None or not steps:
        yield {"key": key, "value": count, "count": count, **steps}
        return
    n = int(np.max(rows))
    if not stack:
        last = {name: s[n - 1] for name, s in steps.items()}
        yield {"key": key, "value": count, "count": count, **last}
        return
    if np.any(count > rows):
        warn(overflow_message(key, count, rows), UserWarning)
    lanes = tuple(range(1, 1 + np.ndim(rows)))  # (a vmap inside the spool: rows per lane)
    start = 0
    for i in range(1, n + 1):
        if i < n and all(np.array_equal(s[i], s[start]) for s in steps.values()):
            continue
        real = np.expand_dims(np.arange(start, i), lanes) < rows  # per lane
        events = np.sum(real, axis=0, dtype=np.int32)
        yield {"key": key, "value": events, **{name: s[start] for name, s in steps.items()}}
        start = i


def event_value(value: Any) -> Any:
    """A tapped event's value as a logger writes it: a value with no array (`log("tick",
    ())`) as the number of events it stands for, 1 (see `_count_records`)."""
    return value if jax.tree.leaves(value) else np.int32(1)


def overflow_message(key: str, count: Any, rows: Any) -> str:
    """What `records` warns when a Stack kept more events (`count`) than its buffer holds
    (`rows`)."""
    return (
        f"eqx_logs: key {key!r} kept {int(np.max(count))} events but its buffer "
        f"holds {int(np.max(rows))}: the rest are not written. With "
        "`interval`, this happens when the logged `step` repeats; pass "
        "`reduce=eqx_logs.Stack(capacity=N)` or log a step that grows with every "
        "event."
    )


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
    if isinstance(x, np.generic | np.ndarray) and x.dtype.kind in "biuf" and x.ndim == 0:
        # (the common case, a numpy scalar, without `host_array`'s dtype checks)
        item = x.item()
        return item if not isinstance(item, float) or math.isfinite(item) else str(item)
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
    if x.dtype.kind != "V":  # numpy's own types (jax's extra ones are "V"): as they are
        return x
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


@contextlib.contextmanager
def quiet(*, stdout: bool = False, loggers: tuple[str, ...] = ()) -> Iterator[None]:
    """A backend's chatter, dropped while the block runs on this thread (the writer's): what
    it prints to stdout (`stdout=True`), and the records below WARNING logged through
    `loggers` (by name, their children included) to those loggers' handlers. Other threads
    print and log as before; warnings, errors and exceptions pass."""
    with contextlib.ExitStack() as stack:
        if stdout:
            stack.enter_context(_QuietStdout.installed())
            stack.enter_context(_quieting("stdout"))
        if loggers:
            for name in loggers:
                for handler in logging.getLogger(name).handlers:
                    if _QUIET_LOGS not in handler.filters:  # left there: it passes the rest
                        handler.addFilter(_QUIET_LOGS)
            stack.enter_context(_quieting("logs"))
        yield


_quiet = threading.local()  # per thread: how many `quiet` blocks drop its "stdout", "logs"


@contextlib.contextmanager
def _quieting(what: str) -> Iterator[None]:
    setattr(_quiet, what, getattr(_quiet, what, 0) + 1)
    try:
        yield
    finally:
        setattr(_quiet, what, getattr(_quiet, what) - 1)


class _QuietLogs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not getattr(_quiet, "logs", 0)


_QUIET_LOGS = _QuietLogs()


class _QuietStdout:
    """`sys.stdout` while a thread is inside a `quiet(stdout=True)` block: that thread's writes
    are dropped, every other thread's go to the stream it replaced."""

    _lock = threading.Lock()
    _users = 0

    def __init__(self, stream: Any):
        self._stream = stream

    def write(self, text: str) -> int:
        return len(text) if getattr(_quiet, "stdout", 0) else self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    @classmethod
    @contextlib.contextmanager
    def installed(cls) -> Iterator[None]:
        with cls._lock:
            if not isinstance(sys.stdout, cls):
                sys.stdout = cls(sys.stdout)
            cls._users += 1
        try:
            yield
        finally:
            with cls._lock:
                cls._users -= 1
                # put back, unless another thread's block needs it or stdout was replaced
                # since (then it stays where it is, passing every write on)
                if cls._users == 0 and isinstance(sys.stdout, cls):
                    sys.stdout = sys.stdout._stream


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
