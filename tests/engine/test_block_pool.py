"""BlockPool (free queue, ref counts, hash map, events) and KVCacheManager (block tables, prefix hits)."""

from __future__ import annotations

import pytest

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.records import BlockEvent, BlockEventKind
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvrelay.engine.kv_cache_manager import NO_HIT, KVCacheManager, blocks_needed, cdiv, ids
from kvrelay.engine.request import Request

BS = 4


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def ids_of(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def check_pool(pool: BlockPool) -> None:
    """Structural invariants of a pool."""
    free = pool.free_queue.block_ids()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    for b in pool.blocks:
        assert b.ref_cnt >= 0
        assert (b.block_id in free) == (b.ref_cnt == 0)
    for hsh, b in pool.cached.items():
        assert b.block_hash == hsh


# -- FreeBlockQueue ---------------------------------------------------------------------------------


def test_free_queue_links():
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3] and q.num_free == 4
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3] and q.num_free == 3
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 0, 2]
    for _ in range(4):
        q.popleft()
    assert q.num_free == 0 and q.block_ids() == []
    with pytest.raises(ValueError):
        q.popleft()


# -- BlockPool ----------------------------------------------------------------------------------------


def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_free_queue_order_after_allocations_and_frees():
    pool = BlockPool(6)
    assert pool.free_queue.block_ids() == [0, 1, 2, 3, 4, 5]
    a = pool.get_new_blocks(2)
    assert ids_of(a) == [0, 1] and all(b.ref_cnt == 1 for b in a)
    b = pool.get_new_blocks(3)
    assert ids_of(b) == [2, 3, 4]
    assert pool.free_queue.block_ids() == [5] and pool.num_free_blocks == 1
    pool.free_blocks([b[1]])
    assert pool.free_queue.block_ids() == [5, 3]
    pool.free_blocks(reversed(a))  # tail first
    assert pool.free_queue.block_ids() == [5, 3, 1, 0]
    assert ids_of(pool.get_new_blocks(3)) == [5, 3, 1]
    assert pool.free_queue.block_ids() == [0]
    assert pool.get_new_blocks(0) == []
    check_pool(pool)


def test_free_blocks_tail_first_evicts_the_last_block_first():
    pool = BlockPool(5)
    table = pool.get_new_blocks(4)  # [0, 1, 2, 3]
    for i, blk in enumerate(table):
        pool.cache_blocks([blk], [h(i)])
    pool.free_blocks(reversed(table))
    # The free queue: the untouched block, then the request's blocks from last to first.
    assert pool.free_queue.block_ids() == [4, 3, 2, 1, 0]
    # So the next allocations reuse (and evict) the request's last block before its first.
    assert ids_of(pool.get_new_blocks(2)) == [4, 3]
    assert set(pool.cached) == {h(0), h(1), h(2)}
    assert ids_of(pool.get_new_blocks(1)) == [2]
    assert set(pool.cached) == {h(0), h(1)}


def test_free_blocks_only_requeues_at_ref_zero():
    pool = BlockPool(3)
    blk = pool.get_new_blocks(1)[0]
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and pool.free_queue.block_ids() == [1, 2]
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and pool.free_queue.block_ids() == [1, 2, 0]


def test_double_free_raises():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([blk])
    assert pool.free_queue.block_ids() == [1, 2, 0]
    # A block that was never allocated cannot be freed either.
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([pool.blocks[1]])
    check_pool(pool)


def test_get_new_blocks_short_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.free_queue.block_ids() == [2]
    check_pool(pool)


def test_touch_revives_a_free_cached_block_from_the_middle_in_o1(monkeypatch):
    pool = BlockPool(6)
    table = pool.get_new_blocks(6)
    for i, blk in enumerate(table):
        pool.cache_blocks([blk], [h(i)])
    pool.free_blocks(reversed(table))
    assert pool.free_queue.block_ids() == [5, 4, 3, 2, 1, 0]
    target = pool.get_cached_block(h(2))
    assert target is pool.blocks[2] and target.ref_cnt == 0

    # O(1): touching must unlink through the block's own links, never walk the queue.
    def no_walk(self):
        raise AssertionError("the free queue was traversed")

    monkeypatch.setattr(FreeBlockQueue, "__iter__", no_walk)
    pool.touch([target])
    monkeypatch.undo()

    assert target.ref_cnt == 1 and target.prev_free is None and target.next_free is None
    assert pool.free_queue.block_ids() == [5, 4, 3, 1, 0]
    assert pool.blocks[3].next_free is pool.blocks[1] and pool.blocks[1].prev_free is pool.blocks[3]
    assert pool.num_free_blocks == 5
    # Still cached (touching is a hit, not an eviction).
    assert pool.get_cached_block(h(2)) is target and target.block_hash == h(2)
    # Touching an in-use block only adds a reference.
    pool.touch([target])
    assert target.ref_cnt == 2 and pool.num_free_blocks == 5
    check_pool(pool)


