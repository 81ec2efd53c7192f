"""Policy: which events a spool keeps and how each key is reduced."""

import fnmatch
import functools
import zlib
from collections.abc import Mapping
from typing import Any, Unpack

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from .._checks import check_count
from .._spelling import closest
from .._watch import CHECK_TAG, Watch, as_watch, is_checked
from ._composites import Window
from ._names import DROP, as_reduction
from ._options import DEFAULTS, OPTIONS, PolicyOptions, check_options, document_options
from ._reductions import AbstractReduction


def _strings(name: str, value: Any, *, optional: bool) -> tuple[str, ...] | None:
    if value is None and optional:
        return None
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    try:
        value = tuple(value)  # OmegaConf ListConfig, lists, tuples
    except TypeError:
        raise TypeError(f"Policy({name}={value!r}): expected a list of strings.") from None
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"Policy({name}={value!r}): expected a list of strings.")
    return value


def _stable_hash(name: str) -> int:
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


@document_options
class Policy(eqx.Module):
    """Which events a spool keeps and how it reduces each key, on the accelerator.

    **Arguments:** keywords only, each optional.

    {policy_options}

    Precedence for a key's reduction: a matching rule, then the reduction named at the
    `log(..., reduce=...)` call site, then `reduce`.

    !!! example

        ```python
        policy = eqx_logs.Policy(reduce="mean", interval=10, rules={"grad/*": "max"})
        out, logs = eqx_logs.spool(f, policy=policy)(x)
        ```
    """

    reduce: AbstractReduction
    interval: int = eqx.field(static=True)
    window: int | None = eqx.field(static=True)
    tags: tuple[str, ...] | None = eqx.field(static=True)
    exclude: tuple[str, ...] = eqx.field(static=True)
    rules: tuple[tuple[str, Any], ...]
    prefix: str = eqx.field(static=True)
    watch: Watch | None = eqx.field(static=True)
    key: PRNGKeyArray | None
    across: tuple[str, ...] = eqx.field(static=True)
    first_nonfinite: bool | str = eqx.field(static=True)

    def __init__(self, **options: Unpack[PolicyOptions]):
        check_options("eqx_logs.Policy", options)
        values = {**DEFAULTS, **options}
        reduce, rules = values["reduce"], values["rules"]
        self.reduce = as_reduction(reduce, where="Policy(reduce)")
        self.interval = values["interval"]
        self.window = values["window"]
        self.tags = _strings("tags", values["tags"], optional=True)
        self.exclude = _strings("exclude", values["exclude"], optional=False)
        if rules is None:
            rules = {}
        if not isinstance(rules, Mapping):
            raise TypeError(
                f"Policy(rules={rules!r}): expected a dict from key pattern to reduction."
            )
        self.rules = tuple(
            (pattern, as_reduction(r, allow_drop=True, where=f"Policy(rules[{pattern!r}])"))
            for pattern, r in rules.items()
        )
        self.prefix = values["prefix"]
        self.watch = as_watch(values["watch"], "eqx_logs.Policy")
        self.key = values["key"]
        self.across = _strings("across", values["across"], optional=False)
        self.first_nonfinite = values["first_nonfinite"]

    def __check_init__(self):
        check_count("Policy", "interval", self.interval)
        check_count("Policy", "window", self.window, optional=True)
        if not isinstance(self.prefix, str):
            raise TypeError(f"Policy(prefix={self.prefix!r}): prefix must be a string.")
        if not (isinstance(self.first_nonfinite, bool) or self.first_nonfinite == "any"):
            raise TypeError(
                f'Policy(first_nonfinite={self.first_nonfinite!r}): expected True, False or "any".'
            )
        for pattern, _ in self.rules:
            if not isinstance(pattern, str):
                raise TypeError(f"Policy(rules): patterns must be strings, got {pattern!r}.")

    def replace(self, **changes: Unpack[PolicyOptions]) -> "Policy":
        """A copy with some options changed (None leaves an option as it is)."""
        check_options("eqx_logs.Policy.replace", changes)
        changes = {k: v for k, v in changes.items() if v is not None}
        return Policy(**{**_options(self), **changes})

    def selects(self, tags: tuple[str, ...]) -> bool:
        """Whether an event with these tags is kept. The checks of `first_nonfinite="any"`
        (`CHECK_TAG`) are the search's own, not the user's events: kept where the policy
        searches, whatever `tags` and `exclude` say, and by no other."""
        if CHECK_TAG in tags:
            return bool(self.first_nonfinite)
        if self.tags is not None and not set(tags) & set(self.tags):
            return False
        return not set(tags) & set(self.exclude)

    def reduction(self, key: str, site_reduce: Any = None) -> Any:
        """The reduction for `key` (or `"drop"`), given the one named at its call sites.
        (The checks of `first_nonfinite="any"` keep theirs: `rules`, `window` and `key` are
        for the user's keys.)"""
        if is_checked(key):
            return self.reduce if site_reduce is None else as_reduction(site_reduce)
        for pattern, reduction in self.rules:
            if fnmatch.fnmatchcase(key, pattern):
                break
        else:
            reduction = self.reduce if site_reduce is None else as_reduction(site_reduce)
        if isinstance(reduction, str):  # DROP
            return DROP
        if self.window is not None:
            reduction = Window(self.window, reduction)
        if self.key is not None:
            reduction = reduction.with_key(jax.random.fold_in(self.key, _stable_hash(key)))
        return reduction


