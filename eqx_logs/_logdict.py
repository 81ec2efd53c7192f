import dataclasses
import functools
import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.export
import jax.tree_util as jtu
import numpy as np

from . import _compat
from ._watch import is_checked, operation_of


@jtu.register_pytree_with_keys_class
class LogDict(dict):
    """What `spool` returns: a dict from key to logged value, plus counts and step info.

    - `logs[key]`: the reduced value (for the default reduction, events stacked on a new
      leading axis, unused slots NaN or 0);
    - `logs.count[key]`: the number of real events;
    - `logs.<step>[key]`: the step values recorded with `log(..., step=i)`, aligned with
      `logs[key]` (for example `logs.step["loss"]`, `logs.episode["loss"]`).

    A key logged with no value (`log("tick", (), step=i)`) holds `()`: its count and steps
    are all there is.

    A LogDict is a pytree, so it passes through `jax.jit` and `eqx.filter_jit` as an output.
    Its static part is its keys, step names and reductions, and the counts (and row counts)
    that `spool` knew when it traced the function (straight-line code and scans, not a
    `while_loop` or a `cond` that decides): those are numpy int32 arrays in its structure,
    not outputs of the compiled program (an output costs a buffer at every call). Under a
    `jax.vmap`, `lax.scan` or `lax.map` around the spool such a count gets the new leading
    axes of its key's value (each lane's count is the same), as an output would. (A key with
    no value has no value to take them from: its count and rows are always outputs.)
    """

    __slots__ = (
        "_count",
        "_steps",
        "_reductions",
        "_rows",
        "_known",
        "_nonfinite",
        "_packed",  # after `tree_unflatten`: (aux, children), until the slots above are set
    )

    def __init__(
        self,
        values: Mapping[str, Any] = (),
        *,
        count: Mapping[str, Any] | None = None,
        steps: Mapping[str, Mapping[str, Any]] | None = None,
        reductions: Mapping[str, str] | None = None,
        rows: Mapping[str, Any] | None = None,
    ):
        super().__init__(values)
        self._count = dict(count or {})
        self._reductions = dict(reductions or {})
        self._rows = dict(rows or {})
        # (part, key) of the counts and rows known at trace time, which are static: to their
        # treedef data and the array made from it, where unflattened (`_static_part`)
        self._known: dict[tuple[str, str], tuple | None] = {}
        # `spool(first_nonfinite=True)`: (arrays, (keys, sites, step names)), else None
        self._nonfinite: tuple[dict[str, Any], tuple] | None = None
        # step name -> {key -> stacked step values}
        self._steps = {name: dict(per_key) for name, per_key in (steps or {}).items()}

    @property
    def count(self) -> dict[str, Any]:
        return self._count

    @property
    def reductions(self) -> dict[str, str]:
        """The name of the reduction class that produced each key (`"Stack"`, `"Mean"`, ...)."""
        return self._reductions

    @property
    def rows(self) -> dict[str, Any]:
        """For keys whose output has an event axis (Stack, Window, Sample, Collect): how many
        leading rows are real events or windows; the rest is padding."""
        return self._rows

    @property
    def steps(self) -> dict[str, dict[str, Any]]:
        """All step info: `{step_name: {key: values}}`."""
        return self._steps

    @property
    def first_nonfinite(self) -> "NonfiniteEvent | None | list":
        """With `spool(..., first_nonfinite=True)`: the first event, in execution order,
        whose value had a NaN or infinite element, as an `NonfiniteEvent` (its key, event
        index, steps, call site and pass); None if every value was finite. Read it outside
        `jax.jit` (return the LogDict from the jitted function).

        Under `jax.vmap(spool(f))` each lane is a run of its own, with a report of its own:
        a list of them, one per lane (nested, one level per vmap)."""
        if self._nonfinite is None:  # (not AttributeError: that would try the step names)
            raise ValueError(
                "LogDict.first_nonfinite: this spool did not look for non-finite values; pass "
                "`first_nonfinite=True` to `eqx_logs.spool` (or to the Policy)."
            )
        arrays, tables = self._nonfinite
        if _compat.is_tracer(arrays["found"]):
            raise TypeError(
                "LogDict.first_nonfinite reads the values of the report, so it needs concrete "
                "arrays: return the LogDict from the jitted function and read it outside."
            )
        return _reports({n: np.asarray(x) for n, x in arrays.items()}, tables)

    def __missing__(self, key: Any) -> Any:
        import difflib

        keys = sorted(self)
        close = difflib.get_close_matches(str(key), keys, n=3)
        hint = f" Did you mean {', '.join(map(repr, close))}?" if close else ""
        listed = ", ".join(map(repr, keys[:50])) + (
            f", ... ({len(keys)} in all)" * (len(keys) > 50)
        )
        raise KeyError(
            f"{key!r}: no such key in this LogDict.{hint} Its keys: {listed or 'none'}. A key "
            "is there when a log under it ran inside the spool and its policy kept it (tags, "
            "exclude, rules)."
        )

    def __getattr__(self, name: str) -> Any:
        if name in _UNPACKED:  # unflattened, not yet unpacked
            _unpack(self)
            return object.__getattribute__(self, name)
        try:
            return self._steps[name]
        except KeyError:
            raise AttributeError(
                f"LogDict has no step named {name!r}; steps recorded: {sorted(self._steps)}."
            ) from None

    def __repr__(self) -> str:
        return f"LogDict({dict.__repr__(self)}, count={self._count!r})"

    def _without(self, keys: Any) -> "LogDict":
        """A copy without `keys` (the loggers' writes skip keys without events)."""
        drop = set(keys)
        keep = [k for k in self if k not in drop]
        out = LogDict(
            {k: self[k] for k in keep},
            count={k: self._count[k] for k in keep},
            steps={n: {k: v for k, v in s.items() if k in keep} for n, s in self._steps.items()},
            reductions={k: r for k, r in self._reductions.items() if k in keep},
            rows={k: r for k, r in self._rows.items() if k in keep},
        )
        out._known = {(part, k): v for (part, k), v in self._known.items() if k not in drop}
        out._nonfinite = self._nonfinite
        return out

    def tree_flatten(self):
        try:  # as unflattened, untouched: the same leaves (Equinox flattens outputs again)
            aux, children = object.__getattribute__(self, "_packed")
            return list(children), aux
        except AttributeError:
            pass
        keys = tuple(self)
        step_names = tuple((name, tuple(per_key)) for name, per_key in self._steps.items())
        known = self._known
        counted = tuple(k for k in keys if ("count", k) not in known)
        row_keys = tuple(k for k in keys if k in self._rows and ("rows", k) not in known)
        static = tuple(
            _static_part(part, k, getattr(self, f"_{part}")[k], self[k], known[part, k])
            for part, k in sorted(known)
            if k in self
        )
        children = [self[k] for k in keys]
        children += [self._count[k] for k in counted]
        children += [self._rows[k] for k in row_keys]
        for name, per_key in step_names:
            children += [self._steps[name][k] for k in per_key]
        reductions = tuple(self._reductions.get(k) for k in keys)
        nonfinite = None
        if self._nonfinite is not None:
            arrays, tables = self._nonfinite
            nonfinite = (tuple(arrays), tables)
            children += list(arrays.values())
        return children, _Aux((keys, step_names, reductions, counted, row_keys, static, nonfinite))

    def tree_flatten_with_keys(self):
        children, aux = self.tree_flatten()
        keys, step_names, _, counted, row_keys, _, nonfinite = aux.spec
        paths = [jtu.DictKey(k) for k in keys]
        paths += [jtu.GetAttrKey(f"count[{k!r}]") for k in counted]
        paths += [jtu.GetAttrKey(f"rows[{k!r}]") for k in row_keys]
        for name, per_key in step_names:
            paths += [jtu.GetAttrKey(f"{name}[{k!r}]") for k in per_key]
        if nonfinite is not None:
            paths += [jtu.GetAttrKey(f"first_nonfinite.{n}") for n in nonfinite[0]]
        return list(zip(paths, children)), aux

    @classmethod
    def tree_unflatten(cls, aux: "_Aux", children: Any) -> "LogDict":
        # The values, and the rest as it came: JAX and Equinox unflatten an output several
        # times a call, and most of those are never read (`_unpack` does it on first use).
        self = cls.__new__(cls)
        dict.update(self, zip(aux.spec[0], children))
        self._packed = (aux, children)
        return self


