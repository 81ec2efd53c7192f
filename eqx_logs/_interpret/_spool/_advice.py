"""Advice after a run: what in the policy most likely holds a typo, and step-less keys that
`interval` numbers per call (warned at the user's call)."""

from ..._reduce import Policy, unmatched
from ..._scope import INTERVAL_STEP
from ..._warn import warn_user
from ..._watch import CHECK_TAG, is_checked
from .._keys import site_list
from .._plan import Plan
from ._store import Store


def warn_unmatched(plan: Plan, who: str, store: Store | None = None) -> None:
    """After a run: warn (at the user's call) for what in the policy most likely holds a
    typo: `tags` that selected nothing, an `exclude` tag or `rules` pattern that matches
    nothing but resembles a tag or key logged (`_reduce.unmatched`); with spool's `store`,
    for step-less keys that `interval` numbers per call (`_stepless`). The checks of
    `first_nonfinite="any"` are the spool's own: not the user's tags or keys, never said."""
    policy = plan.policy
    users = {ts: kept for ts, kept in plan.selected.items() if CHECK_TAG not in ts}
    if not isinstance(policy, Policy) or not users:
        return
    tags = {t for ts in users for t in ts}
    keys = {key for key, _ in plan.reductions_of if not is_checked(key)}
    selected = any(users.values())
    for message in unmatched(policy, who, tags, keys, selected):
        warn_user(message)
    if store is not None and (message := _stepless(store, policy, who)):
        warn_user(message)


def _stepless(store: Store, policy: Policy, who: str) -> str | None:
    """With `interval=k`, keys kept by their `step` beside keys without one, whose events
    per call are not a multiple of k: those are numbered within each call, so in a loop
    calling the spool once per step, each call keeps its first (a step-less key follows
    no step). Say so, naming each such key's `log` lines (the warning itself points at the
    user's call of the spool, not at the model's line that logs) and `scope(step=...)`."""
    period = policy.interval
    counts = {k: n for k, n in store.per_call.items() if not is_checked(k)}
    stepped = [k for k in counts if INTERVAL_STEP in store.info[k].steps]
    if period == 1 or not stepped:
        return None
    stepless = {
        k: n
        for k, n in counts.items()
        if k in store.reductions
        and INTERVAL_STEP not in store.info[k].steps
        and isinstance(n, int)
        and n % period
    }
    if not stepless:
        return None
    names = ", ".join(
        f"{k!r} ({n} per call, logged at {site_list(store.info[k].sites)})"
        for k, n in list(stepless.items())[:4]
    )
    more = f" and {len(stepless) - 4} more" if len(stepless) > 4 else ""
    verb = "is" if len(stepless) == 1 else "are"
    return (
        f"{who}(interval={period}): {names}{more} {verb} logged without a `step`, while "
        f"{stepped[0]!r} carries one. `interval` keeps an event with a step where the step "
        f"is a multiple of {period}, and numbers the others within each call (events 0, "
        f"{period}, {2 * period}, ... of the call): called once per training step, each "
        "call keeps its first. Log them inside `with eqx_logs.scope(step=i):` (around the "
        "model's call, for `instrument`'s statistics) to keep them by step too."
    )
