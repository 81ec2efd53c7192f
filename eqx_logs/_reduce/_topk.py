"""TopK: the k largest (or smallest) elements of all events, with their ids and steps.
(Stub: helper B implements it.)"""

import equinox as eqx

from ._reductions import AbstractReduction


class TopK(AbstractReduction):
    """The k largest (or smallest) elements of all events, with ids and steps (stub)."""

    k: int = eqx.field(static=True, default=8)
    largest: bool = eqx.field(static=True, default=True)

    def init(self, struct, max_events):
        raise NotImplementedError

    def update(self, state, value, valid):
        raise NotImplementedError

    def merge(self, a, b):
        raise NotImplementedError

    def finalize(self, state):
        raise NotImplementedError
