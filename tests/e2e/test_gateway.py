"""The gateway in front of real prefill and decode processes and a real Redis, driven by the unmodified
`openai` SDK: chat and completions (streamed and not), n, logprobs, stop strings, max_tokens, seeds, usage,
errors with their statuses, the gRPC API, disconnects, cache-aware routing over the index, and schemathesis.

One fleet for the module (3 prefill + 2 decode nodes on a tiny random llama that carries the default
model's tokenizer, so text round-trips); gateways run in this process on their own event loop threads.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.prometheus import Metrics
from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2 as gpb
from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tests.helpers.gateway import API_KEY, GatewayThread
from tests.helpers.models import make_tiny_with_tokenizer
from tests.helpers.nodes import start_nodes, stop_nodes, tiny_args, wait_for

BLOCKS = 1024  # per node: n=128 reservations of a short prompt fit


class Fleet:
    """3 prefill + 2 decode node processes registered in Redis, and the module's main gateway."""

    def __init__(self, model: str, redis_url: str) -> None:
        self.model, self.redis_url = model, redis_url
        reg = ["--redis-url", redis_url, "--heartbeat-seconds", "0.5", "--registry-ttl", "3"]
        specs = [(role, tiny_args(model, "ucx", "--node-id", f"{role}-{i}", *reg, blocks=BLOCKS))
                 for role, count in (("prefill", 3), ("decode", 2)) for i in range(count)]
        self.nodes = start_nodes(specs)
        try:
            self.gw = self.gateway(api_key=API_KEY, grpc_port=0, local_prefill_threshold=8)
        except BaseException:
            stop_nodes(self.nodes)
            raise

    def gateway(self, **kwargs) -> GatewayThread:
        kwargs = {"model": self.model, "redis_url": self.redis_url, "startup_timeout": 30, **kwargs}
        gw = GatewayThread(**kwargs)
        wait_for(lambda: len(gw.gateway.discovery.routable("decode")) == 2
                 and len(gw.gateway.discovery.routable("prefill")) == 3, 30, "all nodes routable")
        return gw

    def close(self) -> None:
        self.gw.close()
        stop_nodes(self.nodes)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, default_model_dir):
    model = make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny-gw") / "tiny-gw", Path(default_model_dir))
    from kvrelay.index.redis_server import start_redis

    redis = start_redis()
    try:
        f = Fleet(str(model), redis.url)
    except BaseException:
        redis.stop()
        raise
    yield f
    f.close()
    redis.stop()


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.gw.client()


MODEL = "tiny-gw"


def _chat(text: str = "Tell me a story about a dragon.") -> list[dict]:
    return [{"role": "user", "content": text}]


# ------------------------------------------------------------------------------------------ the SDK


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat(client, fleet):
    tok = fleet.gw.gateway.tokenizer
    resp = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=7, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert resp.usage.prompt_tokens == len(tok.apply_chat_template(_chat()))
    assert resp.usage.completion_tokens == 7 and resp.usage.total_tokens == resp.usage.prompt_tokens + 7
    assert choice.message.content == tok.decode(tok.encode(choice.message.content, add_special_tokens=False))


def test_chat_stream_with_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=9, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=9, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 9 and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions(client):
    resp = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0)
    text = resp.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The quick brown fox", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == text and resp.usage.completion_tokens == 5


def test_n_and_seed(client):
    args = dict(model=MODEL, messages=_chat("Name three colors."), max_tokens=8, temperature=1.0, seed=1234)
    a = client.chat.completions.create(n=2, **args)
    b = client.chat.completions.create(n=2, **args)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    single = client.chat.completions.create(**args)
    assert single.choices[0].message.content == a.choices[0].message.content  # choice 0 keeps the seed


