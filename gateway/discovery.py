"""Which nodes exist and which may take requests: the Redis registry plus static --prefill/--decode addresses.

Registry nodes are alive while their lease is (the registry only returns those). Static nodes have no
lease: the gateway asks each for GetNodeInfo until it answers, then health-checks it periodically.

Each node has a circuit breaker (gateway/breaker.py): failed calls open it past a threshold, and an
unanswered health probe opens it at once. A failed call from a node that did not answer at all makes the
gateway probe that node right away (`suspect`), so a crashed or hung node leaves rotation within a probe's
timeout, while a failure a live node reported (a transfer between two nodes, say) ejects nobody. The probe
loop runs on its own, Redis or not, and brings a node back (half-open) once it answers.

`probe` is the gateway's one health prober: the breakers' probes, the liveness monitor's (gateway/liveness.py)
and the check of nodes gone from the registry all go through it, with one timeout, and a node has at most one
probe in flight: whoever asks while one is under way gets its answer.

Redis down: the last node list stays, probes go on. A node that drops out of a successful registry read is
kept for `unlisted_grace_s` while it answers its probe and is not draining: after a Redis restart the nodes
re-register within a heartbeat, and the fleet must not look empty meanwhile.
A node whose model is none of the gateway's, or whose block size differs from the gateway's, is listed (in /health)
but never routed to: its block hashes would mean nothing here. A gateway serving several models reads each one's
registry; `routable(role, model_id)` is one model's nodes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvrelay.common.records import NodeLoad
from kvrelay.common.wire import NodeInfo
from kvrelay.gateway.breaker import BreakerConfig, CircuitBreaker
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.node_client import NodeClients, NodeRpcError

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Node:
    node_id: str
    role: str
    address: str
    model_id: str
    block_size: int
    source: str  # "registry" | "static"
    kv_address: str = ""
    max_model_len: int = 0
    vocab_size: int = 0
    load: NodeLoad | None = None
    healthy: bool = True
    draining: bool = False
    refused: str | None = None  # why this node may never be routed to (model or block size mismatch)
    metrics_address: str = ""  # host:port of its /metrics ("": unknown)
    connector: str = ""  # its KV connector; "local": it takes no hand-offs, so it is a colocated engine
    kv_tiers: tuple[str, ...] = ()  # the index entries of the offload tiers it loads from (NodeRegistration)
    # Folded from `load` once, not per request (routing reads them for every node of every request).
    queued_tokens: int = field(init=False, default=0)
    active_seqs: int = field(init=False, default=0)
    free_tokens: int | None = field(init=False, default=None)  # None: unknown
    tier_token_cost: float | None = field(init=False, default=None)  # a load as a share of a compute; None: unmeasured

    def __post_init__(self) -> None:
        load = self.load
        if load is not None:
            object.__setattr__(self, "queued_tokens", load.queued_prefill_tokens)
            object.__setattr__(self, "active_seqs", load.num_running + load.num_waiting)
            if load.total_kv_blocks:
                object.__setattr__(self, "free_tokens", load.free_kv_blocks * self.block_size)
            if load.kv_tier_token_cost > 0:
                object.__setattr__(self, "tier_token_cost", load.kv_tier_token_cost)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and self.refused is None

    @property
    def kind(self) -> str:
        """What the node is to a reader (/health, metrics labels): its role, or "colocated" for a decode node that
        computes its prompts itself (it can take no KV from a prefill node)."""
        return "colocated" if self.role == "decode" and self.connector == "local" else self.role


@dataclass
class _Static:
    address: str
    role: str
    node: Node | None = None
    error: str | None = None


@dataclass(frozen=True)
class Probe:
    """A node's answer to a health probe."""

    healthy: bool  # answered, and healthy
    draining: bool = False
    reason: str | None = None  # why not healthy (no answer, or what the node said)


@dataclass
class DiscoveryConfig:
    model_id: str
    block_size: int
    kv_cache_dtype: str = "auto"  # the nodes' --kv-cache-dtype: part of each block hash the router looks up
    other_models: tuple[str, ...] = ()  # the gateway's other models' ids (several models behind one gateway)
    static_prefill: tuple[str, ...] = ()
    static_decode: tuple[str, ...] = ()
    refresh_s: float = GatewayConfig.refresh_interval
    health_s: float = GatewayConfig.health_interval
    probe_timeout_s: float = GatewayConfig.probe_timeout
    probe_s: float = 0.5  # how often open breakers whose period is over are probed
    unlisted_grace_s: float = 3.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)


