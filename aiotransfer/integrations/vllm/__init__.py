"""aiotransfer as a vLLM KV connector.

Load it in vLLM with ``KVTransferConfig(kv_connector="AiotransferConnector",
kv_connector_module_path="aiotransfer.integrations.vllm", kv_role=..., kv_connector_extra_config={...})``.
See docs/vllm.md. ``AiotransferConnector`` imports vLLM when first looked up; :class:`ConnectorConfig`
(the extra config, validated) and :func:`concurrent_params` (a router's ``kv_transfer_params`` for
concurrent dispatch) do not need vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._config import KEY_ENDPOINT as KEY_ENDPOINT
from ._config import KEY_ERROR as KEY_ERROR
from ._config import KEY_ROOM as KEY_ROOM
from ._config import ConnectorConfig as ConnectorConfig
from ._config import concurrent_params as concurrent_params

if TYPE_CHECKING:
    from ._connector import AiotransferConnector as AiotransferConnector

__all__ = ["KEY_ENDPOINT", "KEY_ERROR", "KEY_ROOM", "AiotransferConnector", "ConnectorConfig", "concurrent_params"]


def __getattr__(name: str) -> Any:
    if name == "AiotransferConnector":
        from ._connector import AiotransferConnector

        return AiotransferConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
