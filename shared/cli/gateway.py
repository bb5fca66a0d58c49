"""`kvrelay gateway`: the OpenAI-compatible gateway in front of the prefill and decode pools. Every flag's
default is the GatewayConfig field's (kvrelay.gateway.config)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from kvrelay.cli.args import HelpFormatter, UsageError, add_field_flags, add_tls_flags
from kvrelay.cli.log import exit_now
from kvrelay.cli.preflight import check_port
from kvrelay.common.hashing import KV_CACHE_DTYPES
from kvrelay.gateway.config import INDEX_BACKENDS, ROUTING_POLICIES, TOOL_CALL_PARSERS, GatewayConfig

EXAMPLES = """examples:
  kvrelay gateway --model default --redis-url redis://127.0.0.1:6379/0
  kvrelay gateway --model default --prefill 127.0.0.1:50061 --decode 127.0.0.1:50062 --api-key secret
"""


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    d = GatewayConfig()
    g = p.add_argument_group("serving")
    g.add_argument("--model", action="append", default=None,
                   help=f"model folder, .gguf or 'default': its tokenizer and id (the nodes must serve the same); "
                        f"again for each further base model behind this gateway (default: {d.model})")
    add_field_flags(g, d, {
        "host": "interface of the HTTP (and gRPC) API",
        "port": "HTTP port of the OpenAI API, /health and /metrics",
    })
    g.add_argument("--shutdown-grace", "--shutdown-timeout", dest="shutdown_timeout", type=float,
                   default=d.shutdown_timeout,
                   help="seconds open streams get after SIGTERM (new requests get 503 meanwhile); then each ends "
                        "with an error event and [DONE]")
    g.add_argument("--reuse-port", action="store_true", default=d.reuse_port,
                   help="share --port and --grpc-port with another gateway (SO_REUSEPORT): a rolling restart starts "
                        "the new gateway on the same ports, then sends this one SIGUSR1: it stops listening at once "
                        "and its open streams finish (SIGTERM keeps the port, answering 503); kvrelay up passes it")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API accepts in 'model' (default: the model id); NAME=MODEL names another "
                        "--model's (a plain NAME is the first model's)")
    g.add_argument("--api-key", default=os.environ.get("KVRELAY_API_KEY", d.api_key),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $KVRELAY_API_KEY; unset: open)")
    g.add_argument("--api-keys-file", default=d.api_keys_file, metavar="FILE",
                   help="many keys: a JSON or YAML list of {key | key_sha256, tenant, models, priority, rpm, tpm, "
                        "max_concurrent, admin} (docs/security.md); re-read on SIGHUP. Once any key exists every route "
                        "but /health needs one")
    add_tls_flags(g)
    g.add_argument("--ssl-certfile", default=d.ssl_certfile, metavar="PEM",
                   help="serve HTTPS, and TLS on the gRPC API, with this certificate (the one clients know the "
                        "gateway by; vLLM's flag)")
    g.add_argument("--ssl-keyfile", default=d.ssl_keyfile, metavar="PEM", help="the private key of --ssl-certfile")
    g.add_argument("--ssl-ca-certs", default=d.ssl_ca_certs, metavar="PEM",
                   help="with --ssl-certfile: clients must present a certificate this CA signed (HTTP and gRPC)")
    g.add_argument("--public-metrics", action="store_true", default=d.public_metrics,
                   help="/metrics answers without a key (for a Prometheus that sends none)")
    g.add_argument("--tenant-cache-isolation", action=argparse.BooleanOptionalAction,
                   default=d.tenant_cache_isolation,
                   help="each tenant's prompts hash into KV blocks of their own: no tenant reuses, or can time, "
                        "another's cached prefixes")
    g.add_argument("--grpc-port", type=int, default=d.grpc_port,
                   help="port of the gRPC API for internal callers (default: no gRPC API)")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context limit (default: the nodes' smallest)")
    g.add_argument("--log-requests", action="store_true", default=d.log_requests,
                   help="log every HTTP request, and one JSON line per generation (request id, tenant, key, status, "
                        "tokens, TTFT, duration, nodes) on the logger kvrelay.access")
    g.add_argument("--otlp-traces-endpoint", default=d.otlp_traces_endpoint, metavar="URL",
                   help="send OpenTelemetry traces to this OTLP collector (gRPC, e.g. http://127.0.0.1:4317; HTTP "
                        "when it ends in /v1/traces or OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); a "
                        "client's traceparent header is the parent of the request's trace")
    g.add_argument("--fleet-metrics", action=argparse.BooleanOptionalAction, default=d.fleet_metrics,
                   help="/metrics also serves every known node's series (vllm:* and the node's kvrelay:*), labelled "
                        "node_id and role, scraped on demand: one URL for a whole `kvrelay up` fleet. Leave it off "
                        "where Prometheus scrapes the nodes themselves (Kubernetes), or series count twice")
    g.add_argument("--node-metrics-timeout", type=float, default=d.node_metrics_timeout,
                   help="--fleet-metrics: seconds a node's /metrics may take; a slower or dead node is left out "
                        "(kvrelay:node_metrics_up 0)")
    g.add_argument("--tool-call-parser", default=d.tool_call_parser or "none", choices=[*TOOL_CALL_PARSERS, "none"],
                   help="how tool_choice 'auto' finds the model's tool calls (vLLM's names; 'none': never parsed)")
    g.add_argument("--allowed-origins", nargs="+", default=list(d.allowed_origins),
                   help="CORS: origins browsers may call the API from ('*' for any; default: no CORS headers)")
    g.add_argument("--allowed-methods", nargs="+", default=list(d.allowed_methods), help="CORS: allowed methods")
    g.add_argument("--allowed-headers", nargs="+", default=list(d.allowed_headers),
                   help="CORS: allowed request headers")
    g.add_argument("--allow-credentials", action="store_true", default=d.allow_credentials,
                   help="CORS: allow credentials (cookies, auth)")
    r = p.add_argument_group("nodes and routing")
    r.add_argument("--redis-url", default=os.environ.get("KVRELAY_REDIS_URL", d.redis_url),
                   help="the Redis of the block index and node registry: redis://[user:password@]host:port/db, "
                        "rediss:// for TLS, unix://[user:password@]/path (default: $KVRELAY_REDIS_URL)")
    r.add_argument("--index-backend", choices=INDEX_BACKENDS, default=d.index_backend,
                   help="mirror: follow the index's event stream into this process and look up locally; "
                        "redis: one Redis round trip per routing decision")
    r.add_argument("--prefill", action="append", default=list(d.prefill), metavar="HOST:PORT",
                   help="a static prefill node")
    r.add_argument("--decode", action="append", default=list(d.decode), metavar="HOST:PORT",
                   help="a static decode node")
    r.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="the nodes' --kv-cache-dtype: blocks of a quantized KV cache hash apart from the model "
                        "dtype's, and the router looks prompts up as the nodes store them")
    r.add_argument("--routing-policy", choices=ROUTING_POLICIES, default=d.routing_policy,
                   help="cache_aware: the nodes holding the longest cached prefix, weighed against their load; "
                        "round_robin; least_loaded")
    add_field_flags(r, d, {
        "local_prefill_threshold": "the decode node prefills itself when it would compute at most this many prompt "
                                   "tokens",
        "block_size": "fleet-wide KV block size; nodes announcing another are not routed to",
        "refresh_interval": "seconds between registry reads",
        "health_interval": "seconds between static nodes' health checks",
        "startup_timeout": "wait this long for a decode node at start",
        "kv_lease_ms": "reservation lease asked of decode nodes (0: theirs)",
        "prefill_timeout": "deadline of one Prefill call, seconds",
    })
    add_field_flags(p.add_argument_group("failures and overload"), d, {
        "migration_limit": "times one sequence may move to another node after the node under it failed (its "
                           "stream continues where it stopped)",
        "max_concurrent_requests": "generations in progress at once; past it new requests get 429 with Retry-After "
                                   "(0: no bound)",
        "request_timeout": "seconds a request may take in all; past it it is aborted on every node and the client "
                           "gets an error (0: no deadline)",
        "queue_timeout": "seconds a reservation may wait in a full decode node's queue before the request gets 503",
        "capacity_wait": "seconds a request waits for a decode node to be up (a restart) before it gets 503",
        "stall_timeout": "a node whose calls give no sign of life for this long gets a health probe; no answer "
                         "moves its requests elsewhere",
        "probe_timeout": "seconds a node has to answer a health probe (every one: stalled calls, failed calls, "
                         "nodes out of rotation, nodes gone from the registry)",
        "lookup_timeout": "an index lookup slower than this routes without prefix information (Redis hung)",
        "idempotency_ttl": "seconds an answer stays stored for a request sent again with the same "
                           "Idempotency-Key or X-Request-Id (a repeat while it runs waits for it; a stream is "
                           "recorded, and resumes after its Last-Event-ID; 0: off)",
        "stream_resume_grace": "seconds a keyed stream whose clients all left keeps generating for one to "
                               "reconnect with Last-Event-ID; then it is aborted. With Redis, also how long a "
                               "node keeps a keyed sequence whose gateway died, for another gateway to go on "
                               "with it",
        "shed_at": "share of --max-concurrent-requests past which admission is fair across tenants: keys of "
                   "priority < 0 are refused first, then tenants holding more than an equal share",
    })
    limits = p.add_argument_group("limits on input (0: none; each breach is a 400 or 413 naming the field)")
    add_field_flags(limits, d, {
        "max_body_bytes": "request body size, bytes (413 past it)",
        "max_messages": "messages in one chat request",
        "max_prompt_chars": "characters of prompt or message text, checked before tokenizing",
        "max_logit_bias": "logit_bias entries",
        "max_stop": "stop sequences",
        "max_tools": "tools in one request",
        "max_tool_bytes": "bytes of one tool's JSON",
        "max_schema_bytes": "bytes of a structured-output schema, regex, grammar or choice list",
        "max_schema_depth": "nesting depth of a structured-output or tool parameters schema",
        "max_images_per_request": "images in one chat request (a vision-language model)",
        "max_image_bytes": "bytes of one image, encoded (a data: URL's payload or a fetched URL's body)",
        "max_image_pixels": "width x height of one image as decoded",
        "allow_image_urls": "fetch http(s) image URLs in messages (off: only data: URLs; a URL is fetched by the "
                            "gateway, within --max-image-bytes and --image-fetch-timeout)",
        "image_fetch_timeout": "seconds to fetch one image URL",
    })


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """The config from the flags: each field from the flag of its name, the lists as tuples."""
    if not args.redis_url and not args.decode:
        raise ValueError("decode: give --redis-url (node registry) or at least one --decode HOST:PORT")
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(GatewayConfig) if hasattr(args, f.name)}
    models = args.model or [GatewayConfig.model]
    values.update(
        model=models[0], other_models=tuple(models[1:]),
        served_model_names=tuple(args.served_model_name or ()), api_key=args.api_key or None,
        prefill=tuple(args.prefill), decode=tuple(args.decode), allowed_origins=tuple(args.allowed_origins),
        allowed_methods=tuple(args.allowed_methods), allowed_headers=tuple(args.allowed_headers),
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
    )
    return GatewayConfig(**values)


def check_gateway(config: GatewayConfig) -> None:
    """The ports, before the tokenizer and the index load (kvrelay.cli.preflight)."""
    from kvrelay.gateway.auth import KeysFileError, KeyStore

    try:
        KeyStore(config.api_key, config.api_keys_file)
    except KeysFileError as e:
        raise UsageError(str(e)) from None
    try:
        config.serving_tls()
    except ValueError as e:
        raise UsageError(str(e), "--ssl-certfile") from None
    if config.grpc_port == config.port:
        raise UsageError(f"{config.port} is --port too: give the gRPC API a port of its own", "--grpc-port")
    if config.reuse_port:  # a predecessor may hold the ports until it has drained
        return
    check_port(config.host, config.port, "--port")
    if config.grpc_port is not None:
        check_port(config.host, config.grpc_port, "--grpc-port")


def _run(args: argparse.Namespace) -> int:
    from kvrelay.gateway.server import serve

    config = config_from_args(args)
    check_gateway(config)
    exit_now(serve(config, log_level=getattr(args, "log_level", "INFO")))


def register(subparsers) -> None:
    p = subparsers.add_parser("gateway", help="the OpenAI-compatible gateway (HTTP + gRPC)",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=HelpFormatter)
    add_gateway_args(p)
    p.set_defaults(func=_run)
