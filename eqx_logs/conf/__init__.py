"""eqx_logs' Hydra config groups, shipped with the package: `logging` (policies), `logger`
(loggers) and `instrument`.

An application puts them on its Hydra search path, in its primary config:

```yaml
hydra:
  searchpath:
    - pkg://eqx_logs.conf
```

and can then choose `logging=train`, `logger=tensorboard`, `instrument=all`, ... on the command
line, from an installed package as from a checkout. The schemas behind them are registered by
importing `eqx_logs.config`.
"""

# Hydra imports this package to read the groups: the schemas they extend (`jsonl_base`, ...)
# are registered with it.
from .. import config as _config  # noqa: E402, F401
