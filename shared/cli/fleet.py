"""The processes of `kvrelay up`: what each child runs (plan_children) where kvrelay.cli.placement puts the engines,
and the Fleet that starts, watches and stops them.

Every child is a ChildProcess (kvrelay.common.process) in a session and process group of its own, Redis
included: a Ctrl-C at the terminal reaches only `up`, which stops them in order (the gateway, then the nodes,
Redis last), and a second Ctrl-C kills every group at once (kill()). A node binds its ports and answers /health
("loading") before it loads the model, which is what the progress lines report.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from kvrelay.cli.placement import MIN_CORES_PER_ENGINE, Placement, placement
from kvrelay.cli.up_config import NODE_ENGINE_FIELDS
from kvrelay.common.process import ChildProcess, kill_all, kvrelay_command, stop_all
from kvrelay.common.system import format_cores, free_port

if TYPE_CHECKING:
    from kvrelay.cli.up_config import FleetModel, UpConfig
    from kvrelay.index.redis_server import RedisServer

__all__ = ["MIN_CORES_PER_ENGINE", "Child", "Fleet", "FleetPorts", "Interrupted", "Placement", "placement",
           "plan_children"]

logger = logging.getLogger("kvrelay.up")

PROGRESS_FIRST_S, PROGRESS_EVERY_S = 2.0, 5.0  # the first progress line, then one every so often


class Interrupted(Exception):
    """Ctrl-C (or SIGTERM) arrived while the fleet was starting."""


@dataclass(frozen=True)
class FleetPorts:
    """Every port of a fleet, fixed before anything starts (and printed): the gateway's HTTP and gRPC ports, and
    each node's gRPC and metrics ports by node name."""

    http: int
    grpc: int
    nodes: dict[str, tuple[int, int]]

    @classmethod
    def pick(cls, config: UpConfig, where: Placement, grpc: int | None = None) -> FleetPorts:
        """The gRPC port as given (or `grpc`, or a free one) and a free pair for each node."""
        host = config.host
        nodes = {name: (free_port(host), free_port(host)) for _, name in where.node_names()}
        return cls(config.port, grpc or config.grpc_port or free_port(host), nodes)


@dataclass
class Child:
    """One process of the fleet: what it runs and, once started, the ChildProcess running it."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    process: ChildProcess | None = None
    restarts: int = 0
    next_restart: float = 0.0  # monotonic time of the next restart; 0: none due; -1: reported, not restarted
    metrics_url: str = ""  # nodes: http://host:port (its /health says loading, then serving)

    @property
    def is_gateway(self) -> bool:
        """A gateway ("gateway", "gateway-N" of several, "...-rN" once a rolling restart replaced it), not a node."""
        return self.name == "gateway" or self.name.startswith("gateway-")


def _routable_in(health: dict) -> set[str]:
    """The node ids a gateway's /health marks routable."""
    return {n["node_id"] for n in health.get("nodes", []) if n.get("routable")}


def _with_flags(argv: list[str], values: dict[str, str]) -> list[str]:
    """argv with the value after each flag in `values` replaced."""
    out = list(argv)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def _set_flags(config: UpConfig, names: tuple[str, ...]) -> list[str]:
    """`--name value` for each of `names` that is set (not None) in config."""
    flags: list[str] = []
    for name in names:
        if (value := getattr(config, name)) is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def engine_flags(config: UpConfig, model: FleetModel | None = None) -> list[str]:
    """The engine flags every node of `model` (None: the only model) gets: those set on `up` (the nodes' own
    defaults apply to the rest). The model and block size are what the gateway checks a node against."""
    model = model or config.fleet_models()[0]
    flags = ["--model", model.model, "--block-size", str(config.block_size), "--dtype", model.dtype or config.dtype,
             *_set_flags(config, (*NODE_ENGINE_FIELDS, "scheduling_policy"))]
    names = [n.partition("=")[0] for n in model.served_model_names]
    if names:
        flags += ["--served-model-name", names[0]]  # a node labels its metrics with one name
    if config.enable_prefix_caching is not None:
        flags.append("--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching")
    adapters = [*config.lora_modules, *model.lora_modules]
    if config.enable_lora or adapters:
        flags.append("--enable-lora")
    if adapters:
        flags += ["--lora-modules", *adapters]
    return flags