def test_logprobs(client):
    resp = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=4, logprobs=True,
                                          top_logprobs=3, temperature=0)
    content = resp.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.logprob <= 0 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob, abs=1e-4)  # greedy = top 1
    comp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2, temperature=0)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.top_logprobs[0]) <= 2 and lp.text_offset[0] == 0


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop.strip(), base
    for stream in (False, True):
        kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop],
                      extra_body={"ignore_eos": True})
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.completions.create(**kwargs).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert text == base[: base.index(stop)] and reason == "stop"


def test_max_completion_tokens(client):
    resp = client.chat.completions.create(model=MODEL, messages=_chat(), max_completion_tokens=3,
                                          extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 3


@pytest.mark.parametrize("call,status,param", [
    (lambda c: c.chat.completions.create(model="gpt-404", messages=_chat()), 404, "model"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=_chat(), temperature=-0.5), 400, "temperature"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=_chat(), top_p=2), 400, "top_p"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[]), 400, "messages"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=5000), 400, "max_tokens"),
    (lambda c: c.completions.create(model=MODEL, prompt="hi " * 2100), 400, "prompt"),
    (lambda c: c.completions.create(model=MODEL, prompt="hi", n=0), 400, "n"),
    (lambda c: c.completions.create(model=MODEL, prompt="hi", extra_body={"stop_token_ids": [10**6]}), 400,
     "stop_token_ids"),
    (lambda c: c.embeddings.create(model=MODEL, input=[]), 400, "input"),
    (lambda c: c.embeddings.create(model=MODEL, input=[[1, 2, 10**6]]), 400, "input"),
    (lambda c: c.embeddings.create(model=MODEL, input="hi " * 2100), 400, "input"),
    (lambda c: c.embeddings.create(model=MODEL, input="hi", dimensions=65), 400, "dimensions"),
])
def test_errors(client, call, status, param):
    with pytest.raises(openai.APIStatusError) as info:
        call(client)
    assert info.value.status_code == status
    body = info.value.body
    assert body["param"] == param and body["message"] and body["type"]


def _hf_embedding(model: str, ids: list[int]):
    import torch
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        return torch.nn.functional.normalize(hf(torch.tensor([ids])).last_hidden_state[0, -1], dim=0)


def test_embeddings_equal_transformers_through_the_sdk(client, fleet):
    import torch

    texts = ["The capital of France is Paris.", "Embeddings beside chat, on the same nodes."]
    tokens = [fleet.gw.gateway.tokenizer.encode(t) for t in texts]
    chat = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=4)  # the same fleet serves both
    assert chat.choices[0].message.content is not None
    # The SDK asks for base64 unless told otherwise and decodes it itself; asked for base64, it hands it over.
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        got = client.embeddings.create(model=MODEL, input=texts, encoding_format=fmt)
        assert [d.index for d in got.data] == [0, 1] and got.model == MODEL
        assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, tokens))
        for data, ids in zip(got.data, tokens, strict=True):
            vector = data.embedding
            if fmt == "base64":
                vector = np.frombuffer(base64.b64decode(vector), dtype="<f4").copy()
            want = _hf_embedding(fleet.model, ids)
            assert torch.nn.functional.cosine_similarity(torch.tensor(vector), want, dim=0) > 1 - 1e-5
    short = client.embeddings.create(model=MODEL, input=[tokens[0]], dimensions=16).data[0].embedding
    assert len(short) == 16 and abs(sum(x * x for x in short) - 1) < 1e-5


