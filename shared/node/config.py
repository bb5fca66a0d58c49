"""A node's configuration: one frozen record, built by the CLI (or a test) and handed to the runtime.

Its defaults are the node commands' (`kvrelay prefill`, `kvrelay decode`): their flags read them from here.
SERVING_ENGINE is what a node changes of the engine's own defaults, which suit an offline batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrelay.common.tls import TLSFiles
from kvrelay.engine.config import EngineConfig, SchedulerConfig, SchedulingPolicy
from kvrelay.kv_transfer.types import ConnectorConfig

# A server's requests arrive over time: the shortest prompt goes first (with aging), so a burst's short prompts
# start decoding while long ones compute; the waiting queue is bounded, past it the gateway answers 429; and a
# reservation or blocks held for a transfer outlive the longest prefill (tens of seconds for a 2k-token prompt
# on one CPU thread) before they are freed unclaimed.
SERVING_ENGINE = EngineConfig(scheduler=SchedulerConfig(policy=SchedulingPolicy.SJF, max_waiting_requests=1024,
                                                        kv_lease_s=120.0))


@dataclass(frozen=True)
class RegistryConfig:
    redis_url: str | None = None  # None: run unregistered (reach the node by its address)
    heartbeat_s: float = 1.0  # registry heartbeat (load) interval
    ttl_s: float = 5.0  # a registration outlives its last heartbeat by this much


@dataclass(frozen=True)
class NodeConfig:
    """Everything but the role: the CLI picks the role's server class and hands both to the runtime."""

    engine: EngineConfig = SERVING_ENGINE
    # auto: shared memory to nodes on this host, `remote` (ucx) to others
    connector: ConnectorConfig = field(default_factory=lambda: ConnectorConfig(name="auto"))
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    host: str = "127.0.0.1"  # interface of the gRPC server and the metrics endpoint
    port: int = 0  # gRPC port; 0 picks a free one
    metrics_port: int = 0  # HTTP port of /metrics and /health; 0 picks a free one
    node_id: str | None = None  # default: <role>-<host>-<port>
    served_model_name: str | None = None  # default: the model id
    num_threads: int | None = None  # torch CPU threads; None: the cores this process may run on / local_nodes
    cpu_cores: tuple[int, ...] = ()  # pin the process to these cores (its torch threads: one each); (): as started
    local_nodes: int = 1  # nodes sharing this machine's cores (oversubscribed OpenMP threads slow every node)
    shutdown_timeout_s: float = 30.0  # how long in-flight requests get to finish after SIGTERM
    ready_file: str | None = None  # JSON with the node's addresses, written once it serves
    otlp_traces_endpoint: str | None = None  # OTLP collector for this node's spans (kvrelay.common.tracing)
    tls: TLSFiles | None = None  # mutual TLS: only callers with a certificate of the fleet's CA (common.tls)
