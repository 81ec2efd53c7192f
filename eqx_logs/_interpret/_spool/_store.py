"""The store: each key's state, one reduction state per channel (its value, and each step).

A key's state is a dict: `"count"` (its kept events, per batch lane), `"seen"` (with
`interval=k`: its events, kept or not), and per channel the reduction's state. A key logged
with no value (`log("tick", (), step=i)`: a count only) has no value channel: its count, and
its steps' channels if it has steps. `init` makes it
(`Pending` until the first events, so that straight-line events are folded in at once), `gate`
decides whether an event is kept and counts it, `fold` folds it in, `settle` makes the states
arrays to pass through a function JAX traces (a loop body, a branch), `finish` finalizes them.
"""

import functools
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ... import _compat
from ..._methods import method
from ..._reduce import NeedsBound, Policy, cast_event, check_ranked
from ..._scope import INTERVAL_STEP, kept_step
from .._gate import Interval
from .._keys import KeyInfo, site_list
from .._manual import ManualAxes
from .._plan import Plan
from .._values import as_array, counter, known, plus, stop_gradients, vmap_n, widened

# A channel state not made yet (`Store.init`).
FRESH = object()

# Where a streamed key's events start in a scan body (`_stream.py`).
STREAM = object()


class Pending:
    """A channel's state with events still to fold in, each of them kept for sure: the events
    of straight-line code are folded in together (`AbstractReduction.update_many`), where the
    state is next needed as arrays (`Store.settle`)."""

    __slots__ = ("state", "events")

    def __init__(self, state: Any, events: tuple[Any, ...]):
        self.state, self.events = state, events


