"""Per-lane events under vmap when a cond or while loop gets a batched predicate.

`vmap` turns `lax.cond` with a batched predicate into code that runs every branch for every
lane and selects the results, and runs a `while_loop`'s body for every lane until all lanes
are done. Logs inside would then fire for untaken branches and finished lanes (the bug of
oryx, logify and checkify). For conds and while loops that contain logs, eqx_logs replaces
JAX's batching rules with ones that do the same thing while giving every log a validity mask:
the lanes where its branch is taken, or where the loop is still running. Statistics
(`log_stats`, `instrument`), over all lanes of such a vmap together, are over those lanes.
"""

import contextlib
import itertools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _compat, _lanes
from ._interpret import Handler, Interpreter
from ._primitive import log_effect, masked_events, rebind
from ._reduce import Policy
from ._rules import RULES
from ._stats import masked


class _Mask(Handler):
    """Adds `mask` to every log (through nested control flow), and marks it as in `branch`.
    The logs of custom derivative rules, which JAX traces apart (the backward rule when it
    transposes), get it too: it travels with the call as an operand (`rule_carry`), and the
    rules bind their logs and statistics under it (`masked_events`)."""

    def __init__(self, mask: Any, branch: tuple[int, int] | None):
        self.mask, self.branch = mask, branch
        self.interp = Interpreter(Policy(), RULES, self)
        self.spooled = _compat.logging_enabled.value  # a spool or tap traces around

    def owns_rules(self) -> bool:
        # (a vmap outside every spool and tap: the rules log as they would, unbound)
        return self.spooled

    def rule_carry(self, eqn: Any) -> list[Any]:
        # a custom_vjp's: its backward rule, traced when JAX transposes, may log (a
        # custom_jvp's rule is evaluated here when it differentiates: no need)
        return [self._kept()] if eqn.primitive.name == _compat.CUSTOM_VJP else []

    def rule_events(self, *carried: Any) -> Any:
        return masked_events(carried[0], self.branch) if carried else contextlib.nullcontext()

    def snapshot(self) -> tuple[dict[str, Any], Any]:
        return {"branch_mask": self.mask}, None

    @contextlib.contextmanager
    def restored(self, context: dict[str, Any], static: Any):
        saved, self.mask = self.mask, context["branch_mask"]
        try:
            yield
        finally:
            self.mask = saved

    def _kept(self) -> Any:
        """Whether (in this lane) the events here are kept."""
        lane = self.interp.lanes.mask()
        return self.mask if lane is None else jnp.logical_and(self.mask, lane)

    def event(self, eqn, invals, states):
        rebind(eqn, invals, self._kept(), branch=self.branch)

    def statistics(self, eqn, invals):
        # the vmap is inside the spool (the model's batch): a statistic is over the lanes
        # whose events are kept (those of a lane value with lane axes, a loop under a vmap
        # inside the branch: if any of them is)
        kept = self._kept()
        return masked(eqn, invals, kept if jnp.ndim(kept) == 0 else jnp.any(kept))


def masked_eval(
    closed: Any, args: Sequence[Any], mask: Any, branch: tuple[int, int] | None = None
) -> list[Any]:
    """Evaluate `closed` on `args` with every log inside masked by `mask`, and marked as in
    `branch` (`(cond, branch index)`, see `_primitive.py`) if given. Outputs that have a lane
    value (`_lanes.py`: Equinox's loop predicates) are returned as their lane value."""
    interp = _Mask(mask, branch).interp
    outs, _ = interp.eval(closed, args, {})
    return [x if interp.lanes.of(x) is None else interp.lanes.of(x) for x in outs]


def _has_log(*closed: Any) -> bool:
    return any(log_effect in _compat.unpack(c)[0].effects for c in closed)


