"""`kvrelay up`: a whole fleet on one machine (embedded Redis, prefill and decode nodes, the gateway).

Lifecycle:
1. Start Redis (embedded redis-server on a unix socket) unless --redis-url names one.
2. Start the nodes, then the gateway, each a ChildProcess (kvrelay.common.process): its own session, so that
   Ctrl-C reaches only this launcher, which then stops them in order; its log in the fleet's log folder.
3. Wait until the gateway answers /health and lists the model; print the URL and ready-to-paste snippets.
4. Supervise: a child that exits is reported (and restarted with --restart, with backoff).
5. On Ctrl-C / SIGTERM: SIGTERM to the gateway, then the nodes (they drain within --shutdown-timeout),
   SIGKILL to the process group of whatever is left, stop Redis. No process is left behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import tempfile
import time
from dataclasses import dataclass

import httpx

from kvrelay.cli.args import HelpFormatter, add_field_flags
from kvrelay.common.hashing import DEFAULT_BLOCK_SIZE
from kvrelay.common.process import ChildProcess, ProcessStartError, kvrelay_command, stop_all
from kvrelay.common.system import free_port
from kvrelay.engine.args import SCHEDULING_POLICIES, speculative_json
from kvrelay.gateway.config import ROUTING_POLICIES, GatewayConfig
from kvrelay.kv_transfer import CONNECTORS
from kvrelay.node.config import NodeConfig

logger = logging.getLogger("kvrelay.up")

_NODE, _GATEWAY = NodeConfig(), GatewayConfig()


@dataclass(frozen=True)
class UpConfig:
    """What `kvrelay up` starts, and how: its flags' defaults. A per-node or gateway knob left None is not passed
    on, and the part's own default applies (NodeConfig's, GatewayConfig's)."""

    model: str = _GATEWAY.model
    served_model_name: str | None = None  # None: the model id
    dtype: str = _NODE.engine.model.dtype
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int | None = None  # None: the model's
    kv_cache_memory: int | None = None  # None: the engine's
    speculative_config: str | None = None  # JSON, as vLLM takes it; decode nodes only
    prefill: int | None = None  # None: placement() decides
    decode: int | None = None
    colocated: bool = False
    connector: str | None = None  # None: auto, local for a colocated engine
    routing_policy: str = _GATEWAY.routing_policy
    redis_url: str | None = None  # None: start an embedded redis-server
    host: str = "127.0.0.1"
    port: int = _GATEWAY.port
    grpc_port: int = 50051  # `up` always serves the gateway's gRPC API
    api_key: str | None = None
    restart: bool = False
    max_waiting_requests: int | None = None
    scheduling_policy: str | None = None
    max_concurrent_requests: int | None = None
    request_timeout: float | None = None
    migration_limit: int = _GATEWAY.migration_limit
    shutdown_timeout: float = 10.0  # shorter than a lone node's or gateway's: Ctrl-C should not take long
    ready_timeout: float = 600.0


def config_from_args(args: argparse.Namespace) -> UpConfig:
    return UpConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(UpConfig)})


@dataclass
class Child:
    """One process of the fleet: what it runs and, once started, the ChildProcess running it."""

    name: str
    argv: list[str]
    process: ChildProcess | None = None
    restarts: int = 0
    next_restart: float = 0.0  # monotonic time of the next restart; 0: none due; -1: reported, not restarted


def _set_flags(config: UpConfig, names: tuple[str, ...]) -> list[str]:
    """`--name value` for each of `names` that is set (not None) in config."""
    flags: list[str] = []
    for name in names:
        if (value := getattr(config, name)) is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def _fleet_flags(config: UpConfig) -> list[str]:
    """What the nodes and the gateway must agree on: the gateway hashes prompts in blocks of the nodes' size and
    refuses a node whose block size or model differs."""
    return _set_flags(config, ("model", "block_size", "served_model_name"))


def _engine_flags(config: UpConfig) -> list[str]:
    return [*_fleet_flags(config), "--dtype", config.dtype,
            *_set_flags(config, ("max_model_len", "kv_cache_memory", "max_waiting_requests", "scheduling_policy"))]


def _gateway_flags(config: UpConfig) -> list[str]:
    return [*_fleet_flags(config), "--migration-limit", str(config.migration_limit),
            *_set_flags(config, ("max_concurrent_requests", "request_timeout"))]


