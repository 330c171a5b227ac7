"""vLLM's KV connector for kvpool: ``kv_connector_module_path="kvpool_agent.connectors.vllm"``,
``kv_connector="KvpoolConnector"`` (docs/vllm.md).

The connector class needs vLLM installed; it is imported on first use, so ``layout`` can be
read (and tested) without vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvpoolConnector", "KvpoolConnectorMetadata"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvpool_agent.connectors.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
