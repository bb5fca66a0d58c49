"""`kvrelay up`: a whole fleet on one machine (embedded Redis, prefill and decode nodes, the gateway).

Lifecycle:
1. Start Redis (embedded redis-server on a unix socket) unless --redis-url names one.
2. Start the nodes, then the gateway, each as its own process in its own session, so that Ctrl-C reaches
   only this launcher, which then stops them in order.
3. Wait until the gateway answers /health and lists the model; print the URL and ready-to-paste snippets.
4. Supervise: a child that exits is reported (and restarted with --restart, with backoff).
5. On Ctrl-C / SIGTERM: SIGTERM to the gateway, then the nodes (they drain within --shutdown-timeout),
   SIGKILL whatever is left, stop Redis. No process is left behind.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from kvrelay.cli.args import HelpFormatter
from kvrelay.common.system import die_with_parent, free_port
from kvrelay.engine.args import SCHEDULING_POLICIES, speculative_json

logger = logging.getLogger("kvrelay.up")


@dataclass
class Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_restart: float = 0.0
    log_path: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)


def _kvrelay(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvrelay.cli", *args]


def _fleet_flags(args: argparse.Namespace) -> list[str]:
    """What the nodes and the gateway must agree on: the gateway hashes prompts in blocks of the nodes' size and
    refuses a node whose block size or model differs."""
    flags = ["--model", args.model, "--block-size", str(args.block_size)]
    if args.served_model_name:
        flags += ["--served-model-name", args.served_model_name]
    return flags


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = [*_fleet_flags(args), "--dtype", args.dtype]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    if args.max_waiting_requests is not None:
        flags += ["--max-waiting-requests", str(args.max_waiting_requests)]
    if args.scheduling_policy is not None:
        flags += ["--scheduling-policy", args.scheduling_policy]
    return flags


def _gateway_flags(args: argparse.Namespace) -> list[str]:
    flags = [*_fleet_flags(args), "--migration-limit", str(args.migration_limit)]
    for flag in ("max_concurrent_requests", "request_timeout"):
        value = getattr(args, flag)
        if value is not None:
            flags += ["--" + flag.replace("_", "-"), str(value)]
    return flags


def _decode_flags(args: argparse.Namespace) -> list[str]:
    """Flags only decode nodes (and the colocated engine) take: prefill nodes never decode."""
    return ["--speculative-config", args.speculative_config] if args.speculative_config else []


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


def placement(args: argparse.Namespace) -> Placement:
    """--colocated or explicit node counts are followed; otherwise the machine decides: one prefill and one decode
    node where each gets MIN_CORES_PER_ENGINE cores, else one colocated engine with every core."""
    cores = os.cpu_count() or 1
    explicit = args.prefill is not None or args.decode is not None
    colocated = args.colocated or (not explicit and cores < 2 * MIN_CORES_PER_ENGINE)
    prefill = 0 if colocated else (1 if args.prefill is None else args.prefill)
    decode = 1 if colocated else (1 if args.decode is None else args.decode)
    threads = max(1, cores // (1 if colocated else prefill + decode))
    note = f"{cores} CPU cores: {threads} torch thread(s) per engine"
    if colocated and not args.colocated:
        note += (f"; one colocated engine, as disaggregating would leave each engine under {MIN_CORES_PER_ENGINE} "
                 "cores (docs/benchmarks.md: time to first token 3x the colocated one at concurrency 32 on 2 "
                 "cores); --prefill 1 --decode 1 disaggregates anyway")
    elif not colocated and threads < MIN_CORES_PER_ENGINE:
        note += ("; with a core or less per engine, each prefill runs on one core while decodes hold the other: "
                 "time to first token suffers most (docs/benchmarks.md: 3x the colocated TTFT at concurrency 32 "
                 "on 2 cores). --colocated gives one engine every core")
    connector = args.connector or "auto"
    if colocated and not args.connector:
        # auto would start a UCX worker whose progress thread wakes every millisecond, for a node that never
        # sends or receives KV: 2-3% of served throughput on 2 cores (docs/benchmarks.md).
        connector = "local"
        note += "; KV connector local, as a lone engine hands KV to no other process"
    return Placement(colocated, prefill, decode, threads, connector, note)


def plan_children(args: argparse.Namespace, redis_url: str, where: Placement) -> list[Child]:
    """The node and gateway processes, with ports picked up front so the gateway can be told them."""
    threads = str(where.threads)
    common = ["--redis-url", redis_url, "--host", args.host, "--num-threads", threads,
              "--shutdown-timeout", str(args.shutdown_timeout), *_engine_flags(args)]
    children = []
    roles = [("decode", 1)] if where.colocated else [("prefill", where.prefill), ("decode", where.decode)]
    for role, count in roles:
        for i in range(count):
            port = free_port()
            argv = _kvrelay(role, "--port", str(port), "--metrics-port", str(free_port()),
                            "--connector", where.connector, "--node-id", f"{role}-{i}", *common)
            if role == "decode":
                argv += _decode_flags(args)
            children.append(Child(f"{role}-{i}", argv))
    gateway = _kvrelay("gateway", "--host", args.host, "--port", str(args.port), "--grpc-port", str(args.grpc_port),
                       "--redis-url", redis_url,
                       "--shutdown-timeout", str(args.shutdown_timeout), "--routing-policy", args.routing_policy,
                       *_gateway_flags(args))
    if args.api_key:
        gateway += ["--api-key", args.api_key]
    children.append(Child("gateway", gateway))
    return children


class Fleet:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.placement = placement(args)
        self.redis = None
        self.children: list[Child] = []
        self.log_dir = tempfile.mkdtemp(prefix="kvrelay-up-")
        self.stopping = False

    def start(self) -> None:
        redis_url = self.args.redis_url or self._start_redis()
        self.children = plan_children(self.args, redis_url, self.placement)
        logger.info("placement: %s", self.placement.note)
        for child in self.children:
            self._spawn(child)

    def _start_redis(self) -> str:
        from kvrelay.index.redis_server import start_redis

        self.redis = start_redis(os.path.join(self.log_dir, "redis.sock"))
        logger.info("embedded Redis at %s", self.redis.url)
        return self.redis.url

    def _spawn(self, child: Child) -> None:
        child.log_path = os.path.join(self.log_dir, f"{child.name}.log")
        log = open(child.log_path, "ab")  # noqa: SIM115 - the child owns it
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **child.extra_env}
        child.proc = subprocess.Popen(child.argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      start_new_session=True, preexec_fn=die_with_parent)
        log.close()
        logger.info("started %s (pid %d), log %s", child.name, child.proc.pid, child.log_path)

    def wait_ready(self, timeout_s: float) -> None:
        url = f"http://{self.args.host}:{self.args.port}"
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        while time.monotonic() < deadline:
            self._check_children(restart=False)
            try:
                health = httpx.get(f"{url}/health", timeout=2)
                models = httpx.get(f"{url}/v1/models", timeout=2, headers=headers)
                if health.status_code == 200 and models.status_code == 200 and models.json().get("data") \
                        and self._all_nodes_routable(health.json()):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the fleet was not healthy within {timeout_s:.0f}s; logs in {self.log_dir}")

    def _all_nodes_routable(self, health: dict) -> bool:
        """The gateway answers before the nodes have loaded the model; ready means it routes to all of them."""
        prefill, decode = self.placement.prefill, self.placement.decode
        return health.get("prefill_nodes", 0) >= prefill and health.get("decode_nodes", 0) >= decode

    def _check_children(self, restart: bool) -> None:
        for child in self.children:
            if child.proc is None or child.proc.poll() is None:
                continue
            code = child.proc.returncode
            if not restart:
                raise RuntimeError(f"{child.name} exited with code {code} during start-up; see {child.log_path}:\n"
                                   + _tail(child.log_path))
            if child.next_restart == 0.0:
                logger.error("%s exited with code %s; last log lines:\n%s", child.name, code, _tail(child.log_path))
                child.next_restart = time.monotonic() + min(30.0, 2.0**child.restarts)
            elif time.monotonic() >= child.next_restart:
                child.restarts += 1
                child.next_restart = 0.0
                logger.warning("restarting %s (restart %d)", child.name, child.restarts)
                self._spawn(child)

    def supervise(self) -> None:
        while not self.stopping:
            if self.args.restart:
                self._check_children(restart=True)
            else:
                for child in self.children:
                    if child.proc and child.proc.poll() is not None and child.next_restart == 0.0:
                        logger.error("%s exited with code %s (not restarting; pass --restart):\n%s", child.name,
                                     child.proc.returncode, _tail(child.log_path))
                        child.next_restart = -1.0
            time.sleep(0.5)

    def stop(self) -> None:
        self.stopping = True
        # Gateway first, so no new work reaches nodes that are draining.
        ordered = sorted(self.children, key=lambda c: c.name != "gateway")
        for group in (ordered[:1], ordered[1:]):
            for child in group:
                if child.proc and child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + self.args.shutdown_timeout + 5
            for child in group:
                if child.proc is None:
                    continue
                try:
                    child.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in time; killing it", child.name)
                    child.proc.kill()
                    child.proc.wait()
        if self.redis is not None:
            self.redis.stop()
        logger.info("fleet stopped")


def _tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            return b"".join(f.readlines()[-lines:]).decode(errors="replace")
    except OSError:
        return ""


def banner(args: argparse.Namespace, fleet: Fleet) -> str:
    base = f"http://{args.host}:{args.port}/v1"
    key = args.api_key or "unused"
    model = args.served_model_name or _served_name(args)
    where = fleet.placement
    layout = "colocated (1 engine)" if where.colocated else f"{where.prefill} prefill + {where.decode} decode"
    return f"""
