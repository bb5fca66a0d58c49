"""CUDA caches for the same-host connector (shm.py): the one device allocation that holds every layer, its IPC
export, and a sender's export opened by its receiver (the copy out of it: _device_copy.py).

One allocation: an IPC handle names a whole CUDA allocation, so with every layer in one, a receiver opens a
sender's memory once per connection and finds each layer at the offsets of the hello, as in a memfd segment.

Export: the handle comes from torch (`UntypedStorage._share_cuda_()`, what torch.multiprocessing sends), taken
on an alias of the allocation (a DLPack view, with a storage of its own), never on the engine's storage: torch
swaps the exported storage's data pointer for a reference-counted one, which would race with the threads that
read the caches. Each connection gets an export of its own, so a count of its own in torch's IPC reference
counters: its receiver decrements it when it lets go, and until then the alias, and with it the allocation,
stays out of the sender's allocator (torch's limbo), even once the sender has dropped its caches.

Import: `UntypedStorage._new_shared_cuda()` with the export's fields, as torch.multiprocessing's
rebuild_cuda_tensor calls it. Only plain values cross the socket (ints, bytes, a string, in msgpack); nothing a
peer sends is unpickled, and every field is checked first (torch writes through the reference counter's
offset unchecked). The sender names its GPU by UUID, because device indices differ between processes with
different CUDA_VISIBLE_DEVICES; a receiver refuses a sender on another GPU (the auto connector sends those over
its remote connector instead).

A receiver copies out of the opened memory on a stream of the connection's own (not behind the engine's
kernels) and synchronizes that stream before it acks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvrelay.kv_transfer.types import TransferError

_ALIGN = 4096  # each layer starts on its own page of the allocation, as in a memfd segment
# torch/csrc/CudaIPCTypes.h, CUDA_IPC_REF_COUNTER_FILE_SIZE: the int64 slots of one reference-counter file. A
# receiver's storage decrements slot `ref_counter_offset` of the named file when released, without a check.
_REF_COUNTER_SLOTS = 10_000
_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t, cudaIpcEventHandle_t: torch reads that many bytes of each, unchecked
_MAX_HANDLE_BYTES = 4096  # torch's expandable segments send a longer memory handle than cudaIpcMemHandle_t


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID: the same in every process, whatever CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(device).uuid)


# -- the sender's memory -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CudaExport:
    """What a receiver opens a sender's CUDA segment with: the fields of torch's `_share_cuda_()` (but the
    device index, which is the sender's) and the UUID of the GPU."""

    gpu: str
    handle: bytes  # names the CUDA allocation that holds the segment
    size: int  # bytes of the segment
    offset: int  # where the segment starts in that allocation
    ref_counter: bytes  # the shared-memory file of torch's IPC reference counters ...
    ref_counter_offset: int  # ... and this connection's slot in it
    event: bytes  # an IPC event recorded when exporting (if event_sync)
    event_sync: bool

    def to_msg(self) -> dict:
        return {"gpu": self.gpu, "handle": self.handle, "size": self.size, "offset": self.offset,
                "ref": self.ref_counter, "ref_offset": self.ref_counter_offset, "event": self.event,
                "event_sync": self.event_sync}

    @classmethod
    def from_msg(cls, msg: object) -> CudaExport:
        """The export a hello carries, once every field is seen to be what torch expects; TransferError if not."""
        if not isinstance(msg, dict):
            raise TransferError("malformed CUDA export from the sender: not a map")
        try:
            export = cls(msg["gpu"], msg["handle"], msg["size"], msg["offset"], msg["ref"], msg["ref_offset"],
                         msg["event"], msg["event_sync"])
        except KeyError as e:
            raise TransferError(f"malformed CUDA export from the sender: no {e}") from None
        bad = export._flaw()
        if bad is not None:
            raise TransferError(f"malformed CUDA export from the sender: {bad}")
        return export

    def _flaw(self) -> str | None:
        def count(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 0

        def blob(v: object, least: int, most: int = _MAX_HANDLE_BYTES) -> bool:
            return isinstance(v, bytes) and least <= len(v) <= most

        if not isinstance(self.gpu, str) or not 0 < len(self.gpu) <= 128:
            return "gpu is not a UUID"
        if not (blob(self.handle, _IPC_HANDLE_BYTES) and blob(self.ref_counter, 1)
                and blob(self.event, _IPC_HANDLE_BYTES, _IPC_HANDLE_BYTES)):
            return "handle, ref or event is not bytes of a handle's size"
        if b"\0" in self.ref_counter:
            return "ref is not a file name"
        if not (count(self.size) and self.size > 0 and count(self.offset)):
            return "size or offset is not a byte count"
        if not count(self.ref_counter_offset) or self.ref_counter_offset >= _REF_COUNTER_SLOTS:
            return f"ref_offset is not a counter slot (0 to {_REF_COUNTER_SLOTS - 1})"
        if not isinstance(self.event_sync, bool):
            return "event_sync is not a bool"
        return None


def refusal(export: CudaExport, ours: str | None) -> str | None:
    """Why a receiver whose caches are on GPU `ours` (None: in host memory) cannot copy from this export."""
    if ours is None:
        return f"the sender's KV caches are on GPU {export.gpu}, this receiver's in host memory (use ucx, or auto)"
    if export.gpu != ours:
        return (f"the sender's KV caches are on GPU {export.gpu}, this receiver's on GPU {ours}: shm copies within "
                "one GPU (use ucx, or auto, between GPUs)")
    return None


class CudaSegment:
    """One zero-filled device allocation holding every layer's cache, each at a page-aligned offset."""

    def __init__(self, layer_nbytes: int, num_layers: int, device: torch.device) -> None:
        stride = -(-layer_nbytes // _ALIGN) * _ALIGN
        self.offsets = [i * stride for i in range(num_layers)]
        self.nbytes = max(stride * num_layers, _ALIGN)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        self._bytes: torch.Tensor | None = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        self.base = self._bytes.data_ptr()
        self.gpu = device_uuid(self.device)

    def layer(self, i: int, nbytes: int) -> torch.Tensor:
        return self._bytes[self.offsets[i] : self.offsets[i] + nbytes]

    def contains(self, t: torch.Tensor) -> bool:
        start = t.data_ptr() - self.base
        return t.device == self.device and 0 <= start and start + t.numel() * t.element_size() <= self.nbytes

    def export(self) -> CudaExport:
        """A new export for one connection (its own reference count; the handle is the allocation's)."""
        alias = torch.from_dlpack(self._bytes)  # shares the memory, not the storage
        _, handle, size, offset, ref, ref_offset, event, event_sync = alias.untyped_storage()._share_cuda_()
        # Dropped here, the alias waits in torch's limbo, holding the allocation, until the receiver lets go.
        return CudaExport(self.gpu, handle, size, offset, ref, ref_offset, event, bool(event_sync))

    def close(self) -> None:
        """Let go of the allocation (it is freed with the caches and once no receiver holds an export)."""
        if self._bytes is not None:
            self._bytes = None
            torch.cuda.ipc_collect()  # frees exports that receivers have let go of already


# -- the receiver's view ----------------------------------------------------------------------------------------


class PeerCudaMemory:
    """A sender's CUDA segment as its receiver sees it: opened once per connection on the receiver's GPU, read
    on a stream of the connection's own, let go when the connection ends."""

    def __init__(self, export: CudaExport, device: torch.device) -> None:
        try:
            with torch.cuda.device(device):
                storage = torch.UntypedStorage._new_shared_cuda(
                    device.index, export.handle, export.size, export.offset, export.ref_counter,
                    export.ref_counter_offset, export.event, export.event_sync,
                )
                # Opening queued a wait for the sender's writes before its export on this thread's stream.
                torch.cuda.current_stream(device).synchronize()
        except (RuntimeError, TypeError, ValueError) as e:
            raise TransferError(f"cannot open the sender's CUDA memory: {e}") from None
        self.bytes: torch.Tensor | None = torch.empty(0, dtype=torch.uint8, device=device).set_(
            storage, 0, (export.size,), (1,)
        )
        self.nbytes = export.size
        self.stream = torch.cuda.Stream(device)

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Copies enqueued inside go on this connection's stream; on the way out (an error included) all of
        them are done."""
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self.stream.synchronize()

    def close(self) -> None:
        """Drop the storage: torch then closes the handle and decrements the sender's reference count."""
        self.bytes = None
