"""The routing policies kvrelay sim compares (approximate, random) in the real router, and the gateway's
routing-quality metrics: what could have hit, load imbalance, block-size mismatches."""

from __future__ import annotations

import logging
import uuid

import pytest

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.prometheus import Metrics
from kvrelay.common.records import BlockEvent, BlockEventKind, NodeLoad
from kvrelay.gateway.config import ROUTING_POLICIES
from kvrelay.gateway.discovery import Discovery, DiscoveryConfig
from kvrelay.gateway.metrics import GatewayMetrics, imbalance
from kvrelay.gateway.node_client import NodeClients
from kvrelay.gateway.policies import POLICIES, ApproximatePrefix, make_policy
from kvrelay.gateway.router import Router
from kvrelay.index.base import NodeRegistration
from kvrelay.index.memory import MemoryIndex, get_store
from tests.gateway.test_unit import BS, MODEL, FakeDiscovery, FakeIndex, fleet, node, prompt, route


def decide(router: Router, tokens: list[int], hits: dict[str, int] | None = None):
    hashes = prompt_block_hashes(tokens, MODEL, BS)
    disc = router.discovery
    return router.decide(tokens, hashes, hits or {}, disc.routable("prefill"), disc.routable("decode"))


def test_every_policy_is_a_gateway_choice():
    assert set(ROUTING_POLICIES) == set(POLICIES)


def test_approximate_sends_a_prefix_back_where_it_sent_it_without_an_index():
    router = Router(FakeDiscovery(fleet(prefill=0, decode=4)), make_policy("approximate"), None, 16)
    tenants = [prompt(s, 320) for s in range(6)]
    first = {s: decide(router, t + prompt(100 + s, 30)).decode.node_id for s, t in enumerate(tenants)}
    again = {s: decide(router, t + prompt(200 + s, 30)) for s, t in enumerate(tenants)}
    assert {s: d.decode.node_id for s, d in again.items()} == first
    assert all(d.decode_cached_tokens == 320 for d in again.values())  # the 20 shared blocks, as it remembers
    assert len(set(first.values())) > 1  # different prefixes spread


def test_approximate_forgets_past_a_node_capacity_and_on_restart():
    policy = ApproximatePrefix(default_blocks=4)
    router = Router(FakeDiscovery(fleet(prefill=0, decode=1)), policy, None, 16)
    tokens = prompt(1, 160)  # 10 blocks: more than the node holds
    decide(router, tokens)
    assert decide(router, tokens).decode_cached_tokens == 0  # its first blocks were the first to go
    small = prompt(2, 48)
    decide(router, small)
    assert decide(router, small).decode_cached_tokens == 47
    policy.forget()
    assert decide(router, small).decode_cached_tokens == 0
    load = NodeLoad(free_kv_blocks=100, total_kv_blocks=100)
    big = ApproximatePrefix(default_blocks=4)
    router = Router(FakeDiscovery([node("d0", "decode", load)]), big, None, 16)
    decide(router, tokens)
    assert decide(router, tokens).decode_cached_tokens == 159  # the node's published capacity, not the default


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_cached_prefix_outweighs_a_queue_up_to_twice_the_tokens_it_saves(role):
    """400 tokens, 320 of them cached on node 0: it saves 320 tokens of compute, which count twice (the request's
    wait and that of whoever queues behind it at node 1), so node 0 keeps the request until its queue is 640
    tokens longer than node 1's. On prefill nodes, and on decode nodes when no prefill node is up (colocated)."""
    tokens = prompt(1, 400)
    p0, p1 = f"{role[0]}0", f"{role[0]}1"

    def first_choice(queued: int) -> str:
        loads = {p0: NodeLoad(queued_prefill_tokens=queued), p1: NodeLoad()}
        prefill, decode = (2, 1) if role == "prefill" else (0, 2)
        nodes = fleet(prefill=prefill, decode=decode, loads=loads)
        router = Router(FakeDiscovery(nodes), make_policy("cache_aware"), None, 16)
        d = decide(router, tokens, {p0: 20})
        return (d.prefill if role == "prefill" else d.decode).node_id

    assert [first_choice(q) for q in (0, 400, 639, 641, 1000)] == [p0, p0, p0, p1, p1]