kvrelay is up: {layout}, model {model}
  placement       : {where.note}
  OpenAI base URL : {base}
  gRPC API        : {args.host}:{args.grpc_port}
  metrics         : http://{args.host}:{args.port}/metrics
  logs            : {fleet.log_dir}

curl {base}/chat/completions -H 'Content-Type: application/json' -H 'Authorization: Bearer {key}' \\
  -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32, "temperature": 0}}'

python -c "from openai import OpenAI; c = OpenAI(base_url='{base}', api_key='{key}'); \\
print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hello!'}}], \\
max_tokens=32, temperature=0).choices[0].message.content)"

Ctrl-C stops everything.
"""


def _served_name(args: argparse.Namespace) -> str:
    try:
        httpx_headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        r = httpx.get(f"http://{args.host}:{args.port}/v1/models", timeout=2, headers=httpx_headers)
        return r.json()["data"][0]["id"]
    except Exception:
        return args.model


def run_up(args: argparse.Namespace) -> int:
    fleet = Fleet(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per readiness poll

    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # Both explicitly: a launcher started from a non-interactive shell's background job inherits SIGINT ignored.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        fleet.start()
        fleet.wait_ready(args.ready_timeout)
        print(banner(args, fleet), flush=True)
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
    p = sub.add_parser(
        "up", help="bring up a whole fleet on this machine",
        description="Start an embedded Redis, prefill and decode nodes and the gateway; print the URL.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default="default", help="HF folder, .gguf file, or 'default'")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the model id)")
    p.add_argument("--dtype", default="auto", help="auto (the faster of bfloat16 and float32 on this machine), "
                   "bfloat16, float32")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV cache per node (CPU)")
    p.add_argument("--speculative-config", type=speculative_json, default=None,
                   help="speculative decoding on the decode nodes, as vLLM takes it (JSON; see `kvrelay decode -h`)")
    p.add_argument("--prefill", type=int, default=None,
                   help="prefill nodes (default: 1, or a colocated engine where the machine has under "
                        f"{2 * MIN_CORES_PER_ENGINE} cores)")
    p.add_argument("--decode", type=int, default=None, help="decode nodes (default: 1, as --prefill)")
    p.add_argument("--colocated", action="store_true",
                   help="one engine that prefills and decodes with every core (the default under "
                        f"{2 * MIN_CORES_PER_ENGINE} cores)")
    p.add_argument("--connector", default=None, choices=["auto", "shm", "ucx", "nccl", "local"],
                   help="KV transfer connector between processes (default: auto, shared memory to nodes on this "
                        "host and ucx to others; a colocated engine gets local: it moves KV in-process only)")
    p.add_argument("--routing-policy", default="cache_aware", choices=["cache_aware", "round_robin", "least_loaded"],
                   help="how the gateway picks prefill and decode nodes")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of starting an embedded one")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="gateway HTTP port (OpenAI API)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gateway gRPC port")
    p.add_argument("--api-key", default=None, help="require this key from clients")
    p.add_argument("--restart", action="store_true", help="restart a child that dies")
    p.add_argument("--max-waiting-requests", type=int, default=None,
                   help="per node: requests that may wait for room; past it the gateway answers 429 (node default)")
    p.add_argument("--scheduling-policy", default=None, choices=SCHEDULING_POLICIES,
                   help="per node: waiting order (node default: sjf, shortest prompt first with aging)")
    p.add_argument("--max-concurrent-requests", type=int, default=None,
                   help="gateway: generations in progress at once; past it 429 (gateway default)")
    p.add_argument("--request-timeout", type=float, default=None, help="gateway: per-request deadline, seconds")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="gateway: moves of one sequence to another node after node failures")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="seconds each process has to drain")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the fleet")
    p.set_defaults(func=run_up)
