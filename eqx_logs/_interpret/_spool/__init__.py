"""Spool's handler and what only it uses: the store of each key's reduction states, the
first non-finite search, the streaming of events through loops, the advice on unmatched
options. The evaluator (`.._evaluator`) imports none of it."""

from ._advice import warn_unmatched as warn_unmatched
from ._spooling import Spool as Spool
from ._store import memory_limit as memory_limit
