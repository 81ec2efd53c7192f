"""`watch`: events from code the user did not write (the outputs of named primitives, the
carries of loops), at addresses given by their position in the program. `_spec.py`: `Watch`,
what is watched (a policy option, so it imports nothing that logs); `_rewrite.py`: the program
rewritten with the logs in it (`watched`, for spool and tap); `_api.py`: the function
transform `eqx_logs.watch`; `_nonfinite.py`: `first_nonfinite="any"`'s checks (the same
rewrite), with the lanes of a vmap inside the spool from `_lanes.py`."""

from ._spec import (
    CHECK_TAG as CHECK_TAG,
    CHECKED as CHECKED,
    OPERATION as OPERATION,
    WATCH_TAG as WATCH_TAG,
    Watch as Watch,
    as_watch as as_watch,
    checked_key as checked_key,
    checked_names as checked_names,
    is_checked as is_checked,
    operation_of as operation_of,
)