def gateway_flags(config: UpConfig) -> list[str]:
    models = config.fleet_models()
    flags = ["--block-size", str(config.block_size), "--migration-limit", str(config.migration_limit),
             "--routing-policy", config.routing_policy, "--fleet-metrics",
             *_set_flags(config, ("max_concurrent_requests", "request_timeout", "tool_call_parser",
                                  "otlp_traces_endpoint", "kv_cache_dtype"))]
    for m in models:
        flags += ["--model", m.model]
    names = [name if i == 0 or "=" in name else f"{name}={m.model}"
             for i, m in enumerate(models) for name in m.served_model_names]
    if names:
        flags += ["--served-model-name", *names]
    if config.allowed_origins:
        flags += ["--allowed-origins", *config.allowed_origins]
    if config.api_keys_file:
        flags += ["--api-keys-file", os.path.abspath(config.api_keys_file)]
    if config.public_metrics:
        flags.append("--public-metrics")
    if config.log_requests:
        flags.append("--log-requests")
    return flags


def plan_children(config: UpConfig, redis_url: str, where: Placement, ports: FleetPorts | None = None,
                  api_key: str | None = None) -> list[Child]:
    """The node and gateway processes, with their ports picked up front so the gateway can be told them.
    `api_key`: the gateway's --api-key (default: the config's)."""
    api_key = api_key or config.api_key
    ports = ports or FleetPorts.pick(config, where)
    children = []
    # Secrets (the Redis password in the URL, the API key) travel in the environment, not on command lines that
    # every user of the machine can read.
    env = {"KVRELAY_REDIS_URL": redis_url}
    for place in where.models():
        common = [*_set_flags(config, ("otlp_traces_endpoint",)), "--host", config.host, "--num-threads",
                  str(place.threads),
                  "--shutdown-grace", str(config.shutdown_grace), *engine_flags(config, place.model)]
        for i, (role, name) in enumerate(place.own_node_names()):
            grpc_port, metrics_port = ports.nodes[name]
            argv = kvrelay_command(role, "--port", str(grpc_port), "--metrics-port", str(metrics_port),
                                   "--connector", place.connector, "--node-id", name, *common)
            if place.cores:
                argv += ["--cpu-cores", format_cores(place.cores[i])]
            if role == "decode":  # prefill nodes never decode
                argv += _set_flags(config, ("speculative_config",))
            children.append(Child(name, argv, metrics_url=f"http://{config.host}:{metrics_port}", env=dict(env)))
    gateway = kvrelay_command("gateway", "--host", config.host, "--port", str(ports.http), "--grpc-port",
                              str(ports.grpc), "--reuse-port", "--shutdown-grace",
                              str(config.shutdown_grace), *gateway_flags(config))
    if api_key:
        env["KVRELAY_API_KEY"] = api_key
    names = ["gateway"] if config.gateways == 1 else [f"gateway-{i}" for i in range(config.gateways)]
    children += [Child(name, list(gateway), env=dict(env)) for name in names]
    return children


