"""Reductions: how the events of one key become one output, on the accelerator.

The protocol is that of CLU metrics and optax accumulators: `init` makes a state (a pytree
of arrays that can live in a loop carry), `update` folds in one event (only where `valid`),
`merge` combines two states, `finalize` produces the output.
"""

import abc
from typing import Any

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

    Real events come first; unused slots hold NaN (inexact dtypes) or 0. The buffer holds the
    static upper bound on the number of events, so it is allocated once and written in place
    inside loops.
    """

    def init(self, struct, max_events):
        if max_events is None:
            raise _UnboundedStack()
        buffers = jtu.tree_map(lambda s: _empty(s, max_events), struct)
        return {"buffer": buffers, "index": jnp.zeros((), jnp.int32)}

    def update(self, state, value, valid):
        index = state["index"]
        capacity = jtu.tree_leaves(state["buffer"])[0].shape[0]
        if capacity == 0:
            return state

        def write(buf: Array, v: Any) -> Array:
            v = jnp.asarray(v, buf.dtype)
            if valid is not True:
                v = jnp.where(valid, v, buf[index])
            zeros = (0,) * v.ndim
            return jax.lax.dynamic_update_slice(buf, v[None], (index, *zeros))

        buffers = jtu.tree_map(write, state["buffer"], value)
        return {"buffer": buffers, "index": index + jnp.asarray(valid, jnp.int32)}

    def merge(self, a, b):
        capacity = jtu.tree_leaves(a["buffer"])[0].shape[0]
        positions = jnp.arange(capacity)
        # b's real events go right after a's.
        source = positions - a["index"]

        def combine(buf_a: Array, buf_b: Array) -> Array:
            taken = jnp.take(buf_b, jnp.clip(source, 0, capacity - 1), axis=0)
            mask = (source >= 0).reshape((capacity,) + (1,) * (buf_a.ndim - 1))
            return jnp.where(mask, taken, buf_a)

        buffers = jtu.tree_map(combine, a["buffer"], b["buffer"])
        return {"buffer": buffers, "index": jnp.minimum(a["index"] + b["index"], capacity)}

    def finalize(self, state):
        return state["buffer"]


class _UnboundedStack(Exception):
    """Raised by `Stack.init` without a bound; the interpreter adds the key and call site."""