# The slots `_unpack` sets.
_UNPACKED = frozenset(LogDict.__slots__) - {"_packed"}


def _static_part(part: str, key: str, x: Any, value: Any, made: tuple | None) -> tuple:
    """A count or row count known at trace time as treedef data: `(part, key, shape, dtype,
    elements, ndim)`, `ndim` that of the key's value's first leaf then (the axes a `vmap`,
    `scan` or `lax.map` adds later are its leading axes beyond it: `_parts`). `made`, where
    the LogDict was unflattened: `(data, array)`, the data the part came from and the array
    made of it; while `x` is that array, the data is kept (the value's leading axes beyond
    `ndim` are a `vmap`'s, not the part's own)."""
    if made is not None and made[1] is x:
        return made[0]
    x = np.asarray(x)
    leaves = jtu.tree_leaves(value)
    ndim = np.ndim(leaves[0]) if leaves else None
    return (part, key, x.shape, x.dtype.str, tuple(x.ravel().tolist()), ndim)


class _Aux:
    """A LogDict's treedef data: its keys, step names, reductions, its counts known at trace
    time, ... (`spec`, by which it is compared and hashed), and where `_unpack` finds each
    part among the leaves, worked out once per treedef."""

    __slots__ = ("spec", "_hash", "_plan")

    def __init__(self, spec: tuple):
        self.spec = spec
        self._hash = hash(spec)
        self._plan = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Aux) and self.spec == other.spec

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"LogDict{self.spec[0]!r}"

    def plan(self) -> tuple:
        """(count, rows, steps, nonfinite): where each key's part is, in the keys' order:
        `(part, key, at)`, `at` its leaf index, or `(array, ndim, value index, data)` for a
        part in the structure (`_static_part`'s `data`)."""
        if self._plan is None:
            keys, step_names, _, counted, row_keys, static, nonfinite = self.spec
            at = iter(range(len(keys), 2**62))
            where = {("count", k): next(at) for k in counted}
            where.update({("rows", k): next(at) for k in row_keys})
            steps = tuple((n, tuple((k, next(at)) for k in per_key)) for n, per_key in step_names)
            arrays = None if nonfinite is None else tuple((n, next(at)) for n in nonfinite[0])
            for data in static:
                part, key, shape, dtype, elements, ndim = data
                x = np.array(elements, dtype).reshape(shape)
                x.flags.writeable = False  # (shared by every LogDict of this treedef)
                where[part, key] = (x, ndim, keys.index(key), data)
            count = tuple(("count", k, where["count", k]) for k in keys)
            rows = tuple(("rows", k, where["rows", k]) for k in keys if ("rows", k) in where)
            self._plan = (count, rows, steps, arrays)
        return self._plan


