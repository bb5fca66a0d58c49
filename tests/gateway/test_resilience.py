"""The gateway's failure handling against scripted nodes (fast, exact): migration of a failed or hung stream,
admission (429, Retry-After, deadlines), circuit breakers, and an index that fails or hangs. The same
faults on real processes are in tests/e2e/test_chaos.py."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import httpx
import pytest

from kvrelay.common.prometheus import Metrics
from kvrelay.gateway.breaker import BreakerConfig, BreakerState, CircuitBreaker
from kvrelay.gateway.discovery import Discovery, DiscoveryConfig, Node, Probe
from kvrelay.gateway.liveness import Liveness
from kvrelay.gateway.node_client import NodeClients
from kvrelay.gateway.policies import make_policy
from kvrelay.gateway.router import Router
from kvrelay.model_files.resolve import DEFAULT_MODEL_ID
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc
from tests.gateway.test_fake_nodes import FakeNode, Fleet, Script
from tests.gateway.test_unit import FakeDiscovery, prompt
from tests.gateway.test_unit import fleet as node_fleet


@pytest.fixture
def fleet(default_tokenizer, request):
    kwargs = dict(local_prefill_threshold=8, stall_timeout=0.5, probe_timeout=0.3, capacity_wait=1.0)
    kwargs.update(getattr(request, "param", {}))
    f = Fleet(default_tokenizer, n_prefill=1, n_decode=2, **kwargs)
    yield f
    f.close()


def _metric(f: Fleet, name: str, **labels: str) -> float:
    return Metrics.scrape(f.url + "/metrics").value(name, **labels) or 0.0


def _body(stream: bool, max_tokens: int = 12) -> dict:
    return {"prompt": "Tell me something long. " * 6, "max_tokens": max_tokens, "stream": stream, "seed": 3}


def _text(f: Fleet, stream: bool, max_tokens: int = 12) -> tuple[str, list[str]]:
    if not stream:
        r = httpx.post(f.url + "/v1/completions", json=_body(False, max_tokens), timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"], []
    with httpx.stream("POST", f.url + "/v1/completions", json=_body(True, max_tokens), timeout=30) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks
    return "".join(c["choices"][0]["text"] for c in chunks), lines


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_decode_failure_mid_stream_migrates_without_loss(fleet, stream):
    expected, _ = _text(fleet, stream)
    node = fleet.gateway.router.route  # the decode node of a cold prompt: fail whichever is picked
    decision = asyncio.run(node(fleet.gateway.tokenizer.encode(_body(False)["prompt"])))
    fleet.script.die_node, fleet.script.die_after = decision.decode.node_id, 5
    fleet.script.calls.clear()
    text, _ = _text(fleet, stream)
    assert text == expected
    generates = [(n, rid) for n, m, rid in fleet.script.calls if m in ("Generate", "Reserve")]
    moved = [n for n, rid in generates if rid.endswith(".m1")]
    assert moved and decision.decode.node_id not in moved, generates
    assert _metric(fleet, "kvrelay:migrations_total", stage="mid_stream") == 1


def test_hung_decode_node_is_detected_and_left(fleet):
    expected, _ = _text(fleet, True, 10)
    decision = asyncio.run(fleet.gateway.router.route(fleet.gateway.tokenizer.encode(_body(False)["prompt"])))
    victim = decision.decode.node_id
    fleet.script.die_node, fleet.script.die_after, fleet.script.hang = victim, 4, True
    t0 = time.monotonic()
    text, _ = _text(fleet, True, 10)
    assert text == expected and time.monotonic() - t0 < 10
    assert fleet.gateway.discovery.breaker_state(victim) == "open"
    assert victim not in [n.node_id for n in fleet.gateway.discovery.routable("decode")]
    health = httpx.get(fleet.url + "/health").json()
    assert health["status"] == "degraded" and any(victim in r for r in health["reasons"])
    fleet.script.hang = False  # it answers again: the probe brings it back half-open, a success closes it
    deadline = time.monotonic() + 10
    while fleet.gateway.discovery.breaker_state(victim) == "open":
        assert time.monotonic() < deadline, "the breaker never let the node back"
        time.sleep(0.1)


def test_migration_limit_ends_with_a_clean_error(default_tokenizer):
    f = Fleet(default_tokenizer, n_prefill=0, n_decode=1, migration_limit=1, capacity_wait=0.3)
    try:
        f.script.die_node, f.script.die_after = "d0", 3
        with httpx.stream("POST", f.url + "/v1/completions", json=_body(True), timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["type"] == "upstream_error", error
        texts = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-2])
        assert texts  # what was streamed before the failure stays streamed
        generates = [rid for _, m, rid in f.script.calls if m == "Generate"]
        assert len(generates) == 2 and generates[1].endswith(".m1")  # one move, then the limit
    finally:
        f.close()


@pytest.mark.parametrize("fleet", [{"max_concurrent_requests": 1}], indirect=True)
def test_past_the_concurrency_bound_429_with_retry_after(fleet):
    fleet.script.token_delay_s = 0.05
    with httpx.stream("POST", fleet.url + "/v1/completions", json=_body(True, 40), timeout=30) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the connection, which cancels the stream
        next(line for line in lines if line.startswith("data:"))
        second = httpx.post(fleet.url + "/v1/completions", json=_body(False, 2), timeout=30)
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    err = second.json()["error"]
    assert err["type"] == "rate_limit_error" and "max-concurrent-requests" in err["message"]
    assert _metric(fleet, "kvrelay:rejected_requests_total", reason="overloaded") == 1


@pytest.mark.parametrize("fleet", [{"request_timeout": 0.6}], indirect=True)
def test_request_timeout_aborts_everywhere(fleet):
    fleet.script.token_delay_s = 0.1
    r = httpx.post(fleet.url + "/v1/completions", json=_body(False, 100), timeout=30)
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
    with httpx.stream("POST", fleet.url + "/v1/completions", json=_body(True, 100), timeout=30) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"
    deadline = time.monotonic() + 5
    while any(n.active for n in fleet.nodes):
        assert time.monotonic() < deadline, "a node still streams a timed-out request"
        time.sleep(0.05)
    assert _metric(fleet, "kvrelay:request_timeouts_total") == 2


def test_draining_is_503_with_retry_after(fleet):
    fleet.gateway.core.draining = True
    r = httpx.post(fleet.url + "/v1/completions", json=_body(False, 2))
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "shutting_down"


def test_no_decode_node_waits_then_503(default_tokenizer):
    f = Fleet(default_tokenizer, n_prefill=0, n_decode=0, decode=("127.0.0.1:9",), capacity_wait=0.5)
    try:
        t0 = time.monotonic()
        r = httpx.post(f.url + "/v1/completions", json=_body(False, 2), timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and time.monotonic() - t0 >= 0.5
    finally:
        f.close()


# --------------------------------------------------------------------------------------- breaker


def test_breaker_thresholds_and_half_open():
    b = CircuitBreaker(BreakerConfig(failure_threshold=3, open_s=1.0, max_open_s=4.0, min_calls=100))
    assert not b.record_failure("x", now=0) and not b.record_failure("x", now=0.1)
    b.record_success(now=0.2)  # consecutive count restarts
    assert not b.record_failure("x", now=0.3) and not b.record_failure("x", now=0.4)
    assert b.record_failure("x", now=0.5) and b.state == BreakerState.OPEN and not b.routable
    assert not b.probe_due(now=1.0) and b.probe_due(now=1.5)
    assert b.probe_passed() and b.state == BreakerState.HALF_OPEN and b.routable
    assert b.record_failure("again", now=2.0)  # one failure half-open re-opens, for longer
    assert b.open_until == pytest.approx(4.0)
    b.probe_passed()
    assert b.record_success(now=5.0) and b.state == BreakerState.CLOSED


def test_breaker_error_rate():
    b = CircuitBreaker(BreakerConfig(failure_threshold=100, error_rate=0.5, min_calls=10, window_s=10))
    for i in range(30):  # a third of the calls fail: below the rate
        b.record_failure("old", now=i * 0.01)
        b.record_success(now=i * 0.01)
        b.record_success(now=i * 0.01)
    assert b.state == BreakerState.CLOSED  # (these calls leave the window before the ones below)
    for i in range(4):
        b.record_success(now=25 + i)
    for i in range(5):  # 5 failed of 9: too few calls to judge
        assert not b.record_failure("x", now=30 + i * 0.1)
    assert b.record_failure("x", now=31) and b.state == BreakerState.OPEN  # 6 failed of 10


# ------------------------------------------------------------------------------------ health probes


async def _probed_node(script: Script, probe_timeout_s: float = 0.3):
    """A scripted node on a real gRPC server, and a discovery (with its liveness monitor) that probes it."""
    fake = FakeNode("d0", "decode", script, [1, 2, 3], 100)
    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(fake, server)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    discovery = Discovery(DiscoveryConfig(DEFAULT_MODEL_ID, 16, probe_timeout_s=probe_timeout_s), NodeClients())
    node = Node("d0", "decode", fake.address, DEFAULT_MODEL_ID, 16, "static")
    return server, discovery, Liveness(discovery, stall_s=60), node


def _health_calls(script: Script) -> int:
    return sum(1 for _, method, _ in script.calls if method == "Health")


def test_one_health_probe_per_node_at_a_time_within_the_probe_timeout():
    script = Script(die_node="d0", hang=True)

    async def go():
        server, discovery, _, node = await _probed_node(script)
        try:
            t0 = time.monotonic()
            discovery.suspect(node)  # a failed call's probe, the liveness monitor's and the breaker's at once
            answers = await asyncio.gather(discovery.probe(node), discovery.probe(node))
            elapsed = time.monotonic() - t0
            calls = _health_calls(script)
            script.hang = False
            again = await discovery.probe(node)  # over: the next question is a new probe
            return answers, elapsed, calls, again, discovery.breaker_state("d0")
        finally:
            await discovery.stop()
            await server.stop(None)

    answers, elapsed, calls, again, state = asyncio.run(go())
    assert calls == 1 and answers[0] == answers[1] and not answers[0].healthy
    assert answers[0].reason.startswith("no answer (") and 0.3 <= elapsed < 2.0
    assert again == Probe(True) and _health_calls(script) == 2
    assert state == "half_open"  # the unanswered probe opened the breaker, the answered one let it back


def test_every_probe_answer_reaches_the_watched_calls():
    script = Script(die_node="d0", hang=False)

    async def go():
        server, discovery, liveness, node = await _probed_node(script)
        try:
            with liveness.watch(node) as slow:
                slow.last -= 30
                await discovery.probe(node)  # answered (asked by anyone): alive, just slow
                touched = time.monotonic() - slow.last < 5
            script.hang = True
            with liveness.watch(node) as watch:
                discovery.suspect(node)  # e.g. after a call that got no answer: long before the stall timeout
                await asyncio.sleep(0.6)
                return touched, watch.error
        finally:
            await discovery.stop()
            await server.stop(None)

    touched, error = asyncio.run(go())
    assert touched
    assert error is not None and error.startswith("node d0 stopped answering: no answer (")
    assert "without output" in error


def test_a_failed_probe_spares_a_call_the_node_still_streams_on_until_it_goes_quiet():
    """A draining node refuses new connections while its last messages are on their way: a call that heard
    from the node within the last round is not failed; once it goes quiet, the next round's probe fails it."""
    script = Script(die_node="d0", hang=True)

    async def go():
        server, discovery, _, node = await _probed_node(script)
        liveness = Liveness(discovery, stall_s=60, interval_s=30)  # rounds driven by hand
        try:
            with liveness.watch(node) as quiet, liveness.watch(node) as streaming:
                streaming.output()
                await discovery.probe(node)
                first = quiet.error, streaming.error
                streaming.heard -= 60  # nothing since, a round later
                liveness.check()  # the node that failed a probe is asked again, stall or not
                await asyncio.sleep(0.6)
                return first, streaming.error
        finally:
            await discovery.stop()
            await server.stop(None)

    (quiet, spared), failed = asyncio.run(go())
    assert quiet is not None and quiet.startswith("node d0 stopped answering: no answer (")
    assert spared is None
    assert failed is not None and failed.startswith("node d0 stopped answering: no answer (")


