"""`kvrelay bench routing`'s decision part on a real Redis (registry, index and the gateway's mirror), small."""

from __future__ import annotations

import json

from kvrelay.bench import parse_args, routing
from kvrelay.bench.index_lookup import BLOCK_SIZE, index_workload


def test_the_index_workload_is_seeded_and_shaped():
    work = index_workload("m", num_nodes=6, num_tokens=256, noise_blocks=3, seed=1)
    assert work == index_workload("m", num_nodes=6, num_tokens=256, noise_blocks=3, seed=1)
    assert sorted(work.held) == [f"node-{n:03d}" for n in range(6)]
    assert len(work.queries) == 16 and all(len(q) == 256 for q in work.queries)
    assert all(len(h) == 256 // BLOCK_SIZE for h in work.query_hashes())
    tenants = {tuple(h[:4]) for h in work.query_hashes()}
    assert len(tenants) == 4  # four tenants' system prompts open the queries
    assert all(len(blocks) >= 3 for blocks in work.held.values())


def test_decisions_with_the_mirror_and_with_redis(tmp_path, capsys):
    out = tmp_path / "routing.json"
    args = parse_args(routing.__name__, ["--skip-overhead", "--decision-nodes", "10", "--decision-tokens", "512",
                                         "--decision-iters", "30", "--lag-seconds", "0.3", "--output", str(out)])
    assert routing.run(args) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result and "overhead" not in result
    d = result["decision"]
    for lookup in ("mirror", "redis"):
        total = d[lookup]["total_ms"]
        assert total["n"] == 30 and 0 < total["p50"] <= total["p99"] <= total["max"]
        assert set(d[lookup]) == {"total_ms", "cpu_per_decision_ms", "hash_ms", "lookup_ms", "score_ms"}
        assert d[lookup]["cpu_per_decision_ms"]["client"] > 0
    assert d["redis"]["cpu_per_decision_ms"]["redis"] > d["mirror"]["cpu_per_decision_ms"]["redis"]
    lag = d["mirror_under_load"]
    assert lag["caught_up"] and lag["gaps"] == 0 and lag["events_per_s"] > 0 and lag["lag_ms"]["p50"] > 0
    assert d["hash_python_ms"]["n"] == 30 and d["meets_target"] == (d["mirror"]["total_ms"]["p99"] <= 0.5)
    assert result["loop_1m_ms_before"] > 0 and result["loop_1m_ms_after"] > 0
