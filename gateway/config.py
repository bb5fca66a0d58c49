"""The gateway's settings: one record, built from `kvrelay gateway` flags or by tests directly.

This is the one place the gateway's defaults live: the flags take theirs from these fields, and so do the
parts' own configs (discovery, liveness, dispatch, admission, node calls), so that a part built alone (a test,
a benchmark) behaves as it does inside the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.common.hashing import DEFAULT_BLOCK_SIZE
from kvrelay.common.tls import ServingTLS, serving_tls_from_flags

ROUTING_POLICIES = ("cache_aware", "approximate", "round_robin", "least_loaded", "random")  # gateway/policies.py
INDEX_BACKENDS = ("mirror", "redis")
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")


@dataclass(frozen=True)
class GatewayConfig:
    model: str = "default"  # folder, .gguf or 'default': the tokenizer and the model id the nodes must serve
    other_models: tuple[str, ...] = ()  # more base models behind the same gateway (the first is the default)
    # NAME (the first model's) or NAME=MODEL (MODEL as given, or its id); a model named nowhere is served as its id
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    api_keys_file: str | None = None  # JSON/YAML list of keys with tenants, models, limits (gateway.auth)
    # Mutual TLS to the nodes (kvrelay.common.tls): the fleet's CA, this gateway's certificate and key (PEM files)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # TLS of this gateway's HTTP and gRPC APIs (kvrelay.common.tls.ServingTLS; vLLM's flags); None: plain
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # clients must present a certificate this CA signed
    public_metrics: bool = False  # /metrics answers without a key (else only /health does, once keys exist)
    tenant_cache_isolation: bool = True  # each tenant's prompts hash into KV blocks of their own
    shed_at: float = 0.75  # share of max_concurrent_requests past which admission is fair across tenants
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None  # None: no gRPC API
    redis_url: str | None = None
    index_backend: str = "mirror"  # kvrelay.index backend: "mirror" (in-process copy) or "redis" (round trips)
    prefill: tuple[str, ...] = ()  # static host:port addresses
    decode: tuple[str, ...] = ()
    routing_policy: str = "cache_aware"
    local_prefill_threshold: int = 64  # tokens the decode node would compute at most to prefill itself
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_dtype: str = "auto"  # the nodes' --kv-cache-dtype: part of every block hash (common.hashing)
    max_model_len: int | None = None  # None: the smallest any node announces
    shutdown_timeout: float = 30.0
    # --port and --grpc-port shared with a successor (SO_REUSEPORT): a rolling restart starts the new gateway on
    # the same ports, then sends this one SIGUSR1: it stops listening at once and drains (kvrelay up sets it).
    reuse_port: bool = False
    refresh_interval: float = 0.5  # registry poll
    health_interval: float = 2.0  # static nodes' health checks
    startup_timeout: float = 0.0  # wait this long for a decode node before serving (0: serve at once)
    kv_lease_ms: int = 0  # reservation lease asked of decode nodes (0: the node's default)
    prefill_timeout: float = 300.0
    log_requests: bool = False  # uvicorn's access log, and one JSON line per generation (logger kvrelay.access)
    otlp_traces_endpoint: str | None = None  # OTLP collector for this gateway's spans (kvrelay.common.tracing)
    # /metrics also serves every known node's series, labelled node_id and role (kvrelay.gateway.fleet_metrics):
    # `kvrelay up` turns it on; off where Prometheus scrapes the nodes itself, which would count them twice.
    fleet_metrics: bool = False
    node_metrics_timeout: float = 0.5  # seconds a node's /metrics may take before it is left out of a scrape
    tool_call_parser: str | None = "hermes"  # how tool_choice "auto" reads calls (vLLM's names); None: not at all
    allowed_origins: tuple[str, ...] = ()  # CORS: origins allowed to call the API from a browser (empty: no CORS)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # Resilience and admission (docs/architecture.md, "Failures and overload").
    migration_limit: int = 3  # re-dispatches of one sequence after node failures
    max_concurrent_requests: int = 1024  # generations in progress at once; past it: 429 (0: no bound)
    request_timeout: float = 0.0  # seconds; past it a request is aborted everywhere (0: no deadline)
    queue_timeout: float = 600.0  # how long a reservation may wait in a decode node's queue for blocks
    capacity_wait: float = 10.0  # how long a request waits for a decode node to be up before 503
    stall_timeout: float = 5.0  # a node whose calls are this quiet gets a health probe
    probe_timeout: float = 2.0  # ... which it must answer within this (every health probe: liveness, discovery)
    lookup_timeout: float = 0.5  # an index lookup slower than this routes without prefix information
    idempotency_ttl: float = 600.0  # a keyed request's answer (or stream) is replayed this long (0: off)
    stream_resume_grace: float = 30.0  # a keyed stream whose clients all left runs on this long for a reconnect
    # Limits on input size and shape (gateway.input_limits); 0: no limit.
    max_body_bytes: int = 8 << 20
    max_messages: int = 2048
    max_prompt_chars: int = 4 << 20  # a prompt's text, before tokenizing
    max_logit_bias: int = 1024  # entries
    max_stop: int = 64  # stop strings and stop token ids, each
    max_tools: int = 128
    max_tool_bytes: int = 64 << 10  # one tool's JSON
    max_schema_bytes: int = 64 << 10  # a response_format / structured-output schema's JSON
    max_schema_depth: int = 32
    # Images in chat messages (a vision-language model; gateway.images)
    max_images_per_request: int = 8
    max_image_bytes: int = 8 << 20  # one image, encoded
    max_image_pixels: int = 4096 * 4096  # one image, width x height as decoded
    allow_image_urls: bool = False  # fetch http(s) image URLs (else data: URLs only)
    image_fetch_timeout: float = 10.0  # seconds for one image URL

    def serving_tls(self) -> ServingTLS | None:
        """TLS of the HTTP and gRPC APIs (ValueError when the files are not a usable pair)."""
        return serving_tls_from_flags(self.ssl_certfile, self.ssl_keyfile, self.ssl_ca_certs)
