"""The policy's options, declared once: each option's name and type (`TapOptions`,
`PolicyOptions`), default and documentation (`OPTIONS`).

Everything else that takes them derives from here: `Policy` (its `__init__`, `replace` and
docstring), `spool`, `tap`, `AbstractLogger.spool`, `.tap` and `.jit` (their
`**options: Unpack[...]` and the option lists of their docstrings, filled in by
`document_options`), and the Hydra schema `eqx_logs.config.policy` (checked against `OPTIONS`
when `eqx_logs.config` is imported). A new option is added here, as a key of the
`TypedDict` and an entry of `OPTIONS`, and as a field of `Policy`.
"""

import inspect
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple, TypedDict, TypeVar

from jaxtyping import PRNGKeyArray

from .._spelling import closest
from ._reductions import AbstractReduction

_F = TypeVar("_F", bound=Callable)


class TapOptions(TypedDict, total=False):
    """The policy's options a tap uses (`eqx_logs.tap(fun, **options)`). None, like an option
    left out, keeps the policy's value."""

    interval: int | None
    tags: str | Iterable[str] | None
    exclude: str | Iterable[str] | None
    rules: Mapping[str, Any] | None
    prefix: str | None
    watch: Any


class PolicyOptions(TapOptions, total=False):
    """The policy's options (`eqx_logs.Policy(**options)`, `eqx_logs.spool(fun, **options)`):
    those of `TapOptions` and those that a spool alone uses, on the events it keeps."""

    reduce: str | AbstractReduction | None
    window: int | None
    key: PRNGKeyArray | None
    across: str | Iterable[str] | None
    first_nonfinite: bool | str | None


class Option(NamedTuple):
    """An option's default (`Policy`'s) and its entry in the docstrings' `**Arguments:**`."""

    default: Any
    doc: str


# In the order the docstrings list them.
OPTIONS: dict[str, Option] = {
    "reduce": Option(
        "stack",
        """the default reduction: a name (`"stack"`, `"mean"`, `"last"`, ...) or an
        [`eqx_logs.AbstractReduction`][] (`Stack(capacity=...)` for logs inside while loops).""",
    ),
    "interval": Option(
        1,
        """with `interval=k`, an event logged with a step (`log(..., step=i)`, or inside
        `scope(step=i)`) is kept where `i` is a multiple of k, whichever call it happens in
        (steps 0, k, 2k, ... across the calls of a per-step loop); an event without a step is
        numbered per key within each call (events 0, k, 2k, ... of the call are kept).""",
    ),
    "window": Option(
        None,
        """reduce each run of `window` events and stack the results: shorthand for
        `Window(window, reduce)` on every key.""",
    ),
    "tags": Option(
        None,
        """None keeps all events; otherwise only events carrying at least one of these tags.""",
    ),
    "exclude": Option((), """drop events carrying any of these tags."""),
    "rules": Option(
        None,
        """a dict from a key pattern (`fnmatch`, e.g. `"grad/*"`) to a reduction, or to
        `"drop"` to remove matching keys; the first matching pattern wins. In `fnmatch`, `[`
        starts a character class: for `instrument`'s keys (`"layers[0]/rms"`) write
        `"layers*/rms"`, or `"layers[[]0]/rms"` for a literal bracket. (A tap applies
        `"drop"` and ignores the reductions.)""",
    ),
    "prefix": Option("", """prepended to every output key."""),
    "watch": Option(
        None,
        """log values of code you did not write: the name of a primitive (`"cholesky"`) or loop
        kind (`"scan"`, `"while"`), a list of them, or an [`eqx_logs.Watch`][] (with `where`,
        `max_depth`, `stats`): every output of a watched primitive, and the carry of a watched
        loop at each iteration, is logged under `"watch/<address>"` (as
        [`eqx_logs.watch`][] does).""",
    ),
    "key": Option(None, """a `jax.random.key` for reductions that sample (`Sample`)."""),
    "across": Option(
        (),
        """names of manual mesh axes (`jax.shard_map`, `jax.pmap`) or of `jax.vmap` axes
        (its `axis_name`) inside the spool: the events each device (or lane) reduced on its
        own are merged over these axes, with each reduction's `merge`, in device order (a
        Stack holds device 0's events, then device 1's, ...). The key's output then has no
        axis for them. By default each device's result is kept, on its own axis after the
        event axis.""",
    ),
    "first_nonfinite": Option(
        False,
        """also find the first event, in execution order, whose value has a NaN or infinite
        element: `logs.first_nonfinite` names its key, event, steps, call site and pass
        (forward or backward). Every kept key's events are checked, those an `interval`
        skips included. `"any"` also checks the output of every operation that can make a
        NaN or an infinity of finite inputs, in code you did not write (a division, an
        `exp`, a matmul that overflows; forward and, in a derivative the spool contains,
        backward) and the function's inputs: the report names the operation, its
        address (as [`eqx_logs.watch`][]'s) and your line that led there.""",
    ),
}

DEFAULTS: dict[str, Any] = {name: option.default for name, option in OPTIONS.items()}
TAP_OPTIONS: tuple[str, ...] = tuple(n for n in OPTIONS if n in TapOptions.__optional_keys__)

if set(OPTIONS) != PolicyOptions.__optional_keys__:  # (a new option declared in one only)
    raise AssertionError("PolicyOptions and OPTIONS declare different options.")


def check_options(
    where: str, options: Mapping[str, Any], allowed: Iterable[str] = OPTIONS, also=()
) -> None:
    """A `TypeError` for a keyword of `options` that is not `allowed`, naming it and the
    closest name among `allowed` and `also` (`where`'s other keywords)."""
    allowed = tuple(allowed)
    for name in options:
        if name not in allowed:
            near = closest(name, (*allowed, *also))
            hint = f" Did you mean {near!r}?" if near else ""
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}.{hint}")


_MARKER = re.compile(r"^( *)\{(policy|tap)_options\}\n", re.M)


def options_doc(names: Iterable[str], indent: str = "") -> str:
    """The `**Arguments:**` entries of the options `names`, as Markdown list items."""
    lines = []
    for name in names:
        default = f"default `{OPTIONS[name].default!r}`"
        text = inspect.cleandoc(f"- `{name}` ({default}): " + OPTIONS[name].doc)
        first, *rest = text.splitlines()
        lines += [indent + first] + [indent + "    " + line for line in rest]
    return "".join(line + "\n" for line in lines)


def document_options(obj: _F) -> _F:
    """Fill `obj`'s docstring in: a line `{policy_options}` (or `{tap_options}`) becomes the
    entries of every option (or of those a tap uses), at its indentation."""

    def entries(m: re.Match) -> str:
        return options_doc(OPTIONS if m[2] == "policy" else TAP_OPTIONS, m[1])

    obj.__doc__ = _MARKER.sub(entries, obj.__doc__)
    return obj