def _decode_flags(config: UpConfig) -> list[str]:
    """Flags only decode nodes (and the colocated engine) take: prefill nodes never decode."""
    return _set_flags(config, ("speculative_config",))


MIN_CORES_PER_ENGINE = 2  # disaggregation below this: each prefill runs on one core while decodes hold the rest


@dataclass(frozen=True)
class Placement:
    """What `up` runs where: colocated or how many nodes of each role, torch threads per engine, the KV
    connector, and why."""

    colocated: bool
    prefill: int
    decode: int
    threads: int
    connector: str
    note: str


def placement(config: UpConfig) -> Placement:
    """--colocated or explicit node counts are followed; otherwise the machine decides: one prefill and one decode
    node where each gets MIN_CORES_PER_ENGINE cores, else one colocated engine with every core."""
    cores = os.cpu_count() or 1
    explicit = config.prefill is not None or config.decode is not None
    colocated = config.colocated or (not explicit and cores < 2 * MIN_CORES_PER_ENGINE)
    prefill = 0 if colocated else (1 if config.prefill is None else config.prefill)
    decode = 1 if colocated else (1 if config.decode is None else config.decode)
    threads = max(1, cores // (1 if colocated else prefill + decode))
    note = f"{cores} CPU cores: {threads} torch thread(s) per engine"
    if colocated and not config.colocated:
        note += (f"; one colocated engine, as disaggregating would leave each engine under {MIN_CORES_PER_ENGINE} "
                 "cores (docs/benchmarks.md: time to first token 3x the colocated one at concurrency 32 on 2 "
                 "cores); --prefill 1 --decode 1 disaggregates anyway")
    elif not colocated and threads < MIN_CORES_PER_ENGINE:
        note += ("; with a core or less per engine, each prefill runs on one core while decodes hold the other: "
                 "time to first token suffers most (docs/benchmarks.md: 3x the colocated TTFT at concurrency 32 "
                 "on 2 cores). --colocated gives one engine every core")
    connector = config.connector or _NODE.connector.name
    if colocated and not config.connector:
        # auto would start a UCX worker whose progress thread wakes every millisecond, for a node that never
        # sends or receives KV: 2-3% of served throughput on 2 cores (docs/benchmarks.md).
        connector = "local"
        note += "; KV connector local, as a lone engine hands KV to no other process"
    return Placement(colocated, prefill, decode, threads, connector, note)


def plan_children(config: UpConfig, redis_url: str, where: Placement) -> list[Child]:
    """The node and gateway processes, with ports picked up front so the gateway can be told them."""
    common = ["--redis-url", redis_url, "--host", config.host, "--num-threads", str(where.threads),
              "--shutdown-timeout", str(config.shutdown_timeout), *_engine_flags(config)]
    children = []
    roles = [("decode", 1)] if where.colocated else [("prefill", where.prefill), ("decode", where.decode)]
    for role, count in roles:
        for i in range(count):
            argv = kvrelay_command(role, "--port", str(free_port()), "--metrics-port", str(free_port()),
                                   "--connector", where.connector, "--node-id", f"{role}-{i}", *common)
            if role == "decode":
                argv += _decode_flags(config)
            children.append(Child(f"{role}-{i}", argv))
    gateway = kvrelay_command("gateway", "--host", config.host, "--port", str(config.port),
                              "--grpc-port", str(config.grpc_port), "--redis-url", redis_url,
                              "--shutdown-timeout", str(config.shutdown_timeout),
                              "--routing-policy", config.routing_policy, *_gateway_flags(config))
    if config.api_key:
        gateway += ["--api-key", config.api_key]
    children.append(Child("gateway", gateway))
    return children


class Fleet:
    """The processes of `kvrelay up`, each a ChildProcess (kvrelay.common.process) with its log in `log_dir`."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.placement = placement(config)
        self.redis = None
        self.children: list[Child] = []
        self.log_dir = tempfile.mkdtemp(prefix="kvrelay-up-")
        self.stopping = False

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def start(self) -> None:
        redis_url = self.config.redis_url or self._start_redis()
        self.children = plan_children(self.config, redis_url, self.placement)
        logger.info("placement: %s", self.placement.note)
        for child in self.children:
            self._spawn(child)

    def _start_redis(self) -> str:
        from kvrelay.index.redis_server import start_redis

        self.redis = start_redis(os.path.join(self.log_dir, "redis.sock"), workdir=self.log_dir)
        logger.info("embedded Redis at %s", self.redis.url)
        return self.redis.url

    def _spawn(self, child: Child) -> None:
        # die_with_parent: a launcher killed outright (SIGKILL) takes its fleet with it.
        child.process = ChildProcess.start(child.name, child.argv, log_dir=self.log_dir, die_with_parent=True)
        logger.info("started %s (pid %d), log %s", child.name, child.process.pid, child.process.log_path)

    def wait_ready(self, timeout_s: float) -> None:
        """Until the gateway routes to every node; RuntimeError if a child exits first or time runs out."""
        gateway = next(c.process for c in self.children if c.name == "gateway")
        try:
            gateway.wait_ready(self._ready, timeout_s, interval_s=0.5)
        except ProcessStartError as e:
            raise RuntimeError(f"the fleet was not healthy within {timeout_s:.0f}s; logs in {self.log_dir}: {e}") \
                from None

    def _ready(self) -> bool:
        self._check_children(restart=False)
        try:
            health = httpx.get(f"{self.url}/health", timeout=2)
            models = httpx.get(f"{self.url}/v1/models", timeout=2, headers=self.headers)
            return (health.status_code == 200 and models.status_code == 200 and bool(models.json().get("data"))
                    and self._all_nodes_routable(health.json()))
        except httpx.HTTPError:
            return False

    def _all_nodes_routable(self, health: dict) -> bool:
        """The gateway answers before the nodes have loaded the model; ready means it routes to all of them."""
        prefill, decode = self.placement.prefill, self.placement.decode
        return health.get("prefill_nodes", 0) >= prefill and health.get("decode_nodes", 0) >= decode

    def _check_children(self, restart: bool) -> None:
        for child in self.children:
            process = child.process
            if process is None or process.alive():
                continue
            if not restart:
                raise RuntimeError(f"{child.name} exited with code {process.returncode} during start-up; see "
                                   f"{process.log_path}:\n{process.log_tail(20)}")
            if child.next_restart == 0.0:
                logger.error("%s exited with code %s; last log lines:\n%s", child.name, process.returncode,
                             process.log_tail(20))
                child.next_restart = time.monotonic() + min(30.0, 2.0**child.restarts)
            elif time.monotonic() >= child.next_restart:
                child.restarts += 1
                child.next_restart = 0.0
                logger.warning("restarting %s (restart %d)", child.name, child.restarts)
                self._spawn(child)

    def supervise(self) -> None:
        while not self.stopping:
            if self.config.restart:
                self._check_children(restart=True)
            else:
                for child in self.children:
                    process = child.process
                    if process is not None and not process.alive() and child.next_restart == 0.0:
                        logger.error("%s exited with code %s (not restarting; pass --restart):\n%s", child.name,
                                     process.returncode, process.log_tail(20))
                        child.next_restart = -1.0
            time.sleep(0.5)

    def stop(self) -> None:
        self.stopping = True
        processes = [c.process for c in self.children if c.process is not None]
        grace = self.config.shutdown_timeout + 5
        # Gateway first, so no new work reaches nodes that are draining; the nodes' drains overlap.
        stop_all([p for p in processes if p.name == "gateway"], grace)
        stop_all([p for p in processes if p.name != "gateway"], grace)
        if self.redis is not None:
            self.redis.stop()
        logger.info("fleet stopped")


def banner(fleet: Fleet) -> str:
    config, where = fleet.config, fleet.placement
    base = f"{fleet.url}/v1"
    key = config.api_key or "unused"
    model = config.served_model_name or _served_name(fleet)
    layout = "colocated (1 engine)" if where.colocated else f"{where.prefill} prefill + {where.decode} decode"
    return f"""
kvrelay is up: {layout}, model {model}
  placement       : {where.note}
  OpenAI base URL : {base}
  gRPC API        : {config.host}:{config.grpc_port}
  metrics         : {fleet.url}/metrics
  logs            : {fleet.log_dir}

curl {base}/chat/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer {key}' \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32, "temperature": 0}}'

python -c "from openai import OpenAI; c = OpenAI(base_url='{base}', api_key='{key}'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}], \\
max_tokens=32, temperature=0).choices[0].message.content)"

