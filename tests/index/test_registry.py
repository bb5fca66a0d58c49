"""Node registry: leases, load, heartbeat, the janitor, restarts, Redis going away (both backends)."""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid

import pytest

from kvrelay.common.records import BlockEvent, BlockEventKind, NodeLoad
from kvrelay.index import IndexPublisher, NodeRegistration, create_index, create_registry
from kvrelay.index.heartbeat import Heartbeat
from kvrelay.index.memory import drop_store
from kvrelay.index.redis_server import start_redis
from kvrelay.index.registry import Registry
from tests.helpers.index import EngineSide

MODEL = "test-model"
H = [bytes([i]) * 16 for i in range(16)]


def reg(node_id: str, role: str = "prefill", model: str = MODEL) -> NodeRegistration:
    return NodeRegistration(
        node_id=node_id,
        role=role,  # type: ignore[arg-type]
        grpc_address=f"127.0.0.1:{5000 + len(node_id)}",
        kv_address="127.0.0.1:7000",
        connector="local",
        model_id=model,
        block_size=16,
        dtype="float32",
        capacity_tokens=4096,
        metrics_address="127.0.0.1:9000",
        started_at=123.5,
    )


def stored(*hashes: bytes) -> list[BlockEvent]:
    return [BlockEvent(BlockEventKind.STORED, h) for h in hashes]


def live_ids(registry, model: str = MODEL, role=None) -> list[str]:
    return [r.node_id for r, _ in registry.live_nodes(model, role)]


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture(params=["memory", "redis"])
def url(request):
    if request.param == "redis":
        yield request.getfixturevalue("redis_url")
        return
    name = f"memory://registry-{uuid.uuid4().hex[:8]}"
    yield name
    drop_store(name)


@pytest.fixture
def registry(url):
    r = create_registry(url)
    yield r
    r.close()


@pytest.fixture
def index(url):
    ix = create_index(url, MODEL)
    yield ix
    ix.close()


def test_registration_json_roundtrip_and_validation():
    r = reg("p0")
    assert NodeRegistration.from_json(r.to_json()) == r
    load = NodeLoad(num_waiting=1, num_running=2, num_reserved=3, num_held=4, queued_prefill_tokens=300,
                    free_kv_blocks=40, total_kv_blocks=50, kv_cache_usage=0.2, ts=9.5)
    assert NodeLoad.from_json(load.to_json()) == load
    with pytest.raises(ValueError):
        reg("x", role="encoder")


def test_register_and_live_nodes_with_load(registry):
    assert registry.register(reg("p0"), ttl_s=30) is False
    load = NodeLoad(num_waiting=2, num_running=3, queued_prefill_tokens=900, free_kv_blocks=10, total_kv_blocks=64)
    registry.register(reg("d0", "decode"), ttl_s=30, load=load)
    registry.register(reg("c0", "colocated"), ttl_s=30)
    registry.register(reg("other", model="another-model"), ttl_s=30)
    nodes = registry.live_nodes(MODEL)
    assert [r.node_id for r, _ in nodes] == ["c0", "d0", "p0"]
    assert dict((r.node_id, ld) for r, ld in nodes) == {"c0": None, "d0": load, "p0": None}
    assert nodes[2][0] == reg("p0")
    assert live_ids(registry, role="decode") == ["d0"]
    assert live_ids(registry, role=("prefill", "colocated")) == ["c0", "p0"]
    assert live_ids(registry, model="another-model") == ["other"]
    assert registry.register(reg("p0"), ttl_s=30) is True  # renewal of a live lease


def test_live_nodes_is_one_round_trip(redis_url):
    registry = Registry(redis_url)
    for i in range(5):
        registry.register(reg(f"p{i}"), ttl_s=30, load=NodeLoad(num_running=i))
    registry.live_nodes(MODEL)  # loads the script
    registry.client.config_resetstat()
    assert len(registry.live_nodes(MODEL)) == 5
    stats = registry.client.info("commandstats")
    calls = {k: v["calls"] for k, v in stats.items() if not k.startswith(("cmdstat_config", "cmdstat_info"))}
    # One EVALSHA from the client; HKEYS and HMGET ran inside it.
    assert calls.pop("cmdstat_evalsha") == 1 and set(calls) <= {"cmdstat_hkeys", "cmdstat_hmget"}


def test_lease_lapse_then_purge(registry, index):
    registry.register(reg("dead"), ttl_s=0.3)
    registry.register(reg("alive"), ttl_s=30)
    index.apply("dead", stored(*H[:4]))
    index.apply("alive", stored(*H[:2]))
    assert wait_until(lambda: live_ids(registry) == ["alive"], 3.0)
    assert index.lookup(H[:4]) == {"dead": 4, "alive": 2}  # lapsed, not purged yet
    assert registry.purge_dead_nodes(MODEL) == ["dead"]
    assert index.lookup(H[:4]) == {"alive": 2}
    assert index.known_nodes() == {"alive"}
    assert registry.purge_dead_nodes(MODEL) == []


def test_purge_skips_a_node_that_came_back(registry, index):
    registry.register(reg("n"), ttl_s=0.2)
    index.apply("n", stored(*H[:3]))
    assert wait_until(lambda: live_ids(registry) == [], 3.0)
    assert registry.register(reg("n"), ttl_s=30) is False  # lapsed: the node must resync
    assert registry.purge_dead_nodes(MODEL) == []
    assert index.lookup(H[:3]) == {"n": 3}


