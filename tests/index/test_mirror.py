"""The gateway's in-process index mirror (shared/index/mirror.py) against the real Redis index.

The mirror must equal Redis after a load of block events from many nodes (stores, evictions, a node's
clear, the janitor's purge of a dead node), whether it followed the stream from the start or joined
midway from a snapshot; reload after a gap in the sequence numbers; keep answering while Redis is away and
catch up after Redis restarts empty; and two gateways following one Redis must route alike.
"""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from kvrelay.common.records import BlockEvent, BlockEventKind, NodeLoad
from kvrelay.index import IndexUnavailable, NodeRegistration, create_index
from kvrelay.index.mirror import MirrorIndex
from kvrelay.index.redis_index import RedisIndex
from kvrelay.index.redis_server import start_redis
from kvrelay.index.registry import Registry

STORED, EVICTED = BlockEventKind.STORED, BlockEventKind.EVICTED

pytestmark = pytest.mark.timeout(120)


def chains(rng: random.Random, count: int, length: int) -> list[list[bytes]]:
    return [[rng.randbytes(16) for _ in range(length)] for _ in range(count)]


def assert_same(mirror: MirrorIndex, direct: RedisIndex, nodes: list[str], queries: list[list[bytes]]) -> None:
    assert mirror.sync(10), mirror.stats()
    for node in nodes:
        assert mirror.node_hashes(node) == direct.node_hashes(node), node
    for q in queries:
        assert mirror.lookup(q) == direct.lookup(q)
        assert mirror.lookup(q, nodes[:3]) == direct.lookup(q, nodes[:3])


def test_mirror_equals_redis_after_10000_events(redis_url):
    rng = random.Random(7)
    model = f"m-{uuid.uuid4().hex[:6]}"
    direct = RedisIndex(redis_url, model)
    early = create_index(redis_url, model, backend="mirror")  # follows from the first event
    assert isinstance(early, MirrorIndex) and early.wait_ready(5)
    prompts = chains(rng, 40, 64)
    nodes = [f"node-{i:02d}" for i in range(20)]
    held: dict[str, list[bytes]] = {n: [] for n in nodes}
    late, sent = None, 0
    while sent < 10_000:
        node = rng.choice(nodes)
        if held[node] and rng.random() < 0.3:  # evict a few of what it holds
            gone = rng.sample(held[node], min(len(held[node]), rng.randint(1, 20)))
            events = [BlockEvent(EVICTED, h) for h in gone]
            held[node] = [h for h in held[node] if h not in set(gone)]
        else:  # store a prefix of a prompt
            prefix = rng.choice(prompts)[: rng.randint(1, 64)]
            events = [BlockEvent(STORED, h) for h in prefix]
            held[node] += [h for h in prefix if h not in set(held[node])]
        direct.apply(node, events)
        sent += len(events)
        if late is None and sent > 5_000:  # a second gateway joins midway: snapshot, then the stream
            late = MirrorIndex(redis_url, model)
            assert late.wait_ready(5)
    direct.clear_node("node-03")  # a node's restart
    registry = Registry(redis_url)  # the janitor purges a node whose lease lapsed (never registered here)
    registry.register(NodeRegistration("node-07", "decode", "a:1", "k", "ucx", model, 16, "float32", 1), 0.05)
    wait = asyncio.run(asyncio.sleep(0.1))
    assert wait is None and "node-07" in registry.purge_dead_nodes(model)
    queries = [p[: rng.randint(1, 64)] + [rng.randbytes(16)] for p in prompts] + prompts
    for mirror in (early, late):
        assert_same(mirror, direct, nodes, queries)
        assert mirror.node_hashes("node-03") == mirror.node_hashes("node-07") == set()
        assert mirror.stats()["gaps"] == 0
    assert early.stats()["snapshots"] == late.stats()["snapshots"] == 1
    for x in (early, late, direct, registry):
        x.close()


