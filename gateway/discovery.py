"""Which nodes exist and which may take requests: the Redis registry plus static --prefill/--decode addresses.

Registry nodes are alive while their lease is (the registry only returns those). Static nodes have no
lease: the gateway asks each for GetNodeInfo until it answers, then health-checks it periodically. Any node
whose call fails is taken out of rotation until a health check passes again, so a crashed node costs one
failed request, not one per refresh interval. A node whose model or block size differs from the gateway's
is listed (in /health) but never routed to: its block hashes would mean nothing here.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from gateway.node_client import Load, NodeClients, NodeInfo, NodeRpcError

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
    load: Load | None = None
    healthy: bool = True
    draining: bool = False
    refused: str | None = None  # why this node may never be routed to (model or block size mismatch)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining and self.refused is None


@dataclass
class _Static:
    address: str
    role: str
    node: Node | None = None
    error: str | None = None


@dataclass
class DiscoveryConfig:
    model_id: str
    block_size: int
    static_prefill: tuple[str, ...] = ()
    static_decode: tuple[str, ...] = ()
    refresh_s: float = 0.5
    health_s: float = 2.0
    down_s: float = 1.0  # a node whose call failed stays out at least this long
    extra: dict = field(default_factory=dict)


class Discovery:
    def __init__(self, config: DiscoveryConfig, clients: NodeClients, registry=None) -> None:
        self.config = config
        self.clients = clients
        self.registry = registry
        self._static = {a: _Static(a, "prefill") for a in config.static_prefill}
        self._static.update({a: _Static(a, "decode") for a in config.static_decode})
        self._registered: dict[str, Node] = {}
        self._infos: dict[str, NodeInfo] = {}  # by address: what GetNodeInfo said
        self._down: dict[str, float] = {}  # node_id -> monotonic time it may come back
        self._warned: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self.registry_error: str | None = None

    # ----------------------------------------------------------------------------------------- life

    async def start(self) -> None:
        await asyncio.gather(self.refresh_registry(), self.check_static(), return_exceptions=True)
        self._tasks = [asyncio.create_task(self._loop(self.refresh_registry, self.config.refresh_s)),
                       asyncio.create_task(self._loop(self.check_static, self.config.health_s))]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _loop(self, fn, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await fn()
            except Exception:  # a bad refresh must not end discovery
                logger.exception("discovery: %s failed", fn.__name__)

    # ---------------------------------------------------------------------------------------- views

    def nodes(self) -> list[Node]:
        """Every known node, routable or not, sorted by (role, node_id)."""
        found = {n.node_id: n for n in self._registered.values()}
        for s in self._static.values():
            if s.node is not None:
                found.setdefault(s.node.node_id, s.node)
        now = time.monotonic()
        out = [replace(n, healthy=False) if self._down.get(n.node_id, 0) > now else n for n in found.values()]
        return sorted(out, key=lambda n: (n.role, n.node_id))

    def routable(self, role: str) -> list[Node]:
        return [n for n in self.nodes() if n.role == role and n.routable]

    def unreachable_static(self) -> list[_Static]:
        return [s for s in self._static.values() if s.node is None]

    def max_model_len(self) -> int | None:
        """The smallest context any routable node accepts (a request must fit wherever it lands)."""
        lens = [n.max_model_len for n in self.nodes() if n.routable and n.max_model_len]
        return min(lens) if lens else None

    def vocab_size(self) -> int | None:
        sizes = [n.vocab_size for n in self.nodes() if n.vocab_size]
        return min(sizes) if sizes else None

    def mark_failed(self, node_id: str, err: Exception) -> None:
        """Take a node out of rotation after a failed call; the next passing health check brings it back."""
        if self._down.get(node_id, 0) <= time.monotonic():
            logger.warning("node %s failed a call, out of rotation: %s", node_id, err)
        self._down[node_id] = time.monotonic() + self.config.down_s

    # ------------------------------------------------------------------------------------- registry

    async def refresh_registry(self) -> None:
        if self.registry is None:
            return
        try:
            rows = self.registry.live_nodes(self.config.model_id)
            rows = await rows if inspect.isawaitable(rows) else rows
        except Exception as e:  # Redis down: keep the last view rather than dropping every node
            if self.registry_error is None:
                logger.warning("registry unreachable, keeping the last node list: %s", e)
            self.registry_error = str(e)
            return
        self.registry_error = None
        fresh: dict[str, Node] = {}
        for reg, load in rows:
            node = self._from_registration(reg, load)
            fresh[node.node_id] = node
            if node.address not in self._infos:
                asyncio.ensure_future(self._fetch_info(node.address))
        self._registered = fresh
        await self._probe_down(n for n in fresh.values())

    def _from_registration(self, reg, load) -> Node:
        info = self._infos.get(reg.grpc_address)
        node = Node(
            node_id=reg.node_id, role=reg.role, address=reg.grpc_address, model_id=reg.model_id,
            block_size=int(reg.block_size), source="registry", kv_address=getattr(reg, "kv_address", ""),
            max_model_len=int(getattr(reg, "max_model_len", 0) or (info.max_model_len if info else 0)),
            vocab_size=int(getattr(reg, "vocab_size", 0) or (info.vocab_size if info else 0)),
            load=Load.of(load), draining=bool(getattr(reg, "draining", False)),
        )
        return self._vet(node)

    async def _fetch_info(self, address: str) -> None:
        try:
            self._infos[address] = await self.clients.get(address).info()
        except NodeRpcError as e:
            logger.debug("GetNodeInfo %s: %s", address, e)

    async def _probe_down(self, nodes: Iterable[Node]) -> None:
        now = time.monotonic()
        probes = [self._probe(n) for n in nodes if self._down.get(n.node_id, 0) > now]
        if probes:
            await asyncio.gather(*probes)

    async def _probe(self, node: Node) -> None:
        try:
            health = await self.clients.get(node.address).health(timeout=self.config.down_s)
        except NodeRpcError:
            return
        if health.healthy:
            self._down.pop(node.node_id, None)
            logger.info("node %s passed its health check, back in rotation", node.node_id)

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
            health, load = await asyncio.gather(client.health(), client.load())
        except NodeRpcError as e:
            if s.node is not None and s.node.healthy:
                logger.warning("static node %s at %s failed its health check: %s", s.node.node_id, s.address, e)
            s.error = str(e)
            if s.node is not None:
                s.node = replace(s.node, healthy=False)
            return
        s.error = None
        s.node = replace(s.node, healthy=health.healthy, draining=health.draining, load=load)
        if health.healthy:
            self._down.pop(s.node.node_id, None)

    def _from_info(self, info: NodeInfo, s: _Static) -> Node:
        role = info.role or s.role
        if role != s.role:
            logger.warning("node at %s was given as --%s but says it is a %s node", s.address, s.role, role)
        node = Node(
            node_id=info.node_id or s.address, role=role, address=s.address, model_id=info.model_id,
            block_size=info.block_size, source="static", kv_address=info.kv_address,
            max_model_len=info.max_model_len, vocab_size=info.vocab_size,
        )
        return self._vet(node)

    # ----------------------------------------------------------------------------------------- vet

    def _vet(self, node: Node) -> Node:
        reason = None
        if node.model_id != self.config.model_id:
            reason = f"serves model {node.model_id!r}, the gateway serves {self.config.model_id!r}"
        elif node.block_size != self.config.block_size:
            reason = f"block size {node.block_size} differs from the gateway's {self.config.block_size}"
        elif node.role not in ROLES:
            reason = f"unknown role {node.role!r}"
        if reason and node.node_id not in self._warned:
            self._warned.add(node.node_id)
            logger.warning("refusing to route to node %s at %s: %s", node.node_id, node.address, reason)
        return replace(node, refused=reason) if reason else node
