"""The simulator runs the production router, index mirror and schedulers; its timing follows its models exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.scheduler import Scheduler
from kvrelay.gateway.discovery import Discovery
from kvrelay.gateway.policies import CacheAware, make_policy
from kvrelay.gateway.router import Router
from kvrelay.index.memory import MemoryRegistry
from kvrelay.index.mirror import MirrorState
from kvrelay.sim.fleet import MODEL_ID, Fleet, FleetSpec
from kvrelay.sim.results import Collector
from kvrelay.sim.run import simulate
from kvrelay.sim.timemodel import load_profile
from kvrelay.sim.trace import PromptSource, TraceRequest
from kvrelay.sim.workloads import Shape, chat, llmd
from tests.sim.helpers import tiny_profile


def prompt(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def logged(trace, spec, profile, collector=None) -> list[tuple]:
    """Every token a client receives and every request's end, in simulated order: (time, request, what)."""
    log: list[tuple] = []
    simulate(trace, spec, profile, setup=lambda fleet: setattr(fleet.dispatcher, "log", log), collector=collector)
    return log


def test_colocated_event_order_is_the_hand_computed_one():
    # r0 (32-token prompt, 3 tokens out) at 0; r1 (16, 2 out) at 5 ms. Steps take 10 ms + 1 ms per token:
    #   [0, 42 ms)  r0's prompt (32)                    -> r0 token 1
    #   [42, 69)    r0 decodes (1) + r1's prompt (16)   -> r0 token 2, r1 token 1
    #   [69, 81)    r0 (1) + r1 (1)                      -> r0 token 3 (done), r1 token 2 (done)
    trace = [TraceRequest(0.0, 3, prompt_tokens=prompt(1000, 32)),
             TraceRequest(0.005, 2, prompt_tokens=prompt(2000, 16))]
    c = Collector()
    events = logged(trace, FleetSpec(colocated=1, hop_s=0.0), tiny_profile(), c)
    assert events == [(0.042, "r0", "tokens 1-1"), (0.069, "r0", "tokens 2-2"), (0.069, "r1", "tokens 1-1"),
                      (0.081, "r0", "tokens 3-3"), (0.081, "r0", "done"), (0.081, "r1", "tokens 2-2"),
                      (0.081, "r1", "done")]
    assert c.ttft == pytest.approx([0.042, 0.064]) and c.e2e == pytest.approx([0.081, 0.076])
    r = simulate(trace, FleetSpec(colocated=1, hop_s=0.0), tiny_profile())
    assert (r.completed, r.failed, r.sim_duration_s) == (2, 0, pytest.approx(0.081))
    assert r.itl_p50_s == pytest.approx(0.012)


def test_a_request_overhead_delays_each_request_by_it_before_routing():
    # The same two requests as above, with 5 ms of request overhead (what a served fleet adds outside the steps):
    # r0 enters at 5 ms, r1 at 10 ms, while r0's prompt runs: every event comes 5 ms later than without it.
    trace = [TraceRequest(0.0, 3, prompt_tokens=prompt(1000, 32)),
             TraceRequest(0.005, 2, prompt_tokens=prompt(2000, 16))]
    profile = tiny_profile()
    slow = dataclasses.replace(profile, steps={1: dataclasses.replace(profile.steps[1], request_overhead_s=0.005)})
    c = Collector()
    events = logged(trace, FleetSpec(colocated=1, hop_s=0.0), slow, c)
    assert [e[0] for e in events] == [0.047, 0.074, 0.074, 0.086, 0.086, 0.086, 0.086]
    assert c.ttft == pytest.approx([0.047, 0.069])  # still from the arrival


def test_disaggregated_event_order_is_the_hand_computed_one():
    # 128-token prompt (more than the 64 a decode node computes itself): reserve, then the prefill node's step
    # of 10 + 128 ms; 8 blocks of 4,096 bytes go at 1 GB/s over 2 layers, overlapped with the step but for the
    # last layer's half: 1 ms + 16.384 us after the step; then the decode node's steps of 11 ms each.
    trace = [TraceRequest(0.0, 3, prompt_tokens=prompt(1000, 128))]
    events = logged(trace, FleetSpec(prefill=1, decode=1, hop_s=0.0), tiny_profile())
    first = 0.138 + 0.001 + 8 * 4096 / 1e9 / 2
    assert events == [(round(first, 9), "r0", "tokens 1-1"), (round(first + 0.011, 9), "r0", "tokens 2-2"),
                      (round(first + 0.022, 9), "r0", "tokens 3-3"), (round(first + 0.022, 9), "r0", "done")]


