"""`kvrelay bench fleet`: arms bring up real fleets with `kvrelay up`, measure them with the serve benchmark,
and stop them."""

from __future__ import annotations

import argparse
import json
import os
import shlex

import pytest

from kvrelay.bench import fleet, vllm_baseline
from kvrelay.bench.server_process import ServerProcess
from kvrelay.model_files.resolve import resolve_model
from tests.helpers.procs import alive, descendants


def test_scenarios_compare_the_right_fleets():
    a, b = fleet.scenario_arms("disagg", 3)
    assert a.up_flags == ("--colocated",) and b.up_flags == ("--prefill", "1", "--decode", "1")
    a, b = fleet.scenario_arms("routing", 3)
    assert a.label == "round_robin-3p1d" and b.label == "cache_aware-3p1d"
    assert a.up_flags == ("--prefill", "3", "--decode", "1", "--routing-policy", "round_robin")
    assert b.up_flags[-1] == "cache_aware"
    a, b = fleet.scenario_arms("vllm", 3)
    assert (a.label, a.server, b.label, b.server, b.up_flags) == (
        "vllm-serve", fleet.Server.VLLM, "kvrelay-up", fleet.Server.KVRELAY, ())


def test_rounds_alternate_which_arm_runs_first():
    a, b = fleet.scenario_arms("vllm", 1)
    assert fleet.round_arms(a, b, 1) == [(a, b)]
    pairs = fleet.round_arms(a, b, 3)
    assert [(x.label, y.label) for x, y in pairs] == [("vllm-serve-1", "kvrelay-up-1"),
                                                     ("vllm-serve-2", "kvrelay-up-2"),
                                                     ("vllm-serve-3", "kvrelay-up-3")]
    assert [arm.label for arm in fleet.play_order(pairs)] == [
        "vllm-serve-1", "kvrelay-up-1", "kvrelay-up-2", "vllm-serve-2", "vllm-serve-3", "kvrelay-up-3"]
    assert all(x.server is fleet.Server.VLLM for x, _ in pairs)


def test_vllm_serve_gets_the_kits_settings_on_this_machines_cores(tmp_path):
    server = vllm_baseline.VllmServer("/venv/bin/python", "/models/smol", "Smol", "float32", 18123,
                                      kv_cache_bytes=2 * 2**30, log_path=tmp_path / "v.log", ready_timeout=1.0)
    assert server.argv == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/smol",
                           "--served-model-name", "Smol", "--host", "127.0.0.1", "--port", "18123", "--dtype",
                           "float32", "--max-model-len", "2048", "--max-num-seqs", "128",
                           "--no-enable-prefix-caching", "--seed", "0", "--disable-uvicorn-access-log"]
    assert (server.base_url, server.health_url) == ("http://127.0.0.1:18123/v1", "http://127.0.0.1:18123/health")
    cores = os.cpu_count()
    assert server.env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert server.env["VLLM_CPU_OMP_THREADS_BIND"] == (f"0-{cores - 1}" if cores > 1 else "0")


@pytest.mark.parametrize("scenario", sorted(fleet.SERVE_DEFAULTS))
def test_default_serve_flags_parse_and_later_flags_win(scenario, tmp_path):
    flags = shlex.split(fleet.SERVE_DEFAULTS[scenario]) + ["--num-requests", "5"]
    args = fleet.serve_namespace(flags, "http://127.0.0.1:1/v1", "x", tmp_path / "x.json")
    assert args.num_requests == 5 and args.ignore_eos and args.label == "x"
    assert args.dataset == ("multi-tenant" if scenario == "routing" else "random")


def _record_spawned(monkeypatch) -> list[set[int]]:
    """Each started server's process tree, taken once it is ready (to check nothing outlives it)."""
    spawned = []
    real_enter = ServerProcess.__enter__

    def enter(self):
        out = real_enter(self)
        spawned.append(descendants(self.proc.pid) | {self.proc.pid})
        return out

    monkeypatch.setattr(ServerProcess, "__enter__", enter)
    return spawned


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_one_arm_runs_a_real_fleet_and_stops_it(default_model_dir, tmp_path, monkeypatch):
    spawned = _record_spawned(monkeypatch)
    args = argparse.Namespace(output_dir=str(tmp_path), model="default", kv_cache_memory=128 * 2**20,
                              ready_timeout=360.0, no_plot=False, dtype="auto")
    serve_args = shlex.split(fleet.SERVE_DEFAULTS["disagg"]) + [
        "--num-requests", "3", "--warmup", "0", "--concurrency", "2", "--min-input", "80", "--max-input", "120",
        "--min-output", "4", "--max-output", "6", "--tokenizer", str(default_model_dir), "--no-progress"]
    path, _ = fleet.run_arm(fleet.scenario_arms("disagg", 1)[1], args, serve_args)
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


def _vllm_python() -> str:
    try:
        return vllm_baseline.find_python(None)
    except ValueError:
        pytest.skip("no vLLM venv here (the peer kit's, or $KVRELAY_VLLM_PYTHON)")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_vllm_arm_serves_the_same_model_and_stops(default_model_dir, tmp_path, monkeypatch):
    _vllm_python()
    spawned = _record_spawned(monkeypatch)
    args = argparse.Namespace(output_dir=str(tmp_path), model="default", kv_cache_memory=2**30, ready_timeout=480.0,
                              no_plot=True, dtype="float32", vllm_python=None,
                              resolved_model=resolve_model("default"))
    serve_args = shlex.split(fleet.SERVE_DEFAULTS["vllm"]) + [
        "--num-requests", "3", "--warmup", "0", "--concurrency", "2", "--min-input", "40", "--max-input", "60",
        "--min-output", "4", "--max-output", "6", "--tokenizer", str(default_model_dir), "--no-progress"]
    arm, _ = fleet.scenario_arms("vllm", 1)
    path, _ = fleet.run_arm(arm, args, serve_args)
    result = json.loads(path.read_text())
    assert result["label"] == "vllm-serve" and result["completed"] == 3 and result["failed"] == 0
    assert all(4 <= r["completion_tokens"] <= 6 for r in result["requests"])
    argv = result["fleet"]["vllm_serve_argv"]
    assert argv[argv.index("--model") + 1] == str(default_model_dir) and "float32" in argv
    (pids,) = spawned
    assert len(pids) >= 2  # the API server and its engine core
    assert not [p for p in pids if alive(p)], "processes left behind"
