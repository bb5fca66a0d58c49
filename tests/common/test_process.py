"""ChildProcess, the one launcher: a child in its own session with its log in a file; ready when a probe says so;
stopped with SIGTERM, then SIGKILL to its whole process group, so nothing it started outlives it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from kvrelay.common.process import (
    ChildProcess,
    ProcessStartError,
    freeze,
    kill_all,
    kvrelay_command,
    pid_alive,
    stop_all,
)

PY = sys.executable


def _py(code: str) -> list[str]:
    return [PY, "-c", code]


# Prints its pid, then waits for SIGTERM; `ignore` leaves it deaf to SIGTERM; `grandchild` starts a `sleep` that
# does not die with it, and prints that one's pid too.
SERVER = """
import os, signal, subprocess, sys, time
ignore, grandchild = {ignore}, {grandchild}
signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else lambda *a: sys.exit(3))
if grandchild:
    print("grandchild", subprocess.Popen(["sleep", "60"]).pid, flush=True)
print("ready", os.getpid(), flush=True)
while True:
    time.sleep(0.05)
"""


def _server(tmp_path, name: str = "server", ignore: bool = False, grandchild: bool = False) -> ChildProcess:
    child = ChildProcess.start(name, _py(SERVER.format(ignore=ignore, grandchild=grandchild)), log_dir=tmp_path)
    child.wait_ready(lambda: "ready" in child.log_path.read_text(), timeout_s=30)
    return child


def _logged(child: ChildProcess, word: str) -> int:
    line = next(line for line in child.log_path.read_text().splitlines() if line.startswith(word))
    return int(line.split()[1])


def test_a_child_runs_in_its_own_session_with_its_log_and_environment(tmp_path):
    child = ChildProcess.start("env", _py("import os; print(os.environ['KVRELAY_X'], os.getsid(0) == os.getpid())"),
                               env={"KVRELAY_X": "forty-two"}, log_dir=tmp_path, cwd=tmp_path)
    assert child.wait(30) == 0 and child.returncode == 0 and not child.alive()
    assert child.log_path == tmp_path / "env.log"
    assert child.log_tail() == "forty-two True"
    assert child.argv[0] == PY


def test_stop_is_sigterm_first(tmp_path):
    child = _server(tmp_path)
    assert child.alive() and _logged(child, "ready") == child.pid
    assert child.stop(grace_s=10) == 3  # its SIGTERM handler ran
    assert not pid_alive(child.pid)


def test_stop_kills_a_child_deaf_to_sigterm_and_its_whole_group(tmp_path):
    child = _server(tmp_path, ignore=True, grandchild=True)
    grandchild = _logged(child, "grandchild")
    assert pid_alive(grandchild)
    t0 = time.monotonic()
    assert child.stop(grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 10
    _gone(grandchild)


def test_a_grandchild_left_behind_by_a_clean_exit_is_killed_too(tmp_path):
    child = _server(tmp_path, grandchild=True)
    grandchild = _logged(child, "grandchild")
    assert child.stop(grace_s=10) == 3
    _gone(grandchild)


SPINNERS = """
import os, threading
def spin():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("ready", os.getpid(), flush=True)
spin()
"""


def test_freeze_returns_once_every_thread_has_stopped(tmp_path):
    child = ChildProcess.start("spinners", _py(SPINNERS), log_dir=tmp_path)
    try:
        child.wait_ready(lambda: "ready" in child.log_path.read_text(), timeout_s=30)
        freeze(child.pid)
        tasks = list((Path("/proc") / str(child.pid) / "task").iterdir())
        assert len(tasks) == 4
        assert {(t / "stat").read_text().rsplit(")", 1)[-1].split()[0] for t in tasks} == {"T"}
        child.send_signal(signal.SIGCONT)
    finally:
        child.kill()


def test_kill_is_sigkill_to_the_group(tmp_path):
    child = _server(tmp_path, grandchild=True)
    assert child.kill() == -signal.SIGKILL
    _gone(_logged(child, "grandchild"))
    child.terminate()  # no-ops on an exited child
    child.send_signal(signal.SIGTERM)


def test_kill_all_kills_every_group_at_once_even_the_deaf(tmp_path):
    children = [_server(tmp_path, "a", grandchild=True), _server(tmp_path, "deaf", ignore=True)]
    grandchild = _logged(children[0], "grandchild")
    t0 = time.monotonic()
    kill_all(children)
    assert time.monotonic() - t0 < 1.5
    assert [c.returncode for c in children] == [-signal.SIGKILL, -signal.SIGKILL]  # reaped, no drain
    _gone(grandchild)


def test_stop_all_overlaps_the_drains(tmp_path):
    children = [_server(tmp_path, f"s{i}") for i in range(2)]
    deaf = _server(tmp_path, "deaf", ignore=True)
    t0 = time.monotonic()
    assert stop_all([*children, deaf], grace_s=1.0) == [3, 3, -signal.SIGKILL]
    assert time.monotonic() - t0 < 8  # one common deadline, not a grace period each


def test_wait_ready_returns_what_the_probe_found(tmp_path):
    child = _server(tmp_path)
    try:
        assert child.wait_ready(lambda: _logged(child, "ready"), timeout_s=5) == child.pid
    finally:
        child.stop()


def test_wait_ready_reports_an_exit_with_the_log(tmp_path):
    child = ChildProcess.start("crash", _py("print('cannot start: port taken'); raise SystemExit(7)"),
                               log_dir=tmp_path)
    with pytest.raises(ProcessStartError, match=r"crash exited with 7:\ncannot start: port taken"):
        child.wait_ready(lambda: False, timeout_s=30)


def test_wait_ready_times_out_and_stops_the_child(tmp_path):
    child = _server(tmp_path)
    with pytest.raises(ProcessStartError, match="server not ready after 0 s"):
        child.wait_ready(lambda: None, timeout_s=0.2)
    assert not child.alive() and child.returncode == 3


def test_the_context_manager_stops_the_child(tmp_path):
    with _server(tmp_path) as child:
        pid = child.pid
    assert not pid_alive(pid)


def test_log_tail_of_a_missing_log(tmp_path):
    child = _server(tmp_path)
    child.stop()
    child.log_path.unlink()
    assert child.log_tail() == "(no log)"


def test_pid_alive(tmp_path):
    assert pid_alive(os.getpid())
    child = ChildProcess.start("quick", ["true"], log_dir=tmp_path)
    pid = child.pid
    time.sleep(0.5)  # exited, not reaped: a zombie counts as gone
    assert not pid_alive(pid)
    child.wait(10)
    assert not pid_alive(pid)


def test_kvrelay_command_runs_this_install():
    assert kvrelay_command("up", "--help") == [sys.executable, "-m", "kvrelay", "up", "--help"]


def _gone(pid: int) -> None:
    deadline = time.monotonic() + 5
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"{pid} outlived its parent's stop"
        time.sleep(0.05)


def test_a_child_reads_only_its_own_part_of_an_appended_log(tmp_path):
    """A log folder reused by a second run: the first run's lines are not the second child's (a readiness probe
    looking for a banner must not find the last run's)."""
    say = [sys.executable, "-c", "import sys; print(sys.argv[1])"]
    first = ChildProcess.start("job", [*say, "first run is up"], log_dir=tmp_path)
    first.popen.wait(30)
    second = ChildProcess.start("job", [*say, "second"], log_dir=tmp_path)
    second.popen.wait(30)
    assert "first run is up" in second.log_path.read_text()
    assert second.log_text() == "second\n" and second.log_tail() == "second"
    assert first.log_text() == "first run is up\nsecond\n"
