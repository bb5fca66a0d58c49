"""The first hour with `kvrelay up`, as a newcomer goes through it (issue "The first hour with kvrelay up"):

1. every misconfiguration fails within 3 s, before anything starts, with one line naming the flag and exit code 2;
2. two fleets on one machine, differing only in --port, both serve, each printing its own ports;
3. the printed metrics URL serves vLLM's series, labelled by node;
4. every vLLM flag `up` takes reaches the node and takes effect (checked on the node's own metrics and behaviour);
5. Ctrl-C during a long stream: the stream ends with an error event and [DONE], new requests get 503 meanwhile,
   and nothing of the fleet is alive a second after `up` exits; two Ctrl-C: killed at once, nothing left either;
   no traceback anywhere.

Two real fleets (one colocated engine each on a small machine), started side by side; small --max-tokens.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvrelay.common.process import ChildProcess, kvrelay_command
from kvrelay.common.prometheus import Metrics
from kvrelay.common.system import free_port
from tests.helpers.procs import alive, descendants

pytestmark = pytest.mark.timeout(600)

KEY = "sk-newcomer-secret-key"
GRACE_S = 2.0
LONG_PROMPT = " ".join(f"item {i} is number {i * 7 % 13}." for i in range(60))  # ~500 tokens: chunked prefill
REGEX_CALL = r'\{"name": "get_weather", "parameters": \{"city": "Oslo"\}\}'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FLAGS = ["--max-num-seqs", "2", "--max-num-batched-tokens", "128", "--no-enable-prefix-caching", "--seed", "1234",
         "--gpu-memory-utilization", "0.5", "--device", "cpu", "--tool-call-parser", "llama3_json",
         "--enable-auto-tool-choice", "--allowed-origins", "http://app.example", "--api-key", KEY,
         "--kv-cache-memory", "96MiB", "--shutdown-grace", str(GRACE_S)]


# ------------------------------------------------------------------------------------- misconfigurations


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_each_misconfiguration_fails_fast_with_one_line_naming_the_flag(tmp_path, taken_port):
    cases = [
        (["--prefill", "0", "--decode", "0"], "--decode"),
        (["--prefill", "1", "--decode", "0"], "--decode"),
        (["--port", str(taken_port)], "--port"),
        (["--kv-cache-memory", "-1"], "--kv-cache-memory"),
        (["--kv-cache-memory", "1MiB"], "--kv-cache-memory"),
        (["--max-model-len", "1000000"], "--max-model-len"),
        (["--no-such-flag", "1"], "--no-such-flag"),
        (["--tensor-parallel-size", "2"], "--tensor-parallel-size"),
        (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size"),
    ]
    logs = tmp_path / "logs"
    for argv, flag in cases:
        t0 = time.monotonic()
        proc = subprocess.run(kvrelay_command("up", "--log-dir", str(logs), *argv), capture_output=True, text=True,
                              timeout=30)
        seconds = time.monotonic() - t0
        lines = proc.stderr.splitlines()
        assert proc.returncode == 2, (argv, proc.stderr)
        assert seconds < 3.0, (argv, seconds)
        assert len(lines) == 1 and lines[0].startswith("kvrelay up: error: ") and flag in lines[0], (argv, lines)
        assert "Traceback" not in proc.stderr and not proc.stdout
    assert not logs.exists()  # nothing was started: no run, no Redis, no node


# ---------------------------------------------------------------------------------------------- the fleets


@dataclass
class Up:
    """A running `kvrelay up` and what its banner printed."""

    process: ChildProcess
    port: int
    log_dir: Path
    banner: dict[str, str] | None = None

    @property
    def text(self) -> str:
        return self.process.log_text()

    def read_banner(self) -> dict[str, str] | None:
        found = dict(re.findall(r"^  (OpenAI base URL|metrics|gRPC API|nodes|API key|logs) +: (.+)$", self.text,
                                re.MULTILINE))
        return found or None

    @property
    def url(self) -> str:
        return self.banner["OpenAI base URL"].removesuffix("/v1")

    @property
    def metrics_url(self) -> str:
        return self.banner["metrics"].split()[0]

    def node_metrics(self) -> Metrics:
        address = re.search(r"metrics (\S+)", self.banner["nodes"]).group(1)
        return Metrics.scrape(f"http://{address}/metrics", timeout_s=5)

    def post(self, path: str, body: dict, timeout: float = 120) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=HEADERS, timeout=timeout)


HEADERS = {"Authorization": f"Bearer {KEY}"}


def _start(port: int, log_dir: Path) -> Up:
    # The same flags for both fleets; only --port differs.
    cmd = kvrelay_command("up", "--port", str(port), "--log-dir", str(log_dir), *FLAGS)
    return Up(ChildProcess.start(f"up-{port}", cmd, log_dir=log_dir), port, log_dir)


@pytest.fixture(scope="module")
def fleets(tmp_path_factory, default_model_dir):
    folder = tmp_path_factory.mktemp("fleets")
    ups = [_start(free_port(), folder / "a"), _start(free_port(), folder / "b")]
    try:
        for up in ups:
            up.banner = up.process.wait_ready(up.read_banner, timeout_s=400, interval_s=0.5)
        yield ups
    finally:
        for up in ups:
            up.process.stop(grace_s=30)


def _sample(up: Up) -> str:
    reply = up.post("/v1/completions", {"prompt": "Three random words:", "max_tokens": 8, "temperature": 1.5})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_seed_makes_sampled_output_reproducible(fleets):
    # Each fleet's first generation (so both samplers are at the same point of their --seed's stream).
    a, b = fleets
    first_a, first_b = _sample(a), _sample(b)
    assert first_a == first_b
    assert _sample(a) != first_a  # sampled for real: the next draw differs
    for up in fleets:
        (info,) = up.node_metrics().select("kvrelay:engine_config_info")
        assert info.labels["seed"] == "1234"


def test_two_fleets_differing_only_in_port_both_serve_with_their_own_ports(fleets):
    a, b = fleets
    for up in fleets:
        assert up.banner["OpenAI base URL"] == f"http://127.0.0.1:{up.port}/v1"
        # --port + 1 when that was free (it is, unless the other fleet's HTTP port happens to be it)
        assert up.banner["gRPC API"] == f"127.0.0.1:{up.port + 1}" or up.port + 1 in (a.port, b.port)
        models = httpx.get(up.url + "/v1/models", headers=HEADERS, timeout=10).json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"
    ports = [set(re.findall(r":(\d+)", up.banner["gRPC API"] + up.banner["nodes"])) for up in fleets]
    assert not ports[0] & ports[1]  # nothing shared
    for up in fleets:  # the placement note once, the key masked, progress while loading
        assert up.text.count("placement:") == 1 and KEY not in up.text and up.banner["API key"].startswith("sk-...")
        assert re.search(r"starting \(\d+ s\): ", up.text)


def test_the_printed_metrics_url_serves_each_nodes_vllm_series(fleets):
    for up in fleets:
        with pytest.raises(httpx.HTTPStatusError):  # keys exist: /metrics too needs one (or --public-metrics)
            Metrics.scrape(up.metrics_url)
        m = Metrics.scrape(up.metrics_url, headers=HEADERS)
        node = {"node_id": "colocated-0", "role": "colocated"}
        for name in ("vllm:num_requests_running", "vllm:time_to_first_token_seconds_count",
                     "vllm:kv_cache_usage_perc"):
            assert m.select(name, **node), name
        assert m.select("vllm:time_to_first_token_seconds_bucket", **node)
        assert m.value("kvrelay:node_metrics_up", **node) == 1 and m.select("kvrelay:requests_total")
        health = httpx.get(up.url + "/health", timeout=10).json()  # a colocated engine is named so
        assert [(n["node_id"], n["role"]) for n in health["nodes"]] == [("colocated-0", "colocated")]
        assert health["colocated_nodes"] == 1


def test_engine_flags_reach_the_node(fleets):
    m = fleets[0].node_metrics()
    (engine,) = m.select("kvrelay:engine_config_info")
    assert {k: engine.labels[k] for k in ("device", "max_num_seqs", "max_num_batched_tokens", "seed")} == \
        {"device": "cpu", "max_num_seqs": "2", "max_num_batched_tokens": "128", "seed": "1234"}
    (cache,) = m.select("vllm:cache_config_info")
    assert cache.labels["gpu_memory_utilization"] == "0.5" and cache.labels["enable_prefix_caching"] == "False"


def test_max_num_seqs_caps_the_running_requests(fleets):
    up = fleets[0]
    seen: list[tuple[float, float]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            m = up.node_metrics()
            seen.append((m.value("vllm:num_requests_running"), m.value("vllm:num_requests_waiting")))
            time.sleep(0.05)

    body = {"prompt": "Count with me:", "max_tokens": 10, "ignore_eos": True, "temperature": 0}
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: up.post("/v1/completions", body), range(4)))
    finally:
        done.set()
        watcher.join()
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10 for r in replies)
    assert max(running for running, _ in seen) == 2  # never more than --max-num-seqs
    assert max(waiting for _, waiting in seen) >= 1  # the others waited


def test_prefix_caching_off_reuses_nothing_and_long_prompts_go_in_chunks(fleets):
    up = fleets[0]
    for _ in range(2):  # the same ~500-token prompt twice; --max-num-batched-tokens 128 chunks it
        reply = up.post("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 2, "temperature": 0})
        assert reply.status_code == 200, reply.text
        usage = reply.json()["usage"]
        assert usage["prompt_tokens"] > 128 * 3 and usage["prompt_tokens_details"]["cached_tokens"] == 0
    assert up.node_metrics().value("vllm:prefix_cache_hits_total") == 0


def test_the_tool_call_parser_reads_calls(fleets):
    # The output is forced into llama3_json's call format; hermes (the default) would leave it as content.
    reply = fleets[0].post("/v1/chat/completions", {
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 40, "structured_outputs": {"regex": REGEX_CALL}})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert choice["finish_reason"] == "tool_calls"


def test_allowed_origins_answer_cors(fleets):
    up = fleets[0]
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    ok = httpx.options(up.url + "/v1/chat/completions", headers={"Origin": "http://app.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(up.url + "/v1/chat/completions", headers={"Origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers


def test_only_the_fleet_reaches_its_nodes_and_its_redis(fleets, tmp_path):
    """mTLS: a node refuses a caller without the fleet's certificate (none, or one of another CA); the embedded
    Redis refuses a client without the fleet's password."""
    import grpc
    import redis

    from kvrelay.common.tls import TLSFiles, make_fleet_pki
    from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
    from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

    up = fleets[0]
    address = re.search(r"gRPC (\S+),", up.banner["nodes"]).group(1)
    run = Path(up.banner["logs"])
    mine = TLSFiles(str(run / "tls" / "ca.pem"), str(run / "tls" / "gateway.pem"), str(run / "tls" / "gateway.key"))
    stranger = make_fleet_pki(tmp_path / "other-ca", ["intruder"])["intruder"]
    outsiders = [grpc.insecure_channel(address),
                 grpc.secure_channel(address, stranger.channel_credentials(), options=stranger.channel_options()),
                 grpc.secure_channel(address, grpc.ssl_channel_credentials(Path(mine.ca_file).read_bytes()),
                                     options=mine.channel_options())]  # the right CA, but no client certificate
    for channel in outsiders:
        with channel, pytest.raises(grpc.RpcError) as e:
            pb_grpc.EngineStub(channel).Reserve(pb.ReserveRequest(request_id="x", prompt_token_ids=[1] * 64),
                                                timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(address, mine.channel_credentials(), options=mine.channel_options()) as channel:
        assert pb_grpc.EngineStub(channel).GetNodeInfo(pb.NodeInfoRequest(), timeout=10).node_id == "colocated-0"
    sock = run / "redis.sock"
    if len(str(sock)) <= 100:  # else it is in /tmp (a unix socket's path must be short)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(unix_socket_path=str(sock)).ping()


def _no_traceback(up: Up) -> None:
    for path in [up.process.log_path, *up.log_dir.rglob("*.log")]:
        text = path.read_text(errors="replace")
        assert "Traceback" not in text and "CancelledError" not in text, path


def _all_gone(pids: set[int]) -> None:
    time.sleep(1.0)
    assert not [p for p in pids if alive(p)], "processes left behind"


def test_ctrl_c_mid_stream_ends_the_stream_cleanly_and_leaves_nothing(fleets):
    up = fleets[0]
    lines: list[str] = []
    streaming = threading.Event()

    def stream() -> None:
        body = {"prompt": "Tell me everything:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", up.url + "/v1/completions", json=body, headers=HEADERS, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    if len(lines) >= 3:
                        streaming.set()

    client = threading.Thread(target=stream)
    client.start()
    assert streaming.wait(120)
    pids = descendants(up.process.pid)
    assert len(pids) >= 3  # Redis, the engine, the gateway
    t0 = time.monotonic()
    up.process.send_signal(signal.SIGINT)
    refused = None
    while time.monotonic() - t0 < GRACE_S and refused is None:  # the port stays open while the stream drains
        r = up.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}, timeout=10)
        refused = r if r.status_code == 503 else None
    assert refused is not None and refused.headers["retry-after"] and refused.json()["error"]["code"]
    client.join(60)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last.get("error", {}).get("code") == "shutting_down" or last["choices"][0]["finish_reason"] == "length"
    assert up.process.wait(30) == 0
    assert time.monotonic() - t0 < GRACE_S + 5
    _all_gone(pids)
    _no_traceback(up)


def test_two_ctrl_c_kill_the_fleet_at_once_and_leave_nothing(fleets):
    up = fleets[1]
    pids = descendants(up.process.pid)
    assert len(pids) >= 3
    up.process.send_signal(signal.SIGINT)
    time.sleep(0.3)
    t0 = time.monotonic()
    up.process.send_signal(signal.SIGINT)
    assert up.process.wait(10) == 130
    assert time.monotonic() - t0 < 2.0
    _all_gone(pids)
    assert "Traceback" not in up.text

