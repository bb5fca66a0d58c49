"""Failures between nodes never strand KV memory, and every error says what went wrong.

One prefill node P, one decode node D (short leases) and one decode node X whose KV layout differs (block
size and dtype), all over ucx on loopback; P and D register in a real redis-server. The tests that kill a
prefill node (SIGKILL: its lease lapses and its index entries are purged) start one of their own, so each
test passes alone; the last test drains D (SIGTERM: it deregisters).
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.system import free_port
from kvrelay.common.wire import sampling_to_proto
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import (
    all_blocks_free,
    disaggregated,
    generate,
    in_thread,
    prefill_request,
    reserve,
    rpc_error,
    start_nodes,
    stop_nodes,
    tiny_args,
    wait_for,
)

LEASE_S = 1.5
REGISTRY_TTL_S = 1.5
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = [(5 * i + 1) % 500 for i in range(40)]


@pytest.fixture(scope="module")
def redis_url():
    from kvrelay.index.redis_server import start_redis

    server = start_redis()
    yield server.url
    server.stop()


def _registered(redis_url: str) -> list[str]:
    return ["--redis-url", redis_url, "--heartbeat-seconds", "0.3", "--registry-ttl", str(REGISTRY_TTL_S)]


def _prefill_args(model: str, redis_url: str) -> list[str]:
    return tiny_args(model, "ucx", "--kv-connect-timeout", "2", "--transfer-timeout", "5", *_registered(redis_url))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def nodes(tiny_model, redis_url):
    model, registered = tiny_model, _registered(redis_url)
    started = start_nodes([
        ("prefill", _prefill_args(model, redis_url)),
        ("decode", tiny_args(model, "ucx", "--kv-lease-seconds", str(LEASE_S), *registered)),
        ("decode", tiny_args(model, "ucx", "--block-size", "32", "--dtype", "bfloat16",
                             "--kv-cache-memory", str(32 * 12288), "--kv-lease-seconds", str(LEASE_S))),
    ])
    yield dict(zip("PDX", started))
    stop_nodes(started, grace=15)


@pytest.fixture
def doomed_prefill(tiny_model, redis_url):
    """A registered prefill node of the test's own, for the tests that kill one."""
    (node,) = start_nodes([("prefill", _prefill_args(tiny_model, redis_url))])
    yield node
    stop_nodes([node], grace=5)


@pytest.fixture(scope="module")
def index(nodes, redis_url):
    from kvrelay.index.redis_index import RedisIndex
    from kvrelay.index.registry import Registry

    model_id = nodes["D"].stub().GetNodeInfo(pb.NodeInfoRequest(), timeout=5).model_id
    registry, idx = Registry(redis_url), RedisIndex(redis_url, model_id)
    live = lambda: {reg.node_id: load for reg, load in registry.live_nodes(model_id)}  # noqa: E731
    yield live, idx
    registry.close()
    idx.close()


