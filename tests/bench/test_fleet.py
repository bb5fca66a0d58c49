"""`kvrelay bench fleet`: arms bring up real fleets with `kvrelay up`, measure them with the serve benchmark,
and stop them; and the runner's servers and nodes start, report readiness and stop."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys

import pytest

from kvrelay.bench import fleet, routing, vllm_baseline
from kvrelay.common.process import ProcessStartError
from kvrelay.common.system import free_port
from kvrelay.model_files.resolve import resolve_model
from tests.helpers.nodes import wait_for
from tests.helpers.procs import alive


def test_scenarios_compare_the_right_fleets():
    a, b = fleet.scenario_arms("disagg", 3)
    assert a.up_flags == ("--colocated",) and b.up_flags == ("--prefill", "1", "--decode", "1")
    a, b = fleet.scenario_arms("routing", 3)
    assert a.label == "round_robin-3p1d" and b.label == "cache_aware-3p1d"
    assert a.up_flags == ("--prefill", "3", "--decode", "1", "--routing-policy", "round_robin")
    assert b.up_flags[-1] == "cache_aware"
    assert fleet.scenario_arms("routing", 3, 2)[1].up_flags == (
        "--prefill", "3", "--decode", "2", "--routing-policy", "cache_aware")
    a, b = fleet.scenario_arms("vllm", 3)
    assert (a.label, a.kind, b.label, b.kind, b.up_flags) == (
        "vllm-serve", fleet.Kind.VLLM, "kvrelay-up", fleet.Kind.KVRELAY, ())
    a, b = fleet.scenario_arms("llamacpp", 3)
    assert (a.label, a.kind, b.label, b.kind, b.up_flags) == (
        "llama-server", fleet.Kind.LLAMACPP, "kvrelay-up-gguf", fleet.Kind.KVRELAY, ("--quantization", "gguf"))
    a, b = fleet.scenario_arms("kvcache", 3)
    assert (a.label, a.up_flags, b.label, b.up_flags) == ("kv-auto", (), "kv-int8", ("--kv-cache-dtype", "int8"))
    assert fleet.scenario_arms("kvcache", kv_cache_dtype="fp8")[1].up_flags == ("--kv-cache-dtype", "fp8")
    assert fleet.KV_CACHE_DEFAULTS["kvcache"] == 16 * 2**20


def test_the_llamacpp_scenario_needs_a_gguf_before_anything_starts(tmp_path):
    args = argparse.Namespace(model=str(tmp_path), llama_server=None)
    with pytest.raises(SystemExit, match="llama.cpp runs GGUF files"):
        fleet.llamacpp_inputs(args)
    with pytest.raises(SystemExit, match="no llama-server"):
        fleet.llamacpp_inputs(argparse.Namespace(model="default", llama_server="none"))


def test_rounds_alternate_which_arm_runs_first():
    a, b = fleet.scenario_arms("vllm", 1)
    assert fleet.round_arms(a, b, 1) == [(a, b)]
    pairs = fleet.round_arms(a, b, 3)
    assert [(x.label, y.label) for x, y in pairs] == [("vllm-serve-1", "kvrelay-up-1"),
                                                     ("vllm-serve-2", "kvrelay-up-2"),
                                                     ("vllm-serve-3", "kvrelay-up-3")]
    assert [arm.label for arm in fleet.play_order(pairs)] == [
        "vllm-serve-1", "kvrelay-up-1", "kvrelay-up-2", "vllm-serve-2", "vllm-serve-3", "kvrelay-up-3"]
    assert all(x.kind is fleet.Kind.VLLM for x, _ in pairs)


def test_vllm_serve_gets_the_kits_settings_on_this_machines_cores():
    argv = vllm_baseline.serve_argv("/venv/bin/python", "/models/smol", "Smol", "float32", 18123)
    assert argv == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/smol",
                    "--served-model-name", "Smol", "--host", "127.0.0.1", "--port", "18123", "--dtype", "float32",
                    "--max-model-len", "2048", "--max-num-seqs", "128", "--no-enable-prefix-caching", "--seed", "0",
                    "--disable-uvicorn-access-log"]
    cores = os.cpu_count()
    env = vllm_baseline.vllm_env("/venv/bin/python", cores, 2 * 2**30, "/scratch")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["OMP_NUM_THREADS"] == str(cores)
    assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] == "/scratch"  # its sockets go where the caller removes them
    assert env["TORCHINDUCTOR_CACHE_DIR"] != "/scratch"  # its compile cache outlives the run
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == (f"0-{cores - 1}" if cores > 1 else "0")
    # whole GiB, at least 1
    assert vllm_baseline.vllm_env("/venv/bin/python", 1, 1, "/s")["VLLM_CPU_KVCACHE_SPACE"] == "1"


@pytest.mark.parametrize("scenario", sorted(fleet.SERVE_DEFAULTS))
def test_default_serve_flags_parse_and_later_flags_win(scenario, tmp_path):
    flags = shlex.split(fleet.SERVE_DEFAULTS[scenario]) + ["--num-requests", "5"]
    args = fleet.serve_namespace(flags, "http://127.0.0.1:1/v1", "x", tmp_path / "x.json")
    assert args.num_requests == 5 and args.ignore_eos and args.label == "x"
    assert args.dataset == ("multi-tenant" if scenario == "routing" else "random")


@pytest.mark.timeout(420)
def test_one_arm_on_a_real_fleet_and_the_gateway_overhead(default_model_dir, tmp_path, spawned):
    """One `kvrelay up` (1 prefill + 1 decode node): an arm of `bench fleet` measured on it, `bench routing`'s
    overhead timed through it, its children listed from its log, and nothing left once it stops."""
    args = argparse.Namespace(output_dir=str(tmp_path), model="default", kv_cache_memory=128 * 2**20,
                              ready_timeout=360.0, no_plot=False, dtype="auto")
    serve_args = shlex.split(fleet.SERVE_DEFAULTS["disagg"]) + [
        "--num-requests", "3", "--warmup", "0", "--concurrency", "2", "--min-input", "80", "--max-input", "120",
        "--min-output", "4", "--max-output", "6", "--tokenizer", str(default_model_dir), "--no-progress"]
    arm = fleet.scenario_arms("disagg", 1)[1]
    server, record = fleet.start_arm(arm, args)
    with server:
        path, _ = fleet.measure_arm(server, arm, record, args, serve_args)
        assert set(server.pids()) == {"prefill-0", "decode-0", "gateway"}
        assert server.metrics().value("kvrelay:prompt_tokens_total") > 0
        ids = default_tokenizer_ids(default_model_dir)
        overhead = asyncio.run(routing._overhead(server, ids, 3))
    result = json.loads(path.read_text())
    assert result["label"] == "disagg-1p1d" and result["completed"] == 3 and result["failed"] == 0
    assert result["fleet"]["kvrelay_up_flags"] == ["--model", "default", "--prefill", "1", "--decode", "1",
                                                   "--kv-cache-memory", str(128 * 2**20)]
    assert all(4 <= r["completion_tokens"] <= 6 for r in result["requests"])
    assert (tmp_path / "fleet-disagg-1p1d-latency.png").stat().st_size > 0
    assert result["base_url"] in (tmp_path / "fleet-disagg-1p1d.log").read_text()  # kvrelay up's banner
    assert overhead["direct_ttft_ms"]["n"] == 3 and overhead["gateway_ttft_ms"]["n"] == 3  # one decode node
    assert overhead["prompt_tokens"] == len(ids) and overhead["gateway_cpu_per_request_ms"] > 0
    (pids,) = spawned
    assert len(pids) >= 5  # kvrelay up, redis, prefill, decode, gateway
    _gone(pids)


def _gone(pids: set[int]) -> None:
    """Every process of a stopped server's tree exits within seconds: SIGKILL returns before a process holding
    GBs (vLLM's engine core with its KV cache) has torn its memory down, so "alive right after" is a race."""
    wait_for(lambda: not [p for p in pids if alive(p)], 10, "the stopped server's processes to exit")


def default_tokenizer_ids(model_dir) -> list[int]:
    from kvrelay.common.tokenizer import Tokenizer

    return Tokenizer(model_dir).encode("Hello, how are you today?")


def _vllm_python() -> str:
    try:
        return vllm_baseline.find_python(None)
    except ValueError:
        pytest.skip("no vLLM venv here (the peer kit's, or $KVRELAY_VLLM_PYTHON)")


def _small_baseline_run(scenario: str, args: argparse.Namespace, tokenizer_dir) -> dict:
    """The scenario's baseline arm (its A) on three short requests: the serve result, checked complete."""
    serve_args = shlex.split(fleet.SERVE_DEFAULTS[scenario]) + [
        "--num-requests", "3", "--warmup", "0", "--concurrency", "2", "--min-input", "40", "--max-input", "60",
        "--min-output", "4", "--max-output", "6", "--tokenizer", str(tokenizer_dir), "--no-progress"]
    arm, _ = fleet.scenario_arms(scenario, 1)
    path, _ = fleet.run_arm(arm, args, serve_args)
    result = json.loads(path.read_text())
    assert result["completed"] == 3 and result["failed"] == 0
    assert all(4 <= r["completion_tokens"] <= 6 for r in result["requests"])
    return result


@pytest.mark.timeout(600)
def test_the_vllm_arm_serves_the_same_model_and_stops(default_model_dir, tmp_path, spawned, monkeypatch):
    _vllm_python()
    scratches, mkdtemp = [], fleet.tempfile.mkdtemp
    monkeypatch.setattr(fleet.tempfile, "mkdtemp", lambda **kw: scratches.append(mkdtemp(**kw)) or scratches[-1])
    args = argparse.Namespace(output_dir=str(tmp_path), model="default", kv_cache_memory=2**30, ready_timeout=480.0,
                              no_plot=True, dtype="float32", vllm_python=None,
                              resolved_model=resolve_model("default"))
    result = _small_baseline_run("vllm", args, default_model_dir)
    assert result["label"] == "vllm-serve"
    argv = result["fleet"]["vllm_serve_argv"]
    assert argv[argv.index("--model") + 1] == str(default_model_dir) and "float32" in argv
    (pids,) = spawned
    assert len(pids) >= 2  # the API server and its engine core
    _gone(pids)
    assert [s for s in scratches if "kvrelay-vllm-" in s] and not [s for s in scratches if os.path.exists(s)]


@pytest.mark.timeout(300)
def test_the_llama_server_arm_serves_the_same_gguf_and_stops(default_model_dir, tmp_path, spawned):
    from kvrelay.bench.llamacpp_baseline import find_tool

    if find_tool("llama-server", None) is None:
        pytest.skip("no llama-server here (the peer kit's LLAMACPP=1 build, or $KVRELAY_LLAMACPP_BIN)")
    args = argparse.Namespace(output_dir=str(tmp_path), model="default", kv_cache_memory=2**30, ready_timeout=120.0,
                              no_plot=True, dtype="auto", llama_server=None)
    args.gguf, args.served_name, args.llama_server_path = fleet.llamacpp_inputs(args)
    result = _small_baseline_run("llamacpp", args, default_model_dir)
    assert result["label"] == "llama-server"
    argv = result["fleet"]["llama_server_argv"]
    assert argv[argv.index("-m") + 1] == args.gguf and argv[argv.index("--parallel") + 1] == "32"
    _gone(spawned[0])


# -- the runner's processes -------------------------------------------------------------------------------


def _http_server(tmp_path, port: int) -> list[str]:
    (tmp_path / "www").mkdir(exist_ok=True)
    (tmp_path / "www" / "health").write_text("ok")
    return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path / "www")]


