"""Kept sequences: a token stream that outlives its caller, so that another gateway can pick it up.

When a gateway dies (kill -9, a crashed pod), every stream through it ends, and the nodes used to abort those
sequences at once. Then a client that reconnected to another gateway could only have its request computed
again, and for a sampled answer it would get different text. A sequence started with `keep_ms` (a keyed request,
see gateway.idempotency) runs in a task of its own instead, which keeps every chunk the sequence produces.
Callers follow that record:
- Generate (or one sequence of GenerateMany) follows it from the first chunk. Attach follows it from any chunk.
- When the last follower leaves without an Abort, the sequence goes on for keep_ms and waits for an Attach.
  Past that it is aborted, which frees its KV blocks, and it is forgotten.
- A sequence that has ended is kept for keep_ms more, so that a late Attach still gets its end.
- After an Abort, the sequence ends the way an aborted one does, and it is forgotten once it has ended.

The chunks stay in memory: a few hundred bytes per token, for at most keep_ms after the sequence ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from kvrelay.engine.reservation_queue import DuplicateRequest
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb

logger = logging.getLogger(__name__)


class Abandoned(Exception):
    """The sequence was aborted because nobody followed it within keep_ms."""


class KeptSequence:
    """One sequence's chunks so far, the task that produces them, and the callers that follow them."""

    def __init__(self, request_id: str, source: AsyncIterator[pb.TokenChunk], keep_s: float,
                 registry: KeptSequences) -> None:
        self.request_id = request_id
        self.keep_s = keep_s
        self.chunks: list[pb.TokenChunk] = []
        self.error: BaseException | None = None
        self.done = False
        self.aborted = False  # an Abort came: forgotten as soon as it has ended
        self.followers = 0
        self._registry = registry
        self._changed = asyncio.Event()  # replaced after each change, so each waiter sees every one
        self._timer: asyncio.TimerHandle | None = None
        self._task = asyncio.create_task(self._run(source))

    async def _run(self, source: AsyncIterator[pb.TokenChunk]) -> None:
        try:
            async with aclosing(source) as chunks:
                async for chunk in chunks:
                    self.chunks.append(chunk)
                    self._notify()
        except asyncio.CancelledError:
            self.error = Abandoned(f"{self.request_id!r}: nobody followed the sequence for {self.keep_s:g} s; "
                                   "it was aborted")
        except Exception as e:  # noqa: BLE001 - each follower raises it, as Generate would have
            self.error = e
        finally:
            self.done = True
            self._notify()
            self._settle()

    async def follow(self, start: int = 0) -> AsyncIterator[pb.TokenChunk]:
        """The chunks from number `start` on, then the live ones; the sequence's error at its end, if it failed."""
        self.followers += 1
        self._cancel_timer()
        try:
            i = start
            while True:
                if i < len(self.chunks):
                    chunk, i = self.chunks[i], i + 1
                    yield chunk
                elif self.done:
                    if self.error is not None:
                        raise self.error
                    return
                else:
                    await self._changed.wait()
        finally:
            self.followers -= 1
            self._settle()

    def abort(self) -> None:
        """An Abort came for it (the engine is told separately): forget it once it has ended."""
        self.aborted = True
        self._settle()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _settle(self) -> None:
        """With nobody following: forget it now (aborted and over), or arm the keep_ms timer."""
        if self.followers:
            return
        if self.done and (self.aborted or isinstance(self.error, Abandoned)):
            self._forget()
            return
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.keep_s, self._expire)

    def _expire(self) -> None:
        self._timer = None
        if self.followers:
            return
        if self.done:
            self._forget()
        else:
            logger.info("kept sequence %s: nobody attached within %.1f s, aborting it", self.request_id, self.keep_s)
            self._task.cancel()  # its end forgets it

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _forget(self) -> None:
        self._cancel_timer()
        self._registry.forget(self)

    def close(self) -> None:
        self._cancel_timer()
        self._task.cancel()


class KeptSequences:
    """The kept sequences of one node, by request id."""

    def __init__(self) -> None:
        self._kept: dict[str, KeptSequence] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def start(self, request_id: str, source: AsyncIterator[pb.TokenChunk], keep_s: float) -> KeptSequence:
        """Run `source` as a kept sequence. DuplicateRequest while one under the id still runs (one that ended
        is replaced: the id was sent anew)."""
        old = self._kept.get(request_id)
        if old is not None and not old.done:
            raise DuplicateRequest(f"request {request_id!r} is already running on this node")
        kept = self._kept[request_id] = KeptSequence(request_id, source, keep_s, self)
        return kept

    def get(self, request_id: str) -> KeptSequence | None:
        return self._kept.get(request_id)

    def abort(self, request_id: str) -> None:
        kept = self._kept.get(request_id)
        if kept is not None:
            kept.abort()

    def forget(self, kept: KeptSequence) -> None:
        if self._kept.get(kept.request_id) is kept:
            del self._kept[kept.request_id]

    def close(self) -> None:
        for kept in list(self._kept.values()):
            kept.close()
        self._kept.clear()
