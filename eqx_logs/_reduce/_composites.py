"""Reductions that compose others: `Window` (a reduction per window of events) and `Fanout`
(several reductions of each event)."""

from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu

from .._checks import check_count
from ._buffers import NeedsBound, Stack, check_capacity
from ._names import as_reduction, is_reduction_like, public_name
from ._reductions import AbstractReduction, select_valid


def _windows_stack(state: dict) -> Stack:
    """The Stack that holds a Window's finished windows (its capacity is the buffer's)."""
    return _stack_of(jtu.tree_leaves(state["windows"]["buffer"])[0].shape[0])


def _stack_of(windows: Any) -> Stack:
    """The Stack of `windows` slots that holds a Window's finished windows: one with that
    capacity, or none where the size is a static bound no window exceeds: a key with no
    possible events, or a symbolic size (`jax.export`), which no capacity can be."""
    return Stack(capacity=windows) if isinstance(windows, int) and windows else Stack()


class Window(AbstractReduction):
    """Reduces each run of `size` consecutive events with `inner` and stacks the results:
    "the mean loss over every 100 steps". A last, partial window is included.

    **Arguments:**

    - `size`: events per window.
    - `inner`: the reduction applied within each window (a name or a reduction).
    - `capacity`: the number of windows kept (required inside while loops); by default
        `ceil(max_events / size)`.
    """

    size: int = eqx.field(static=True)
    inner: AbstractReduction
    capacity: int | None = eqx.field(default=None, static=True)
    event_axes: ClassVar[int] = 1

    def __init__(self, size: int, inner: Any = "mean", capacity: int | None = None):
        if is_reduction_like(size):  # `Window("mean", 100)`: the order of `Window(100, "mean")`
            _swapped(size, inner)
        self.size = size
        self.inner = as_reduction(inner, where="eqx_logs.Window: inner")
        self.capacity = capacity

    def __check_init__(self):
        check_count("Window", "size", self.size)
        check_capacity("Window", self.capacity)

    def step_reduction(self):
        return Window(self.size, self.inner.step_reduction(), self.capacity)

    def with_key(self, key):
        return Window(self.size, self.inner.with_key(key), self.capacity)

    def _windows(self, max_events):
        if self.capacity is not None:
            return self.capacity
        if max_events is None:
            raise NeedsBound()
        return -(-max_events // self.size)  # a ceiling that stays symbolic (`jax.export`)

    def init(self, struct, max_events):
        fresh = self.inner.init(struct, self.size)
        out = jax.eval_shape(self.inner.finalize, fresh)
        n = self._windows(max_events)
        return {
            "current": fresh,
            "position": jnp.zeros((), jnp.int32),
            "windows": _stack_of(n).init(out, n),
        }

    def update(self, state, value, valid):
        current = self.inner.update(state["current"], value, valid)
        position = state["position"] + jnp.asarray(valid, jnp.int32)
        done = position == self.size
        stack = _windows_stack(state)
        windows = stack.update(state["windows"], self.inner.finalize(current), done)
        struct = jtu.tree_map(
            lambda v: jax.ShapeDtypeStruct(jnp.shape(v), jnp.result_type(v)), value
        )
        fresh = self.inner.init(struct, self.size)
        return {
            "current": select_valid(done, fresh, current),
            "position": jnp.where(done, 0, position),
            "windows": windows,
        }

    def merge(self, a, b):
        """The windows of `a` (its last, partial window closed), then those of `b`."""
        stack = _windows_stack(a)
        closed = stack.update(a["windows"], self.inner.finalize(a["current"]), a["position"] > 0)
        return {
            "current": b["current"],
            "position": b["position"],
            "windows": stack.merge(closed, b["windows"]),
        }

    def rows(self, state):  # finished windows, and the partial one if it has events
        stack = _windows_stack(state)
        closed = stack.rows(state["windows"]) + (state["position"] > 0).astype(jnp.int32)
        return jnp.minimum(closed, jtu.tree_leaves(state["windows"]["buffer"])[0].shape[0])

    def finalize(self, state):
        stack = _windows_stack(state)
        windows = stack.update(
            state["windows"], self.inner.finalize(state["current"]), state["position"] > 0
        )
        return stack.finalize(windows)


def _swapped(size: Any, inner: Any) -> None:
    """The error for a reduction given as `Window`'s first argument, the window's size."""

    def shown(value: Any) -> str:
        return public_name(value) if isinstance(value, type) else repr(value)

    got = f"size={shown(size)}, inner={shown(inner)}"
    meant = f"{public_name(size)}()" if isinstance(size, type) else repr(size)
    if isinstance(inner, int) and not isinstance(inner, bool):
        fix = f"the arguments are swapped: did you mean `Window({inner!r}, {meant})`?"
    else:
        fix = f"the window's size comes first: `Window(size, {meant})`, as `Window(100, {meant})`."
    raise ValueError(
        f"eqx_logs.Window({got}): {fix} Window's arguments are `Window(size, inner='mean', "
        "capacity=None)`: the number of events per window, then the reduction within each."
    )


class Fanout(AbstractReduction):
    """Several reductions of one key at once; the output is a dict from name to output.

    !!! example

        ```python
        eqx_logs.spool(f, reduce=eqx_logs.Fanout(mean="mean", max=eqx_logs.Max()))
        # logs["loss"] == {"mean": ..., "max": ...}
        ```
    """

    reductions: tuple[tuple[str, AbstractReduction], ...]

    def __init__(self, **named: Any):
        if not named:
            raise ValueError("Fanout needs at least one named reduction, e.g. Fanout(mean='mean').")
        # A tuple, not a dict: hashable (a call site may name it) and ordered.
        self.reductions = tuple(
            (name, as_reduction(r, where=f"eqx_logs.Fanout: {name}")) for name, r in named.items()
        )

    def with_key(self, key):
        return Fanout(
            **{
                n: r.with_key(jax.random.fold_in(key, i))
                for i, (n, r) in enumerate(self.reductions)
            }
        )

    def init(self, struct, max_events):
        return {n: r.init(struct, max_events) for n, r in self.reductions}

    def update(self, state, value, valid):
        return {n: r.update(state[n], value, valid) for n, r in self.reductions}

    def merge(self, a, b):
        return {n: r.merge(a[n], b[n]) for n, r in self.reductions}

    def finalize(self, state):
        return {n: r.finalize(state[n]) for n, r in self.reductions}

    def place_batch_axes(self, output, nbatch):
        return {n: r.place_batch_axes(output[n], nbatch) for n, r in self.reductions}
