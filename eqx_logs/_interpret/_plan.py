"""The plan: what a jaxpr holds, found by walks over it before anything is evaluated.

`Plan.program` walks the whole program twice: first to collect every log's sites of each key
(`_keys.sites_of`), which are then merged once per key into its frozen `KeyInfo`
(`_keys.merge`: the layout of its events, checking that its sites agree); then `Plan.count`
finds, for every key, the static upper bound on its number of events (a scan multiplies, a
cond takes the maximum over branches, a while loop is unbounded). `has_log` says whether a
jaxpr logs at all. Every answer is cached per jaxpr (by id, holding the jaxpr so that the id
stays unique), and the policy's answers per tag and key.
"""

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .. import _compat
from .._primitive import current_prefix, is_log, is_sow, log_effect, logging_as
from .._reduce import Policy
from . import _keys
from ._keys import KeyInfo, site_list
from ._manual import ManualAxes

if TYPE_CHECKING:
    from .._rules import Rule

Counts = dict[str, int | None]  # key -> static bound on its events (None: unbounded)


class UnhandledPrimitiveError(NotImplementedError):
    pass


# What the user wrote, for primitives that arrive under another name.
_WRITTEN_AS = {
    "shard_map": "`jax.shard_map` or `jax.pmap` (the primitive 'shard_map')",
    "xla_pmap": "`jax.pmap` (the primitive 'xla_pmap')",
}


# Hi primitives that hold user functions (other than `lax.custom_root`'s) come from options.
_HI_HINT = (
    " JAX's options `jax_scan3`, `jax_remat3`, `jax_custom_jvp3` and `jax_custom_vjp3` turn "
    "`lax.scan`, `jax.checkpoint`, `jax.custom_jvp` and `jax.custom_vjp` into hi primitives, "
    "as `defvjp(..., generic_batching=True)` does a custom_vjp; without them (the default), "
    "logs inside are captured."
)


def _log_sites(eqn: _compat.JaxprEqn) -> list[str]:
    """The call sites of the logs inside `eqn`, however deeply nested."""
    subs = _compat.sub_jaxprs(eqn.params)
    return [e.params["site"] for sub in subs for e in _compat.eqns(sub) if is_log(e)]


def _add(a: Counts, b: Counts, scale: int = 1) -> Counts:
    out = dict(a)
    for k, n in b.items():
        n = None if n is None else n * scale
        out[k] = None if n is None or out.get(k, 0) is None else out.get(k, 0) + n
    return out


def max_counts(many: Sequence[Counts]) -> Counts:
    out: Counts = {}
    for counts in many:
        for k, n in counts.items():
            out[k] = None if n is None or out.get(k, 0) is None else max(out.get(k, 0), n)
    return out


def _exclusive(logs: list[tuple[tuple[tuple[int, int], ...], Counts]], depth: int) -> Counts:
    """The bound on the events of logs in branches of batched conds (`log_p`'s `branches`,
    pairs `(cond, branch)`), all sharing their first `depth` pairs: a lane takes one branch of
    a cond, so each cond adds the maximum over its branches (each branch's logs grouped the
    same way by their next pair); logs with no more pairs add their own. Max is only taken
    between different branches of one cond, everything else is summed: whatever order the
    pairs come in, the bound holds for every lane."""
    total: Counts = {}
    conds: dict[int, dict[int, list[Any]]] = {}
    for branches, counts in logs:
        if len(branches) == depth:
            total = _add(total, counts)
        else:
            cond, i = branches[depth]
            conds.setdefault(cond, {}).setdefault(i, []).append((branches, counts))
    for by_branch in conds.values():
        total = _add(total, max_counts([_exclusive(b, depth + 1) for b in by_branch.values()]))
    return total


def unbounded(counts: Counts) -> Counts:
    return {k: None for k in counts}


