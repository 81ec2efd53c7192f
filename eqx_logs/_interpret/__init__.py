"""The jaxpr interpreter behind `spool`, `tap`, `plant` and the masking of batched conds: one
evaluator, handlers plugged into it, and the pieces they share. See README.md here."""

from .._scope import INTERVAL_STEP as INTERVAL_STEP
from ._evaluator import Interpreter as Interpreter
from ._gate import (
    Interval as Interval,
    items_of as items_of,
    mask_of as mask_of,
    pass_on as pass_on,
    selects as selects,
    steps_of as steps_of,
)
from ._handler import Handler as Handler, Stream as Stream
from ._keys import (
    check_rule_dtypes as check_rule_dtypes,
    keys_of as keys_of,
    site_list as site_list,
)
from ._plan import (
    Counts as Counts,
    Plan as Plan,
    UnhandledPrimitiveError as UnhandledPrimitiveError,
    max_counts as max_counts,
    unbounded as unbounded,
)
from ._spool import Spool as Spool, memory_limit as memory_limit, warn_unmatched as warn_unmatched
from ._values import known as known, vmap_n as vmap_n, widened as widened
