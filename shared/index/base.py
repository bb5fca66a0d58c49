"""The index and registry contracts shared by the Redis backend and the in-process memory backend.

A `BlockIndex` answers "which nodes hold how long a prefix of these blocks" and takes each node's own
STORED/EVICTED events. A `RegistryBackend` holds node registrations under leases, with their load.
Both backends keep the same semantics; the memory one exists for unit tests of the callers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from kvrelay.common.records import BlockEvent, JsonRecord, NodeLoad

Role = Literal["prefill", "decode", "colocated"]
ROLES: tuple[str, ...] = ("prefill", "decode", "colocated")


class IndexUnavailable(RuntimeError):
    """The index store cannot be reached (Redis down, timeout). Callers route without cache hints."""


@dataclass(frozen=True)
class NodeRegistration(JsonRecord):
    node_id: str
    role: Role
    grpc_address: str
    kv_address: str
    connector: str
    model_id: str
    block_size: int
    dtype: str
    capacity_tokens: int
    metrics_address: str = ""
    started_at: float = 0.0
    # The index entries of the offload tiers the node loads from (kvrelay.engine.offload: "tier:<name>:<id>"), in
    # the order it reads them. Every node of a host that shares a tier names the same entry.
    kv_tiers: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.kv_tiers, tuple):  # JSON gives a list
            object.__setattr__(self, "kv_tiers", tuple(self.kv_tiers))
        if self.role not in ROLES:
            raise ValueError(f"role: must be one of {ROLES}, got {self.role!r}")
        if not self.node_id:
            raise ValueError("node_id: must not be empty")


LiveNode = tuple[NodeRegistration, "NodeLoad | None"]


HASH_LEN = 16


def check_block_hashes(block_hashes: Sequence[bytes]) -> None:
    if set(map(len, block_hashes)) - {HASH_LEN}:
        raise ValueError(f"block hashes must be {HASH_LEN} bytes each")


TIER_PREFIX = "tier:"  # index entries of an offload tier, not of a node (NodeRegistration.kv_tiers)


def is_tier(entry_id: str) -> bool:
    return entry_id.startswith(TIER_PREFIX)


def spare_named_tiers(dead: list[str], live: Callable[[], list[LiveNode]]) -> list[str]:
    """The entries of `dead` (no lease) to purge: a tier's entry has no lease of its own and stays while a live
    node names it (`kv_tiers`); `live` is read only when a tier is among them."""
    if not any(map(is_tier, dead)):
        return dead
    named = {t for reg, _ in live() for t in reg.kv_tiers}
    return [n for n in dead if n not in named]


def role_matches(role: str, wanted: str | Collection[str] | None) -> bool:
    if wanted is None:
        return True
    if isinstance(wanted, str):
        return role == wanted
    return role in wanted


class BlockIndex(ABC):
    """One model's block index. Thread-safe: the gateway looks up from many threads while a node's
    publisher thread writes."""

    model_id: str

    @abstractmethod
    def lookup(self, block_hashes: Sequence[bytes], nodes: Collection[str] | None = None) -> dict[str, int]:
        """Number of leading blocks of `block_hashes` (a prompt's chained hashes, in order) each node holds,
        counting up to its first missing block. Only nodes holding at least the first block appear (treat
        others as 0); `nodes`, if given, restricts the answer to those ids. Raises IndexUnavailable."""

    @abstractmethod
    def apply(self, node_id: str, events: Sequence[BlockEvent]) -> bool:
        """Apply one node's events in order (one round trip). Returns True when the node was not known to
        the index before this call (first write, or its entries were purged meanwhile: resync)."""

    @abstractmethod
    def clear_node(self, node_id: str) -> None:
        """Remove every entry of `node_id`. The node stays known while it is registered, else is forgotten."""

    @abstractmethod
    def known_nodes(self) -> set[str]:
        """Node ids that have (or had, until purged) entries or a registration for this model."""

    def wait_ready(self, timeout_s: float) -> bool:  # noqa: B027 - optional hook
        """Block until lookups can be answered (a mirror's first load), at most timeout_s; True if they can."""
        return True

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class RegistryBackend(ABC):
    """Node leases and load. `model_id` namespaces everything, like the index."""

    @abstractmethod
    def register(self, reg: NodeRegistration, ttl_s: float, load: NodeLoad | None = None) -> bool:
        """Write (or renew) the registration with a lease of `ttl_s`. Returns True when a live lease existed
        already (a renewal, or a restart before the old lease lapsed), False when the lease was new or had
        lapsed: a lapsed node may have been purged from the index and must resync."""

    @abstractmethod
    def deregister(self, node_id: str, model_id: str | None = None) -> None:
        """Graceful shutdown: drop the registration and the node's index entries."""

    @abstractmethod
    def live_nodes(self, model_id: str, role: str | Collection[str] | None = None) -> list[LiveNode]:
        """Registered nodes whose lease holds, with their last load (None before the first report)."""

    @abstractmethod
    def purge_dead_nodes(self, model_id: str) -> list[str]:
        """Clear the index entries of known nodes whose lease lapsed. Returns the purged ids."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""