class Plan:
    """The static answers about the jaxprs one interpreter evaluates: per key, its `KeyInfo`
    (`info`) and bound on events (`count`); per jaxpr, whether it logs (`has_log`). Rules'
    `count` functions answer for their primitives (with `plan.count` for their jaxprs)."""

    def __init__(
        self,
        policy: Policy,
        rules: "dict[str, Rule]",
        reduction: Callable[[str, Any], Any],
        selects: Callable[[tuple[str, ...]], bool],
        manual: ManualAxes,
        name: str,
    ):
        self.name = name  # the handler's, in errors
        self._selects = selects  # tags -> whether the handler takes their events
        self.manual = manual  # the manual mesh axes around what is counted (`_manual.py`)
        self.policy = policy
        self.rules = rules
        self._reduction = reduction  # (key, site_reduce) -> its reduction, or "drop"
        self.sites: dict[str, list[_keys.Site]] = {}  # each key's sites, as collected
        self.info: dict[str, KeyInfo] = {}  # each key's record, once `program` froze them
        self.frozen = False
        # the log equations of each key, by id (`_recorded` keeps the ids unique)
        self.eqns_of: dict[str, set[int]] = {}
        self._recorded: dict[int, Any] = {}
        self._counts: dict[int, tuple[Any, Counts]] = {}
        self._has_log: dict[int, tuple[Any, bool]] = {}
        self._iterated: dict[int, tuple[Any, bool]] = {}  # `fills_iteration`
        self._bodies: dict[tuple[int, str, bool], tuple[Any, Any]] = {}  # `opaque_body`
        self._recomputing = False  # inside a remat's recomputation (`recomputing`)
        self._outer: list[Any] = []  # the equations around the one being counted
        self.selected: dict[tuple[str, ...], bool] = {}  # `selects`, by tags
        self.reductions_of: dict[tuple[str, Any], Any] = {}  # `reduction_of`
        self.iteration_events: dict[str, int] = {}  # key -> most events in one loop iteration

    def selects(self, tags: tuple[str, ...]) -> bool:
        """The handler's `selects(tags)`, cached: called for every log equation."""
        hit = self.selected.get(tags)
        if hit is None:
            hit = self.selected[tags] = self._selects(tags)
        return hit

    def reduction_of(self, key: str, site_reduce: Any = None) -> Any:
        """The reduction of `key` (`Policy.reduction`, unless the handler says otherwise),
        cached."""
        hit = self.reductions_of.get((key, site_reduce))
        if hit is None:
            hit = self.reductions_of[(key, site_reduce)] = self._reduction(key, site_reduce)
        return hit

    def dropped(self, key: str) -> bool:
        return isinstance(self.reduction_of(key), str)

    def has_log(self, closed: Any) -> bool:
        hit = self._has_log.get(id(closed))
        if hit is None:
            top = _compat.eqns(closed, deep=False)
            found = any(is_log(e) or self.eqn_has_log(e) for e in top)
            hit = self._has_log[id(closed)] = (closed, found)
        return hit[1]

    def fills_iteration(self, closed: Any) -> bool:
        """Whether `closed` (at any depth) holds JAX's backward-pass logs, whose step is the
        index of the scan iteration around them (`_primitive.bind_backward_logs`)."""
        hit = self._iterated.get(id(closed))
        if hit is None:
            found = _compat.any_eqn(closed, lambda e: is_log(e) and "iteration" in e.params)
            hit = self._iterated[id(closed)] = (closed, found)
        return hit[1]

    def eqn_has_log(self, eqn: _compat.JaxprEqn) -> bool:
        if log_effect in eqn.effects:
            return True
        hit = self._has_log.get(id(eqn))  # (logs where the effect is not declared: custom rules)
        if hit is None:
            found = any(self.has_log(sub) for sub in _compat.sub_jaxprs(eqn.params))
            body = self.opaque_body(eqn)
            found = found or (body is not None and self.has_log(body))
            hit = self._has_log[id(eqn)] = (eqn, found)
        return hit[1]

    def opaque_body(self, eqn: _compat.JaxprEqn) -> Any:
        """For a primitive Equinox defined (`_compat.equinox_impl`: lineax's `linear_solve`),
        its implementation traced as JAX lowers it, with logging on: its logs may sit in a
        Python function among its parameters (a linear operator's `mv`), in no jaxpr. None
        for other primitives."""
        impl = _compat.equinox_impl(eqn)
        if impl is None:
            return None
        # A recomputation of the forward pass (a remat's for the backward pass, `noinline`'s
        # JVP and transpose) has no events of its own: they are the primal pass's.
        enabled = not (self._recomputing or _compat.derivative_noinline(eqn))
        prefix = current_prefix()
        hit = self._bodies.get((id(eqn), prefix, enabled))
        if hit is None:
            try:
                with logging_as(prefix, enabled=enabled):
                    body = _compat.trace_on_avals(impl, [v.aval for v in eqn.invars])
            except Exception:  # noqa: BLE001 (then as any primitive: logs found in its
                body = None  # jaxprs raise `unhandled`, and it is bound as it is otherwise)
            hit = self._bodies[(id(eqn), prefix, enabled)] = (eqn, body)
        return hit[1]

    @contextlib.contextmanager
    def recomputing(self, on: bool):
        """Within: a remat's recomputation of the forward pass if `on` (see `opaque_body`)."""
        before, self._recomputing = self._recomputing, self._recomputing or on
        try:
            yield
        finally:
            self._recomputing = before

    def count(self, closed: Any) -> Counts:
        """Static bound on the number of selected events per key in `closed`."""
        hit = self._counts.get(id(closed))
        if hit is not None:
            return hit[1]
        # each log and each loop or call with logs: the batched-cond branches it is in, and
        # its counts (`_exclusive` adds them up)
        parts: list[tuple[tuple[tuple[int, int], ...], Counts]] = []
        for eqn, logs in self.logging(closed):
            if logs:
                keys = self._record(eqn)
                counts = {k: self.events_per_log(eqn, k) for k in keys}
                parts.append((eqn.params["branches"], counts))
            else:
                self._outer.append(eqn)  # (for the location of an error inside it)
                try:
                    parts.append((self._branches(eqn), self.rule(eqn).count(self, eqn)))
                finally:
                    self._outer.pop()
        total = _exclusive(parts, 0)
        self._counts[id(closed)] = (closed, total)
        return total

    def logging(self, closed: Any) -> Iterator[tuple[_compat.JaxprEqn, bool]]:
        """The equations at the top level of `closed` that the plan's visitors look at (its
        count, spool's streaming, tap's splitters), in program order: each log the policy
        selects, with True; each equation that holds logs (a loop, a call: its rule answers
        for what is inside), with False."""
        for eqn in _compat.eqns(closed, deep=False):
            if is_log(eqn):
                if self.selects(eqn.params["tags"]):
                    yield eqn, True
            elif self.eqn_has_log(eqn) and not is_sow(eqn):  # (a sow's derivative: no logs)
                yield eqn, False

    def program(self, closed: Any) -> Counts:
        """`count` of the whole program `closed`, its keys' records frozen: a first walk
        collects the sites of every log (`_keys.sites_of`), each key's sites are merged once
        with all of them in hand (`_keys.merge`), and a second walk counts from the frozen
        records. A jaxpr counted later (a custom derivative rule JAX traces when it
        differentiates) is checked against them, never merged into them."""
        self.count(closed)
        across = self.policy.across
        self.info.update(
            {key: _keys.merge(key, sites, across) for key, sites in self.sites.items()}
        )
        self.frozen = True
        self._counts.clear()  # (counted before the layouts were known)
        self.iteration_events.clear()
        return self.count(closed)

    def _record(self, eqn: _compat.JaxprEqn) -> list[str]:
        """The keys of the log equation `eqn`: its sites collected before the records are
        frozen, checked against them after."""
        if id(eqn) in self._recorded:  # (the second walk: known, no site made again)
            return _keys.keys_of(eqn)
        manual = self.manual
        sites = _keys.sites_of(eqn, manual.axes, manual.mesh)
        if self.frozen:
            across = self.policy.across
            for key, site in sites.items():
                if key in self.info:  # (other keys pass on, see `Spool.event`)
                    _keys.check_late(key, self.info[key], self.sites[key], site, across)
            return list(sites)
        self._recorded[id(eqn)] = eqn
        for key, site in sites.items():
            self.sites.setdefault(key, []).append(site)
            self.eqns_of.setdefault(key, set()).add(id(eqn))
        return list(sites)

    def events_per_log(self, eqn: _compat.JaxprEqn, key: str) -> int:
        """Events one execution of the log equation `eqn` makes for `key` (one until the
        records are frozen: the first walk only collects)."""
        if key not in self.info:
            return 1
        return _keys.events_per_log(self.info, eqn, key)

    def _branches(self, eqn: _compat.JaxprEqn) -> tuple[tuple[int, int], ...]:
        """The batched-cond branches (`log_p`'s `branches`) that every log inside `eqn` (a
        loop, a call) is in: its events are those branches' too."""
        common = None
        for sub in _compat.sub_jaxprs(eqn.params):
            for inner in _compat.eqns(sub, deep=False):
                if is_log(inner):
                    pairs = set(inner.params["branches"])
                elif self.eqn_has_log(inner):
                    pairs = set(self._branches(inner))
                else:
                    continue
                common = pairs if common is None else common & pairs
                if not common:
                    return ()  # (as for any loop or call outside batched conds: at once)
        return tuple(sorted(common or ()))

    def note_iteration(self, counts: Counts) -> None:
        """Record the events per key of one iteration of a loop body (`_scan_count`)."""
        for key, n in counts.items():
            if n is not None:
                self.iteration_events[key] = max(self.iteration_events.get(key, 0), n)

    def rule(self, eqn: _compat.JaxprEqn) -> "Rule":
        rule = self.rules.get(eqn.primitive.name)
        if rule is None:
            self.unhandled(eqn)
        return rule

    def unhandled(self, eqn: _compat.JaxprEqn) -> None:
        """Raise the error for a primitive that holds logs and has no rule."""
        name, hi = eqn.primitive.name, _compat.hi_name(eqn)
        what = _WRITTEN_AS.get(name, f"the primitive {name!r}")
        if hi is not None:
            what = f"JAX's hi primitive {hi!r} (a {name!r})"
        sites = _log_sites(eqn)
        raise UnhandledPrimitiveError(
            f"eqx_logs: {what} (at {_compat.eqn_location(eqn, self._outer)}) contains logs"
            f"{f' (at {site_list(sites)})' if sites else ''}, but {self.name} has no "
            "rule for it yet, so its events cannot be captured and would be lost. Move the logs "
            f"out of it, or wrap the code in `eqx_logs.nolog`."
            f"{_HI_HINT if hi is not None else ''} Supported: {sorted(self.rules)}."
        )
