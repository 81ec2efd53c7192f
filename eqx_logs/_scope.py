"""Scopes and call sites: the key prefix and the steps of the enclosing `scope` blocks
(per thread), the trace-time context that JAX's trace caches key on, and the user's
file:line that error messages name."""

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

from jaxtyping import ArrayLike

from . import _compat
from ._log_checks import check_step

local = threading.local()
_package_dir = os.path.dirname(os.path.abspath(__file__))


def _scopes() -> list[str]:
    if not hasattr(local, "scopes"):
        local.scopes = []
    return local.scopes


@contextlib.contextmanager
def scope(name: str | None = None, /, **steps: int | ArrayLike) -> Iterator[None]:
    """Prefix every key logged inside the block with `name/`, and record `steps` with every
    event inside it. Scopes nest.

    **Arguments:**

    - `name`: a non-empty string without leading or trailing `/`; or None for no prefix.
    - `**steps`: integer scalars recorded beside every event logged inside the block (as
        `log(..., step=i)` does), also those of `instrument`, `log_stats`, `sow` and the
        backward pass of `log_grad` traced inside it; a step the `log` call names itself
        wins. Enter it where the step is a traced value (inside the jitted training step,
        around the model's call): a Python number would be a constant of the compiled program.

    !!! example

        ```python
        def train_step(model, x, i):
            with eqx_logs.scope("encoder"):
                eqx_logs.log("norm", jnp.linalg.norm(x))  # logged as "encoder/norm"

            with eqx_logs.scope(step=i):  # i traced: entered inside the traced step
                loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
            return loss

        mlp = eqx_logs.instrument(model)  # its statistics carry the step too
        loss, logs = eqx_logs.spool(train_step)(mlp, x, jnp.int32(3))
        # logs.step["layers[0]/rms"] == [3]
        ```

    The prefix is applied when `log` is called (when the function is traced), so it is the
    same on every retrace: no counters are involved.
    """
    site = call_site()
    if name is not None and (not isinstance(name, str) or not name or name.strip("/") != name):
        raise ValueError(
            f"eqx_logs.scope(name) needs a non-empty string without leading or trailing '/' "
            f"(or None), got {name!r}."
        )
    checked = {n: check_step(n, v, site) for n, v in steps.items()}
    if checked and not _compat.tracing():
        raise ValueError(
            f"eqx_logs.scope({', '.join(f'{n}=...' for n in steps)}) at {site} is entered "
            "outside any jit or trace: its steps would be constants of the programs compiled "
            "inside it, one program per value. Enter it inside the jitted function, with the "
            "step as a traced argument (or log `step=` at each `log` call)."
        )
    prefixes, context = _scopes(), _context_steps()
    if name is not None:
        prefixes.append(name)
    # in trace-cache keys: a traced value by identity (a jit traced inside this block is traced
    # again inside the next, so it never holds an old trace's value), a number by value
    key = tuple((n, _Traced() if _compat.is_tracer(v) else int(v)) for n, v in checked.items())
    context.append((checked, key))
    try:
        with tracing_context():
            yield
    finally:
        context.pop()
        if name is not None:
            prefixes.pop()


def _context_steps() -> list[tuple[dict[str, Any], tuple]]:
    if not hasattr(local, "steps"):
        local.steps = []
    return local.steps


def current_steps() -> dict[str, Any]:
    """The steps of the enclosing `scope` blocks (inner ones win)."""
    merged: dict[str, Any] = {}
    for steps, _ in _context_steps():
        merged.update(steps)
    return merged


class StepWatch:
    """Whether every event traced while it is on carries the call's step (`logger.jit(...,
    step=...)`): its `step` is that argument's traced value, entered with `call_step`; each
    event whose step `INTERVAL_STEP` is another value (its own `step=`, an inner `scope`, a
    custom rule traced apart, which sees no scope) is noted in `others` by its call site.
    Then, where the call's step is not a multiple of `interval`, no event of the call can be
    kept, and the call may run without its logs."""

    __slots__ = ("step", "others")

    def __init__(self):
        self.step: Any = None
        self.others: list[str] = []


# The step `interval` selects by (`_interpret/_spool/_store.py`).
INTERVAL_STEP = "step"


@contextlib.contextmanager
def watching() -> Iterator[StepWatch]:
    """A `StepWatch` over the events traced inside the block."""
    saved, local.watch = getattr(local, "watch", None), StepWatch()
    try:
        yield local.watch
    finally:
        local.watch = saved


@contextlib.contextmanager
def call_step(step: Any) -> Iterator[None]:
    """Inside the block, `step` is the call's step: the step of every event without one of
    its own (a `scope(step=step)`), and what the enclosing `watching` compares events with."""
    with scope(**{INTERVAL_STEP: step}):
        watch = getattr(local, "watch", None)
        if watch is not None:
            watch.step = current_steps()[INTERVAL_STEP]  # (as `scope` checked it)
        yield


@contextlib.contextmanager
def kept_at(step: Any, period: int) -> Iterator[None]:
    """Inside the block, `step` (the traced step argument of a `logger.jit` call) is a step
    that `interval=period` keeps: the host read the call's step and chose the program for
    kept steps. An event whose step is that very value, under that interval, is then kept
    without a gate on the device (see `kept_step`)."""
    saved, local.kept_step = getattr(local, "kept_step", None), (step, period)
    try:
        yield
    finally:
        local.kept_step = saved


