"""The module path users give vLLM: `kv_connector_module_path = "kvtier.integrations.vllm"`."""

from kvtier.integrations.vllm.connector import KVTierConnector

__all__ = ["KVTierConnector"]
