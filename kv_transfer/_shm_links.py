"""The two ends of one shm connection (kv_transfer/shm.py): the sender's Outbound (a writer thread posts the
queued messages in order, an ack reader books the layers) and the receiver's Inbound (a thread that checks,
copies and acks the layers).

A link gets what it works with at construction: an Outbound its connector's introduction (SegmentIntro),
its book of sent transfers and a callback for when it breaks; an Inbound the receiving connector as a
ShmReceiver, whose public methods copy a layer and let go of the link. Neither knows the connector's class.

The sender's segment is a memfd (host caches), whose descriptor goes with the hello, or a CUDA allocation,
exported anew for each connection (_cuda_ipc.py). On CUDA a layer is posted only once the kernels that wrote it
are done (the event send_blocks recorded on the engine's stream): the receiver reads memory, not streams. The
receiver takes the layer messages that have arrived together as one batch: on CUDA it enqueues their copies one
after another and waits once, so the GPU is not idle between layers while the thread acks and reads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer import _cuda_ipc, _handshake
from kvrelay.kv_transfer._book import TransferBook, TransferBooks
from kvrelay.kv_transfer._cuda_ipc import CudaExport, CudaSegment, PeerCudaMemory
from kvrelay.kv_transfer._shm_io import Channel, PeerMapping, parse_address
from kvrelay.kv_transfer.types import ConnectorConfig, TransferError

logger = logging.getLogger(__name__)

_MAX_SEEN = 4096  # transfer ids a connection remembers, to fail the unfinished ones if it breaks
# Transfers whose block lists both ends of a connection remember: a layer of one of them goes without its lists
# (the same for every layer of a transfer), so neither end encodes, decodes nor checks them again.
_LISTS_KEPT = 64


def _remember(kept: dict, key: str, value: object) -> None:
    """The same bounded memory on both ends (inserted in the order of the connection's messages, the oldest
    forgotten first), so that a receiver still has the lists a sender leaves out."""
    kept.pop(key, None)
    kept[key] = value
    if len(kept) > _LISTS_KEPT:
        del kept[next(iter(kept))]
_MAX_BATCH = 64  # layers a sender puts in one message, and messages a receiver takes before it acks
_NOTHING = object()


@dataclass(frozen=True)
class SegmentIntro:
    """What a sender shows a receiver when it connects: its layout, where each layer's cache lies in its
    segment, and the segment: a memfd's descriptor goes along with the message, a CUDA allocation is exported
    for each connection."""

    layout: KVLayout
    offsets: list[int]
    size: int
    fd: int | None = None
    cuda: CudaSegment | None = None

    def message(self, transfer_id: str | None) -> tuple[dict, tuple[int, ...]]:
        """The hello, and the descriptors to send with it."""
        msg = {"k": "hello", "layout": self.layout.to_dict(), "offsets": self.offsets, "size": self.size,
               "t": transfer_id}
        if self.cuda is not None:
            msg["cuda"] = self.cuda.export().to_msg()
        return msg, (() if self.fd is None else (self.fd,))


class ShmReceiver(Protocol):
    """The receiving connector, as the Inbound connections it accepted use it."""

    config: ConnectorConfig
    books: TransferBooks

    @property
    def registered_layout(self) -> KVLayout | None: ...

    @property
    def kv_device(self) -> torch.device | None:
        """Where this node's caches are, once registered."""
        ...

    def copy_layer(self, layer: int, src: np.ndarray | torch.Tensor, src_blocks: list[int], dst_blocks: list[int],
                   src_layout: KVLayout) -> int:
        """Copy blocks of one layer from a sender's cache (flat bytes) into this node's cache; bytes copied. On
        CUDA the copy is only enqueued, on the current stream."""
        ...

    def forget_inbound(self, inbound: Inbound) -> None: ...


