"""The offload store's files: bounded LRU tiers, atomic writes, checksums, writers killed mid-write, a tier whose
folder is gone, and files of another user's mode."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import time

from kvrelay.engine.offload.store import DirTier, TieredStore

BLOCK = bytes(range(256)) * 40  # 10,240 bytes


def _payload(i: int) -> bytes:
    return bytes([i % 256]) + BLOCK[1:]


def test_a_block_reads_back_verified_and_only_its_owner_reads_the_folder(tmp_path):
    tier = DirTier("memory", tmp_path / "t", 1 << 20)
    tier.write([("k1", _payload(1))])
    assert bytes(tier.read("k1")) == _payload(1)
    assert tier.read("nope") is None
    assert stat.S_IMODE(os.stat(tmp_path / "t").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tier.file("k1")).st_mode) == 0o600
    assert (tier.stats.hits, tier.stats.misses, tier.stats.writes) == (1, 1, 1)


def test_the_least_recently_used_go_first_and_the_bound_holds(tmp_path):
    tier = DirTier("memory", tmp_path / "t", 3 * (len(BLOCK) + 24))  # three blocks and their headers
    for i in range(3):
        tier.write([(f"k{i}", _payload(i))])
        time.sleep(0.01)  # distinct modification times
    assert tier.read("k0") is not None  # k0 is now the most recent: k1 goes first
    tier.write([("k3", _payload(3))])
    assert [tier.has(f"k{i}") for i in range(4)] == [True, False, True, True]
    assert tier.used_bytes() <= tier.capacity and tier.stats.evictions == 1


def test_memory_evictions_move_to_disk_and_are_found_there(tmp_path):
    memory = DirTier("memory", tmp_path / "m", 2 * (len(BLOCK) + 24))
    disk = DirTier("disk", tmp_path / "d", 1 << 20)
    store = TieredStore([memory, disk])
    for i in range(4):
        store.write([(f"k{i}", _payload(i))])
        time.sleep(0.01)
    assert not memory.has("k0") and disk.has("k0") and memory.has("k3")
    payload, tier = store.read("k0")
    assert bytes(payload) == _payload(0) and tier is disk


def test_a_batch_larger_than_the_tier_keeps_its_last_blocks_and_the_rest_go_down(tmp_path):
    """The writer coalesces what was queued: a batch may outgrow the tier. Its last blocks (evicted last) stay,
    as many as fit; the first go to disk (and with no disk tier, nowhere)."""
    memory = DirTier("memory", tmp_path / "m", 3 * (len(BLOCK) + 24))
    disk = DirTier("disk", tmp_path / "d", 1 << 20)
    memory.write([("old", _payload(9))])
    TieredStore([memory, disk]).write([(f"k{i}", _payload(i)) for i in range(5)])
    assert [memory.has(f"k{i}") for i in range(5)] == [False, False, True, True, True] and not memory.has("old")
    assert memory.used_bytes() <= memory.capacity and memory.stats.evictions == 3  # old, k0, k1
    assert all(disk.has(k) for k in ("old", "k0", "k1"))
    alone = DirTier("memory", tmp_path / "a", 2 * (len(BLOCK) + 24))
    alone.write([(f"k{i}", _payload(i)) for i in range(5)])
    assert [alone.has(f"k{i}") for i in range(5)] == [False, False, False, True, True]
    assert alone.used_bytes() <= alone.capacity


def test_a_flipped_byte_or_a_truncated_file_is_a_counted_miss(tmp_path):
    tier = DirTier("memory", tmp_path / "t", 1 << 20)
    tier.write([("a", _payload(1)), ("b", _payload(2))])
    data = bytearray(tier.file("a").read_bytes())
    data[100] ^= 1
    tier.file("a").write_bytes(bytes(data))
    tier.file("b").write_bytes(tier.file("b").read_bytes()[:-10])
    assert tier.read("a") is None and tier.read("b") is None
    assert tier.stats.checksum_failures == 2 and not tier.file("a").exists()


_WRITER = """
import sys, time
from kvrelay.engine.offload import store
tier = store.DirTier("memory", sys.argv[1], 1 << 30)
real = store.os.write
def slow(fd, data):  # the payload trickles out: the test kills the writer with its block half-written
    n = real(fd, bytes(data[:4096]))
    print("writing", flush=True)
    time.sleep(0.5)
    return n
store.os.write = slow
tier.write([("big", bytes(1 << 20))])
"""


def test_a_writer_killed_mid_write_leaves_no_block_and_its_leftover_is_swept(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path / "t")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tier = DirTier("memory", tmp_path / "t", 1 << 20)
    assert not tier.has("big") and tier.read("big") is None
    assert any(n.startswith(".tmp.") for n in os.listdir(tmp_path / "t"))  # the dead writer's leftover
    tier.write([("k", _payload(0))])  # a scan sweeps it
    assert not any(n.startswith(".tmp.") for n in os.listdir(tmp_path / "t"))


def test_a_removed_folder_stops_writes_with_a_warning_and_reads_miss(tmp_path, caplog):
    tier = DirTier("disk", tmp_path / "t", 1 << 20)
    tier.write([("k", _payload(0))])
    for name in os.listdir(tmp_path / "t"):
        os.remove(tmp_path / "t" / name)
    os.rmdir(tmp_path / "t")
    tier.write([("k2", _payload(1))])
    assert not tier.enabled and tier.stats.write_failures == 1
    assert "offloading to it stops" in caplog.text
    assert tier.read("k") is None
    tier.write([("k3", _payload(2))])  # disabled: no second warning, no error
    assert tier.stats.write_failures == 1


_LOADER = """
import random, sys
from kvrelay.engine.offload.store import DirTier
tier = DirTier("memory", sys.argv[1], int(sys.argv[2]))
rng = random.Random(int(sys.argv[3]))
for i in range(150):
    batch = range(rng.randrange(1, 4))
    tier.write([(f"{sys.argv[3]}-{i}-{j}", rng.randbytes(rng.randrange(1000, 20000))) for j in batch])
    if i % 7 == 0:
        tier.read(f"{sys.argv[3]}-{i - 3}-0")
"""


def test_writers_of_several_processes_keep_the_tier_within_its_bound(tmp_path):
    bound = 200_000
    folder = tmp_path / "t"
    procs = [subprocess.Popen([sys.executable, "-c", _LOADER, str(folder), str(bound), str(seed)])
             for seed in range(3)]
    peak = 0
    while any(p.poll() is None for p in procs):
        peak = max(peak, _held(folder))
        time.sleep(0.002)
    assert [p.returncode for p in procs] == [0, 0, 0]
    tier = DirTier("memory", folder, bound)
    assert 0 < tier.used_bytes() <= bound and 0 < peak <= bound


def _held(folder) -> int:
    """Bytes of blocks and temporary files in the folder, between two writers (under the tier's lock)."""
    if not (folder / ".lock").exists():
        return 0
    fd = os.open(folder / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return sum(e.stat().st_size for e in os.scandir(folder)
                   if e.name.endswith(".kvb") or e.name.startswith(".tmp."))
    finally:
        os.close(fd)
