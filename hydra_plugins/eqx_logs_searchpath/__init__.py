"""Puts eqx_logs' config groups (`logging`, `logger`, `instrument`; `eqx_logs/conf/`) on the
search path of every Hydra application in an environment where eqx_logs is installed, after the
application's own configs (which take precedence), as hydra-colorlog and hydra-submitit ship
theirs. Hydra finds this plugin in its `hydra_plugins` namespace package."""
