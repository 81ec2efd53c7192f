"""What spool and tap share before they keep an event: the prelude of a log equation (whether
the handler takes it, `selects`; its items, steps and mask, `items_of`, `steps_of`, `mask_of`;
the keys it passes on, `pass_on`) and the policy's interval (`Interval`).

With `interval=k`, events that carry the step `INTERVAL_STEP` are kept where it is a multiple
of k (in a per-step training loop, one jitted call per step, only the step can tell); the
others are numbered, per key in spool and per group of keys in tap, and events 0, k, 2k, ...
are kept.
"""

from typing import TYPE_CHECKING, Any

import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax import lax

from .. import _compat
from .._deferred import force
from .._primitive import ITERATION_STEP, rebind
from .._scope import INTERVAL_STEP

if TYPE_CHECKING:
    from ._evaluator import Interpreter


def selects(interp: "Interpreter", eqn: _compat.JaxprEqn, invals: list[Any]) -> bool:
    """Whether the handler of `interp` takes the events of the log equation `eqn` (its policy
    selects their tags); if not, `eqn` is bound again, for an enclosing spool or tap."""
    if interp.plan.selects(eqn.params["tags"]):
        return True
    rebind(eqn, invals, interp.lanes.mask())
    return False


def items_of(eqn: _compat.JaxprEqn, leaves: Any) -> dict[str, Any]:
    """The event's items, key by key, as pytrees of `leaves` (its values, or their positions
    among the equation's operands)."""
    return jtu.tree_unflatten(eqn.params["treedef"], leaves)


def steps_of(interp: "Interpreter", eqn: _compat.JaxprEqn, invals: list[Any]) -> dict[str, Any]:
    """The event's steps, by name; for JAX's backward-pass logs (`bind_backward_logs`), the
    index of the innermost scan iteration `interp` is evaluating, if any (else -1, as bound)."""
    n_leaves = eqn.params["treedef"].num_leaves
    steps = dict(zip(eqn.params["steps"], force(invals[n_leaves:])))
    if eqn.params.get("iteration") and interp.iterations:
        bound = steps[ITERATION_STEP]  # (with the lanes of the vmaps around the log, if any)
        steps[ITERATION_STEP] = jnp.broadcast_to(interp.iterations[-1], jnp.shape(bound))
    return steps


def mask_of(eqn: _compat.JaxprEqn, invals: list[Any], everywhere: Any = None) -> Any:
    """Where the event happened (a bool per lane), or `everywhere` if it is not masked."""
    return force(invals[-1:])[0] if eqn.params["masked"] else everywhere


def pass_on(
    interp: "Interpreter", eqn: _compat.JaxprEqn, invals: list[Any], items: Any, taken: Any
) -> None:
    """Bind `eqn` again with the keys of `items` that the handler does not take (`taken`) and
    no policy rule drops: logged by a custom derivative rule but not by its primal
    (`_rules/_custom.py`), they go to an enclosing spool or tap, or warn if none captures
    them."""
    passed = [k for k in items if k not in taken and not interp.plan.dropped(k)]
    if passed:
        rebind(eqn, invals, interp.lanes.mask(), keys=passed, rule=interp.rule_name)


class Interval:
    """The policy's `interval=period` (see above): which events it keeps."""

    def __init__(self, period: int):
        self.period = period

    def by_step(self, steps: dict[str, Any]) -> bool:
        """Whether an event with `steps` is kept by its step (else by its number)."""
        return self.period > 1 and INTERVAL_STEP in steps

    def number(self, steps: dict[str, Any], seen: Any) -> Any:
        """What an event with `steps` is kept by: its step `INTERVAL_STEP`, or `seen`, the
        events counted before it."""
        return steps[INTERVAL_STEP] if self.by_step(steps) else seen

    def keeps(self, number: Any, now: bool | None = None) -> Any:
        """Whether the event numbered `number` (`number`) is kept: where it is a multiple of
        the period. Computed now where `now` (by default: where `number` is a Python or numpy
        integer, known at trace time), else on the device (`lax.rem`: counters and steps are
        never negative)."""
        if isinstance(number, int | np.integer) if now is None else now:
            return number % self.period == 0
        number = jnp.asarray(number)
        return lax.rem(number, jnp.asarray(self.period, number.dtype)) == 0
