"""Loading the native kernels after a loader was killed: torch's lock file left in the build folder must not
hang the next process (it waited forever for the file to go)."""

import subprocess
import sys

import pytest

from shared.engine import kernels as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no native kernels on this machine")


def test_a_lock_file_left_by_a_killed_loader_is_cleared():
    stale = cpu_kernels._build_dir() / "lock"
    stale.touch()  # what torch's FileBaton leaves when its process is SIGKILLed mid-load
    code = "from shared.engine import kernels; assert kernels.load() is not None"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "left by a kernel build that was killed" in done.stderr
    assert not stale.exists()