@pytest.mark.parametrize("record", [True, False])
def test_eviction_only_on_reuse(record):
    pool = BlockPool(3, record_events=record)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a], [h(10)])
    pool.cache_blocks([b], [h(11)])
    stored = [BlockEvent(BlockEventKind.STORED, h(10)), BlockEvent(BlockEventKind.STORED, h(11))]
    assert pool.drain_events() == (stored if record else [])
    pool.free_blocks([b, a])
    assert pool.free_queue.block_ids() == [2, 1, 0]
    # Freed blocks keep their hashes and stay hittable; no event yet.
    assert pool.get_cached_block(h(10)) is a and pool.get_cached_block(h(11)) is b
    assert a.block_hash == h(10)
    assert pool.drain_events() == []
    # Allocating the uncached block 2 evicts nothing.
    assert ids_of(pool.get_new_blocks(1)) == [2]
    assert set(pool.cached) == {h(10), h(11)} and pool.drain_events() == []
    # Reusing block 1 (h(11)) evicts exactly that hash.
    assert pool.get_new_blocks(1) == [b]
    assert b.block_hash is None and b.ref_cnt == 1
    assert pool.get_cached_block(h(11)) is None and pool.get_cached_block(h(10)) is a
    assert pool.drain_events() == ([BlockEvent(BlockEventKind.EVICTED, h(11))] if record else [])
    assert pool.drain_events() == []
    # Re-storing a hash after its eviction is recorded again, in order.
    pool.cache_blocks([b], [h(11)])
    assert pool.get_cached_block(h(11)) is b
    assert pool.drain_events() == ([BlockEvent(BlockEventKind.STORED, h(11))] if record else [])
    check_pool(pool)


def test_duplicate_hash_keeps_one_block_in_the_map():
    pool = BlockPool(4, record_events=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_blocks([a], [h(1)])
    pool.cache_blocks([b], [h(1)])  # the same prefix computed twice
    assert pool.get_cached_block(h(1)) is a
    assert len(pool.cached) == 1
    assert pool.drain_events() == [BlockEvent(BlockEventKind.STORED, h(1))]
    # Evicting the private duplicate leaves the map entry alone and records nothing.
    pool.free_blocks([b])
    assert pool.get_new_blocks(1) == [pool.blocks[3]]
    assert pool.get_new_blocks(1) == [b]
    assert pool.get_cached_block(h(1)) is a and pool.drain_events() == []
    # A block keeps its first hash.
    pool.cache_blocks([a], [h(2)])
    assert a.block_hash == h(1) and pool.get_cached_block(h(2)) is None
    # Once the mapped block is evicted, another block may take the hash.
    pool.free_blocks([a])
    assert pool.get_new_blocks(1) == [a]
    assert pool.get_cached_block(h(1)) is None
    pool.cache_blocks([c], [h(1)])
    assert pool.get_cached_block(h(1)) is c
    assert pool.drain_events() == [BlockEvent(BlockEventKind.EVICTED, h(1)), BlockEvent(BlockEventKind.STORED, h(1))]


def test_caching_disabled_stores_nothing():
    pool = BlockPool(2, enable_caching=False, record_events=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_blocks([a], [h(1)])
    assert a.block_hash is None and pool.cached == {} and pool.drain_events() == []


def test_reset_prefix_cache_only_when_nothing_in_use():
    pool = BlockPool(3, record_events=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_blocks([a], [h(1)])
    pool.cache_blocks([b], [h(2)])
    pool.drain_events()
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is False
    assert set(pool.cached) == {h(1), h(2)} and b.block_hash == h(2) and pool.drain_events() == []
    pool.free_blocks([a])
    order = pool.free_queue.block_ids()
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and all(blk.block_hash is None for blk in pool.blocks)
    assert sorted(e.block_hash for e in pool.drain_events()) == [h(1), h(2)]
    assert pool.free_queue.block_ids() == order and pool.num_free_blocks == 3
    assert pool.usage() == 0.0


def test_usage():
    pool = BlockPool(4)
    assert pool.usage() == 0.0
    pool.get_new_blocks(1)
    assert pool.usage() == 0.25


# -- KVCacheManager -------------------------------------------------------------------------------------


def make_req(rid: str, prompt: list[int], salt: str = "") -> Request:
    req = Request(rid, prompt, SamplingParams(max_tokens=100), cache_salt=salt)
    req.max_tokens = 100
    return req


def make_kv(num_blocks: int, caching: bool = True, record: bool = False) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, caching, record_events=record), BS, "m", enable_caching=caching)


def step(kv: KVCacheManager, req: Request, n: int, hit=NO_HIT, sample: int | None = None):
    """What the scheduler does for one request in one step: allocate, count computed, maybe sample."""
    new = kv.allocate_slots(req, n, hit)
    assert new is not None
    req.num_computed_tokens += hit.num_tokens + n
    if sample is not None:
        assert req.num_computed_tokens == req.num_tokens
        req.append_output_token(sample)
    return ids_of(new)


def test_helpers():
    assert cdiv(0, 4) == 0 and cdiv(1, 4) == 1 and cdiv(4, 4) == 1 and cdiv(5, 4) == 2
    assert blocks_needed(9, 4) == 3
    assert ids((KVBlock(3), KVBlock(1))) == (3, 1)


def test_block_ids_over_prefill_and_decode():
    kv = make_kv(8)
    req = make_req("a", list(range(10)))
    assert kv.get_computed_blocks(req) == NO_HIT
    # Prefill in two chunks: 6 then 4 tokens.
    assert step(kv, req, 6) == [0, 1]
    assert kv.num_cached_blocks["a"] == 1  # block 0 is full; block 1 holds 2 of 4
    assert step(kv, req, 4, sample=100) == [2]
    assert kv.block_ids("a") == [0, 1, 2] and kv.num_cached_blocks["a"] == 2
    # Decodes: tokens 10 and 11 fill block 2, token 12 opens block 3.
    assert step(kv, req, 1, sample=101) == []
    assert step(kv, req, 1, sample=102) == []
    assert kv.num_cached_blocks["a"] == 3  # block 2 (tokens 8..11) is full and known now
    assert step(kv, req, 1, sample=103) == [3]
    assert kv.block_ids("a") == [0, 1, 2, 3]
    assert req.num_tokens == 14 and req.num_computed_tokens == 13
    # The hashes are the gateway's hashes of the same tokens.
    expected = prompt_block_hashes(req.all_token_ids, "m", BS)
    assert [kv.pool.blocks[i].block_hash for i in range(3)] == expected[:3]
    assert kv.pool.blocks[3].block_hash is None
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7]
    kv.free(req)
    assert not kv.holds("a") and "a" not in kv.num_cached_blocks
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    check_pool(kv.pool)