def kept_step(period: int) -> Any:
    """The step `kept_at` says `interval=period` keeps, else None."""
    kept = getattr(local, "kept_step", None)
    return kept[0] if kept is not None and kept[1] == period else None


def note_steps(steps: dict[str, Any], site: str) -> None:
    """Tell the enclosing `watching`, if any, the steps of an event traced at `site`."""
    watch = getattr(local, "watch", None)
    if watch is not None and (watch.step is None or steps.get(INTERVAL_STEP) is not watch.step):
        watch.others.append(site)


@contextlib.contextmanager
def unwatched() -> Iterator[None]:
    """Events traced inside the block were noted where they were written (a backward rule,
    whose steps travel as residuals: other traced values, the same steps)."""
    saved, local.watch = getattr(local, "watch", None), None
    try:
        yield
    finally:
        local.watch = saved


class _Traced:
    """A traced step's place in a trace-cache key: equal only to itself."""

    __slots__ = ()


def _context_key() -> tuple:
    key = tuple(key for _, key in _context_steps() if key)
    if lanes_marked():  # (a jit traced inside is traced again, its operations bracketed)
        key = (*key, ("<lanes marked>",))
    masked = getattr(local, "event_mask", None)  # `_primitive.masked_events`: by identity
    return key if masked is None else (*key, ("<masked events>", masked[2]))


def lanes_marked() -> bool:
    """Whether a spool with `first_nonfinite="any"` traces its function (`marking`)."""
    return getattr(local, "lanes_marked", False)


@contextlib.contextmanager
def marking(on: bool = True) -> Iterator[None]:
    """While a spool with `first_nonfinite="any"` traces its function (`on`): the batching
    rules bracket what they emit, so that the checks know each value's lanes
    (`_watch/_lanes.py`)."""
    saved, local.lanes_marked = lanes_marked(), on
    try:
        yield
    finally:
        local.lanes_marked = saved


def current_prefix() -> str:
    return "/".join(_scopes())


@contextlib.contextmanager
def logging_as(
    prefix: str, rule: str | None = None, *, enabled: bool | None = True
) -> Iterator[None]:
    """Logging on (or as it is, for `enabled=None`), under the scope `prefix` (a function JAX
    traces later, such as a custom derivative rule, logs as where it was written). `rule`
    names the custom rule whose events pass on: they are lost, with a `LostEventsWarning`,
    if no spool or tap captures them."""
    scopes, old_rule = _scopes(), getattr(local, "rule", None)
    saved = list(scopes)
    scopes[:] = prefix.split("/") if prefix else []
    local.rule = rule
    try:
        with no_context_steps(), tracing_context(enabled=enabled):
            yield
    finally:
        scopes[:] = saved
        local.rule = old_rule


@contextlib.contextmanager
def tracing_context(enabled: bool | None = None) -> Iterator[None]:
    """Sets the JAX config states that `log` depends on at trace time (logging on or off, and
    the scope prefix while on), so that JAX's trace caches tell the cases apart."""
    with contextlib.ExitStack() as stack:
        if enabled is not None:
            stack.enter_context(_compat.logging_enabled(enabled))
        if _compat.logging_enabled.value:
            context = _context_key()
            prefix = (current_prefix(), context) if context else current_prefix()
            stack.enter_context(_compat.scope_prefix(prefix))
        yield


_contextlib_file = contextlib.__file__


def call_site() -> str:
    """The user's file:line (function) that called into eqx_logs (a `with` statement, for
    `scope`)."""
    return _first_outside(sys._getframe(1), ())


# The machinery between the user's call and eqx_logs: a spooled function's program is traced
# (and checked, for `first_nonfinite="any"`) under `eqx.filter_jit`, `jax.jit`, `nnx.jit`.
_MACHINERY = ("eqx_logs.", "equinox.", "jax.", "jaxlib.", "flax.")


def user_site() -> str:
    """The user's file:line (function) whose call led into eqx_logs through any of JAX's,
    Equinox's or Flax's machinery: the line that called a spool or a jitted step (where
    `call_site` names the first frame outside eqx_logs, a `log` call's line, which may be in
    a library)."""
    return _first_outside(sys._getframe(1), _MACHINERY)


def _first_outside(frame: Any, modules: tuple[str, ...]) -> str:
    """file:line (function) of the first frame from `frame` outwards that is neither
    eqx_logs', contextlib's nor in one of `modules` (prefixes of module names)."""
    while frame is not None and (
        frame.f_code.co_filename == _contextlib_file
        or os.path.dirname(os.path.abspath(frame.f_code.co_filename)).startswith(_package_dir)
        or (modules and frame.f_globals.get("__name__", "").startswith(modules))
    ):
        frame = frame.f_back
    if frame is None:
        return "<unknown location>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


@contextlib.contextmanager
def no_context_steps() -> Iterator[None]:
    """Without the steps of the `scope` blocks around: in a function JAX traces apart (a
    custom derivative rule), whose events carry what was captured where it was called."""
    saved = list(_context_steps())
    _context_steps().clear()
    try:
        yield
    finally:
        _context_steps()[:] = saved