@pytest.mark.timeout(60)
def test_bad_input_is_invalid_argument(nodes):
    P, D = nodes["P"], nodes["D"]
    ok = sampling_to_proto(GREEDY)
    cases = [
        (D.stub().Generate, pb.GenerateRequest(request_id="e1", prompt_token_ids=[], params=ok), "prompt"),
        (D.stub().Generate, pb.GenerateRequest(request_id="e2", prompt_token_ids=[1, 9999], params=ok),
         "prompt_token_ids"),
        (D.stub().Generate, pb.GenerateRequest(request_id="e3", prompt_token_ids=[1, -4], params=ok),
         "prompt_token_ids"),
        (D.stub().Generate, pb.GenerateRequest(request_id="e4", prompt_token_ids=[1, 2],
                                               params=pb.SamplingParams(temperature=-1)), "temperature"),
        (D.stub().Generate, pb.GenerateRequest(request_id="", prompt_token_ids=[1, 2], params=ok), "request_id"),
        (D.stub().Reserve, pb.ReserveRequest(request_id="e5", prompt_token_ids=[1, 2],
                                             params=pb.SamplingParams(n=2)), "n"),
        (D.stub().Reserve, pb.ReserveRequest(request_id="e6", prompt_token_ids=[1, 2],
                                             params=pb.SamplingParams(top_p=2.0)), "top_p"),
        (P.stub().Prefill, pb.PrefillRequest(request_id="e7", prompt_token_ids=PROMPT, params=ok,
                                             decode_kv_address="ucx://127.0.0.1:1", dst_block_ids=[1]),
         "dst_block_ids"),
        (P.stub().Prefill, pb.PrefillRequest(request_id="e8", prompt_token_ids=PROMPT, params=ok,
                                             decode_kv_address="127.0.0.1:1", dst_block_ids=[1, 2, 3]),
         "decode_kv_address"),
    ]
    for method, request, field in cases:
        if isinstance(request, pb.GenerateRequest):
            error = rpc_error(lambda m=method, r=request: list(m(r, timeout=10)))
        else:
            error = rpc_error(method, request, timeout=10)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, error)
        assert error.details().startswith(f"{field}:"), error.details()
    # A hand-off's first token is checked too, and the reservation it named is freed.
    reserve(D, "e9", PROMPT, GREEDY)
    handoff = pb.GenerateRequest(request_id="e9", prompt_token_ids=PROMPT, params=ok,
                                 handoff=pb.Handoff(first_token_id=100000))
    error = rpc_error(lambda: list(D.stub().Generate(handoff, timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "first_token_id" in error.details()
    # Each role refuses the other's RPC by name.
    error = rpc_error(D.stub().Prefill, pb.PrefillRequest(request_id="e10"), timeout=10)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "prefill nodes" in error.details()
    for node in (P, D):
        assert node.stub().Health(pb.HealthRequest(), timeout=5).healthy
        wait_for(lambda n=node: all_blocks_free(n), 5, "blocks freed after refused requests")


@pytest.mark.timeout(60)
def test_registered_with_load_and_blocks(nodes, index):
    live, idx = index
    P, D = nodes["P"], nodes["D"]
    ids = {P.info["node_id"], D.info["node_id"]}
    wait_for(lambda: ids <= set(live()), 5, "both nodes in the registry")
    # The first heartbeat may predate the previous test's last frees: wait for one taken after them.
    load = wait_for(lambda: (got := live().get(D.info["node_id"])) and got.free_kv_blocks == 64 and got, 10,
                    "a heartbeat with every block free")
    assert load.total_kv_blocks == 64
    assert nodes["X"].info["node_id"] not in live()  # no --redis-url: unregistered
    prompt = [(11 * i + 5) % 500 for i in range(50)]
    disaggregated(P, D, "indexed", prompt, GREEDY)
    hashes = prompt_block_hashes(prompt, idx.model_id, 16)
    held = wait_for(lambda: (h := idx.lookup(hashes)) and len(h) == 2 and h, 5, "the blocks in the index")
    assert held == {P.info["node_id"]: 3, D.info["node_id"]: 3}


@pytest.mark.timeout(60)
def test_decode_unreachable(nodes):
    P, D = nodes["P"], nodes["D"]
    res = pb.ReserveResponse(kv_address=f"ucx://127.0.0.1:{free_port()}", dst_block_ids=[0, 1, 2])
    error = rpc_error(P.stub().Prefill, prefill_request("lost", PROMPT, GREEDY, res, with_layout=False), timeout=30)
    assert error.code() == grpc.StatusCode.UNAVAILABLE, error
    assert "cannot connect" in error.details() and res.kv_address in error.details(), error.details()
    wait_for(lambda: all_blocks_free(P), 5, "the prefill node to free the held blocks")
    # It keeps serving.
    result = disaggregated(P, D, "after-lost", PROMPT, GREEDY)
    assert len(result.tokens) == 4


@pytest.mark.timeout(60)
def test_only_the_reservations_transfer_id_fills_its_blocks(nodes):
    """The decode node expects the KV under the transfer id its Reserve handed out (the request id and 128 random
    bits): a process that did not reserve, guessing the request id or anything near it, writes nothing."""
    P, D = nodes["P"], nodes["D"]
    res = reserve(D, "guess", PROMPT, GREEDY)
    assert res.transfer_id.startswith("guess.") and len(res.transfer_id) == len("guess.") + 32
    for tid in ("guess", res.transfer_id[:-1] + "x", "guess." + "0" * 32):
        req = prefill_request("guess", PROMPT, GREEDY, res)
        req.transfer_id = tid
        error = rpc_error(P.stub().Prefill, req, timeout=30)
        assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION), error
        wait_for(lambda: all_blocks_free(P), 5, "the prefill node to free the held blocks")
    assert D.stub().Abort(pb.AbortRequest(request_id="guess"), timeout=5).aborted
    wait_for(lambda: all_blocks_free(D), 5, "the decode node to free the reservation")
    assert len(disaggregated(P, D, "after-guess", PROMPT, GREEDY).tokens) == 4  # the right id still works


@pytest.mark.timeout(60)
def test_layout_mismatch_is_refused(nodes):
    P, X = nodes["P"], nodes["X"]
    short = PROMPT[:10]  # one block on either side, so only the layouts differ
    # Told the decode layout (as the gateway does), the prefill node refuses before computing anything.
    res = reserve(X, "mm1", short, GREEDY)
    error = rpc_error(P.stub().Prefill, prefill_request("mm1", short, GREEDY, res), timeout=30)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
    for text in ("block_size", "16", "32", "dtype", "float32", "bfloat16"):
        assert text in error.details(), error.details()
    # Not told, the connectors' handshake refuses it, and both sides learn why.
    res = reserve(X, "mm2", short, GREEDY)
    error = rpc_error(P.stub().Prefill, prefill_request("mm2", short, GREEDY, res, with_layout=False), timeout=30)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
    for text in ("refused", "block_size", "16", "32", "float32", "bfloat16"):
        assert text in error.details(), error.details()
    handoff = pb.GenerateRequest(request_id="mm2", prompt_token_ids=short, params=sampling_to_proto(GREEDY),
                                 handoff=pb.Handoff(first_token_id=3))
    error = rpc_error(lambda: list(X.stub().Generate(handoff, timeout=10)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "bfloat16" in error.details(), error
    assert X.stub().Abort(pb.AbortRequest(request_id="mm1"), timeout=5).aborted
    for node in (P, X):
        wait_for(lambda n=node: all_blocks_free(n), 5, f"{node.role} node to free every block")


@pytest.mark.timeout(60)
def test_abort_and_cancel_mid_stream_free_blocks(nodes):
    D = nodes["D"]
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    # The tiny model can finish 200 tokens before a loaded machine delivers the Abort; then Abort must say
    # so and the stream must end by length. Some try out of five lands mid-stream.
    for attempt in range(5):
        rid = f"ab1-{attempt}"
        req = pb.GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, params=sampling_to_proto(long))
        stream = D.stub().Generate(req, timeout=30)
        first = next(stream)
        assert first.token_ids and not first.finish_reason
        aborted = D.stub().Abort(pb.AbortRequest(request_id=rid), timeout=5).aborted
        rest = list(stream)
        wait_for(lambda: all_blocks_free(D), 5, "blocks freed after Abort")
        if aborted:
            assert rest[-1].finish_reason == "abort" and len(rest) < 199
            break
        assert rest[-1].finish_reason == "length"
    else:
        pytest.fail("no Abort of five landed while its request was generating")
    # A client cancelling its stream aborts the request.
    req = pb.GenerateRequest(request_id="ab2", prompt_token_ids=PROMPT, params=sampling_to_proto(long))
    stream = D.stub().Generate(req, timeout=30)
    next(stream)
    stream.cancel()
    wait_for(lambda: all_blocks_free(D), 5, "blocks freed after the client cancelled")
    assert not D.stub().Abort(pb.AbortRequest(request_id="ab2"), timeout=5).aborted  # already gone


def _generate_before_kv(rid: str, prompt: list[int]) -> pb.GenerateRequest:
    """A Generate for a reservation whose KV has not come yet (its first token a stand-in): it waits."""
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, params=sampling_to_proto(GREEDY),
                              handoff=pb.Handoff(first_token_id=1))


def _late_prefill_is_refused(P, D, rid: str, prompt: list[int], res: pb.ReserveResponse) -> None:
    """A prefill after the reservation was given up: its layers must not land in blocks that may already serve
    another request; both nodes end with every block free."""
    late = rpc_error(P.stub().Prefill, prefill_request(rid, prompt, GREEDY, res), timeout=30)
    assert late.code() == grpc.StatusCode.UNAVAILABLE and "not expected" in late.details(), late
    wait_for(lambda: all_blocks_free(P), 10, "the prefill node to release the refused request's blocks")
    assert all_blocks_free(D)


@pytest.mark.timeout(60)
def test_generate_client_gone_before_kv_closes_the_transfer(nodes):
    """A Generate whose client leaves while it waits for the KV frees the reservation, and a prefill that
    comes later is refused."""
    P, D = nodes["P"], nodes["D"]
    prompt = [(11 * i + 5) % 500 for i in range(120)]
    res = reserve(D, "early-leaver", prompt, GREEDY, lease_ms=20_000)
    err = rpc_error(lambda: list(D.stub().Generate(_generate_before_kv("early-leaver", prompt), timeout=0.5)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
    wait_for(lambda: all_blocks_free(D), 5, "the decode node to free the abandoned reservation")
    _late_prefill_is_refused(P, D, "early-leaver", prompt, res)


@pytest.mark.timeout(60)
def test_abort_while_generate_waits_for_kv_closes_the_transfer(nodes):
    """An Abort (the gateway's) while a Generate waits for the KV frees the reservation and refuses the layers
    of a prefill that comes later, as when the Generate's own client leaves."""
    P, D = nodes["P"], nodes["D"]
    prompt = [(13 * i + 7) % 500 for i in range(120)]
    res = reserve(D, "aborted-waiter", prompt, GREEDY, lease_ms=20_000)
    req = _generate_before_kv("aborted-waiter", prompt)
    thread, box = in_thread(lambda: list(D.stub().Generate(req, timeout=30)))
    time.sleep(0.5)  # the Generate is waiting for the KV
    D.stub().Abort(pb.AbortRequest(request_id="aborted-waiter"), timeout=5)
    thread.join(10)
    assert not thread.is_alive() and "result" not in box, box
    wait_for(lambda: all_blocks_free(D), 5, "the decode node to free the aborted reservation")
    _late_prefill_is_refused(P, D, "aborted-waiter", prompt, res)


@pytest.mark.timeout(60)
def test_reservation_nobody_fills_expires(nodes):
    D = nodes["D"]
    before = D.load().free_kv_blocks
    reserve(D, "nobody", PROMPT, GREEDY, lease_ms=300)
    assert D.load().free_kv_blocks == before - 3
    wait_for(lambda: all_blocks_free(D), 5, "the lease to expire")
    tokens, _ = generate(D, "after-lease", PROMPT, GREEDY)
    assert len(tokens) == 4


@pytest.mark.timeout(60)
def test_prefill_client_gone_frees_blocks(nodes):
    P, D = nodes["P"], nodes["D"]
    prompt = [(3 * i + 2) % 500 for i in range(200)]
    res = reserve(D, "gone", prompt, GREEDY)
    # Usually the deadline passes mid-prefill; the tiny model may also win the race. Either way nothing leaks.
    try:
        P.stub().Prefill(prefill_request("gone", prompt, GREEDY, res), timeout=0.005)
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
    wait_for(lambda: all_blocks_free(P), 10, "the prefill node to release what the abandoned request held")
    D.stub().Abort(pb.AbortRequest(request_id="gone"), timeout=5)  # what a gateway does after a failed Prefill
    wait_for(lambda: all_blocks_free(D), 5, "the decode node to free the reservation")
    assert len(disaggregated(P, D, "gone", prompt, GREEDY).tokens) == 4  # the id is free for reuse


@pytest.mark.timeout(60)
def test_prefill_client_gone_during_transfer_frees_blocks(nodes):
    """The client leaves after the prompt is computed, while the prefill node waits for the decode node's
    acknowledgements (the decode node is frozen): the blocks are released once the transfer is over, well
    before the prefill node's 30 s hold lease would free them."""
    P, D = nodes["P"], nodes["D"]
    prompt = [(7 * i + 3) % 500 for i in range(200)]
    res = reserve(D, "gone-mid-transfer", prompt, GREEDY, lease_ms=20_000)
    os.kill(D.proc.pid, signal.SIGSTOP)  # its acks cannot come; resumed before its registry entry lapses
    try:
        err = rpc_error(P.stub().Prefill, prefill_request("gone-mid-transfer", prompt, GREEDY, res), timeout=0.8)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
        load = P.load()
        assert load.num_running == 0 and load.free_kv_blocks < load.total_kv_blocks  # computed, blocks held
    finally:
        os.kill(D.proc.pid, signal.SIGCONT)
    wait_for(lambda: all_blocks_free(P), 10, "the prefill node to release the blocks once the transfer ended")
    D.stub().Abort(pb.AbortRequest(request_id="gone-mid-transfer"), timeout=5)  # the gateway's move
    wait_for(lambda: all_blocks_free(D), 5, "the decode node to free the reservation")


@pytest.mark.timeout(90)
def test_prefill_killed_after_reservation(nodes, doomed_prefill):
    P, D = doomed_prefill, nodes["D"]
    prompt = [(3 * i + 7) % 500 for i in range(200)]
    res = reserve(D, "victim", prompt, GREEDY)
    assert D.load().free_kv_blocks < D.load().total_kv_blocks
    os.kill(P.proc.pid, signal.SIGSTOP)  # frozen, so the prefill cannot win the race against the kill
    thread, box = in_thread(P.stub().Prefill, prefill_request("victim", prompt, GREEDY, res), 30)
    time.sleep(0.3)  # the call is on the wire, unanswered
    P.kill()
    thread.join(10)
    assert not thread.is_alive() and "result" not in box, box
    assert isinstance(box["error"], grpc.RpcError) and box["error"].code() == grpc.StatusCode.UNAVAILABLE, box
    t0 = time.monotonic()
    wait_for(lambda: all_blocks_free(D), LEASE_S + 5, "the decode node to free the orphaned reservation")
    assert time.monotonic() - t0 <= LEASE_S + 5
    handoff = pb.GenerateRequest(request_id="victim", prompt_token_ids=prompt, params=sampling_to_proto(GREEDY),
                                 handoff=pb.Handoff(first_token_id=3))
    error = rpc_error(lambda: list(D.stub().Generate(handoff, timeout=10)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "no reservation" in error.details()
    tokens, _ = generate(D, "after-kill", PROMPT, GREEDY)
    assert len(tokens) == 4


@pytest.mark.timeout(90)
def test_dead_node_leaves_registry_and_index(index, doomed_prefill):
    live, idx = index
    victim = doomed_prefill.info["node_id"]
    wait_for(lambda: victim in live(), REGISTRY_TTL_S + 5, "the node to register")
    generate(doomed_prefill, "fill", PROMPT, GREEDY)  # its prompt's blocks land in its cache and the index
    wait_for(lambda: idx.node_hashes(victim), 10, "the node's blocks in the index")
    doomed_prefill.kill()
    wait_for(lambda: victim not in live(), REGISTRY_TTL_S + 5, "the dead node's lease to lapse")
    wait_for(lambda: not idx.node_hashes(victim), 10, "the janitor to purge the dead node's blocks")


@pytest.mark.timeout(60)
def test_sigterm_drains_then_exits_zero(nodes, index):
    """SIGTERM mid-request: the node refuses new work but finishes what it has accepted. The request in flight
    is a disaggregated one between its reservation and its Generate, so it cannot finish before the signal
    (a plain stream on the tiny model can) and its Prefill and Generate both arrive while the node drains."""
    P, D = nodes["P"], nodes["D"]
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    prompt = [(9 * i + 4) % 500 for i in range(40)]  # + 200 tokens fits the tiny model (256)
    res = reserve(D, "drain", prompt, long, lease_ms=20_000)
    D.terminate()
    wait_for(lambda: D.stub().Health(pb.HealthRequest(), timeout=5).draining, 5, "draining")
    assert D.stub().Health(pb.HealthRequest(), timeout=5).healthy
    error = rpc_error(reserve, D, "too-late", PROMPT, GREEDY)
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "draining" in error.details()
    pre = P.stub().Prefill(prefill_request("drain", prompt, long, res), timeout=30)
    tokens, chunks = generate(D, "drain", prompt, long, handoff=pre)
    assert len(tokens) == 200 and chunks[-1].finish_reason == "length"
    assert D.proc.wait(timeout=30) == 0
    live, idx = index
    assert D.info["node_id"] not in live() and not idx.node_hashes(D.info["node_id"])  # deregistered
