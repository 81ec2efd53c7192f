"""Reductions: how the events of one key become one output, on the accelerator.

The protocol is that of CLU metrics and optax accumulators: `init` makes a state (a pytree
of arrays that can live in a loop carry), `update` folds in one event (only where `valid`),
`merge` combines two states, `finalize` produces the output.
"""

import abc
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Bool, PyTree


class AbstractReduction(eqx.Module):
    """Base class of reductions. Subclasses implement the four methods below."""

    @abc.abstractmethod
    def init(self, struct: PyTree[jax.ShapeDtypeStruct], max_events: int | None) -> PyTree[Array]:
        """The empty state, for events shaped like `struct`. `max_events` is the static upper
        bound on the number of events (None when unbounded, as in a `while_loop`)."""

    @abc.abstractmethod
    def update(
        self, state: PyTree[Array], value: PyTree[Array], valid: bool | Bool[Array, ""]
    ) -> PyTree[Array]:
        """Fold in one event. Where `valid` is false the state must be unchanged."""

    @abc.abstractmethod
    def merge(self, a: PyTree[Array], b: PyTree[Array]) -> PyTree[Array]:
        """The state that has seen the events of `a`, then those of `b`."""

    @abc.abstractmethod
    def finalize(self, state: PyTree[Array]) -> PyTree[Array]:
        """The output for a state."""


def _empty(leaf: jax.ShapeDtypeStruct, n: int) -> Array:
    fill = jnp.nan if jnp.issubdtype(leaf.dtype, jnp.inexact) else 0
    return jnp.full((n, *leaf.shape), fill, leaf.dtype)


class Stack(AbstractReduction):
    """Every event, stacked along a new leading axis in execution order.

    **Arguments:**

    - `capacity`: the number of slots. By default, the static upper bound on the number of
        events, which spool computes; required for logs inside `lax.while_loop`.
    - `keep`: with a capacity smaller than the number of events, `"first"` keeps the first
        `capacity` events, `"last"` the latest ones (a ring buffer), oldest first.

    Real events come first; unused slots hold NaN (inexact dtypes) or 0. The buffer is
    allocated once and written in place inside loops.
    """

    capacity: int | None = eqx.field(default=None, static=True)
    keep: Literal["first", "last"] = eqx.field(default="first", static=True)

    def __check_init__(self):
        if self.capacity is not None and (
            isinstance(self.capacity, bool)
            or not isinstance(self.capacity, int)
            or self.capacity < 1
        ):
            raise ValueError(f"Stack(capacity={self.capacity!r}): capacity must be an int >= 1.")
        if self.keep not in ("first", "last"):
            raise ValueError(f"Stack(keep={self.keep!r}): keep must be 'first' or 'last'.")

    def init(self, struct, max_events):
        size = self.capacity if self.capacity is not None else max_events
        if size is None:
            raise _UnboundedStack()
        buffers = jtu.tree_map(lambda s: _empty(s, size), struct)
        # index: the number of events received.
        return {"buffer": buffers, "index": jnp.zeros((), jnp.int32)}

    def update(self, state, value, valid):
        index = state["index"]
        size = jtu.tree_leaves(state["buffer"])[0].shape[0]
        if size == 0:
            return state
        if self.keep == "last":
            position = index % size
        else:
            position = index
            if self.capacity is not None:  # otherwise the bound is never exceeded
                valid = jnp.logical_and(valid, index < size)

        def write(buf: Array, v: Any) -> Array:
            v = jnp.asarray(v, buf.dtype)
            if valid is not True:
                v = jnp.where(valid, v, buf[jnp.minimum(position, size - 1)])
            zeros = (0,) * v.ndim
            return jax.lax.dynamic_update_slice(buf, v[None], (position, *zeros))

        buffers = jtu.tree_map(write, state["buffer"], value)
        return {"buffer": buffers, "index": index + jnp.asarray(valid, jnp.int32)}

    def merge(self, a, b):
        # Replay b's stored events, oldest first, into a.
        stored = self.finalize(b)
        size = jtu.tree_leaves(stored)[0].shape[0]
        num = jnp.minimum(b["index"], size)

        def body(i, state):
            event = jtu.tree_map(lambda x: x[i], stored)
            return self.update(state, event, i < num)

        return jax.lax.fori_loop(0, size, body, a)

    def finalize(self, state):
        if self.keep == "first":
            return state["buffer"]
        index = state["index"]
        size = jtu.tree_leaves(state["buffer"])[0].shape[0]
        shift = jnp.where(index > size, index % size, 0) if size else 0
        return jtu.tree_map(lambda b: jnp.roll(b, -shift, axis=0), state["buffer"])


class _UnboundedStack(Exception):
    """Raised by `Stack.init` without a bound; the interpreter adds the key and call site."""