class Discovery:
    def __init__(self, config: DiscoveryConfig, clients: NodeClients, registry=None, metrics=None) -> None:
        self.config = config
        self.clients = clients
        self.registry = registry
        self.metrics = metrics
        self._static = {a: _Static(a, "prefill") for a in config.static_prefill}
        self._static.update({a: _Static(a, "decode") for a in config.static_decode})
        self._registered: dict[str, Node] = {}
        self._unlisted: dict[str, float] = {}  # registry nodes missing from the last read -> since (monotonic)
        self._infos: dict[str, NodeInfo] = {}  # by address: what GetNodeInfo said
        self._fetching: set[str] = set()
        self._breakers: dict[str, CircuitBreaker] = {}
        self._probes: dict[str, asyncio.Task[Probe]] = {}  # node_id -> the probe in flight
        self._probe_listeners: list[Callable[[Node, Probe], None]] = []
        self._view: tuple[list[Node], dict[str, list[Node]]] | None = None  # (all, routable by role)
        self._by_model: dict[tuple[str, str], list[Node]] = {}  # (role, model id) -> routable, from self._view
        self._warned: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.registry_error: str | None = None

    # ----------------------------------------------------------------------------------------- life

    async def start(self) -> None:
        await asyncio.gather(self.refresh_registry(), self.check_static(), return_exceptions=True)
        self._tasks = [asyncio.create_task(self._loop(self.refresh_registry, self.config.refresh_s)),
                       asyncio.create_task(self._loop(self.check_static, self.config.health_s)),
                       asyncio.create_task(self._loop(self.probe_open, self.config.probe_s))]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks + list(self._background) + list(self._probes.values()), []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _loop(self, fn, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:  # a bad refresh must not end discovery
                logger.exception("discovery: %s failed", fn.__name__)

    # ---------------------------------------------------------------------------------------- views

    def nodes(self, model_id: str | None = None) -> list[Node]:
        """Every known node (of model `model_id`, None: any), routable or not, sorted by (role, node_id)."""
        nodes = self._views()[0]
        return nodes if model_id is None else [n for n in nodes if n.model_id == model_id]

    def routable(self, role: str, model_id: str | None = None) -> list[Node]:
        """The nodes of `role` (of model `model_id`, None: any) that may take requests now (a cached list: do not
        modify)."""
        nodes = self._views()[1].get(role, [])
        if model_id is None:
            return nodes
        key = (role, model_id)
        found = self._by_model.get(key)
        if found is None:
            found = self._by_model[key] = [n for n in nodes if n.model_id == model_id]
        return found

    @property
    def model_ids(self) -> tuple[str, ...]:
        return (self.config.model_id, *self.config.other_models)

    def _views(self) -> tuple[list[Node], dict[str, list[Node]]]:
        # Rebuilt only when something changed: routing asks for every request.
        if self._view is None:
            found = {n.node_id: n for n in self._registered.values()}
            for s in self._static.values():
                if s.node is not None:
                    found.setdefault(s.node.node_id, s.node)
            nodes = sorted((n if self._breaker(n.node_id).routable else replace(n, healthy=False)
                            for n in found.values()), key=lambda n: (n.role, n.node_id))
            by_role: dict[str, list[Node]] = {}
            for n in nodes:
                if n.routable:
                    by_role.setdefault(n.role, []).append(n)
            self._view = (nodes, by_role)
        return self._view

    def _changed(self) -> None:
        self._view = None
        self._by_model = {}

    def max_model_len(self, model_id: str | None = None) -> int | None:
        """The smallest context any routable node (of `model_id`) accepts (a request must fit wherever it lands)."""
        lens = [n.max_model_len for n in self.nodes(model_id) if n.routable and n.max_model_len]
        return min(lens) if lens else None

    def vocab_size(self, model_id: str | None = None) -> int | None:
        sizes = [n.vocab_size for n in self.nodes(model_id) if n.vocab_size]
        return min(sizes) if sizes else None

    # ------------------------------------------------------------------------------------ breakers

    def _breaker(self, node_id: str) -> CircuitBreaker:
        b = self._breakers.get(node_id)
        if b is None:
            b = self._breakers[node_id] = CircuitBreaker(self.config.breaker)
        return b

    def breaker_state(self, node_id: str) -> str:
        return self._breaker(node_id).state.value

    def record_success(self, node_id: str) -> None:
        b = self._breakers.get(node_id)
        if b is not None and b.record_success():
            logger.info("node %s answered again: circuit closed", node_id)
            self._changed()

    def record_failure(self, node: Node, err: Exception, answered: bool = False) -> None:
        """A call to `node` failed. `answered`: the node itself reported the failure (it is alive), else the
        node is probed at once and, if it does not answer, taken out of rotation."""
        if self._breaker(node.node_id).record_failure(str(err)):
            self._opened(node.node_id, f"{self.config.breaker.failure_threshold} failed calls or more", err)
        if not answered:
            self.suspect(node)

    def trip(self, node_id: str, reason: str) -> None:
        """Out of rotation now, on evidence (a health probe went unanswered)."""
        b = self._breaker(node_id)
        was_open = b.state.value == "open"
        b.trip(reason)
        if not was_open:
            self._opened(node_id, "no answer to a health probe", reason)

    def _opened(self, node_id: str, why: str, err) -> None:
        logger.warning("node %s out of rotation (%s): %s", node_id, why, err)
        if self.metrics is not None:
            self.metrics.breaker_trips.labels(node_id).inc()
        self._changed()

    def suspect(self, node: Node) -> None:
        """Probe the node now, in the background; no answer opens its breaker."""
        self._probe_task(node)

    async def probe_open(self) -> None:
        """Probe the nodes whose open period is over: an answer brings them back half-open."""
        now = time.monotonic()
        due = [n for n in self.nodes() if self._breaker(n.node_id).probe_due(now)]
        if due:
            await asyncio.gather(*(self.probe(n) for n in due))

    def on_probe(self, listener: Callable[[Node, Probe], None]) -> None:
        """Call `listener(node, answer)` after every health probe (the liveness monitor acts on each)."""
        self._probe_listeners.append(listener)

    async def probe(self, node: Node) -> Probe:
        """Health-check a node within the probe timeout, and update its breaker: no answer or an unhealthy
        one opens it, an answer lets an open one back half-open. Joins the node's probe in flight, if any."""
        return await asyncio.shield(self._probe_task(node))

    def _probe_task(self, node: Node) -> asyncio.Task[Probe]:
        task = self._probes.get(node.node_id)
        if task is None or task.done():
            task = self._probes[node.node_id] = asyncio.ensure_future(self._probe(node))
            task.add_done_callback(self._probe_done)
        return task

    def _probe_done(self, task: asyncio.Task[Probe]) -> None:
        for node_id, t in list(self._probes.items()):
            if t is task:
                del self._probes[node_id]

    async def _probe(self, node: Node) -> Probe:
        try:
            health = await self.clients.get(node.address).health(timeout=self.config.probe_timeout_s)
        except NodeRpcError as e:
            result = Probe(False, reason=f"no answer ({e.details or e.code.name})")
        else:
            result = Probe(health.healthy, health.draining, None if health.healthy else f"unhealthy: {health.message}")
        if not result.healthy:
            self.trip(node.node_id, f"health probe: {result.reason}")
        elif self._breaker(node.node_id).probe_passed():
            logger.info("node %s answered its health probe, back in rotation (half-open)", node.node_id)
            self._changed()
        for listener in self._probe_listeners:
            listener(node, result)
        return result

    # ------------------------------------------------------------------------------------- registry

    async def refresh_registry(self) -> None:
        if self.registry is None:
            return
        try:
            # A thread: the registry client is blocking, and a slow Redis must not stall the request loop.
            rows = [row for model_id in self.model_ids
                    for row in await asyncio.to_thread(self.registry.live_nodes, model_id)]
        except Exception as e:  # Redis down: keep the last view rather than dropping every node
            if self.registry_error is None:
                logger.warning("registry unreachable, keeping the last node list: %s", e)
            self.registry_error = str(e) or type(e).__name__
            if self.metrics is not None:
                self.metrics.index_errors.labels("registry").inc()
            return
        if self.registry_error is not None:
            logger.info("registry reachable again")
        self.registry_error = None
        fresh: dict[str, Node] = {}
        for reg, load in rows:
            node = self._from_registration(reg, load)
            fresh[node.node_id] = node
            if node.address not in self._infos and node.address not in self._fetching:
                self._fetching.add(node.address)
                task = asyncio.ensure_future(self._fetch_info(node.address))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        missing = [n for node_id, n in self._registered.items() if node_id not in fresh]
        for node_id in fresh:
            self._unlisted.pop(node_id, None)
        kept = await self._keep_unlisted(missing)
        self._registered = {**fresh, **{n.node_id: n for n in kept}}
        self._changed()

    def set_registered(self, rows: Iterable[tuple]) -> None:
        """The registry's nodes are these (registration, load) rows, taken at once as a registry read returned
        them: no probe of the nodes gone, no GetNodeInfo (an in-process fleet: the simulator, kvrelay.sim)."""
        nodes = (self._from_registration(reg, load) for reg, load in rows)
        self._registered = {n.node_id: n for n in nodes}
        self._changed()

    async def _keep_unlisted(self, missing: Iterable[Node]) -> list[Node]:
        """Nodes gone from a registry read that still answer, are not draining and are within the grace."""
        now = time.monotonic()
        grace = self.config.unlisted_grace_s
        candidates = [n for n in missing if now - self._unlisted.setdefault(n.node_id, now) < grace and not n.draining]
        answers = await asyncio.gather(*(self.probe(n) for n in candidates))
        kept = [n for n, answer in zip(candidates, answers) if answer.healthy and not answer.draining]
        for n in missing:
            if n not in kept:
                self._unlisted.pop(n.node_id, None)
        return kept

    def _from_registration(self, reg, load) -> Node:
        info = self._infos.get(reg.grpc_address)
        node = Node(
            node_id=reg.node_id, role=reg.role, address=reg.grpc_address, model_id=reg.model_id,
            block_size=int(reg.block_size), source="registry", kv_address=getattr(reg, "kv_address", ""),
            max_model_len=int(getattr(reg, "max_model_len", 0) or (info.max_model_len if info else 0)),
            vocab_size=int(getattr(reg, "vocab_size", 0) or (info.vocab_size if info else 0)),
            load=load, draining=bool(getattr(reg, "draining", False)),
            metrics_address=getattr(reg, "metrics_address", ""), connector=getattr(reg, "connector", ""),
            kv_tiers=tuple(getattr(reg, "kv_tiers", ())),
        )
        return self._vet(node)

    async def _fetch_info(self, address: str) -> None:
        """Context length and vocabulary, which registrations do not carry."""
        try:
            self._infos[address] = await self.clients.get(address).info()
        except NodeRpcError as e:
            logger.debug("GetNodeInfo %s: %s", address, e)
        finally:
            self._fetching.discard(address)

    # --------------------------------------------------------------------------------------- static

    async def check_static(self) -> None:
        if self._static:
            await asyncio.gather(*(self._check_one(s) for s in self._static.values()))

    async def _check_one(self, s: _Static) -> None:
        client = self.clients.get(s.address)
        try:
            if s.node is None:
                s.node = self._from_info(await client.info(), s)
                logger.info("static %s node %s at %s", s.node.role, s.node.node_id, s.address)
            answer, load = await asyncio.gather(self.probe(s.node), client.load())
        except NodeRpcError as e:
            answer, load = Probe(False, reason=str(e)), None
        if s.node is None:
            s.error = answer.reason
            return
        if not answer.healthy and s.node.healthy:
            logger.warning("static node %s at %s failed its health check: %s", s.node.node_id, s.address,
                           answer.reason)
        s.error = answer.reason
        s.node = replace(s.node, healthy=answer.healthy, draining=answer.draining, load=load or s.node.load)
        self._changed()

    def _from_info(self, info: NodeInfo, s: _Static) -> Node:
        role = info.role or s.role
        if role != s.role:
            logger.warning("node at %s was given as --%s but says it is a %s node", s.address, s.role, role)
        node = Node(
            node_id=info.node_id or s.address, role=role, address=s.address, model_id=info.model_id,
            block_size=info.block_size, source="static", kv_address=info.kv_address,
            max_model_len=info.max_model_len, vocab_size=info.vocab_size, metrics_address=info.metrics_address,
            connector=info.connector,
        )
        return self._vet(node)

    # ----------------------------------------------------------------------------------------- vet

    def _vet(self, node: Node) -> Node:
        reason = field_ = None
        if node.model_id not in self.model_ids:
            models = ", ".join(map(repr, self.model_ids))
            reason, field_ = f"serves model {node.model_id!r}, the gateway serves {models}", "model"
        elif node.block_size != self.config.block_size:
            reason = f"block size {node.block_size} differs from the gateway's {self.config.block_size}"
            field_ = "block_size"
        elif node.role not in ROLES:
            reason = f"unknown role {node.role!r}"
        if reason and node.node_id not in self._warned:
            # Its block hashes would never match ours: every lookup would be a silent miss. Logged and counted once.
            self._warned.add(node.node_id)
            logger.warning("refusing to route to node %s at %s: %s", node.node_id, node.address, reason)
            if field_ is not None and self.metrics is not None:
                self.metrics.observe_mismatch(node.node_id, field_)
        return replace(node, refused=reason) if reason else node
