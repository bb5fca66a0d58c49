"""`kvrelay up`: a whole fleet on one machine (embedded Redis, prefill and decode nodes, the gateway).

Lifecycle:
1. Check everything that can be checked before loading (kvrelay.cli.preflight): the fleet's shape, ports, sizes,
   --max-model-len against the model's config. A failure is one line naming the flag, exit code 2, in a second.
2. Start Redis (unless --redis-url), the nodes, then the gateway (kvrelay.cli.fleet), each in its own process
   group, logging into this run's folder under --log-dir (the newest --keep-logs runs are kept).
3. Report progress while the model loads; once the gateway routes to every node, print the URLs, every port,
   and ready-to-paste snippets.
4. Supervise: a child that exits is reported (restarted with --restart).
5. First Ctrl-C / SIGTERM: the gateway stops admitting (503 with Retry-After), open streams get
   --shutdown-grace, then a final error event and [DONE]; then the nodes; Redis last. A second Ctrl-C kills
   every process group at once. Either way nothing is left running, and no traceback is printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import time

import httpx

from kvrelay.cli.args import CommandParser, HelpFormatter, UsageError, add_field_flags
from kvrelay.cli.fleet import MIN_CORES_PER_ENGINE, Child, Fleet, FleetPorts, Interrupted, placement, plan_children
from kvrelay.cli.fleet_file import read_fleet_file
from kvrelay.cli.preflight import check_at_least, check_engine, check_fleet_shape, check_port, derived_port
from kvrelay.cli.run_logs import RunLogs
from kvrelay.cli.up_config import NODE_ENGINE_FIELDS, FleetModel, UpConfig
from kvrelay.common.hashing import KV_CACHE_DTYPES
from kvrelay.common.system import format_cores, usable_cores
from kvrelay.common.units import byte_size
from kvrelay.engine.args import (
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    add_offload_args,
    lora_module,
    speculative_json,
)
from kvrelay.engine.config import EngineConfig
from kvrelay.gateway.config import ROUTING_POLICIES, TOOL_CALL_PARSERS, GatewayConfig
from kvrelay.kv_transfer import CONNECTORS
from kvrelay.node.config import NodeConfig

__all__ = ["Child", "Fleet", "UpConfig", "config_from_args", "placement", "plan_children", "register", "run_up"]

logger = logging.getLogger("kvrelay.up")

_NODE, _GATEWAY = NodeConfig(), GatewayConfig()


def config_from_args(args: argparse.Namespace) -> UpConfig:
    """The config from the flags; several --model flags, or --fleet-file, give the fleet several models."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(UpConfig) if hasattr(args, f.name)}
    for name in ("allowed_origins", "served_model_name", "lora_modules"):
        values[name] = tuple(values[name] or ())
    specs = args.model or [UpConfig.model]
    if args.fleet_file:
        if args.model:
            raise UsageError("give the models in the fleet file or with --model, not both", "--fleet-file")
        values["models"] = read_fleet_file(args.fleet_file)
        specs = [values["models"][0].model]
    elif len(specs) > 1:
        values["models"] = tuple(FleetModel(m, tuple(n for n in values["served_model_name"]
                                                    if _names_model(n, m, i == 0)))
                                 for i, m in enumerate(specs))
    values["model"] = specs[0]
    return UpConfig(**values)


def _names_model(entry: str, model: str, first: bool) -> bool:
    """Whether a --served-model-name entry names `model` (NAME=MODEL, or a plain NAME for the first model)."""
    name, sep, target = entry.partition("=")
    return target == model if sep else first


# ---------------------------------------------------------------------------------------------- checks


