"""The benchmarks' HTTP client against the stand-in OpenAI server (conftest.py) and against raw sockets that
frame answers the other ways HTTP allows; and how `bench soak` judges what the client saw."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.bench.client import Client
from kvrelay.bench.soak import MALFORMED, Tally, build_requests, verdict
from tests.bench.conftest import MODEL


def post(url: str, endpoint: str, body, **kwargs):
    async def go():
        async with Client(url, **kwargs) as client:
            return await client.post(endpoint, body)

    return asyncio.run(go())


def test_unary_chat_and_completions(fake):
    chat = post(fake.url, "chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.ok and chat.status == 200 and chat.text == "r0t0 r0t1 r0t2 " and not chat.chunk_times
    assert chat.usage == {"prompt_tokens": 7, "completion_tokens": 3}
    assert chat.headers["x-kvrelay-decode-node"] == "decode-0" and chat.end > chat.start
    done = post(fake.url, "completions", {"prompt": "hi", "max_tokens": 2})
    assert done.ok and done.text == "r1t0 r1t1 "
    assert [b.get("stream") for b in fake.bodies] == [None, None]

    async def models():
        async with Client(fake.url) as client:
            return await client.models()

    assert asyncio.run(models()) == [MODEL, "other"]


def test_streams_time_each_content_chunk(fake):
    fake.first_delay = lambda body: 0.1
    fake.gap = lambda i: 0.05
    r = post(fake.url, "chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
                                "stream_options": {"include_usage": True}})
    assert r.ok and r.done and r.text == "r0t0 r0t1 r0t2 r0t3 " and len(r.chunk_times) == 4
    assert r.usage["completion_tokens"] == 4 and r.usage["prompt_tokens_details"] == {"cached_tokens": 2}
    # The server's sleeps are lower bounds of when each chunk arrives after the request (not of each gap: a chunk
    # the client reads late, on a loaded machine, shortens the gap after it).
    arrivals = [r.ttft_s + sum(r.itl_s[:k]) for k in range(4)]
    assert 0.1 <= r.ttft_s < 0.6 and len(r.itl_s) == 3 and all(g < 0.5 for g in r.itl_s)
    assert all(t >= 0.1 + 0.05 * k - 1e-3 for k, t in enumerate(arrivals)), arrivals


def test_connections_are_kept_alive_and_reused():
    """Three requests at once open three connections; a fourth after them reuses one (the server counts)."""
    answer = b'HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\n{"choices": [{"text": "old"}]}'

    async def go():
        server, url, connections = await _raw_server(answer, "keep")
        async with server, Client(url) as client:
            replies = await asyncio.gather(*(client.post("completions", b"{}") for _ in range(3)))
            opened = connections[0]
            again = await client.post("completions", b"{}")
            return replies, opened, again, connections[0]

    replies, opened, again, opened_after = asyncio.run(go())
    assert all(r.ok for r in replies) and again.ok
    assert opened == 3 and opened_after == 3


def test_error_bodies_retry_after_and_stream_faults(fake):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    fake.reject = True
    r = post(fake.url, "chat", body)
    assert (r.status, r.error, r.error_body, r.headers["retry-after"]) == (429, "HTTP 429: busy", True, "1")
    assert verdict(r) == "rejected"
    fake.reject, fake.fail_every = False, 1
    r = post(fake.url, "chat", body)
    assert r.status == 503 and not r.error_body and verdict(r) == "bad"  # no error type, no Retry-After
    fake.fail_every, fake.stream_error = 0, True
    r = post(fake.url, "chat", body)
    assert r.status == 200 and r.error == "stream error: node failed" and r.done and verdict(r) == "bad"
    fake.stream_error, fake.no_done = False, True
    r = post(fake.url, "chat", body)
    assert r.status == 200 and r.error == "the stream ended without [DONE]" and r.cut and not r.done
    assert verdict(r) == "bad"
    for endpoint, malformed in MALFORMED[:1] + MALFORMED[-1:]:  # an empty chat, bytes that are not JSON
        r = post(fake.url, endpoint, malformed)
        assert r.status == 400 and r.error_body and verdict(r) == "client"


def test_timeouts_and_refused_connections_fail_the_request_not_the_run(fake):
    fake.first_delay = lambda body: 2.0
    r = post(fake.url, "completions", {"prompt": "x", "max_tokens": 1}, timeout_s=0.3)
    assert r.status == 0 and r.error == "timeout after 0.3 s" and 0.3 <= r.end - r.start < 1.5
    r = post("http://127.0.0.1:9/v1", "completions", {"prompt": "x", "max_tokens": 1})
    assert r.status == 0 and r.error.startswith("ConnectionRefusedError") and verdict(r) == "bad"


async def _raw_server(answer: bytes, mode: str):
    """Answers each request (always a 2-byte body) with `answer`, counting connections. mode close: closes after
    its answer; stale: answers the first request of a connection, and closes on the next one without an answer;
    keep: answers all."""
    connections = [0]

    async def handle(reader, writer):
        connections[0] += 1
        served = 0
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
                if mode == "stale" and served:
                    break
                writer.write(answer)
                await writer.drain()
                served += 1
                if mode == "close":
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", connections


@pytest.mark.parametrize("answer,mode", [
    (b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"choices": [{"text": "old"}]}', "close"),
    (b'HTTP/1.1 200 OK\r\nContent-Length: 30\r\n\r\n{"choices": [{"text": "old"}]}', "stale"),
    (b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1e\r\n{"choices": [{"text": "old"}]}\r\n0\r\n\r\n',
     "keep"),
])
def test_bodies_sized_chunked_or_closed_and_stale_connections(answer, mode):
    async def go():
        server, url, connections = await _raw_server(answer, mode)
        async with server, Client(url) as client:
            replies = [await client.post("completions", b"{}") for _ in range(3)]
            return replies, connections[0]

    replies, opened = asyncio.run(go())
    assert all(r.ok and r.text == "old" for r in replies), replies
    assert opened == {"close": 3, "stale": 3, "keep": 1}[mode]


def test_soak_requests_mix_and_tally(default_tokenizer):
    reqs = build_requests(default_tokenizer, 12, seed=0, max_tokens=4)
    assert {r.endpoint for r in reqs} == {"chat", "completions"} and {r.body["stream"] for r in reqs} == {False, True}
    assert sum(r.checked for r in reqs) == 8  # greedy and seeded; unseeded ones are only required to succeed
    texts = [r.body["messages"][0]["content"] if r.endpoint == "chat" else r.body["prompt"] for r in reqs]
    assert all(80 <= len(default_tokenizer.encode(t)) <= 460 for t in texts)
    assert reqs == build_requests(default_tokenizer, 12, seed=0, max_tokens=4)
    from kvrelay.bench.client import Reply

    checked = [r for r in reqs if r.checked]
    ref = {r.name: "same" for r in checked}
    t = Tally()
    t.add(Reply(200, text="same", done=True), checked[0], ref)
    t.add(Reply(200, text="different", done=True), checked[1], ref)
    t.add(Reply(429, {"retry-after": "1"}, error="HTTP 429: busy", error_body=True, done=True), checked[2], ref)
    t.add(Reply(400, error="HTTP 400: bad", error_body=True, done=True))
    report = t.report()
    assert (report["sent"], report["completed"], report["failed"], report["mismatches"]) == (4, 2, 1, 1)
    assert report["mismatched_requests"] == [checked[1].name]
    assert report["errors"] == {"429 HTTP 429: busy": 1, "400 HTTP 400: bad": 1}  # every answer that was not ok
