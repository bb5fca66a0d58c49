"""Resumable streams: a keyed stream's events, numbered and kept, so that a client that lost its connection
gets the rest of the stream.

A streaming completion sent with `Idempotency-Key` or `X-Request-Id` (gateway.idempotency) is recorded:
- Every event carries an SSE `id:`, counted from 0.
- The generation runs in its own task and feeds a `Recording`. Each client follows the recording: a new one
  from the start, a reconnecting one (`Last-Event-ID: n`, the same key and body) from event n + 1. A client
  that arrives while the stream is still running gets the events so far and then the live ones.
- When the last client has left, the generation goes on for `grace_s` to wait for a reconnect. Past that, it
  is aborted on the nodes (as a plain stream is when its client leaves), and the recording ends with an error
  event and `[DONE]`.
- A finished recording is kept for the idempotency ttl, so a late reconnect still gets the stream's end.

Plain httpx with the two headers is all a client needs; nothing in the openai SDK is required. The recording is
in this gateway's memory. With Redis, a client that reconnects to another gateway gets the same events there:
that gateway goes on with the running sequence and numbers its events the same (gateway.handover).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvrelay.gateway.errors import BadRequest, NodeFailure
from kvrelay.gateway.serving_common import SSE_DONE, SSEResponse, sse_error


class Recording:
    def __init__(self) -> None:
        self.events: list[str] = []  # each one "id: N\ndata: ...\n\n"
        self.done = False
        self.followers = 0
        self._changed = asyncio.Condition()

    async def append(self, text: str) -> None:
        """One write of the stream (an event, or several written together)."""
        for event in text.split("\n\n"):
            if event:
                self.events.append(f"id: {len(self.events)}\n{event}\n\n")
        async with self._changed:
            self._changed.notify_all()

    async def finish(self) -> None:
        self.done = True
        async with self._changed:
            self._changed.notify_all()

    async def follow(self, after: int | None) -> AsyncIterator[str]:
        """The events after id `after` (all of them for None), then the live ones until the stream ends."""
        i = 0 if after is None else after + 1
        while True:
            if i < len(self.events):
                out, i = "".join(self.events[i:]), len(self.events)
                yield out
                continue
            if self.done:
                return
            async with self._changed:
                await self._changed.wait_for(self._past(i))


    def _past(self, i: int):
        return lambda: i < len(self.events) or self.done


class RecordedStream:
    """A keyed stream's generation, its recording, and the clients following it."""

    def __init__(self, response: SSEResponse, grace_s: float) -> None:
        body, self._close, self._cut_error = response.detach()
        self.headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        self.recording = Recording()
        self.grace_s = grace_s
        self.abandoned = False  # aborted when nobody came back within the grace
        self._abandon: asyncio.TimerHandle | None = None
        self.task = asyncio.create_task(self._record(body))

    async def _record(self, body: AsyncIterator[str]) -> None:
        try:
            async for text in body:
                await self.recording.append(text)
        except asyncio.CancelledError:  # abandoned: nobody came back within the grace
            self.abandoned = True
            err = NodeFailure("the stream was abandoned: its client left and did not reconnect in time")
            await self.recording.append(sse_error(err) + SSE_DONE)
        finally:
            await self.recording.finish()
            await self._close()  # aborts what is still running on the nodes

    def response(self, after: int | None) -> SSEResponse:
        """A client's view: the events after id `after`, then the live ones."""
        self.recording.followers += 1
        if self._abandon is not None:
            self._abandon.cancel()
            self._abandon = None
        return SSEResponse(self.recording.follow(after), on_close=self._left, headers=self.headers,
                           cut_error=self._cut_error)

    async def _left(self) -> None:
        self.recording.followers -= 1
        if not self.recording.followers and not self.task.done():
            self._abandon = asyncio.get_running_loop().call_later(self.grace_s, self.task.cancel)


def last_event_id(value: str | None) -> int | None:
    """The `Last-Event-ID` header's event number (None: absent)."""
    if value is None:
        return None
    if not value.isdigit():
        raise BadRequest(f"Last-Event-ID: {value!r} is not an event id of this gateway's streams (a number)",
                         param="Last-Event-ID")
    return int(value)
