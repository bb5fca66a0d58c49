"""Gateway behaviour against scripted stand-in nodes (fast, no model): the OpenAI surface, stop strings,
n > 1, disconnect aborts, fallbacks and errors. The real-process tests are in tests/e2e/test_gateway.py.

The stand-ins implement Generate but not GenerateMany, as a node from before it: every stream here goes
through the gateway's fallback to a Generate call per sequence (GenerateMany itself: tests/node)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import grpc
import httpx
import openai
import pytest

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.prometheus import Metrics
from kvrelay.common.resumable_client import resumable_stream
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.server import make_server
from kvrelay.model_files.resolve import DEFAULT_MODEL_ID
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

TEXT = " Hello world. This is a scripted node speaking, one two three four five six seven eight nine ten."
BLOCK = 16


@dataclass
class Script:
    """What every fake node does; tests flip fields."""

    token_delay_s: float = 0.0
    refuse_reserve: bool = False
    fail_prefill: bool = False
    die_node: str | None = None  # this node's streams fail (UNAVAILABLE, as a reset) or hang ...
    die_after: int = 0  # ... once this many tokens of the sequence exist
    hang: bool = False  # hang instead of failing (Health hangs too, as a SIGSTOPped process would)
    aborted: list[str] = field(default_factory=list)
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (node_id, method, request_id)


class FakeNode(pb_grpc.EngineServicer):
    def __init__(self, node_id: str, role: str, script: Script, tokens: list[int], vocab: int) -> None:
        self.node_id, self.role, self.script, self.tokens, self.vocab = node_id, role, script, tokens, vocab
        self.address = ""
        self.metrics_address = ""  # set: announced in GetNodeInfo, as real nodes announce their /metrics
        self.connector = ""  # "local": a colocated engine
        self.publish = None  # set: report cached blocks to the index, as real nodes do
        self.cached: set[bytes] = set()
        self.active: dict[str, asyncio.Event] = {}

    def _cached_tokens(self, prompt, salt) -> int:
        n = 0
        for h in prompt_block_hashes(list(prompt), DEFAULT_MODEL_ID, BLOCK, salt):
            if h not in self.cached:
                break
            n += BLOCK
        return min(n, len(prompt) - 1) // BLOCK * BLOCK

    def _remember(self, prompt, salt) -> None:
        hashes = prompt_block_hashes(list(prompt), DEFAULT_MODEL_ID, BLOCK, salt)
        self.cached.update(hashes)
        if self.publish is not None:
            self.publish(hashes)

    def _token(self, params, i: int) -> int:
        offset = (params.seed or 0) % 7 if params.HasField("seed") else 0
        return self.tokens[(i + offset) % len(self.tokens)]

    async def GetNodeInfo(self, request, context):  # noqa: N802
        return pb.NodeInfo(node_id=self.node_id, role=self.role, model_id=DEFAULT_MODEL_ID, block_size=BLOCK,
                           max_model_len=512, vocab_size=self.vocab, grpc_address=self.address,
                           kv_address=f"local://{self.node_id}", metrics_address=self.metrics_address,
                           connector=self.connector)

    async def Health(self, request, context):  # noqa: N802
        self.script.calls.append((self.node_id, "Health", ""))
        if self.script.hang and self.script.die_node == self.node_id:
            await asyncio.sleep(3600)
        return pb.HealthResponse(healthy=True)

    async def GetLoad(self, request, context):  # noqa: N802
        return pb.Load(total_kv_blocks=100, free_kv_blocks=100)

    async def Reserve(self, request, context):  # noqa: N802
        self.script.calls.append((self.node_id, "Reserve", request.request_id))
        if self.script.refuse_reserve:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        cached = self._cached_tokens(request.prompt_token_ids, request.cache_salt)
        n_blocks = -(-len(request.prompt_token_ids) // BLOCK) - cached // BLOCK
        return pb.ReserveResponse(request_id=request.request_id, node_id=self.node_id,
                                  kv_address=f"local://{self.node_id}", num_cached_tokens=cached,
                                  dst_block_ids=list(range(n_blocks)))

    async def Prefill(self, request, context):  # noqa: N802
        self.script.calls.append((self.node_id, "Prefill", request.request_id))
        if self.script.fail_prefill:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "transfer failed")
        cached = self._cached_tokens(request.prompt_token_ids, request.cache_salt)
        self._remember(request.prompt_token_ids, request.cache_salt)
        p = request.params
        first = self._token(p, p.num_resumed_tokens)
        resp = pb.PrefillResponse(request_id=request.request_id, first_token_id=first, num_cached_tokens=cached,
                                  finish_reason="length" if p.max_tokens == 1 else "")
        if p.HasField("logprobs"):
            resp.first_logprobs.CopyFrom(self._logprobs(first, p.logprobs))
        return resp

    def _logprobs(self, token: int, k: int) -> pb.TokenLogprobs:
        top = [pb.TopLogprob(token_id=token, logprob=-0.5)] + [
            pb.TopLogprob(token_id=(token + j) % self.vocab, logprob=-1.0 - j) for j in range(1, k)]
        return pb.TokenLogprobs(token_id=token, logprob=-0.5, rank=1, top=top[:k])

    async def Generate(self, request, context):  # noqa: N802
        rid = request.request_id
        self.script.calls.append((self.node_id, "Generate", rid))
        p = request.params
        cached = self._cached_tokens(request.prompt_token_ids, request.cache_salt)
        self._remember(request.prompt_token_ids, request.cache_salt)  # a hand-off's blocks are cached too
        stop = self.active[rid] = asyncio.Event()
        max_tokens = p.max_tokens if p.HasField("max_tokens") else 10_000
        start = p.num_resumed_tokens  # a migrated sequence continues where it stopped
        try:
            for i in range(start, max_tokens):
                if stop.is_set():
                    yield pb.TokenChunk(finish_reason="abort")
                    return
                if self.script.die_node == self.node_id and i >= self.script.die_after:
                    if self.script.hang:
                        await asyncio.sleep(3600)
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "Connection reset by peer")
                if i > start and self.script.token_delay_s:
                    await asyncio.sleep(self.script.token_delay_s)
                token = self._token(p, i)
                done = i + 1 == max_tokens
                chunk = pb.TokenChunk(token_ids=[token], finish_reason="length" if done else "",
                                      num_prompt_tokens=len(request.prompt_token_ids), num_output_tokens=i + 1,
                                      num_cached_tokens=cached)
                if p.HasField("logprobs"):
                    chunk.logprobs.append(self._logprobs(token, p.logprobs))
                yield chunk
        finally:
            self.active.pop(rid, None)

    async def Abort(self, request, context):  # noqa: N802
        self.script.aborted.append(request.request_id)
        ev = self.active.get(request.request_id)
        if ev:
            ev.set()
        return pb.AbortResponse(aborted=ev is not None)


class Fleet:
    """Fake nodes and a gateway, each server on its own thread's event loop."""

    def __init__(self, tokenizer, n_prefill: int = 1, n_decode: int = 1, prepare=None, **gateway_kwargs) -> None:
        """`prepare(nodes)`: called once the nodes serve, before the gateway first looks at them."""
        self.script = Script()
        tokens = tokenizer.encode(TEXT)
        self.nodes = [FakeNode(f"p{i}", "prefill", self.script, tokens, tokenizer.vocab_size)
                      for i in range(n_prefill)]
        self.nodes += [FakeNode(f"d{i}", "decode", self.script, tokens, tokenizer.vocab_size) for i in range(n_decode)]
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.grpc = asyncio.run_coroutine_threadsafe(self._start_nodes(), self.loop).result(10)
        if prepare is not None:
            prepare(self.nodes)
        by_role = {role: tuple(n.address for n in self.nodes if n.role == role) for role in ("prefill", "decode")}
        cfg = GatewayConfig(**{"model": "default", "port": 0, "shutdown_timeout": 2, "health_interval": 0.2,
                               **by_role, **gateway_kwargs})
        self.server = make_server(cfg, log_level="warning")
        self.gateway = self.server.gateway
        self._gw_thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), daemon=True)
        self._gw_thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _start_nodes(self):
        servers = []
        for node in self.nodes:
            server = grpc.aio.server()
            pb_grpc.add_EngineServicer_to_server(node, server)
            port = server.add_insecure_port("127.0.0.1:0")
            node.address = f"127.0.0.1:{port}"
            await server.start()
            servers.append(server)
        return servers

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def close(self) -> None:
        self.server.should_exit = True
        self._gw_thread.join(15)
        for s in self.grpc:
            asyncio.run_coroutine_threadsafe(s.stop(None), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def fleet(default_tokenizer):
    f = Fleet(default_tokenizer, n_prefill=1, n_decode=2, local_prefill_threshold=8)
    yield f
    f.close()


@pytest.fixture(autouse=True)
def _reset(fleet):
    fleet.script.token_delay_s = 0
    fleet.script.refuse_reserve = fleet.script.fail_prefill = fleet.script.hang = False
    fleet.script.die_node, fleet.script.die_after = None, 0
    fleet.script.aborted.clear()
    fleet.script.calls.clear()


def _chat(content="Say hi"):
    return [{"role": "user", "content": content}]


def test_chat_and_completion_via_sdk(fleet):
    client = fleet.client()
    resp = client.chat.completions.create(model=DEFAULT_MODEL_ID, messages=_chat(), max_tokens=5)
    assert resp.choices[0].message.content.startswith(" Hello world")
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5 and resp.usage.prompt_tokens > 10
    resp = client.completions.create(model=DEFAULT_MODEL_ID, prompt="Once upon a time", max_tokens=4)
    assert resp.choices[0].text.startswith(" Hello")
    methods = [m for _, m, _ in fleet.script.calls]
    assert "Reserve" in methods and "Prefill" in methods


def test_stream_stop_string_aborts(fleet):
    fleet.script.token_delay_s = 0.01
    client = fleet.client()
    stream = client.chat.completions.create(model=DEFAULT_MODEL_ID, messages=_chat(), max_tokens=50, stop=["one"],
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " Hello world. This is a scripted node speaking, "
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals[-1].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens < 50
    deadline = time.monotonic() + 5
    while not fleet.script.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fleet.script.aborted, "the node request was not aborted after the stop string"


def test_n_choices_and_logprobs(fleet):
    client = fleet.client()
    resp = client.chat.completions.create(model=DEFAULT_MODEL_ID, messages=_chat(), max_tokens=3, n=3, seed=1,
                                          logprobs=True, top_logprobs=2)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for c in resp.choices:
        assert len(c.logprobs.content) == 3
        assert len(c.logprobs.content[0].top_logprobs) == 2
    resp = client.completions.create(model=DEFAULT_MODEL_ID, prompt=["a b c", "d e f"], max_tokens=2, n=2,
                                     logprobs=1)
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == 2 for c in resp.choices)


def test_disconnect_aborts_stream(fleet):
    fleet.script.token_delay_s = 0.05
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", fleet.url + "/v1/completions",
                         json={"prompt": "tell me", "max_tokens": 500, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
    deadline = time.monotonic() + 5
    while not fleet.script.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fleet.script.aborted


def test_refused_reservations_429(fleet):
    """Every decode node at its queue bound: 429 with Retry-After, not a 5xx."""
    fleet.script.refuse_reserve = True
    r = httpx.post(fleet.url + "/v1/completions", json={"prompt": "x " * 50, "max_tokens": 3})
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
    reserves = [node for node, m, _ in fleet.script.calls if m == "Reserve"]
    assert sorted(reserves) == ["d0", "d1"]  # the next decode node was tried


def test_failed_prefill_falls_back_to_local(fleet):
    fleet.script.fail_prefill = True
    r = httpx.post(fleet.url + "/v1/completions", json={"prompt": "y " * 50, "max_tokens": 3})
    assert r.status_code == 200, r.text
    # A fresh id for the local attempt: the abandoned reservation's abort may not have landed yet.
    assert any(m == "Generate" and rid.endswith(".h1") for _, m, rid in fleet.script.calls)
    assert fleet.gateway.discovery.routable("prefill")  # the prefill node answered its probe: still in rotation


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "prompt": "hi"}, 404, "model"),
    ({"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    ({"prompt": "hi", "n": "many"}, 400, "n"),
    ({"prompt": [99999999]}, 400, "prompt"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
])
def test_errors(fleet, body, status, param):
    r = httpx.post(fleet.url + "/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_bad_json_is_400(fleet):
    r = httpx.post(fleet.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "error" in r.json()


def test_models_health_metrics(fleet):
    assert fleet.client().models.list().data[0].id == DEFAULT_MODEL_ID
    health = httpx.get(fleet.url + "/health").json()
    assert health["status"] == "ok" and health["decode_nodes"] == 2
    metrics = Metrics.scrape(fleet.url + "/metrics")
    assert metrics.select("kvrelay:routing_decision_seconds_count") and metrics.select("kvrelay:requests_total")


def test_a_node_without_generate_many_gets_a_generate_per_sequence(fleet):
    client = fleet.client()
    for _ in range(3):
        client.completions.create(model=DEFAULT_MODEL_ID, prompt="Once upon a time", max_tokens=3)
    assert [m for _, m, _ in fleet.script.calls].count("Generate") == 3
    served = {node for node, m, _ in fleet.script.calls if m == "Generate"}
    modes = {n.node_id: fleet.gateway.clients.get(n.address).multiplexed for n in fleet.nodes if n.node_id in served}
    assert modes and set(modes.values()) == {False}, modes


def test_sse_ends_with_done(fleet):
    with httpx.stream("POST", fleet.url + "/v1/chat/completions",
                      json={"messages": _chat(), "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["choices"][0]["delta"]["role"] == "assistant"


def test_disconnect_aborts_unary_request(fleet):
    fleet.script.token_delay_s = 0.05
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fleet.url + "/v1/completions", json={"prompt": "tell me", "max_tokens": 500}, timeout=0.5)
    deadline = time.monotonic() + 5
    while not fleet.script.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fleet.script.aborted
    assert Metrics.scrape(fleet.url + "/metrics").value("kvrelay:requests_total", outcome="cancelled") == 1


# ----------------------------------------------------------------------------- registry + index (memory)


@pytest.fixture(scope="module")
def registry_fleet(default_tokenizer):
    """Fake nodes that register in the in-process registry and publish what they cache to the index."""
    from kvrelay.common.records import BlockEvent, BlockEventKind
    from kvrelay.index import NodeRegistration, create_index, create_registry

    url = "memory://gateway-fake-nodes"
    index, registry = create_index(url, DEFAULT_MODEL_ID), create_registry(url)
    f = Fleet(default_tokenizer, n_prefill=0, n_decode=0, redis_url=url, refresh_interval=0.05,
              local_prefill_threshold=4)
    extra = [FakeNode(f"{role}{i}", role, f.script, default_tokenizer.encode(TEXT), default_tokenizer.vocab_size)
             for role, n in (("prefill", 3), ("decode", 2)) for i in range(n)]
    servers = asyncio.run_coroutine_threadsafe(_serve(extra), f.loop).result(10)
    for node in extra:
        node.publish = lambda hashes, node_id=node.node_id: index.apply(
            node_id, [BlockEvent(BlockEventKind.STORED, h) for h in hashes])
        registry.register(NodeRegistration(node.node_id, node.role, node.address, f"local://{node.node_id}", "local",
                                           DEFAULT_MODEL_ID, BLOCK, "float32", 1 << 20), ttl_s=60)
    f.registry, f.extra = registry, extra
    deadline = time.monotonic() + 10
    while len(f.gateway.discovery.routable("prefill")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f
    for s in servers:
        asyncio.run_coroutine_threadsafe(s.stop(None), f.loop).result(5)
    f.close()


async def _serve(nodes):
    servers = []
    for node in nodes:
        server = grpc.aio.server()
        pb_grpc.add_EngineServicer_to_server(node, server)
        node.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        servers.append(server)
    return servers


def test_registry_routes_tenants_to_their_prefix(registry_fleet):
    f = registry_fleet
    tenants = [f"You are assistant number {t}. " + "Always answer with care and detail. " * 12 for t in range(4)]
    first = {}
    for t, system in enumerate(tenants):
        r = httpx.post(f.url + "/v1/chat/completions", json={"messages": [
            {"role": "system", "content": system}, {"role": "user", "content": "hello"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        first[t] = (r.headers["x-kvrelay-prefill-node"], r.headers["x-kvrelay-decode-node"])
    assert len({p for p, _ in first.values()}) > 1  # cold tenants spread over the prefill nodes
    for t, system in enumerate(tenants):
        for q in ("how are you?", "what is the time?"):
            r = httpx.post(f.url + "/v1/chat/completions", json={"messages": [
                {"role": "system", "content": system}, {"role": "user", "content": q}], "max_tokens": 2})
            assert r.status_code == 200
            assert (r.headers["x-kvrelay-prefill-node"], r.headers["x-kvrelay-decode-node"]) == first[t]
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80


def test_lapsed_lease_is_not_routed(registry_fleet):
    f = registry_fleet
    from kvrelay.index import NodeRegistration

    victim = next(n for n in f.extra if n.node_id == "decode1")
    f.registry.register(NodeRegistration(victim.node_id, "decode", victim.address, "local://x", "local",
                                         DEFAULT_MODEL_ID, BLOCK, "float32", 1 << 20), ttl_s=0.2)
    deadline = time.monotonic() + 5
    while any(n.node_id == "decode1" for n in f.gateway.discovery.routable("decode")):
        assert time.monotonic() < deadline, "a lapsed lease stayed routable"
        time.sleep(0.05)
    for i in range(4):
        r = httpx.post(f.url + "/v1/completions", json={"prompt": f"lease test {i}", "max_tokens": 1})
        assert r.headers["x-kvrelay-decode-node"] == "decode0"


def _generations(fleet) -> list[str]:
    """The request id of each stream the decode nodes served (a generation each)."""
    return [rid for _, method, rid in fleet.script.calls if method == "Generate"]


def test_a_retry_after_a_timeout_gets_the_first_copy_s_answer(fleet):
    """The openai SDK retries a non-streaming request that timed out, with the same headers: under an
    Idempotency-Key the retry attaches to the copy still running, and one after it gets the stored answer."""
    fleet.script.token_delay_s = 0.02
    body = {"prompt": "tell me", "max_tokens": 40}
    headers = {"Idempotency-Key": "retry-1"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(fleet.url + "/v1/completions", json=body, headers=headers, timeout=0.3)
    attached = httpx.post(fleet.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert attached.status_code == 200, attached.text
    assert len(_generations(fleet)) == 1 and not fleet.script.aborted  # the hang-up did not abort it
    stored = httpx.post(fleet.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert stored.json() == attached.json() and stored.headers["idempotent-replayed"] == "true"
    assert len(_generations(fleet)) == 1
    m = Metrics.scrape(fleet.url + "/metrics")  # the second attached, or (on a slow machine) found it stored
    assert sum(m.value("kvrelay:idempotent_replays_total", kind=k) or 0 for k in ("attached", "stored")) >= 2
    refused = httpx.post(fleet.url + "/v1/completions", json={**body, "max_tokens": 3}, headers=headers)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "idempotency_key_reused"


def test_the_sdk_s_requests_under_one_x_request_id_run_once(fleet):
    fleet.script.token_delay_s = 0.01
    client = fleet.client()

    def ask():
        return client.chat.completions.create(model=DEFAULT_MODEL_ID, messages=_chat(), max_tokens=20,
                                              extra_headers={"X-Request-Id": "sdk-same-1"})

    threads = [threading.Thread(target=lambda: answers.append(ask())) for _ in range(3)]
    answers: list = []
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(answers) == 3 and len({a.model_dump_json() for a in answers}) == 1
    assert len(_generations(fleet)) == 1
    # A keyed stream is recorded: the same one again replays it.
    streams = [[c.model_dump_json() for c in client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=_chat(), max_tokens=3, stream=True,
        extra_headers={"X-Request-Id": "sdk-stream-1"})] for _ in range(2)]
    assert streams[0] == streams[1] and len(_generations(fleet)) == 2


def _events_lines(response):
    event_id = None
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            yield event_id, line[6:]


def _events(response) -> list[tuple[int | None, str]]:
    """(id, data) of each SSE event of an httpx response."""
    return list(_events_lines(response))


def _text(events: list[tuple[int, str]]) -> str:
    return "".join(json.loads(d)["choices"][0]["text"] for _, d in events if d != "[DONE]" and
                   json.loads(d).get("choices"))


def test_a_stream_resumes_after_its_last_event_id(fleet):
    """A client that lost its connection reconnects with Last-Event-ID and the same key: it gets the rest of
    the stream, nothing lost and nothing repeated, from the one generation."""
    fleet.script.token_delay_s = 0.02
    body = {"prompt": "tell me", "max_tokens": 30, "stream": True}
    whole = _events(httpx.post(fleet.url + "/v1/completions", json=body, timeout=30))  # unkeyed: a reference
    assert whole[-1][1] == "[DONE]" and whole[0][0] is None  # an unkeyed stream has no ids
    fleet.script.calls.clear()
    headers = {"Idempotency-Key": "resume-1"}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", fleet.url + "/v1/completions", json=body, headers=headers) as r:
            head = []
            for item in _events_lines(r):
                head.append(item)
                if len(head) == 5:
                    break  # the connection drops
        assert [i for i, _ in head] == [0, 1, 2, 3, 4]
        rest = _events(http.post(fleet.url + "/v1/completions", json=body,
                                 headers={**headers, "Last-Event-ID": "4"}))
    assert [i for i, _ in rest] == list(range(5, 5 + len(rest))) and rest[-1][1] == "[DONE]"
    assert _text(head + rest) == _text(whole)
    assert len(_generations(fleet)) == 1 and not fleet.script.aborted
    gone = httpx.post(fleet.url + "/v1/completions", json=body, headers={"Idempotency-Key": "never-sent",
                                                                        "Last-Event-ID": "3"})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "stream_not_found"


def test_a_stream_nobody_comes_back_for_is_aborted_after_the_grace(fleet):
    fleet.script.token_delay_s = 0.05
    store = fleet.gateway.idempotency
    grace, store.resume_grace_s = store.resume_grace_s, 2.0
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", fleet.url + "/v1/completions", headers={"Idempotency-Key": "left-1"},
                             json={"prompt": "tell me", "max_tokens": 500, "stream": True}) as r:
                next(_events_lines(r))
        time.sleep(0.2)
        assert not fleet.script.aborted  # still within the grace: it waits for a reconnect
        deadline = time.monotonic() + 5
        while not fleet.script.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fleet.script.aborted
        late = _events(httpx.post(fleet.url + "/v1/completions", headers={"Idempotency-Key": "left-1",
                                                                          "Last-Event-ID": "0"},
                                  json={"prompt": "tell me", "max_tokens": 500, "stream": True}, timeout=30))
        assert "abandoned" in late[-2][1] and late[-1][1] == "[DONE]"
        fleet.script.calls.clear()  # the same request sent anew (no Last-Event-ID) runs anew
        fleet.script.token_delay_s = 0
        again = _events(httpx.post(fleet.url + "/v1/completions", headers={"Idempotency-Key": "left-1"},
                                   json={"prompt": "tell me", "max_tokens": 500, "stream": True}, timeout=30))
        assert again[-1][1] == "[DONE]" and "abandoned" not in again[-2][1] and len(_generations(fleet)) == 1
    finally:
        store.resume_grace_s = grace


def test_the_resuming_client_gets_the_whole_stream_over_a_connection_that_keeps_breaking(fleet):
    """kvrelay.common.resumable_client, whose reads time out long before each token comes: it reconnects with
    Last-Event-ID every time and still gets the reference stream, from one generation."""
    fleet.script.token_delay_s = 0.12  # each gap between tokens is three read timeouts long
    body = {"prompt": "tell me", "max_tokens": 12}
    whole = _events(httpx.post(fleet.url + "/v1/completions", json={**body, "stream": True}, timeout=30))
    fleet.script.calls.clear()

    def attached() -> float:
        return Metrics.scrape(fleet.url + "/metrics").value("kvrelay:idempotent_replays_total", kind="attached") or 0

    before = attached()
    with httpx.Client(base_url=fleet.url, timeout=httpx.Timeout(30, read=0.04)) as http:
        events = list(resumable_stream(http, "/v1/completions", body, max_reconnects=500))
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == _text(whole)
    assert len(_generations(fleet)) == 1 and attached() - before >= 5  # it did break, and reconnect, often
    with httpx.Client(base_url=fleet.url, timeout=30) as http, pytest.raises(httpx.HTTPStatusError):
        list(resumable_stream(http, "/v1/completions", {**body, "max_tokens": 10**9}))  # a 400 is not retried
