"""`kvrelay gateway`: the OpenAI-compatible gateway in front of the prefill and decode pools."""

from __future__ import annotations

import argparse
import os

from kvrelay.cli.args import HelpFormatter
from kvrelay.common.hashing import DEFAULT_BLOCK_SIZE

EXAMPLES = """examples:
  kvrelay gateway --model default --redis-url redis://127.0.0.1:6379/0
  kvrelay gateway --model default --prefill 127.0.0.1:50061 --decode 127.0.0.1:50062 --api-key secret
"""


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("serving")
    g.add_argument("--model", default="default",
                   help="model folder, .gguf or 'default': its tokenizer and id (the nodes must serve the same)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="names the API accepts in 'model' (default: the model id)")
    g.add_argument("--api-key", default=os.environ.get("KVRELAY_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $KVRELAY_API_KEY; unset: open)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API, /health and /metrics")
    g.add_argument("--grpc-port", type=int, default=None, help="port of the gRPC API for internal callers")
    g.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the nodes' smallest)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds SIGTERM lets open streams finish")
    g.add_argument("--log-requests", action="store_true", help="log every HTTP request")
    g.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "llama3_json", "mistral", "none"],
                   help="how tool_choice 'auto' finds the model's tool calls (vLLM's names; 'none': never parsed)")
    g.add_argument("--allowed-origins", nargs="+", default=[],
                   help="CORS: origins browsers may call the API from ('*' for any; default: no CORS headers)")
    g.add_argument("--allowed-methods", nargs="+", default=["*"], help="CORS: allowed methods")
    g.add_argument("--allowed-headers", nargs="+", default=["*"], help="CORS: allowed request headers")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, auth)")
    r = p.add_argument_group("nodes and routing")
    r.add_argument("--redis-url", default=None, help="the Redis of the block index and node registry")
    r.add_argument("--index-backend", choices=["mirror", "redis"], default="mirror",
                   help="mirror: follow the index's event stream into this process and look up locally; "
                        "redis: one Redis round trip per routing decision")
    r.add_argument("--prefill", action="append", default=[], metavar="HOST:PORT", help="a static prefill node")
    r.add_argument("--decode", action="append", default=[], metavar="HOST:PORT", help="a static decode node")
    r.add_argument("--routing-policy", choices=["cache_aware", "round_robin", "least_loaded"], default="cache_aware")
    r.add_argument("--local-prefill-threshold", type=int, default=64,
                   help="the decode node prefills itself when it would compute at most this many prompt tokens")
    r.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="fleet-wide KV block size; nodes announcing another are not routed to")
    r.add_argument("--refresh-interval", type=float, default=0.5, help="seconds between registry reads")
    r.add_argument("--health-interval", type=float, default=2.0, help="seconds between static nodes' health checks")
    r.add_argument("--startup-timeout", type=float, default=0.0, help="wait this long for a decode node at start")
    r.add_argument("--kv-lease-ms", type=int, default=0, help="reservation lease asked of decode nodes (0: theirs)")
    r.add_argument("--prefill-timeout", type=float, default=300.0, help="deadline of one Prefill call, seconds")
    f = p.add_argument_group("failures and overload")
    f.add_argument("--migration-limit", type=int, default=3,
                   help="times one sequence may move to another node after the node under it failed (its stream "
                        "continues where it stopped)")
    f.add_argument("--max-concurrent-requests", type=int, default=1024,
                   help="generations in progress at once; past it new requests get 429 with Retry-After (0: no bound)")
    f.add_argument("--request-timeout", type=float, default=0.0,
                   help="seconds a request may take in all; past it it is aborted on every node and the client gets "
                        "an error (0: no deadline)")
    f.add_argument("--queue-timeout", type=float, default=600.0,
                   help="seconds a reservation may wait in a full decode node's queue before the request gets 503")
    f.add_argument("--capacity-wait", type=float, default=10.0,
                   help="seconds a request waits for a decode node to be up (a restart) before it gets 503")
    f.add_argument("--stall-timeout", type=float, default=5.0,
                   help="a node whose calls give no sign of life for this long gets a health probe; no answer moves "
                        "its requests elsewhere")
    f.add_argument("--probe-timeout", type=float, default=2.0, help="seconds a node has to answer a health probe")
    f.add_argument("--lookup-timeout", type=float, default=0.5,
                   help="an index lookup slower than this routes without prefix information (Redis hung)")


def config_from_args(args: argparse.Namespace):
    from kvrelay.gateway.config import GatewayConfig

    if not args.redis_url and not args.decode:
        raise ValueError("decode: give --redis-url (node registry) or at least one --decode HOST:PORT")
    return GatewayConfig(
        model=args.model, served_model_names=tuple(args.served_model_name or ()), api_key=args.api_key or None,
        host=args.host, port=args.port, grpc_port=args.grpc_port, redis_url=args.redis_url,
        prefill=tuple(args.prefill), decode=tuple(args.decode), routing_policy=args.routing_policy,
        local_prefill_threshold=args.local_prefill_threshold, block_size=args.block_size,
        max_model_len=args.max_model_len, shutdown_timeout=args.shutdown_timeout,
        refresh_interval=args.refresh_interval, health_interval=args.health_interval,
        startup_timeout=args.startup_timeout, kv_lease_ms=args.kv_lease_ms, prefill_timeout=args.prefill_timeout,
        log_requests=args.log_requests, index_backend=args.index_backend,
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
        allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
        migration_limit=args.migration_limit,
        max_concurrent_requests=args.max_concurrent_requests, request_timeout=args.request_timeout,
        queue_timeout=args.queue_timeout, capacity_wait=args.capacity_wait, stall_timeout=args.stall_timeout,
        probe_timeout=args.probe_timeout, lookup_timeout=args.lookup_timeout,
    )


def _run(args: argparse.Namespace) -> int:
    from kvrelay.gateway.server import serve

    return serve(config_from_args(args), log_level=getattr(args, "log_level", "INFO"))


def register(subparsers) -> None:
    p = subparsers.add_parser("gateway", help="the OpenAI-compatible gateway (HTTP + gRPC)",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=HelpFormatter)
    add_gateway_args(p)
    p.set_defaults(func=_run)
