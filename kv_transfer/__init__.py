"""KV transfer connectors: move a request's KV blocks from a prefill node's cache into a decode node's cache.

    connector = create_connector("ucx", ConnectorConfig(name="ucx", transport="tcp"))
    connector.register_kv_caches(KVLayout.for_caches(model_id, kv_caches), kv_caches)   # shared.records.KVLayout

Implementations are imported on demand, so that choosing "local" never loads UCX or starts a store.
"""

from __future__ import annotations

import importlib

from kv_transfer.base import KVConnector
from kv_transfer.types import ConnectorConfig, ConnectorMetrics, LayoutMismatchError, TransferError, TransferResult

CONNECTORS: dict[str, str] = {
    "ucx": "kv_transfer.ucx:UcxConnector",
    "nccl": "kv_transfer.nccl:NcclConnector",
    "local": "kv_transfer.local:LocalConnector",
}


def create_connector(name: str, config: ConnectorConfig | None = None) -> KVConnector:
    if name not in CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; choose one of {', '.join(sorted(CONNECTORS))}")
    module_name, _, class_name = CONNECTORS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(config if config is not None else ConnectorConfig(name=name))


__all__ = [
    "CONNECTORS",
    "ConnectorConfig",
    "ConnectorMetrics",
    "KVConnector",
    "LayoutMismatchError",
    "TransferError",
    "TransferResult",
    "create_connector",
]
