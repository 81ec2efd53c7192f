"""A LogDict packed for the trip from a compiled step to the writer thread (`logger.jit`).

Every output of a compiled call costs a buffer and its bookkeeping, on the device and in
Python, each call: a LogDict of three keys has a dozen (values, counts, rows, steps). Packed,
its small leaves travel as one buffer per dtype, concatenated on the device, and the writer
thread cuts them apart again in numpy; large leaves travel as they are (copying them into a
buffer would cost more than their output does).
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _compat
from .._logdict import LogDict
from .._watch import checked_names

# Leaves of at most this many elements are packed.
SMALL = 1024


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """Where each leaf of a packed LogDict is: static, one per compiled step (every call's
    output holds the same object: compared and hashed by identity)."""

    treedef: Any
    # per leaf: (buffer index, offset, shape) for packed leaves, (-1, index in `large`, shape)
    places: tuple[tuple[int, int, tuple[int, ...]], ...]
    dtypes: tuple[np.dtype, ...]
    nbytes: int
    # where the counts are, if all are packed in one buffer and nothing else needs reading
    # (no `first_nonfinite` report, no count known at trace time, in the treedef, above 0):
    # (buffer index, number of leading elements), else None
    counts: tuple[int, int] | None


@jax.tree_util.register_pytree_node_class
class Packed:
    """A LogDict's leaves: `buffers` (one per dtype of its small leaves) and `large`; its
    `layout` is static. (A plain pytree, not an Equinox module: it is read every step, and
    each attribute of a module costs a Python-level lookup.)"""

    __slots__ = ("buffers", "large", "layout")

    def __init__(self, buffers: tuple[Any, ...], large: tuple[Any, ...], layout: Layout):
        self.buffers, self.large, self.layout = buffers, large, layout

    def tree_flatten(self) -> tuple[tuple[Any, ...], Layout]:
        return (self.buffers, self.large), self.layout

    @classmethod
    def tree_unflatten(cls, layout: Layout, children: Any) -> "Packed":
        return cls(*children, layout)


def _packable(x: Any) -> bool:
    """Small, of a plain dtype (not a PRNG key), and not sharded over Explicit mesh axes
    (which a reshape cannot flatten without naming a sharding)."""
    return (
        math.prod(np.shape(x)) <= SMALL
        and not jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.extended)
        and _compat.explicit_spec(jax.typeof(x)) is None
    )


def without_checks(logs: LogDict) -> LogDict:
    """`logs` without the keys of the checks of `first_nonfinite="any"`: the search's own
    bookkeeping, which is in its report (`first_nonfinite`), not in a backend's rows."""
    if logs._nonfinite is None:
        return logs
    checks = checked_names(logs, logs._nonfinite[1][0])
    return logs._without(checks) if checks else logs


def pack(logs: LogDict) -> Packed:
    """`logs` packed, inside the compiled step (without the checks of `first_nonfinite`:
    `without_checks`). The counts go first in their buffer, so that the writer thread tells
    a write without events by its first elements."""
    logs = without_checks(logs)
    leaves, treedef = jax.tree.flatten(logs)
    children, aux = logs.tree_flatten()
    first_leaf = np.cumsum([0] + [len(jax.tree.leaves(c)) for c in children])
    count_leaves = {int(first_leaf[at]) for *_, at in aux.plan()[0] if isinstance(at, int)}
    # (a count known at trace time is in the treedef: a write with one always has events)
    known_events = any(np.any(at[0]) for *_, at in aux.plan()[0] if not isinstance(at, int))
    groups: dict[Any, list[Any]] = {}
    dtypes = tuple(np.dtype(jnp.result_type(leaf)) for leaf in leaves)
    large: list[Any] = []
    places: list[Any] = [None] * len(leaves)
    for i in sorted(range(len(leaves)), key=lambda i: i not in count_leaves):  # (stable)
        leaf, dtype, shape = leaves[i], dtypes[i], tuple(np.shape(leaves[i]))
        if _packable(leaf):
            group = groups.setdefault(dtype, [])
            offset = sum(math.prod(np.shape(x)) for x in group)
            places[i] = (list(groups).index(dtype), offset, shape)
            group.append(jnp.ravel(jnp.asarray(leaf, dtype)))
        else:
            places[i] = (-1, len(large), shape)
            large.append(leaf)
    nbytes = sum(math.prod(shape) * d.itemsize for (*_, shape), d in zip(places, dtypes))
    buffers = tuple(jnp.concatenate(group) for group in groups.values())
    at = [places[i] for i in count_leaves]
    counts = None
    one = len({index for index, *_ in at}) == 1 and at[0][0] >= 0
    if one and not known_events and logs._nonfinite is None:
        counts = (at[0][0], sum(math.prod(shape) for *_, shape in at))
    layout = Layout(treedef, tuple(places), dtypes, nbytes, counts)
    return Packed(buffers, tuple(large), layout)


def stand_in(layout: Layout) -> LogDict:
    """A LogDict of the layout's shapes and dtypes, its values zeros (views of one zero)."""
    leaves = [
        np.broadcast_to(np.zeros((), dtype), shape)
        for (_, _, shape), dtype in zip(layout.places, layout.dtypes)
    ]
    return jax.tree.unflatten(layout.treedef, leaves)


def unpack(packed: Packed, buffers: list[np.ndarray]) -> LogDict:
    """The LogDict of `packed`, its small leaves cut from `buffers` (on the host), its large
    ones as they are."""
    leaves = [
        packed.large[at] if index < 0 else buffers[index][at : at + math.prod(shape)].reshape(shape)
        for index, at, shape in packed.layout.places
    ]
    return jax.tree.unflatten(packed.layout.treedef, leaves)