def test_gap_in_sequence_numbers_reloads_a_snapshot(redis_url):
    rng = random.Random(1)
    model = f"m-{uuid.uuid4().hex[:6]}"
    direct, mirror = RedisIndex(redis_url, model), MirrorIndex(redis_url, model)
    try:
        assert mirror.wait_ready(5)
        (chain,) = chains(rng, 1, 32)
        direct.apply("a", [BlockEvent(STORED, h) for h in chain[:10]])
        assert mirror.sync(5) and mirror.lookup(chain) == {"a": 10}
        # Events the mirror never sees (what a capped stream drops for a follower too far behind): block 10
        # is stored without an event, and the sequence numbers move on.
        direct.client.incrby(direct.keys.seq, 5)
        direct.client.setbit(direct.keys.block(chain[10]), 0, 1)
        direct.client.sadd(direct.keys.node("a"), chain[10].hex())
        direct.apply("a", [BlockEvent(STORED, chain[11])])
        assert mirror.sync(5)
        assert mirror.stats()["gaps"] == 1 and mirror.stats()["snapshots"] == 2
        assert mirror.lookup(chain) == direct.lookup(chain) == {"a": 12}
    finally:
        mirror.close()
        direct.close()


def test_routing_from_the_mirror_while_redis_is_away(tmp_path):
    rng = random.Random(2)
    (chain,) = chains(rng, 1, 16)
    sock = tmp_path / "redis.sock"
    server = start_redis(sock)
    direct = RedisIndex(server.url, "m")
    mirror = MirrorIndex(server.url, "m", block_ms=100)
    try:
        assert mirror.wait_ready(5)
        direct.apply("a", [BlockEvent(STORED, h) for h in chain[:8]])
        assert mirror.sync(5)
        server.stop()  # Redis goes away: lookups keep answering from the mirror
        with pytest.raises(IndexUnavailable):
            direct.lookup(chain)
        for _ in range(20):
            assert mirror.lookup(chain) == {"a": 8}
        assert wait_for(lambda: mirror.stats()["error"] is not None)
        server = start_redis(sock)  # back, empty: the nodes republish what they hold
        direct.apply("b", [BlockEvent(STORED, h) for h in chain[:4]])
        assert wait_for(lambda: mirror.stats()["error"] is None and mirror.lookup(chain) == {"b": 4})
        assert mirror.stats()["snapshots"] >= 2  # reloaded: the new Redis numbers its events from 1 again
    finally:
        mirror.close()
        direct.close()
        server.stop()


def wait_for(cond, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_two_gateways_route_the_same_prompt_to_the_same_node(redis_url):
    """Two routers, each with its own mirror of one Redis and the same registry, decide alike."""
    from kvrelay.common.hashing import prompt_block_hashes
    from kvrelay.gateway.discovery import Discovery, DiscoveryConfig
    from kvrelay.gateway.node_client import NodeClients
    from kvrelay.gateway.policies import make_policy
    from kvrelay.gateway.router import Router

    rng = random.Random(3)
    model = f"m-{uuid.uuid4().hex[:6]}"
    registry, direct = Registry(redis_url), RedisIndex(redis_url, model)
    tenants = [[rng.randrange(40_000) for _ in range(512)] for _ in range(6)]
    for i in range(12):
        node = f"node-{i:02d}"
        reg = NodeRegistration(node, "prefill" if i % 2 else "decode", f"127.0.0.1:{30000 + i}", "k", "auto", model,
                               16, "float32", 10_000)
        registry.register(reg, 60, NodeLoad(num_running=i % 3, free_kv_blocks=500, total_kv_blocks=600))
        for t in rng.sample(tenants, 3):
            hashes = prompt_block_hashes(t, model, 16)[: rng.randint(4, 32)]
            direct.apply(node, [BlockEvent(STORED, h) for h in hashes])
    prompts = [t[: rng.randint(100, 512)] + [rng.randrange(40_000) for _ in range(20)] for t in tenants * 3]

    async def decisions() -> list[list[tuple[str, str | None, int]]]:
        out = []
        for _ in range(2):  # two gateways
            mirror = MirrorIndex(redis_url, model)
            assert mirror.wait_ready(5) and mirror.sync(5)
            discovery = Discovery(DiscoveryConfig(model_id=model, block_size=16), NodeClients(), registry)
            await discovery.refresh_registry()
            router = Router(discovery, make_policy("cache_aware"), mirror, local_prefill_threshold=64)
            routes = []
            for p in prompts:
                d = await router.route(p)
                routes.append((d.decode.node_id, d.prefill.node_id if d.prefill else None, d.decode_cached_tokens))
            out.append(routes)
            await discovery.stop()
            mirror.close()
        return out

    first, second = asyncio.run(decisions())
    assert first == second
    assert any(cached > 0 for _, _, cached in first)  # the prefix hints were used
    registry.close()
    direct.close()
