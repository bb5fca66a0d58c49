"""Simulated gateways and the index they share, built from the production pieces.

- `IndexStream`: the index's events stream. A node's block events become the stream's records (what the
  records Redis stores carry, without their hex text), visible to the gateways `delay_s` later (the
  publisher's batching and the mirror's read). An oracle mirror applies them at once: what was cached
  anywhere, for the "would have hit" measure.
- `SimGateway`: the gateway's `Router` with a policy from `gateway/policies.py`, a real `Discovery` fed from
  the registry (the in-memory backend, on the simulated clock: leases and loads as nodes heartbeat), and a
  `MirrorState` (the mirror's own map and lookup) that follows the stream. A decision is `Router.decide` on
  what `Router.route` would give it: the routable nodes, the prompt's block hashes, and the mirror's lookup.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.prometheus import Metrics
from kvrelay.common.records import BlockEvent, BlockEventKind
from kvrelay.gateway.discovery import Discovery, DiscoveryConfig
from kvrelay.gateway.errors import NoCapacity
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.node_client import NodeClients
from kvrelay.gateway.policies import make_policy
from kvrelay.gateway.router import RouteDecision, Router, TierHits, sees_tiers, tier_lookups
from kvrelay.index.mirror import MirrorState

STORED = BlockEventKind.STORED

# The names the issue and `kvrelay sim` use, and the gateway's policy each one runs.
SIM_POLICIES = {"precise": "cache_aware", "approximate": "approximate", "round_robin": "round_robin",
                "random": "random", "least_load": "least_loaded"}


def gateway_policy(name: str) -> str:
    if name in SIM_POLICIES:
        return SIM_POLICIES[name]
    if name in SIM_POLICIES.values():
        return name
    raise ValueError(f"policy: {name!r}; choose one of {', '.join(SIM_POLICIES)}")


class IndexStream:
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        # (visible at, node, hashes, stored flags or None when all are stores): a batch of the stream's records
        self._entries: list[tuple[float, str, list[bytes], list[bool] | None]] = []
        self._offset = 0  # stream position of _entries[0]
        self.oracle = MirrorState()
        self.num_records = 0

    @property
    def end(self) -> int:
        return self._offset + len(self._entries)

    def publish(self, now: float, node_id: str, events: Sequence[BlockEvent]) -> None:
        # What the publisher's records carry, without their hex text (MirrorState.apply decodes that into this).
        hashes = [e.block_hash for e in events]
        stored: list[bool] | None = [e.kind is STORED for e in events]
        if all(stored):
            stored = None
        self._entries.append((now + self.delay_s, node_id, hashes, stored))
        self.oracle.apply_changes(node_id, hashes, stored)
        self.num_records += len(events)

    def follow(self, state: MirrorState, cursor: int, now: float) -> int:
        """Apply to `state` the entries from `cursor` visible by `now`; returns the new cursor."""
        entries, i = self._entries, cursor - self._offset
        n = len(entries)
        while i < n and entries[i][0] <= now:
            _, node, hashes, stored = entries[i]
            state.apply_changes(node, hashes, stored)
            i += 1
        return i + self._offset

    def trim(self, cursors: Sequence[int]) -> None:
        """Forget the entries every follower has applied."""
        low = min(cursors, default=self.end) - self._offset
        if low > 4096:
            del self._entries[:low]
            self._offset += low

    def forget_node(self, node_id: str, hashes: Sequence[bytes], now: float) -> None:
        """A node left: its entries are cleared (deregistration), as one entry of removals."""
        if hashes:
            gone = list(hashes)
            evicted = [False] * len(gone)
            self._entries.append((now + self.delay_s, node_id, gone, evicted))
            self.oracle.apply_changes(node_id, gone, evicted)


def snapshot(holdings: dict[str, Sequence[bytes]]) -> MirrorState:
    """A mirror's snapshot load: every node's hashes, as the index holds them now."""
    state = MirrorState()
    for node_id, hashes in holdings.items():
        if hashes:
            state.apply_changes(node_id, hashes)
    return state


class SimGateway:
    def __init__(self, name: str, policy: str, seed: int, model_id: str, block_size: int,
                 local_prefill_threshold: int, stream: IndexStream) -> None:
        self.name = name
        self.policy = make_policy(gateway_policy(policy), seed=seed)
        self.metrics = GatewayMetrics(model_id, policy)
        self.discovery = Discovery(DiscoveryConfig(model_id=model_id, block_size=block_size), NodeClients(),
                                   metrics=self.metrics)
        self.router = Router(self.discovery, self.policy, None, local_prefill_threshold, self.metrics)
        self.stream = stream
        self.mirror: MirrorState | None = None
        self.cursor = stream.end
        self.inflight = 0  # requests this gateway is serving
        self.accepting = True

    def load_snapshot(self, holdings: dict[str, Sequence[bytes]]) -> None:
        """Start (or restart) the mirror from the index as it is now, then follow the stream."""
        self.mirror = snapshot(holdings) if self.policy.uses_cache else None
        self.cursor = self.stream.end

    def refresh(self, rows: list) -> None:
        self.discovery.set_registered(rows)

    def route(self, prompt: Sequence[int], now: float, user: str | None = None) -> tuple[RouteDecision, list[bytes]]:
        """The decision `Router.route` makes, and the prompt's block hashes. NoCapacity without a decode node."""
        decode = self.discovery.routable("decode")
        if not decode:
            raise NoCapacity("no decode node is up; retry later")
        prefill = self.discovery.routable("prefill")
        hashes = prompt_block_hashes(prompt, self.router.model_id, self.router.block_size)
        hits: dict[str, int] = {}
        tier_hits: TierHits | None = None
        if hashes and self.mirror is not None:
            self.cursor = self.stream.follow(self.mirror, self.cursor, now)
            hits = self.mirror.lookup(hashes)
            if sees_tiers(hits, nodes := decode + prefill):
                tier_hits = {}
                while wanted := tier_lookups(hashes, hits, tier_hits, nodes):
                    for offset, tiers in wanted.items():
                        tier_hits[offset] = self.mirror.lookup(hashes[offset:], tiers)
        decision = self.router.decide(prompt, hashes, hits, prefill, decode, 0.0, user, tier_hits=tier_hits)
        self.metrics.observe_route(decision)
        return decision, hashes

    def mismatched_nodes(self) -> int:
        """Nodes this gateway refused for another model or block size (its kvrelay:node_config_mismatches)."""
        found = Metrics.parse(self.metrics.render().decode()).select("kvrelay:node_config_mismatches_total")
        return int(sum(s.value for s in found))
