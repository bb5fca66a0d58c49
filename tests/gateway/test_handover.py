"""Hand-over of a keyed request between gateways (gateway.handover, Dispatcher.stream(resume=...)): the record a
gateway writes, the sequence state another gateway rebuilds from it, and what a resumed stream may do when its
node is gone. Against real nodes and gateway processes: tests/e2e/test_chaos.py."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.common.records import TokenLogprobs
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.wire import TokenChunk
from kvrelay.gateway.discovery import Discovery, DiscoveryConfig
from kvrelay.gateway.dispatch import DispatchConfig, Dispatcher
from kvrelay.gateway.errors import NodeFailure, RunGone
from kvrelay.gateway.handover import RunRecord, record_from_json, record_to_json
from kvrelay.gateway.liveness import Liveness
from kvrelay.gateway.node_client import EngineRequest, NodeClients
from kvrelay.gateway.policies import make_policy
from kvrelay.gateway.router import Router
from kvrelay.gateway.sequence_state import Placement, SequenceAttempts

FIRST = TokenChunk((11,), (TokenLogprobs(11, -0.5, 1, ((11, -0.5), (12, -1.25))),), num_prompt_tokens=3,
                   num_output_tokens=1, num_cached_tokens=2, prompt_logprobs=(None, TokenLogprobs(4, -2.0, 3)))
MOVED = TokenChunk((12, 13), num_output_tokens=3)
PLACE = Placement("127.0.0.1:1", "decode-9", "r-0.m1", (FIRST, MOVED), False, 1, True, "prefill-0")


def test_a_record_round_trips_through_its_json():
    record = RunRecord("cmpl-7", PLACE)
    assert record_from_json(record_to_json(record)) == record
    with pytest.raises((ValueError, KeyError, TypeError)):
        record_from_json(b'{"id": "x"}')


def test_a_resumed_sequence_goes_on_from_its_record():
    """The client had the prefix; the next move counts on from the record's, with the prefix as output."""
    seq = SequenceAttempts(EngineRequest("r-0", [1, 2, 3], SamplingParams(max_tokens=20)), {}, keep_chunks=True)
    seq.resume(PLACE)
    assert seq.current.request_id == "r-0.m1" and seq.generated == [11, 12, 13]
    seq.observe(TokenChunk((14,), num_output_tokens=4, num_cached_tokens=9))
    assert seq.chunks[-1].num_cached_tokens == 0  # a moved prompt's cache hit counted earlier output
    seq.move(NodeFailure("gone", node_id="decode-9"))
    assert seq.current.request_id == "r-0.m2" and list(seq.current.prompt_token_ids) == [1, 2, 3, 11, 12, 13, 14]
    assert seq.current.params.num_resumed_tokens == 4


@pytest.mark.parametrize(("params", "exact", "error"), [
    (SamplingParams(temperature=0.8, max_tokens=20), True, RunGone),  # the client's output cannot be redrawn
    (SamplingParams(temperature=0.8, seed=3, max_tokens=20), True, NodeFailure),  # seeded: it would move
    (SamplingParams(temperature=0.0, max_tokens=20), True, NodeFailure),  # greedy: likewise
    (SamplingParams(temperature=0.8, max_tokens=20), False, NodeFailure),  # nothing streamed yet: it may move
])
def test_a_resumed_stream_whose_node_is_gone_moves_only_if_it_repeats_itself(params, exact, error):
    """Its node is not among this gateway's (nor is any other): the recorded chunks come out, then a move is
    tried (and finds no node) unless the client already has output an unseeded draw could not give again."""
    async def go():
        clients = NodeClients()
        discovery = Discovery(DiscoveryConfig("m", 16), clients)
        dispatcher = Dispatcher(Router(discovery, make_policy("cache_aware")), clients, discovery,
                                Liveness(discovery), config=DispatchConfig(capacity_wait_s=0.0))
        got = []
        with pytest.raises(error) as raised:
            async for chunk in dispatcher.stream(None, EngineRequest("r-0", [1, 2, 3], params), resume=PLACE,
                                                 exact=exact):
                got.append(chunk)
        await clients.close()
        return got, raised.value

    got, raised = asyncio.run(go())
    assert got == [FIRST, MOVED]
    assert "decode-9" in raised.message
