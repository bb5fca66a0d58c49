"""A sequence's next attempt after a node failure (gateway.sequence_state): the prompt plus what was streamed,
under a new id, with everything else the request carried (salt, adapter, images, deadline)."""

from __future__ import annotations

from kvrelay.common.records import ImageInput
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.wire import TokenChunk
from kvrelay.gateway.errors import NodeFailure
from kvrelay.gateway.node_client import EngineRequest
from kvrelay.gateway.sequence_state import SequenceAttempts


def test_a_moved_sequence_keeps_what_its_request_carried():
    image = ImageInput(offset=1, length=2, data=b"png", content_hash=b"h" * 16)
    req = EngineRequest("r-0", [5, 7, 7, 6], SamplingParams(max_tokens=8), cache_salt="s", deadline=12.5,
                        lora_name="ad", images=(image,))
    seq = SequenceAttempts(req, {})
    seq.observe(TokenChunk(token_ids=(9, 10)))
    seq.move(NodeFailure("gone", node_id="n1"))
    moved = seq.current
    assert moved.request_id == "r-0.m1" and list(moved.prompt_token_ids) == [5, 7, 7, 6, 9, 10]
    assert moved.params.num_resumed_tokens == 2 and moved.proto_params().num_resumed_tokens == 2
    assert (moved.cache_salt, moved.deadline, moved.lora_name, moved.images) == ("s", 12.5, "ad", (image,))
    assert seq.failed == {"n1"}
