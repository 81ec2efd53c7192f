"""Quantiles: a mergeable sketch of all elements of all events, with a relative-error bound.
(Stub: helper A implements it.)"""

import equinox as eqx

from ._reductions import AbstractReduction


class Quantiles(AbstractReduction):
    """Quantiles of all elements of all events (stub)."""

    q: tuple[float, ...] = eqx.field(static=True, default=(0.5, 0.9, 0.99))
    relative_error: float = eqx.field(static=True, default=0.01)

    def init(self, struct, max_events):
        raise NotImplementedError

    def update(self, state, value, valid):
        raise NotImplementedError

    def merge(self, a, b):
        raise NotImplementedError

    def finalize(self, state):
        raise NotImplementedError
