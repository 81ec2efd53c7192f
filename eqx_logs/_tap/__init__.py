"""tap: log events streamed to a host callback as they happen. The public `tap` and the
wrapper it returns (`_api.py`), its handler (`_handler.py`, `Tap`) and its rule table
(`_rules.py`), chunked delivery with `buffer=k` (`_blocks.py`) and the scans it splits at
trace time (`_split.py`)."""

from ._api import (
    CallbackFailedWarning as CallbackFailedWarning,
    check_buffer as check_buffer,
    check_tap_options as check_tap_options,
    print_callback as print_callback,
    tap as tap,
    tap_with as tap_with,
)
from ._handler import Tap as Tap
