"""Real processes for the tests: nodes and the gateway started as `kvrelay prefill|decode|gateway` on
kvrelay.common.process.ChildProcess (own session, log file, SIGTERM then SIGKILL to the group), and the checks
that prove nothing was left running.

    with NodeProcess.launch("decode", ["--model", path, "--connector", "ucx"]) as node:
        node.stub().GetLoad(...)
    with GatewayProcess.launch(["--model", path, "--decode", node.address]) as gw:
        httpx.get(gw.url + "/v1/models")
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import grpc
import httpx

from kvrelay.common.process import ChildProcess, kvrelay_command, stop_all
from kvrelay.common.process import pid_alive as alive
from kvrelay.common.prometheus import Metrics
from kvrelay.common.system import free_port
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

# Where the processes' log folders go: tests/conftest.py points it into pytest's own temporary folder, which
# pytest prunes (the last three runs are kept); None: the system's temporary folder.
LOG_ROOT: Path | None = None


def log_folder(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=LOG_ROOT))

__all__ = ["GatewayProcess", "NodeProcess", "alive", "descendants"]

ROOT = Path(__file__).resolve().parents[2]


class NodeProcess(ChildProcess):
    """A node on port 0 (so any number run at once); its addresses come from its ready file."""

    def __init__(self, name: str, popen: subprocess.Popen, log_path: Path) -> None:
        super().__init__(name, popen, log_path)
        self.role = name
        self.ready_path = log_path.with_suffix(".ready.json")
        self.info: dict = {}
        self._channel: grpc.Channel | None = None

    @classmethod
    def spawn(cls, role: str, argv: list[str], env: dict[str, str] | None = None,
              log_level: str = "INFO") -> NodeProcess:
        """Start the node without waiting for it; `ready` waits."""
        folder = log_folder(f"{role}-")
        cmd = kvrelay_command("--log-level", log_level, role, "--port", "0",
                              "--ready-file", str(folder / f"{role}.ready.json"), *argv)
        return cls.start(role, cmd, env=env, log_dir=folder, cwd=ROOT)

    @classmethod
    def launch(cls, role: str, argv: list[str], env: dict[str, str] | None = None,
               timeout_s: float = 120.0) -> NodeProcess:
        node = cls.spawn(role, argv, env)
        node.ready(timeout_s)
        return node

    @classmethod
    def start_many(cls, specs: list[tuple[str, list[str]]], env: dict[str, str] | None = None,
                   timeout: float = 120.0) -> list[NodeProcess]:
        """Start (role, argv) nodes at once (their model loads overlap) and wait for all; on a failure, stop all."""
        nodes = [cls.spawn(role, argv, env) for role, argv in specs]
        try:
            for node in nodes:
                node.ready(timeout)
        except BaseException:
            stop_all(nodes, grace_s=2.0)
            raise
        return nodes

    def ready(self, timeout_s: float) -> dict:
        """Wait for the ready file (ProcessStartError if the node exits or time runs out); its contents."""
        self.info = json.loads(self.wait_ready(self._ready_text, timeout_s))
        return self.info

    def _ready_text(self) -> str | None:
        return self.ready_path.read_text() if self.ready_path.exists() else None

    @property
    def proc(self) -> subprocess.Popen:
        """The Popen, for tests that signal or poll the node itself (SIGSTOP, SIGCONT)."""
        return self.popen

    @property
    def address(self) -> str:
        return self.info["grpc_address"]

    @property
    def metrics_url(self) -> str:
        return f"http://{self.info['metrics_address']}/metrics"

    def metrics(self) -> Metrics:
        return Metrics.scrape(self.metrics_url, timeout_s=5)

    def stub(self) -> pb_grpc.EngineStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return pb_grpc.EngineStub(self._channel)

    def load(self) -> pb.Load:
        return self.stub().GetLoad(pb.LoadRequest(), timeout=5)

    def stop(self, grace_s: float = 20.0) -> int:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        return super().stop(grace_s)


class GatewayProcess(ChildProcess):
    """`kvrelay gateway` on a free port (a load generator must not share the gateway's GIL)."""

    def __init__(self, name: str, popen: subprocess.Popen, log_path: Path) -> None:
        super().__init__(name, popen, log_path)
        self.url = ""

    @classmethod
    def launch(cls, argv: list[str], num_nodes: int = 1, timeout_s: float = 120.0) -> GatewayProcess:
        """Start it and wait until /health counts `num_nodes` nodes."""
        port = free_port()
        gw = cls.start("gateway", kvrelay_command("--log-level", "WARNING", "gateway", "--port", str(port), *argv),
                       log_dir=log_folder("gateway-"))
        gw.url = f"http://127.0.0.1:{port}"
        gw.wait_ready(lambda: gw.num_nodes() >= num_nodes, timeout_s, interval_s=0.2)
        return gw

    def num_nodes(self) -> int:
        """Prefill and decode nodes in /health (0 while it does not answer)."""
        try:
            health = httpx.get(self.url + "/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return 0
        return health.get("prefill_nodes", 0) + health.get("decode_nodes", 0)

    def metrics(self) -> Metrics:
        return Metrics.scrape(self.url + "/metrics")


def descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,sid="], capture_output=True, text=True).stdout
    rows = [tuple(int(x) for x in line.split()) for line in out.splitlines() if line.strip()]
    kids, frontier = set(), {pid}
    while frontier:
        nxt = {p for p, pp, _ in rows if pp in frontier} - kids
        kids |= nxt
        frontier = nxt
    return kids
