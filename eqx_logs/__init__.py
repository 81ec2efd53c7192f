"""eqx_logs: imperative-style logging for JAX, done functionally."""

from ._instrument import instrument as instrument
from ._log import log as log, log_grad as log_grad
from ._logdict import LogDict as LogDict, NonfiniteEvent as NonfiniteEvent
from ._noise import log_noise_scale as log_noise_scale
from ._per_example import value_grad_and_norms as value_grad_and_norms
from ._plant import at as at, plant as plant, sow as sow
from ._primitive import LostEventsWarning as LostEventsWarning
from ._reduce import (
    EMA as EMA,
    AbstractReduction as AbstractReduction,
    Collect as Collect,
    Count as Count,
    Fanout as Fanout,
    First as First,
    Histogram as Histogram,
    Last as Last,
    Max as Max,
    Mean as Mean,
    Min as Min,
    NoiseScale as NoiseScale,
    Policy as Policy,
    Quantiles as Quantiles,
    QuantileSketch as QuantileSketch,
    Sample as Sample,
    Stack as Stack,
    Std as Std,
    Sum as Sum,
    TopK as TopK,
    Var as Var,
    Window as Window,
)
from ._scope import scope as scope
from ._spool import nolog as nolog, spool as spool
from ._stats import log_stats as log_stats
from ._tap import CallbackFailedWarning as CallbackFailedWarning, tap as tap
from ._watch import Watch as Watch
from ._watch._api import watch as watch

__version__ = "0.1.0"
