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
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from kvrelay.common.system import die_with_parent as _die_with_parent

T = TypeVar("T")

logger = logging.getLogger(__name__)


def kvrelay_command(*args: str) -> list[str]:
    """The `kvrelay` command line run by this interpreter (the same install as the caller)."""
    return [sys.executable, "-m", "kvrelay", *args]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def freeze(pid: int, timeout_s: float = 5.0) -> None:
    """SIGSTOP a process (a hang: it keeps its sockets open and answers nothing) and return once every thread
    of it has stopped. The kernel stops the threads one after another, once one has taken the signal: until
    then, on a loaded machine, another thread may go on answering for a while."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not _all_threads_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout_s:.0f}s of SIGSTOP")
        time.sleep(0.005)


def _all_threads_stopped(pid: int) -> bool:
    try:
        states = [(task / "stat").read_text().rsplit(")", 1)[-1].split()[0]
                  for task in Path(f"/proc/{pid}/task").iterdir()]
    except (OSError, IndexError):
        return not pid_alive(pid)  # gone (or going): nothing of it runs
    return all(state in ("T", "t") for state in states)


class ProcessStartError(RuntimeError):
    """A child exited, or did not become ready in time; the message ends with the tail of its log."""


class ChildProcess:
    def __init__(self, name: str, popen: subprocess.Popen, log_path: Path) -> None:
        self.name = name
        self.popen = popen
        self.log_path = log_path
        self.log_offset = 0  # where this child's part of the log starts (the file may hold earlier runs')
        self._terminated = False

    @classmethod
    def start(cls, name: str, argv: Sequence[str], *, env: dict[str, str] | None = None,
              log_dir: str | os.PathLike | None = None, cwd: str | os.PathLike | None = None,
              die_with_parent: bool = False) -> ChildProcess:
        """Start argv in a new session, stdout and stderr appended to `<log_dir>/<name>.log` (a fresh temporary
        folder when log_dir is None). `env` is added to this process's environment. `die_with_parent`: the
        child gets SIGTERM if this process dies without stopping it (Linux; set in a preexec_fn, which is not
        safe to fork from a process whose other threads hold locks, e.g. gRPC's, so only launchers ask)."""
        folder = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="kvrelay-"))
        folder.mkdir(parents=True, exist_ok=True)
        log_path = folder / f"{name}.log"
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        preexec = _die_with_parent if die_with_parent and sys.platform.startswith("linux") else None
        with open(log_path, "ab") as log:
            offset = log.tell()
            popen = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=full_env, cwd=cwd, start_new_session=True, preexec_fn=preexec)
        child = cls(name, popen, log_path)
        child.log_offset = offset
        return child

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def argv(self) -> list[str]:
        return [str(a) for a in self.popen.args]

    @property
    def returncode(self) -> int | None:
        """The exit code once the child has exited (a negative signal number if a signal ended it), else None."""
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, probe: Callable[[], T | None], timeout_s: float, interval_s: float = 0.05) -> T:
        """Poll `probe` until it returns something other than None or False, and return that. Raises
        ProcessStartError (with the log's tail) if the child exits first or `timeout_s` passes; on a timeout the
        child is stopped. An exception from `probe` propagates."""
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
        self._kill_group()
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
            logger.warning("%s did not exit within %.1f s of SIGTERM; killing its process group", self.name, grace_s)
            return self.kill()
        self._kill_group()
        return code

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def log_text(self) -> str:
        """What this child wrote to its log (not what an earlier run appended to the same file); "" without one."""
        return self._own_log() or ""

    def log_tail(self, lines: int = 40) -> str:
        """The last lines this child wrote."""
        text = self._own_log()
        return "(no log)" if text is None else "\n".join(text.splitlines()[-lines:])

    def _own_log(self) -> str | None:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return None

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(children: Iterable[ChildProcess], grace_s: float = 20.0) -> list[int]:
    """SIGTERM every child at once (their drains overlap), then stop each by one common deadline; returns the
    exit codes in order."""
    children = list(children)
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace_s
    return [child.stop(max(0.1, deadline - time.monotonic())) for child in children]


def kill_all(children: Iterable[ChildProcess], wait_s: float = 1.0) -> None:
    """SIGKILL every child's whole process group at once, then reap each within `wait_s` (a bounded wait, so
    this may run in a signal handler that interrupted a wait on one of them)."""
    children = list(children)
    for child in children:
        child._kill_group()
    deadline = time.monotonic() + wait_s
    for child in children:
        child.wait(max(0.0, deadline - time.monotonic()))
