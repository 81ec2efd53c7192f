"""JAX's backward-pass logs (jax >= 0.12): the dict a backward rule returns beside its
cotangents when it was registered with `custom_vjp.defvjp_with_logs` (or made by
`custom_gradient(with_logs=True)`, or is a hi primitive's `vjp_bwd`). JAX hands it up through
the transposes of the loops, branches and calls around the rule (stacked per iteration by a
scan) to whoever ran the backward pass, which keeps it only for `jax.vjp(...).with_logs`:
`jax.grad` drops it.

`on_backward_logs(emit)` has eqx_logs see each rule's dict where JAX runs the rule, as one
more thing it does there: `emit(logs, site)`, `site` where the user called the custom
function. The transpose rules that call backward rules (the linear part of a custom_vjp call,
`custom_lin`, and that of a hi primitive) are wrapped; what they return is handed on
unchanged. A backward rule that eqx_logs binds itself (`_custom.py`, under its own context)
emits its logs there instead (`rule_output`), and the transpose that called it emits nothing
more. Before jax 0.12 nothing is wrapped, and backward rules return cotangents alone.
"""

import threading
from collections.abc import Callable
from typing import Any

from jax._src import hijax as _hijax
from jax._src.interpreters import ad as _ad

from ._jaxprs import current_location

# jax >= 0.12: a flat backward rule returns `(cotangents, logs)` (`vjp.with_logs`)
BACKWARD_LOGS = hasattr(_ad, "CustomBwdWithAccums")

_local = threading.local()
_emitters: list[Callable[[dict[Any, Any], str], None]] = []  # the one `on_backward_logs` set


def _calls() -> list[list[bool]]:
    """The wrapped transposes running (innermost last): whether a backward rule of eqx_logs'
    emitted the logs of each already."""
    if not hasattr(_local, "calls"):
        _local.calls = []
    return _local.calls


def _emit(logs: dict[Any, Any]) -> None:
    for emit in _emitters:
        emit(logs, current_location())


def _wrapped(transpose: Callable[..., Any]) -> Callable[..., Any]:
    def rule(*args, **params):
        calls = _calls()
        calls.append([False])
        try:
            logs = transpose(*args, **params)
        finally:
            emitted = calls.pop()[0]
        if logs and not emitted:  # (under the equation's source information: `current_location`)
            _emit(logs)
        return logs

    return rule


def on_backward_logs(emit: Callable[[dict[Any, Any], str], None]) -> None:
    """Call `emit(logs, site)` with the logs of every backward rule JAX runs (see above)."""
    if _emitters:
        raise RuntimeError("eqx_logs: the backward-pass logs are already handed to a function.")
    _emitters.append(emit)
    if not BACKWARD_LOGS:
        return
    for prim in (_ad.custom_lin_p, _hijax.call_hi_primitive_linearized_p):
        _ad.fancy_transposes[prim] = _wrapped(_ad.fancy_transposes[prim])


def rule_output(out: Any) -> tuple[Any, Any]:
    """`(cotangents, logs)` from what a flat backward rule returned (`logs` None before jax
    0.12), for a backward rule eqx_logs binds: its logs are emitted here, in the rule's
    context, and not again by the transpose that called the rule."""
    if not BACKWARD_LOGS:
        return out, None
    cts, logs = out
    if logs:
        calls = _calls()
        if calls:
            calls[-1][0] = True
        _emit(logs)
    return cts, logs