def test_prefix_hit_returns_the_right_blocks():
    kv = make_kv(10, record=True)
    a = make_req("a", list(range(10)))
    step(kv, a, 10, sample=1)
    assert kv.block_ids("a") == [0, 1, 2]
    b = make_req("b", list(range(8)) + [50, 51, 52])  # shares 2 full blocks
    hit = kv.get_computed_blocks(b)
    assert ids_of(hit.blocks) == [0, 1] and hit.num_tokens == 8
    assert step(kv, b, 3, hit) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert b.num_computed_tokens == 11
    assert kv.num_cached_blocks["b"] == 2
    # Diverging in the second block: only the first is a hit.
    c = make_req("c", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9])
    hit = kv.get_computed_blocks(c)
    assert ids_of(hit.blocks) == [0] and hit.num_tokens == 4
    # Another salt: no hit at all.
    d = make_req("d", list(range(10)), salt="other")
    assert kv.get_computed_blocks(d) == NO_HIT
    # Freeing a sharer leaves the shared blocks in use.
    kv.free(a)
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [1, 1, 0, 1]
    assert kv.pool.free_queue.block_ids()[-1] == 2
    check_pool(kv.pool)


def test_hits_on_freed_blocks_and_after_eviction():
    kv = make_kv(4)
    a = make_req("a", list(range(9)))
    step(kv, a, 9, sample=1)  # blocks [0, 1, 2], 0 and 1 cached
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 2, 1, 0]
    b = make_req("b", list(range(9)))
    hit = kv.get_computed_blocks(b)
    assert ids_of(hit.blocks) == [0, 1]
    assert step(kv, b, 1, hit) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert kv.pool.free_queue.block_ids() == [2]
    kv.free(b)
    # Reusing blocks 3, 2 and then 1 evicts block 1's hash: only block 0 still hits.
    kv.pool.get_new_blocks(3)
    c = make_req("c", list(range(9)))
    assert ids_of(kv.get_computed_blocks(c).blocks) == [0]


