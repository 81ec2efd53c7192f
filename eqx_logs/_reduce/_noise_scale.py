"""NoiseScale: the gradient noise scale B_simple (McCandlish et al. 2018, appendix A), from
gradient norms at two batch sizes, with moving averages of its numerator and denominator.
(Stub: helper D implements it.)"""

from ._reductions import AbstractReduction


class NoiseScale(AbstractReduction):
    """The gradient noise scale B_simple (stub)."""

    decay: float = 0.99

    def init(self, struct, max_events):
        raise NotImplementedError

    def update(self, state, value, valid):
        raise NotImplementedError

    def merge(self, a, b):
        raise NotImplementedError

    def finalize(self, state):
        raise NotImplementedError
