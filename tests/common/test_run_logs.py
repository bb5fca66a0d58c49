"""`kvrelay up` logs each run into a folder of its own under --log-dir (a per-user state folder by default) and
keeps the newest --keep-logs runs, never removing one that a live fleet still holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvrelay.cli.run_logs import RunLogs, default_log_root, prune


def test_the_default_root_is_the_per_user_state_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert default_log_root() == tmp_path / "kvrelay" / "logs"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_log_root() == Path.home() / ".local" / "state" / "kvrelay" / "logs"


def test_a_run_keeps_the_newest_runs_and_removes_older_ones(tmp_path):
    old = [tmp_path / f"up-20260101-00000{i}-1" for i in range(4)]
    for folder in old:
        folder.mkdir()
        (folder / "gateway.log").write_text("x")
    (tmp_path / "unrelated").mkdir()
    run = RunLogs.create(tmp_path, keep=3)
    try:
        assert run.path.parent == tmp_path and run.path.name.startswith("up-") and run.path.is_dir()
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == sorted([old[2].name, old[3].name, run.path.name, "unrelated"])
    finally:
        run.close()


def test_a_run_that_is_still_going_is_never_removed(tmp_path):
    live = RunLogs.create(tmp_path, keep=1)
    try:
        later = RunLogs.create(tmp_path, keep=1)  # would remove the first, but a live run holds it
        assert live.path.is_dir() and later.path.is_dir()
        later.close()
        # Another process (a second fleet) sees the lock too.
        code = (f"from pathlib import Path; from kvrelay.cli.run_logs import prune; "
                f"print([p.name for p in prune(Path({str(tmp_path)!r}), 1)])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        assert live.path.name not in out and live.path.is_dir()
    finally:
        live.close()
    assert prune(tmp_path, 1) == [live.path]  # released: now it goes, oldest first
