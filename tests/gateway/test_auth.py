"""API keys, tenants, admin routes, rate limits and input limits at the gateway (gateway.auth, gateway.ratelimit,
gateway.http_guard, gateway.input_limits): the real app over a TestClient, the real Redis for the buckets.

The decode node is an address nobody listens on, so a request that passes every check ends in a 503
(no capacity): what these tests need is that nothing before that lets a request through, or answers 500."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal

import grpc
import pytest

from kvrelay.gateway.auth import KeysFileError, KeyStore, Principal, current_principal, parse_keys
from kvrelay.gateway.errors import Overloaded, RateLimited, Unauthorized
from kvrelay.gateway.ratelimit import BucketState, RateDecision, RateLimiter, duration

KEYS = [
    {"key": "admin-key-123", "tenant": "ops", "admin": True},
    {"key": "tenant-a-key", "tenant": "a", "models": ["default", "SmolLM2*"], "rpm": 3, "tpm": 1000,
     "max_concurrent": 4},
    {"key_sha256": hashlib.sha256(b"tenant-b-key").hexdigest(), "tenant": "b", "models": ["other-model"],
     "priority": -1},
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# ----------------------------------------------------------------------------------------- keys


def test_keys_file_parses_json_and_yaml_and_holds_only_digests(tmp_path):
    keys = parse_keys(json.dumps(KEYS))
    assert set(keys) == {hashlib.sha256(k.encode()).hexdigest() for k in ("admin-key-123", "tenant-a-key",
                                                                           "tenant-b-key")}
    a = keys[hashlib.sha256(b"tenant-a-key").hexdigest()]
    assert (a.tenant, a.models, a.rpm, a.tpm, a.max_concurrent, a.admin, a.priority) == (
        "a", ("default", "SmolLM2*"), 3, 1000, 4, False, 0)
    assert a.may_use("SmolLM2-135M") and a.may_use("default") and not a.may_use("other-model")
    yaml_text = "keys:\n  - key: yaml-key-1234\n    tenant: y\n    rpm: 5\n"
    (p,) = parse_keys(yaml_text).values()
    assert (p.tenant, p.rpm, p.models, p.sheddable) == ("y", 5, None, False)
    assert "tenant-a-key" not in repr(KeyStore(keys_file=_write(tmp_path, KEYS)).__dict__)


@pytest.mark.parametrize(("entries", "message"), [
    ([], "non-empty list"),
    ([{"tenant": "x"}], "exactly one of 'key' and 'key_sha256'"),
    ([{"key": "short"}], "at least 8 characters"),
    ([{"key_sha256": "abc"}], "64 hex digits"),
    ([{"key": "long-enough", "rpm": 0}], "'rpm' must be a positive integer"),
    ([{"key": "long-enough", "models": "default"}], "'models' must be a list"),
    ([{"key": "long-enough", "admin": "yes"}], "'admin' must be true or false"),
    ([{"key": "long-enough", "color": 1}], "unknown fields ['color']"),
    ([{"key": "long-enough"}, {"key": "long-enough"}], "entry 1: the same key appears twice"),
])
def test_a_bad_keys_file_says_which_entry_and_why(entries, message):
    with pytest.raises(KeysFileError) as e:
        parse_keys(json.dumps(entries))
    assert message in str(e.value)


def test_authenticate_and_reload(tmp_path):
    path = _write(tmp_path, KEYS)
    store = KeyStore(api_key="single-key", keys_file=path)
    assert store.authenticate("Bearer single-key").admin
    assert store.authenticate(b"bearer tenant-a-key").tenant == "a"
    for header in (None, "", "Bearer", "Basic tenant-a-key", "Bearer wrong-key-123"):
        with pytest.raises(Unauthorized):
            store.authenticate(header)
    path.write_text(json.dumps([{"key": "new-key-12345", "tenant": "n"}]))
    assert store.reload()
    assert store.authenticate("Bearer new-key-12345").tenant == "n"
    with pytest.raises(Unauthorized):
        store.authenticate("Bearer tenant-a-key")  # gone from the file
    assert store.authenticate("Bearer single-key").admin  # --api-key stays
    path.write_text("[{")  # a broken file keeps the keys in force
    assert not store.reload() and store.authenticate("Bearer new-key-12345").tenant == "n"
    assert KeyStore().authenticate(None) is KeyStore.ANONYMOUS  # no keys: open


def _write(tmp_path, entries):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    return path


# ----------------------------------------------------------------------------------- rate limits


def test_reset_durations_in_openai_format():
    assert [duration(s) for s in (0.02, 1, 59.5, 360, 3723)] == ["20ms", "1s", "1m0s", "6m0s", "1h2m3s"]
    state = BucketState(limit=60, level=30.0)
    assert (state.remaining, state.reset_s, state.wait_s(31)) == (30, 30.0, 1)
    assert RateDecision(state, None).headers() == {"x-ratelimit-limit-requests": "60",
                                                   "x-ratelimit-remaining-requests": "30",
                                                   "x-ratelimit-reset-requests": "30s"}
    # Pressure: the larger share spent of either bucket (a burst of 10 with 7.5 left; a token bucket in debt).
    assert RateDecision(BucketState(60, 7.5, capacity=10), None).pressure == 0.25
    assert RateDecision(BucketState(60, 7.5, capacity=10), BucketState(1000, -5.0)).pressure == 1.0
    assert RateDecision(None, None).pressure == 0.0


def test_engine_priority_counts_tenant_in_flight_pressure_and_band():
    from kvrelay.gateway.admission import PRESSURE_WEIGHT, Activity

    activity = Activity()
    activity.by_tenant = {"a": 3}
    a, b, vip = Principal("ka", tenant="a"), Principal("kb", tenant="b"), Principal("kv", tenant="b", priority=2)
    assert activity.engine_priority(b, 0) == 0
    assert activity.engine_priority(a, 5) == 3 + 5
    assert activity.engine_priority(a, -7, pressure=1.0) == 3 + PRESSURE_WEIGHT  # a request's own never below 0
    assert activity.engine_priority(b, 0, pressure=0.5) == PRESSURE_WEIGHT // 2
    assert activity.engine_priority(vip, 0, pressure=1.0) == PRESSURE_WEIGHT - 2_000_000


def test_buckets_in_redis_are_shared_by_gateways_and_tokens_go_into_debt(redis_url):
    async def run():
        one, two = RateLimiter(redis_url, "gw-1"), RateLimiter(redis_url, "gw-2")
        await one.start()
        await two.start()
        key = Principal(key_id="k", rpm=240, tpm=100)  # a burst of two seconds' worth: 8 requests
        try:
            seen = [await gw.admit(key) for gw in (one, two) * 4]
            assert [d.requests.remaining for d in seen] == [7, 6, 5, 4, 3, 2, 1, 0]  # one bucket for both gateways
            with pytest.raises(RateLimited) as e:
                await two.admit(key)
            assert e.value.type == "requests" and e.value.retry_after >= 1
            assert e.value.headers()["x-ratelimit-remaining-requests"] == "0"
            other = Principal(key_id="other", tpm=100)
            await one.admit(other)
            one.charge_tokens(other, 150)  # a generation used more than was left: debt
            await asyncio.sleep(0.1)
            with pytest.raises(RateLimited) as e:
                await two.admit(other)
            assert e.value.type == "tokens" and e.value.retry_after >= 29  # 50 tokens at 100/min
            assert one.degraded_reason is None
        finally:
            await one.stop()
            await two.stop()

    asyncio.run(run())


def test_redis_down_each_gateway_enforces_its_share():
    async def run():
        limiter = RateLimiter("redis://127.0.0.1:9/0", "gw-1")  # nobody listens there
        await limiter.start()
        limiter.gateways = 2
        key = Principal(key_id="k", rpm=240)
        try:
            states = [await limiter.admit(key) for _ in range(4)]
            # Half of 240 a minute, in a bucket of two seconds' worth of that half.
            assert [(s.requests.limit, s.requests.remaining) for s in states] == [(120, n) for n in (3, 2, 1, 0)]
            with pytest.raises(RateLimited):
                await limiter.admit(key)
            assert "Redis unreachable" in limiter.degraded_reason and "1/2" in limiter.degraded_reason
        finally:
            await limiter.stop()

    asyncio.run(run())


# ---------------------------------------------------------------------------------- the app


@pytest.fixture(scope="module")
def app_client(tmp_path_factory):
    from fastapi.testclient import TestClient

    from kvrelay.gateway.config import GatewayConfig
    from kvrelay.gateway.runtime import Gateway
    from kvrelay.gateway.server import build_app

    path = _write(tmp_path_factory.mktemp("keys"), KEYS)
    config = GatewayConfig(decode=("127.0.0.1:9",), api_keys_file=str(path), health_interval=60, capacity_wait=0.0,
                           max_body_bytes=4096, max_messages=4, max_tools=2, max_schema_depth=5,
                           max_logit_bias=3, served_model_names=("default", "SmolLM2-135M"))
    with TestClient(build_app(Gateway(config))) as client:
        yield client


ROUTES = [("get", "/v1/models", None), ("post", "/v1/chat/completions", {"messages": [{"role": "user",
                                                                                       "content": "hi"}]}),
          ("post", "/v1/completions", {"prompt": "hi"}), ("post", "/tokenize", {"prompt": "hi"}),
          ("post", "/detokenize", {"tokens": [1]}), ("get", "/version", None), ("get", "/metrics", None),
          ("post", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
          ("post", "/v1/unload_lora_adapter", {"lora_name": "x"}), ("get", "/openapi.json", None)]


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
def test_every_route_needs_a_valid_key(app_client, method, path, body):
    for headers in ({}, bearer("wrong-key-1234"), {"Authorization": "tenant-a-key"}):
        r = getattr(app_client, method)(path, headers=headers, **({"json": body} if body else {}))
        assert r.status_code == 401, (path, headers)
        assert r.json()["error"]["type"] == "authentication_error"
    assert app_client.get("/health").status_code in (200, 503)


def test_keys_see_and_use_only_their_models_and_admin_routes_need_admin(app_client):
    ids = lambda key: [m["id"] for m in app_client.get("/v1/models", headers=bearer(key)).json()["data"]]  # noqa: E731
    assert ids("admin-key-123") == ["default", "SmolLM2-135M"]
    assert ids("tenant-a-key") == ["default", "SmolLM2-135M"] and ids("tenant-b-key") == []
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    r = app_client.post("/v1/chat/completions", headers=bearer("tenant-b-key"), json=chat)
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed"
    r = app_client.post("/tokenize", headers=bearer("tenant-b-key"), json={"prompt": "x"})
    assert r.status_code == 403
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
                       ("/v1/unload_lora_adapter", {"lora_name": "x"})):
        r = app_client.post(path, headers=bearer("tenant-a-key"), json=body)
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
        assert app_client.post(path, headers=bearer("admin-key-123"), json=body).status_code not in (401, 403, 500)


def test_rate_limit_headers_and_429(app_client):
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    codes, remaining = [], []
    for _ in range(4):
        r = app_client.post("/v1/chat/completions", headers=bearer("tenant-a-key"), json=chat)
        codes.append(r.status_code)
        remaining.append(r.headers.get("x-ratelimit-remaining-requests"))
    # No node behind: 503s, then 429 past the burst of 2 (two seconds' worth of 3 a minute, at least 2 requests).
    assert codes == [503, 503, 429, 429]
    assert remaining[:2] == ["1", "0"]
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-limit-tokens"] == "1000"
    from kvrelay.common.prometheus import Metrics

    metrics = Metrics.parse(app_client.get("/metrics", headers=bearer("admin-key-123")).text)
    assert metrics.value("kvrelay:rejected_requests_total", reason="rate_limit_exceeded") == 2
    assert metrics.value("kvrelay:admission_saturation") == 0.0  # nothing in progress now


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"messages": [{"role": "user", "content": "x"}] * 5}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, 413, None),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}, 400,
     "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3)]}, 400, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "deep", "schema": {"a": {"b": {"c": {"d": {"e": {"f": 1}}}}}}}}}, 400,
     "response_format.json_schema.schema"),
])
def test_input_limits(app_client, body, status, param):
    r = app_client.post("/v1/chat/completions", headers=bearer("admin-key-123"), json={"model": "default", **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_sighup_reloads_the_keys_file(tmp_path):
    from kvrelay.gateway.config import GatewayConfig
    from kvrelay.gateway.runtime import Gateway

    path = _write(tmp_path, KEYS[:1])

    async def run():
        gateway = Gateway(GatewayConfig(decode=("127.0.0.1:9",), api_keys_file=str(path), health_interval=60))
        await gateway.start()
        try:
            path.write_text(json.dumps([{"key": "after-hup-key", "tenant": "h"}]))
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(100):  # the loop runs the handler on its next turn; up to 5 s on a loaded machine
                await asyncio.sleep(0.05)
                if len(gateway.keys) == 1 and "h" in gateway.keys.tenants():
                    break
            return gateway.keys.authenticate("Bearer after-hup-key").tenant
        finally:
            await gateway.stop()

    assert asyncio.run(run()) == "h"


# ------------------------------------------------------------------------------ fair admission


def test_admission_sheds_sheddable_then_holds_tenants_to_their_share(default_tokenizer):
    from kvrelay.gateway.admission import Admission
    from kvrelay.gateway.core import GatewayCore

    core = GatewayCore(default_tokenizer, router=None, dispatcher=None,
                       admission=Admission(max_concurrent_requests=8, shed_at=0.5))
    a, b = Principal("ka", tenant="a"), Principal("kb", tenant="b")
    shed, vip = Principal("ks", tenant="s", priority=-1), Principal("kv", tenant="a", priority=1)
    core.activity.active, core.activity.by_tenant = 3, {"a": 3}  # under pressure? not yet (3 < 4)
    for p in (a, shed):
        core.activity.admit(core.admission, p)
    core.activity.active, core.activity.by_tenant = 5, {"a": 5}
    core.activity.admit(core.admission, a)  # alone, a may have it all
    with pytest.raises(Overloaded) as e:
        core.activity.admit(core.admission, shed)
    assert e.value.code == "shed"
    core.activity.by_tenant = {"a": 4, "b": 1}
    with pytest.raises(Overloaded) as e:
        core.activity.admit(core.admission, a)  # a holds 4 of 8, its share beside b
    assert e.value.code == "tenant_share"
    core.activity.admit(core.admission, b)  # b holds nothing: admitted
    core.activity.admit(core.admission, vip)  # a's band-1 key is above the share
    core.activity.active = 8
    with pytest.raises(Overloaded):
        core.activity.admit(core.admission, vip)  # the bound itself holds for everyone
    core.activity.active, core.activity.by_key = 1, {"kc": 2}
    capped = Principal("kc", tenant="c", max_concurrent=2)
    with pytest.raises(Overloaded) as e:
        core.activity.admit(core.admission, capped)  # its own cap, whatever the gateway's load
    assert e.value.code == "concurrency_limit"
    core.activity.admit(core.admission, Principal("kc", tenant="c", max_concurrent=3))


def test_tenants_hash_into_blocks_of_their_own(default_tokenizer):
    from kvrelay.common.sampling_params import SamplingParams
    from kvrelay.gateway.admission import Admission
    from kvrelay.gateway.core import GatewayCore, GenerateInput
    from kvrelay.gateway.outputs import OutputOptions

    core = GatewayCore(default_tokenizer, router=None, dispatcher=None, admission=Admission())
    inp = GenerateInput([1, 2, 3], SamplingParams(max_tokens=1), OutputOptions(), cache_salt="s")
    token = current_principal.set(Principal("ka", tenant="a"))
    core.activity.by_tenant = {"a": 3, "b": 1}
    try:
        first = core.generate(inp).inp
        assert first.cache_salt == "a\x00s" and first.params.priority == 3  # behind a's 3 in flight
        current_principal.set(Principal("kb", tenant="b", priority=1))  # a higher band outranks in-flight counts
        assert core.generate(inp).inp.params.priority == 1 - 1_000_000
        current_principal.set(Principal("kd"))  # the default tenant (one --api-key): unchanged
        assert (core.generate(inp).inp.cache_salt, core.generate(inp).inp.params.priority) == ("s", 0)
    finally:
        current_principal.reset(token)


# ------------------------------------------------------------------------------------- gRPC


def test_grpc_keys_models_and_malformed_messages(tmp_path):
    from kvrelay.gateway.config import GatewayConfig
    from kvrelay.gateway.grpc_api import start_grpc_server
    from kvrelay.gateway.runtime import Gateway
    from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2 as pb
    from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2_grpc as pb_grpc

    path = _write(tmp_path, KEYS)

    async def run():
        gateway = Gateway(GatewayConfig(decode=("127.0.0.1:9",), api_keys_file=str(path), health_interval=60,
                                        capacity_wait=0.0))
        await gateway.start()
        server = await start_grpc_server(gateway, "127.0.0.1", 0)
        codes = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.grpc_port}") as channel:
                stub = pb_grpc.GatewayStub(channel)
                for name, meta in (("none", ()), ("wrong", (("authorization", "Bearer nope-nope-1"),)),
                                   ("b", (("authorization", "Bearer tenant-b-key"),)),
                                   ("a", (("authorization", "Bearer tenant-a-key"),))):
                    try:
                        async for _ in stub.Generate(pb.GenerateRequest(prompt="hi"), metadata=meta):
                            pass
                    except grpc.aio.AioRpcError as e:
                        codes[name] = e.code()
                models = await stub.ListModels(pb.ModelsRequest(),
                                               metadata=(("authorization", "Bearer tenant-b-key"),))
                raw = channel.unary_unary("/kvrelay.gateway.v1.Gateway/ListModels")
                try:
                    await raw(b"\xff\xff\xff", metadata=(("authorization", "Bearer admin-key-123"),))
                except grpc.aio.AioRpcError as e:
                    codes["malformed"] = e.code()
        finally:
            await server.stop(0)
            await gateway.stop()
        return codes, list(models.models)

    codes, models = asyncio.run(run())
    assert codes == {"none": grpc.StatusCode.UNAUTHENTICATED, "wrong": grpc.StatusCode.UNAUTHENTICATED,
                     "b": grpc.StatusCode.PERMISSION_DENIED, "a": grpc.StatusCode.UNAVAILABLE,
                     "malformed": grpc.StatusCode.INVALID_ARGUMENT}
    assert models == []


def test_admission_gauges_read_the_tenants_in_progress():
    from kvrelay.common.prometheus import Metrics
    from kvrelay.gateway.admission import Activity
    from kvrelay.gateway.metrics import GatewayMetrics

    metrics, activity = GatewayMetrics("m", "cache_aware"), Activity()
    metrics.watch_admission(activity, 8)
    activity.active, activity.by_tenant = 3, {"a": 2, "b": 1}
    m = Metrics.parse(metrics.render().decode())
    assert m.value("kvrelay:tenant_requests_in_progress", tenant="a") == 2
    assert m.value("kvrelay:tenant_requests_in_progress", tenant="b") == 1
    assert m.value("kvrelay:admission_saturation") == 3 / 8