def test_full_prompt_hit_leaves_the_last_block_to_compute():
    kv = make_kv(8)
    a = make_req("a", list(range(12)))  # exactly 3 blocks
    step(kv, a, 12, sample=7)
    assert kv.num_cached_blocks["a"] == 3
    b = make_req("b", list(range(12)))
    hit = kv.get_computed_blocks(b)
    assert ids_of(hit.blocks) == [0, 1] and hit.num_tokens == 8
    assert step(kv, b, 4, hit) == [3]  # block 2 is recomputed into a fresh block
    assert b.num_computed_tokens == 12
    # Its hash is a duplicate of block 2's: block 2 stays the cached one.
    assert kv.pool.get_cached_block(kv.pool.blocks[2].block_hash) is kv.pool.blocks[2]
    # With one more token the whole 12-token prefix is a hit.
    c = make_req("c", list(range(13)))
    hit = kv.get_computed_blocks(c)
    assert ids_of(hit.blocks) == [0, 1, 2] and hit.num_tokens == 12
    # A prompt of one token never hits.
    assert kv.get_computed_blocks(make_req("d", [0])) == NO_HIT


def test_prefix_caching_disabled():
    kv = make_kv(8, caching=False)
    a = make_req("a", list(range(12)))
    step(kv, a, 12, sample=7)
    b = make_req("b", list(range(13)))
    assert kv.get_computed_blocks(b) == NO_HIT
    assert kv.pool.cached == {} and all(blk.block_hash is None for blk in kv.pool.blocks)


def test_hits_in_the_free_queue_count_against_free_capacity():
    kv = make_kv(4)
    a = make_req("a", list(range(8)))
    step(kv, a, 8, sample=1)  # [0, 1]
    other = make_req("o", [90, 91, 92])
    step(kv, other, 3)  # [2]
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [3, 1, 0]
    # 16 tokens: 2 hit blocks (both free) + 2 new = 4 > 3 free, though 2 new alone would fit.
    b = make_req("b", list(range(8)) + list(range(200, 208)))
    hit = kv.get_computed_blocks(b)
    assert ids_of(hit.blocks) == [0, 1]
    before = ([blk.ref_cnt for blk in kv.pool.blocks], kv.pool.free_queue.block_ids(), dict(kv.pool.cached))
    assert kv.allocate_slots(b, 8, hit) is None
    assert ([blk.ref_cnt for blk in kv.pool.blocks], kv.pool.free_queue.block_ids(), dict(kv.pool.cached)) == before
    assert not kv.holds("b") and "b" not in kv.num_cached_blocks
    # 12 tokens: 2 hit + 1 new = 3 fits exactly.
    c = make_req("c", list(range(8)) + [300, 301, 302, 303])
    hit = kv.get_computed_blocks(c)
    assert step(kv, c, 4, hit) == [3]
    assert kv.block_ids("c") == [0, 1, 3] and kv.num_free_blocks == 0
    check_pool(kv.pool)


def test_allocate_returns_none_and_changes_nothing_when_short():
    kv = make_kv(3)
    a = make_req("a", list(range(12)))
    step(kv, a, 12, sample=5)
    assert kv.block_ids("a") == [0, 1, 2] and kv.num_free_blocks == 0
    cached_before = dict(kv.pool.cached)
    assert kv.allocate_slots(a, 1) is None
    assert kv.block_ids("a") == [0, 1, 2] and kv.num_cached_blocks["a"] == 3
    assert kv.pool.cached == cached_before and [b.ref_cnt for b in kv.pool.blocks] == [1, 1, 1]
    b = make_req("b", [1])
    assert kv.allocate_slots(b, 1) is None
    assert not kv.holds("b")
    kv.free(a)
    assert kv.num_free_blocks == 3
    check_pool(kv.pool)


def test_update_block_hashes_extends_incrementally():
    kv = make_kv(4)
    req = make_req("a", list(range(6)))
    kv.update_block_hashes(req)
    assert req.block_hashes == prompt_block_hashes(list(range(6)), "m", BS)
    assert len(req.block_hashes) == 1
    req.append_output_token(6)
    kv.update_block_hashes(req)
    assert len(req.block_hashes) == 1
    req.append_output_token(7)
    kv.update_block_hashes(req)
    assert req.block_hashes == prompt_block_hashes(list(range(8)), "m", BS)


def test_cache_tokens_hashes_blocks_filled_after_allocation():
    kv = make_kv(4)
    req = make_req("a", list(range(3)))
    step(kv, req, 3, sample=3)  # block 0 has 4 known tokens, only 3 computed
    assert kv.num_cached_blocks.get("a", 0) == 0
    req.num_computed_tokens = 4
    kv.cache_tokens(req)
    assert kv.num_cached_blocks["a"] == 1
    assert kv.pool.blocks[0].block_hash == prompt_block_hashes(list(range(4)), "m", BS)[0]