def test_heartbeat_renews_and_publishes_load(registry):
    counter = itertools.count(1)
    registry.register(reg("p0"), ttl_s=0.8)
    hb = Heartbeat(registry, reg("p0"), 0.8, lambda: NodeLoad(num_running=next(counter), total_kv_blocks=8)).start()
    try:
        time.sleep(1.8)  # over twice the TTL
        assert live_ids(registry) == ["p0"]
        assert hb.num_beats >= 3 and hb.num_lapses == 0
        ((_, load),) = registry.live_nodes(MODEL)
        assert load is not None and load.num_running >= 3 and load.total_kv_blocks == 8 and load.ts > 0
    finally:
        hb.stop()
    assert wait_until(lambda: live_ids(registry) == [], 3.0)


def test_heartbeat_runs_janitor(registry, index):
    registry.register(reg("crashed"), ttl_s=0.3)
    index.apply("crashed", stored(*H[:4]))
    registry.register(reg("p0"), ttl_s=0.6)
    index.apply("p0", stored(H[0]))
    with Heartbeat(registry, reg("p0"), 0.6, janitor_every=1).start():
        assert wait_until(lambda: index.lookup(H[:4]) == {"p0": 1}, 5.0)
    assert index.known_nodes() == {"p0"}


def test_heartbeat_detects_its_own_lapse(registry):
    lapses = []
    registry.register(reg("p0"), ttl_s=0.2)
    hb = Heartbeat(registry, reg("p0"), 0.2, on_lapse=lambda: lapses.append(1), interval_s=0.4).start()
    try:
        assert wait_until(lambda: hb.num_beats >= 1, 3.0)
        assert lapses and hb.num_lapses >= 1
        assert hb.num_failures == 0
    finally:
        hb.stop()


def test_deregister_removes_registration_and_entries(url, registry, index):
    registry.register(reg("p0"), ttl_s=30)
    registry.register(reg("p1"), ttl_s=30)
    index.apply("p0", stored(*H[:3]))
    index.apply("p1", stored(*H[:2]))
    registry.deregister("p0")
    assert live_ids(registry) == ["p1"]
    assert index.lookup(H[:3]) == {"p1": 2}
    assert index.known_nodes() == {"p1"}
    with pytest.raises(KeyError):
        create_registry(url).deregister("p1")  # another client must name the model
    create_registry(url).deregister("p1", MODEL)
    assert live_ids(registry) == []


def test_restarted_node_clears_its_old_entries(url):
    registry, index = create_registry(url), create_index(url, MODEL)
    registry.register(reg("p0"), ttl_s=30)
    index.apply("p0", stored(*H[:6]))  # first life; then the process dies without deregistering
    # Second life, same node id, a cold cache holding only H[0]: the publisher clears before publishing.
    registry2, index2 = create_registry(url), create_index(url, MODEL)
    assert registry2.register(reg("p0"), ttl_s=30) is True  # the old lease had not lapsed yet
    with IndexPublisher(index2, "p0") as pub, EngineSide(pub, lambda: [H[0]]):
        assert pub.flush(5.0)
    assert index.lookup(H[:6]) == {"p0": 1}
    assert index.node_hashes("p0") == {H[0]}
    assert live_ids(registry) == ["p0"]


def test_heartbeat_and_publisher_survive_redis_restart(tmp_path):
    sock = tmp_path / "r.sock"
    server = start_redis(sock)
    try:
        registry, index = Registry(server.url, socket_timeout_s=0.5), create_index(server.url, MODEL)
        pub = IndexPublisher(index, "p0", backoff_s=(0.02, 0.1))
        engine = EngineSide(pub, lambda: H[:3])
        registry.register(reg("p0"), ttl_s=0.6)
        hb = Heartbeat(registry, reg("p0"), 0.6, on_lapse=pub.request_resync, interval_s=0.1).start()
        assert pub.flush(5.0) and index.lookup(H[:3]) == {"p0": 3}
        server.stop()
        assert wait_until(lambda: hb.num_failures >= 2, 3.0)  # logged, not raised
        server = start_redis(sock)  # an empty DB: registration and index are gone
        assert wait_until(lambda: live_ids(registry) == ["p0"], 5.0)
        assert hb.num_lapses >= 1
        assert wait_until(lambda: index.lookup(H[:3]) == {"p0": 3}, 5.0)
        hb.stop()
        engine.close()
        pub.close()
    finally:
        server.stop()


def test_a_tier_entry_stays_while_a_live_node_names_it_and_goes_with_the_last(registry, index):
    """An offload tier's entry has no lease of its own: the janitor keeps it while a live registration names it
    (the store outlives the node that wrote it), and purges it once none does."""
    tier = "tier:memory:0123456789abcdef"
    registry.register(dataclasses.replace(reg("reader"), kv_tiers=(tier,)), ttl_s=0.3)
    index.apply(tier, stored(*H[:3]))
    assert [r.kv_tiers for r, _ in registry.live_nodes(MODEL)] == [(tier,)]  # through JSON: a tuple again
    assert registry.purge_dead_nodes(MODEL) == []
    assert index.lookup(H[:3]) == {tier: 3}
    assert wait_until(lambda: live_ids(registry) == [], 3.0)
    assert registry.purge_dead_nodes(MODEL) == ["reader", tier]
    assert index.lookup(H[:3]) == {}
