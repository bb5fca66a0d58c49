"""The KV block pool: ref-counted blocks, a hash->block map for prefix caching, an O(1) LRU free queue.

Lifecycle of a block:
1. Free and uncached: in the free queue, no hash.
2. Allocated: popped from the front of the free queue, ref_cnt 1. If it still carried a hash from an
   earlier life, that hash is evicted now (and only now: eviction happens when a block is reused).
3. Cached: once its tokens are known and full, it gets the chained hash and enters the hash map.
   Another request with the same prefix `touch`es it (ref_cnt + 1, out of the free queue if it was there).
4. Freed: ref_cnt - 1; at 0 it goes to the tail of the free queue but keeps its hash, so it can be
   hit again until its slot is needed.
Every store and eviction is recorded as an event for the index publisher to drain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Protocol

from kvrelay.common.records import BlockEvent, BlockEventKind, BlockHash


class BlockEventSink(Protocol):
    """Takes a cache's changes in order: the prefix cache's, on the engine thread, or an offload tier's, on its
    writer thread (a node's index publisher for the node's entry, or the tier's)."""

    @property
    def snapshot_wanted(self) -> bool: ...

    def submit(self, events: Sequence[BlockEvent]) -> None: ...

    def submit_snapshot(self, hashes: Sequence[BlockHash]) -> None: ...


# A BlockEvent from its two fields as one tuple, without the named tuple's Python-level __new__: a node makes one
# per block it fills or evicts.
_event = partial(tuple.__new__, BlockEvent)
_STORED = BlockEventKind.STORED


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the front (least recently freed), append at the back,
    and unlink any block in O(1) when a cache hit revives it."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        # Linked in one pass (a pool is tens of thousands of blocks; the fleet simulator builds one per node).
        last, n = self._head, 0
        for block in blocks:
            last.next_free, block.prev_free = block, last
            last, n = block, n + 1
        last.next_free, self._tail.prev_free = self._tail, last
        self.num_free = n

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, record_events: bool = False,
                 on_evict: Callable[[list[int], list[BlockHash]], None] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks: must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # Only a node that publishes to the index drains events; offline use must not accumulate them.
        self.record_events = record_events
        self._events: list[BlockEvent] = []
        # Told of cached blocks whose slots are being reused, before anything writes into them (the offload tier
        # copies them out): ids and hashes of blocks computed in full, never of blocks uncached as uncomputed.
        self.on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, reviving free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks: only {self.num_free_blocks} free")
        out = []
        if self.on_evict is None:
            for _ in range(n):
                block = self.free_queue.popleft()
                self._evict(block)
                block.ref_cnt = 1
                out.append(block)
            return out
        ids: list[int] = []
        hashes: list[BlockHash] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None and self.cached.get(block.block_hash) is block:
                ids.append(block.block_id)
                hashes.append(block.block_hash)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if ids:
            self.on_evict(ids, hashes)
        return out

    def uncache_block(self, block: KVBlock) -> None:
        """Drop a block's hash (its KV will not be computed after all); it stays allocated."""
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.record_events:
                self._events.append(_event((BlockEventKind.EVICTED, block.block_hash)))
        block.block_hash = None

    def cache_blocks(self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash]) -> None:
        """Give full, computed (or about to be computed this step) blocks their hashes, pairwise. A block that
        has one keeps it; a hash another block holds already (the same prefix computed twice at once) stays
        private to this block: one block per hash."""
        if not self.enable_caching:
            return
        cached, events = self.cached, self._events if self.record_events else None
        for block, block_hash in zip(blocks, block_hashes):
            if block.block_hash is not None:
                continue
            block.block_hash = block_hash
            if block_hash not in cached:
                cached[block_hash] = block
                if events is not None:
                    events.append(_event((_STORED, block_hash)))

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference from each; blocks that reach 0 go to the free queue in the given order
        (callers pass a request's blocks tail first, so its last blocks are evicted first)."""
        for block in ordered:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def drain_events(self) -> list[BlockEvent]:
        events, self._events = self._events, []
        return events
