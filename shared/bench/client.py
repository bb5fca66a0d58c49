"""The benchmarks' one HTTP client: OpenAI-compatible requests over aiohttp, each content chunk timed.

Every benchmark that speaks HTTP (serve, fleet, soak, routing) sends through `Client`, so requests are framed,
read and judged one way: kept-alive connections, streamed answers read as server-sent events, and every failure
recorded in the reply instead of raised. aiohttp rather than httpx: its cost per streamed request is a fraction
of the gateway overhead that `bench routing` measures (docs/benchmarks.md). Only the given URL is contacted
(no proxy variables, no redirects).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

PATHS = {"chat": "chat/completions", "completions": "completions"}


@dataclass
class Reply:
    """One request as the client saw it. Times are time.perf_counter() readings."""

    status: int = 0  # 0: no HTTP answer (refused, dropped or timed out before the status line)
    headers: dict[str, str] = field(default_factory=dict)
    text: str = ""  # the answer's text (a body that is no completion: the body itself)
    error: str = ""
    error_body: bool = False  # an OpenAI error body: {"error": {"message": ..., "type": ...}}
    done: bool = False  # the whole answer arrived (a stream: its [DONE])
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each event with content
    usage: dict | None = None
    cut: bool = False  # the connection failed or broke (not an answer of the server's): a client may resume
    last_event_id: str | None = None  # a stream's last `id:` read

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and not self.error

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def itl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


class Client:
    """Requests to one OpenAI API root (".../v1"); connections are reused, `close()` closes them."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 300.0) -> None:
        self.prefix = base_url.rstrip("/") + "/"
        self.timeout_s = timeout_s
        self.headers = {"Accept": "*/*", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use, inside the caller's event loop
            self._session = aiohttp.ClientSession(
                headers=self.headers, trust_env=False, timeout=aiohttp.ClientTimeout(total=None),
                connector=aiohttp.TCPConnector(limit=0, force_close=False))
        return self._session

    async def post(self, endpoint: str, body: dict | bytes, key: str | None = None,
                   last_event_id: str | None = None) -> Reply:
        """POST to "chat" (/chat/completions) or "completions"; bytes are sent as they are (malformed requests).
        A body with "stream": true is read as events. `key`: its Idempotency-Key; `last_event_id`: resume the
        keyed stream after that event (the gateway's gateway.resumable)."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**({"Idempotency-Key": key} if key else {}),
                   **({"Last-Event-ID": last_event_id} if last_event_id is not None else {})}
        return await self.request("POST", PATHS[endpoint], data, isinstance(body, dict) and bool(body.get("stream")),
                                  headers)

    async def models(self) -> list[str]:
        reply = await self.request("GET", "models")
        if reply.status != 200:
            raise RuntimeError(f"GET {self.prefix}models: {reply.error or reply.status}")
        return [m["id"] for m in json.loads(reply.text).get("data") or []]

    async def request(self, method: str, path: str, data: bytes = b"", stream: bool = False,
                      headers: dict[str, str] | None = None) -> Reply:
        """Never raises for what the server does: a failure is the reply's `error` (and status 0 without an
        answer); a request over the client's timeout fails as "timeout after N s"."""
        reply = Reply(start=time.perf_counter())
        try:
            await asyncio.wait_for(self._exchange(reply, method, path, data, stream, headers or {}), self.timeout_s)
        except asyncio.TimeoutError:
            reply.error = f"timeout after {self.timeout_s:g} s"
        except aiohttp.ClientConnectorError as e:  # nothing listens there, or it cannot be reached
            reply.error, reply.cut = f"{type(e.os_error).__name__}: {e}"[:500], True
        except Exception as e:  # dropped, not HTTP, not events: the request failed, not the run
            reply.error, reply.cut = f"{type(e).__name__}: {e}"[:500], True
        else:
            if stream and reply.status == 200 and not reply.done and not reply.error:
                reply.error, reply.cut = "the stream ended without [DONE]", True
        reply.end = time.perf_counter()
        return reply

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _exchange(self, reply: Reply, method: str, path: str, data: bytes, stream: bool,
                        headers: dict[str, str]) -> None:
        try:
            await self._send(reply, method, path, data, stream, headers)
        except aiohttp.ServerDisconnectedError:
            if reply.status:
                raise
            # The server closed a kept-alive connection as the request went out (its idle timeout): once more,
            # on a new connection, as HTTP clients do for a connection that never answered.
            await self._send(reply, method, path, data, stream, headers)

    async def _send(self, reply: Reply, method: str, path: str, data: bytes, stream: bool,
                    headers: dict[str, str]) -> None:
        async with self.session.request(method, self.prefix + path, data=data, allow_redirects=False,
                                        headers={"Content-Type": "application/json", **headers}) as response:
            reply.status = response.status
            reply.headers = {name.lower(): value for name, value in response.headers.items()}
            if stream and response.status == 200:
                await _read_events(response.content, reply)
            else:
                _read_answer(await response.read(), reply)


async def _read_events(content: aiohttp.StreamReader, reply: Reply) -> None:
    pieces = []
    try:
        async for line in content:  # one line at a time, as it arrives
            now = time.perf_counter()
            if line.startswith(b"id:"):
                reply.last_event_id = line[3:].strip().decode()
            data = line.strip()[5:].strip() if line.startswith(b"data:") else None
            if data == b"[DONE]":
                reply.done = True
            elif data:
                event = json.loads(data)
                if event.get("error"):
                    error = event["error"]
                    reply.error = "stream error: " + (error.get("message") if isinstance(error, dict)
                                                      else json.dumps(error))[:480]
                reply.usage = event.get("usage") or reply.usage
                if text := "".join(_content(c) for c in event.get("choices") or ()):
                    pieces.append(text)
                    reply.chunk_times.append(now)
    finally:  # what was read counts when the stream breaks too (a resuming client goes on from it)
        reply.text = "".join(pieces)


def _read_answer(raw: bytes, reply: Reply) -> None:
    reply.done, text = True, raw.decode(errors="replace")
    try:
        data = json.loads(raw)
    except ValueError:
        data = None
    if reply.status != 200:
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        reply.error_body = bool(message) and bool(error.get("type"))
        reply.error = f"HTTP {reply.status}: {message or text}"[:500]
    elif isinstance(data, dict) and data.get("choices"):
        choice = data["choices"][0]
        reply.text = (choice.get("message") or {}).get("content") or choice.get("text") or ""
        reply.usage = data.get("usage")
    elif data is None:
        reply.error = f"not JSON: {text[:200]}"
    else:
        reply.text = text


def _content(choice: dict) -> str:
    if "delta" in choice:
        delta = choice["delta"] or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""
