"""A full decode node queues reservations instead of refusing them, bounded by --max-waiting-requests; every
refusal says why in a status code and in trailing metadata (the gateway's evidence that the node is alive)."""

from __future__ import annotations

import time

import grpc
import pytest

from kvrelay.common import wire
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.wire import sampling_to_proto
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import (
    all_blocks_free,
    generate,
    in_thread,
    rpc_error,
    start_nodes,
    stop_nodes,
    tiny_args,
    wait_for,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
BIG = 250  # 16 blocks: four of them fill the node's 64


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    model = str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-admission")))
    (node,) = start_nodes([("decode", tiny_args(model, "ucx", "--max-waiting-requests", "2"))])
    yield node
    stop_nodes([node])


def _reserve(node, rid: str, n: int = BIG, queue_ms: int = 0, timeout: float = 30):
    prompt = [(5 * i + len(rid)) % 500 for i in range(n)]
    return node.stub().Reserve(pb.ReserveRequest(request_id=rid, prompt_token_ids=prompt,
                                                 params=sampling_to_proto(GREEDY), queue_timeout_ms=queue_ms),
                               timeout=timeout)


def _kind(error: grpc.RpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get(wire.NODE_ERROR_KEY)


def _abort(node, *rids: str) -> None:
    for rid in rids:
        node.stub().Abort(pb.AbortRequest(request_id=rid), timeout=5)


def _fill(node) -> list[str]:
    ids = [f"fill{i}" for i in range(4)]
    for rid in ids:
        _reserve(node, rid)
    # The load report follows the engine loop, which may not have counted the last reservation yet.
    wait_for(lambda: node.load().free_kv_blocks == 0, 10, "the four reservations to hold every block")
    return ids


@pytest.mark.timeout(90)
def test_a_reservation_waits_for_blocks(decode):
    filled = _fill(decode)
    error = rpc_error(_reserve, decode, "refused")  # not willing to wait: refused at once, as before
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and _kind(error) == "full"
    thread, box = in_thread(_reserve, decode, "waiter", 40, 30_000)
    wait_for(lambda: decode.load().num_waiting == 1, 10, "the reservation to queue")
    time.sleep(0.3)
    assert thread.is_alive()
    _abort(decode, filled[0])
    thread.join(10)
    res = box["result"]
    assert res.request_id == "waiter" and len(res.dst_block_ids) == 3 and decode.load().num_waiting == 0
    _abort(decode, "waiter", *filled[1:])
    wait_for(lambda: all_blocks_free(decode), 5, "every block free")


@pytest.mark.timeout(90)
def test_waiting_is_bounded_in_time_and_count(decode):
    filled = _fill(decode)
    t0 = time.monotonic()
    error = rpc_error(_reserve, decode, "late", 40, 400)
    assert time.monotonic() - t0 >= 0.35
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "within 0.4 s" in error.details(), error
    threads = [in_thread(_reserve, decode, f"w{i}", 40, 30_000) for i in range(2)]
    wait_for(lambda: decode.load().num_waiting == 2, 10, "two reservations queued")
    error = rpc_error(_reserve, decode, "third", 40, 30_000)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_waiting_requests 2" in error.details()
    assert _kind(error) == "full"
    error = rpc_error(generate, decode, "local", [1, 2, 3], GREEDY)  # the bound covers local requests too
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    _abort(decode, *filled)
    for thread, box in threads:
        thread.join(10)
        assert "result" in box, box
    _abort(decode, "w0", "w1")
    wait_for(lambda: all_blocks_free(decode), 5, "every block free")


@pytest.mark.timeout(90)
def test_a_caller_leaving_the_queue_leaks_nothing(decode):
    filled = _fill(decode)
    error = rpc_error(_reserve, decode, "gone", 40, 30_000, timeout=0.5)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: decode.load().num_waiting == 0, 5, "the abandoned reservation to leave the queue")
    _abort(decode, *filled)
    wait_for(lambda: all_blocks_free(decode), 5, "every block free")
    assert len(_reserve(decode, "gone", 40).dst_block_ids) == 3  # the id is free again
    _abort(decode, "gone")


@pytest.mark.timeout(60)
def test_duplicate_ids_are_already_exists(decode):
    _reserve(decode, "dup", 40)
    error = rpc_error(_reserve, decode, "dup", 40)
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and _kind(error) == "duplicate", error
    _abort(decode, "dup")
    wait_for(lambda: all_blocks_free(decode), 5, "every block free")
