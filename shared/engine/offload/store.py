"""The offload tier's block store: KV blocks as files in directories that every node of a host shares.

Why files: a directory in /dev/shm is shared memory that any process of the host's user opens by name, survives
the restart of any node, and needs no server; a directory on disk is the same store one tier down. Each tier is a
`DirTier` with a byte bound; `TieredStore` chains memory then disk.

Correct by construction:
- A block is written under a temporary name and renamed into place, so a writer killed mid-write leaves no
  half-written block visible (its temporary file is removed by the next scan, once its process is gone).
- Each file carries a header with its payload's length and xxh3-64 checksum, verified on every read. A mismatch
  is a miss and a counted error; the file is removed.
- Keys are chosen by the caller (kvrelay.engine.offload.tier: the KV layout and the block hash), so a block of one
  model, dtype or block size is never found for another.

Bounds: a writer takes the tier's lock (flock on `.lock`), scans the directory, removes the least recently used
files (by mtime; a hit refreshes it) until the new ones fit, writes them and lets go. Files evicted from memory
move to disk when there is a disk tier. A tier that fails to write (disk full, its directory removed) stops
taking writes with one logged warning; reads go on.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvrelay.common.process import pid_alive

logger = logging.getLogger(__name__)

_MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sQQ")  # magic, payload length, xxh3-64 of the payload
_SUFFIX = ".kvb"
_TMP = ".tmp."
Buffer = bytes | bytearray | memoryview  # a payload: the file's bytes after the header, or a view of a block's KV


@dataclass
class TierStats:
    """Cumulative counts of one tier (the node's metrics advance by their deltas)."""

    writes: int = 0
    write_bytes: int = 0
    hits: int = 0
    misses: int = 0
    checksum_failures: int = 0
    evictions: int = 0
    write_failures: int = 0


@dataclass
class _Scan:
    total: int = 0
    files: list[tuple[float, int, str]] = field(default_factory=list)  # (mtime, size, name), oldest first


class DirTier:
    """One directory of blocks, at most `capacity` bytes (headers included)."""

    def __init__(self, name: str, path: str | os.PathLike, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"{name} tier: capacity must be > 0 bytes, got {capacity}")
        self.name = name
        self.path = Path(path)
        self.capacity = capacity
        self.stats = TierStats()
        self.used = 0  # bytes in the folder (every writer's) as of this tier's last write
        self.enabled = True
        self._seq = 0
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path, 0o700)  # blocks are other tenants' prompts: the host's other users read none

    def file(self, key: str) -> Path:
        return self.path / f"{key}{_SUFFIX}"

    def has(self, key: str) -> bool:
        return self.file(key).exists()

    def read(self, key: str) -> Buffer | None:
        """The block's payload, verified, or None (absent, or failed its checksum: counted and removed)."""
        path = self.file(key)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)  # writable: tensors are made over it
                f.readinto(data)
        except OSError:
            self.stats.misses += 1
            return None
        payload = _verified(data)
        if payload is None:
            self.stats.checksum_failures += 1
            self.stats.misses += 1
            logger.warning("%s tier: block %s failed its checksum; removed, treated as a miss", self.name, key)
            _unlink(path)
            return None
        try:
            os.utime(path)  # most recently used
        except OSError:
            pass
        self.stats.hits += 1
        return payload

    def write(self, blocks: list[tuple[str, Buffer]], demote: DirTier | None = None) -> None:
        """Store `blocks` (key, payload) at once, evicting the least recently used files to make room; evicted
        files go to `demote` when given, and so do the first blocks of a batch larger than the tier. A failure
        disables this tier's writes (logged once)."""
        if not self.enabled or not blocks:
            return
        views = [(key, memoryview(p).cast("B")) for key, p in blocks]
        files = [(key, _HEADER.pack(_MAGIC, len(p), xxhash.xxh3_64_intdigest(p)), p) for key, p in views]
        # A batch larger than the tier (the writer coalesces whatever was queued) keeps its last blocks, the most
        # recently evicted, as many as fit; the others go where this tier's evictions go.
        size, fit = 0, len(files)
        while fit and size + len(files[fit - 1][1]) + len(files[fit - 1][2]) <= self.capacity:
            fit -= 1
            size += len(files[fit][1]) + len(files[fit][2])
        overflow = [(key, payload) for key, _, payload in files[:fit]]
        files = files[fit:]
        self.stats.evictions += len(overflow)
        demoted: list[tuple[str, Buffer]] = []
        try:
            with self._locked():
                scan = _scan(self.path)
                demoted, freed = self._evict(scan, size - (self.capacity - scan.total), demote is not None)
                self.used = scan.total - freed
                for key, header, payload in files:
                    self._write_one(key, header, payload)
                    self.stats.writes += 1
                    self.stats.write_bytes += len(header) + len(payload)
                    self.used += len(header) + len(payload)
        except OSError as e:
            self.enabled = False
            self.stats.write_failures += 1
            logger.warning("%s tier at %s: writing failed (%s); offloading to it stops, serving goes on",
                           self.name, self.path, e)
        if demote is not None and (demoted or overflow):
            demote.write(demoted + overflow)

    def _write_one(self, key: str, header: bytes, payload: Buffer) -> None:
        self._seq += 1
        tmp = self.path / f"{_TMP}{os.getpid()}.{threading.get_ident()}.{self._seq}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, header)
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        os.replace(tmp, self.file(key))  # atomic: readers see the whole block or none

    def _evict(self, scan: _Scan, excess: int, keep: bool) -> tuple[list[tuple[str, Buffer]], int]:
        """Remove the oldest files until `excess` bytes are gone; their verified payloads when `keep`, and the
        bytes removed."""
        kept: list[tuple[str, Buffer]] = []
        freed = 0
        for _, size, name in scan.files:
            if excess <= 0:
                break
            path = self.path / name
            if keep:
                try:
                    payload = _verified(path.read_bytes())
                except OSError:
                    payload = None
                if payload is not None:
                    kept.append((name.removesuffix(_SUFFIX), payload))
            if _unlink(path):
                self.stats.evictions += 1
                freed += size
            excess -= size
        return kept, freed

    def used_bytes(self) -> int:
        return used_in(self.path)

    def keys(self, prefix: str) -> list[str]:
        """The keys of the blocks in the folder that start with `prefix` (a listing: no file is opened)."""
        n = len(_SUFFIX)
        return [name[:-n] for name in os.listdir(self.path) if name.startswith(prefix) and name.endswith(_SUFFIX)]

    @contextmanager
    def _locked(self):
        fd = os.open(self.path / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing lets go of the lock


class TieredStore:
    """Memory, then disk when configured: reads look in order; writes go to memory and what memory evicts goes
    to disk (or straight to disk when there is no memory tier)."""

    def __init__(self, tiers: Iterable[DirTier]) -> None:
        self.tiers = list(tiers)
        if not self.tiers:
            raise ValueError("an offload store needs at least one tier")

    @property
    def writable(self) -> bool:
        """Whether any tier still takes writes."""
        return any(t.enabled for t in self.tiers)

    def read(self, key: str) -> tuple[Buffer, DirTier] | None:
        """The verified payload of `key` and the first tier that has it (each tier before counts a miss)."""
        for tier in self.tiers:
            payload = tier.read(key)
            if payload is not None:
                return payload, tier
        return None

    def write(self, blocks: list[tuple[str, Buffer]]) -> None:
        top, below = self.tiers[0], (self.tiers[1] if len(self.tiers) > 1 else None)
        if top.enabled:
            top.write(blocks, demote=below)
        elif below is not None:
            below.write(blocks)


def used_in(path: Path) -> int:
    """Bytes of blocks (and writes in progress) in a tier's folder; 0 when it cannot be read."""
    try:
        return _scan(path).total
    except OSError:
        return 0


def _scan(path: Path) -> _Scan:
    """The folder's blocks, oldest first, and its bytes; a temporary file of a writer that died is removed."""
    scan = _Scan()
    with os.scandir(path) as entries:
        for entry in entries:
            name = entry.name
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if name.endswith(_SUFFIX):
                scan.files.append((st.st_mtime, st.st_size, name))
                scan.total += st.st_size
            elif name.startswith(_TMP):
                pid = name.split(".")[2]  # .tmp.<pid>.<thread>.<n>
                if pid.isdigit() and not pid_alive(int(pid)):  # a writer killed mid-write
                    _unlink(Path(entry.path))
                else:
                    scan.total += st.st_size
    scan.files.sort()
    return scan


def _verified(data: bytes | bytearray) -> Buffer | None:
    if len(data) < _HEADER.size:
        return None
    magic, length, checksum = _HEADER.unpack_from(data)
    payload = memoryview(data)[_HEADER.size:]
    if magic != _MAGIC or length != len(payload) or xxhash.xxh3_64_intdigest(payload) != checksum:
        return None
    return payload


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False
