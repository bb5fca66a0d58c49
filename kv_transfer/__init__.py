"""KV transfer connectors: move a request's KV blocks from a prefill node's cache into a decode node's cache.

    connector = create_connector("auto", ConnectorConfig(name="auto"))   # shm on one host, else ucx
    caches = allocate through connector.kv_allocator() when it gives one (shared memory), else anywhere
    connector.register_kv_caches(KVLayout.for_caches(model_id, kv_caches), kv_caches)  # common.records.KVLayout

Implementations are imported on demand, so that choosing "local" never loads UCX or starts a store.
"""

from __future__ import annotations

import importlib

from kvrelay.kv_transfer._book import TransferBooks
from kvrelay.kv_transfer.base import KVConnector
from kvrelay.kv_transfer.types import (
    ConnectorConfig,
    ConnectorMetrics,
    LayoutMismatchError,
    TransferError,
    TransferResult,
)

CONNECTORS: dict[str, str] = {
    "ucx": "kvrelay.kv_transfer.ucx:UcxConnector",
    "nccl": "kvrelay.kv_transfer.nccl:NcclConnector",
    "local": "kvrelay.kv_transfer.local:LocalConnector",
    "shm": "kvrelay.kv_transfer.shm:ShmConnector",
    "auto": "kvrelay.kv_transfer.auto:AutoConnector",
}


def create_connector(
    name: str, config: ConnectorConfig | None = None, books: TransferBooks | None = None
) -> KVConnector:
    """`books`: share another connector's bookkeeping (a composite connector's parts do)."""
    if name not in CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; choose one of {', '.join(sorted(CONNECTORS))}")
    module_name, _, class_name = CONNECTORS[name].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(config if config is not None else ConnectorConfig(name=name), books)


__all__ = [
    "CONNECTORS",
    "ConnectorConfig",
    "ConnectorMetrics",
    "KVConnector",
    "LayoutMismatchError",
    "TransferError",
    "TransferBooks",
    "TransferResult",
    "create_connector",
]
