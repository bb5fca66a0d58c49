"""Which nodes exist and which may take requests: the Redis registry plus static --prefill/--decode addresses.

Registry nodes are alive while their lease is (the registry only returns those). Static nodes have no
lease: the gateway asks each for GetNodeInfo until it answers, then health-checks it periodically. Any node
whose call fails is taken out of rotation until a health check passes again, so a crashed node costs one
failed request, not one per refresh interval. A node whose model or block size differs from the gateway's
is listed (in /health) but never routed to: its block hashes would mean nothing here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from gateway.node_client import NodeClients, NodeRpcError
from shared.records import NodeLoad
from shared.wire import NodeInfo

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
    # Folded from `load` once, not per request (routing reads them for every node of every request).
    queued_tokens: int = field(init=False, default=0)
    active_seqs: int = field(init=False, default=0)
    free_tokens: int | None = field(init=False, default=None)  # None: unknown

    def __post_init__(self) -> None:
        load = self.load
        if load is not None:
            object.__setattr__(self, "queued_tokens", load.queued_prefill_tokens)
            object.__setattr__(self, "active_seqs", load.num_running + load.num_waiting)
            if load.total_kv_blocks:
                object.__setattr__(self, "free_tokens", load.free_kv_blocks * self.block_size)

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
    probe_timeout_s: float = 1.0


class Discovery:
    def __init__(self, config: DiscoveryConfig, clients: NodeClients, registry=None) -> None:
        self.config = config
        self.clients = clients
        self.registry = registry
        self._static = {a: _Static(a, "prefill") for a in config.static_prefill}
        self._static.update({a: _Static(a, "decode") for a in config.static_decode})
        self._registered: dict[str, Node] = {}
        self._infos: dict[str, NodeInfo] = {}  # by address: what GetNodeInfo said
        self._fetching: set[str] = set()
        self._down: set[str] = set()  # failed a call; out until a health check passes
        self._view: tuple[list[Node], dict[str, list[Node]]] | None = None  # (all, routable by role)
        self._warned: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self.registry_error: str | None = None

    # ----------------------------------------------------------------------------------------- life

    async def start(self) -> None:
        await asyncio.gather(self.refresh_registry(), self.check_static(), return_exceptions=True)
        self._tasks = [asyncio.create_task(self._loop(self.refresh_registry, self.config.refresh_s)),
                       asyncio.create_task(self._loop(self.check_static, self.config.health_s))]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
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

    def nodes(self) -> list[Node]:
        """Every known node, routable or not, sorted by (role, node_id)."""
        return self._views()[0]

    def routable(self, role: str) -> list[Node]:
        """The nodes of `role` that may take requests now (a cached list: do not modify)."""
        return self._views()[1].get(role, [])

    def _views(self) -> tuple[list[Node], dict[str, list[Node]]]:
        # Rebuilt only when something changed: routing asks for every request.
        if self._view is None:
            found = {n.node_id: n for n in self._registered.values()}
            for s in self._static.values():
                if s.node is not None:
                    found.setdefault(s.node.node_id, s.node)
            nodes = sorted((replace(n, healthy=False) if n.node_id in self._down else n for n in found.values()),
                           key=lambda n: (n.role, n.node_id))
            by_role: dict[str, list[Node]] = {}
            for n in nodes:
                if n.routable:
                    by_role.setdefault(n.role, []).append(n)
            self._view = (nodes, by_role)
        return self._view

    def _changed(self) -> None:
        self._view = None

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
        if node_id not in self._down:
            logger.warning("node %s failed a call, out of rotation until a health check passes: %s", node_id, err)
            self._down.add(node_id)
            self._changed()

    # ------------------------------------------------------------------------------------- registry

    async def refresh_registry(self) -> None:
        if self.registry is None:
            return
        try:
            # A thread: the registry client is blocking, and a slow Redis must not stall the request loop.
            rows = await asyncio.to_thread(self.registry.live_nodes, self.config.model_id)
        except Exception as e:  # Redis down: keep the last view rather than dropping every node
            if self.registry_error is None:
                logger.warning("registry unreachable, keeping the last node list: %s", e)
            self.registry_error = str(e)
            return
        self.registry_error = None
        self._tasks = [t for t in self._tasks if not t.done()]
        fresh: dict[str, Node] = {}
        for reg, load in rows:
            node = self._from_registration(reg, load)
            fresh[node.node_id] = node
            if node.address not in self._infos and node.address not in self._fetching:
                self._fetching.add(node.address)
                self._tasks.append(asyncio.ensure_future(self._fetch_info(node.address)))
        self._registered = fresh
        self._changed()
        await self._probe_down(n for n in fresh.values())

    def _from_registration(self, reg, load) -> Node:
        info = self._infos.get(reg.grpc_address)
        node = Node(
            node_id=reg.node_id, role=reg.role, address=reg.grpc_address, model_id=reg.model_id,
            block_size=int(reg.block_size), source="registry", kv_address=getattr(reg, "kv_address", ""),
            max_model_len=int(getattr(reg, "max_model_len", 0) or (info.max_model_len if info else 0)),
            vocab_size=int(getattr(reg, "vocab_size", 0) or (info.vocab_size if info else 0)),
            load=load, draining=bool(getattr(reg, "draining", False)),
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

    async def _probe_down(self, nodes: Iterable[Node]) -> None:
        probes = [self._probe(n) for n in nodes if n.node_id in self._down]
        if probes:
            await asyncio.gather(*probes)

    async def _probe(self, node: Node) -> None:
        try:
            health = await self.clients.get(node.address).health(timeout=self.config.probe_timeout_s)
        except NodeRpcError:
            return
        if health.healthy:
            self._back(node.node_id)

    def _back(self, node_id: str) -> None:
        if node_id in self._down:
            self._down.discard(node_id)
            self._changed()
            logger.info("node %s passed its health check, back in rotation", node_id)

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
                self._changed()
            return
        s.error = None
        s.node = replace(s.node, healthy=health.healthy, draining=health.draining, load=load)
        self._changed()
        if health.healthy:
            self._back(s.node.node_id)

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
