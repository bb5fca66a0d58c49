"""`kvrelay bench fleet`: arms bring up real fleets with `kvrelay up`, measure them with the serve benchmark,
and stop them."""

from __future__ import annotations

import argparse
import json
import shlex

import pytest

from shared.bench import fleet
from tests.helpers.procs import alive, descendants


def test_scenarios_compare_the_right_fleets():
    a, b = fleet.scenario_arms("disagg", 3)
    assert a.up_flags == ("--colocated",) and b.up_flags == ("--prefill", "1", "--decode", "1")
    a, b = fleet.scenario_arms("routing", 3)
    assert a.label == "round_robin-3p1d" and b.label == "cache_aware-3p1d"
    assert a.up_flags == ("--prefill", "3", "--decode", "1", "--routing-policy", "round_robin")
    assert b.up_flags[-1] == "cache_aware"


@pytest.mark.parametrize("scenario", sorted(fleet.SERVE_DEFAULTS))
def test_default_serve_flags_parse_and_later_flags_win(scenario, tmp_path):
    flags = shlex.split(fleet.SERVE_DEFAULTS[scenario]) + ["--num-requests", "5"]
    args = fleet.serve_namespace(flags, "http://127.0.0.1:1/v1", "x", tmp_path / "x.json")
    assert args.num_requests == 5 and args.ignore_eos and args.label == "x"
    assert args.dataset == ("random" if scenario == "disagg" else "multi-tenant")


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_one_arm_runs_a_real_fleet_and_stops_it(default_model_dir, tmp_path, monkeypatch):
    spawned = []
    real_enter = fleet.FleetProcess.__enter__

    def enter(self):
        out = real_enter(self)
        spawned.append(descendants(self.proc.pid) | {self.proc.pid})
        return out

    monkeypatch.setattr(fleet.FleetProcess, "__enter__", enter)
    args = argparse.Namespace(output_dir=str(tmp_path), model="default", kv_cache_memory=128 * 2**20,
                              ready_timeout=360.0, no_plot=False)
    serve_args = shlex.split(fleet.SERVE_DEFAULTS["disagg"]) + [
        "--num-requests", "3", "--warmup", "0", "--concurrency", "2", "--min-input", "80", "--max-input", "120",
        "--min-output", "4", "--max-output", "6", "--tokenizer", str(default_model_dir), "--no-progress"]
    path = fleet.run_arm(fleet.scenario_arms("disagg", 1)[1], args, serve_args)
    result = json.loads(path.read_text())
    assert result["label"] == "disagg-1p1d" and result["completed"] == 3 and result["failed"] == 0
    assert result["fleet"]["kvrelay_up_flags"] == ["--model", "default", "--prefill", "1", "--decode", "1",
                                                   "--kv-cache-memory", str(128 * 2**20)]
    assert all(4 <= r["completion_tokens"] <= 6 for r in result["requests"])
    assert (tmp_path / "fleet-disagg-1p1d-latency.png").stat().st_size > 0
    assert result["base_url"] in (tmp_path / "fleet-disagg-1p1d.log").read_text()  # kvrelay up's banner
    (pids,) = spawned
    assert len(pids) >= 5  # kvrelay up, redis, prefill, decode, gateway
    assert not [p for p in pids if alive(p)], "processes left behind"
