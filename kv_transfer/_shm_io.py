"""The pieces of the same-host connector (shm.py): the shared KV segment in host memory (CUDA's: _cuda_ipc.py),
the control channel, the host id, the stale-socket sweep, and the block copy.

The segment is a memfd: it never has a name in a file system, so nothing can leak. It reaches a peer as a
file descriptor over the control socket (SCM_RIGHTS), and the kernel frees it once the last process that
maps it lets go (its owner's exit, a crash included, and the peers' unmaps).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
import socket
import struct
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

from kvrelay.common import native

SCHEME = "shm://"
SOCKET_PREFIX = "kvrelay-kv-"
_LEN = struct.Struct("<I")
_ALIGN = 4096  # each layer starts on a page: a peer maps the whole segment, offsets stay page-aligned
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+; Python 3.13 names it
_STALE_AFTER_S = 10.0  # a socket nobody listens on is only swept once this old (it may be starting up)


# -- where and who -------------------------------------------------------------------------------------------


def parse_address(peer: str) -> tuple[str, str]:
    """(host id, socket path) of an shm:// address."""
    rest = peer.removeprefix(SCHEME)
    host, slash, path = rest.partition("/")
    if not peer.startswith(SCHEME) or not host or not slash:
        raise ValueError(f"bad shm peer address {peer!r}; expected shm://<host id>/<socket path>")
    return host, "/" + path


def socket_dir(configured: str | None) -> Path:
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def host_id(folder: Path) -> str:
    """Equal for two processes iff they run on the same boot and see the same socket folder (the same
    /dev/shm): what the auto connector needs to use shm, e.g. two containers sharing /dev/shm."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    st = folder.stat()
    return f"{boot}-{st.st_dev:x}-{st.st_ino:x}"


def new_socket_path(folder: Path) -> Path:
    return folder / f"{SOCKET_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.sock"


def sweep_stale_sockets(folder: Path) -> list[Path]:
    """Unlink control sockets left by connectors that died without closing (SIGKILL): nobody accepts on
    them any more. Returns what was removed."""
    removed = []
    for path in folder.glob(f"{SOCKET_PREFIX}*.sock"):
        try:
            if time.time() - path.lstat().st_mtime < _STALE_AFTER_S:
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.settimeout(0.5)
                probe.connect(str(path))
        except ConnectionRefusedError:
            try:
                path.unlink()
                removed.append(path)
            except OSError:
                pass
        except OSError:
            pass  # gone meanwhile, not ours to judge (permissions), or alive and slow
    return removed


# -- the shared segment --------------------------------------------------------------------------------------


class Segment:
    """One memfd holding every layer's cache, mapped read-write by its owner."""

    def __init__(self, layer_nbytes: int, num_layers: int) -> None:
        stride = -(-layer_nbytes // _ALIGN) * _ALIGN
        self.offsets = [i * stride for i in range(num_layers)]
        self.nbytes = max(stride * num_layers, _ALIGN)
        self.fd = os.memfd_create(f"{SOCKET_PREFIX}{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            # Its size can never change again: a peer that maps it cannot be hit by SIGBUS from a shrink.
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._map = mmap.mmap(self.fd, self.nbytes)  # MAP_SHARED; zero-filled like torch.zeros
        except BaseException:
            os.close(self.fd)
            raise
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # holds the map for as long as it lives
        self.base = self._bytes.data_ptr()
        self._populate()

    def _populate(self) -> None:
        """Back every page now, as torch.zeros does for plain caches. Left to first touch, the kernel would
        allocate and clear each page inside the engine's attention kernels as blocks are first written, a cost
        that shows in served runs (docs/results/2026-11-25-zen5/NOTES.md). Memory that is not there fails
        here, at start-up."""
        try:
            self._map.madvise(_MADV_POPULATE_WRITE)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise MemoryError(f"cannot back the {self.nbytes / 2**30:.2f} GiB KV cache segment ({e}); "
                                  "give the node less --kv-cache-memory") from e
            self._bytes.zero_()  # kernels before 5.14 know no MADV_POPULATE_WRITE: touch every page

    def layer(self, i: int, nbytes: int) -> torch.Tensor:
        return self._bytes[self.offsets[i] : self.offsets[i] + nbytes]

    def contains(self, t: torch.Tensor) -> bool:
        start = t.data_ptr() - self.base
        return t.device.type == "cpu" and 0 <= start and start + t.numel() * t.element_size() <= self.nbytes

    def close(self) -> None:
        """Close the descriptor (peers that mapped it keep their mapping); the memory goes with the tensors."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class PeerMapping:
    """A sender's segment as its receiver sees it: read-only, unmapped when the connection ends."""

    def __init__(self, fd: int, nbytes: int) -> None:
        try:
            # Map only a segment that holds what the sender claims and cannot shrink under the mapping
            # (touching pages past a file's end raises SIGBUS).
            if os.fstat(fd).st_size < nbytes or not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise ValueError("the sender's segment is smaller than announced, or not sealed against shrinking")
            self._map = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)  # the mapping keeps the memory; the descriptor is not needed any more
        self.bytes = np.frombuffer(self._map, dtype=np.uint8)
        self.base = self.bytes.ctypes.data
        self.nbytes = nbytes

    def copying(self) -> contextlib.AbstractContextManager[None]:
        """What a receiver copies out of this segment inside is done when each copy returns: nothing to wait for."""
        return contextlib.nullcontext()

    def close(self) -> None:
        self.bytes = None  # the array holds an export of the map: drop it first
        self._map.close()


# -- the control channel -------------------------------------------------------------------------------------


class Channel:
    """Length-prefixed msgpack messages on a connected unix stream socket; a message may carry descriptors.
    Sends are serialized by a lock; one thread receives."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode = msgspec.msgpack.Decoder().decode

    def send(self, msg: dict, fds: tuple[int, ...] = ()) -> None:
        data = self._encode(msg)
        frame = _LEN.pack(len(data)) + data
        with self._lock:
            sent = socket.send_fds(self.sock, [frame], list(fds)) if fds else 0
            if sent < len(frame):
                self.sock.sendall(frame[sent:])

    def recv(self) -> tuple[dict, list[int]]:
        """The next message and the descriptors that came with it; EOFError once the peer has gone."""
        fds: list[int] = []
        while True:
            msg = self._pop()
            if msg is not None:
                return msg, fds
            try:
                data, new_fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
            except OSError as e:
                raise EOFError(f"control socket failed: {e!r}") from None
            fds += new_fds
            if not data:
                for fd in fds:
                    os.close(fd)
                raise EOFError("peer closed the control socket")
            self._buf += data

    def buffered(self, limit: int) -> list[dict]:
        """Up to `limit` messages that were received in full already (no wait; they carry no descriptors)."""
        msgs = []
        while len(msgs) < limit and (msg := self._pop()) is not None:
            msgs.append(msg)
        return msgs

    def _pop(self) -> dict | None:
        if len(self._buf) >= _LEN.size:
            (size,) = _LEN.unpack_from(self._buf)
            if len(self._buf) >= _LEN.size + size:
                msg = self._decode(bytes(self._buf[_LEN.size : _LEN.size + size]))
                del self._buf[: _LEN.size + size]
                return msg
        return None

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in recv()
        except OSError:
            pass
        self.sock.close()


# -- the copy ------------------------------------------------------------------------------------------------


def copy_plan(
    src: list[int], dst: list[int], src_blocks: int, dst_blocks: int, block_nbytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst offsets, src offsets, sizes) in bytes within one layer cache [2, blocks, ...]: keys then values,
    and a run of blocks consecutive on both sides as one piece."""
    s, d = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, (np.diff(s) != 1) | (np.diff(d) != 1)])
    lengths = np.diff(np.r_[starts, len(s)])
    s0, d0 = s[starts], d[starts]
    src_off = np.concatenate((s0, s0 + src_blocks)) * block_nbytes
    dst_off = np.concatenate((d0, d0 + dst_blocks)) * block_nbytes
    return dst_off, src_off, np.tile(lengths, 2) * block_nbytes


