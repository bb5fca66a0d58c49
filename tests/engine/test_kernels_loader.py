"""Loading the native kernels after a loader was killed: torch's lock file left in the build folder must not
hang the next process (it waited forever for the file to go)."""

import os
import shutil
import subprocess
import sys

import pytest

from kvrelay.engine import kernels as cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no native kernels on this machine")


def test_a_lock_file_left_by_a_killed_loader_is_cleared(tmp_path, monkeypatch):
    # A build folder of the test's own (a copy of the built one, so nothing is rebuilt): a node starting in
    # another test meanwhile would clear a stale lock in the shared folder first, and log it in its own log.
    built = cpu_kernels._build_dir()
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path))
    own = cpu_kernels._build_dir()
    shutil.copytree(built, own, dirs_exist_ok=True, ignore=shutil.ignore_patterns("lock", "load.flock"))
    stale = own / "lock"
    stale.touch()  # what torch's FileBaton leaves when its process is SIGKILLed mid-load
    code = "from kvrelay.engine import kernels; assert kernels.load() is not None"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "KVRELAY_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert "left by a kernel build that was killed" in done.stderr
    assert not stale.exists()


def test_kv_prefetch_target_follows_the_vendor_unless_overridden(monkeypatch):
    from kvrelay.engine import auto_dtype

    monkeypatch.delenv("KVRELAY_KV_PREFETCH", raising=False)
    monkeypatch.setattr(auto_dtype, "cpu_vendor", lambda: "AuthenticAMD")
    assert cpu_kernels.kv_prefetch_target() == "l2"
    assert cpu_kernels._defines() == ["-DKVRELAY_PREFETCH_L2"]
    monkeypatch.setattr(auto_dtype, "cpu_vendor", lambda: "GenuineIntel")
    assert cpu_kernels.kv_prefetch_target() == "l1"
    assert cpu_kernels._defines() == []
    monkeypatch.setenv("KVRELAY_KV_PREFETCH", "l2")
    assert cpu_kernels.kv_prefetch_target() == "l2"
    monkeypatch.setenv("KVRELAY_KV_PREFETCH", "l3")
    with pytest.raises(ValueError, match="choose l1 or l2"):
        cpu_kernels.kv_prefetch_target()


def test_the_prefetch_target_keys_the_build_folder(monkeypatch):
    monkeypatch.setenv("KVRELAY_KV_PREFETCH", "l1")
    l1 = cpu_kernels._build_dir()
    monkeypatch.setenv("KVRELAY_KV_PREFETCH", "l2")
    assert cpu_kernels._build_dir() != l1
