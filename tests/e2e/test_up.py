"""`kvrelay up` end to end, disaggregated (one prefill and one decode node, KV over the auto connector): the fleet
comes up with the default model, the printed URL serves a real chat completion through the official OpenAI client,
the printed metrics URL carries both nodes' vLLM series, and an idle fleet stops on Ctrl-C within 3 s, leaving no
process behind and no traceback. (A colocated fleet, and everything else a newcomer meets: test_newcomer.py.)"""

from __future__ import annotations

import re
import signal
import time

import httpx
import pytest

from kvrelay.common.process import ChildProcess, kvrelay_command
from kvrelay.common.prometheus import Metrics
from kvrelay.common.system import free_port
from tests.helpers.procs import alive, descendants

pytestmark = pytest.mark.timeout(420)

IDLE_STOP_S = 3.0


def test_up_serves_chat_and_stops_cleanly(default_model_dir, tmp_path):
    port = free_port()
    # Disaggregated explicitly: on a machine under 4 cores the default is one colocated engine.
    cmd = kvrelay_command("up", "--model", "default", "--prefill", "1", "--decode", "1", "--port", str(port),
                          "--kv-cache-memory", "256MiB", "--log-dir", str(tmp_path / "logs"))
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

        time.sleep(1.0)  # idle
        children = descendants(up.pid)
        assert len(children) >= 4  # redis, prefill, decode, gateway
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
