"""Routing sees the offload tier: each tier of a host's store is one entry of the block index, which the tier's
writer thread keeps equal to the folder's blocks of its namespace, whoever wrote or evicted them. And the tier
reads a request's blocks ahead of its admission, off the engine thread."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from kvrelay.engine.offload.store import DirTier, TieredStore
from kvrelay.engine.offload.tier import KVOffload
from kvrelay.index.memory import MemoryIndex, get_store
from kvrelay.index.publisher import IndexPublisher
from tests.helpers.nodes import wait_for

BLOCK_BYTES = 4096
H = [bytes([i]) * 16 for i in range(8)]


class Blocks:
    """A KV cache of numbered blocks in host memory (what the model runner's BlockIO gives the tier)."""

    def __init__(self, n: int) -> None:
        self.data = [bytes([i]) * BLOCK_BYTES for i in range(n)]

    def read_blocks(self, block_ids: Sequence[int]) -> list[memoryview]:
        return [memoryview(self.data[i]) for i in block_ids]

    def write_blocks(self, block_ids: Sequence[int], payloads) -> None:
        for i, p in zip(block_ids, payloads):
            self.data[i] = bytes(p)


def _offload(folder, namespace: str = "model|float32|16") -> KVOffload:
    tier = DirTier("memory", folder, 3 * (BLOCK_BYTES + 20))  # three blocks and their headers
    return KVOffload(TieredStore([tier]), namespace, Blocks(8), BLOCK_BYTES)


def test_the_index_entry_follows_the_folder_whoever_writes_or_evicts(tmp_path):
    index = MemoryIndex(get_store(f"memory://tier-{uuid.uuid4().hex[:8]}"), "model")
    a, b = _offload(tmp_path / "shm"), _offload(tmp_path / "shm")  # two nodes of one host
    other = _offload(tmp_path / "shm", "model|bfloat16|16")
    tier_id = a.tier_ids()["memory"]
    assert tier_id.startswith("tier:memory:") and b.tier_ids() == a.tier_ids() != other.tier_ids()
    (tmp_path / "shm" / (a.key(H[0])[:-32] + "not-hex.kvb")).write_bytes(b"")  # a stray name is passed over
    publisher = IndexPublisher(index, tier_id)
    a.publish_to({"memory": publisher}, interval_s=0.05)
    try:
        a.offload([0, 1], H[:2])
        wait_for(lambda: index.lookup(H[:2]) == {tier_id: 2}, 5, "the written blocks in the index")
        b.offload([2, 3], H[2:4])  # the other node's writer evicts the oldest block, h0, to make room
        b.flush()
        wait_for(lambda: index.lookup(H[:1]) == {} and index.lookup(H[1:4]) == {tier_id: 3}, 5,
                 "the other node's eviction in the index")
        index.clear_node(tier_id)  # as a Redis restart would: the publisher's resync brings the listing back
        publisher.request_resync()
        wait_for(lambda: index.lookup(H[1:4]) == {tier_id: 3}, 5, "the listing published again")
    finally:
        for t in (a, b, other):
            t.close()
        publisher.close()


def test_a_loaded_token_is_weighed_against_a_computed_one_as_measured(tmp_path):
    tier = _offload(tmp_path / "shm")
    assert tier.token_cost() == 0.0  # nothing measured yet
    tier.offload([0], H[:1])
    tier.flush()
    tier.observe_step(32, 1.0)  # a decode-sized step measures nothing
    assert tier.token_cost() == 0.0
    assert tier.fetch(H[:1]) == 1
    tier.load([5], H[:1])
    tier.observe_step(128, 0.128)  # 1 ms per computed token
    s = tier.stats
    assert tier.token_cost() == min(1.0, (s.fetch_seconds + s.load_seconds) / 16 / 0.001)
    assert 0.0 < tier.token_cost() <= 1.0
    tier.close()


def test_blocks_read_ahead_are_counted_without_reading_them_again(tmp_path):
    writer, reader = _offload(tmp_path / "shm"), _offload(tmp_path / "shm")
    writer.offload([1, 2], H[:2])
    writer.flush()
    (tier,) = reader.store.tiers
    reader.prefetch(H[:3])  # the third is not in the store: the read ahead stops there
    wait_for(lambda: reader.stats.prefetched_blocks == 2, 5, "the blocks read ahead")
    assert tier.stats.hits == 2
    assert reader.fetch(H[:3]) == 2
    assert tier.stats.hits == 2  # counted from what the reader staged, not read again
    reader.load([6, 7], H[:2])
    assert reader.io.read_blocks([6, 7]) == [memoryview(bytes([1]) * BLOCK_BYTES), memoryview(bytes([2]) * BLOCK_BYTES)]
    for t in (writer, reader):
        t.close()