class Outbound:
    """One connection to a receiver, sending side: a writer thread posts the queued messages in order (the
    engine thread only enqueues), an ack reader books the layers."""

    def __init__(self, peer: str, first_transfer_id: str | None, *, intro: SegmentIntro, book: TransferBook,
                 connect_timeout: float, on_broken: Callable[[Outbound], None]) -> None:
        self.peer = peer
        self._intro, self._book, self._connect_timeout, self._on_broken = intro, book, connect_timeout, on_broken
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lists: dict[str, tuple[list[int], list[int]]] = {}  # the receiver has these (_remember)
        self._connected = threading.Event()
        self.error: TransferError | None = None
        self._channel: Channel | None = None
        self._threads = [threading.Thread(target=self._write, args=(first_transfer_id,), daemon=True,
                                          name="kvrelay-shm-send")]
        self._threads[0].start()

    def post(self, msg: dict, ready: torch.cuda.Event | None = None) -> None:
        """Queue a message; the writer sends it once `ready` (the layer's kernels, on CUDA) has completed."""
        self._queue.put((msg, ready))

    def wait_connected(self, timeout: float) -> None:
        if not self._connected.wait(timeout):
            raise TransferError(f"no handshake with shm peer {self.peer} within {timeout:.1f}s")
        if self.error is not None:
            raise self.error

    def _write(self, first_transfer_id: str | None) -> None:
        try:
            self._handshake(first_transfer_id)
        except TransferError as e:
            self._break(e)
            return
        reader = threading.Thread(target=self._read_acks, daemon=True, name="kvrelay-shm-acks")
        self._threads.append(reader)
        reader.start()
        self._connected.set()
        try:
            held = _NOTHING  # an item taken from the queue whose layer was not ready: the next batch's first
            while True:
                item = self._queue.get() if held is _NOTHING else held
                held = _NOTHING
                if item is None:
                    return
                if item[1] is not None:
                    item[1].synchronize()
                batch = [item[0]]
                while len(batch) < _MAX_BATCH:  # and whatever else is queued and ready, in order
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None or (item[1] is not None and not item[1].query()):
                        held = item
                        break
                    batch.append(item[0])
                for msg in _coalesced(batch):
                    self._channel.send(self._without_known_lists(msg))
        except OSError as e:
            self._break(TransferError(f"connection to shm peer {self.peer} lost: {e!r}"))
        except RuntimeError as e:  # a CUDA error while waiting for a layer's kernels
            self._break(TransferError(f"shm transfer to {self.peer} failed: {e}"))

    def _without_known_lists(self, msg: dict) -> dict:
        """A layers message without its block lists when the receiver has them from an earlier one."""
        if msg["k"] != "layers":
            return msg
        lists = (msg["s"], msg["d"])
        if self._lists.get(msg["t"]) == lists:
            return {"k": "layers", "t": msg["t"], "ls": msg["ls"]}
        _remember(self._lists, msg["t"], lists)
        return msg

    def _handshake(self, transfer_id: str | None) -> None:
        _, path = parse_address(self.peer)
        timeout = self._connect_timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            self._channel = Channel(sock)
            hello, fds = self._intro.message(transfer_id)
            self._channel.send(hello, fds=fds)
            reply, _ = self._channel.recv()
            sock.settimeout(None)  # from now on a dead peer shows as EOF, an idle one is fine
        except (OSError, EOFError) as e:
            sock.close()
            raise TransferError(f"cannot connect to shm peer {self.peer} within {timeout:.1f}s: {e!r}") from None
        except RuntimeError as e:  # exporting CUDA memory failed
            sock.close()
            raise TransferError(f"cannot export the KV caches to shm peer {self.peer}: {e}") from None
        _handshake.check_reply(reply, self._intro.layout, self.peer)

    def _read_acks(self) -> None:
        try:
            while True:
                msg, _ = self._channel.recv()
                for transfer_id, layer, nbytes, refusal in msg["a"]:  # a batch of layers, in order
                    if refusal:
                        self._book.fail(transfer_id, TransferError(f"receiver {self.peer} refused layer {layer}: "
                                                                   f"{refusal}"))
                    else:
                        self._book.layer_done(transfer_id, layer, nbytes)
        except EOFError as e:
            self._break(TransferError(f"connection to shm peer {self.peer} lost: {e}"))

    def _break(self, error: TransferError) -> None:
        """Give up this connection: fail what went through it; the next transfer reconnects."""
        if self.error is not None:
            return
        self.error = error
        self._on_broken(self)
        self._connected.set()
        self._book.fail_peer(self.peer, error)
        if self._channel is not None:
            self._channel.close()
        self._queue.put(None)  # ends the writer (its later messages belong to failed transfers)

    def close(self) -> None:
        if self._channel is not None and self.error is None:
            self._queue.put(({"k": "bye"}, None))
        self._queue.put(None)
        self._threads[0].join(timeout=2)
        self.error = self.error or TransferError("shm connector closed")
        if self._channel is not None:
            self._channel.close()

    def join(self, timeout: float) -> None:
        for thread in self._threads:
            thread.join(timeout)


