"""Small helpers for the values the interpreter handles: counters known at trace time, events
broadcast to a key's batch, stop-gradients, vmaps over several leading axes."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._deferred import stop_gradient


def known(x: Any) -> bool:
    """Whether `x` is a value known at trace time (a numpy counter, see `Store.init`)."""
    return isinstance(x, np.ndarray | np.generic)


def counter(shape: tuple[Any, ...], value: Any = 0) -> Any:
    """An int32 counter of one lane per element of `shape` (a key's batch shape), holding
    `value`: a numpy value, known at trace time, unless `shape` is symbolic (a batch dimension
    of `jax.export`, which numpy cannot hold), then an array."""
    if all(isinstance(d, int | np.integer) for d in shape):
        return np.full(shape, value, np.int32)
    return jnp.full(shape, value, jnp.int32)


def widened(x: Any, shape: tuple[int, ...]) -> Any:
    """An event of a site unbatched over some of its key's vmap axes, broadcast along them
    (`_keys.merge`); `x` itself where it has the key's shape."""
    return x if jnp.shape(x) == shape else jnp.broadcast_to(x, shape)


def as_array(x: Any) -> Any:
    return jnp.asarray(x) if known(x) else x


def stop_gradients(tree: Any) -> Any:
    """`lax.stop_gradient` of the traced inexact leaves of `tree` (the others take none)."""
    return jtu.tree_map(stop_gradient, tree)


def plus(count: Any, valid: Any) -> Any:
    """`count + valid`, computed now where both are known at trace time."""
    if known(count) and isinstance(valid, bool | int):
        return count + valid
    return count + jnp.asarray(valid, jnp.int32)


def vmap_n(fun: Callable, nbatch: int) -> Callable:
    """`fun` mapped over `nbatch` leading axes of all its arguments."""
    for _ in range(nbatch):
        fun = jax.vmap(fun)
    return fun
