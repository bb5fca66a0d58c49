"""Where `kvrelay up` keeps its logs: one folder per run (every child's log, the embedded Redis's socket and log)
under --log-dir, by default the per-user state folder ($XDG_STATE_HOME/kvrelay/logs, else
~/.local/state/kvrelay/logs). Each run keeps the newest --keep-logs runs and removes older ones, except a run
still going: a run holds a lock on its folder for as long as it lives, so fleets started side by side never
remove each other's logs.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import shutil
import time
from pathlib import Path

PREFIX = "up-"
_LOCK = ".lock"


def default_log_root() -> Path:
    state = os.environ.get("XDG_STATE_HOME")
    return (Path(state).expanduser() if state else Path.home() / ".local" / "state") / "kvrelay" / "logs"


class RunLogs:
    """This run's log folder, locked while the run lives."""

    def __init__(self, path: Path, lock_fd: int) -> None:
        self.path = path
        self._lock_fd = lock_fd

    @classmethod
    def create(cls, root: str | os.PathLike | None, keep: int) -> RunLogs:
        """A fresh folder `up-<date>-<time>-<pid>` under `root` (default_log_root() if None), locked; then the
        runs past the newest `keep` (this one included) that no live run holds are removed."""
        base = Path(root).expanduser() if root else default_log_root()
        base.mkdir(parents=True, exist_ok=True)
        stem = f"{PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for n in itertools.count(1):
            path = base / (stem if n == 1 else f"{stem}-{n}")
            try:
                path.mkdir()
                break
            except FileExistsError:
                continue
        fd = os.open(path / _LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        prune(base, keep)
        return cls(path, fd)

    def close(self) -> None:
        """Release the folder (the logs stay, for the next runs to prune)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def prune(root: Path, keep: int) -> list[Path]:
    """Remove the run folders under `root` older than the newest `keep`, but those a live run holds; returns
    what was removed."""
    runs = sorted(p for p in root.glob(f"{PREFIX}*") if p.is_dir())  # named by start time: oldest first
    removed = []
    for run in runs[: max(0, len(runs) - keep)]:
        if _held(run):
            continue
        shutil.rmtree(run, ignore_errors=True)
        removed.append(run)
    return removed


def _held(run: Path) -> bool:
    """Whether a live run holds `run`'s lock (a folder without a lock file is no run's)."""
    try:
        fd = os.open(run / _LOCK, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock we took
    return False