class Inbound:
    """One sender's connection, receiving side: a thread that checks, copies and acks each layer."""

    def __init__(self, channel: Channel, receiver: ShmReceiver) -> None:
        self._channel, self._receiver = channel, receiver
        self._book = receiver.books.received
        self._timeout = receiver.config.connect_timeout
        self._layout: KVLayout | None = None  # the sender's
        self._mapping: PeerMapping | PeerCudaMemory | None = None
        self._offsets: list[int] = []
        self._layer_bytes = 0
        self._seen: dict[str, None] = {}  # transfer ids that came this way, oldest first (bounded)
        self._lists: dict[str, tuple[list[int], list[int]] | None] = {}  # as the sender's (None: refused)
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvrelay-shm-recv")

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._channel.close()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        error = None
        try:
            if self._accept():
                self._serve()
        except (EOFError, OSError) as e:  # the sender died (EOF, or a broken pipe when acking)
            error = TransferError(f"connection to sender lost: {e!r}")
        except Exception as e:  # noqa: BLE001 - a bad message ends this connection, not the node
            logger.warning("shm connection from a sender failed: %r", e)
            error = TransferError(f"sender connection: {e!r}")
        # Unmapped before anyone hears of the failure: a failed transfer means the dead sender's memory is gone.
        self._channel.close()
        if self._mapping is not None:
            self._mapping.close()
        self._receiver.forget_inbound(self)
        if error is not None:
            for transfer_id in self._seen:
                self._book.fail_unfinished(transfer_id, error)

    def _accept(self) -> bool:
        self._channel.sock.settimeout(self._timeout)
        hello, fds = self._channel.recv()
        self._channel.sock.settimeout(None)
        ours = self._receiver.registered_layout
        try:
            theirs = KVLayout.from_dict(hello["layout"])
            refusal = _handshake.judge(ours, theirs)
            if refusal is not None:
                raise refusal
            self._mapping = _open_segment(theirs, hello, fds, self._receiver.kv_device)
        except TransferError as e:
            for fd in fds:
                os.close(fd)
            reply = _handshake.refuse(self._receiver.books, ours, e, hello.get("t"), "shm")
            self._channel.send(reply)
            try:  # closing at once could drop the refusal in flight: let the sender hang up first
                self._channel.sock.settimeout(self._timeout)
                self._channel.recv()
            except (EOFError, OSError):
                pass
            return False
        if hello.get("t") is not None:  # its first transfer: fail it too if the sender dies before a layer
            self._seen[hello["t"]] = None
        self._layout, self._offsets = theirs, list(hello["offsets"])
        self._layer_bytes = theirs.num_blocks * 2 * theirs.block_nbytes
        self._channel.send(_handshake.accepted(ours))
        return True

    def _serve(self) -> None:
        while True:
            first, _ = self._channel.recv()
            layers: list[dict] = []
            for msg in [first, *self._channel.buffered(_MAX_BATCH - 1)]:  # in order: a batch ends at any other kind
                if msg["k"] == "layers":
                    layers.extend(_layer_messages(msg))
                    continue
                self._receive_layers(layers)
                layers = []
                if msg["k"] == "abort":
                    self._book.fail(msg["t"], TransferError(f"sender aborted: {msg['e']}"))
                elif msg["k"] == "bye":
                    return
            self._receive_layers(layers)

    def _receive_layers(self, msgs: list[dict]) -> None:
        """Check and copy a batch of layers, then ack each. A layer let in counts as landing until its copy is
        done (on CUDA: its connection's stream synchronized), whatever becomes of the rest of the batch."""
        if not msgs:
            return
        acks = []
        with contextlib.ExitStack() as landing:
            with self._mapping.copying():
                for msg in msgs:
                    refusal, lists = self._check(msg, landing)
                    nbytes = 0 if lists is None else self._copy(msg["l"], *lists)
                    acks.append((msg["t"], msg["l"], nbytes, refusal))
            for transfer_id, layer, nbytes, refusal in acks:
                if refusal is None:
                    self._book.layer_done(transfer_id, layer, nbytes)
        self._channel.send({"k": "acks", "a": acks})

    def _check(self, msg: dict, landing: contextlib.ExitStack) -> tuple[str | None, tuple | None]:
        """(why a layer is refused (its transfer fails), or None, and its block lists): a layer let in is
        admitted until `landing` closes. A transfer's lists are checked against the sender's cache once."""
        transfer_id = msg["t"]
        self._seen[transfer_id] = None
        if len(self._seen) > _MAX_SEEN:
            del self._seen[next(iter(self._seen))]
        if "s" in msg:
            src, dst = msg["s"], msg["d"]
            inside = len(src) == len(dst) and not (src and (min(src) < 0 or max(src) >= self._layout.num_blocks))
            _remember(self._lists, transfer_id, (src, dst) if inside else None)
        lists = self._lists.get(transfer_id)
        if lists is None:
            refusal = f"transfer {transfer_id!r}: src blocks outside the sender's cache, or none named"
        else:
            refusal = landing.enter_context(self._book.admitting(transfer_id, msg["l"], lists[1]))
        if refusal is not None:
            self._book.fail(transfer_id, TransferError(refusal))
            return refusal, None
        return None, lists

    def _copy(self, layer: int, src: list[int], dst: list[int]) -> int:
        start = self._offsets[layer]
        src_bytes = self._mapping.bytes[start : start + self._layer_bytes]
        return self._receiver.copy_layer(layer, src_bytes, src, dst, self._layout)


