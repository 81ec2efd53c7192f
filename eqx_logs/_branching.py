"""Branches that only skip work: a `lax.cond` where the device decides, none on GPUs.

eqx_logs branches in the programs it emits to skip work: a value computed only for logs is
computed inside the `lax.cond` that folds its event in (or writes it into a buffered tap's
block), so an `interval` that skips the event skips the computation (`_deferred.py`), and
`log_stats` takes a careful path only where the quick one cannot serve. On a CPU or a TPU
the device decides which branch runs. XLA:GPU runs a conditional by copying its predicate
to the host and waiting for it (its `ConditionalThunk` blocks the host until the stream is
done, unless conditionals are put in CUDA graphs, which XLA does not do by default). A
`lax.cond` in a compiled training step would make the host wait for the device at every
step, and the loop could no longer dispatch steps ahead of the device.

So on a GPU the work is done, and nothing branches: the expensive branch is one that is also
right where the cheap one is taken. The choice is made when the program is lowered for its
platform (`lax.platform_dependent`): XLA never sees the branch that is not taken, and a
program exported for several platforms carries both.
"""

from collections.abc import Callable
from typing import Any, TypeVar

from jax import lax

_T = TypeVar("_T")

# The platforms whose conditionals wait for the host: there the full branch runs, always.
SELECTING: tuple[str, ...] = ("cuda", "rocm")


def skippable(pred: Any, full: Callable[..., _T], short: Callable[..., _T], *operands: Any) -> _T:
    """`lax.cond(pred, full, short, *operands)`, where `full(*operands)` is also right where
    `pred` is false: the branch is only there to skip `full`'s work. On the platforms in
    `SELECTING` (GPUs), `full(*operands)` unconditionally."""

    def branching(*ops: Any) -> _T:
        return lax.cond(pred, full, short, *ops)

    selecting = {platform: full for platform in SELECTING}
    return lax.platform_dependent(*operands, default=branching, **selecting)
