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

# Leaves of at most this many elements are packed.
SMALL = 1024


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each leaf of a packed LogDict is: static, one per compiled step."""

    treedef: Any
    # per leaf: (buffer index, offset, shape) for packed leaves, (-1, index in `large`, shape)
    places: tuple[tuple[int, int, tuple[int, ...]], ...]
    dtypes: tuple[np.dtype, ...]
    nbytes: int
    # where the counts are, if all are packed in one buffer and nothing else needs reading
    # (no `first_nonfinite` report): (buffer index, offsets), else None
    counts: tuple[int, tuple[int, ...]] | None


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


def pack(logs: LogDict) -> Packed:
    """`logs` packed, inside the compiled step."""
    leaves, treedef = jax.tree.flatten(logs)
    children, aux = logs.tree_flatten()
    first_leaf = np.cumsum([0] + [len(jax.tree.leaves(c)) for c in children])
    count_leaves = {int(first_leaf[i]) for _, i in aux.plan()[0]}
    groups: dict[Any, list[Any]] = {}
    large, places, dtypes, nbytes = [], [], [], 0
    for leaf in leaves:
        dtype, shape = jnp.result_type(leaf), tuple(np.shape(leaf))
        dtypes.append(np.dtype(dtype))
        nbytes += math.prod(shape) * np.dtype(dtype).itemsize
        if _packable(leaf):
            group = groups.setdefault(np.dtype(dtype), [])
            offset = sum(math.prod(np.shape(x)) for x in group)
            places.append((list(groups).index(np.dtype(dtype)), offset, shape))
            group.append(jnp.ravel(jnp.asarray(leaf, dtype)))
        else:
            places.append((-1, len(large), shape))
            large.append(leaf)
    buffers = tuple(jnp.concatenate(group) for group in groups.values())
    at = {places[i][:2] for i in count_leaves}
    counts = None
    if len({index for index, _ in at}) == 1 and -1 not in dict(at) and logs._nonfinite is None:
        counts = (next(iter(at))[0], tuple(sorted(offset for _, offset in at)))
    layout = Layout(treedef, tuple(places), tuple(dtypes), nbytes, counts)
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
