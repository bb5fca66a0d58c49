"""A tiny real OpenAI-compatible server on 127.0.0.1 for the benchmarks' client and load generators.

The server (FastAPI + uvicorn, in a thread) answers with deterministic text after known sleeps, streamed as SSE
or in one body, so what the benchmarks measure can be checked against it. It is a fault-free stand-in for an
endpoint (faults are set per test): the units under test are the client and the load generators; runs against
real fleets are in test_fleet.py and test_soak.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "tiny-test"


class FakeServer:
    """What the stand-in server does (set per test) and what it saw."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.first_delay = lambda body: 0.01  # seconds before the first content chunk
        self.gap = lambda i: 0.005  # seconds before content chunk i (i >= 1)
        self.usage = True  # send the usage chunk when asked for
        self.fail_every = 0  # answer every n-th request with HTTP 503 (no Retry-After)
        self.reject = False  # answer 429 with Retry-After and an OpenAI error body
        self.stream_error = False  # an error event in the stream, after the first chunk
        self.no_done = False  # end streams without [DONE]
        self.bodies: list[dict] = []
        self.replies: list[str] = []

    async def stream(self, n: int, body: dict, kind: str):
        yield _sse(_chunk(kind, ""))  # a role-only chunk without content, as vLLM sends first
        await asyncio.sleep(self.first_delay(body))
        pieces = []
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(self.gap(i))
            pieces.append(f"r{n}t{i} ")
            yield _sse(_chunk(kind, pieces[-1]))
            if self.stream_error:
                yield _sse({"error": {"message": "node failed", "type": "internal_error"}})
        self.replies.append("".join(pieces))
        yield _sse({"choices": [{"index": 0, "delta": {}, "text": "", "finish_reason": "length"}]})
        if self.usage and (body.get("stream_options") or {}).get("include_usage"):
            yield _sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": len(pieces),
                                                 "total_tokens": 7 + len(pieces),
                                                 "prompt_tokens_details": {"cached_tokens": 2}}})
        if not self.no_done:
            yield "data: [DONE]\n\n"

    async def unary(self, n: int, body: dict, kind: str) -> dict:
        await asyncio.sleep(self.first_delay(body))
        text = "".join(f"r{n}t{i} " for i in range(body["max_tokens"]))
        self.replies.append(text)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}} if kind == "chat" else \
            {"index": 0, "text": text}
        return {"choices": [choice], "usage": {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}}


def _chunk(kind: str, text: str) -> dict:
    if kind == "chat":
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(state: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}, {"id": "other", "object": "model"}]}

    async def handle(request: Request, kind: str):
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse({"error": {"message": "not JSON", "type": "invalid_request_error"}}, status_code=400)
        n = len(state.bodies)
        state.bodies.append(body)
        if state.fail_every and (n + 1) % state.fail_every == 0:
            return JSONResponse({"error": {"message": "overloaded, try later"}}, status_code=503)
        if state.reject:
            return JSONResponse({"error": {"message": "busy", "type": "rate_limit_exceeded"}}, status_code=429,
                                headers={"Retry-After": "1"})
        if not body.get("messages") and not body.get("prompt"):
            return JSONResponse({"error": {"message": "nothing to answer", "type": "invalid_request_error"}},
                                status_code=400)
        if not body.get("stream"):
            return JSONResponse(await state.unary(n, body, kind), headers={"x-kvrelay-decode-node": "decode-0"})
        return StreamingResponse(state.stream(n, body, kind), media_type="text/event-stream",
                                 headers={"x-kvrelay-decode-node": "decode-0"})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions")

    return app


@pytest.fixture(scope="session")
def openai_server():
    state = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    state.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    yield state
    srv.should_exit = srv.force_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(openai_server):
    openai_server.reset()
    return openai_server


@pytest.fixture
def spawned(monkeypatch) -> list[set[int]]:
    """The process tree of each server the benchmarks start (kvrelay.bench.fleet.Server), taken once it is
    ready: to check that nothing outlives it."""
    from kvrelay.bench.fleet import Server
    from tests.helpers.procs import descendants

    trees: list[set[int]] = []
    real_start = Server.start.__func__

    def start(cls, *args, **kwargs):
        server = real_start(cls, *args, **kwargs)
        trees.append(descendants(server.process.pid) | {server.process.pid})
        return server

    monkeypatch.setattr(Server, "start", classmethod(start))
    return trees
