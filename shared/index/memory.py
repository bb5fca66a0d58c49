"""In-process index and registry with the Redis backend's semantics, for unit tests of their callers.

Backends created with the same name ("memory" or "memory://<name>") share one store, the way processes
share a Redis: a gateway and nodes in one test process see each other's writes and leases.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvrelay.common.records import BlockEvent, BlockEventKind, NodeLoad
from kvrelay.index.base import (
    BlockIndex,
    LiveNode,
    NodeRegistration,
    RegistryBackend,
    check_block_hashes,
    role_matches,
    spare_named_tiers,
)


@dataclass
class _ModelState:
    holders: dict[bytes, set[str]] = field(default_factory=dict)  # block hash -> node ids
    node_hashes: dict[str, set[bytes]] = field(default_factory=dict)
    known: set[str] = field(default_factory=set)
    # node_id -> (registration, load, lease expiry on the store's clock)
    leases: dict[str, tuple[NodeRegistration, NodeLoad | None, float]] = field(default_factory=dict)


class MemoryStore:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self._models: dict[str, _ModelState] = {}

    def model(self, model_id: str) -> _ModelState:
        state = self._models.get(model_id)
        if state is None:
            state = self._models[model_id] = _ModelState()
        return state

    def registered(self, state: _ModelState, node_id: str) -> bool:
        lease = state.leases.get(node_id)
        if lease is not None and lease[2] <= self.clock():
            del state.leases[node_id]  # lapsed, like a Redis key past its TTL
            return False
        return lease is not None

    def clear(self, model_id: str, node_id: str, only_if_dead: bool) -> bool:
        with self.lock:
            state = self.model(model_id)
            registered = self.registered(state, node_id)
            if only_if_dead and registered:
                return False
            for h in state.node_hashes.pop(node_id, set()):
                holders = state.holders.get(h)
                if holders is not None:
                    holders.discard(node_id)
                    if not holders:
                        del state.holders[h]
            if not registered:
                state.known.discard(node_id)
            return True


_STORES: dict[str, MemoryStore] = {}
_STORES_LOCK = threading.Lock()


def get_store(name: str = "memory") -> MemoryStore:
    with _STORES_LOCK:
        store = _STORES.get(name)
        if store is None:
            store = _STORES[name] = MemoryStore()
        return store


def drop_store(name: str) -> None:
    with _STORES_LOCK:
        _STORES.pop(name, None)


class MemoryIndex(BlockIndex):
    def __init__(self, store: MemoryStore, model_id: str) -> None:
        self.store = store
        self.model_id = model_id
        self.num_write_round_trips = 0

    def lookup(self, block_hashes: Sequence[bytes], nodes: Collection[str] | None = None) -> dict[str, int]:
        check_block_hashes(block_hashes)
        if not block_hashes or (nodes is not None and not nodes):
            return {}
        with self.store.lock:
            holders = self.store.model(self.model_id).holders
            active = set(holders.get(block_hashes[0], ()))
            if nodes is not None:
                active &= set(nodes)
            out: dict[str, int] = {}
            for i, h in enumerate(block_hashes[1:], start=1):
                if not active:
                    break
                held = holders.get(h, set())
                for node in active - held:
                    out[node] = i
                active &= held
            out.update((node, len(block_hashes)) for node in active)
            return out

    def apply(self, node_id: str, events: Sequence[BlockEvent]) -> bool:
        if not events:
            return False
        with self.store.lock:
            self.num_write_round_trips += 1
            state = self.store.model(self.model_id)
            fresh = node_id not in state.known
            state.known.add(node_id)
            mine = state.node_hashes.setdefault(node_id, set())
            for event in events:
                h = event.block_hash
                if event.kind is BlockEventKind.STORED:
                    state.holders.setdefault(h, set()).add(node_id)
                    mine.add(h)
                else:
                    mine.discard(h)
                    holders = state.holders.get(h)
                    if holders is not None:
                        holders.discard(node_id)
                        if not holders:
                            del state.holders[h]
            return fresh

    def clear_node(self, node_id: str) -> None:
        self.store.clear(self.model_id, node_id, only_if_dead=False)

    def known_nodes(self) -> set[str]:
        with self.store.lock:
            return set(self.store.model(self.model_id).known)

    def node_hashes(self, node_id: str) -> set[bytes]:
        with self.store.lock:
            return set(self.store.model(self.model_id).node_hashes.get(node_id, ()))


class MemoryRegistry(RegistryBackend):
    def __init__(self, store: MemoryStore) -> None:
        self.store = store
        self._models: dict[str, str] = {}  # node_id -> model_id of what this client registered

    def register(self, reg: NodeRegistration, ttl_s: float, load: NodeLoad | None = None) -> bool:
        with self.store.lock:
            state = self.store.model(reg.model_id)
            existed = self.store.registered(state, reg.node_id)
            if load is None and existed:
                load = state.leases[reg.node_id][1]
            state.leases[reg.node_id] = (reg, load, self.store.clock() + ttl_s)
            state.known.add(reg.node_id)
            self._models[reg.node_id] = reg.model_id
            return existed

    def deregister(self, node_id: str, model_id: str | None = None) -> None:
        remembered = self._models.pop(node_id, None)
        model_id = model_id or remembered
        if model_id is None:
            raise KeyError(f"deregister: unknown model of node {node_id!r}; pass model_id")
        with self.store.lock:
            self.store.model(model_id).leases.pop(node_id, None)
            self.store.clear(model_id, node_id, only_if_dead=False)

    def live_nodes(self, model_id: str, role: str | Collection[str] | None = None) -> list[LiveNode]:
        with self.store.lock:
            state = self.store.model(model_id)
            out = []
            for node_id in sorted(state.known):
                if self.store.registered(state, node_id):
                    reg, load, _ = state.leases[node_id]
                    if role_matches(reg.role, role):
                        out.append((reg, load))
            return out

    def purge_dead_nodes(self, model_id: str) -> list[str]:
        with self.store.lock:
            state = self.store.model(model_id)
            dead = [n for n in sorted(state.known) if not self.store.registered(state, n)]
            dead = spare_named_tiers(dead, lambda: self.live_nodes(model_id))
            return [n for n in dead if self.store.clear(model_id, n, only_if_dead=True)]