def with_options(policy: Any, where: str, **options: Unpack[PolicyOptions]) -> Policy:
    """`policy` (default `Policy()`) with the options that are not None; `where` names the
    caller in the error for anything that is not a Policy."""
    if policy is None:
        policy = _default_policy()
    elif not isinstance(policy, Policy):
        raise TypeError(f"{where}(policy=...) takes an eqx_logs.Policy, got {policy!r}.")
    if all(v is None for v in options.values()):
        return policy  # `spool(f)` in a loop: building a Policy costs more than the call
    _check_reductions(where, options)
    return policy.replace(**options)


def _check_reductions(where: str, options: Mapping[str, Any]) -> None:
    """`as_reduction`'s errors for the reductions among `options`, naming `where`'s option
    (`eqx_logs.spool(reduce)=eqx_logs.Mean ...`) rather than the Policy it makes."""
    if options.get("reduce") is not None:
        as_reduction(options["reduce"], where=f"{where}(reduce)")
    if isinstance(options.get("rules"), Mapping):
        for pattern, r in options["rules"].items():
            as_reduction(r, allow_drop=True, where=f"{where}(rules[{pattern!r}])")


def _options(policy: Policy) -> dict[str, Any]:
    """The options that make `policy` again: `Policy(**_options(policy))`."""
    return {**{name: getattr(policy, name) for name in OPTIONS}, "rules": dict(policy.rules)}


def without_watch(policy: Policy) -> Policy:
    """`policy` without its `watch` option (applied to the function by the caller instead)."""
    return Policy(**{**_options(policy), "watch": None})


def unmatched(
    policy: Policy, who: str, tags: set[str], keys: set[str], selected: bool
) -> list[str]:
    """After tracing: what in `policy` most likely holds a typo, given the `tags` the events
    traced carry and the `keys` kept (`selected`: whether any event was).

    - `tags` that selected none of the events: said with the tags logged.
    - A `tags` or `exclude` tag or a `rules` pattern that matches nothing while a tag or key
        close to it (`_spelling.closest`: by case, one edit, two letters swapped) was logged:
        said with that tag or key. One that matches
        nothing and resembles nothing stays silent, as a shared configuration excluding a
        tag the program does not log (Hydra's `exclude: [debug]`) is correct.
    """
    found = []
    seen = sorted(tags)
    if policy.tags is not None:
        typos = [(t, near) for t in policy.tags if t not in tags and (near := closest(t, seen))]
        meant = "".join(f" Did you mean {near!r} for {t!r}?" for t, near in typos)
        if not selected:
            found.append(
                f"{who}(tags={policy.tags!r}) selected none of the events traced; the tags "
                f"logged are {seen if seen else 'none (every log is untagged)'}.{meant} Events "
                "a spool or tap does not select pass to an enclosing one, or are dropped."
            )
        elif typos:
            found.append(
                f"{who}(tags={policy.tags!r}): no event traced carries "
                f"{', '.join(repr(t) for t, _ in typos)}.{meant} The tags logged are {seen}."
            )
    for tag in policy.exclude:
        if tag not in tags and (near := closest(tag, seen)):
            found.append(
                f"{who}(exclude={tag!r}): no event traced carries that tag; did you mean "
                f"{near!r}? The tags logged are {seen}."
            )
    for pattern, _ in policy.rules:
        if any(fnmatch.fnmatchcase(k, pattern) for k in keys):
            continue
        if any(fnmatch.fnmatchcase(k, pattern + "/*") for k in keys):
            near = pattern + "/*"  # `"grad"` for the keys under `grad/`
        else:
            near = closest(pattern, sorted(keys), fnmatch.translate)
        if near:
            found.append(
                f"{who}(rules={{{pattern!r}: ...}}): the pattern matches none of the keys "
                f"kept; did you mean {near!r}? Patterns are `fnmatch` patterns matched case by "
                "case against whole keys (`'grad/*'`)."
            )
    return found


@functools.cache
def _default_policy() -> Policy:
    return Policy()  # immutable, so one is shared
