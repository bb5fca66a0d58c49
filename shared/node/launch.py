"""Start node processes and talk to them: for tests and benchmarks.

    with NodeProcess.start("decode", ["--model", path, "--connector", "ucx"]) as node:
        stub = node.stub()
        ...

Each node runs as `python -m kvrelay.cli <role>` (`kvrelay <role>`) in its own session with its log in a
file; `start` waits for the node's ready file (so the addresses are known even with port 0); `stop` sends
SIGTERM, waits, and kills what does not exit. Several nodes start in parallel with `start_many`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]


class NodeStartError(RuntimeError):
    pass


@dataclass
class NodeProcess:
    role: str
    proc: subprocess.Popen
    log_path: Path
    ready_path: Path
    info: dict = field(default_factory=dict)
    _channel: grpc.Channel | None = None
    _terminated: bool = False

    @classmethod
    def spawn(cls, role: str, argv: list[str], env: dict[str, str] | None = None,
              log_dir: str | None = None, log_level: str = "INFO") -> NodeProcess:
        folder = Path(log_dir or tempfile.mkdtemp(prefix="kvrelay-node-"))
        fd, name = tempfile.mkstemp(prefix=f"{role}-", suffix=".log", dir=folder)
        os.close(fd)
        log_path, ready = Path(name), Path(name).with_suffix(".ready.json")
        cmd = [sys.executable, "-m", "kvrelay.cli", "--log-level", log_level, role, "--port", "0",
               "--ready-file", str(ready), *argv]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=ROOT,
                                    start_new_session=True)
        return cls(role, proc, log_path, ready)

    @classmethod
    def start(cls, role: str, argv: list[str], env: dict[str, str] | None = None,
              timeout: float = 120.0) -> NodeProcess:
        node = cls.spawn(role, argv, env)
        node.wait_ready(timeout)
        return node

    @staticmethod
    def start_many(specs: list[tuple[str, list[str]]], env: dict[str, str] | None = None,
                   timeout: float = 120.0) -> list[NodeProcess]:
        nodes = [NodeProcess.spawn(role, argv, env) for role, argv in specs]
        try:
            for node in nodes:
                node.wait_ready(timeout)
        except BaseException:
            for node in nodes:
                node.stop(grace=2.0)
            raise
        return nodes

    def wait_ready(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not self.ready_path.exists():
            if self.proc.poll() is not None:
                raise NodeStartError(f"{self.role} node exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop(grace=2.0)
                raise NodeStartError(f"{self.role} node not ready after {timeout:.0f}s:\n{self.log_tail()}")
            time.sleep(0.05)
        self.info = json.loads(self.ready_path.read_text())
        return self.info

    @property
    def address(self) -> str:
        return self.info["grpc_address"]

    @property
    def metrics_url(self) -> str:
        return f"http://{self.info['metrics_address']}/metrics"

    def stub(self) -> pb_grpc.EngineStub:
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.address)
        return pb_grpc.EngineStub(self._channel)

    def load(self) -> pb.Load:
        return self.stub().GetLoad(pb.LoadRequest(), timeout=5)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, as a crash would: no draining, no goodbye to peers."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM once: the node drains; a second one would only interrupt that."""
        if self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace: float = 20.0) -> int:
        """SIGTERM, then SIGKILL after `grace` seconds; returns the exit code."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self.terminate()
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def __enter__(self) -> NodeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
