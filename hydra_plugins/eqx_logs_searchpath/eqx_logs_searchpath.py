from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class EqxLogsSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # The schemas the groups extend (`/eqx_logs/logger/jsonl`, ...) are registered before
        # anything is composed (`--help` lists groups before it would import the groups'
        # package). This imports eqx_logs, and so JAX: about half a second at start-up.
        import eqx_logs.config  # noqa: F401

        search_path.append(provider="eqx_logs", path="pkg://eqx_logs.conf")
