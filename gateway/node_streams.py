"""The Generate streams of many sequences to one node over a single GenerateMany call (the node's end is
kvrelay.node.multiplex). With 32 sequences on a node the gateway receives one message per engine step instead of
32, and each sequence still sees exactly what its own Generate call would give: its chunks in order, then the
end, or NodeRpcError with the status and error kind that call would have ended with.

Lifecycle:
1. The first sequence opens the call; a reader task hands each update to its sequence's queue.
2. A sequence registers its queue, then writes its `start` (one write at a time, as grpc.aio requires).
3. It ends on its `end` update; or on its deadline (a timer puts a marker in its queue), when its CallWatch fails
   it (the liveness monitor), or when its consumer leaves early: in those three cases a `cancel` goes to the node,
   which aborts the sequence there.
4. When the call ends (the node died or restarted, the channel closed) every sequence on it fails with the call's
   status, as their own calls would have; the next sequence opens a new call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from kvrelay.common import wire
from kvrelay.gateway.node_errors import CallWatch, NodeRpcError
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_METHOD = "Generate"  # what errors name: each sequence is a Generate carried over the shared call


class _Marker:
    """Put in a sequence's queue by something other than the node: its watch, its deadline, the call's end."""

    __slots__ = ("error",)

    def __init__(self, error: NodeRpcError) -> None:
        self.error = error


class _WatchHandle:
    """What a CallWatch cancels: this sequence only, not the call it shares."""

    __slots__ = ("_queue", "_watch", "_address")

    def __init__(self, queue: asyncio.Queue, watch: CallWatch, address: str) -> None:
        self._queue, self._watch, self._address = queue, watch, address

    def cancel(self) -> None:
        reason = self._watch.error or "cancelled by the liveness watch"
        self._queue.put_nowait(_Marker(NodeRpcError(self._address, _METHOD, grpc.StatusCode.UNAVAILABLE, reason)))


class SequenceStream:
    """One GenerateMany call to a node, shared by the sequences the gateway runs there."""

    def __init__(self, address: str, stub: pb_grpc.EngineStub) -> None:
        self.address = address
        self._call = stub.GenerateMany()
        self._queues: dict[str, asyncio.Queue] = {}
        self._write_lock = asyncio.Lock()
        self._error: NodeRpcError | None = None
        self._answered = False  # a response came on this call
        self._cancels: set[asyncio.Task] = set()
        self._reader = asyncio.create_task(self._read())

    @property
    def ended(self) -> bool:
        return self._error is not None

    def refused(self, error: NodeRpcError) -> bool:
        """Whether `error` says the node has no GenerateMany (an older node): the call ended before any answer,
        not from the node's own code (which names every error's kind), as UNIMPLEMENTED, or as INTERNAL or UNKNOWN,
        which grpc.aio reports instead, depending on timing, for a stream-stream method a servicer lacks."""
        return (self.ended and not self._answered and error.kind is None
                and error.code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN))

    def close(self) -> None:
        self._call.cancel()

    async def sequence(self, msg: pb.GenerateRequest, deadline: float | None,
                       watch: CallWatch | None) -> AsyncIterator[pb.TokenChunk]:
        """The sequence's chunks; leaving the loop early cancels it on the node."""
        rid = msg.request_id
        if self._error is not None:
            raise self._error
        if rid in self._queues:
            raise NodeRpcError(self.address, _METHOD, grpc.StatusCode.ALREADY_EXISTS,
                               f"request {rid!r} is already streaming from this node",
                               wire.NodeErrorKind.DUPLICATE.value)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        timer = None
        if deadline is not None:
            late = NodeRpcError(self.address, _METHOD, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.monotonic()),
                                                          queue.put_nowait, _Marker(late))
        if watch is not None:
            watch.call = _WatchHandle(queue, watch, self.address)
        over = False  # the node ended it (with the call gone, there is nothing to cancel either)
        try:
            await self._write(pb.GenerateManyRequest(start=msg))
            while True:
                item = await queue.get()
                if isinstance(item, _Marker):
                    raise item.error
                if watch is not None:
                    watch.output()
                if item.HasField("chunk"):
                    yield item.chunk
                if item.end:
                    over = True
                    if item.error_code:
                        raise NodeRpcError(self.address, _METHOD, _CODES.get(item.error_code, grpc.StatusCode.UNKNOWN),
                                           item.error_message, item.error_kind or None)
                    return
        finally:
            del self._queues[rid]
            if timer is not None:
                timer.cancel()
            if watch is not None:
                watch.call = None
            if not over and self._error is None:
                self._cancel(rid)

    async def _write(self, msg: pb.GenerateManyRequest) -> None:
        """Raises the call's final status if the call has ended (every sequence on it sees the same one)."""
        try:
            async with self._write_lock:
                await self._call.write(msg)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            await asyncio.wait({self._reader})  # ends with the call: its status is the one to report
            raise self._error or NodeRpcError(self.address, _METHOD, grpc.StatusCode.UNAVAILABLE,
                                              f"the stream to the node ended: {e}") from None

    def _cancel(self, rid: str) -> None:
        async def send() -> None:
            try:
                await self._write(pb.GenerateManyRequest(cancel=rid))
            except NodeRpcError:
                pass  # the call is gone, and the sequence with it

        task = asyncio.create_task(send())
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def _read(self) -> None:
        error = NodeRpcError(self.address, _METHOD, grpc.StatusCode.UNAVAILABLE, "the node ended the stream")
        try:
            async for response in self._call:
                self._answered = True
                for update in response.updates:
                    queue = self._queues.get(update.request_id)
                    if queue is not None:
                        queue.put_nowait(update)
        except grpc.aio.AioRpcError as e:
            error = NodeRpcError.from_grpc(self.address, _METHOD, e)
        except asyncio.CancelledError:
            error = NodeRpcError(self.address, _METHOD, grpc.StatusCode.CANCELLED, "the stream was closed")
            raise
        finally:
            self._error = error
            for queue in self._queues.values():
                queue.put_nowait(_Marker(error))
