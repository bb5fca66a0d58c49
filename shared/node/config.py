"""A node's configuration: one frozen record, built by the CLI (or a test) and handed to the runtime."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.engine.config import EngineConfig
from kvrelay.kv_transfer.types import ConnectorConfig


@dataclass(frozen=True)
class RegistryConfig:
    redis_url: str | None = None  # None: run unregistered (reach the node by its address)
    heartbeat_s: float = 1.0  # registry heartbeat (load) interval
    ttl_s: float = 5.0  # a registration outlives its last heartbeat by this much


@dataclass(frozen=True)
class NodeConfig:
    """Everything but the role: the CLI picks the role's server class and hands both to the runtime."""

    engine: EngineConfig
    connector: ConnectorConfig
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    host: str = "127.0.0.1"  # interface of the gRPC server and the metrics endpoint
    port: int = 0  # gRPC port; 0 picks a free one
    metrics_port: int = 0
    node_id: str | None = None  # default: <role>-<host>-<port>
    served_model_name: str | None = None  # default: the model id
    num_threads: int = 1  # torch CPU threads
    shutdown_timeout_s: float = 30.0
    ready_file: str | None = None  # JSON with the node's addresses, written once it serves
