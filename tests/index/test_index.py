"""Block index: lookup semantics on both backends, writes, clearing, the publisher, Redis going away."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.common.records import BlockEvent, BlockEventKind
from kvrelay.engine.block_pool import BlockPool
from kvrelay.index import IndexPublisher, IndexUnavailable, backend_of, create_index
from kvrelay.index.memory import MemoryIndex, MemoryStore
from kvrelay.index.redis_index import CLEAR_BATCH, RedisIndex
from kvrelay.index.redis_server import find_redis_server, start_redis
from tests.helpers.index import EngineSide

STORED, EVICTED = BlockEventKind.STORED, BlockEventKind.EVICTED
H = [bytes([i]) * 16 for i in range(64)]  # distinct, readable block hashes


def stored(*hashes: bytes) -> list[BlockEvent]:
    return [BlockEvent(STORED, h) for h in hashes]


def evicted(*hashes: bytes) -> list[BlockEvent]:
    return [BlockEvent(EVICTED, h) for h in hashes]


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture(params=["memory", "redis"])
def index(request):
    model = f"model-{uuid.uuid4().hex[:6]}"
    if request.param == "memory":
        ix = MemoryIndex(MemoryStore(), model)
    else:
        ix = RedisIndex(request.getfixturevalue("redis_url"), model)
    yield ix
    ix.close()


# ---------------------------------------------------------------- lookup semantics


def test_lookup_counts_leading_blocks_up_to_first_missing(index):
    index.apply("a", stored(*H[:5]))
    index.apply("b", stored(*H[:8]))
    index.apply("c", stored(H[0], H[1], H[3], H[4]))  # a hole at block 2
    index.apply("d", stored(*H[1:8]))  # lacks the first block
    assert index.lookup(H[:10]) == {"a": 5, "b": 8, "c": 2}
    assert index.lookup(H[:3]) == {"a": 3, "b": 3, "c": 2}
    assert index.lookup(H[1:10]) == {"a": 4, "b": 7, "c": 1, "d": 7}


def test_lookup_node_filter(index):
    index.apply("a", stored(*H[:5]))
    index.apply("b", stored(*H[:8]))
    assert index.lookup(H[:10], nodes=["a"]) == {"a": 5}
    assert index.lookup(H[:10], nodes={"b", "nope"}) == {"b": 8}
    assert index.lookup(H[:10], nodes=["nope"]) == {}
    assert index.lookup(H[:10], nodes=[]) == {}
    assert index.lookup(H[:10], nodes=None) == {"a": 5, "b": 8}


def test_lookup_empty_prompt_and_unknown_hashes(index):
    index.apply("a", stored(*H[:5]))
    assert index.lookup([]) == {}
    assert index.lookup(H[40:50]) == {}
    assert index.lookup([H[0], H[40], H[1]]) == {"a": 1}


def test_lookup_rejects_malformed_hashes(index):
    with pytest.raises(ValueError):
        index.lookup([b"short"])


def test_lookup_many_nodes_spanning_bitmap_bytes(index):
    # 40 nodes: slots past 32 exercise several bitmap bytes; node i holds i+1 leading blocks.
    for i in range(40):
        index.apply(f"n{i}", stored(*H[: i + 1]))
    expected = {f"n{i}": i + 1 for i in range(40)}
    assert index.lookup(H[:64]) == expected
    subset = [f"n{i}" for i in (0, 7, 8, 31, 32, 39)]
    assert index.lookup(H[:64], nodes=subset) == {n: expected[n] for n in subset}


# ---------------------------------------------------------------- writes and clearing


def test_apply_in_order(index):
    index.apply("a", stored(H[0], H[1]) + evicted(H[1]) + stored(H[1]))  # evict then re-store: stored
    assert index.lookup(H[:2]) == {"a": 2}
    index.apply("a", stored(H[2]) + evicted(H[2]))  # store then evict: gone
    assert index.lookup(H[:3]) == {"a": 2}
    index.apply("a", stored(H[0], H[0]) + evicted(H[5]))  # duplicates and unknown evictions are harmless
    assert index.lookup(H[:3]) == {"a": 2}
    assert index.node_hashes("a") == {H[0], H[1]}


def test_apply_reports_unknown_node(index):
    assert index.apply("a", stored(H[0])) is True
    assert index.apply("a", stored(H[1])) is False
    assert index.apply("a", []) is False
    index.clear_node("a")
    assert index.apply("a", stored(H[0])) is True


def test_clear_node_keeps_other_nodes(index):
    index.apply("a", stored(*H[:4]))
    index.apply("b", stored(*H[:2]))
    index.clear_node("a")
    assert index.lookup(H[:4]) == {"b": 2}
    assert index.known_nodes() == {"b"}
    assert index.node_hashes("a") == set()
    index.clear_node("never-seen")


def test_clear_large_node_in_batches(redis_url):
    ix = RedisIndex(redis_url, "m")
    many = [i.to_bytes(16, "big") for i in range(CLEAR_BATCH * 2 + 500)]
    ix.apply("a", stored(*many))
    ix.apply("b", stored(*many[:3]))
    ix.clear_node("a")
    assert ix.lookup(many[:5]) == {"b": 3}
    # Block keys of blocks nobody holds are deleted, not left as empty bitmaps.
    assert len(ix.client.keys("kvr:{m}:b:*")) == 3
    ix.clear_node("b")
    assert ix.client.keys("kvr:{m}:b:*") == []
    assert ix.client.keys("kvr:{m}:n:*") == []


def test_freed_slot_reused_without_misattribution(redis_url):
    gateway, writer = RedisIndex(redis_url, "m"), RedisIndex(redis_url, "m")
    writer.apply("a", stored(*H[:3]))
    writer.apply("b", stored(*H[:2]))
    assert gateway.lookup(H[:4]) == {"a": 3, "b": 2}  # the gateway now caches the slot map
    writer.clear_node("a")
    writer.apply("d", stored(*H[:4]))  # takes a's freed slot
    assert gateway.lookup(H[:4]) == {"d": 4, "b": 2}
    assert gateway.lookup(H[:4], nodes=["d"]) == {"d": 4}
    writer.clear_node("d")
    writer.apply("a", stored(H[0]))
    assert gateway.lookup(H[:4], nodes=["d", "a"]) == {"a": 1}


# ---------------------------------------------------------------- memory vs redis


NODES = [f"n{i}" for i in range(10)]  # more than 8: slots span two bitmap bytes
events_strategy = st.lists(st.tuples(st.sampled_from(NODES), st.booleans(), st.integers(0, 11)), max_size=80)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    events=events_strategy,
    clears=st.lists(st.sampled_from(NODES), max_size=2),
    prompts=st.lists(st.lists(st.integers(0, 11), max_size=12), min_size=1, max_size=4),
    filt=st.none() | st.sets(st.sampled_from([*NODES, "x"])),
)
def test_memory_and_redis_agree(redis_server, events, clears, prompts, filt):
    model = uuid.uuid4().hex
    backends = [MemoryIndex(MemoryStore(), model), RedisIndex(redis_server.url, model)]
    try:
        for ix in backends:
            for node, is_store, h in events:
                ix.apply(node, [BlockEvent(STORED if is_store else EVICTED, H[h])])
            for node in clears:
                ix.clear_node(node)
        for prompt in prompts:
            hashes = [H[i] for i in prompt]
            mem, red = (ix.lookup(hashes, nodes=filt) for ix in backends)
            assert mem == red, (prompt, filt)
        assert backends[0].known_nodes() == backends[1].known_nodes()
    finally:
        backends[1].close()


# ---------------------------------------------------------------- publisher


def test_publisher_applies_in_order_and_batches(redis_url):
    ix = RedisIndex(redis_url, "m")
    pub = IndexPublisher(ix, "n1", max_batch=256, flush_interval_s=0.5, clear_on_start=False, start=False)
    all_events = [BlockEvent(STORED, i.to_bytes(16, "big")) for i in range(1000)]
    for i in range(0, 1000, 100):
        pub.submit(all_events[i : i + 100])
    pub.submit(evicted(all_events[5].block_hash) + stored(all_events[5].block_hash) + evicted(H[1]))
    pub.start()
    assert pub.flush(5.0)
    assert ix.num_write_round_trips == 4  # ceil(1003 / 256)
    assert pub.num_batches == 4 and pub.num_events == 1003
    assert ix.node_hashes("n1") == {e.block_hash for e in all_events}
    pub.close()


def test_publisher_flushes_on_interval_and_on_close(redis_url):
    ix = RedisIndex(redis_url, "m")
    pub = IndexPublisher(ix, "n1", max_batch=1000, flush_interval_s=0.02, clear_on_start=False)
    pub.submit(stored(H[0]))
    assert wait_until(lambda: ix.lookup([H[0]]) == {"n1": 1}, 2.0)
    pub.submit(stored(H[1]))
    pub.close()
    assert ix.lookup(H[:2]) == {"n1": 2}
    pub.submit(stored(H[2]))  # after close: dropped, not raised
    assert not pub._thread.is_alive()


def test_publisher_start_clears_then_publishes_snapshot(redis_url):
    ix = RedisIndex(redis_url, "m")
    ix.apply("n1", stored(*H[:6]))  # a previous life's entries
    held = {H[0], H[1]}  # the second life's cache
    with IndexPublisher(ix, "n1") as pub, EngineSide(pub, lambda: sorted(held)) as engine:
        with engine.step():
            held.add(H[2])
            pub.submit(stored(H[2]))
        assert pub.flush(5.0)
    assert ix.lookup(H[:6]) == {"n1": 3}
    assert ix.node_hashes("n1") == set(H[:3])


def test_publisher_resyncs_after_external_purge(redis_url):
    ix = RedisIndex(redis_url, "m")
    held = set(H[:4])
    with (IndexPublisher(ix, "n1", flush_interval_s=0.001) as pub,
          EngineSide(pub, lambda: sorted(held)) as engine):
        assert pub.flush(5.0)
        ix.clear_node("n1")  # what the janitor does to a node whose lease lapsed
        with engine.step():
            held.add(H[4])
            pub.submit(stored(H[4]))  # the write finds the node unknown: resync from the snapshot
        assert wait_until(lambda: pub.num_resyncs >= 2 and pub.flush(0.1))
        assert ix.lookup(H[:6]) == {"n1": 5}


def test_publisher_with_block_pool_events(redis_url):
    ix = RedisIndex(redis_url, "m")
    pool = BlockPool(4, record_events=True)
    with IndexPublisher(ix, "n1") as pub, EngineSide(pub, lambda: list(pool.cached)) as engine:
        with engine.step():
            blocks = pool.get_new_blocks(3)
            for block, h in zip(blocks, H):
                pool.cache_blocks([block], [h])
            pool.free_blocks(reversed(blocks))
            pub.submit(pool.drain_events())
        with engine.step():
            for block in pool.get_new_blocks(4):  # reuses freed blocks: evicts their hashes
                pool.cache_blocks([block], [H[10 + block.block_id]])
            pub.submit(pool.drain_events())
        assert pub.flush(5.0)
    assert ix.node_hashes("n1") == set(pool.cached)


def test_publisher_survives_redis_restart(tmp_path):
    sock = tmp_path / "r.sock"
    server = start_redis(sock)
    try:
        ix = RedisIndex(server.url, "m", socket_timeout_s=0.5, lookup_retry_after_s=0.0)
        held: set[bytes] = set()
        pub = IndexPublisher(ix, "n1", max_backlog=1000, backoff_s=(0.02, 0.1), flush_interval_s=0.001)
        engine = EngineSide(pub, lambda: sorted(held))
        with engine.step():
            held.update(H[:3])
            pub.submit(stored(*H[:3]))
        assert pub.flush(5.0)
        server.stop()

        t0 = time.perf_counter()
        for i in range(3, 40):  # the engine keeps running: submit never blocks, the backlog stays bounded
            with engine.step():
                held.add(H[i])
                pub.submit(stored(H[i]) * 100)
        assert time.perf_counter() - t0 < 0.5
        assert pub.backlog <= 1000
        with pytest.raises(IndexUnavailable):
            ix.lookup(H[:3])
        assert wait_until(lambda: pub.num_errors > 0)

        server = start_redis(sock)  # same socket, empty DB, empty script cache
        assert wait_until(lambda: pub.flush(0.2), 10.0)
        assert ix.lookup(H[:40]) == {"n1": 40}
        assert ix.node_hashes("n1") == held
        engine.close()
        pub.close()
    finally:
        server.stop()


def test_lookup_fails_fast_while_index_down(tmp_path):
    ix = RedisIndex(f"unix://{tmp_path}/absent.sock", "m", lookup_retry_after_s=30.0)
    with pytest.raises(IndexUnavailable):
        ix.lookup(H[:4])
    t0 = time.perf_counter()
    with pytest.raises(IndexUnavailable, match="failed recently"):
        ix.lookup(H[:4])
    assert time.perf_counter() - t0 < 0.05
    with pytest.raises(IndexUnavailable):
        ix.apply("n", stored(H[0]))


# ---------------------------------------------------------------- factory, server, bench


def test_factory_backends(redis_url):
    assert backend_of("memory") == "memory" and backend_of("unix:///x.sock") == "redis"
    with pytest.raises(ValueError):
        create_index("http://nope", "m")
    a, b = create_index("memory://t-factory", "m"), create_index("memory://t-factory", "m")
    a.apply("n", stored(H[0]))
    assert b.lookup([H[0]]) == {"n": 1}  # same name, same store
    assert isinstance(create_index(redis_url, "m"), RedisIndex)


def test_redis_server_tcp_and_stop():
    assert find_redis_server()
    with start_redis() as server:
        assert server.url.startswith("redis://127.0.0.1:")
        assert redis.Redis.from_url(server.url).ping()
    assert not server.is_running()


def test_bench_lookup_smoke(redis_url):
    from kvrelay.bench.index_lookup import bench_lookup

    result = bench_lookup(redis_url, num_nodes=10, num_blocks=32, iters=50, noise_blocks=10)
    assert 0 < result["p50_us"] <= result["p99_us"]
    assert result["mean_nodes_matched"] > 0
    assert redis.Redis.from_url(redis_url).dbsize() == 0  # cleaned up
