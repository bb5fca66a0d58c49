"""`kvrelay up` end to end: the fleet comes up with the default model, the printed URL serves a real chat
completion through the official OpenAI client, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from kvrelay.common.system import free_port
from tests.helpers.procs import alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


def test_up_serves_chat_and_stops_cleanly(default_model_dir, tmp_path):
    port, grpc_port = free_port(), free_port()
    # Disaggregated explicitly: on a machine under 4 cores the default is one colocated engine.
    cmd = [sys.executable, "-m", "kvrelay.cli", "up", "--model", "default", "--prefill", "1", "--decode", "1",
           "--port", str(port), "--grpc-port", str(grpc_port), "--kv-cache-memory", str(256 * 2**20),
           "--shutdown-timeout", "5"]
    log = open(tmp_path / "up.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        url = _wait_for_banner(proc, log, timeout=360)
        assert url == f"http://127.0.0.1:{port}/v1"
        children = descendants(proc.pid)
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
        children = descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        log.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in children):
        time.sleep(0.2)
    assert not [p for p in children if alive(p)], "processes left behind"
    assert proc.returncode == 0


def _wait_for_banner(proc: subprocess.Popen, log, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log.seek(0)
        text = log.read()
        m = re.search(r"OpenAI base URL : (\S+)", text)
        if m:
            return m.group(1)
        if proc.poll() is not None:
            raise AssertionError(f"kvrelay up exited with {proc.returncode}:\n{text[-4000:]}")
        time.sleep(0.5)
    log.seek(0)
    raise AssertionError(f"no banner within {timeout}s:\n{log.read()[-4000:]}")
