"""The module path users give vLLM: `kv_connector_module_path = "kvtier.integrations.vllm"`.

vLLM looks the connector up by name on this module (`getattr`), so it is imported on that first lookup: the
package's other modules (the tiny model, the stats) load without importing vLLM, and so does everything that
imports them (`kvtier rollout` checks its arguments in a second, and drives a remote server without vLLM here).
"""

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
