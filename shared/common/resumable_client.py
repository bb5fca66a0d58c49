"""A client of resumable streams, in plain httpx: what a client does to get a whole stream over a connection
that breaks (the gateway's side: kvrelay.gateway.resumable).

The pattern:
1. Send the streaming request with a key (`Idempotency-Key`, or `X-Request-Id`).
2. Remember the `id:` of the last event you read.
3. When the connection breaks, send the same request again, with the same key, and `Last-Event-ID` set to
   that id. You get the events after it, then the live ones. Nothing is lost and nothing is repeated.

    with httpx.Client(base_url="http://gateway:8000", timeout=60) as http:
        for event in resumable_stream(http, "/v1/chat/completions", body, key="order-7"):
            print(event["choices"][0]["delta"].get("content", ""), end="")

The openai SDK does not resume streams; any SSE client that sends those two headers does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import httpx


class StreamBroken(Exception):
    """The stream broke more times than `max_reconnects` allowed; `last_event_id` is where it stopped."""

    def __init__(self, message: str, last_event_id: int | None) -> None:
        super().__init__(message)
        self.last_event_id = last_event_id


def resumable_stream(http: httpx.Client, path: str, body: dict, key: str | None = None,
                     headers: dict[str, str] | None = None, max_reconnects: int = 5) -> Iterator[dict]:
    """The stream's events (each `data:` payload, parsed) up to `[DONE]`, reconnecting with `Last-Event-ID` when
    the connection breaks (an httpx transport error: a reset, a read timeout, a refused reconnect). `key`: the
    request's Idempotency-Key (a fresh one by default). An HTTP error answer raises httpx.HTTPStatusError."""
    sent = {**(headers or {}), "Idempotency-Key": key or f"resume-{uuid.uuid4().hex}"}
    last: int | None = None
    for attempt in range(max_reconnects + 1):
        resume = {} if last is None else {"Last-Event-ID": str(last)}
        try:
            with http.stream("POST", path, json={**body, "stream": True}, headers={**sent, **resume}) as response:
                if response.status_code >= 400:
                    response.read()
                    response.raise_for_status()
                event_id: int | None = None
                for line in response.iter_lines():
                    if line.startswith("id:"):
                        event_id = int(line[3:].strip())
                    elif line.startswith("data:"):
                        data = line[5:].strip()
                        last = event_id if event_id is not None else last
                        if data == "[DONE]":
                            return
                        yield json.loads(data)
            raise httpx.RemoteProtocolError("the stream ended without [DONE]")
        except httpx.TransportError as e:
            if attempt == max_reconnects:
                raise StreamBroken(f"the stream broke {attempt + 1} times; the last: {e!r}", last) from e
