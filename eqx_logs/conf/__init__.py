"""eqx_logs' Hydra config groups, shipped with the package: `logging` (policies), `logger`
(loggers) and `instrument`.

The package's Hydra plugin (`hydra_plugins/eqx_logs_searchpath`) puts them on every Hydra
application's search path, after the application's own configs, so an application picks
`logging=train`, `logger=tensorboard`, `instrument=all`, ... from its defaults list or the
command line, from an installed package as from a checkout. The schemas the groups extend
(`/eqx_logs/logger/jsonl`, ...) are registered by importing `eqx_logs.config`.
"""

# Hydra imports this package to read the groups: with it, the schemas, for a search path
# that names `pkg://eqx_logs.conf` itself (the plugin registers them before anything else).
from .. import config as _config  # noqa: E402, F401