def preflight(config: UpConfig) -> FleetPorts:
    """Everything `up` can check before starting a process (UsageError naming the flag); the fleet's ports."""
    check_fleet_shape(config.prefill, config.decode, config.colocated)
    for flag, value in (("--tensor-parallel-size", config.tensor_parallel_size),
                        ("--pipeline-parallel-size", config.pipeline_parallel_size)):
        if value != 1:
            raise UsageError(f"{value} is not supported: kvrelay runs each engine in one process on one device (no "
                             "tensor or pipeline parallelism); scale out with more nodes (--prefill N --decode M)",
                             flag)
    check_at_least([("--max-concurrent-requests", config.max_concurrent_requests, 0),
                    ("--request-timeout", config.request_timeout, 0.0),
                    ("--migration-limit", config.migration_limit, 0),
                    ("--shutdown-grace", config.shutdown_grace, 0.0),
                    ("--ready-timeout", config.ready_timeout, 1.0), ("--keep-logs", config.keep_logs, 1),
                    ("--reserved-cores", config.reserved_cores, 0), ("--gateways", config.gateways, 1)])
    if config.reserved_cores and config.reserved_cores >= len(usable_cores()):
        raise UsageError(f"{config.reserved_cores} leaves no core for the engines: this process may use "
                         f"{len(usable_cores())} ({format_cores(usable_cores())})", "--reserved-cores")
    if config.api_keys_file:
        from kvrelay.gateway.auth import KeysFileError, KeyStore

        try:
            KeyStore(keys_file=config.api_keys_file)
        except KeysFileError as e:
            raise UsageError(str(e)) from None
    for model in config.fleet_models():
        check_fleet_shape(model.prefill, model.decode, model.colocated)
        check_engine(node_engine(config, model))
    check_port(config.host, config.port, "--port", "; another server (a kvrelay up?) listens there: pick another "
                                                   "--port")
    if config.grpc_port is not None:
        if config.grpc_port == config.port:
            raise UsageError(f"{config.grpc_port} is --port too: give the gRPC API a port of its own", "--grpc-port")
        check_port(config.host, config.grpc_port, "--grpc-port", "; leave --grpc-port out to get a free one")
    where = placement(config)
    grpc = config.grpc_port or derived_port(config.host, config.port, 1, taken=[config.port])
    return FleetPorts.pick(config, where, grpc)


def node_engine(config: UpConfig, model: FleetModel | None = None) -> EngineConfig:
    """The engine config each node of `model` (None: the first) will run (its own defaults, with what `up` passes
    on set over them)."""
    model = model or config.fleet_models()[0]
    names = (*NODE_ENGINE_FIELDS, "enable_prefix_caching")
    values = {name: getattr(config, name) for name in names if getattr(config, name) is not None}
    if config.scheduling_policy is not None:
        values["policy"] = config.scheduling_policy
    adapters = (*config.lora_modules, *model.lora_modules)
    try:
        return _NODE.engine.with_kwargs(model=model.model, dtype=model.dtype or config.dtype,
                                        block_size=config.block_size, enable_lora=config.enable_lora or bool(adapters),
                                        lora_modules=adapters, **values)
    except ValueError as e:  # a LoRA setting the engine refuses (max_cpu_loras below max_loras, ...)
        flag, _, message = str(e).partition(": ")
        raise UsageError(message or str(e), "--" + flag.replace("_", "-") if message else None) from None


# ---------------------------------------------------------------------------------------------- run


