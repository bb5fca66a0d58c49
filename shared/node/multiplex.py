"""GenerateMany: the Generate calls of many sequences over one gRPC stream.

A gateway with 32 sequences on a node used to get 32 messages per engine step, each a wake-up of gRPC's
poller and of both event loops. Over one stream the node sends what a step produced as one message.

Lifecycle:
1. The reader takes the caller's messages: `start` begins a sequence (a task running the same chunk generator
   as Generate), `cancel` cancels that task, which aborts the sequence in the engine as a cancelled Generate does.
2. A sequence's task appends its chunks to the outbox, then one last update (`end`, with the status Generate
   would have ended with if it failed).
3. The writer sends the whole outbox as one message whenever it holds something. The engine thread hands a
   step's outputs to the event loop in one callback, so the tasks it wakes all append before the writer runs.
4. The stream ends when the caller has half-closed and its sequences are over; when the call itself ends (the
   caller went away) every sequence still running is cancelled.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import grpc

from kvrelay.common import wire
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb

ChunkSource = Callable[[pb.GenerateRequest], AsyncIterator[pb.TokenChunk]]
StatusOf = Callable[[Exception], tuple[grpc.StatusCode, str, wire.NodeErrorKind]]


class SequenceMux:
    """One GenerateMany call: `chunks(request)` streams a sequence as Generate would; `status_of(error)` is
    the status Generate would have ended with."""

    def __init__(self, chunks: ChunkSource, status_of: StatusOf) -> None:
        self._chunks = chunks
        self._status_of = status_of
        self._tasks: dict[str, asyncio.Task] = {}
        self._outbox: list[pb.SequenceUpdate] = []
        self._wake = asyncio.Event()
        self._sending = False  # a message is out with gRPC, which asks for the next once it has sent it

    @property
    def settled(self) -> bool:
        """No sequence running and nothing left to hand to gRPC (a draining node waits for this)."""
        return not self._tasks and not self._outbox and not self._sending

    async def run(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> AsyncIterator[pb.GenerateManyResponse]:
        reader = asyncio.create_task(self._read(requests))
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                if self._outbox:
                    updates, self._outbox = self._outbox, []
                    self._sending = True
                    yield pb.GenerateManyResponse(updates=updates)
                    self._sending = False
                if reader.done():
                    reader.result()  # the caller's stream failed: end the call with that error
                    if not self._tasks and not self._outbox:  # updates put while the last message went out
                        return  # are sent first (the last sequence's final chunk and end, say)
        finally:
            tasks = [reader, *self._tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.GenerateManyRequest]) -> None:
        try:
            async for msg in requests:
                if msg.HasField("start"):
                    self._start(msg.start)
                elif msg.HasField("cancel") and (task := self._tasks.get(msg.cancel)) is not None:
                    task.cancel()
        finally:
            self._wake.set()

    def _start(self, request: pb.GenerateRequest) -> None:
        rid = request.request_id
        if rid in self._tasks:
            self._end(rid, grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running on this stream",
                      wire.NodeErrorKind.DUPLICATE)
            return
        task = self._tasks[rid] = asyncio.create_task(self._sequence(request))
        # A done callback, not a `finally` in the task: a task cancelled before its first step never runs its
        # body (a cancel read in the same batch as its start), and would hold the stream open for ever.
        task.add_done_callback(lambda done: self._over(rid, done))

    def _over(self, rid: str, task: asyncio.Task) -> None:
        if self._tasks.get(rid) is task:
            del self._tasks[rid]
        self._wake.set()

    async def _sequence(self, request: pb.GenerateRequest) -> None:
        rid = request.request_id
        try:
            async with aclosing(self._chunks(request)) as chunks:
                async for chunk in chunks:
                    self._put(pb.SequenceUpdate(request_id=rid, chunk=chunk))
            self._put(pb.SequenceUpdate(request_id=rid, end=True))
        except asyncio.CancelledError:
            pass  # the caller cancelled it and expects nothing more
        except Exception as e:  # noqa: BLE001 - sent as the sequence's status, bugs logged by status_of
            self._end(rid, *self._status_of(e))

    def _end(self, rid: str, code: grpc.StatusCode, message: str, kind: wire.NodeErrorKind) -> None:
        self._put(pb.SequenceUpdate(request_id=rid, end=True, error_code=code.value[0], error_message=message,
                                    error_kind=kind.value))

    def _put(self, update: pb.SequenceUpdate) -> None:
        self._outbox.append(update)
        self._wake.set()
