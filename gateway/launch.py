"""Run `kvrelay gateway` as its own process, for benchmarks and tests (a load generator must not share the
gateway's GIL): picks a free port, waits until /health lists the expected nodes, stops with SIGTERM.

    with GatewayProcess(["--model", path, "--redis-url", url], num_nodes=5) as gw:
        httpx.get(gw.url + "/v1/models")
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvrelay.common.system import free_port


class GatewayProcess:
    def __init__(self, argv: list[str], num_nodes: int = 1, timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = ["--port", str(self.port), *argv]
        self.num_nodes = num_nodes
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> GatewayProcess:
        self.log = tempfile.NamedTemporaryFile(prefix="kvrelay-gateway-", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "--log-level", "WARNING", "gateway",
                                      *self.argv], stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self._ready():
                return self
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"gateway not ready; log:\n{self.log_tail()}")

    def _ready(self) -> bool:
        try:
            health = httpx.get(self.url + "/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        return health.get("prefill_nodes", 0) + health.get("decode_nodes", 0) >= self.num_nodes

    def log_tail(self, chars: int = 3000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def scrape(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value}."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (the gateway drains), then SIGKILL after timeout_s; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.stop()
