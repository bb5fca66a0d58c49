"""GenerateMany, many sequences over one stream, against a real decode node on loopback (colocated requests).

Each sequence must stream exactly what its own Generate call streams; a step's updates travel together; a
sequence's error ends that sequence only; a cancelled sequence and a caller that goes away leave no KV blocks
behind. The gateway's client (gateway.node_streams through NodeClient.generate) is driven the same way: deadline,
liveness watch, early exit, and the node killed under it. A kept sequence (keep_ms, kvrelay.node.kept) outlives
its caller and is attached from any chunk, until an Abort or its keep_ms without a caller.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import signal
import time

import grpc
import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.wire import sampling_to_proto
from kvrelay.gateway.node_client import EngineRequest, NodeClient
from kvrelay.gateway.node_errors import CallWatch, NodeRpcError
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import all_blocks_free, generate, rpc_error, start_nodes, stop_nodes, tiny_args, wait_for

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
# Runs far longer than the test needs to cancel it, however loaded the machine: ~4000 engine steps (a node
# with both cores busy was seen to read a cancel 63 steps after the start; a loaded CI machine once took 900).
LONGEST = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
_ids = itertools.count()


def _prompt(seed: int, n: int = 24) -> list[int]:
    return [(11 * i + 7 * seed + 1) % 500 for i in range(n)]


def _start(rid: str, prompt: list[int], params: SamplingParams, keep_ms: int = 0) -> pb.GenerateManyRequest:
    return pb.GenerateManyRequest(start=pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt,
                                                           params=sampling_to_proto(params), keep_ms=keep_ms))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    model = str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096))
    (node,) = start_nodes([("decode", tiny_args(model, "ucx", blocks=400))])
    yield node
    assert stop_nodes([node]) == [0], node.log_tail()


class _Caller:
    """A GenerateMany call fed from a queue, as a test drives it step by step."""

    def __init__(self, node) -> None:
        self._out: queue.Queue = queue.Queue()
        self.call = node.stub().GenerateMany(iter(self._out.get, None), timeout=60)

    def send(self, msg: pb.GenerateManyRequest) -> None:
        self._out.put(msg)

    def close(self) -> None:
        self._out.put(None)


def _collect(responses, rids: set[str]) -> tuple[dict[str, list[pb.SequenceUpdate]], int]:
    """Updates per sequence until every one in rids has ended; and how many messages carried them."""
    seen: dict[str, list[pb.SequenceUpdate]] = {rid: [] for rid in rids}
    messages = 0
    for response in responses:
        messages += 1
        for update in response.updates:
            seen[update.request_id].append(update)
        if all(updates and updates[-1].end for updates in seen.values()):
            break
    return seen, messages


@pytest.mark.timeout(120)
def test_sequences_stream_what_generate_streams_a_step_per_message(node):
    prompts = {f"many-{next(_ids)}": _prompt(s) for s in range(4)}
    want = {rid: generate(node, f"{rid}-alone", prompt, GREEDY)[0] for rid, prompt in prompts.items()}
    caller = _Caller(node)
    for rid, prompt in prompts.items():
        caller.send(_start(rid, prompt, GREEDY))
    seen, messages = _collect(caller.call, set(prompts))
    caller.close()
    assert list(caller.call) == []  # half-closed with nothing running: the node ends the call
    for rid, updates in seen.items():
        assert [t for u in updates for t in u.chunk.token_ids] == want[rid]
        assert [u.end for u in updates].count(True) == 1 and updates[-1].error_code == 0
        last, end = updates[-2:]  # the end comes on its own after the last chunk
        assert last.chunk.finish_reason == "length" and last.chunk.num_output_tokens == 12
        assert not end.HasField("chunk")
    # 4 x 12 tokens: the sequences run in the same steps, so their updates share messages
    assert messages < sum(len(u) for u in seen.values())
    wait_for(lambda: all_blocks_free(node), 10, "blocks freed")


@pytest.mark.timeout(120)
def test_an_error_ends_only_its_sequence(node):
    good, bad, twice = (f"many-{next(_ids)}" for _ in range(3))
    caller = _Caller(node)
    caller.send(_start(twice, _prompt(1), LONGEST))
    caller.send(_start(twice, _prompt(2), GREEDY))
    caller.send(_start(bad, [1, 2, 10**9], GREEDY))
    caller.send(_start(good, _prompt(3), GREEDY))
    # Read after its start, however loaded the machine: the first `twice` is cancelled before it could run its
    # ~4000 steps (before its task ran at all, when the node reads both in one go).
    caller.send(pb.GenerateManyRequest(cancel=twice))
    caller.close()
    seen: dict[str, list[pb.SequenceUpdate]] = {good: [], bad: [], twice: []}
    for response in caller.call:
        for update in response.updates:
            seen[update.request_id].append(update)
    (refused,) = [u for u in seen[twice] if u.end]  # the first `twice` never ended: it was cancelled
    assert refused.error_code == grpc.StatusCode.ALREADY_EXISTS.value[0] and refused.error_kind == "duplicate"
    assert not any(u.chunk.finish_reason for u in seen[twice])
    assert len([t for u in seen[twice] for t in u.chunk.token_ids]) < LONGEST.max_tokens
    (err,) = seen[bad]
    assert err.end and err.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "prompt_token_ids" in err.error_message and not err.HasField("chunk")
    assert len([t for u in seen[good] for t in u.chunk.token_ids]) == 12 and seen[good][-1].error_code == 0
    wait_for(lambda: all_blocks_free(node), 10, "blocks of the cancelled sequence freed")


@pytest.mark.timeout(120)
def test_a_caller_that_goes_away_leaves_no_blocks(node):
    caller = _Caller(node)
    rids = [f"many-{next(_ids)}" for _ in range(3)]
    for i, rid in enumerate(rids):
        caller.send(_start(rid, _prompt(10 + i), LONG))
    first = next(caller.call)
    assert first.updates
    caller.call.cancel()
    wait_for(lambda: all_blocks_free(node), 10, "blocks freed after the call was cancelled")


@pytest.mark.timeout(120)
def test_a_kept_sequence_outlives_its_caller_and_is_attached_from_any_chunk(node):
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=60, ignore_eos=True)
    want = generate(node, f"many-{next(_ids)}", _prompt(30), seeded)[0]
    rid = f"many-{next(_ids)}"
    caller = _Caller(node)
    caller.send(_start(rid, _prompt(30), seeded, keep_ms=20_000))
    first = next(caller.call)
    caller.call.cancel()  # its gateway is gone; no Abort came
    got = list(node.stub().Attach(pb.AttachRequest(request_id=rid), timeout=60))
    assert [t for c in got for t in c.token_ids] == want and got[-1].finish_reason == "length"
    assert first.updates[0].chunk.token_ids == got[0].token_ids
    tail = list(node.stub().Attach(pb.AttachRequest(request_id=rid, from_chunk=3), timeout=60))
    assert tail == got[3:]  # a late caller gets the end, from any chunk
    node.stub().Abort(pb.AbortRequest(request_id=rid), timeout=5)  # forgotten at once: it had ended
    missing = rpc_error(lambda: list(node.stub().Attach(pb.AttachRequest(request_id=rid), timeout=10)))
    assert missing.code() == grpc.StatusCode.NOT_FOUND and rid in missing.details()
    wait_for(lambda: all_blocks_free(node), 10, "blocks freed")


@pytest.mark.timeout(120)
def test_a_kept_sequence_nobody_attaches_to_is_aborted_after_keep_ms(node):
    rid, aborted = f"many-{next(_ids)}", f"many-{next(_ids)}"
    caller = _Caller(node)
    caller.send(_start(rid, _prompt(31), LONGEST, keep_ms=300))
    caller.send(_start(aborted, _prompt(32), LONGEST, keep_ms=60_000))
    next(caller.call)
    caller.call.cancel()
    node.stub().Abort(pb.AbortRequest(request_id=aborted), timeout=5)  # an Abort ends it, kept or not
    wait_for(lambda: all_blocks_free(node), 20, "both kept sequences aborted, their blocks freed")
    for gone in (rid, aborted):
        e = rpc_error(lambda: list(node.stub().Attach(pb.AttachRequest(request_id=gone), timeout=10)))  # noqa: B023
        assert e.code() == grpc.StatusCode.NOT_FOUND


def _request(rid: str, prompt: list[int], params: SamplingParams, deadline: float | None = None) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=prompt, params=params, deadline=deadline)


@pytest.mark.timeout(120)
def test_gateway_client_streams_fails_and_cancels_per_sequence(node):
    want = generate(node, f"many-{next(_ids)}", _prompt(20), GREEDY)[0]

    async def go():
        client = NodeClient(node.address)
        try:
            async def tokens(req, watch=None):
                return [t for c in [c async for c in client.generate(req, watch=watch)] for t in c.token_ids]

            async def late():
                with pytest.raises(NodeRpcError) as e:
                    await tokens(_request(f"many-{next(_ids)}", _prompt(21), LONG, time.monotonic() + 0.05))
                return e.value

            async def watched():
                watch = CallWatch("node")
                req = _request(f"many-{next(_ids)}", _prompt(22), LONG)
                with pytest.raises(NodeRpcError) as e:
                    async for _ in client.generate(req, watch=watch):
                        watch.fail("no heartbeat")
                return e.value

            async def early():
                async for _ in client.generate(_request(f"many-{next(_ids)}", _prompt(23), LONG)):
                    break  # leaving the loop cancels the sequence on the node

            got, deadline, failed, _ = await asyncio.gather(
                tokens(_request(f"many-{next(_ids)}", _prompt(20), GREEDY)), late(), watched(), early())
            return got, deadline, failed, client.multiplexed
        finally:
            await client.close()

    got, deadline, failed, many = asyncio.run(go())
    assert many and got == want
    assert deadline.code == grpc.StatusCode.DEADLINE_EXCEEDED and not deadline.answered
    assert failed.code == grpc.StatusCode.UNAVAILABLE and failed.details == "no heartbeat"
    wait_for(lambda: all_blocks_free(node), 10, "blocks freed after deadline, watch and early exit")


@pytest.mark.timeout(180)
def test_gateway_client_fails_every_sequence_when_the_node_dies(tmp_path):
    model = str(make_tiny_checkpoint("llama", tmp_path))
    (victim,) = start_nodes([("decode", tiny_args(model, "ucx"))])

    async def go():
        client = NodeClient(victim.address)
        started = asyncio.Event()

        async def one(seed):
            async for _ in client.generate(_request(f"many-{next(_ids)}", _prompt(seed), LONG)):
                started.set()

        tasks = [asyncio.create_task(one(s)) for s in range(3)]
        await started.wait()
        victim.proc.send_signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        return results

    try:
        results = asyncio.run(go())
    finally:
        stop_nodes([victim])
    assert all(isinstance(r, NodeRpcError) and r.code == grpc.StatusCode.UNAVAILABLE and not r.answered
               for r in results), results