Ctrl-C stops everything.
"""


def _served_name(fleet: Fleet) -> str:
    try:
        r = httpx.get(f"{fleet.url}/v1/models", timeout=2, headers=fleet.headers)
        return r.json()["data"][0]["id"]
    except Exception:
        return fleet.config.model


def run_up(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    fleet = Fleet(config)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # Both explicitly: a launcher started from a non-interactive shell's background job inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        fleet.start()
        fleet.wait_ready(config.ready_timeout)
        print(banner(fleet), flush=True)
        fleet.supervise()
    except KeyboardInterrupt:
        logger.info("stopping the fleet")
    except (RuntimeError, TimeoutError) as e:
        logger.error("%s", e)
        fleet.stop()
        return 1
    fleet.stop()
    return 0


def register(sub) -> None:
    d = UpConfig()
    engine, node_default = _NODE.engine, "the nodes' default"
    p = sub.add_parser(
        "up", help="bring up a whole fleet on this machine",
        description="Start an embedded Redis, prefill and decode nodes and the gateway; print the URL.",
        formatter_class=HelpFormatter,
    )
    add_field_flags(p, d, {
        "model": "HF folder, .gguf file, or 'default'",
        "dtype": "auto (the faster of bfloat16 and float32 on this machine), bfloat16, float32",
        "block_size": "tokens per KV block, fleet-wide",
    })
    p.add_argument("--served-model-name", default=d.served_model_name,
                   help="model name in the API (default: the model id)")
    p.add_argument("--max-model-len", type=int, default=d.max_model_len, help="context length (default: the model's)")
    p.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory,
                   help="bytes of KV cache per node (CPU; default 2 GiB)")
    p.add_argument("--speculative-config", type=speculative_json, default=d.speculative_config,
                   help="speculative decoding on the decode nodes, as vLLM takes it (JSON; see `kvrelay decode -h`)")
    p.add_argument("--prefill", type=int, default=d.prefill,
                   help="prefill nodes (default: 1, or a colocated engine where the machine has under "
                        f"{2 * MIN_CORES_PER_ENGINE} cores)")
    p.add_argument("--decode", type=int, default=d.decode, help="decode nodes (default: 1, as --prefill)")
    p.add_argument("--colocated", action="store_true", default=d.colocated,
                   help="one engine that prefills and decodes with every core (the default under "
                        f"{2 * MIN_CORES_PER_ENGINE} cores)")
    p.add_argument("--connector", default=d.connector, choices=sorted(CONNECTORS),
                   help=f"KV transfer connector between processes (default: {_NODE.connector.name}, shared memory to "
                        "nodes on this host and ucx to others; a colocated engine gets local: it moves KV "
                        "in-process only)")
    p.add_argument("--routing-policy", default=d.routing_policy, choices=ROUTING_POLICIES,
                   help="how the gateway picks prefill and decode nodes")
    p.add_argument("--redis-url", default=d.redis_url, help="use this Redis instead of starting an embedded one")
    add_field_flags(p, d, {
        "host": "interface every process listens on",
        "port": "gateway HTTP port (OpenAI API)",
        "grpc_port": "gateway gRPC port",
    })
    p.add_argument("--api-key", default=d.api_key, help="require this key from clients")
    p.add_argument("--restart", action="store_true", default=d.restart, help="restart a child that dies")
    p.add_argument("--max-waiting-requests", type=int, default=d.max_waiting_requests,
                   help="per node: requests that may wait for room; past it the gateway answers 429 "
                        f"({node_default}: {engine.scheduler.max_waiting_requests})")
    p.add_argument("--scheduling-policy", default=d.scheduling_policy, choices=SCHEDULING_POLICIES,
                   help=f"per node: waiting order ({node_default}: {engine.scheduler.policy.value}; "
                        "sjf is the shortest prompt first, with aging)")
    p.add_argument("--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
                   help="gateway: generations in progress at once; past it 429 "
                        f"(the gateway's default: {_GATEWAY.max_concurrent_requests})")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="gateway: per-request deadline, seconds (the gateway's default: "
                        f"{_GATEWAY.request_timeout:g}, none)")
    add_field_flags(p, d, {
        "migration_limit": "gateway: moves of one sequence to another node after node failures",
        "shutdown_timeout": "seconds each process has to drain",
        "ready_timeout": "seconds to wait for the fleet",
    })
    p.set_defaults(func=run_up)