class Fleet:
    """The processes of `kvrelay up`, each a ChildProcess with its log in `log_dir`."""

    def __init__(self, config: UpConfig, where: Placement, ports: FleetPorts, log_dir: Path) -> None:
        self.config, self.placement, self.ports, self.log_dir = config, where, ports, log_dir
        self.redis: RedisServer | None = None
        self.children: list[Child] = []
        # Set by the first Ctrl-C / SIGTERM (a plain flag: a signal handler must take no lock); every loop here
        # looks at it at least every quarter second.
        self.stop_requested = False
        self.roll_requested = False  # SIGHUP: a rolling restart (set by the handler, run by supervise())
        self._generation = 0  # of the nodes' successors' names: decode-0 -> decode-0-r1 -> ...
        self._ready_streak = 0  # answers in a row that said the fleet is ready (_ready)
        # With a keys file only, the launcher's own admin key (its readiness checks), known to nobody else.
        self.api_key = config.api_key or (secrets.token_urlsafe(32) if config.api_keys_file else None)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.ports.http}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def nodes(self) -> list[Child]:
        return [c for c in self.children if not c.is_gateway]

    def gateways(self) -> list[Child]:
        return [c for c in self.children if c.is_gateway]

    def start(self) -> None:
        redis_url = self.config.redis_url or self._start_redis()
        self.children = plan_children(self.config, redis_url, self.placement, self.ports, self.api_key)
        if self.config.fleet_tls:
            self._add_certificates()
        for child in self.children:
            self._spawn(child)

    def _start_redis(self) -> str:
        from kvrelay.index.redis_server import redact, start_redis

        socket_path = self.log_dir / "redis.sock"
        if len(str(socket_path)) > 100:  # a unix socket's path must fit in 108 bytes
            socket_path = Path("/tmp") / f"kvrelay-redis-{os.getpid()}.sock"
        # Only the fleet may use it: a password of its own (which travels in the children's environment).
        self.redis = start_redis(socket_path, workdir=self.log_dir, password=secrets.token_hex(24))
        logger.info("embedded Redis at %s (pid %d)", redact(self.redis.url), self.redis.pid)
        return self.redis.url

    def _add_certificates(self) -> None:
        """A CA for this fleet alone and a certificate for each child (kvrelay.common.tls), in <logs>/tls."""
        from kvrelay.common.tls import make_fleet_pki

        pki = make_fleet_pki(self.log_dir / "tls", [c.name for c in self.children])
        for child in self.children:
            files = pki[child.name]
            child.argv += ["--tls-ca-file", files.ca_file, "--tls-cert-file", files.cert_file,
                           "--tls-key-file", files.key_file]
        logger.info("mutual TLS between the gateway and the nodes (certificates in %s)", self.log_dir / "tls")

    def _spawn(self, child: Child) -> None:
        # die_with_parent: a launcher killed outright (SIGKILL) takes its fleet with it.
        child.process = ChildProcess.start(child.name, child.argv, env=child.env, log_dir=self.log_dir,
                                           die_with_parent=True)
        logger.info("started %s (pid %d)", child.name, child.process.pid)

    # ------------------------------------------------------------------------------------------- start-up

    def wait_ready(self, timeout_s: float) -> None:
        """Until the gateway routes to every node, with a progress line every few seconds; RuntimeError if a
        child exits first or time runs out, Interrupted on Ctrl-C."""
        start = time.monotonic()
        next_report = start + PROGRESS_FIRST_S
        while not self._ready():
            now = time.monotonic()
            if now >= next_report:
                logger.info("starting (%.0f s): %s", now - start, self.progress())
                next_report = now + PROGRESS_EVERY_S
            if now - start > timeout_s:
                raise RuntimeError(f"the fleet was not ready within {timeout_s:.0f} s ({self.progress()}); logs "
                                   f"in {self.log_dir}")
            time.sleep(0.25)
            if self.stop_requested:
                raise Interrupted

    def progress(self) -> str:
        """Where each part is: `decode-0 loading the model, gateway routing to 0 of 1 nodes`."""
        states = [f"{c.name} {self._node_state(c)}" for c in self.nodes()]
        routed = self._routed()
        states.append("gateway starting" if routed is None else
                      f"gateway routing to {routed} of {len(self.nodes())} nodes")
        return ", ".join(states)

    @staticmethod
    def _node_state(child: Child) -> str:
        try:
            reply = httpx.get(child.metrics_url + "/health", timeout=1)
        except httpx.HTTPError:
            return "starting"
        if reply.status_code == 200:
            return "serving"
        return "loading the model" if reply.json().get("status") == "loading" else "not healthy"

    def _routed(self) -> int | None:
        routable = self._routable_nodes()
        return None if routable is None else len(routable)

    def _routable_nodes(self) -> set[str] | None:
        """The nodes the gateway routes to (None: it does not answer)."""
        try:
            return _routable_in(httpx.get(f"{self.url}/health", timeout=2).json())
        except (httpx.HTTPError, ValueError):
            return None

    def _ready(self) -> bool:
        """Whether the gateway answers and routes to every node; with several, whether that many answers in a row
        said so (each request is a new connection, which the kernel gives to any of them)."""
        self._check_children(restart=False)
        try:
            health = httpx.get(f"{self.url}/health", timeout=2)
            models = httpx.get(f"{self.url}/v1/models", timeout=2, headers=self.headers)
            ready = (health.status_code == 200 and models.status_code == 200 and bool(models.json().get("data"))
                     and self._all_nodes_routable(health.json()))
        except (httpx.HTTPError, ValueError):
            ready = False
        self._ready_streak = self._ready_streak + 1 if ready else 0
        gateways = len(self.gateways())
        return self._ready_streak >= (1 if gateways == 1 else 4 * gateways)

    def _all_nodes_routable(self, health: dict) -> bool:
        """The gateway answers before the nodes have loaded the model; ready means it routes to all of them."""
        return {c.name for c in self.nodes()} <= _routable_in(health)

    # ----------------------------------------------------------------------------------------- supervising

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
        """Watch the children until Ctrl-C: report one that exits (restart it with --restart, with backoff)."""
        while not self.stop_requested:
            time.sleep(0.2)
            if self.roll_requested:
                self.roll_requested = False
                self.roll()
            if self.config.restart:
                self._check_children(restart=True)
                continue
            for child in self.children:
                process = child.process
                if process is not None and not process.alive() and child.next_restart == 0.0:
                    logger.error("%s exited with code %s (not restarting; pass --restart):\n%s", child.name,
                                 process.returncode, process.log_tail(20))
                    child.next_restart = -1.0

    # -------------------------------------------------------------------------------------- rolling restart

    def roll(self) -> bool:
        """Restart every process, one at a time, without a lost request (SIGHUP to `kvrelay up`). Each node is
        replaced surge-first, as deploy/'s rollouts do: its successor starts under a new name on new ports, and
        once the gateway routes to it the old node gets SIGTERM: it stops taking work, finishes what it can within
        --shutdown-grace, and the gateway moves the rest to other nodes token-exact. The gateway goes last: its
        successor binds the same ports (--reuse-port), then the old one stops listening and finishes its open
        streams (SIGUSR1). False if it stopped early (Ctrl-C, or a successor that did not come up: the old process then
        stays)."""
        start = time.monotonic()
        logger.info("rolling restart of %d processes, one at a time", len(self.children))
        for old in list(self.nodes()):
            if self.stop_requested or not self._replace_node(old):
                return False
        for old in self.gateways():
            if self.stop_requested or not self._replace_gateway(old):
                return False
        logger.info("rolling restart done in %.0f s: %s", time.monotonic() - start,
                    ", ".join(c.name for c in self.children))
        return True

    def _replace_node(self, old: Child) -> bool:
        host = self.config.host
        base = re.sub(r"-r\d+$", "", old.name)
        self._generation += 1
        name = f"{base}-r{self._generation}"
        grpc_port, metrics_port = free_port(host), free_port(host)
        argv = _with_flags(old.argv, {"--node-id": name, "--port": str(grpc_port), "--metrics-port": str(metrics_port)})
        new = Child(name, argv, env=dict(old.env), metrics_url=f"http://{host}:{metrics_port}")
        self._spawn(new)
        if not self._wait_routable(new):
            return False
        self._retire(old, new)
        return True

    def _replace_gateway(self, old: Child) -> bool:
        self._generation += 1
        base = re.sub(r"-r\d+$", "", old.name)
        new = Child(f"{base}-r{self._generation}", list(old.argv), env=dict(old.env))  # a log of its own
        self._spawn(new)
        deadline = time.monotonic() + self.config.ready_timeout
        # Both listen on the port now: the new one is up once its own log says so (uvicorn's line).
        while "Application startup complete" not in new.process.log_text():
            if self.stop_requested or not new.process.alive() or time.monotonic() > deadline:
                return self._give_up(new, old)
            time.sleep(0.25)
        self._retire(old, new)
        return True

    def _wait_routable(self, new: Child) -> bool:
        """Until the gateway routes to `new` (False, and `new` stopped, if it exits or time runs out first)."""
        deadline = time.monotonic() + self.config.ready_timeout
        next_report = time.monotonic() + PROGRESS_EVERY_S
        while new.name not in (self._routable_nodes() or ()):
            if self.stop_requested or not new.process.alive() or time.monotonic() > deadline:
                return self._give_up(new, None)
            if time.monotonic() >= next_report:
                logger.info("rolling restart: %s %s", new.name, self._node_state(new))
                next_report = time.monotonic() + PROGRESS_EVERY_S
            time.sleep(0.25)
        return True

    def _give_up(self, new: Child, old: Child | None) -> bool:
        why = "interrupted" if self.stop_requested else (
            f"it exited with code {new.process.returncode}" if not new.process.alive() else "it was not ready in time")
        logger.error("rolling restart stopped: %s did not come up (%s); %s keeps serving; its log: %s", new.name, why,
                     old.name if old is not None else "the old node", new.process.log_path)
        new.process.stop(grace_s=self.config.shutdown_grace + 5)
        return False

    def _retire(self, old: Child, new: Child) -> None:
        """`new` takes `old`'s place; `old` drains (a node on SIGTERM, the gateway on SIGUSR1) and exits."""
        self.children[self.children.index(old)] = new
        logger.info("rolling restart: %s serves; %s drains (up to %.0f s)", new.name, old.name,
                    self.config.shutdown_grace)
        if old.process is not None:
            if old.is_gateway:  # it stops listening at once (the new one has the ports), then drains
                old.process.send_signal(signal.SIGUSR1)
                old.process.wait(self.config.shutdown_grace + 5)
            code = old.process.stop(grace_s=self.config.shutdown_grace + 5)  # a node drains on SIGTERM
            logger.info("rolling restart: %s exited with code %s", old.name, code)

    # ---------------------------------------------------------------------------------------------- stopping

    def stop(self) -> None:
        """In order: the gateway (it stops admitting; open streams get --shutdown-grace, then a final error
        event), the nodes (they deregister while Redis still answers), Redis last."""
        processes = [c.process for c in self.children if c.process is not None]
        grace = self.config.shutdown_grace + 5  # past it: SIGKILL to the group
        gateways = [c.process for c in self.gateways() if c.process is not None]
        stop_all(gateways, grace)
        stop_all([p for p in processes if p not in gateways], grace)
        if self.redis is not None:
            self.redis.stop()

    def kill(self) -> None:
        """SIGKILL to every process group at once (the second Ctrl-C): nothing drains, nothing is left."""
        processes = [c.process for c in self.children if c.process is not None]
        kill_all(processes + ([self.redis.process] if self.redis is not None else []))
