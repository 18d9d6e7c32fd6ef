"""aiotransfer as a vLLM KV connector (needs vLLM; ``aiotransfer.integrations`` itself does not).

Load it in vLLM with ``KVTransferConfig(kv_connector="AiotransferConnector",
kv_connector_module_path="aiotransfer.integrations.vllm", kv_role=..., kv_connector_extra_config={...})``.
See docs/vllm.md.
"""

from __future__ import annotations

from ._config import ConnectorConfig as ConnectorConfig
from ._connector import AiotransferConnector as AiotransferConnector

__all__ = ["AiotransferConnector", "ConnectorConfig"]
