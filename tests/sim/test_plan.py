"""The planner: the search, the autoscaler (HPA semantics on the simulated fleet), and the overlay it writes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess

import pytest
import yaml

from kvrelay.sim.autoscale import Autoscaler, HPAPolicy, PoolPolicy, Schedule, oscillations
from kvrelay.sim.fleet import FleetSpec
from kvrelay.sim.overlay import cron_windows, write_overlay
from kvrelay.sim.plan import SLO, Candidate, Search, busiest_window, pareto
from kvrelay.sim.policy import burst_headroom, hpa_policy, needed_rps, prefill_tokens_per_s, schedule_for
from kvrelay.sim.results import Collector, RunResult
from kvrelay.sim.run import simulate
from kvrelay.sim.timemodel import load_profile
from kvrelay.sim.trace import TraceRequest
from kvrelay.sim.workloads import Shape, llmd
from tests.deploy.test_deploy import adapter_rules, check_promql, kustomize, promql_selectors, require
from tests.sim.helpers import tiny_profile

SHAPE = Shape(tenants=4, prefix_len=64, suffix_len=64, output_len=4)


def result(ttft: float, failed: int = 0) -> RunResult:
    return RunResult(ttft / 2, ttft, ttft, 0.01, 0.01, 100.0, 0.5, 10, failed, 0.1)


def test_busiest_window_is_shifted_to_zero():
    trace = [TraceRequest(t, 1, prompt_tokens=(1,)) for t in (0, 1, 50, 50.5, 51, 51.5, 90)]
    window = busiest_window(trace, 5.0)
    assert [r.arrival_s for r in window] == [0, 0.5, 1.0, 1.5]
    assert busiest_window(trace, 0) == trace


def test_pareto_keeps_shapes_no_cheaper_one_beats():
    cands = [Candidate(FleetSpec(colocated=n), result(t, f)) for n, t, f in
             [(1, 9.0, 0), (2, 3.0, 0), (3, 4.0, 0), (4, 1.0, 1), (5, 0.5, 0)]]
    assert [c.nodes for c in pareto(cands)] == [1, 2, 5]


def test_search_finds_the_smallest_fleet_that_meets_the_slos():
    trace = llmd(30.0, 6.0, seed=1, shape=SHAPE)
    search = Search(trace, tiny_profile(), SLO(0.3, 0.2), seed=0, max_nodes=16)
    sched = FleetSpec(decode=1).scheduler
    best = search.colocated(sched)
    assert best is not None and SLO(0.3, 0.2).met(best.result)
    smaller = simulate(trace, FleetSpec(colocated=best.nodes - 1), tiny_profile()) if best.nodes > 1 else None
    assert smaller is None or not SLO(0.3, 0.2).met(smaller)


def burst_trace() -> list[TraceRequest]:
    calm = llmd(2.0, 120.0, seed=1, shape=SHAPE)
    burst = [dataclasses.replace(r, arrival_s=20 + r.arrival_s) for r in llmd(40.0, 10.0, seed=2, shape=SHAPE)]
    return sorted(calm + burst, key=lambda r: r.arrival_s)


def test_the_queue_signal_scales_up_in_a_burst_and_down_after_without_flapping():
    profile = tiny_profile()
    pool = PoolPolicy(1, 6, {"kvrelay:queued_prefill_tokens": 500, "vllm:num_requests_running": 64},
                      up_pods=2, up_period_s=5, down_pods=1, down_period_s=10, down_window_s=15)
    scaler = Autoscaler(HPAPolicy({"colocated": pool}, sync_s=2.0))
    c = Collector()
    r = simulate(burst_trace(), FleetSpec(colocated=1), profile, setup=scaler.install, collector=c)
    ups = [x for x in scaler.changes if x[3] > x[2]]
    downs = [x for x in scaler.changes if x[3] < x[2]]
    assert ups and 20 <= ups[0][0] < 30 and downs and downs[0][0] > ups[-1][0]
    assert oscillations(scaler.changes, 2.0) == 0 and r.completed == len(burst_trace())
    # Without the queue-time signal the pool grows only once the batch is full, later: TTFT pays for it.
    blind = Autoscaler(HPAPolicy({"colocated": pool}, sync_s=2.0, use_queue_signal=False))
    r_blind = simulate(burst_trace(), FleetSpec(colocated=1), profile, setup=blind.install)
    blind_ups = [x for x in blind.changes if x[3] > x[2]]
    assert (not blind_ups or blind_ups[0][0] > ups[0][0]) and r_blind.ttft_p90_s > r.ttft_p90_s


def test_oscillation_count():
    up, down = ("p", 1, 2), ("p", 2, 1)
    changes = [(0, *up), (10, *down), (20, *up), (200, *down)]
    assert oscillations(changes, interval_s=15) == 1  # up-down-up within 45 s; then 190 s apart
    assert oscillations(changes, interval_s=5) == 0


def test_targets_come_from_the_profile_and_the_slos():
    profile = load_profile("h100")
    choice = Candidate(FleetSpec(prefill=2, decode=3), result(0.5))
    trace = llmd(5.0, 10.0, seed=0)
    policy = hpa_policy(choice.spec, profile, SLO(2.0, 0.05), trace)
    queued = policy.pools["prefill"].targets["kvrelay:queued_prefill_tokens"]
    assert queued == round(prefill_tokens_per_s(profile, 2048) * 1.0)
    assert policy.pools["decode"].max_replicas == 6 and policy.pools["prefill"].max_replicas == 4
    assert 1 <= policy.pools["decode"].targets["vllm:num_requests_running"] < 1024


@pytest.mark.parametrize("colocated", [False, True])
def test_the_overlay_is_one_deploy_can_apply(tmp_path, colocated):
    profile = load_profile("h100")
    spec = FleetSpec(colocated=4) if colocated else FleetSpec(prefill=2, decode=3)
    choice = Candidate(dataclasses.replace(spec, scheduler=dataclasses.replace(spec.scheduler,
                                                                              max_num_batched_tokens=8192)),
                       result(0.5))
    policy = hpa_policy(choice.spec, profile, SLO(2.0, 0.05), llmd(5.0, 10.0, seed=0))
    paths = write_overlay(tmp_path / "planned", choice, policy, profile)
    assert paths[0].name == "kustomization.yaml"
    for path in paths:  # JSON is YAML: the files parse either way
        text = path.read_text()
        json.loads(text[text.index("{"):]) if path.name == "kustomization.yaml" else None
    served = {r["name"]["as"]: r for r in adapter_rules()}
    if colocated:
        deleted = [json.loads(p.read_text()) for p in sorted((tmp_path / "planned").glob("no-prefill-*.yaml"))]
        assert {(d["kind"], d["metadata"]["name"], d["$patch"]) for d in deleted} == {
            ("Deployment", "kvrelay-prefill", "delete"), ("Service", "kvrelay-prefill", "delete"),
            ("HorizontalPodAutoscaler", "kvrelay-prefill", "delete"),
            ("PodDisruptionBudget", "kvrelay-prefill", "delete")}
        # The stand-in kustomize() has no `$patch: delete`: the real one, where this machine has it.
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            return
        built = subprocess.run([kubectl, "kustomize", str(tmp_path / "planned")], capture_output=True, text=True,
                               timeout=120, check=True).stdout
        resources = [r for r in yaml.safe_load_all(built) if r]
        # The prefill pool is gone; the decode pool prefills and autoscales on the queue signal too.
        assert not [r for r in resources if r["metadata"]["name"] == "kvrelay-prefill"]
        (hpa,) = [r for r in resources if r["kind"] == "HorizontalPodAutoscaler"]
        names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
        assert hpa["metadata"]["name"] == "kvrelay-decode" and "kvrelay_queued_prefill_tokens" in names
        return
    kubernetes_validate = require("kubernetes_validate", "kubernetes-validate")
    resources = kustomize(tmp_path / "planned")
    hpas = {r["metadata"]["name"]: r for r in resources if r["kind"] == "HorizontalPodAutoscaler"}
    deps = {r["metadata"]["name"]: r for r in resources if r["kind"] == "Deployment"}
    assert hpas["kvrelay-prefill"]["spec"]["maxReplicas"] == 4 and hpas["kvrelay-decode"]["spec"]["maxReplicas"] == 6
    for res in resources:
        kubernetes_validate.validate(res, "1.30", strict=True)
    for hpa in hpas.values():
        for metric in hpa["spec"]["metrics"]:
            name = metric["pods"]["metric"]["name"]
            assert name in served and promql_selectors(served[name]["seriesQuery"])
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60
    for pool in ("prefill", "decode"):
        (container,) = deps[f"kvrelay-{pool}"]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KVRELAY_MAX_NUM_BATCHED_TOKENS"] == "8192" and env["KVRELAY_DEVICE"] == "cuda"
        assert "replicas" not in deps[f"kvrelay-{pool}"]["spec"]


def test_burst_headroom_is_the_surge_nodes_cannot_start_in_time_for():
    steady = [TraceRequest(i / 10, 1, prompt_tokens=(1,)) for i in range(10 * 900)]  # 10/s for 900 s
    assert burst_headroom(steady, react_s=60) == pytest.approx(1.0, abs=0.05)
    surge = [TraceRequest(600 + i / 30, 1, prompt_tokens=(1,)) for i in range(30 * 60)]  # +30/s for a minute
    bursty = sorted(steady + surge, key=lambda r: r.arrival_s)
    assert burst_headroom(bursty, react_s=60, q=100) == pytest.approx(4.0, rel=0.05)


def test_a_schedule_gives_replicas_by_time_of_day():
    s = Schedule(60.0, ((0.0, 1), (20.0, 3), (40.0, 2)))
    assert [s.replicas_at(t) for t in (0, 19.9, 20, 39, 40, 59.9, 60, 85)] == [1, 1, 3, 3, 2, 2, 1, 3]
    for steps in (((5.0, 1),), ((0.0, 1), (0.0, 2)), ((0.0, 1), (60.0, 2))):
        with pytest.raises(ValueError):
            Schedule(60.0, steps)
    # Its period taken as a day: cron windows, the last one ending at midnight.
    day = Schedule(1800.0, ((0.0, 1), (75.0, 2), (1612.5, 1)))
    assert cron_windows(day) == [("0 0 * * *", "0 1 * * *", 1), ("0 1 * * *", "30 21 * * *", 2),
                                 ("30 21 * * *", "0 0 * * *", 1)]


def test_the_learned_schedule_holds_the_bursts_room_ahead_of_the_day_and_ignores_the_bursts():
    """5 req/s for 600 s, then 20 req/s; a 30 s burst of +10/s at 300 s. The burst factor (2: the burst's
    minute over the base) applies to the base rate, which the burst does not move; the pool of 4 nodes was
    shown to serve 20 req/s, so it needs 2 nodes in the morning, and all 4 from a start-up time before the rise."""
    def even(rate: float, start: float, end: float) -> list[TraceRequest]:
        n = round(rate * (end - start))
        return [TraceRequest(start + (i + 0.5) / rate, 1, prompt_tokens=(1,)) for i in range(n)]

    trace = sorted(even(5, 0, 600) + even(20, 600, 1200) + even(10, 300, 330), key=lambda r: r.arrival_s)
    schedule = schedule_for(needed_rps(trace, lead_s=105), pool_size=4, served_rps=20.0)
    assert schedule.period_s == 1200.0
    assert all(schedule.replicas_at(t) == 2 for t in range(0, 450, 5))  # through the burst at 300 s
    assert all(schedule.replicas_at(t) == 4 for t in range(500, 1200, 5))  # ready 105 s before the rise


def test_the_schedule_scales_the_simulated_pool_ahead_of_its_metrics():
    """No load at all: the pool follows its schedule (nodes start when asked, serve after the start-up time)."""
    profile = tiny_profile()
    pool = PoolPolicy(1, 4, {"vllm:num_requests_running": 64}, schedule=Schedule(60.0, ((0.0, 1), (20.0, 3))),
                      down_window_s=5.0)
    scaler = Autoscaler(HPAPolicy({"colocated": pool}, sync_s=2.0))
    calm = [TraceRequest(t, 2, prompt_tokens=(1, 2, 3)) for t in range(0, 90, 10)]
    simulate(calm, FleetSpec(colocated=1), profile, setup=scaler.install)
    # Up at the step; down (one pod at a time) at the first sync whose 5 s window holds no desire for 3: 64 s.
    assert scaler.changes[:2] == [(20.0, "colocated", 1, 3), (64.0, "colocated", 3, 2)]


def test_scheduled_targets_are_what_one_node_serves_and_the_schedule_stays_within_the_peak_pool():
    profile = load_profile("h100")
    choice = Candidate(FleetSpec(prefill=2, decode=3), result(0.5))
    trace = llmd(5.0, 600.0, seed=0)
    reactive = hpa_policy(choice.spec, profile, SLO(2.0, 0.05), trace)
    scheduled = hpa_policy(choice.spec, profile, SLO(2.0, 0.05), trace, scheduled=True)
    for role, size in (("prefill", 2), ("decode", 3)):
        pool = scheduled.pools[role]
        assert reactive.pools[role].schedule is None and pool.schedule is not None
        assert {r for _, r in pool.schedule.steps} <= set(range(1, size + 1))
        assert all(v >= reactive.pools[role].targets[k] for k, v in pool.targets.items())
    assert scheduled.pools["prefill"].targets["kvrelay:queued_prefill_tokens"] == round(
        prefill_tokens_per_s(profile, 2048) * 1.0)


@pytest.mark.parametrize("colocated", [False, True])
def test_a_scheduled_overlay_scales_with_keda_on_exported_metrics(tmp_path, colocated):
    kubectl = shutil.which("kubectl")
    if kubectl is None:  # the stand-in kustomize() has no `$patch: delete`
        pytest.skip("kubectl is not installed")
    profile = load_profile("h100")
    spec = FleetSpec(colocated=4) if colocated else FleetSpec(prefill=2, decode=3)
    choice = Candidate(spec, result(0.5))
    trace = sorted(llmd(2.0, 900.0, seed=0) + [dataclasses.replace(r, arrival_s=r.arrival_s + 400)
                                               for r in llmd(10.0, 300.0, seed=1)], key=lambda r: r.arrival_s)
    policy = hpa_policy(choice.spec, profile, SLO(2.0, 0.05), trace, scheduled=True)
    write_overlay(tmp_path / "planned", choice, policy, profile, namespace="llm")
    built = subprocess.run([kubectl, "kustomize", str(tmp_path / "planned")], capture_output=True, text=True,
                           timeout=120, check=True).stdout
    resources = [r for r in yaml.safe_load_all(built) if r]
    assert not [r for r in resources if r["kind"] == "HorizontalPodAutoscaler"]  # KEDA makes them
    scaled = {r["metadata"]["name"]: r for r in resources if r["kind"] == "ScaledObject"}
    pools = {"decode": "colocated"} if colocated else {"prefill": "prefill", "decode": "decode"}
    assert set(scaled) == {f"kvrelay-{p}" for p in pools}
    for pool, role in pools.items():
        spec_ = scaled[f"kvrelay-{pool}"]["spec"]
        planned = policy.pools[role]
        assert spec_["scaleTargetRef"]["name"] == f"kvrelay-{pool}" and spec_["minReplicaCount"] == 1
        crons = [t["metadata"] for t in spec_["triggers"] if t["type"] == "cron"]
        windows = [w for w in cron_windows(planned.schedule) if w[2] > 1]
        assert windows and [(c["start"], c["end"], int(c["desiredReplicas"])) for c in crons] == windows
        queries = [t["metadata"] for t in spec_["triggers"] if t["type"] == "prometheus"]
        assert len(queries) == len(planned.targets)
        for q in queries:
            assert not check_promql(q["query"], "ScaledObject") and 'namespace="llm"' in q["query"]
        assert spec_["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["policies"]
