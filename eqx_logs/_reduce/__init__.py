"""Reductions, the buffers that keep events, the reductions by name and the policy that picks
them per key: what a spool (or tap's buffer) folds events into."""

from ._buffers import (
    Collect as Collect,
    NeedsBound as NeedsBound,
    Sample as Sample,
    Stack as Stack,
    cast_event as cast_event,
)
from ._composites import Fanout as Fanout, Window as Window
from ._names import DROP as DROP, as_reduction as as_reduction
from ._noise_scale import NoiseScale as NoiseScale
from ._options import (
    DEFAULTS as DEFAULTS,
    OPTIONS as OPTIONS,
    TAP_OPTIONS as TAP_OPTIONS,
    PolicyOptions as PolicyOptions,
    TapOptions as TapOptions,
    check_options as check_options,
    document_options as document_options,
)
from ._policy import (
    Policy as Policy,
    unmatched as unmatched,
    with_options as with_options,
    without_watch as without_watch,
)
from ._quantiles import Quantiles as Quantiles, QuantileSketch as QuantileSketch
from ._reductions import (
    EMA as EMA,
    AbstractReduction as AbstractReduction,
    Count as Count,
    First as First,
    Histogram as Histogram,
    Last as Last,
    Max as Max,
    Mean as Mean,
    Min as Min,
    Std as Std,
    Sum as Sum,
    Var as Var,
    nan_or_zero as nan_or_zero,
    select_valid as select_valid,
)
from ._topk import (
    RANKED_FIELDS as RANKED_FIELDS,
    Ranked as Ranked,
    TopK as TopK,
    check_ranked as check_ranked,
    takes_ids as takes_ids,
)