def _coalesced(msgs: list[dict]) -> list[dict]:
    """Layer messages as layers messages: a run of layers of one transfer (the same blocks) becomes one message
    naming them all, so that a batch costs one send and one receive however many layers it holds."""
    out: list[dict] = []
    for msg in msgs:
        last = out[-1] if out else None
        if msg["k"] != "layer":
            out.append(msg)
        elif (last is not None and last["k"] == "layers" and last["t"] == msg["t"] and last["s"] == msg["s"]
              and last["d"] == msg["d"]):
            last["ls"].append(msg["l"])
        else:
            out.append({"k": "layers", "t": msg["t"], "ls": [msg["l"]], "s": msg["s"], "d": msg["d"]})
    return out


def _layer_messages(msg: dict) -> list[dict]:
    """A layers message as one message per layer, the first with the block lists when it names them."""
    first = {"k": "layer", "t": msg["t"], "l": msg["ls"][0]} if msg["ls"] else None
    if first is not None and "s" in msg:
        first["s"], first["d"] = msg["s"], msg["d"]
    rest = [{"k": "layer", "t": msg["t"], "l": layer} for layer in msg["ls"][1:]]
    return ([first] if first is not None else []) + rest


def _open_segment(
    theirs: KVLayout, hello: dict, fds: list[int], ours: torch.device | None
) -> PeerMapping | PeerCudaMemory:
    """The sender's segment, once it is seen to hold every layer's cache where it says: a memfd mapped
    read-only, or CUDA memory opened on this node's GPU, the same as the sender's (`ours`: this node's caches'
    device)."""
    layer_bytes = theirs.num_blocks * 2 * theirs.block_nbytes
    offsets, size, cuda = hello["offsets"], hello["size"], hello.get("cuda")
    if len(fds) != (0 if cuda is not None else 1) or len(offsets) != theirs.num_layers or any(
        not 0 <= o <= size - layer_bytes for o in offsets
    ):
        raise TransferError("sender's shared segment does not hold its caches")
    on_gpu = ours is not None and ours.type == "cuda"
    if cuda is None:
        if on_gpu:
            raise TransferError(f"the sender's KV caches are in host memory, this receiver's on {ours} (use ucx, "
                                "or auto)")
        try:
            return PeerMapping(fds.pop(), size)
        except (ValueError, OSError) as e:
            raise TransferError(f"cannot map the sender's shared segment: {e}") from None
    export = CudaExport.from_msg(cuda)
    if export.size != size:
        raise TransferError("sender's shared segment does not hold its caches")
    why = _cuda_ipc.refusal(export, _cuda_ipc.device_uuid(ours) if on_gpu else None)
    if why is not None:
        raise TransferError(why)
    return PeerCudaMemory(export, ours)
