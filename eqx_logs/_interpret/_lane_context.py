"""Lane context: what each `vmap` lane would see alone, for the equations being evaluated.

Two things, both explained in `eqx_logs/_lanes.py`: the *lane guards* (the conditions, per
lane, that the cond branches and loop iterations around the current equation run under; events
are masked with them) and the *lane values* (for integer and boolean values computed from an
Equinox loop's predicate, the value each lane alone would have computed). Rules hand both on
into loop bodies and branches; `Interpreter.eval` follows the lane values through each
equation.
"""

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .. import _compat, _lanes


class LaneContext:
    def __init__(self):
        self.guards: list[Any] = []
        self.values: dict[int, tuple[Any, Any]] = {}  # id(x) -> (x, its lane value)

    @contextlib.contextmanager
    def guard(self, lane: Any):
        """Evaluate what follows under the lane guard `lane` (the condition a guard of
        `Interpreter.guard` holds under, as each lane would compute it alone), if any."""
        if lane is None:
            yield
            return
        # with no lane axes, the lane value is `pred()` (true here) unless a vmap batches it
        self.guards.append(_lanes.shadow(True, lane) if jnp.ndim(lane) == 0 else lane)
        try:
            yield
        finally:
            self.guards.pop()

    def mask(self) -> Any:
        """The conjunction of the lane guards around the current equation, or None."""
        if not self.guards:
            return None
        return functools.reduce(jnp.logical_and, self.guards)

    def snapshot(self) -> dict[str, Any]:
        return {"lane_guards": list(self.guards)}

    @contextlib.contextmanager
    def restored(self, context: dict[str, Any]):
        saved, self.guards = self.guards, list(context["lane_guards"])
        try:
            yield
        finally:
            self.guards = saved

    def of(self, x: Any) -> Any:
        """The lane value of `x` (a value `eval` produced), or None if it has none."""
        hit = self.values.get(id(x))
        return None if hit is None or hit[0] is not x else hit[1]

    def of_each(self, xs: Sequence[Any]) -> dict[int, Any]:
        """The lane values of `xs`, by position, where they have one."""
        return {i: lane for i, x in enumerate(xs) if (lane := self.of(x)) is not None}

    def give(self, xs: Sequence[Any], lanes: dict[int, Any]) -> None:
        """Give `xs[i]` the lane value `lanes[i]`: values entering a loop body or branch.
        Only integer and boolean values (those that steer control flow) keep one."""
        for i, lane in lanes.items():
            x = xs[i]
            # not a Python scalar (their ids are shared)
            if isinstance(x, jax.Array) and not jnp.issubdtype(x.dtype, jnp.inexact):
                self.values[id(x)] = (x, lane)

    def in_step(self, xs: Sequence[Any], lanes: dict[int, Any]) -> Any:
        """Whether (per lane) each `xs[i]` equals its lane value `lanes[i]`: a loop iteration
        runs for a lane on its own only where its carried control values agree with what the
        lane alone would have (None if no value has a lane value)."""
        if not lanes:
            return None
        same = [jnp.equal(xs[i], lane) for i, lane in lanes.items()]
        return functools.reduce(jnp.logical_and, same)

    def like(self, xs: Sequence[Any], like: dict[int, Any]) -> dict[int, Any]:
        """The lane values of `xs` at the positions of `like`, shaped like those (a value
        without a lane value is its own): what a loop carries from one iteration to the
        next."""
        out = {}
        for i, old in like.items():
            lane = self.of(xs[i])
            out[i] = jnp.broadcast_to(xs[i] if lane is None else lane, jnp.shape(old))
        return out

    def carried(self, xs: Sequence[Any], lanes: dict[int, Any]) -> dict[int, Any]:
        """`lanes` as a loop carries them: a lane value with no lane axes is `xs[i]` itself
        unless a vmap batches them apart (`_lanes.shadow`), so where none does, XLA sees two
        equal carries and keeps one."""
        return {
            i: _lanes.shadow(xs[i], lane) if jnp.shape(lane) == jnp.shape(xs[i]) else lane
            for i, lane in lanes.items()
        }

    def follow(self, eqn: _compat.JaxprEqn, invals: list[Any], outs: list[Any]) -> None:
        """Record the lane values of `eqn`'s outputs, if any (see `_lanes.py`); called where
        values have lane values or `eqn` makes one."""
        inlanes = [self.of(x) for x in invals]
        if _lanes.is_lane_primitive(eqn):
            lanes = [
                _lanes.lane_value(eqn, [x if y is None else y for x, y in zip(invals, inlanes)])
            ]
        else:
            if all(lane is None for lane in inlanes):
                return
            lanes = _lanes.propagate(eqn, invals, inlanes)
            if lanes is None:
                return
        self.give(outs, dict(enumerate(lanes)))
