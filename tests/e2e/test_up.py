"""`kvrelay up` end to end, disaggregated (one prefill and one decode node, KV over the auto connector, two gateways
on one port): the fleet comes up with the default model, the printed URL serves a real chat completion through the
official OpenAI client, the printed metrics URL carries both nodes' vLLM series, a rolling restart (SIGHUP) under
load replaces every process, both gateways included, without a failed request or a changed greedy answer, and an
idle fleet stops on Ctrl-C within 3 s, leaving no process behind and no traceback. (A colocated fleet, and
everything else a newcomer meets: test_newcomer.py.)"""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest

from kvrelay.common.process import ChildProcess, kvrelay_command
from kvrelay.common.prometheus import Metrics
from kvrelay.common.system import free_port
from tests.helpers.procs import alive, descendants

pytestmark = pytest.mark.timeout(420)

IDLE_STOP_S = 3.0


def test_up_serves_chat_rolls_and_stops_cleanly(default_model_dir, tmp_path):
    port = free_port()
    # Disaggregated explicitly: on a machine under 4 cores the default is one colocated engine.
    cmd = kvrelay_command("up", "--model", "default", "--prefill", "1", "--decode", "1", "--gateways", "2",
                          "--port", str(port), "--kv-cache-memory", "256MiB", "--log-dir", str(tmp_path / "logs"))
    up = ChildProcess.start("up", cmd, log_dir=tmp_path)
    code = None
    try:
        url = up.wait_ready(lambda: _banner(up, "OpenAI base URL"), timeout_s=360, interval_s=0.5)
        assert url == f"http://127.0.0.1:{port}/v1"
        health = httpx.get(url.removesuffix("/v1") + "/health", timeout=5).json()
        assert health["prefill_nodes"] == 1 and health["decode_nodes"] == 1  # ready means routable, at once
        assert {n["node_id"]: n["role"] for n in health["nodes"]} == {"prefill-0": "prefill", "decode-0": "decode"}

        from openai import OpenAI

        client = OpenAI(base_url=url, api_key="unused")
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12, temperature=0,
        )
        text = reply.choices[0].message.content
        assert text and re.search(r"[A-Za-z]{3}", text)
        assert reply.usage.completion_tokens > 0

        metrics = Metrics.scrape(_banner(up, "metrics").split()[0])
        for node, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
            assert metrics.select("vllm:num_requests_running", node_id=node, role=role)
            assert metrics.select("vllm:kv_cache_usage_perc", node_id=node, role=role)
        # A prompt this short is computed on the decode node itself (--local-prefill-threshold): counted there.
        assert metrics.value("vllm:time_to_first_token_seconds_count", node_id="decode-0") >= 1

        _roll_under_load(up, client, model)

        time.sleep(1.0)  # idle
        children = descendants(up.pid)
        assert len(children) >= 5  # redis, prefill, decode, two gateways
        t0 = time.monotonic()
        up.send_signal(signal.SIGINT)  # Ctrl-C: `up` stops its fleet in order
        code = up.wait(60)
        stopped_in = time.monotonic() - t0
    finally:
        up.stop(grace_s=5)  # (a no-op once it has exited, but for its process group)
    time.sleep(1.0)
    assert not [p for p in children if alive(p)], "processes left behind"
    assert code == 0, up.log_tail()
    assert stopped_in <= IDLE_STOP_S, f"an idle fleet took {stopped_in:.1f} s to stop"
    for path in [up.log_path, *(tmp_path / "logs").rglob("*.log")]:
        assert "Traceback" not in path.read_text(errors="replace"), path


def _banner(up: ChildProcess, field: str) -> str | None:
    found = re.search(rf"^  {field} +: (\S+)", up.log_path.read_text(errors="replace"), re.MULTILINE)
    return found.group(1) if found else None


def _roll_under_load(up: ChildProcess, client, model: str) -> None:
    """SIGHUP while two clients (one streaming) send greedy requests back to back: every process is replaced one
    at a time, every request succeeds (the SDK's own retries allowed), and every answer is the one the fleet gave
    before the restart."""
    prompts = [f"Count from {i} to {i + 30}, one number per line." for i in (1, 50)]

    def ask(prompt: str, stream: bool) -> str:
        kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=24, temperature=0)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)

    expected = {p: ask(p, False) for p in prompts}
    started = dict(re.findall(r"started (\S+) \(pid (\d+)\)", up.log_path.read_text(errors="replace")))
    assert set(started) == {"prefill-0", "decode-0", "gateway-0", "gateway-1"}
    answers, errors, stop = [], [], threading.Event()

    def client_loop(k: int) -> None:
        while not stop.is_set():
            prompt = prompts[(len(answers) + k) % 2]
            try:
                answers.append((prompt, ask(prompt, stream=k == 0), time.monotonic()))
            except Exception as e:  # every failure is what the test counts
                errors.append(repr(e))

    threads = [threading.Thread(target=client_loop, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)
        rolled_at = time.monotonic()
        up.send_signal(signal.SIGHUP)
        up.wait_ready(lambda: "rolling restart done" in up.log_path.read_text(errors="replace") or None,
                      timeout_s=240, interval_s=0.5)
        done_at = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert [a for a in answers if a[1] != expected[a[0]]] == []
    assert sum(rolled_at <= t <= done_at for _, _, t in answers) >= 4  # requests were served through the roll
    health = httpx.get(_banner(up, "OpenAI base URL").removesuffix("/v1") + "/health", timeout=5).json()
    assert sorted(n["node_id"] for n in health["nodes"] if n["routable"]) == ["decode-0-r2", "prefill-0-r1"]
    successors = dict(re.findall(r"started (\S+) \(pid (\d+)\)", up.log_path.read_text(errors="replace")))
    assert {"gateway-0-r3", "gateway-1-r4"} <= set(successors), successors  # one at a time, each replaced
    assert all(alive(int(successors[name])) for name in ("gateway-0-r3", "gateway-1-r4"))
    assert not [name for name, pid in started.items() if alive(int(pid))], "a replaced process is still running"
