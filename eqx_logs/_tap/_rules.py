"""tap's rules, made once: the interpreter's table (`eqx_logs/_rules/`) with what a tap does
differently.

- A remat (`recomputed`) is evaluated again in the backward pass, callbacks included: like a
  custom derivative, its outputs come from the call with its logs stripped, its events from an
  inline copy (`inline_copy_apply`).
- Rules that evaluate their jaxpr inline (`straight`) are kept: known counters stay known.
- Every other rule gets the counters as arrays (`Tap.threadable`); a scan is first offered to
  `Tap.split_scan`, which may split it at trace time (`_split.py`).
- A shard_map needs every mesh axis manual (`_shard_map_apply`).
"""

from typing import Any

from .. import _compat
from .._rules import RULES, Rule, inline_copy_apply


def _shard_map_apply(interp, eqn, invals, states):
    """spool's rule: each device calls back with its own events (a callback in a shard_map
    runs on every device), its mesh coordinates among the steps, its own counters (scalars
    inside, see `on_device`/`device_states`), so `interval` counts each device's events. The
    callback needs every mesh axis manual."""
    _, mesh, _, _, axes, _ = _compat.shard_map_parts(eqn)
    if set(axes) != set(mesh.axis_names):
        raise ValueError(
            f"eqx_logs.tap: a shard_map over only some of its mesh's axes (manual {axes}, "
            f"mesh {mesh.axis_names}) logs; tap needs every axis manual there (the callback "
            "runs on each device). Use `eqx_logs.spool`, or make every axis manual."
        )
    return RULES[_compat.SHARD_MAP].apply(interp, eqn, invals, states)


def _threaded(rule: Rule) -> Rule:
    """`rule`, given the counters as arrays; a scan split at trace time where it can be."""

    def apply(interp: Any, eqn: Any, invals: list[Any], states: dict[str, Any]) -> Any:
        tap = interp.handler
        if rule.scan:
            split = tap.split_scan(eqn, invals, states)
            if split is not None:
                return split
        return rule.apply(interp, eqn, invals, tap.threadable(states))

    return rule._replace(apply=apply)


def tap_rule(rule: Rule) -> Rule:
    """The rule a tap evaluates an equation with, from the table's `rule` (see above)."""
    if rule.recomputed:
        return rule._replace(apply=inline_copy_apply)
    if rule.straight:
        return rule
    return _threaded(rule)


_SHARD_MAP = RULES[_compat.SHARD_MAP]._replace(apply=_shard_map_apply)
TAP_RULES: dict[str, Rule] = {
    name: tap_rule(rule) for name, rule in {**RULES, _compat.SHARD_MAP: _SHARD_MAP}.items()
}