def test_a_shared_prefix_is_computed_once_and_found_by_the_router():
    # Two requests of one 256-token group on two colocated nodes: the second goes where the first left its blocks.
    trace = [TraceRequest(0.0, 2, prefix_group="g", prefix_len=256, suffix_len=16),
             TraceRequest(1.0, 2, prefix_group="g", prefix_len=256, suffix_len=16)]
    r = simulate(trace, FleetSpec(colocated=2, policy="precise"), tiny_profile())
    assert r.prefix_hit_ratio == pytest.approx(256 / (2 * 272))
    r_rr = simulate(trace, FleetSpec(colocated=2, policy="round_robin"), tiny_profile())
    assert r_rr.prefix_hit_ratio == 0.0 and r_rr.would_hit_ratio == pytest.approx(256 / (2 * 272))


def test_the_production_classes_make_every_decision(monkeypatch):
    calls = {"schedule": 0, "decide": 0, "lookup": 0, "update": 0}

    def counting(cls, name, key):
        original = getattr(cls, name)

        def wrapper(self, *a, **kw):
            calls[key] += 1
            return original(self, *a, **kw)
        monkeypatch.setattr(cls, name, wrapper)

    counting(Scheduler, "schedule", "schedule")
    counting(Scheduler, "update_from_output", "update")
    counting(Router, "decide", "decide")
    counting(MirrorState, "lookup", "lookup")
    trace = llmd(5.0, 4.0, seed=3, shape=Shape(tenants=3, prefix_len=96, suffix_len=40, output_len=4))
    fleet = Fleet(FleetSpec(prefill=2, decode=2, gateways=2), tiny_profile(), seed=0)
    c = Collector()
    fleet.start(trace, PromptSource(), c)
    fleet.loop.run()
    assert c.completed == len(trace) > 0
    for node in fleet.nodes.values():
        assert type(node.scheduler) is Scheduler and type(node.kv) is KVCacheManager and type(node.pool) is BlockPool
    for gw in fleet.gateways:
        assert type(gw.router) is Router and type(gw.discovery) is Discovery and type(gw.policy) is CacheAware
        assert type(gw.mirror) is MirrorState
    assert type(fleet.registry) is MemoryRegistry
    # One decision per request; one lookup in the gateway's mirror and one in the oracle ("would have hit").
    assert calls["decide"] == len(trace) and calls["lookup"] == 2 * len(trace)
    # Every simulated step is one schedule() and one update_from_output(); a schedule() with nothing to do ends
    # a node's stepping.
    steps = sum(n.stats.steps for n in fleet.nodes.values())
    assert calls["update"] == steps > 0 and calls["schedule"] > steps


def _run_in_subprocess(hash_seed: str) -> dict:
    code = ("import json; from kvrelay.sim.run import simulate; from kvrelay.sim.fleet import FleetSpec; "
            "from kvrelay.sim.workloads import llmd, Shape; from tests.sim.helpers import tiny_profile; "
            "t = llmd(20.0, 3.0, seed=5, shape=Shape(tenants=4, prefix_len=128, suffix_len=40, output_len=6, "
            "spread=0.5)); "
            "r = simulate(t, FleetSpec(prefill=2, decode=3, gateways=3, policy='random'), tiny_profile(), seed=7)"
            ".to_json(); r.pop('wall_s'); print(json.dumps(r, sort_keys=True))")
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    return json.loads(out.stdout)


def test_same_seed_same_result_in_any_process():
    a, b = _run_in_subprocess("1"), _run_in_subprocess("12345")
    assert a == b and a["completed"] > 0


def test_a_node_with_another_block_size_is_refused_and_counted():
    trace = [TraceRequest(0.1 * i, 2, prompt_tokens=prompt(1000 + 100 * i, 40)) for i in range(6)]
    fleet_spec = FleetSpec(decode=2, odd_block_size_nodes=1)
    r = simulate(trace, fleet_spec, tiny_profile())
    assert r.refused_nodes == 1 and r.completed == 6