def test_score_and_rerank_are_cosines_of_the_embeddings(fleet):
    import torch

    headers = {"Authorization": f"Bearer {API_KEY}"}
    query, docs = "Where is Paris?", ["Paris is in France.", "Dragons breathe fire.", "France's capital is Paris."]
    vec = {t: _hf_embedding(fleet.model, fleet.gw.gateway.tokenizer.encode(t)) for t in [query, *docs]}
    want = [float(torch.dot(vec[query], vec[d])) for d in docs]
    r = httpx.post(fleet.gw.url + "/v1/score", headers=headers, json={"model": MODEL, "text_1": query, "text_2": docs})
    assert r.status_code == 200, r.text
    got = [d["score"] for d in r.json()["data"]]
    assert [d["index"] for d in r.json()["data"]] == [0, 1, 2] and np.allclose(got, want, atol=1e-5)
    r = httpx.post(fleet.gw.url + "/v1/rerank", headers=headers,
                   json={"model": MODEL, "query": query, "documents": docs, "top_n": 2})
    results = r.json()["results"]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in results] == best and [x["document"]["text"] for x in results] == [docs[i] for i in best]
    assert np.allclose([x["relevance_score"] for x in results], [want[i] for i in best], atol=1e-5)
    bare = httpx.post(fleet.gw.url + "/v1/rerank", headers=headers,
                      json={"query": query, "documents": docs, "return_documents": False}).json()["results"]
    assert len(bare) == 3 and all("document" not in x for x in bare)
    bad = httpx.post(fleet.gw.url + "/v1/score", headers=headers, json={"text_1": ["a", "b"], "text_2": docs})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"


def test_auth(fleet):
    with pytest.raises(openai.AuthenticationError):
        fleet.gw.client(api_key="wrong").chat.completions.create(model=MODEL, messages=_chat(), max_tokens=1)
    for r in (httpx.get(fleet.gw.url + "/v1/models"),
              httpx.post(fleet.gw.url + "/v1/completions", json={"prompt": "hi"}),
              httpx.post(fleet.gw.url + "/v1/embeddings", json={"input": "hi"})):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(fleet.gw.url + "/health").status_code == 200  # probes need no key


def test_no_capacity_503(fleet):
    gw = GatewayThread(model=fleet.model, decode=("127.0.0.1:9",), health_interval=0.2, capacity_wait=0.5)
    try:
        with pytest.raises(openai.APIStatusError) as info:
            gw.client().chat.completions.create(model=MODEL, messages=_chat(), max_tokens=2)
        assert info.value.status_code == 503
        assert httpx.get(gw.url + "/health").status_code == 503
    finally:
        gw.close()


# ------------------------------------------------------------------------------------ gRPC, aborts


def test_grpc_api(fleet, client):
    expected = client.completions.create(model=MODEL, prompt="Rain in Spain", max_tokens=6, temperature=0)
    with grpc.insecure_channel(f"127.0.0.1:{fleet.gw.gateway.grpc_port}") as channel:
        stub = gpb_grpc.GatewayStub(channel)
        meta = [("authorization", f"Bearer {API_KEY}")]
        req = gpb.GenerateRequest(prompt="Rain in Spain", params=gpb.SamplingParams(max_tokens=6, temperature=0),
                                  stream=True)
        msgs = list(stub.Generate(req, metadata=meta, timeout=60))
        assert "".join(c.text for m in msgs for c in m.choices) == expected.choices[0].text
        assert msgs[-1].finished and msgs[-1].usage.completion_tokens == 6
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(gpb.GenerateRequest(prompt="x", params=gpb.SamplingParams(top_p=5)), metadata=meta))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(req))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Embeddings for internal callers: the vectors /v1/embeddings gives, in order.
        texts = ["Rain in Spain", "falls mainly on the plain"]
        want = [d.embedding for d in client.embeddings.create(model=MODEL, input=texts, encoding_format="float").data]
        got = stub.Embed(gpb.EmbedRequest(texts=texts), metadata=meta, timeout=60)
        assert got.model == MODEL and len(got.embeddings) == 2 and got.usage.prompt_tokens > 0
        assert np.allclose([list(e.values) for e in got.embeddings], want, atol=1e-6)
        short = stub.Embed(gpb.EmbedRequest(token_ids=[gpb.TokenIds(ids=[5, 6, 7])], dimensions=8), metadata=meta)
        assert len(short.embeddings[0].values) == 8
        with pytest.raises(grpc.RpcError) as info:
            stub.Embed(gpb.EmbedRequest(texts=["a"], token_ids=[gpb.TokenIds(ids=[1])]), metadata=meta)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in info.value.details()


