"""The offload tier in the simulator: the blocks a node's KV cache evicts, kept in host memory (kvrelay.engine.offload
in production), and loaded back over the host link instead of recomputed.

The production KVCacheManager and BlockPool drive it through the same seams as the real tier (`on_evict`,
`fetch`, `load`); only the bytes are not there. What the tier holds is a set of block hashes with an LRU bound;
loading costs the blocks' bytes over `bytes_per_s` (a GPU's host-to-device link), added to the step that
admits the request, as the real tier's synchronous load is. Writes down are free: they overlap the steps.
Routing sees the tier as in production: it is an entry of the index (`entry_id`, which the node's registration
names), whose STORED/EVICTED events the node publishes after its own; with no `entry_id` it publishes nothing
(routing blind to the tier, to measure what seeing it buys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.common.records import BlockEvent, BlockEventKind, BlockHash


@dataclass
class SimTierStats:
    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    load_s: float = 0.0


class SimTier:
    """One host's tier: `capacity_blocks` blocks of `block_bytes`, loaded at `bytes_per_s`."""

    def __init__(self, capacity_blocks: int, block_bytes: int, bytes_per_s: float, entry_id: str = "") -> None:
        if capacity_blocks < 1 or bytes_per_s <= 0:
            raise ValueError("a simulated tier needs a capacity >= 1 block and a load bandwidth > 0")
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self.bytes_per_s = bytes_per_s
        self.entry_id = entry_id
        self.stats = SimTierStats()
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self._events: list[BlockEvent] = []
        self._pending_s = 0.0  # load time of the blocks loaded since the node's last step started

    def offload(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            if h not in self._blocks and self.entry_id:
                self._events.append(BlockEvent(BlockEventKind.STORED, h))
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        self.stats.offloaded_blocks += len(hashes)
        while len(self._blocks) > self.capacity:
            gone = self._blocks.popitem(last=False)[0]
            if self.entry_id:
                self._events.append(BlockEvent(BlockEventKind.EVICTED, gone))

    def drain_events(self) -> list[BlockEvent]:
        """What the tier stored and evicted since the last call, for the index entry `entry_id`."""
        events, self._events = self._events, []
        return events

    def hashes(self) -> list[BlockHash]:
        return list(self._blocks)

    def token_cost(self, block_size: int, compute_s_per_token: float) -> float:
        """A loaded token's cost as a share of a computed one's (what a node publishes as it measures it)."""
        return min(1.0, self.block_bytes / self.bytes_per_s / block_size / compute_s_per_token)

    def prefetch(self, hashes: Sequence[BlockHash]) -> None:
        """Reads ahead cost the simulated engine nothing: a load is priced in full when it happens."""

    def fetch(self, hashes: Sequence[BlockHash]) -> int:
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            self._blocks.move_to_end(h)
            n += 1
        return n

    def load(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        seconds = len(hashes) * self.block_bytes / self.bytes_per_s
        self._pending_s += seconds
        self.stats.loaded_blocks += len(hashes)
        self.stats.load_s += seconds

    def take_load_s(self) -> float:
        """Load time to add to the step about to run (the loads its scheduling made)."""
        seconds, self._pending_s = self._pending_s, 0.0
        return seconds
