"""eqx_logs: imperative-style logging for JAX, done functionally."""

from ._logdict import LogDict as LogDict
from ._primitive import log as log, log_grad as log_grad, scope as scope
from ._reductions import AbstractReduction as AbstractReduction, Stack as Stack
from ._spool import nolog as nolog, spool as spool

__version__ = "0.1.0"
