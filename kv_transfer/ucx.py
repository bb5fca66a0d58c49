"""UCX connector (ucxx).

Two endpoints per sender->receiver pair. The control endpoint comes from the receiver's listener, with error
handling on (ucxx forces it for listener connections, and it is what turns a dead peer into an error): it
carries the layout handshake, one JSON header per layer, and the receiver's per-layer acks. The data endpoint
is created from the receiver's UCX worker address and carries only block bytes as tagged messages; its error
handling follows the transport, because UCX only uses shared memory on endpoints without it. Tags are
(connection id << 32 | message sequence number), so every data message has a unique tag at the receiver.

CUDA caches work the same way: buffers are handed to ucxx through __cuda_array_interface__, the sender waits
on a CUDA event recorded by send_blocks, and each side synchronizes its copies before UCX or a waiter reads
them. Use transport "auto" (or ucx_tls with cuda_copy,cuda_ipc) so that UCX loads its CUDA transports.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable

import torch

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer import _blocks, _handshake
from kvrelay.kv_transfer._book import TransferBook, TransferBooks
from kvrelay.kv_transfer._ucx_runtime import UcxRuntime, parse_peer, recv_msg, send_msg, tag, ucx_settings, ucxx
from kvrelay.kv_transfer._ucx_sender import SenderPeer
from kvrelay.kv_transfer._wire import WireCaches
from kvrelay.kv_transfer.base import KVConnector
from kvrelay.kv_transfer.types import ConnectorConfig, TransferError

logger = logging.getLogger(__name__)


class UcxConnector(KVConnector):
    name = "ucx"

    def __init__(self, config: ConnectorConfig, books: TransferBooks | None = None):
        super().__init__(config, books)
        tls, self._error_handling = ucx_settings(config)
        self._rt = UcxRuntime.acquire(tls, timeout=max(config.connect_timeout, 10.0))
        self._peers: dict[str, SenderPeer] = {}  # touched on the loop thread only
        self._serving: set[asyncio.Task] = set()
        self._conn_ids: set[int] = set()
        self._closed = False
        self._staging = _blocks.StagingPool()
        self._wire: WireCaches | None = None  # once the caches are registered
        try:
            self._listener = self._rt.run(self._listen(), timeout=max(config.connect_timeout, 10.0))
            self._port: int = self._listener.port
        except BaseException:
            self._rt.release()
            raise

    @property
    def address(self) -> str:
        return f"ucx://{self.config.host}:{self._port}"

    def register_kv_caches(self, layout: KVLayout, kv_caches: list[torch.Tensor]) -> None:
        super().register_kv_caches(layout, kv_caches)
        self._wire = WireCaches(self.config, layout, tuple(kv_caches), self._staging, self._received)

    def connect(self, peer: str, timeout: float | None = None) -> None:
        wait = self.config.connect_timeout + 1 if timeout is None else timeout
        self._rt.run(self._connect_peer(peer), timeout=wait)

    def send_blocks(
        self, peer: str, transfer_id: str, layer: int, src_block_ids: list[int], dst_block_ids: list[int]
    ) -> None:
        self._check_send_args(transfer_id, layer, src_block_ids, dst_block_ids)
        parse_peer(peer)  # a malformed address is the caller's bug: raise here, not on the transfer thread
        if self._closed:
            raise TransferError("ucx connector is closed")
        if not self._sent.enqueue_layer(transfer_id, self.layout.num_layers, layer, peer):
            return
        job = self._wire.job(transfer_id, layer, src_block_ids, dst_block_ids)
        self._rt.call_soon(lambda: self._peer(peer, transfer_id).post(job))

    def _abort_remote(self, peer: str, transfer_id: str, reason: str) -> None:
        self._rt.call_soon(self._abort, peer, transfer_id, reason)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._rt.run(self._shutdown(), timeout=10)
        except TransferError as e:
            logger.warning("ucx connector close: %s", e)
        error = TransferError("ucx connector closed")
        self._sent.fail_all(error)
        self._received.fail_all(error)
        self._rt.release()

    # -- loop-thread internals -------------------------------------------------------------------------
    def _peer(self, peer: str, first_transfer_id: str | None) -> SenderPeer:
        sender = self._peers.get(peer)
        if sender is None:
            if self._wire is None:
                raise TransferError("ucx connector cannot send before register_kv_caches()")
            sender = self._peers[peer] = SenderPeer(
                peer, first_transfer_id, caches=self._wire, book=self._sent,
                error_handling=self._error_handling, on_broken=self._forget_peer,
            )
        return sender

    def _forget_peer(self, sender: SenderPeer) -> None:
        if self._peers.get(sender.peer) is sender:
            del self._peers[sender.peer]

    async def _connect_peer(self, peer: str) -> None:
        await self._peer(peer, None).connected_or_raise()

    def _abort(self, peer: str, transfer_id: str, reason: str) -> None:
        sender = self._peers.get(peer)
        if sender is not None:
            sender.post_abort(transfer_id, reason)

    async def _listen(self) -> object:
        return ucxx.create_listener(
            self._serve, port=self.config.port or None, connect_timeout=self.config.connect_timeout
        )

    async def _shutdown(self) -> None:
        for sender in list(self._peers.values()):
            await sender.close()
        for task in list(self._serving):
            task.cancel()
        await asyncio.gather(*self._serving, return_exceptions=True)
        self._listener.close()
        self._peers.clear()
        self._listener = None  # ucxx.reset() refuses while anything still references the UCX context

    async def _serve(self, ep: object) -> None:
        task = asyncio.current_task()
        self._serving.add(task)
        inbound: _Inbound | None = None
        try:
            conn_id = await self._accept(ep)
            if conn_id:
                inbound = _Inbound(ep, conn_id, self._received, self._recv_layer, self.config.max_inflight_layers)
                await inbound.run()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a broken connection must fail its transfers, not the loop
            logger.info("ucx connection from a sender ended: %r", e)
            if inbound is not None:
                inbound.fail(TransferError(f"connection to sender lost: {e!r}"))
        finally:
            if inbound is not None:
                inbound.cancel()
                self._conn_ids.discard(inbound.conn_id)
            self._serving.discard(task)
            ep.abort()

    async def _accept(self, ep: object) -> int:
        """Layout handshake; returns the new connection id, or 0 when the sender was refused."""
        hello = await asyncio.wait_for(recv_msg(ep), self.config.connect_timeout)
        ours = self.registered_layout
        refusal = _handshake.judge(ours, KVLayout.from_dict(hello["layout"]))
        if refusal is not None:
            await send_msg(ep, _handshake.refuse(self.books, ours, refusal, hello.get("transfer_id"), "ucx"))
            try:  # closing at once could drop the refusal in flight: let the sender hang up first
                await asyncio.wait_for(recv_msg(ep), self.config.connect_timeout)
            except (Exception, asyncio.TimeoutError):  # noqa: BLE001
                pass
            return 0
        conn_id = random.randrange(1, 1 << 31)
        while conn_id in self._conn_ids:
            conn_id = random.randrange(1, 1 << 31)
        self._conn_ids.add(conn_id)
        reply = _handshake.accepted(ours) | {"conn_id": conn_id}
        await send_msg(ep, reply | {"worker_address": self._rt.worker_address.hex()})
        return conn_id

    async def _recv_layer(self, conn_id: int, msg: dict) -> str | None:
        """Receive one layer into the cache; returns why it was refused, or None."""
        # On a timeout the caller drops the connection, so nothing lands after the block exits.
        with self._wire.landing(msg) as landing:
            recvs = [
                ucxx.recv(_blocks.wire_buffer(buf), tag=tag(conn_id, msg["seq"] + i))
                for i, buf in enumerate(landing.buffers)
            ]
            await asyncio.wait_for(asyncio.gather(*recvs), self.config.transfer_timeout)
        return landing.refusal


class _Inbound:
    """One sender's connection, receiving side. Layers are received concurrently (up to max_inflight_layers)
    so that the next header is read and its receives posted while earlier bytes are still arriving."""

    def __init__(self, ep: object, conn_id: int, book: TransferBook,
                 receive: Callable[[int, dict], Awaitable[str | None]], max_inflight_layers: int):
        self.ep, self.conn_id = ep, conn_id
        self._book, self._receive = book, receive
        self.seen: set[str] = set()
        self.ack_lock = asyncio.Lock()
        self.slots = asyncio.Semaphore(max_inflight_layers)
        self.tasks: set[asyncio.Task] = set()

    async def run(self) -> None:
        while True:
            msg = await recv_msg(self.ep)  # idle until the sender has work; ends when it leaves
            if msg["kind"] == "layer":
                self.seen.add(msg["transfer_id"])
                await self.slots.acquire()
                task = asyncio.get_running_loop().create_task(self._layer(msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif msg["kind"] == "abort":
                error = TransferError(f"sender aborted: {msg['error']}")
                self._book.fail(msg["transfer_id"], error)
            elif msg["kind"] == "bye":
                await asyncio.gather(*self.tasks)
                return

    async def _layer(self, msg: dict) -> None:
        try:
            refusal = await self._receive(self.conn_id, msg)
            ack = {"kind": "ack", "transfer_id": msg["transfer_id"], "layer": msg["layer"], "error": refusal}
            async with self.ack_lock:  # send_obj is two messages: keep concurrent acks from interleaving
                await send_msg(self.ep, ack)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            # The message stream is out of step now: drop the connection; run() sees it and fails the rest.
            logger.warning("ucx receive of layer %s failed: %r", msg["layer"], e)
            self.fail(TransferError(f"receiving layer {msg['layer']} failed: {e!r}"))
            self.ep.abort()
        finally:
            self.slots.release()

    def fail(self, error: TransferError) -> None:
        for transfer_id in self.seen:
            self._book.fail_unfinished(transfer_id, error)

    def cancel(self) -> None:
        for task in list(self.tasks):
            task.cancel()
