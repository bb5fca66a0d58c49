"""The two ends of one shm connection (kv_transfer/shm.py): the sender's Outbound (a writer thread posts the
queued messages in order, an ack reader books the layers) and the receiver's Inbound (a thread that
checks, copies and acks each layer). Their owner, the ShmConnector, keeps the books and does the copies."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from typing import TYPE_CHECKING

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer._shm_io import Channel, PeerMapping, parse_address
from kvrelay.kv_transfer.types import LayoutMismatchError, TransferError, layout_mismatch

if TYPE_CHECKING:
    from kvrelay.kv_transfer.shm import ShmConnector

logger = logging.getLogger(__name__)

_MAX_SEEN = 4096  # transfer ids a connection remembers, to fail the unfinished ones if it breaks


class Outbound:
    """One connection to a receiver, sending side: a writer thread posts the queued messages in order (the
    engine thread only enqueues), an ack reader books the layers."""

    def __init__(self, owner: ShmConnector, peer: str, first_transfer_id: str | None) -> None:
        self.owner, self.peer = owner, peer
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.connected = threading.Event()
        self.error: TransferError | None = None
        self.channel: Channel | None = None
        self.threads = [threading.Thread(target=self._write, args=(first_transfer_id,), daemon=True,
                                         name="kvrelay-shm-send")]
        self.threads[0].start()

    def post(self, msg: dict) -> None:
        self.queue.put(msg)

    def wait_connected(self, timeout: float) -> None:
        if not self.connected.wait(timeout):
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
        self.threads.append(reader)
        reader.start()
        self.connected.set()
        try:
            while True:
                msg = self.queue.get()
                if msg is None:
                    return
                self.channel.send(msg)
        except OSError as e:
            self._break(TransferError(f"connection to shm peer {self.peer} lost: {e!r}"))

    def _handshake(self, transfer_id: str | None) -> None:
        _, path = parse_address(self.peer)
        timeout = self.owner.config.connect_timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
            self.channel = Channel(sock)
            hello, fd = self.owner.hello(transfer_id)
            self.channel.send(hello, fds=(fd,))
            reply, _ = self.channel.recv()
            sock.settimeout(None)  # from now on a dead peer shows as EOF, an idle one is fine
        except (OSError, EOFError) as e:
            sock.close()
            raise TransferError(f"cannot connect to shm peer {self.peer} within {timeout:.1f}s: {e!r}") from None
        if not reply["ok"]:
            theirs = reply.get("layout")
            layout = self.owner.layout
            refusal = layout_mismatch(layout, KVLayout.from_dict(theirs), "sender", "receiver") if theirs else None
            if refusal is not None:
                raise LayoutMismatchError(f"refused by receiver {self.peer}: {refusal}", refusal.mismatches)
            raise TransferError(f"refused by receiver {self.peer}: {reply['error']}")

    def _read_acks(self) -> None:
        book = self.owner._sent
        try:
            while True:
                ack, _ = self.channel.recv()
                if ack["e"]:
                    book.fail(ack["t"], TransferError(f"receiver {self.peer} refused layer {ack['l']}: {ack['e']}"))
                else:
                    book.layer_done(ack["t"], ack["l"], ack["n"])
        except EOFError as e:
            self._break(TransferError(f"connection to shm peer {self.peer} lost: {e}"))

    def _break(self, error: TransferError) -> None:
        """Give up this connection: fail what went through it; the next transfer reconnects."""
        if self.error is not None:
            return
        self.error = error
        self.owner._drop_peer(self)
        self.connected.set()
        self.owner._sent.fail_peer(self.peer, error)
        if self.channel is not None:
            self.channel.close()
        self.queue.put(None)  # ends the writer (its later messages belong to failed transfers)

    def close(self) -> None:
        if self.channel is not None and self.error is None:
            self.queue.put({"k": "bye"})
        self.queue.put(None)
        self.threads[0].join(timeout=2)
        self.error = self.error or TransferError("shm connector closed")
        if self.channel is not None:
            self.channel.close()


class Inbound:
    """One sender's connection, receiving side: a thread that checks, copies and acks each layer."""

    def __init__(self, owner: ShmConnector, channel: Channel) -> None:
        self.owner, self.channel = owner, channel
        self.layout: KVLayout | None = None
        self.mapping: PeerMapping | None = None
        self.offsets: list[int] = []
        self.layer_bytes = 0
        self.seen: dict[str, None] = {}  # transfer ids that came this way, oldest first (bounded)
        self.thread = threading.Thread(target=self._run, daemon=True, name="kvrelay-shm-recv")

    def start(self) -> None:
        self.thread.start()

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
        self.channel.close()
        if self.mapping is not None:
            self.mapping.close()
        self.owner.forget_inbound(self)
        if error is not None:
            for transfer_id in self.seen:
                self.owner._received.fail_unfinished(transfer_id, error)

    def _accept(self) -> bool:
        self.channel.sock.settimeout(self.owner.config.connect_timeout)
        hello, fds = self.channel.recv()
        self.channel.sock.settimeout(None)
        try:
            self.layout, self.mapping = self.owner.accept_hello(hello, fds)
        except TransferError as e:
            for fd in fds:
                os.close(fd)
            logger.error("refused shm sender: %s", e)
            self.owner.metrics.add(refused_handshakes=1)
            if hello.get("t") is not None:
                mismatches = e.mismatches if isinstance(e, LayoutMismatchError) else {}
                self.owner._received.fail(hello["t"], LayoutMismatchError(f"refused sender: {e}", mismatches))
            layout = self.owner._layout.to_dict() if self.owner._layout else None
            self.channel.send({"ok": False, "error": str(e), "layout": layout})
            try:  # closing at once could drop the refusal in flight: let the sender hang up first
                self.channel.sock.settimeout(self.owner.config.connect_timeout)
                self.channel.recv()
            except (EOFError, OSError):
                pass
            return False
        if hello.get("t") is not None:  # its first transfer: fail it too if the sender dies before a layer
            self.seen[hello["t"]] = None
        self.offsets = list(hello["offsets"])
        self.layer_bytes = self.layout.num_blocks * 2 * self.layout.block_nbytes
        self.channel.send({"ok": True, "layout": self.owner.layout.to_dict()})
        return True

    def _serve(self) -> None:
        while True:
            msg, _ = self.channel.recv()
            kind = msg["k"]
            if kind == "layer":
                self.seen[msg["t"]] = None
                if len(self.seen) > _MAX_SEEN:
                    del self.seen[next(iter(self.seen))]
                refusal, nbytes = self.owner.receive_layer(self, msg)
                self.channel.send({"k": "ack", "t": msg["t"], "l": msg["l"], "n": nbytes, "e": refusal})
            elif kind == "abort":
                self.owner._received.fail(msg["t"], TransferError(f"sender aborted: {msg['e']}"))
            elif kind == "bye":
                return