def test_disconnect_frees_blocks(fleet):
    body = {"model": MODEL, "prompt": "Count forever:", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        with http.stream("POST", fleet.gw.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(line for line in lines if line.startswith("data:"))
    decode = [n for n in fleet.nodes if n.role == "decode"]
    wait_for(lambda: all(n.load().num_running == 0 and n.load().num_waiting == 0 for n in decode), 15,
             "the abandoned stream to be aborted on its decode node")
    assert not fleet.gw.gateway.router.inflight.seqs


# ------------------------------------------------------------------------------------------------ routing


def _tenant_system(t: int) -> str:
    return f"You are the assistant of tenant {t}. " + " ".join(f"Rule {t}.{i}: be exact and kind." for i in range(24))


def _tenant_chat(t: int, question: str) -> list[dict]:
    return [{"role": "system", "content": _tenant_system(t)}, {"role": "user", "content": question}]


def test_cache_aware_routing_follows_prefixes(fleet, client):
    """4 tenants with long system prompts over 3 prefill + 2 decode nodes: after a tenant's first request,
    its requests land on the nodes holding its prefix and hit their caches."""
    gw = fleet.gw.gateway
    tok = gw.tokenizer
    before = _metric(fleet.gw, "kvrelay:prefix_hit_tokens_total")
    homes = {}
    for t in range(4):
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=_tenant_chat(t, "Hi!"),
                                                                max_tokens=2)
        homes[t] = (raw.headers["x-kvrelay-prefill-node"], raw.headers["x-kvrelay-decode-node"])
        system_ids = tok.apply_chat_template(_tenant_chat(t, "")[:1], add_generation_prompt=False)
        hashes = prompt_block_hashes(system_ids, gw.model_id, gw.config.block_size)
        wait_for(lambda h=hashes, nodes=homes[t]: all(gw.router.index.lookup(h).get(n, 0) == len(h) for n in nodes),
                 15, f"tenant {t}'s prefix published by {homes[t]}")
    assert all(p != "local" for p, _ in homes.values())
    assert len({p for p, _ in homes.values()}) >= 2, homes  # cold tenants spread over the prefill nodes
    system_tokens = {t: len(tok.apply_chat_template(_tenant_chat(t, "")[:1], add_generation_prompt=False))
                     for t in homes}
    for question in ("What is two plus two?", "Name a color.", "Why is the sky blue?"):
        for t in range(4):
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=_tenant_chat(t, question), max_tokens=2)
            assert (raw.headers["x-kvrelay-prefill-node"], raw.headers["x-kvrelay-decode-node"]) == homes[t]
            cached = raw.parse().usage.prompt_tokens_details.cached_tokens
            assert cached >= system_tokens[t] // 16 * 16 - 16, (t, cached, system_tokens[t])
    hits = _metric(fleet.gw, "kvrelay:prefix_hit_tokens_total") - before
    assert hits >= 12 * (min(system_tokens.values()) - 32)


def test_replicas_route_alike(fleet):
    """A second gateway on the same Redis makes the same decisions (no gateway-local randomness)."""
    other = fleet.gateway(api_key=API_KEY, local_prefill_threshold=8)
    try:
        a, b = fleet.gw.gateway, other.gateway
        for t in range(6):
            prompt = a.tokenizer.apply_chat_template(_tenant_chat(t, f"question {t}"))
            hashes = prompt_block_hashes(prompt, a.model_id, a.config.block_size)
            hits = a.router.index.lookup(hashes)
            da, db = (g.router.decide(prompt, hashes, hits, g.discovery.routable("prefill"),
                                      g.discovery.routable("decode")) for g in (a, b))
            ids = [(d.prefill.node_id if d.prefill else None, d.decode.node_id) for d in (da, db)]
            assert ids[0] == ids[1]
    finally:
        other.close()


