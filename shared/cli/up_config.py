"""`kvrelay up`'s settings: one record, its flags' defaults (kvrelay.cli.up reads them), and the fleet's models."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.common.hashing import DEFAULT_BLOCK_SIZE
from kvrelay.engine.args import OFFLOAD_FIELDS
from kvrelay.gateway.config import GatewayConfig
from kvrelay.node.config import NodeConfig

_NODE, _GATEWAY = NodeConfig(), GatewayConfig()

# UpConfig's fields every node's engine takes as they are, when set (the engine field and flag of the same name).
NODE_ENGINE_FIELDS = ("device", "quantization", "max_model_len", "kv_cache_memory", "kv_cache_dtype",
                      "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "seed",
                      "max_waiting_requests", "max_loras", "max_lora_rank", "max_cpu_loras",
                      "max_pooling_tokens_per_step", "priority_step_gap", *OFFLOAD_FIELDS)


@dataclass(frozen=True)
class FleetModel:
    """One base model of the fleet, and its engines: an entry of a fleet file (--fleet-file), or one --model. A knob
    left None takes the fleet's flag (--prefill, --decode, --dtype)."""

    model: str
    served_model_names: tuple[str, ...] = ()  # empty: the model id
    prefill: int | None = None
    decode: int | None = None
    colocated: bool = False
    dtype: str | None = None
    lora_modules: tuple[str, ...] = ()  # NAME=PATH adapters its nodes load at start (beside --lora-modules)


@dataclass(frozen=True)
class UpConfig:
    """What `kvrelay up` starts, and how: its flags' defaults. A per-node or gateway knob left None is not passed
    on, and the part's own default applies (NodeConfig's, GatewayConfig's)."""

    model: str = _GATEWAY.model
    models: tuple[FleetModel, ...] = ()  # several base models (repeated --model, or --fleet-file); empty: `model`
    fleet_file: str | None = None
    served_model_name: tuple[str, ...] = ()  # empty: the model id; with several models, NAME=MODEL picks one
    dtype: str = _NODE.engine.model.dtype
    device: str | None = None
    quantization: str | None = None  # gguf: every node serves a .gguf model's quantized blocks as they are
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int | None = None  # None: the model's
    kv_cache_memory: int | None = None  # None: the engine's
    kv_cache_dtype: str | None = None  # None: the engine's (auto); the gateway hashes blocks for it too
    kv_offload_bytes: int | None = None  # the host's offload tier (every node shares it); None: the engine's (off)
    kv_offload_path: str | None = None
    kv_offload_dir: str | None = None
    kv_offload_disk_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool | None = None
    seed: int | None = None
    speculative_config: str | None = None  # JSON, as vLLM takes it; decode nodes only
    max_waiting_requests: int | None = None
    max_pooling_tokens_per_step: int | None = None
    priority_step_gap: int | None = None
    scheduling_policy: str | None = None
    enable_lora: bool = False  # vLLM's LoRA flags, handed to every node
    lora_modules: tuple[str, ...] = ()
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    tensor_parallel_size: int = 1  # vLLM's; only 1
    pipeline_parallel_size: int = 1
    prefill: int | None = None  # None: placement() decides
    decode: int | None = None
    colocated: bool = False
    connector: str | None = None  # None: auto, local for a colocated engine
    reserved_cores: int = 0  # cores kept for the gateway and Redis; the engines are pinned to the rest (0: unpinned)
    gateways: int = 1  # gateway processes sharing the HTTP and gRPC ports (SO_REUSEPORT), the nodes and Redis
    routing_policy: str = _GATEWAY.routing_policy
    redis_url: str | None = None  # None: start an embedded redis-server
    restart: bool = False
    host: str = "127.0.0.1"
    port: int = _GATEWAY.port
    grpc_port: int | None = None  # None: --port + 1 when free, else a free one (`up` always serves gRPC)
    api_key: str | None = None
    api_keys_file: str | None = None  # the gateway's --api-keys-file (tenants, limits)
    otlp_traces_endpoint: str | None = None  # every process's spans go to this OTLP collector
    public_metrics: bool = False  # the gateway's /metrics answers without a key
    log_requests: bool = False  # the gateway's access log: one JSON line per generation (kvrelay.access)
    fleet_tls: bool = True  # a CA of the fleet's own and mutual TLS between the gateway and the nodes
    tool_call_parser: str | None = None  # None: the gateway's
    enable_auto_tool_choice: bool = False  # vLLM's; auto tool choice is on whenever a parser is set
    allowed_origins: tuple[str, ...] = ()
    max_concurrent_requests: int | None = None
    request_timeout: float | None = None
    migration_limit: int = _GATEWAY.migration_limit
    shutdown_grace: float = 10.0  # shorter than a lone node's or gateway's: Ctrl-C should not take long
    ready_timeout: float = 600.0
    log_dir: str | None = None  # None: kvrelay.cli.run_logs.default_log_root()
    keep_logs: int = 5

    def fleet_models(self) -> tuple[FleetModel, ...]:
        """Every base model of the fleet, the first being the gateway's default."""
        if self.models:
            return self.models
        return (FleetModel(self.model, self.served_model_name, self.prefill, self.decode, self.colocated),)
