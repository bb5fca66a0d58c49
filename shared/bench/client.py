"""The benchmarks' one HTTP client: OpenAI-compatible requests over asyncio streams, each content chunk timed.

Every benchmark that speaks HTTP (serve, fleet, soak, routing) sends through `Client`, so requests are framed,
read and judged one way. It speaks just the HTTP/1.1 an OpenAI endpoint needs (kept-alive connections; bodies
sized by Content-Length, chunked, or ended by the server closing; TLS for https URLs), so that its own cost per
request stays small next to the latencies it measures: a general-purpose client library costs about as much per
request as the gateway overhead that `bench routing` measures. Streamed answers are read as server-sent events.
Only the given URL is contacted (no proxy variables, no redirects).
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

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
        url = urlsplit(base_url.rstrip("/"))
        self.tls = url.scheme == "https"
        self.host, self.port = url.hostname or "127.0.0.1", url.port or (443 if self.tls else 80)
        self.prefix, self.timeout_s = url.path + "/", timeout_s
        self.head = f"Host: {url.netloc}\r\nAccept: */*\r\n"
        if api_key:
            self.head += f"Authorization: Bearer {api_key}\r\n"
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, endpoint: str, body: dict | bytes) -> Reply:
        """POST to "chat" (/chat/completions) or "completions"; bytes are sent as they are (malformed requests).
        A body with "stream": true is read as events."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return await self.request("POST", PATHS[endpoint], data, isinstance(body, dict) and bool(body.get("stream")))

    async def models(self) -> list[str]:
        reply = await self.request("GET", "models")
        if reply.status != 200:
            raise RuntimeError(f"GET {self.prefix}models: {reply.error or reply.status}")
        return [m["id"] for m in json.loads(reply.text).get("data") or []]

    async def request(self, method: str, path: str, data: bytes = b"", stream: bool = False) -> Reply:
        """Never raises for what the server does: a failure is the reply's `error` (and status 0 without an
        answer); a request over the client's timeout fails as "timeout after N s"."""
        reply = Reply(start=time.perf_counter())
        try:
            await asyncio.wait_for(self._exchange(reply, method, path, data, stream), self.timeout_s)
        except asyncio.TimeoutError:
            reply.error = f"timeout after {self.timeout_s:g} s"
        except Exception as e:  # refused, dropped, not HTTP, not events: the request failed, not the run
            reply.error = f"{type(e).__name__}: {e}"[:500]
        reply.end = time.perf_counter()
        return reply

    async def close(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- HTTP/1.1 ---------------------------------------------------------------------------------------

    async def _exchange(self, reply: Reply, method: str, path: str, data: bytes, stream: bool) -> None:
        for attempt in range(2):
            reader, writer, reused = await self._connection()
            reusable = False
            try:
                try:
                    writer.write(f"{method} {self.prefix}{path} HTTP/1.1\r\n{self.head}Content-Type: application/"
                                 f"json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
                    await writer.drain()
                    status = await reader.readline()
                except ConnectionError:
                    if not reused:
                        raise
                    status = b""
                if not status and reused and attempt == 0:
                    continue  # the server had closed the idle connection: once more on a new one
                keep = await self._read_head(reader, status, reply)
                body = self._body(reader, reply.headers)
                if stream and reply.status == 200:
                    await self._read_events(body, reply)
                else:
                    self._read_answer(b"".join([chunk async for chunk in body]), reply)
                reusable = keep  # only once the whole body was read
            finally:
                if reusable:
                    self._idle.append((reader, writer))
                else:
                    writer.close()
            return

    async def _connection(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        while self._idle:
            reader, writer = self._idle.pop()
            if not reader.at_eof():
                return reader, writer, True
            writer.close()
        context = ssl.create_default_context() if self.tls else None
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=context, limit=2**22)
        return reader, writer, False

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader, status: bytes, reply: Reply) -> bool:
        """Status and headers; whether the connection may be reused after this body."""
        if not status:
            raise EOFError("the server closed the connection without an answer")
        version, code = status.split()[:2]
        reply.status = int(code)
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            reply.headers[name.strip().lower()] = value.strip()
        sized = "content-length" in reply.headers or reply.headers.get("transfer-encoding", "").lower() == "chunked"
        return sized and version == b"HTTP/1.1" and reply.headers.get("connection", "").lower() != "close"

    @staticmethod
    async def _body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await reader.readline()).split(b";")[0], 16):
                yield await reader.readexactly(size + 2)  # the chunk and its CRLF
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
        elif "content-length" in headers:
            if size := int(headers["content-length"]):
                yield await reader.readexactly(size)
        else:
            while chunk := await reader.read(65536):
                yield chunk

    @staticmethod
    async def _read_events(body: AsyncIterator[bytes], reply: Reply) -> None:
        pieces, rest = [], b""
        async for chunk in body:
            now = time.perf_counter()
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
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
        reply.text = "".join(pieces)

    @staticmethod
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