def test_random_is_seeded_and_spreads():
    def picks(seed):
        router = Router(FakeDiscovery(fleet(prefill=0, decode=5)), make_policy("random", seed=seed), None, 16)
        return [decide(router, prompt(1, 64)).decode.node_id for _ in range(50)]
    assert picks(3) == picks(3) != picks(4)
    assert len(set(picks(3))) == 5


def test_decisions_say_what_could_have_hit_and_the_metrics_count_it():
    tokens = prompt(1, 400)
    hashes = prompt_block_hashes(tokens, MODEL, BS)
    metrics = GatewayMetrics("m", "round_robin")
    router = Router(FakeDiscovery(fleet(prefill=0, decode=2)), make_policy("round_robin"),
                    FakeIndex({"d0": hashes[:20], "d1": hashes[:5]}), 16, metrics)
    hits = router.index.lookup(hashes)
    decisions = [router.decide(tokens, hashes, hits, [], router.discovery.routable("decode")) for _ in range(2)]
    assert [d.fleet_cached_tokens for d in decisions] == [320, 320]
    for d in decisions:
        metrics.observe_route(d)
    m = Metrics.parse(metrics.render().decode())
    assert m.value("kvrelay:routed_prompt_tokens_total", model_name="m") == 800
    assert m.value("kvrelay:fleet_cached_tokens_total", model_name="m") == 640
    assert m.value("kvrelay:routed_cached_tokens_total", model_name="m") == 320 + 80  # d0, then d1


def test_load_imbalance():
    busy = NodeLoad(num_running=6, num_waiting=2)
    idle = NodeLoad()
    assert imbalance([node("a", "decode", busy), node("b", "decode", idle)]) == 2.0
    assert imbalance([node("a", "decode", idle)]) == 1.0 and imbalance([]) == 1.0
    metrics = GatewayMetrics("m", "cache_aware")
    disc = FakeDiscovery([node("a", "decode", busy), node("b", "decode", NodeLoad(num_running=8)),
                          node("p", "prefill")])
    metrics.watch(disc, None)
    m = Metrics.parse(metrics.render().decode())
    assert m.value("kvrelay:load_imbalance", role="decode") == 1.0
    assert m.value("kvrelay:index_staleness_seconds") == 0.0


def registration(node_id: str, block_size: int = BS, model_id: str = MODEL) -> NodeRegistration:
    return NodeRegistration(node_id, "decode", f"{node_id}:1", "", "auto", model_id, block_size, "float32", 1000)


def test_a_block_size_mismatch_is_logged_counted_and_never_routed_to(caplog):
    metrics = GatewayMetrics("m", "cache_aware")
    disc = Discovery(DiscoveryConfig(model_id=MODEL, block_size=BS), NodeClients(), metrics=metrics)
    rows = [(registration("d0"), None), (registration("d1", block_size=32), None),
            (registration("d2", model_id="other"), None)]
    with caplog.at_level(logging.WARNING, logger="kvrelay.gateway.discovery"):
        for _ in range(3):  # every registry read sees them again: logged and counted once each
            disc.set_registered(rows)
    assert [n.node_id for n in disc.routable("decode")] == ["d0"]
    assert {n.node_id: n.refused is not None for n in disc.nodes()} == {"d0": False, "d1": True, "d2": True}
    m = Metrics.parse(metrics.render().decode())
    assert m.value("kvrelay:node_config_mismatches_total", node_id="d1", field="block_size") == 1
    assert m.value("kvrelay:node_config_mismatches_total", node_id="d2", field="model") == 1
    assert sum("block size 32 differs" in r.message for r in caplog.records) == 1