class Store:
    """Each key's state (see above), for the keys of `plan`, under the `manual` mesh axes
    around what is evaluated."""

    def __init__(self, plan: Plan, manual: ManualAxes, policy: Policy):
        self.plan, self.manual, self.policy = plan, manual, policy
        self.interval = Interval(policy.interval)
        self.info: dict[str, KeyInfo] = plan.info
        self.reductions: dict[str, Any] = {}  # the keys with a state: their reduction
        self.channels: dict[str, dict[str, Any]] = {}  # key -> channel -> reduction
        self.bounds: dict[str, int | None] = {}  # key -> bound on its (kept) events
        self.per_call: dict[str, int | None] = {}  # key -> its events per call

    def setup(self, counts: dict[str, int | None]) -> dict[str, Any]:
        """The keys' reductions and channels, from the plan's `counts` of the whole program;
        returns the keys' first states."""
        for key in counts:
            info = self.info[key]
            reduction = self.plan.reduction_of(key, info.site_reduce(key))
            if not isinstance(reduction, str):  # "drop"
                # a value logged with `ids=` only for a reduction that takes them
                check_ranked(key, info.lane_struct(), reduction, site_list(info.sites))
                self.reductions[key] = reduction
                step = method(reduction, "step_reduction")()
                value = {"value": reduction} if info.leaves else {}  # (none: a count only)
                self.channels[key] = value | {f"step:{n}": step for n in info.steps}
        self.per_call = counts
        return {key: self.init(key, counts[key]) for key in self.reductions}

    def init(self, key: str, bound: int | None) -> dict[str, Any]:
        info = self.info[key]
        period = self.policy.interval
        if bound is not None and period > 1:
            kept = -(-bound // period)  # a ceiling that stays symbolic
            if INTERVAL_STEP in info.steps:
                # kept where the logged step is a multiple of k: the events that share a step
                # (those of one loop iteration, or of the whole call outside loops) are all kept
                # or all not, so up to that many per kept step (consecutive step values)
                shared = self.plan.iteration_events.get(key, bound)
                if isinstance(shared, int) and isinstance(bound, int):
                    kept = min(bound, shared * kept)
                elif not (isinstance(shared, int) and shared == 1):
                    kept = bound  # symbolic sizes (`jax.export`) that cannot be compared
            bound = kept
        self.bounds[key] = bound
        # counters are numpy values while they are known at trace time: straight-line events
        # are counted (and selected by `interval`) without an operation
        state = {"count": counter(info.batch_shape())}
        if self.policy.interval > 1:
            state["seen"] = counter(info.batch_shape())
        for channel in self.channels[key]:
            if bound is None:  # made now: a reduction that needs a bound says so now
                state[channel] = self.empty(key, channel)
            else:  # made with the first events (`AbstractReduction.init_many`)
                state[channel] = Pending(FRESH, ())
        return state

    def gate(
        self, key: str, state: dict[str, Any], steps: dict[str, Any], mask: Any
    ) -> tuple[dict[str, Any], Any]:
        """Whether an event of `key` is kept (True, or a bool per batch lane), and the state
        with it counted. `mask` says where the event really happened. With `interval=k`, an
        event that carries the step `INTERVAL_STEP` is kept where that step is a multiple of
        k; other events are numbered per key (0, k, 2k, ... are kept)."""
        state, info = dict(state), self.info[key]
        batch = self.manual.batch_shape(info)
        valid = mask
        if self.interval.period > 1:
            if mask is not True:
                mask = self.manual.fit(info, mask)
            seen = state["seen"]
            by_step = self.interval.by_step(steps)
            if by_step and steps[INTERVAL_STEP] is kept_step(self.interval.period):
                # at the step of a call the host saw kept (`logger.jit`'s program for kept
                # steps): no gate on the device, which would change how XLA compiles the
                # call's other work (the model's update drifted from the unlogged step's)
                valid = mask
            else:
                # now where all lanes have seen as many events, known; a step, on the device
                now = not by_step and known(seen) and mask is True
                keeps = self.interval.keeps(self.interval.number(steps, seen), now)
                valid = bool(np.all(keeps)) if now else jnp.logical_and(keeps, mask)
            state["seen"] = plus(seen, mask)
        if not isinstance(valid, bool):
            valid = self.manual.fit(info, valid) if jnp.shape(valid) != batch else valid
        state["count"] = plus(state["count"], valid)
        return state, valid

    def fold(
        self, key: str, state: dict[str, Any], event: dict[str, Any], valid: Any
    ) -> dict[str, Any]:
        """Fold one event into every channel of a key's state, where `valid`. An event kept
        for sure is only recorded (`Pending`)."""
        if valid is False:
            return state
        state = dict(state)
        for channel, reduction in self.channels[key].items():
            s = state[channel]
            if valid is True:
                events = s.events if isinstance(s, Pending) else ()
                base = s.state if isinstance(s, Pending) else s
                state[channel] = Pending(base, (*events, event[channel]))
            else:
                s = self.settle_channel(key, channel, s, arrays=False)
                update = vmap_n(self.reducing(key, reduction, "update"), self.info[key].nbatch)
                state[channel] = update(s, stop_gradients(event[channel]), valid)
        return state

    def settle_channel(self, key: str, channel: str, state: Any, arrays: bool) -> Any:
        if isinstance(state, Pending):
            assert state.state is not STREAM, key  # taken out by the scan rule
            if state.state is FRESH:
                state = self.empty(key, channel, state.events)
            else:
                update_many = self.reducing(key, self.channels[key][channel], "update_many")
                state = vmap_n(update_many, self.info[key].nbatch)(state.state, list(state.events))
            # states take no gradient: one stop per leaf, where the events need one each
            state = stop_gradients(state)
        return jtu.tree_map(as_array, state) if arrays else state

    def settle(
        self, states: dict[str, Any], keys: Any = None, *, arrays: bool = True
    ) -> dict[str, Any]:
        """The states of `keys` (all by default) with their pending events folded in, and as
        arrays (unless `arrays` is false): to thread through a function JAX traces (a loop
        body, a branch)."""
        keys = states if keys is None else keys
        return {
            k: {c: self.settle_channel(k, c, s, arrays) for c, s in states[k].items()} for k in keys
        }

    def event_of(
        self, key: str, value: Any, steps: dict[str, Any], site: str | None = None
    ) -> dict[str, Any]:
        """One event of `key`, cast to its recorded types: the value and every step. (`site`:
        where it was logged, for the error where a Python scalar does not fit the type.)"""
        info = self.info[key]
        n = self.manual.local_axes(info)
        leaves = jtu.tree_leaves(value)
        cast = [cast_event(x, s.dtype, key, site) for x, s in zip(leaves, info.leaves)]
        leaves = [
            self.manual.lead(info, widened(x, s.shape[n:])) for x, s in zip(cast, info.leaves)
        ]
        event = {"value": jtu.tree_unflatten(info.treedef, leaves)}
        for name, s in info.steps.items():
            if name in steps:
                step = self.manual.lead(
                    info, widened(jnp.asarray(steps[name], s.dtype), s.shape[n:])
                )
            else:
                step = self.manual.lead(info, jnp.full(s.shape[n:], -1, s.dtype))
            event[f"step:{name}"] = step
        # events take no gradient: under `grad`, stopped now, so that nothing stacks or reduces
        # them under differentiation (in a jaxpr being built, one stop per state suffices)
        return event if _compat.staging() else stop_gradients(event)

    def lane_struct(self, key: str, channel: str) -> Any:
        """The structure of one lane of one event of `key` in `channel`."""
        info = self.info[key]
        if channel == "value":
            return info.lane_struct()
        s = info.steps[channel.removeprefix("step:")]
        return jax.ShapeDtypeStruct(s.shape[info.nbatch :], s.dtype)

    def empty(self, key: str, channel: str, events: Sequence[Any] = ()) -> Any:
        """A new state of `key` in `channel`, with `events` (all kept) folded in."""
        info, reduction = self.info[key], self.channels[key][channel]
        struct, bound = self.lane_struct(key, channel), self.bounds[key]
        batch = self.manual.batch_shape(info)
        try:
            if events:
                init = functools.partial(self.reducing(key, reduction, "init_many"), struct, bound)
                state = vmap_n(init, info.nbatch)(list(events))
            else:
                state = self.reducing(key, reduction, "init")(struct, bound)
                if batch:
                    state = jtu.tree_map(lambda x: jnp.broadcast_to(x, batch + jnp.shape(x)), state)
        except NeedsBound:
            raise ValueError(
                f"eqx_logs.spool: key {key!r} is logged inside a `lax.while_loop` (at "
                f"{site_list(info.sites)}; a `lax.fori_loop` whose bounds are traced is one, "
                "as are Equinox's and diffrax's loops), so its number of events has no static "
                "bound and "
                f"{type(reduction).__name__} cannot allocate its buffer without one"
                + (
                    f" (the key has no value: the buffer keeps its step "
                    f"{channel.removeprefix('step:')!r}; log it without steps to count its "
                    "events only)"
                    if not info.leaves
                    else ""
                )
                + ". Pass a capacity, e.g. `reduce=eqx_logs.Stack(capacity=N)` (keep='first' "
                "or 'last'), or use a reduction of fixed size (mean, last, ...), or "
                "`lax.scan`/`lax.fori_loop` with static bounds."
            ) from None
        return info.shard_like_values(state) if channel == "value" else state

    def check_size(self, key: str, channel: str, state: Any) -> None:
        """A buffer larger than the device's memory would fail at run time with an
        out-of-memory error naming nothing: fail now, naming the key and the fixes."""
        nbytes = 0
        for x in jtu.tree_leaves(state):
            shape = tuple(getattr(x, "shape", ()))
            if not all(isinstance(d, int) for d in shape):
                return  # symbolic sizes (`jax.export`): not known here
            nbytes += math.prod(shape) * np.dtype(x.dtype).itemsize
        limit = memory_limit()
        if limit is None or nbytes <= limit:
            return
        info, reduction = self.info[key], self.channels[key][channel]
        event = ", ".join(f"{s.dtype}{list(s.shape)}" for s in jtu.tree_leaves(info.lane_struct()))
        raise ValueError(
            f"eqx_logs.spool: key {key!r} (logged at {site_list(info.sites)}) needs a "
            f"{type(reduction).__name__} buffer of {gib(nbytes)} for its {channel} "
            f"({self.bounds[key]} events of {event}), more than the "
            f"{gib(limit)} of memory the device has. Keep fewer events (`interval=k`, in "
            "spool or the Policy), reduce them on the device (`reduce='mean'`, a "
            "`eqx_logs.Window`, a `eqx_logs.Histogram`), or keep the first or last N "
            "(`reduce=eqx_logs.Stack(capacity=N)`)."
        )

    def reducing(self, key: str, reduction: Any, name: str) -> Any:
        """`reduction`'s method `name`, whose `ValueError` or `TypeError` (an event it refuses,
        a user's reduction's bug) gets a note naming the key and where it is logged."""
        fun = method(reduction, name)

        @functools.wraps(fun)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fun(*args, **kwargs)
            except (ValueError, TypeError) as e:
                note = (
                    f"(eqx_logs: in {type(reduction).__name__}.{name} of key {key!r}, logged "
                    f"at {site_list(self.info[key].sites)})"
                )
                if note not in getattr(e, "__notes__", ()):
                    e.add_note(note)
                raise

        return call

    def finish(self, key: str, state: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """One lane of `key`'s outputs: its rows (for an output with an event axis; None if
        it has none), and its finalized channels. A key with no value channel gets its value
        as logged (`()`), and the rows of its steps, whose slots are those the value's would
        be (Stack, Window and Sample reduce steps as values)."""
        channels = self.channels[key]
        slots = [c for c, r in channels.items() if r.event_axes]  # the value's first
        key_rows = None
        if self.reductions[key].event_axes and slots:
            key_rows = method(channels[slots[0]], "rows")(state[slots[0]])
        finalized = {c: self.reducing(key, r, "finalize")(state[c]) for c, r in channels.items()}
        if "value" not in channels:
            finalized["value"] = jtu.tree_unflatten(self.info[key].treedef, [])
        return key_rows, finalized


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


@functools.cache
def memory_limit() -> int | None:
    """This process's first device's memory in bytes (for a CPU: the host's), or None if
    unknown."""
    # this process's own device: asking another process's (`jax.devices()[0]` in a
    # `jax.distributed` run) upsets the collectives of the run
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    if device.platform != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