def run_up(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    ports = preflight(config)
    where = placement(config)
    logs = RunLogs.create(config.log_dir, config.keep_logs)
    fleet = Fleet(config, where, ports, logs.path)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll
    _handle_signals(fleet)
    logger.info("placement: %s", where.note)
    if where.reserved:  # Redis and the gateway start from here: they inherit it (each node pins itself)
        os.sched_setaffinity(0, where.reserved)
    logger.info("logs in %s (the newest %d runs are kept)", logs.path, config.keep_logs)
    code = 0
    try:
        fleet.start()
        fleet.wait_ready(config.ready_timeout)
        print(banner(fleet), flush=True)
        fleet.supervise()
    except Interrupted:
        pass
    except (RuntimeError, OSError) as e:  # a child failed to start (with its log's tail), or Redis did
        logger.error("%s", e)
        code = 1
    logger.info("stopping the fleet (Ctrl-C again kills it at once)")
    start = time.monotonic()
    fleet.stop()
    logger.info("fleet stopped in %.1f s", time.monotonic() - start)
    logs.close()
    return code


def _handle_signals(fleet: Fleet) -> None:
    """The first Ctrl-C / SIGTERM asks the fleet to stop (the main loop notices within a quarter second); the
    second kills every process group at once and exits 130. Nothing is raised, so nothing prints a traceback."""

    def on_signal(signum, frame) -> None:
        if fleet.stop_requested:
            os.write(2, b"\nkvrelay up: killing the fleet\n")
            fleet.kill()
            os._exit(130)
        fleet.stop_requested = True

    def on_hangup(signum, frame) -> None:
        fleet.roll_requested = True

    # Both explicitly: a launcher started from a non-interactive shell's background job inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)


def mask(key: str) -> str:
    """An API key as the banner shows it: its first 3 characters (a prefix tells keys apart), the rest hidden."""
    return key[:3] + "..." if len(key) > 8 else "***"


def banner(fleet: Fleet) -> str:
    config, where, ports = fleet.config, fleet.placement, fleet.ports
    base = f"{fleet.url}/v1"
    model = (config.served_model_name[0].partition("=")[0] if config.served_model_name and not config.models
             else _served_name(fleet))
    models = ", ".join(_served_names(fleet)) if config.models else model
    nodes = "; ".join(f"{name} gRPC {config.host}:{grpc}, metrics {config.host}:{metrics}"
                      for name, (grpc, metrics) in ports.nodes.items())
    if config.api_keys_file:
        key_line = (f"  API keys        : {config.api_keys_file} (SIGHUP to the gateway re-reads it; the snippets "
                    "read yours from $KVRELAY_API_KEY)\n")
        curl_key, py_key = "-H \"Authorization: Bearer $KVRELAY_API_KEY\" ", "os.environ['KVRELAY_API_KEY']"
    elif config.api_key:
        key_line = f"  API key         : {mask(config.api_key)} (the snippets read it from $KVRELAY_API_KEY)\n"
        curl_key, py_key = "-H \"Authorization: Bearer $KVRELAY_API_KEY\" ", "os.environ['KVRELAY_API_KEY']"
    else:
        key_line, curl_key, py_key = "", "", "'unused'"
    keyed = (config.api_keys_file or config.api_key) and not config.public_metrics
    metrics_note = " (send the API key, or start with --public-metrics)" if keyed else ""
    return f"""
kvrelay is up: {where.layout()}, {"models" if config.models else "model"} {models}
  OpenAI base URL : {base}
  metrics         : {fleet.url}/metrics (kvrelay:* and every node's vllm:*, labelled node_id and role){metrics_note}
  gRPC API        : {config.host}:{ports.grpc}
  nodes           : {nodes}
{key_line}  logs            : {fleet.log_dir}

curl {base}/chat/completions -H 'Content-Type: application/json' {curl_key}\\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'

python -c "import os; from openai import OpenAI; c = OpenAI(base_url='{base}', api_key={py_key}); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}], \\
max_tokens=32).choices[0].message.content)"

Ctrl-C stops the fleet (the gateway, the nodes, then Redis); a second Ctrl-C kills it at once.
kill -HUP {os.getpid()} restarts every process, one at a time, without a lost request (a rolling restart).
"""


def _served_name(fleet: Fleet) -> str:
    names = _served_names(fleet)
    return names[0] if names else fleet.config.model


def _served_names(fleet: Fleet) -> list[str]:
    """The models the gateway lists (adapters too), in its order."""
    try:
        r = httpx.get(f"{fleet.url}/v1/models", timeout=2, headers=fleet.headers)
        return [card["id"] for card in r.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return []


# ---------------------------------------------------------------------------------------------- flags


def register(sub) -> None:
    d = UpConfig()
    engine, nodes = _NODE.engine, "the nodes' default"
    p: CommandParser = sub.add_parser(
        "up", help="bring up a whole fleet on this machine", formatter_class=HelpFormatter,
        description="Start an embedded Redis, prefill and decode nodes and the gateway; print the URL. Flags keep "
                    "vLLM's names (`vllm serve`); each is checked before anything loads.")
    m = p.add_argument_group("model and engines (every node)")
    m.add_argument("--model", action="append", default=None,
                   help="HF model folder, .gguf file, or 'default' (SmolLM2-135M-Instruct, converted once); give it "
                        "again for more base models in the fleet, each with engines of its own (the first is the "
                        "default for requests that name none)")
    m.add_argument("--fleet-file", default=d.fleet_file,
                   help="a YAML file of the fleet's models instead of --model: `models:` entries with model, "
                        "served_model_name, prefill, decode, colocated, dtype, lora_modules")
    add_field_flags(m, d, {"dtype": "auto (the faster of bfloat16 and float32 on this machine), bfloat16, float32"})
    m.add_argument("--served-model-name", nargs="+", default=list(d.served_model_name),
                   help="model names in the API (default: the model id); with several models, NAME=MODEL names "
                        "the model given as --model MODEL (a plain NAME is the first model's)")
    m.add_argument("--device", default=d.device, help="auto (cuda when available), cpu, cuda, cuda:N "
                                                      f"({nodes}: {engine.model.device})")
    m.add_argument("--quantization", "-q", choices=QUANTIZATION_METHODS, default=d.quantization,
                   help="gguf: every node computes on the .gguf model's Q4_0/Q4_1/Q8_0 blocks as the file stores "
                        "them (int8 kernels, as llama.cpp; CPU), instead of dequantizing it once to --dtype; awq, "
                        "gptq, fp8: the checkpoint folder's kind (read from its config.json when not given)")
    m.add_argument("--max-model-len", type=int, default=d.max_model_len,
                   help="context length in tokens (default: the model's, capped at what the KV cache holds); "
                        "checked against the model's config before anything loads")
    add_field_flags(m, d, {"block_size": "tokens per KV block, the same on every node and the gateway"})
    m.add_argument("--kv-cache-memory", type=byte_size, default=d.kv_cache_memory,
                   help="KV cache per node: bytes, or with a unit (512MiB, 4GiB, 2e9); at least one sequence "
                        "(default 2 GiB on CPU)")
    m.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                   help="fp8 (= fp8_e4m3): every node keeps K/V as e4m3 bytes, twice a bf16 cache's tokens in the "
                        "same memory and half the bytes per KV transfer, at some accuracy; int8: the same size, "
                        "closer to bf16 (docs/quantization.md); "
                        f"the gateway hashes prompts for it ({nodes}: {engine.cache.kv_cache_dtype})")
    add_offload_args(m, d)
    m.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="CUDA: fraction of device memory for weights plus KV cache when --kv-cache-memory is not "
                        f"given ({nodes}: {engine.cache.gpu_memory_utilization:g}); on CPU the KV cache is "
                        "--kv-cache-memory and this is only checked and passed on")
    m.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help=f"per node: most requests running at once ({nodes}: {engine.scheduler.max_num_seqs})")
    m.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="per node: tokens one engine step computes at most; longer prompts go in chunks "
                        f"({nodes}: {engine.scheduler.max_num_batched_tokens})")
    m.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching,
                   help="reuse the KV blocks of identical prompt prefixes (default: on)")
    m.add_argument("--seed", type=int, default=d.seed,
                   help=f"per node: the sampler's seed for requests that bring none ({nodes}: "
                        f"{engine.model.seed}); the same seed and requests give the same tokens")
    lora = engine.lora
    m.add_argument("--enable-lora", action="store_true", default=d.enable_lora,
                   help="every node serves LoRA adapters: a request names one in `model`, and POST "
                        "/v1/load_lora_adapter loads more at runtime")
    m.add_argument("--lora-modules", nargs="+", type=lora_module, default=list(d.lora_modules), metavar="NAME=PATH",
                   help="adapters every node loads at start (implies --enable-lora)")
    m.add_argument("--max-loras", type=int, default=d.max_loras,
                   help=f"per node: distinct adapters in one batch ({nodes}: {lora.max_loras})")
    m.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help=f"per node: the largest adapter rank taken ({nodes}: {lora.max_lora_rank})")
    m.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                   help="per node: adapters kept in memory, least recently used out first (default: --max-loras)")
    m.add_argument("--speculative-config", type=speculative_json, default=d.speculative_config,
                   help="speculative decoding on the decode nodes, as vLLM takes it (JSON; see `kvrelay decode -h`)")
    m.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="per node: requests that may wait for room; past it the gateway answers 429 "
                        f"({nodes}: {engine.scheduler.max_waiting_requests})")
    m.add_argument("--max-pooling-tokens-per-step", type=int, default=d.max_pooling_tokens_per_step,
                   help="per node: the most tokens of a step embeddings and scores take on a model that chats "
                        f"({nodes}: {engine.scheduler.max_pooling_tokens_per_step}; 0: no cap)")
    m.add_argument("--priority-step-gap", type=int, default=d.priority_step_gap,
                   help="per node: a prompt this far behind in priority (a tenant with this many more requests in "
                        "flight) waits for the next step instead of lengthening a more urgent prompt's "
                        f"({nodes}: {engine.scheduler.priority_step_gap}; 0: off)")
    m.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=SCHEDULING_POLICIES,
                   help=f"per node: waiting order ({nodes}: {engine.scheduler.policy.value}; sjf is the shortest "
                        "prompt first, with aging)")
    for flags, dest in ((("--tensor-parallel-size", "-tp"), "tensor_parallel_size"),
                        (("--pipeline-parallel-size", "-pp"), "pipeline_parallel_size")):
        m.add_argument(*flags, dest=dest, type=int, default=1,
                       help="vLLM's; kvrelay runs each engine on one device, so only 1 (scale out with --decode N)")
    f = p.add_argument_group("fleet")
    f.add_argument("--prefill", type=int, default=d.prefill,
                   help="prefill nodes (default: 1, or a colocated engine where the machine has under "
                        f"{2 * MIN_CORES_PER_ENGINE} cores; 0: each decode node computes its prompts)")
    f.add_argument("--decode", type=int, default=d.decode, help="decode nodes (default: 1)")
    f.add_argument("--colocated", action="store_true", default=d.colocated,
                   help="engines that prefill and decode, sharing every core (the default under "
                        f"{2 * MIN_CORES_PER_ENGINE} cores)")
    f.add_argument("--connector", default=d.connector, choices=sorted(CONNECTORS),
                   help=f"KV transfer connector between processes (default: {_NODE.connector.name}, shared memory to "
                        "nodes on this host and ucx to others; a colocated engine gets local)")
    f.add_argument("--reserved-cores", type=int, default=d.reserved_cores, metavar="N",
                   help="leave the first N usable cores to the gateway and Redis (and a load generator you pin "
                        "there) and pin each engine to its own share of the rest, as vLLM's "
                        "VLLM_CPU_NUM_OF_RESERVED_CPU; 0: every process on every core")
    f.add_argument("--gateways", type=int, default=d.gateways, metavar="N",
                   help="gateway processes, all on the same ports (the kernel spreads connections over them) and "
                        "sharing the nodes, the index, rate limits and stored answers through Redis; a rolling "
                        "restart replaces them one at a time, so the API never stops answering")
    f.add_argument("--routing-policy", default=d.routing_policy, choices=ROUTING_POLICIES,
                   help="how the gateway picks prefill and decode nodes")
    f.add_argument("--redis-url", default=d.redis_url, help="use this Redis instead of starting an embedded one")
    f.add_argument("--restart", action="store_true", default=d.restart, help="restart a child that dies")
    g = p.add_argument_group("gateway (the OpenAI API)")
    add_field_flags(g, d, {
        "host": "interface every process listens on (127.0.0.1: this machine only; 0.0.0.0: every interface)",
        "port": "the gateway's HTTP port (OpenAI API, /health, /metrics): the only flag two fleets on one machine "
                "need to differ in",
    })
    g.add_argument("--grpc-port", type=int, default=d.grpc_port,
                   help="the gateway's gRPC API port (default: --port + 1 when free, else a free one)")
    g.add_argument("--api-key", default=os.environ.get("KVRELAY_API_KEY", d.api_key),
                   help="require 'Authorization: Bearer KEY' from clients (default: $KVRELAY_API_KEY; unset: open)")
    g.add_argument("--api-keys-file", default=d.api_keys_file, metavar="FILE",
                   help="many keys with tenants, models, priorities and limits (a JSON or YAML list of {key | "
                        "key_sha256, tenant, models, priority, rpm, tpm, max_concurrent, admin}; docs/security.md)")
    f.add_argument("--otlp-traces-endpoint", default=d.otlp_traces_endpoint, metavar="URL",
                   help="every process sends its OpenTelemetry spans to this OTLP collector: one trace per request "
                        "across the gateway and the nodes (e.g. http://127.0.0.1:4317)")
    f.add_argument("--fleet-tls", action=argparse.BooleanOptionalAction, default=d.fleet_tls,
                   help="make a CA for this fleet and run gRPC between the gateway and the nodes over mutual TLS: "
                        "nothing without the fleet's certificate can call a node")
    g.add_argument("--public-metrics", action="store_true", default=d.public_metrics,
                   help="the gateway's /metrics answers without a key (with keys, only /health does otherwise)")
    g.add_argument("--log-requests", action="store_true", default=d.log_requests,
                   help="the gateway logs one JSON line per generation (request id, tenant, key, status, tokens, "
                        "TTFT, duration, nodes) on the logger kvrelay.access, in its log")
    g.add_argument("--tool-call-parser", default=d.tool_call_parser, choices=[*TOOL_CALL_PARSERS, "none"],
                   help=f"how tool_choice 'auto' finds the model's tool calls (the gateway's default: "
                        f"{_GATEWAY.tool_call_parser})")
    g.add_argument("--enable-auto-tool-choice", action="store_true", default=d.enable_auto_tool_choice,
                   help="vLLM's; accepted: tool_choice 'auto' is on whenever --tool-call-parser names a parser")
    g.add_argument("--allowed-origins", nargs="+", default=list(d.allowed_origins),
                   help="CORS: origins browsers may call the API from ('*' for any; default: no CORS headers)")
    g.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                   help=f"generations in progress at once; past it 429 (default: {_GATEWAY.max_concurrent_requests})")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help=f"per-request deadline, seconds (default: {_GATEWAY.request_timeout:g}, none)")
    add_field_flags(g, d, {"migration_limit": "moves of one sequence to another node after node failures"})
    s = p.add_argument_group("lifecycle and logs")
    s.add_argument("--shutdown-grace", "--shutdown-timeout", dest="shutdown_grace", type=float,
                   default=d.shutdown_grace,
                   help="seconds open streams get after Ctrl-C before they end with an error event")
    add_field_flags(s, d, {"ready_timeout": "seconds to wait for the fleet"})
    s.add_argument("--log-dir", default=d.log_dir,
                   help="folder of the runs' logs (default: $XDG_STATE_HOME/kvrelay/logs, else "
                        "~/.local/state/kvrelay/logs); each run logs into a folder of its own")
    add_field_flags(s, d, {"keep_logs": "runs whose logs are kept (older ones are removed)"})
    p.set_defaults(func=run_up)