def split_plan(plan: tuple[np.ndarray, np.ndarray, np.ndarray], parts: int) -> list[tuple]:
    """The plan cut into `parts` plans of about equal bytes (whole pieces each)."""
    sizes = plan[2]
    if parts <= 1 or len(sizes) < parts:
        return [plan]
    bounds = np.searchsorted(np.cumsum(sizes), [sizes.sum() * k / parts for k in range(1, parts)], side="right")
    cuts = [0, *sorted(set(int(b) for b in bounds)), len(sizes)]
    return [tuple(a[lo:hi] for a in plan) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def copy_blocks(
    dst: np.ndarray, src: np.ndarray, plan: tuple[np.ndarray, np.ndarray, np.ndarray]
) -> int:
    """Copy every piece of the plan from src to dst (flat uint8 arrays); returns the bytes copied. One
    native call without the GIL when kvrelay.common.native is built, else a numpy slice per piece."""
    dst_off, src_off, sizes = plan
    if len(sizes) and (int((dst_off + sizes).max()) > dst.nbytes or int((src_off + sizes).max()) > src.nbytes):
        raise ValueError("copy outside a layer cache")  # a bug or a lying peer: never touch foreign memory
    lib = native.load()
    if lib is not None:
        lib.copy_blocks(dst.ctypes.data, src.ctypes.data, dst_off, src_off, sizes)
    else:
        for do, so, n in zip(dst_off.tolist(), src_off.tolist(), sizes.tolist()):
            dst[do : do + n] = src[so : so + n]
    return int(sizes.sum())