def test_a_server_is_ready_once_its_health_answers_and_stops_on_exit(tmp_path):
    port = free_port()
    with fleet.Server.start("web", _http_server(tmp_path, port), f"http://127.0.0.1:{port}/v1",
                            fleet.Server.answers_health, log_dir=tmp_path, timeout_s=30) as server:
        assert server.root == f"http://127.0.0.1:{port}" and server.answers_health()
        pid = server.process.pid
    assert not alive(pid) and server.process.returncode is not None
    assert server.health() == {}  # nothing answers any more


def test_a_server_that_exits_early_fails_with_its_log_tail(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(ProcessStartError, match=r"exited with 3:\nno model here"):
        fleet.Server.start("bad", argv, "http://127.0.0.1:9/v1", fleet.Server.answers_health, log_dir=tmp_path,
                           timeout_s=30)


def test_a_server_never_ready_times_out_and_is_stopped(tmp_path):
    argv = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    with pytest.raises(ProcessStartError, match="not ready after 2 s:\nloading"):
        fleet.Server.start("slow", argv, "http://127.0.0.1:9/v1", fleet.Server.answers_health, log_dir=tmp_path,
                           timeout_s=1.5)
    assert "loading" in (tmp_path / "slow.log").read_text()


def test_kvrelay_up_children_are_read_from_its_log(tmp_path):
    log = tmp_path / "up.log"
    log.write_text(f"x INFO kvrelay.up: started decode-0 (pid 4194309), log a\nx INFO kvrelay.up: started gateway (pid "
                   f"{os.getpid()})\nx INFO kvrelay.up: started decode-0 (pid {os.getpid()}), log a\n"
                   "x INFO kvrelay.up: started prefill-0 (pid 999999999), log b\n")
    process = fleet.ChildProcess("kvrelay-up", None, log)
    assert fleet.Server(process, "http://127.0.0.1:1/v1").pids() == {"decode-0": os.getpid(), "gateway": os.getpid()}


def test_a_node_that_cannot_start_fails_with_its_log_tail(tmp_path):
    (tmp_path / "decode-0.ready.json").write_text("{}")  # an earlier run's: not taken for this one's
    with pytest.raises(ProcessStartError, match="decode-0 exited"):
        fleet.Node.start_many([("decode", ["--model", str(tmp_path / "none")])], log_dir=tmp_path, timeout_s=120)
    assert "none" in (tmp_path / "decode-0.log").read_text() and not list(tmp_path.glob("*.ready.json"))
