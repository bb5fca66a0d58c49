"""`kvrelay sim ...` and `kvrelay plan` as others script them: the JSON keys of the Interface section."""

from __future__ import annotations

import json

from kvrelay.cli import main
from kvrelay.sim import scale
from kvrelay.sim.trace import write_trace
from kvrelay.sim.validate import mape
from kvrelay.sim.workloads import Shape, llmd
from tests.sim.helpers import tiny_profile

RUN_KEYS = {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s", "output_tok_s", "prefix_hit_ratio",
            "completed", "failed", "wall_s"}


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_trace_then_run(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    assert main(["sim", "trace", "llmd", "--qps", "5", "--duration", "4", "--tenants", "3", "--prefix-len", "64",
                 "--suffix-len", "32", "--output-len", "4", "--out", str(trace)]) == 0
    made = last_json(capsys)
    assert made["requests"] == len(trace.read_text().splitlines()) > 0
    profile = tiny_profile().save(tmp_path / "tiny.json")
    assert main(["sim", "run", "--trace", str(trace), "--prefill", "1", "--decode", "2", "--policy", "least_load",
                 "--profile", str(profile), "--seed", "3", "--gateways", "2", "--restart-gateway", "1:1"]) == 0
    out = last_json(capsys)
    assert RUN_KEYS <= set(out) and out["completed"] == made["requests"] and out["failed"] == 0
    assert out["config"]["policy"] == "least_load" and out["config"]["gateways"] == 2
    assert main(["sim", "run", "--trace", str(trace), "--prefill", "1", "--colocated", "1"]) == 2  # one kind only
    for kind in ("chat", "day"):
        assert main(["sim", "trace", kind, "--qps", "0.5", "--duration", "20", "--day", "60", "--peak-qps", "2",
                     "--out", str(tmp_path / f"{kind}.jsonl")]) == 0
        assert last_json(capsys)["requests"] > 0


def test_plan_prints_its_choice_and_writes_the_overlay(tmp_path, capsys):
    profile = tiny_profile().save(tmp_path / "tiny.json")
    held_out = write_trace(tmp_path / "other-day.jsonl", llmd(8.0, 12.0, seed=5, shape=Shape(
        tenants=1_000_000, prefix_len=0, suffix_len=128, output_len=4, spread=0.5)))
    assert main(["plan", "--rate", "10", "--isl", "128", "--osl", "4", "--duration", "10", "--slo-ttft-p90", "0.5",
                 "--slo-itl-p90", "0.1", "--profile", str(profile), "--batched-tokens", "2048", "--max-nodes", "8",
                 "--autoscale", "--autoscale-trace", str(held_out), "--out", str(tmp_path / "overlay")]) == 0
    out = last_json(capsys)
    assert {"prefill", "decode", "colocated", "ttft_p90_s", "itl_p90_s", "node_hours", "pareto", "overlay",
            "schedule"} <= set(out)
    assert out["ttft_p90_s"] <= 0.5 and out["itl_p90_s"] <= 0.1 and out["pareto"]
    auto = out["autoscale"]
    assert {"node_hours", "static_node_hours", "within_slo", "oscillations"} <= set(auto)
    assert auto["trace"] == str(held_out)
    assert {"node_hours", "within_slo"} <= set(auto["without_queue_signal"]) & set(auto["reactive_only"])
    assert (tmp_path / "overlay" / "kustomization.yaml").is_file()


def test_scale_quick(tmp_path, capsys):
    assert main(["sim", "scale", "--quick", "--parts", "gateways,hot", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "scale.json").read_text())
    assert {r["gateways"] for r in report["gateways"]["rows"] if r["case"] == "gateways"} == {1, 4}
    hot = {r["policy"]: r for r in report["hot"]["rows"]}
    assert set(hot) == set(scale.POLICIES) and hot["round_robin"]["hot_nodes"] > 1


def test_mape():
    points = [{"real": {"ttft_p50_s": 1.0, "itl_p50_s": 0.1}, "sim": {"ttft_p50_s": 1.1, "itl_p50_s": 0.09}},
              {"real": {"ttft_p50_s": 2.0, "itl_p50_s": 0.1}, "sim": {"ttft_p50_s": 1.8, "itl_p50_s": 0.1}}]
    out = mape(points)
    assert out["ttft_p50_s"] == 0.1 and out["itl_p50_s"] == 0.05 and out["output_tok_s"] is None