# ----------------------------------------------------------------------------------------- index


class _Index:
    def __init__(self, delay: float = 0.0, fail: bool = False) -> None:
        self.delay, self.fail, self.calls = delay, fail, 0

    def lookup(self, hashes, nodes=None):
        self.calls += 1
        if self.delay:
            time.sleep(self.delay)  # a hung Redis: the socket read blocks
        if self.fail:
            raise ConnectionError("redis down")
        return {}


def test_a_hung_index_never_stalls_routing():
    index = _Index(delay=1.0)
    router = Router(FakeDiscovery(node_fleet()), make_policy("cache_aware"), index, 16, lookup_timeout_s=0.1)

    async def go():
        t0 = time.monotonic()
        first = await router.route(prompt(1, 300))
        elapsed = time.monotonic() - t0
        later = [await router.route(prompt(i, 300)) for i in range(2, 6)]  # skipped while the circuit is open
        return first, elapsed, later

    try:
        first, elapsed, later = asyncio.run(go())
        assert first.decode is not None and elapsed < 0.5 and router.index_error
        assert index.calls == 1 and all(d.decode for d in later)
    finally:
        router.close()


def test_index_recovers_after_its_pause():
    index = _Index(fail=True)
    router = Router(FakeDiscovery(node_fleet()), make_policy("cache_aware"), index, 16)
    try:
        asyncio.run(router.route(prompt(1, 300)))
        assert router.index_error and index.calls == 1
        index.fail = False
        router._skip_until = 0.0  # the pause is over
        asyncio.run(router.route(prompt(2, 300)))
        assert router.index_error is None and index.calls == 2
    finally:
        router.close()
