"""One way to start and stop a kvrelay process: `kvrelay up`, the benchmarks and the tests all use it.

A child starts in a session of its own (a Ctrl-C at the terminal reaches only its parent, which then stops it
in order, and the whole group can be killed at once), with its output in a log file. Stopping is always the
same: SIGTERM to the child (it drains and stops what it started), then, after the grace period, SIGKILL to its
whole process group, so no grandchild outlives it.

    with ChildProcess.start("gateway", kvrelay_command("gateway", "--port", "8000"), log_dir=logs) as gw:
        gw.wait_ready(lambda: http_ok("http://127.0.0.1:8000/health"), timeout_s=60)
        ...
    # leaving the block: SIGTERM, then SIGKILL to the group after the grace period
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def kvrelay_command(*args: str) -> list[str]:
    """The `kvrelay` command line run by this interpreter (the same install as the caller)."""
    return [sys.executable, "-m", "kvrelay", *args]


class ProcessStartError(RuntimeError):
    """A child exited, or did not become ready in time; the message ends with the tail of its log."""


class ChildProcess:
    def __init__(self, name: str, popen: subprocess.Popen, log_path: Path) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self._terminated = False

    @classmethod
    def start(cls, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
              log_dir: str | os.PathLike | None = None, cwd: str | os.PathLike | None = None) -> ChildProcess:
        """Start argv in a new session, stdout and stderr into `<log_dir>/<name>.log` (a fresh temporary folder
        when log_dir is None). `env` is added to this process's environment."""
        folder = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvrelay-"))
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=cwd, start_new_session=True)
        return cls(name, popen, log_path)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code once the child has exited (a negative signal number if a signal ended it), else None."""
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, probe: Callable[[], T | None], timeout_s: float, interval_s: float = 0.05) -> T:
        """Poll `probe` until it returns something other than None or False, and return that. Raises
        ProcessStartError (with the log's tail) if the child exits first or `timeout_s` passes; on a timeout the
        child is stopped."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = probe()
            if result is not None and result is not False:
                return result
            if not self.alive():
                raise ProcessStartError(f"{self.name} exited with {self.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop(grace_s=2.0)
                raise ProcessStartError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(interval_s)

    def send_signal(self, sig: int) -> None:
        """Send `sig` to the child alone (SIGSTOP/SIGCONT to hang and resume it, SIGHUP, ...)."""
        if self.alive():
            self.popen.send_signal(sig)

    def terminate(self) -> None:
        """SIGTERM once: the child drains and stops what it started; a second SIGTERM would cut that short."""
        if self.alive() and not self._terminated:
            self._terminated = True
            self.popen.send_signal(signal.SIGTERM)

    def kill(self) -> int:
        """SIGKILL to the whole process group, as a crash would: no draining, no goodbye to peers."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return self.popen.wait()

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The exit code, or None if the child is still running after timeout_s."""
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 20.0) -> int:
        """SIGTERM, then SIGKILL to the group after `grace_s`; returns the exit code. Whatever the child left in
        its group (it exited without stopping a grandchild) is killed too."""
        self.terminate()
        code = self.wait(grace_s)
        if code is None:
            return self.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        return code

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