def _parts(self: LogDict, children: Any, parts: tuple) -> dict[str, Any]:
    """The counts or row counts of an unflattened LogDict: each its leaf, or the array in
    its structure, broadcast over the leading axes its key's value gained since (a `vmap`,
    `scan` or `lax.map` around the spool), noted in `self._known`."""
    out = {}
    for part, key, at in parts:
        if isinstance(at, int):
            out[key] = children[at]
            continue
        x, ndim, value_at, data = at
        leaves = jtu.tree_leaves(children[value_at])
        shape = getattr(leaves[0], "shape", None) if leaves and ndim is not None else None
        if isinstance(shape, tuple) and len(shape) > ndim:
            lanes = shape[: len(shape) - ndim]
            if all(isinstance(d, int | np.integer) for d in lanes):  # (not `jax.export`'s)
                x = np.broadcast_to(x, lanes + x.shape)
        out[key] = x
        self._known[part, key] = (data, x)
    return out


# One LogDict may be read by several threads at once (a MultiLogger's writers, a user's thread
# beside a writer): it is unpacked by one of them.
_unpacking = threading.Lock()


def _unpack(self: LogDict) -> None:
    """Set the slots of a LogDict made by `tree_unflatten` from its leaves (once, whichever
    thread asks first)."""
    with _unpacking:
        try:
            packed = object.__getattribute__(self, "_packed")
        except AttributeError:  # another thread unpacked it meanwhile
            return
        _unpack_from(self, *packed)


def _unpack_from(self: LogDict, aux: "_Aux", children: Any) -> None:
    """`_unpack`'s work, under its lock."""
    keys, _, reductions, *_, nonfinite = aux.spec
    count, rows, steps, arrays = aux.plan()
    self._known = {}
    self._count = _parts(self, children, count)
    self._rows = _parts(self, children, rows)
    self._steps = {n: {k: children[i] for k, i in per_key} for n, per_key in steps}
    self._reductions = {k: r for k, r in zip(keys, reductions) if r is not None}
    self._nonfinite = None
    if arrays is not None:
        self._nonfinite = ({n: children[i] for n, i in arrays}, nonfinite[1])
    del self._packed  # the parts may change now: `tree_flatten` reads them


def _unpacked(method: Callable) -> Callable:
    """A dict method that changes a LogDict: its parts are unpacked first (`_unpack`)."""

    @functools.wraps(method)
    def changing(self, *args, **kwargs):
        try:
            object.__getattribute__(self, "_packed")
        except AttributeError:
            pass
        else:
            _unpack(self)
        return method(self, *args, **kwargs)

    return changing


for _name in (
    "__setitem__",
    "__delitem__",
    "__ior__",
    "clear",
    "pop",
    "popitem",
    "setdefault",
    "update",
):
    setattr(LogDict, _name, _unpacked(getattr(dict, _name)))


