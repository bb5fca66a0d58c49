"""`kvrelay up` end to end: the fleet comes up with the default model, the printed URL serves a real chat
completion through the official OpenAI client, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import re
import signal
import time

import pytest

from kvrelay.common.process import ChildProcess, kvrelay_command
from kvrelay.common.system import free_port
from tests.helpers.procs import alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_up_serves_chat_and_stops_cleanly(default_model_dir, tmp_path):
    port, grpc_port = free_port(), free_port()
    # Disaggregated explicitly: on a machine under 4 cores the default is one colocated engine.
    cmd = kvrelay_command("up", "--model", "default", "--prefill", "1", "--decode", "1", "--port", str(port),
                          "--grpc-port", str(grpc_port), "--kv-cache-memory", str(256 * 2**20),
                          "--shutdown-timeout", "5")
    up = ChildProcess.start("up", cmd, log_dir=tmp_path)
    try:
        url = up.wait_ready(lambda: _banner_url(up), timeout_s=360, interval_s=0.5)
        assert url == f"http://127.0.0.1:{port}/v1"
        children = descendants(up.pid)
        assert len(children) >= 4  # redis, prefill, decode, gateway
        import httpx

        health = httpx.get(url.removesuffix("/v1") + "/health", timeout=5).json()
        assert health["prefill_nodes"] == 1 and health["decode_nodes"] == 1  # ready means routable, at once

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
    finally:
        children = descendants(up.pid)
        up.send_signal(signal.SIGINT)  # Ctrl-C: `up` stops its fleet in order
        code = up.wait(60)
        up.stop(grace_s=5)  # (a no-op once it has exited, but for its process group)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in children):
        time.sleep(0.2)
    assert not [p for p in children if alive(p)], "processes left behind"
    assert code == 0, up.log_tail()


def _banner_url(up: ChildProcess) -> str | None:
    found = re.search(r"OpenAI base URL : (\S+)", up.log_path.read_text(errors="replace"))
    return found.group(1) if found else None