def _may_log(*closed: Any) -> bool:
    """Whether `closed` logs, or holds a custom_vjp call, whose backward rule may log when
    JAX transposes it (`log_grad`, `instrument(grads=True)`): nothing in the jaxpr says."""

    def is_custom_vjp(eqn: Any) -> bool:
        return eqn.primitive.name == _compat.CUSTOM_VJP

    return _has_log(*closed) or any(_compat.any_eqn(c, is_custom_vjp) for c in closed)


_conds = itertools.count()  # ids of the batched conds with logs (`log_p`'s `branches`)


def _cond_batching(original):
    def rule(axis_data, args, dims, *, branches, **params):
        index_dim = dims[0]
        if index_dim is None or not _may_log(*branches):
            return original(axis_data, args, dims, branches=branches, **params)
        size, name = _compat.axis_size_and_name(axis_data)
        cond = next(_conds)  # this cond, in its branches' logs

        def branch_outputs(i, branch):
            def lane(index, *ops):
                return masked_eval(branch, ops, index == i, (cond, i))

            return jax.vmap(lane, in_axes=tuple(dims), axis_size=size, axis_name=name)(*args)

        outputs = [branch_outputs(i, b) for i, b in enumerate(branches)]
        index = jnp.moveaxis(args[0], index_dim, 0)

        def select(index, *values):
            return lax.select_n(index, *values)

        results = [
            jax.vmap(select)(index, *(out[j] for out in outputs)) for j in range(len(outputs[0]))
        ]
        return results, [0] * len(results)

    return rule


def _while_batching(original):
    def rule(axis_data, args, dims, *, cond_nconsts, cond_jaxpr, body_nconsts, body_jaxpr):
        params = dict(
            cond_nconsts=cond_nconsts,
            cond_jaxpr=cond_jaxpr,
            body_nconsts=body_nconsts,
            body_jaxpr=body_jaxpr,
        )
        if not _has_log(cond_jaxpr, body_jaxpr) or _lanes.has_lanes(cond_jaxpr):
            # An Equinox loop makes its predicate unbatched and guards its own carry: it is
            # batched as it is, and the spool's lane values mask its events (`_lanes.py`),
            # following the lanes its initial carry already has.
            return original(axis_data, args, dims, **params)
        size, name = _compat.axis_size_and_name(axis_data)
        cdims = tuple(dims[:cond_nconsts])
        bdims = tuple(dims[cond_nconsts : cond_nconsts + body_nconsts])
        cconsts = args[:cond_nconsts]
        bconsts = args[cond_nconsts : cond_nconsts + body_nconsts]
        init = [
            jnp.broadcast_to(x, (size, *jnp.shape(x))) if d is None else jnp.moveaxis(x, d, 0)
            for x, d in zip(
                args[cond_nconsts + body_nconsts :], dims[cond_nconsts + body_nconsts :]
            )
        ]

        def vmapped(f, const_dims):
            return jax.vmap(f, in_axes=(0, const_dims, 0), axis_size=size, axis_name=name)

        def test(running, consts, values):
            (pred,) = masked_eval(cond_jaxpr, [*consts, *values], running)
            return pred

        def advance(running, consts, values):
            return masked_eval(body_jaxpr, [*consts, *values], running)

        # Each lane tests once, then (body, test) while its predicate holds.
        running = vmapped(test, cdims)(jnp.ones((size,), bool), cconsts, init)

        def loop_body(carry):
            values, running = carry
            new = vmapped(advance, bdims)(running, bconsts, values)
            values = [
                jnp.where(running.reshape((size,) + (1,) * (jnp.ndim(n) - 1)), n, v)
                for n, v in zip(new, values)
            ]
            running = jnp.logical_and(running, vmapped(test, cdims)(running, cconsts, values))
            return values, running

        values, _ = lax.while_loop(lambda c: jnp.any(c[1]), loop_body, (init, running))
        return values, [0] * len(values)

    return rule


_compat.wrap_batching(_compat.COND, _cond_batching)
_compat.wrap_batching(_compat.WHILE, _while_batching)
