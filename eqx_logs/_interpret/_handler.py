"""What differs between spool, tap, masking and plant: a handler, which makes an `Interpreter`
and drives it.

The interpreter evaluates equations and hands each log event to its handler (`event`: it
takes those it `selects`, the others pass on), each `eqx_logs.sow` (`sown`) and statistics
equation (`statistics`); rules thread the handler's
states through loops, branches and calls, asking it which states a jaxpr updates (`keys`) and
how they travel (`settle`, `threadable`, `snapshot`/`restored`, the `device_*` hooks in a
shard_map), telling it where loops begin (`loop`, `entering_loop`, `iteration`) and which keys
a scan returns as its `ys` (`streamed`, a `Stream`). The defaults here thread no state and bind
every equation as it is.
"""

import contextlib
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

from .. import _compat
from .._methods import method
from .._primitive import PLANT_TAG
from .._stats import lane_masked, per_lane

if TYPE_CHECKING:
    from ._evaluator import Interpreter


class Stream:
    """The keys whose events a scan returns as its `ys` instead of carrying their states
    (`Handler.streamed`), with their events per iteration: none here. The scan rule starts
    each iteration's states with `start`, takes the iteration's events out of them with
    `take` (returned as `ys`), and adds the `ys` to the states after the scan with `add`."""

    keys: Mapping[str, int] = MappingProxyType({})

    def start(self, states: dict[str, Any]) -> dict[str, Any]:
        """An iteration's `states`, with the streamed keys' added."""
        return states

    def take(self, states: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """`(states, events)`: an iteration's states without the streamed keys', and their
        events."""
        return states, {}

    def add(self, states: dict[str, Any], events: dict[str, Any], reverse: bool) -> dict[str, Any]:
        """`states` after the scan, with the events it returned (`events`, stacked over its
        iterations) added."""
        del events, reverse
        return states


class Handler:
    name = "eqx_logs.spool"  # in errors
    # Whether custom_jvp/custom_vjp calls whose primal does not log go through their rule too:
    # their derivative rules, traced later by JAX, may log (`_rules/_custom.py`: `_rules_only`).
    wraps_custom_rules = True
    # Whether rules must say under which condition they evaluate a sub-jaxpr (`guard`) even
    # where no lane value is known. Spool does not need it: a `vmap` outside it selects the
    # states of untaken branches away (for predicates JAX batches; see `_lanes.py`).
    tracks_guards = False

    interp: "Interpreter"  # the interpreter it drives (made in its `__init__`)

    def selects(self, tags: tuple[str, ...]) -> bool:
        """Whether the handler takes the events of a log with `tags` (`Plan.selects` caches
        it; the others pass on): those its policy selects, never those of a `plant_point`
        (`PLANT_TAG`), which are a plant's alone."""
        return PLANT_TAG not in tags and method(self.interp.policy, "selects")(tags)

    def reduction_of(self, key: str, site_reduce: Any) -> Any:
        """The reduction of `key` (or "drop"), uncached (`Plan.reduction_of` caches it)."""
        return method(self.interp.policy, "reduction")(key, site_reduce)

    def run(self, closed: Any, args: Sequence[Any]) -> Any:
        raise NotImplementedError

    # -- events -----------------------------------------------------------------------------

    def event(self, eqn: _compat.JaxprEqn, invals: list[Any], states: dict[str, Any]) -> None:
        """Handle one log equation (its operands may be `Lazy`, see `_deferred.py`), updating
        `states` in place."""
        raise NotImplementedError

    def sown(self, eqn: _compat.JaxprEqn, invals: list[Any], states: dict[str, Any]) -> Any:
        """The outputs of an `eqx_logs.sow` (its value, which `plant` replaces)."""
        del states
        return _compat.bind_eqn(eqn, invals)

    def statistics(self, eqn: _compat.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
        """The outputs of a statistics equation (`log_stats`, `instrument`; see
        `_stats.stats_p`). What consumes the logs (spool, tap) makes them per lane under a
        `vmap` around it; what re-evaluates a function inside them (masking, plant) binds
        them otherwise. Lanes of a `vmap` inside that an Equinox loop runs only to discard
        are masked (`lane_masked`), as their events are."""
        lane = self.interp.lanes.mask()
        if lane is not None and jnp.ndim(lane):
            return lane_masked(per_lane(eqn), invals, lane)
        return _compat.bind_eqn(per_lane(eqn), invals)

    # -- states -----------------------------------------------------------------------------

    def keys(self, closed: Any) -> tuple[str, ...]:
        """The states that `closed` updates."""
        self.interp.plan.count(closed)
        return ()

    def settle(
        self, states: dict[str, Any], keys: Any = None, *, arrays: bool = True
    ) -> dict[str, Any]:
        """The states of `keys` (all by default) as they pass through a function JAX traces
        (a loop body, a branch)."""
        return dict(states) if keys is None else {k: states[k] for k in keys}

    def threadable(self, states: dict[str, Any]) -> dict[str, Any]:
        """`states` as arrays, to pass through a function JAX traces separately."""
        return states

    def streamed(self, body: Any, length: Any) -> Stream:
        """The keys whose events a scan over `body` returns as its `ys`."""
        del body, length
        return Stream()

    # -- loops ------------------------------------------------------------------------------

    def loop(self) -> Any:
        """A context for evaluating the body of a loop (`lax.scan`, `lax.while_loop`); its
        rule calls `entering_loop` before it and `iteration` as each iteration begins."""
        return contextlib.nullcontext()

    def entering_loop(self, states: dict[str, Any]) -> dict[str, Any]:
        """The states as a loop begins (before `loop`)."""
        return states

    def iteration(self, states: dict[str, Any]) -> dict[str, Any]:
        """The states as an iteration of a loop begins (inside `loop`)."""
        return states

    # -- context ----------------------------------------------------------------------------

    def guarded(self, pred: Callable[[], Any], lane: Any) -> Any:
        """A context for `Interpreter.guard`."""
        del pred, lane
        return contextlib.nullcontext()

    def snapshot(self) -> tuple[dict[str, Any], Any]:
        """The handler's part of `Interpreter.snapshot`: `(arrays, static)`."""
        return {}, None

    def restored(self, context: dict[str, Any], static: Any) -> Any:
        del context, static
        return contextlib.nullcontext()

    def owns_rules(self) -> bool:
        """Whether the events of the custom derivative rules bound here (`_rules/_custom.py`)
        belong to a spool or tap: then, where none captures them (the derivative taken outside
        it), a `LostEventsWarning` names the custom function."""
        return True

    def rule_carry(self, eqn: _compat.JaxprEqn) -> list[Any]:
        """Arrays that the events of the rules of `eqn`, a custom derivative's call, depend
        on here: bound as operands of the call and handed to `rule_events` where JAX traces
        a rule (the backward rule as residuals), apart from this trace. None by default."""
        del eqn
        return []

    def rule_events(self, *carried: Any) -> Any:
        """A context for a custom derivative's rules, given `rule_carry()` as traced there
        (for rules the interpreter does not evaluate: the backward rule, and the rules of a
        call whose primal does not log)."""
        del carried
        return contextlib.nullcontext()

    def on_device(self, args: Sequence[Any]) -> Any:
        """A context for evaluating a shard_map's body on one device, whose blocks of the
        operands are `args`."""
        del args
        return contextlib.nullcontext()

    def device_inputs(self, states: dict[str, Any], sizes: tuple[int, ...]) -> dict[str, Any]:
        """The states entering a shard_map whose manual mesh axes have `sizes`, each with one
        leading axis per mesh axis (a block per device). A key logged there has those axes
        from its first state; a state that spans the shard_map gets them here."""
        del sizes
        return states

    def device_states(self, states: dict[str, Any], naxes: int) -> dict[str, Any]:
        """A device's states, from its blocks of them (entering a shard_map's body over
        `naxes` axes)."""
        del naxes
        return states

    def device_blocks(self, states: dict[str, Any], naxes: int) -> dict[str, Any]:
        """A device's blocks of its states (leaving a shard_map's body over `naxes` axes)."""
        del naxes
        return states

    def device_outputs(self, entering: dict[str, Any], blocks: dict[str, Any]) -> dict[str, Any]:
        """The states leaving a shard_map, from every device's `blocks` of them (`entering`:
        as they entered it, before `device_inputs`): a key logged there keeps them per
        device; a state that spans the shard_map merges them here."""
        del entering
        return blocks