def _metric(gw: GatewayThread, name: str) -> float:
    return Metrics.scrape(gw.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).value(name) or 0.0


# ------------------------------------------------------------------------------------------- schemathesis


@pytest.fixture(scope="module")
def schema_gateway(fleet):
    # A short context bounds what random valid requests may generate (n up to 128, max_tokens unset).
    gw = fleet.gateway(max_model_len=96, local_prefill_threshold=32)
    yield gw
    gw.close()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_no_server_errors(schema_gateway, mode):
    """Every operation of the published OpenAPI schema, valid and invalid inputs: never a 5xx."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    schema = schemathesis.openapi.from_url(schema_gateway.url + "/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"}
    for op in ops:
        if mode == "negative" and op.method.upper() == "GET":
            continue  # nothing to make invalid
        examples = 30 if op.method.upper() == "POST" else 5

        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None,
                  derandomize=True)
        @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
        def check(case) -> None:
            response = case.call(timeout=60)
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])

        check()


# ------------------------------------------------------------------------------------------- shutdown


def test_sigterm_drains_streams(fleet):
    """`kvrelay gateway` as a process: SIGTERM lets the open stream finish, refuses new work, exits 0."""
    import signal

    from tests.helpers.procs import GatewayProcess

    nodes = [a for n in fleet.nodes for a in (f"--{n.role}", n.address)]
    with GatewayProcess.launch(["--model", fleet.model, "--shutdown-timeout", "20", *nodes], num_nodes=5) as gw:
        body = {"model": MODEL, "prompt": "Drain me", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            gw.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2], gw.log_tail()
        assert gw.wait(30) == 0, gw.log_tail()
        with pytest.raises(httpx.ConnectError):
            httpx.get(gw.url + "/health")


def test_node_shutdown_timeout_ends_the_stream_with_a_clean_error(fleet):
    """SIGTERM to a decode node whose --shutdown-timeout passes mid-stream: the client gets an error event
    (not a truncated answer that looks finished), and the node aborts the sequence and exits 0."""
    (node,) = start_nodes([("decode", tiny_args(fleet.model, "ucx", "--node-id", "decode-short",
                                                "--shutdown-timeout", "0.5", blocks=160))])
    gw = GatewayThread(model=fleet.model, decode=(node.address,), capacity_wait=1)  # no other node to move to
    try:
        body = {"model": MODEL, "prompt": "Stop me", "max_tokens": 1900, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            node.terminate()
            rest = [line for line in lines if line]
        errors = [json.loads(line.removeprefix("data: "))["error"] for line in rest
                  if line.startswith('data: {"error"')]
        assert len(errors) == 1, rest[-3:]
        error = errors[0]
        assert error["code"] == "node_stopped" and error["type"] == "upstream_error", rest[-3:]
        assert not any('"finish_reason":"length"' in line for line in rest)
        assert node.stop(30) == 0, node.log_tail()
        assert "aborted 1 requests still in flight" in node.log_tail(80)
    finally:
        gw.close()
        stop_nodes([node])


# ----------------------------------------------------------------------------------- node failure (last)


def test_decode_node_crash_is_routed_around(fleet, client):
    """SIGKILL a decode node: requests keep succeeding on the other one, and once its lease lapses the
    node is gone from the gateway's view."""
    victim = next(n for n in fleet.nodes if n.info.get("node_id") == "decode-1")
    victim.kill()
    for i in range(6):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=f"After the crash {i}: " + "x " * 40,
                                                          max_tokens=2)
        assert raw.headers["x-kvrelay-decode-node"] == "decode-0"
    gw = fleet.gw.gateway
    wait_for(lambda: all(n.node_id != "decode-1" for n in gw.discovery.nodes()), 20, "the lapsed lease to drop")
    assert httpx.get(fleet.gw.url + "/health").json()["decode_nodes"] == 1
