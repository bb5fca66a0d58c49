"""A keyed fleet of real processes (issue "Who may call, how much, and what happened"): one prefill and one decode
node, two `kvrelay gateway` processes sharing a keys file and a Redis, and an OTLP collector on loopback.

- One request is one trace with spans from all three processes that served it, linked parent to child, under
  the client's own traceparent.
- A key's requests-per-minute holds across both gateways (the buckets are in Redis).
- Fuzzed bodies (hypothesis) and malformed gRPC messages get 4xx / INVALID_ARGUMENT with a message, never a 5xx,
  and the fleet serves normally afterwards.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvrelay.common.system import free_port
from kvrelay.gateway.ratelimit import burst
from tests.helpers.models import make_tiny_with_tokenizer
from tests.helpers.nodes import start_nodes, stop_nodes, tiny_args, wait_for
from tests.helpers.procs import GatewayProcess

pytestmark = pytest.mark.timeout(300)

ADMIN, LIMITED = "sk-admin-key-0001", "sk-limited-key-01"
RPM = 6


class Collector:
    """An OTLP/gRPC trace receiver: every span it is sent, as (service, name, trace id, span id, parent id)."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tpb_grpc

        collector = self
        self.spans: list[dict] = []
        self.lock = threading.Lock()

        class Servicer(tpb_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - gRPC method name
                with collector.lock:
                    for rs in request.resource_spans:
                        service = next((a.value.string_value for a in rs.resource.attributes
                                        if a.key == "service.name"), "")
                        for ss in rs.scope_spans:
                            for s in ss.spans:
                                collector.spans.append({
                                    "service": service, "name": s.name, "trace": s.trace_id.hex(),
                                    "id": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                                    "attributes": {a.key: a.value for a in s.attributes}})
                return tpb.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tpb_grpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def trace(self, trace_id: str) -> list[dict]:
        with self.lock:
            return [s for s in self.spans if s["trace"] == trace_id]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, default_model_dir):
    from kvrelay.index.redis_server import start_redis

    folder = tmp_path_factory.mktemp("secure-fleet")
    model = str(make_tiny_with_tokenizer(folder / "tiny-sec", Path(default_model_dir)))
    keys = folder / "keys.json"
    keys.write_text(json.dumps([{"key": ADMIN, "tenant": "ops", "admin": True},
                                {"key": LIMITED, "tenant": "metered", "rpm": RPM}]))
    collector = Collector()
    redis = start_redis(password=secrets.token_hex(16))
    reg = ["--redis-url", redis.url, "--heartbeat-seconds", "0.5", "--otlp-traces-endpoint", collector.endpoint]
    nodes, gateways = [], []
    try:
        nodes = start_nodes([(role, tiny_args(model, "shm", "--node-id", role, *reg))
                             for role in ("prefill", "decode")])
        common = ["--model", model, "--redis-url", redis.url, "--api-keys-file", str(keys),
                  "--local-prefill-threshold", "8", "--startup-timeout", "30"]
        grpc_port = free_port()
        gateways = [GatewayProcess.launch([*common, "--otlp-traces-endpoint", collector.endpoint, "--grpc-port",
                                           str(grpc_port)], num_nodes=2),
                    GatewayProcess.launch(common, num_nodes=2)]
        gateways[0].grpc_port = grpc_port
        yield gateways, collector
    finally:
        for gw in gateways:
            gw.stop(10)
        stop_nodes(nodes)
        redis.stop()
        collector.server.stop(0)


def _chat(gw: GatewayProcess, key: str, headers: dict | None = None, **body) -> httpx.Response:
    body = {"model": "tiny-sec", "messages": [{"role": "user", "content": "Tell me about dragons and their caves, "
                                                                           "in some detail please."}],
            "max_tokens": 3, "temperature": 0, **body}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}", **(headers or {})})