def _tiered_router(loads: dict[str, NodeLoad], tiered: bool = True, resident: dict[str, int] | None = None
                   ) -> tuple[Router, list[int]]:
    """Three colocated nodes of one host sharing an offload tier, which holds a 400-token prompt's 25 blocks; d0
    holds its first 10 in memory (and each node of `resident` that many)."""
    tokens = prompt(1, 400)
    hashes = prompt_block_hashes(tokens, MODEL, BS)
    index = MemoryIndex(get_store(f"memory://tiers-{uuid.uuid4().hex[:8]}"), MODEL)
    for node_id, n in {"d0": 10, **(resident or {})}.items():
        index.apply(node_id, [BlockEvent(BlockEventKind.STORED, h) for h in hashes[:n]])
    index.apply(TIER, [BlockEvent(BlockEventKind.STORED, h) for h in hashes])
    tiers = (TIER,) if tiered else ()
    nodes = [node(f"d{i}", "decode", loads.get(f"d{i}"), kv_tiers=tiers) for i in range(3)]
    return Router(FakeDiscovery(nodes), make_policy("cache_aware"), index, 16), tokens


TIER = "tier:memory:0123456789abcdef"


def test_a_prefix_in_the_tier_counts_below_a_resident_one_and_above_a_miss():
    """Each node can load the prompt from the tier: d0 the 15 blocks past its resident 10, the others all 25.
    Loading a token costs a tenth of computing it until a node has measured its own, so d0 (15 blocks to load)
    beats d1 and d2 (25 each), which beat computing the prompt; a node holding all 25 in memory beats them all."""
    router, tokens = _tiered_router({})
    d = route(router, tokens)
    assert (d.decode.node_id, d.decode_cached_tokens) == ("d0", 399)
    assert {n.node_id for n in d.decode_fallbacks} == {"d1", "d2"}
    router, tokens = _tiered_router({}, resident={"d2": 25})
    d = route(router, tokens)
    assert (d.decode.node_id, d.decode_cached_tokens) == ("d2", 399)
    assert [n.node_id for n in d.decode_fallbacks] == ["d0", "d1"]
    blind, _ = _tiered_router({}, tiered=False)
    d = route(blind, tokens)
    assert (d.decode.node_id, d.decode_cached_tokens) == ("d0", 160)  # only what it holds in memory


def test_the_tier_is_weighed_by_what_each_node_measured():
    """d0 measured loading as dear as computing (a slow disk): its resident 10 blocks still count, but d1, which
    loads at a hundredth of a computed token, now costs less than d0's 239 tokens to load."""
    router, tokens = _tiered_router({"d0": NodeLoad(kv_tier_token_cost=1.0), "d1": NodeLoad(kv_tier_token_cost=0.01),
                                     "d2": NodeLoad(kv_tier_token_cost=1.0)})
    d = route(router, tokens)
    assert d.decode.node_id == "d1"
    assert [n.node_id for n in d.decode_fallbacks] == ["d0", "d2"]


def test_a_prefix_split_between_the_memory_and_disk_tiers_counts_whole():
    """A conversation's older blocks went down to disk first: its first 10 blocks are on disk, the next 15 in
    memory, none resident. A node reading both tiers can load all 25 (the run from each tier's end is looked up in
    both again); a node of another host, naming only a memory tier that holds them, none of the first."""
    tokens = prompt(1, 400)
    hashes = prompt_block_hashes(tokens, MODEL, BS)
    index = MemoryIndex(get_store(f"memory://split-{uuid.uuid4().hex[:8]}"), MODEL)
    disk, memory = "tier:disk:0123456789abcdef", TIER
    index.apply(disk, [BlockEvent(BlockEventKind.STORED, h) for h in hashes[:10]])
    index.apply(memory, [BlockEvent(BlockEventKind.STORED, h) for h in hashes[10:]])
    nodes = [node("d0", "decode", kv_tiers=(memory, disk)), node("d1", "decode", kv_tiers=(memory,))]
    d = route(Router(FakeDiscovery(nodes), make_policy("cache_aware"), index, 16), tokens)
    assert (d.decode.node_id, d.decode_cached_tokens) == ("d0", 399)
    nodes = [node("d1", "decode", kv_tiers=(memory,))]
    assert route(Router(FakeDiscovery(nodes), make_policy("cache_aware"), index, 16), tokens).decode_cached_tokens == 0