def _reports(arrays: dict[str, np.ndarray], tables: tuple) -> "NonfiniteEvent | None | list":
    """The report in `arrays`; per lane (a list) where a `vmap` outside the spool batched it."""
    if np.ndim(arrays["found"]):
        lanes = range(len(arrays["found"]))
        return [_reports({n: x[i] for n, x in arrays.items()}, tables) for i in lanes]
    keys, sites, step_names = tables
    if not bool(arrays["found"]):
        return None
    site = sites[int(arrays["site"])] if int(arrays["site"]) >= 0 else "a custom derivative rule"
    steps = {n: int(arrays[f"step:{n}"]) for n in step_names}
    key, operation = keys[int(arrays["key"])], None
    if is_checked(key):  # `first_nonfinite="any"`: the site lists the operations checked
        site, operation = operation_of(site, steps)
    return NonfiniteEvent(
        key=key,
        event=int(arrays["event"]),
        steps={n: v for n, v in steps.items() if v != -1},
        site=site,
        operation=operation,
        backward=bool(arrays["backward"]),
        iterations=tuple(int(i) for i in arrays["iterations"][: int(arrays["depth"])]),
        lane=int(arrays["lane"]) if int(arrays["lane"]) >= 0 else None,
        device=int(device) if (device := arrays.get("device", -1)) >= 0 else None,
    )


@dataclasses.dataclass(frozen=True)
class NonfiniteEvent:
    """The first event with a NaN or infinite element (`LogDict.first_nonfinite`).

    - `key`: its key;
    - `event`: its index among the key's events (those an `interval` skips counted);
    - `steps`: the step values logged with it (`{"step": 17}`);
    - `site`: the [`eqx_logs.log`][] call (file:line) that logged it;
    - `backward`: whether it was logged in the backward pass (`log_grad`, and
      `instrument(..., grads=True)`'s cotangent statistics);
    - `iterations`: the iteration each loop (`lax.scan`, `lax.while_loop`, `fori_loop`)
      around it inside the spool was in, outermost first, counted in execution order (a
      reversed scan's first iteration is 0): in a scan over training steps, the step;
    - `lane`: under a `jax.vmap` inside the spool, the first lane (flattened) that had one;
    - `device`: inside a `jax.shard_map` (or `jax.pmap`), the device it happened on: its
      index, row-major, over the manual mesh axes (of every shard_map around it, outermost
      first); the devices run at once, so of several that had one, the lowest-numbered.
      Its `event` is then its index among that device's events of the key;
    - `operation`: with `first_nonfinite="any"`, the operation whose output it was and its
      address (as [`eqx_logs.watch`][]'s: `"div at scan[0]/div[1]"`), or the function's
      input; its `site` is then your line that led there, and its `key` the key of the
      checks (`"first_nonfinite/checked"`, one event per straight run of checked operations).
    """

    key: str
    event: int
    steps: dict[str, int]
    site: str
    backward: bool
    iterations: tuple[int, ...] = ()
    lane: int | None = None
    operation: str | None = None
    device: int | None = None

    def __str__(self) -> str:
        if self.operation is not None:
            where = [f"the output of {self.operation}"]
        else:
            where = [f"event {self.event} of key {self.key!r}"]
        where += [f"{n}={v}" for n, v in self.steps.items()]
        if self.iterations:
            where.append(f"loop iteration {', '.join(map(str, self.iterations))}")
        if self.lane is not None:
            where.append(f"vmap lane {self.lane}")
        if self.device is not None:
            where.append(f"device {self.device}")
        return (
            f"first non-finite value: {', '.join(where)}; in the "
            f"{'backward' if self.backward else 'forward'} pass, "
            f"{'at' if self.operation is not None else 'logged at'} {self.site}"
        )


def _serialize_aux(aux: _Aux) -> bytes:
    return json.dumps(aux.spec).encode()


def _deserialize_aux(data: bytes) -> _Aux:
    keys, step_names, reductions, counted, row_keys, static, nonfinite = json.loads(data.decode())
    step_names = tuple((name, tuple(per_key)) for name, per_key in step_names)
    static = tuple(
        (part, key, tuple(shape), dtype, tuple(elements), ndim)
        for part, key, shape, dtype, elements, ndim in static
    )
    if nonfinite is not None:
        names, tables = nonfinite
        nonfinite = (tuple(names), tuple(tuple(t) for t in tables))
    keys, reductions, counted, row_keys = map(tuple, (keys, reductions, counted, row_keys))
    return _Aux((keys, step_names, reductions, counted, row_keys, static, nonfinite))


# `jax.export` of a spooled function: its outputs include a LogDict.
jax.export.register_pytree_node_serialization(
    LogDict,
    serialized_name="eqx_logs.LogDict",
    serialize_auxdata=_serialize_aux,
    deserialize_auxdata=_deserialize_aux,
)