def test_one_request_is_one_trace_across_gateway_prefill_and_decode(fleet):
    (gw, _), collector = fleet
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    r = _chat(gw, ADMIN, {"traceparent": f"00-{trace_id}-{client_span}-01"})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvrelay-prefill-node"] == "prefill"  # disaggregated: all three processes took part
    want = {("kvrelay-gateway", "llm_request"), ("kvrelay-gateway", "route"), ("kvrelay-gateway", "reserve"),
            ("kvrelay-gateway", "prefill"), ("kvrelay-gateway", "decode"), ("kvrelay-decode", "node.reserve"),
            ("kvrelay-prefill", "node.prefill"), ("kvrelay-prefill", "kv_transfer"),
            ("kvrelay-decode", "node.generate"), ("kvrelay-decode", "kv_receive")}
    wait_for(lambda: want <= {(s["service"], s["name"]) for s in collector.trace(trace_id)}, 20, "every span")
    spans = {(s["service"], s["name"]): s for s in collector.trace(trace_id)}
    names = {s["id"]: s["name"] for s in spans.values()} | {client_span: "client"}
    parent = {key: names[s["parent"]] for key, s in spans.items()}
    http = parent.pop(("kvrelay-gateway", "POST /v1/chat/completions"), None)  # FastAPI's own server span, if any
    assert http in (None, "client")
    assert parent == {
        ("kvrelay-gateway", "llm_request"): "client" if http is None else "POST /v1/chat/completions",
        ("kvrelay-gateway", "route"): "llm_request", ("kvrelay-gateway", "reserve"): "llm_request",
        ("kvrelay-gateway", "prefill"): "llm_request", ("kvrelay-gateway", "decode"): "llm_request",
        ("kvrelay-decode", "node.reserve"): "reserve", ("kvrelay-prefill", "node.prefill"): "prefill",
        ("kvrelay-prefill", "kv_transfer"): "node.prefill", ("kvrelay-decode", "node.generate"): "decode",
        ("kvrelay-decode", "kv_receive"): "node.generate"}
    root = spans[("kvrelay-gateway", "llm_request")]["attributes"]
    assert root["gen_ai.usage.completion_tokens"].int_value == 3 and root["kvrelay.tenant"].string_value == "ops"
    assert spans[("kvrelay-prefill", "kv_transfer")]["attributes"]["kvrelay.kv_transfer.bytes"].int_value > 0


def test_a_keys_rate_limit_holds_across_two_gateways(fleet):
    gateways, _ = fleet
    t0 = time.monotonic()
    codes = [_chat(gateways[i % 2], LIMITED, max_tokens=1).status_code for i in range(2 * RPM)]
    full = burst(RPM)
    allowance = full + RPM / 60 * (time.monotonic() - t0)  # a full bucket, and what refilled meanwhile
    ok, limited = codes.count(200), codes.count(429)
    assert ok + limited == len(codes) and full <= ok <= allowance * 1.1, codes  # one bucket for the fleet
    r = _chat(gateways[0], LIMITED)
    assert r.status_code == 429 and r.headers["x-ratelimit-limit-requests"] == str(RPM)
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
    assert _chat(gateways[1], ADMIN).status_code == 200  # other keys are unaffected


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4), max_leaves=12)
_FIELDS = st.sampled_from(["model", "messages", "max_tokens", "n", "temperature", "stop", "logit_bias", "tools",
                           "response_format", "top_logprobs", "logprobs", "stream", "seed", "tool_choice",
                           "prompt", "best_of", "structured_outputs"])
_BODIES = st.one_of(
    st.binary(max_size=64),
    _JSON.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(_FIELDS, _JSON, max_size=5).map(
        lambda d: json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **d}).encode()),
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(body=_BODIES, path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize"]))
def _fuzz_one(gw_url: str, body: bytes, path: str) -> None:
    r = httpx.post(gw_url + path, content=body, timeout=60,
                   headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    assert r.status_code < 500, (path, body, r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"], r.text


def test_fuzzed_bodies_and_malformed_grpc_get_4xx_and_the_fleet_serves_on(fleet):
    (gw, _), _ = fleet
    _fuzz_one(gw.url)
    big = httpx.post(gw.url + "/v1/chat/completions", content=b"{" + b" " * (9 << 20) + b"}", timeout=60,
                     headers={"Authorization": f"Bearer {ADMIN}"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    with grpc.insecure_channel(f"127.0.0.1:{gw.grpc_port}") as channel:
        for method in ("/kvrelay.gateway.v1.Gateway/ListModels", "/kvrelay.gateway.v1.Gateway/Generate"):
            unary = method.endswith("ListModels")
            call = channel.unary_unary(method) if unary else channel.unary_stream(method)
            for raw in (b"\xff\xff\xff", b"\x0a\x05ab", secrets.token_bytes(40)):
                try:
                    reply = call(raw, metadata=(("authorization", f"Bearer {ADMIN}"),), timeout=30)
                    if not unary:
                        list(reply)
                except grpc.RpcError as e:
                    assert e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), (raw, e)
                    assert e.details()
    assert _chat(gw, ADMIN).status_code == 200  # the fleet serves on
    assert "Traceback" not in gw.log_path.read_text(errors="replace")
