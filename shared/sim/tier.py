"""The offload tier in the simulator: the blocks a node's KV cache evicts, kept in host memory (kvrelay.engine.offload
in production), and loaded back over the host link instead of recomputed.

The production KVCacheManager and BlockPool drive it through the same seams as the real tier (`on_evict`,
`fetch`, `load`); only the bytes are not there. What the tier holds is a set of block hashes with an LRU bound;
loading costs the blocks' bytes over `bytes_per_s` (a GPU's host-to-device link), added to the step that
admits the request, as the real tier's synchronous load is. Writes down are free: they overlap the steps.
Routing does not see the tier, as in production.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvrelay.common.records import BlockHash


@dataclass
class SimTierStats:
    offloaded_blocks: int = 0
    loaded_blocks: int = 0
    load_s: float = 0.0


class SimTier:
    """One host's tier: `capacity_blocks` blocks of `block_bytes`, loaded at `bytes_per_s`."""

    def __init__(self, capacity_blocks: int, block_bytes: int, bytes_per_s: float) -> None:
        if capacity_blocks < 1 or bytes_per_s <= 0:
            raise ValueError("a simulated tier needs a capacity >= 1 block and a load bandwidth > 0")
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self.bytes_per_s = bytes_per_s
        self.stats = SimTierStats()
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()
        self._pending_s = 0.0  # load time of the blocks loaded since the node's last step started

    def offload(self, block_ids: Sequence[int], hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        self.stats.offloaded_blocks += len(hashes)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

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
