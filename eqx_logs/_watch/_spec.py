"""`Watch`: what `watch` (and the `watch=` option) logs of code the user did not write."""

import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx

from .._checks import DEFAULT_STATS, check_stats

WATCH_TAG = "watch"  # on every event `watch` logs
# `first_nonfinite="any"`: the key of its checks, and the step that says which check of an
# event failed first (its site lists them)
CHECKED = "first_nonfinite/checked"
OPERATION = "operation"
# the tag of those checks: the spool's own bookkeeping, selected by a policy with
# `first_nonfinite` whatever its `tags` and `exclude` (`Policy.selects`), by no other
CHECK_TAG = "eqx_logs.first_nonfinite"


@functools.cache
def _pattern(where: str) -> "re.Pattern[str]":
    """A key pattern as `instrument(where=...)` reads one: `*` any characters, `?` one,
    everything else itself (brackets included: addresses read `while[0]`)."""
    return re.compile(".*".join(".".join(map(re.escape, p.split("?"))) for p in where.split("*")))


class Watch(eqx.Module):
    """What [`eqx_logs.watch`][] (or the `watch=` option of a spool, tap or logger) watches.

    **Arguments:**

    - `*names`: primitives (`"cholesky"`, `"dot_general"`, `"custom_linear_solve"`, ...),
        whose every output is logged, and loop kinds (`"scan"`, `"while"`), whose carry is
        logged at the end of each iteration. Calls (`jax.jit`, `jax.checkpoint`, custom
        derivatives) are looked through, not watched: a jitted function's name is none of
        these (`jnp.linalg.cholesky` is a jit named `cholesky` around the `cholesky`
        primitive, whose output `"cholesky"` watches).
    - `where`: only the addresses this matches: a pattern on the key (`"watch/while[*]/*"`;
        `*` matches any characters, brackets are literal) or a function from key to bool.
    - `max_depth`: only what lies inside at most this many loops, branches and shard_maps
        (0: the program's top level; calls are transparent).
    - `stats`: the statistics logged of each watched array with more than one element
        (scalars are logged as they are), as for [`eqx_logs.instrument`][]; None logs whole
        values (then the policy's reduction applies to them).
    - `grads`: also log the statistics (or values) of each watched value's cotangent in the
        backward pass, under `"<key>/grad"` (for `spool(jax.grad(watch(f, ...)))`).
    - `backward`: also watch the equations of a backward pass that the program computes
        itself (`spool(jax.grad(f), watch=...)` watches the forward pass only by default).
    """

    names: tuple[str, ...] = eqx.field(static=True)
    where: str | Callable[[str], bool] | None = eqx.field(static=True)
    max_depth: int | None = eqx.field(static=True)
    stats: tuple[str, ...] | None = eqx.field(static=True)
    grads: bool = eqx.field(static=True)
    backward: bool = eqx.field(static=True)

    def __init__(
        self,
        *names: str,
        where: str | Callable[[str], bool] | None = None,
        max_depth: int | None = None,
        stats: Sequence[str] | None = DEFAULT_STATS,
        grads: bool = False,
        backward: bool = False,
    ):
        if len(names) == 1 and isinstance(names[0], (list, tuple)):
            names = tuple(names[0])  # (a list of names)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise TypeError(
                "eqx_logs.Watch takes the names of primitives or loop kinds ('scan', "
                f"'while') to watch, as strings; got {names!r}."
            )
        self.names = tuple(dict.fromkeys(names))
        self.where = where
        self.max_depth = max_depth
        self.stats = None if stats is None else check_stats(stats, where="eqx_logs.Watch")
        self.grads = grads
        self.backward = backward

    def __check_init__(self):
        if not (self.where is None or isinstance(self.where, str) or callable(self.where)):
            raise TypeError(
                "eqx_logs.Watch(where=...) takes a key pattern (`*` matching any characters) "
                f"or a function from key to bool; got {self.where!r}."
            )
        depth = self.max_depth
        if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int)):
            raise TypeError(f"eqx_logs.Watch(max_depth={depth!r}): expected an int or None.")
        if depth is not None and depth < 0:
            raise ValueError(f"eqx_logs.Watch(max_depth={depth}): must be at least 0.")
        for name in ("grads", "backward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"eqx_logs.Watch({name}=...): expected True or False.")

    def selects(self, key: str, depth: int) -> bool:
        """Whether the value at `key` (`"watch/..."`), `depth` boundaries deep, is logged."""
        if self.max_depth is not None and depth > self.max_depth:
            return False
        if self.where is None:
            return True
        if isinstance(self.where, str):
            return _pattern(self.where).fullmatch(key) is not None
        return bool(self.where(key))


def as_watch(value: Any, where: str) -> Watch | None:
    """A `Watch` from an option's value: None, a name, a list of names, a `Watch`, or a dict
    of `Watch`'s arguments with the names under `names` (a Hydra config's form)."""
    if value is None or isinstance(value, Watch):
        return value
    if isinstance(value, Mapping):
        options = dict(value)
        names = options.pop("names", ())
        return Watch(*([names] if isinstance(names, str) else names), **options)
    if isinstance(value, str):
        return Watch(value)
    try:
        names = tuple(value)
    except TypeError:
        names = None
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{where}(watch={value!r}): expected the name of a primitive or loop kind, a list "
            "of them, or an eqx_logs.Watch."
        )
    return Watch(*names)


def operation_of(site: str, steps: dict[str, int]) -> tuple[str, str]:
    """`(site, operation)` of the failing check of an event of `CHECKED` (its `site` and
    `steps`, `OPERATION` removed from them)."""
    return tuple(json.loads(site)[steps.pop(OPERATION)])


def checked_key(mesh: tuple[str, ...]) -> str:
    """The key of the checks of `first_nonfinite="any"` made inside shard_maps over the
    manual mesh axes `mesh` (outermost first): `CHECKED` outside any, else `CHECKED@a,b`
    (a key is logged under one set of mesh axes)."""
    return f"{CHECKED}@{','.join(mesh)}" if mesh else CHECKED


def lanes_key(key: str, lanes: int) -> str:
    """`checked_key`'s key for the checks of values batched in `lanes` lanes by a vmap inside
    the spool (one event per lane)."""
    return f"{key}#{lanes}"


def is_checked(key: str) -> bool:
    """Whether `key` is one of `checked_key`'s (or `lanes_key`'s)."""
    return key == CHECKED or key.startswith((f"{CHECKED}@", f"{CHECKED}#"))


def checked_names(names: Any, keys: Any) -> list[str]:
    """Those of `names` (a LogDict's, each a key behind the policy's `prefix`) that are the
    checks' keys among `keys` (the keys of its `first_nonfinite` report, without the prefix):
    the spool's bookkeeping, which no logger writes."""
    ends = [k for k in keys if is_checked(k)]
    return [n for n in names if any(n.endswith(k) for k in ends)]