def test_gateway_restart_and_shared_index():
    trace = llmd(20.0, 4.0, seed=1, shape=Shape(tenants=4, prefix_len=160, suffix_len=20, output_len=3))
    spec = FleetSpec(colocated=4, gateways=2, restarts=((1.0, 0),), restart_s=0.5)
    fleets = []
    r = simulate(trace, spec, tiny_profile(), setup=fleets.append)
    assert r.completed == len(trace) and r.failed == 0
    assert r.prefix_hit_ratio > 0.5
    assert [g.name for g in fleets[0].gateways] == ["gateway-2", "gateway-1"]  # gateway 0 was replaced


def test_shipped_profiles_load():
    for name in ("h100", "h200"):
        p = load_profile(name)
        assert p.source == "roofline" and p.kv_cache_blocks > 0 and p.figures["modelled"]
    with pytest.raises(ValueError, match="neither a file"):
        load_profile("no-such-profile")


def test_random_policy_is_seeded():
    assert [make_policy("random", seed=1)._rng.random() for _ in range(2)] == \
        [make_policy("random", seed=1)._rng.random() for _ in range(2)]


def test_an_offload_tier_gives_back_evicted_prefixes_at_the_links_cost():
    # 20 blocks of 16 tokens: b's prompt (272 tokens) evicts a's blocks; a's group again at 2 s finds its 256
    # prefix tokens (16 blocks) resident or in the tier, computes its 16 suffix tokens, and pays the load:
    # 10 ms + 16 ms + the loaded blocks' 4,096 bytes each at 1 GB/s.
    trace = [TraceRequest(0.0, 2, prefix_group="a", prefix_len=256, suffix_len=16),
             TraceRequest(1.0, 2, prefix_group="b", prefix_len=256, suffix_len=16),
             TraceRequest(2.0, 2, prefix_group="a", prefix_len=256, suffix_len=16)]
    fleets: list[Fleet] = []
    spec = FleetSpec(colocated=1, hop_s=0.0, offload_blocks=64, offload_bytes_per_s=1e9)
    c = Collector()
    simulate(trace, spec, tiny_profile(blocks=20), setup=fleets.append, collector=c)
    (node,) = fleets[0].nodes.values()
    loaded = node.tier.stats.loaded_blocks
    assert loaded >= 14 and node.tier.stats.offloaded_blocks >= loaded
    assert c.ttft[2] == pytest.approx(0.010 + 0.016 + loaded * 4096 / 1e9)
    without = Collector()
    simulate(trace, FleetSpec(colocated=1, hop_s=0.0), tiny_profile(blocks=20), collector=without)
    assert without.ttft[2] == pytest.approx(0.010 + 0.001 * (272 - 16 * (16 - loaded)))


def test_routing_that_sees_the_tiers_sends_a_conversation_back_to_the_host_that_kept_it():
    """Chat sessions on two nodes whose KV caches are too small, each with a tier on its own host: the tiers
    publish to the index, and a turn goes back where its earlier turns wait in the tier, instead of wherever
    load sends it (their blocks then recomputed). Measured: more of the prompts hit, and TTFT p50 falls."""
    trace = chat(1.0, 60.0, seed=0)
    spec = FleetSpec(colocated=2, kv_blocks=600, offload_blocks=3000)
    fleets: list[Fleet] = []
    seen = simulate(trace, spec, load_profile("h100"), setup=fleets.append)
    blind = simulate(trace, dataclasses.replace(spec, tier_routing=False), load_profile("h100"))
    assert seen.completed == blind.completed == len(trace)
    assert seen.prefix_hit_ratio > blind.prefix_hit_ratio + 0.02
    assert seen.ttft_p50_s < blind.ttft_p50_s
    node = next(iter(fleets[0].nodes.values()))
    registered = {reg.node_id: reg.kv_tiers for reg, _ in fleets[0].registry.live_nodes(MODEL_ID)}
    assert registered[node.node_id] == (f"tier:memory:{node.node_id}",)
    assert fleets[0].gateways[0].mirror.lookup(node.tier.hashes()[:1]) == {f"tier:memory:{node.node_id}": 1}
