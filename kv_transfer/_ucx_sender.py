"""The sending half of a UCX connection (kv_transfer/ucx.py): layers go out in order, up to
max_inflight_layers on the wire. It gets its connector's caches (WireCaches), its book of sent transfers and a
callback for when it breaks at construction, and runs on the UCX loop thread."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvrelay.common.records import KVLayout
from kvrelay.kv_transfer import _blocks, _handshake
from kvrelay.kv_transfer._book import TransferBook
from kvrelay.kv_transfer._ucx_runtime import parse_peer, recv_msg, send_msg, tag, ucxx
from kvrelay.kv_transfer._wire import Job, OutgoingLayer, WireCaches
from kvrelay.kv_transfer.types import TransferError

logger = logging.getLogger(__name__)


class SenderPeer:
    """One connection to a receiver: layers sent in order, up to max_inflight_layers on the wire."""

    def __init__(self, peer: str, first_transfer_id: str | None, *, caches: WireCaches, book: TransferBook,
                 error_handling: bool, on_broken: Callable[[SenderPeer], None]):
        self.peer = peer
        self.config = caches.config
        self._caches, self._book, self._error_handling, self._on_broken = caches, book, error_handling, on_broken
        self.queue: asyncio.Queue = asyncio.Queue()
        self.inflight = asyncio.Semaphore(self.config.max_inflight_layers)
        self.ctrl_lock = asyncio.Lock()
        self.connected: asyncio.Future = asyncio.get_running_loop().create_future()
        self.ctrl: object | None = None
        self.data: object | None = None
        self.conn_id, self.seq = 0, 0
        self.pending: dict[tuple[str, int], int] = {}  # (transfer, layer) -> bytes, until acked
        self.tasks: set[asyncio.Task] = set()
        self.closing = False
        self._spawn(self._run(first_transfer_id))

    async def connected_or_raise(self) -> None:
        await asyncio.shield(self.connected)

    def post(self, job: Job) -> None:
        self.queue.put_nowait(job)

    def post_abort(self, transfer_id: str, reason: str) -> None:
        """Tell the receiver that a transfer failed on this side, after the layers already queued."""
        self.queue.put_nowait(("abort", transfer_id, reason))

    def _spawn(self, coro: object) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _run(self, first_transfer_id: str | None) -> None:
        try:
            await self._connect(first_transfer_id)
        except TransferError as e:
            self._break(e)
            return
        except (Exception, asyncio.TimeoutError) as e:  # noqa: BLE001 - e.g. no common transport for data
            self._break(TransferError(f"cannot open a data endpoint to ucx peer {self.peer}: {e!r}"))
            return
        self.connected.set_result(None)
        self._spawn(self._read_acks())
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, tuple):
                    await self._send_ctrl({"kind": "abort", "transfer_id": item[1], "error": item[2]})
                else:
                    await self._send_layer(item)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._break(TransferError(f"connection to ucx peer {self.peer} lost: {e!r}"))

    async def _connect(self, transfer_id: str | None) -> None:
        layout = self._caches.layout
        reply = await self._hello(layout, transfer_id)
        _handshake.check_reply(reply, layout, self.peer)
        self.conn_id = reply["conn_id"]
        address = ucxx.get_ucx_address_from_buffer(bytes.fromhex(reply["worker_address"]))
        create = ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=self._error_handling)
        self.data = await asyncio.wait_for(create, self.config.connect_timeout)

    async def _hello(self, layout: KVLayout, transfer_id: str | None) -> dict:
        host, port = parse_peer(self.peer)
        timeout = self.config.connect_timeout
        why = None
        try:
            create = ucxx.create_endpoint(host, port, connect_timeout=timeout)
            self.ctrl = await asyncio.wait_for(create, timeout + 1)
            await send_msg(self.ctrl, {"layout": layout.to_dict(), "transfer_id": transfer_id})
            return await asyncio.wait_for(recv_msg(self.ctrl), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            why = "no answer (nothing listening there, or unreachable)"
        except Exception as e:  # noqa: BLE001 - any failure here means unreachable
            why = repr(e)
        # Raised outside the except clause: a chained cause's traceback would pin ucxx frames (and with them
        # the UCX context) for as long as the error is kept, and ucxx.reset() refuses while they live.
        raise TransferError(f"cannot connect to ucx peer {self.peer} within {timeout:.1f}s: {why}")

    async def _send_ctrl(self, msg: dict) -> None:
        async with self.ctrl_lock:  # send_obj is two messages: keep concurrent senders from interleaving
            await send_msg(self.ctrl, msg)

    async def _send_layer(self, job: Job) -> None:
        if self._book.error_of(job.transfer_id) is not None:
            return  # already failed (refused, aborted): spare the wire
        await self.inflight.acquire()
        try:
            while job.ready is not None and not job.ready.query():
                await asyncio.sleep(2e-4)  # the layer's kernels are still running
            out = self._caches.outgoing(job)
            seq, self.seq = self.seq, self.seq + len(out.sources)
            self.pending[(job.transfer_id, job.layer)] = out.nbytes
            await self._send_ctrl(out.header | {"seq": seq})
        except Exception as e:
            self.inflight.release()
            error = TransferError(f"sending layer {job.layer} to {self.peer} failed: {e!r}")
            self._book.fail(job.transfer_id, error)
            self.post_abort(job.transfer_id, str(error))
            return
        self._spawn(self._send_data(job, out, seq))

    async def _send_data(self, job: Job, out: OutgoingLayer, seq: int) -> None:
        sends = [
            self.data.send(_blocks.wire_buffer(src), tag=tag(self.conn_id, seq + i), force_tag=True)
            for i, src in enumerate(out.sources)
        ]
        try:
            await asyncio.wait_for(asyncio.gather(*sends), self.config.transfer_timeout)
            out.release()  # not on failure: UCX may still be reading the staging
        except (Exception, asyncio.TimeoutError) as e:  # noqa: BLE001
            # The message stream is out of step with the receiver now: the connection cannot be reused.
            self._break(
                TransferError(f"sending layer {job.layer} of {job.transfer_id!r} to {self.peer}: {e!r}")
            )
        finally:
            self.inflight.release()

    async def _read_acks(self) -> None:
        try:
            while True:
                ack = await recv_msg(self.ctrl)
                nbytes = self.pending.pop((ack["transfer_id"], ack["layer"]), 0)
                if ack["error"]:
                    error = TransferError(
                        f"receiver {self.peer} refused layer {ack['layer']}: {ack['error']}"
                    )
                    self._book.fail(ack["transfer_id"], error)
                else:
                    self._book.layer_done(ack["transfer_id"], ack["layer"], nbytes)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            self._break(TransferError(f"connection to ucx peer {self.peer} lost: {e!r}"))

    def _break(self, error: TransferError) -> None:
        """Give up this connection: fail what went through it; the next transfer reconnects."""
        self._on_broken(self)
        if not self.connected.done():
            self.connected.set_exception(error)
            self.connected.exception()  # mark retrieved: connect() may never be called
        if self.closing:
            return
        self._book.fail_peer(self.peer, error)
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, Job):
                self._book.fail(item.transfer_id, error)
        self._teardown()

    def _teardown(self) -> None:
        current = asyncio.current_task()
        for task in list(self.tasks):
            if task is not current:
                task.cancel()
        for ep in (self.data, self.ctrl):
            if ep is not None:
                ep.abort()  # also when already closed by an error: abort drops the UCX context reference

    async def close(self) -> None:
        self.closing = True
        if self.connected.done() and self.connected.exception() is None:
            try:
                await asyncio.wait_for(self._send_ctrl({"kind": "bye"}), 1.0)
            except (Exception, asyncio.TimeoutError):  # noqa: BLE001 - best effort on the way out
                pass
        self._teardown()
        await asyncio.gather(*self.tasks, return_exceptions=True)
