"""Same-host connector: KV moves through shared memory, one copy per layer, at memory speed.

Every node's KV caches live in one segment: the engine allocates them through `kv_allocator()`. In host
memory the segment is a memfd: a sender connects once per peer to the receiver's unix socket and hands over
the segment's file descriptor (SCM_RIGHTS); the receiver maps the sender's caches read-only. Per layer the
sender posts one small message (transfer id, layer, src and dst blocks); the receiver checks it against what
it expects, copies the src blocks straight from the sender's cache into its reserved blocks (one pass, no
staging) and acks.

CUDA caches work the same way between processes on one GPU (CUDA IPC, _cuda_ipc.py). The segment is one
device allocation holding every layer, so one IPC handle covers them all: the hello carries it (exported anew
for each connection, so that torch counts every receiver that maps it) instead of a descriptor, with the GPU's
UUID; the receiver opens it once per connection and copies each layer with device memcpys or a gather/scatter
kernel (_device_copy.py) on a stream of its own, synchronized before it acks. A layer's KV is only enqueued
on the engine's stream when send_blocks is called: send_blocks records an event there and the writer thread
posts the layer once the event has completed, so the engine thread never blocks. Peers on other GPUs are
refused (the auto connector sends to them over ucx): this node's address names its GPU along with its host.

The receiver copies (pull), not the sender, because only the receiver knows when a reservation ends (lease,
abort): it checks before each copy, and `wait_received` returns only once no copy for that transfer is in
flight, so no byte lands in blocks that were freed meanwhile. A sender writing into the peer could not
promise that.

Lifecycle:
1. Start: sweep control sockets that nobody accepts on any more (left by a SIGKILL), bind
   kvrelay-kv-<pid>-<random>.sock in /dev/shm (or shm_dir), accept on a thread.
2. A sender's first transfer to a peer: connect, hello {layout, layer offsets, segment size, transfer id}
   with the segment's descriptor (CUDA: with its export); the receiver refuses a layout mismatch (naming both
   sides' values), or a sender whose memory it cannot copy from (another GPU, host memory against CUDA), or
   maps (opens) the segment and says ok.
3. Per layer: the sender's writer thread posts the message (on CUDA once the layer's event has completed);
   the receiver's connection thread checks, copies and acks the layers that have arrived (waiting for its
   stream once for all of them, on CUDA); the sender's ack reader books the layers.
4. A peer that dies: its socket ends, the survivor fails that connection's unfinished transfers, and a
   receiver unmaps the dead sender's segment (the kernel frees a segment with its last mapping) or lets go
   of its CUDA memory. Leases free the reserved and held blocks, as with any connector.
5. close(): stop accepting, end every connection, unlink the socket.

Only fleet members of the same user: the control socket is its owner's alone (mode 0600, so another user cannot
even connect), and the receiver also checks each connecting process's uid (SO_PEERCRED) and refuses any other.
The segment has no name anyone could open: only a process handed its descriptor can map it. CUDA memory
can be opened by any process of the GPU that holds its handle, which only goes to a receiver that passed
those checks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import socket
import struct
import threading
from functools import lru_cache

import numpy as np
import torch

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer import _blocks, _cuda_ipc, _device_copy
from kvrelay.kv_transfer._book import TransferBooks
from kvrelay.kv_transfer._cuda_ipc import CudaSegment
from kvrelay.kv_transfer._device_copy import RowIndices
from kvrelay.kv_transfer._shm_io import (
    SCHEME,  # noqa: F401 - re-exported: the auto connector and callers name shm addresses by it
    Channel,
    Segment,
    copy_blocks,
    copy_plan,
    host_id,
    new_socket_path,
    parse_address,
    socket_dir,
    split_plan,
    sweep_stale_sockets,
)
from kvrelay.kv_transfer._shm_links import Inbound, Outbound, SegmentIntro
from kvrelay.kv_transfer.base import KVConnector
from kvrelay.kv_transfer.types import ConnectorConfig, TransferError

logger = logging.getLogger(__name__)

_PARALLEL_COPY_BYTES = 1 << 20  # a layer at least this large is copied by copy_threads threads
_NOT_SHARED = "this node's KV caches are not in shared memory (allocate them through kv_allocator())"
_DEVICES = ("cpu", "cuda")


class ShmConnector(KVConnector):
    name = "shm"

    def __init__(self, config: ConnectorConfig, books: TransferBooks | None = None):
        super().__init__(config, books)
        folder = socket_dir(config.shm_dir)
        for path in sweep_stale_sockets(folder):
            logger.info("removed stale KV control socket %s", path)
        self.host = host_id(folder)
        self._path = new_socket_path(folder)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self._path))
        os.chmod(self._path, 0o600)
        self._listener.listen(64)
        self._segment: Segment | CudaSegment | None = None
        # Own caches as flat bytes (numpy in host memory, tensors on CUDA): what received layers are copied into.
        self._dst: list[np.ndarray] | list[torch.Tensor] = []
        self._gpu: str | None = None  # the UUID of the GPU that holds this node's caches, if one does
        self._indices = RowIndices()
        self._last_plan: tuple | None = None  # (src list, dst list, sender's layout, plan) of the last host copy
        self._fused = False  # CUDA: whether received layers are copied by the fused kernel (_device_copy.py)
        self._intro: SegmentIntro | None = None  # set once the registered caches are in the segment
        self._peers: dict[str, Outbound] = {}
        self._inbound: set[Inbound] = set()
        self._lock = threading.Lock()
        self._helpers = (concurrent.futures.ThreadPoolExecutor(config.copy_threads - 1, "kvrelay-shm-copy")
                         if config.copy_threads > 1 else None)
        self._closed = False
        self._accepting = threading.Thread(target=self._accept_loop, name="kvrelay-shm-accept", daemon=True)
        self._accepting.start()

    @property
    def address(self) -> str:
        return f"{SCHEME}{self.place}{self._path}"

    @property
    def place(self) -> str:
        """Where a peer must be for the two to move KV over shm, as the address names it: this host (the host
        id), and for CUDA caches their GPU too."""
        return self.host if self._gpu is None else f"{self.host}.gpu-{self._gpu}"

    @property
    def kv_device(self) -> torch.device | None:
        return self._caches[0].device if self._caches else None

    @property
    def can_send(self) -> bool:
        """Whether peers can map this node's caches (they live in the segment this connector allocated)."""
        return self._intro is not None

    # -- set-up ----------------------------------------------------------------------------------------
    def kv_allocator(self) -> ShmConnector:
        return self

    def allocate_kv_caches(
        self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        """All layers in one segment: a memfd in host memory, one allocation on a CUDA device."""
        device = torch.device(device)
        if device.type not in _DEVICES:
            raise ValueError(f"shm connector: KV caches on {device}; host memory or CUDA only (use --connector ucx)")
        if self._segment is not None:
            raise RuntimeError("shm connector: KV caches were allocated already")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        cuda = device.type == "cuda"
        self._segment = CudaSegment(nbytes, num_layers, device) if cuda else Segment(nbytes, num_layers)
        return [self._segment.layer(i, nbytes).view(dtype).view(shape) for i in range(num_layers)]

    def register_kv_caches(self, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        device = kv_caches[0].device if kv_caches else torch.device("cpu")
        if device.type not in _DEVICES:
            raise ValueError(f"shm connector: KV caches on {device}; host memory or CUDA only (use ucx)")
        super().register_kv_caches(layout, kv_caches)
        flat = [c.view(torch.uint8).reshape(-1) for c in kv_caches]
        self._dst = flat if device.type == "cuda" else [f.numpy() for f in flat]
        if device.type == "cuda":
            self._gpu = _cuda_ipc.device_uuid(device)
            self._fused = self.config.fused_copy and _device_copy.warm_up(device, layout.block_nbytes)
        segment = self._segment
        if segment is not None and all(segment.contains(c) for c in kv_caches):
            offsets = [c.data_ptr() - segment.base for c in kv_caches]
            self._intro = (SegmentIntro(layout, offsets, segment.nbytes, cuda=segment)
                           if isinstance(segment, CudaSegment) else
                           SegmentIntro(layout, offsets, segment.nbytes, fd=segment.fd))

    # -- sender side -----------------------------------------------------------------------------------
    def connect(self, peer: str, timeout: float | None = None) -> None:
        parse_address(peer)
        if self._intro is None:
            raise TransferError(f"shm connector cannot send: {_NOT_SHARED}")
        self._outbound(peer, None).wait_connected(self.config.connect_timeout + 1 if timeout is None else timeout)

    def send_blocks(
        self, peer: str, transfer_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> None:
        self._check_send_args(transfer_id, layer, src_block_ids, dst_block_ids)
        host, _ = parse_address(peer)  # a malformed address is the caller's bug: raise here
        if self._closed:
            raise TransferError("shm connector is closed")
        if not self._sent.enqueue_layer(transfer_id, self.layout.num_layers, layer, peer):
            return
        why = self._cannot_send(peer, host)
        if why is not None:
            self._sent.fail(transfer_id, TransferError(f"shm transfer {transfer_id!r} impossible: {why}"))
            return
        msg = {"k": "layer", "t": transfer_id, "l": layer, "s": list(src_block_ids), "d": list(dst_block_ids)}
        self._outbound(peer, transfer_id).post(msg, _blocks.ready_event(self._caches[layer]))

    def _cannot_send(self, peer: str, place: str) -> str | None:
        """Why this node cannot send to a peer at `place` (its address's), or None."""
        if place.partition(".gpu-")[0] != self.host:
            return f"peer {peer} is on another host or sees another {self._path.parent} (use ucx, or auto)"
        if place != self.place:
            return f"peer {peer} keeps its KV caches on another device than this node ({self.place}; use ucx, or auto)"
        return _NOT_SHARED if self._intro is None else None

    def _abort_remote(self, peer: str, transfer_id: str, reason: str) -> None:
        with self._lock:
            out = self._peers.get(peer)
        if out is not None:
            out.post({"k": "abort", "t": transfer_id, "e": reason})

    def _outbound(self, peer: str, first_transfer_id: str | None) -> Outbound:
        with self._lock:
            out = self._peers.get(peer)
            if out is None:
                out = self._peers[peer] = Outbound(
                    peer, first_transfer_id, intro=self._intro, book=self._sent,
                    connect_timeout=self.config.connect_timeout, on_broken=self._forget_outbound,
                )
            return out

    def _forget_outbound(self, out: Outbound) -> None:
        with self._lock:
            if self._peers.get(out.peer) is out:
                del self._peers[out.peer]

    # -- receiver side ---------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            uid = _peer_uid(sock)
            if uid != os.getuid():
                logger.warning("refused a KV control connection from uid %s (this node runs as uid %d)", uid,
                               os.getuid())
                sock.close()
                continue
            inbound = Inbound(Channel(sock), self)
            with self._lock:
                if self._closed:
                    inbound.close()
                    return
                self._inbound.add(inbound)
            inbound.start()

    def copy_layer(self, layer: int, src: np.ndarray | torch.Tensor, src_blocks: list[int], dst_blocks: list[int],
                   src_layout: KVLayout) -> int:
        """Copy blocks of one layer from a sender's cache (flat bytes, mapped or opened) into this node's; bytes
        copied. Its Inbound has checked the blocks against the sender's layout and the transfer's reservation,
        and on CUDA waits for the copy (enqueued here on its stream)."""
        if isinstance(src, torch.Tensor):
            return _device_copy.copy_blocks(
                self._dst[layer], src, src_blocks, dst_blocks, src_layout.num_blocks, self.layout.num_blocks,
                src_layout.block_nbytes, max_direct_runs=self.config.max_direct_runs, indices=self._indices,
                fused=self._fused,
            )
        # Every layer of a transfer moves the same blocks: plan once. A connection hands every layer of a transfer
        # the same lists, so the last plan is found by identity (no tuple built and hashed per layer).
        last = self._last_plan
        if last is not None and last[0] is src_blocks and last[1] is dst_blocks and last[2] is src_layout:
            plan = last[3]
        else:
            plan = _plan(tuple(src_blocks), tuple(dst_blocks), src_layout.num_blocks, self.layout.num_blocks,
                         src_layout.block_nbytes)
            self._last_plan = (src_blocks, dst_blocks, src_layout, plan)  # one assignment: threads see all or none
        return self._copy(self._dst[layer], src, plan)

    def _copy(self, dst: np.ndarray, src: np.ndarray, plan: tuple) -> int:
        parts = split_plan(plan, self.config.copy_threads) if plan[2].sum() >= _PARALLEL_COPY_BYTES else [plan]
        if len(parts) == 1 or self._helpers is None:
            return copy_blocks(dst, src, plan)
        helped = [self._helpers.submit(copy_blocks, dst, src, part) for part in parts[1:]]
        return copy_blocks(dst, src, parts[0]) + sum(f.result() for f in helped)

    def forget_inbound(self, inbound: Inbound) -> None:
        with self._lock:
            self._inbound.discard(inbound)

    # -- shutdown ----------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, inbound = list(self._peers.values()), list(self._inbound)
        self._listener.close()
        try:
            self._path.unlink()
        except OSError:
            pass
        for out in peers:
            out.close()
        for inb in inbound:
            inb.close()
        for link in [*peers, *inbound]:
            link.join(timeout=5)
        error = TransferError("shm connector closed")
        self._sent.fail_all(error)
        self._received.fail_all(error)
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
        if self._segment is not None:
            self._segment.close()


@lru_cache(maxsize=64)
def _plan(src: tuple[int, ...], dst: tuple[int, ...], src_blocks: int, dst_blocks: int, block_nbytes: int) -> tuple:
    return copy_plan(list(src), list(dst), src_blocks, dst_blocks, block_nbytes)


def _peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED: pid, uid, gid)."""
    try:
        _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except OSError:
        return None
    return uid
