"""A benchmark's server under test, started as a child process in its own session.

Lifecycle:
1. `with Subclass(...) as server:` starts the command, its output to a log file, in a new session (so the
   server's own children share its process group).
2. `__enter__` polls `is_ready()` until it holds, the child exits (an error with the log's tail) or the
   ready timeout passes (stopped, then an error).
3. `stop()` (also on leaving the block) sends SIGTERM, waits for a drain, then SIGKILLs the whole group.
"""

from __future__ import annotations

import abc
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)


class ServerProcess(abc.ABC):
    """One child server; a context manager that always stops it. Subclasses say when it is ready."""

    def __init__(self, argv: Sequence[str], log_path: Path, ready_timeout: float,
                 env: dict[str, str] | None = None) -> None:
        self.argv, self.env = list(argv), env
        self.log_path, self.ready_timeout = log_path, ready_timeout
        self.proc: subprocess.Popen | None = None

    @abc.abstractmethod
    def is_ready(self) -> bool:
        """Whether the server takes requests now (polled while it starts)."""

    def __enter__(self):
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting: %s (log: %s)", shlex.join(self.argv), self.log_path)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode}:\n{self.tail()}")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"not ready within {self.ready_timeout:g} s:\n{self.tail()}")

    def stop(self, timeout_s: float = 90.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)  # both servers drain and stop their own children on SIGTERM
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %g s; killing its process group", self.argv[0], timeout_s)
        # Children that outlive their parent (an engine core, a worker) go with the group.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class HttpServerProcess(ServerProcess):
    """Ready once GET `health_url` answers 200."""

    def __init__(self, argv: Sequence[str], health_url: str, log_path: Path, ready_timeout: float,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(argv, log_path, ready_timeout, env)
        self.health_url = health_url

    def is_ready(self) -> bool:
        try:
            return httpx.get(self.health_url, timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False
