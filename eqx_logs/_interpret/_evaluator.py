"""The evaluator: the equation loop that every handler shares.

`Interpreter.eval` evaluates a jaxpr in the current trace, equation by equation: a log goes to
the handler, a higher-order primitive that contains logs to its rule (`eqx_logs/_rules/`), which
rebuilds it through JAX's public constructors with the handler's states threaded through;
everything else is bound as it is. Operands computed only for logs are evaluated lazily, where
an event needs them (`_deferred.py`). Nothing JAX created is mutated.

What rules may use (besides `eval`): `guard`, `snapshot`/`restored`, `on_device`,
`in_iteration`, `rule_name`; and the pieces `plan` (`_plan.py`: `count`), `lanes`
(`_lane_context.py`), `manual` (`_manual.py`) and `handler` (`_handler.py`: its hooks `keys`,
`settle`, `threadable`, `loop`/`entering_loop`/`iteration`, `streamed`,
`device_inputs`/`device_states`/`device_blocks`/`device_outputs`).

A handler makes its interpreter (`Handler.run` drives it); the interpreter holds no state of
any handler's, and calls the handler only through the hooks `Handler` declares.
"""

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import _compat, _lanes
from .._deferred import Lazy, Producers, log_only
from .._primitive import is_log, is_sow
from .._reduce import Policy
from .._stats import stats_p
from ._handler import Handler
from ._lane_context import LaneContext
from ._manual import ManualAxes
from ._plan import Plan

if TYPE_CHECKING:
    from .._rules import Rule


class Interpreter:
    """Evaluates jaxprs, handing log events to `handler` (which makes it)."""

    def __init__(self, policy: Policy, rules: "dict[str, Rule]", handler: Handler):
        self.policy = policy
        self.rules = rules
        self.handler = handler
        self.manual = ManualAxes()
        self.plan = Plan(
            policy, rules, handler.reduction_of, handler.selects, self.manual, handler.name
        )
        self.lanes = LaneContext()
        # the custom derivative rule being evaluated, if any (its events may pass on)
        self.rule_name: str | None = None
        # the indices of the scan iterations being evaluated, innermost last (`in_iteration`)
        self.iterations: list[Any] = []
        self._log_only_cache: dict[int, tuple[Any, Producers, set[int]]] = {}

    @contextlib.contextmanager
    def guard(self, pred: Callable[[], Any], lane: Any = None):
        """Evaluate what follows only where `pred()` holds (a cond branch's index, a while
        loop's predicate). `lane` is the same condition as each vmap lane would compute it
        alone, where that differs (`_lanes.py`): events under it are masked with it."""
        with self.handler.guarded(pred, lane), self.lanes.guard(lane):
            yield

    def snapshot(self) -> tuple[Any, Any]:
        """What events depend on besides the states: `(arrays, static)`, to pass into a
        function JAX may trace later (a custom derivative rule) and `restored` there."""
        context, static = self.handler.snapshot()
        return {**self.lanes.snapshot(), **context}, static

    @contextlib.contextmanager
    def restored(self, context: Any, static: Any):
        """Evaluate under a `snapshot()` taken elsewhere."""
        with self.handler.restored(context, static), self.lanes.restored(context):
            yield

    @contextlib.contextmanager
    def in_iteration(self, index: Any):
        """Evaluating a scan's body at iteration `index` (a traced integer): the step that
        JAX's backward-pass logs inside get (`_gate.steps_of`), if they are consumed here."""
        self.iterations.append(index)
        try:
            yield
        finally:
            self.iterations.pop()

    @contextlib.contextmanager
    def on_device(self, args: Sequence[Any], axes: tuple[str, ...], check_vma: bool):
        """Evaluating the body of a `shard_map` over `axes` on one device, whose blocks of the
        operands are `args`."""
        with self.handler.on_device(args):
            with self.manual.inside(tuple((a, 1) for a in axes), check_vma):
                yield

    def bind_eqn(self, eqn: _compat.JaxprEqn, invals: Sequence[Any]) -> list[Any]:
        """`_compat.bind_eqn` for an equation that is neither a log nor evaluated by a rule
        (at once, or when an event forces it: `Lazy`), statistics as the handler binds
        them."""
        if eqn.primitive is stats_p:
            return self.handler.statistics(eqn, invals)
        return _compat.bind_eqn(eqn, invals)

    def eval(self, closed: Any, args: Sequence[Any], states: dict[str, Any], *, settle=True):
        """Evaluate `closed` on `args`; returns `(outs, states)`, the states as arrays unless
        `settle` is false (for code inlined in the current trace)."""
        jaxpr, consts = _compat.unpack(closed)
        states = dict(states)
        env: dict[Any, Any] = {}
        producers, deferred = self._log_only(jaxpr)
        handler, plan, lanes = self.handler, self.plan, self.lanes

        def read(v):
            if isinstance(v, _compat.Literal):
                return v.val
            if v in env or v not in producers:
                return env[v]
            # computed only for logs: when an event needs it
            return Lazy(v, env, producers, self.bind_eqn)

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            if id(eqn) in deferred:
                continue
            invals = [read(v) for v in eqn.invars]
            if is_log(eqn):
                handler.event(eqn, invals, states)
                outs = []
            elif is_sow(eqn):
                outs = handler.sown(eqn, invals, states)
            elif plan.eqn_has_log(eqn) or (handler.wraps_custom_rules and self._custom(eqn)):
                outs, states = plan.rule(eqn).apply(self, eqn, invals, states)
            else:
                outs = self.bind_eqn(eqn, invals)
            if lanes.values or _lanes.is_lane_primitive(eqn):
                lanes.follow(eqn, invals, outs)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, _compat.DropVar):
                    env[v] = x
        return [read(v) for v in jaxpr.outvars], handler.settle(states) if settle else states

    def _custom(self, eqn: _compat.JaxprEqn) -> bool:
        rule = self.rules.get(eqn.primitive.name)
        return rule is not None and rule.custom

    def _log_only(self, jaxpr: Any) -> tuple[Producers, set[int]]:
        """The equations of `jaxpr` that only logs use (`_deferred.py`), cached."""
        hit = self._log_only_cache.get(id(jaxpr))
        if hit is None:

            def keeps(eqn):
                return self.plan.eqn_has_log(eqn) or _lanes.is_lane_primitive(eqn) or is_sow(eqn)

            producers = log_only(jaxpr, is_log, keeps)
            deferred = {id(eqn) for _, eqn in producers.values()}
            hit = self._log_only_cache[id(jaxpr)] = (jaxpr, producers, deferred)
        return hit[1], hit[2]
