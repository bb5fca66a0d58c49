"""The benchmarks' child servers: a real HTTP server process is started, found ready and stopped."""

from __future__ import annotations

import sys

import httpx
import pytest

from kvrelay.bench.server_process import HttpServerProcess
from kvrelay.common.system import free_port
from tests.helpers.procs import alive


def test_an_http_server_is_ready_once_its_health_url_answers_and_stops_on_exit(tmp_path):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path / "www")]
    with HttpServerProcess(argv, f"http://127.0.0.1:{port}/health", tmp_path / "server.log", 30.0) as server:
        assert httpx.get(f"http://127.0.0.1:{port}/health").text == "ok"
        pid = server.proc.pid
    assert not alive(pid)
    assert server.proc.returncode is not None


def test_a_server_that_exits_early_fails_with_its_log_tail(tmp_path):
    argv = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match=r"exited with 3:\nno model here"):
        with HttpServerProcess(argv, f"http://127.0.0.1:{free_port()}/health", tmp_path / "s.log", 30.0):
            pass


def test_a_server_never_ready_times_out_and_is_stopped(tmp_path):
    argv = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    server = HttpServerProcess(argv, f"http://127.0.0.1:{free_port()}/health", tmp_path / "s.log", 1.5)
    with pytest.raises(TimeoutError, match="not ready within 1.5 s:\nloading"):
        server.__enter__()
    assert server.proc.returncode is not None and not alive(server.proc.pid)
