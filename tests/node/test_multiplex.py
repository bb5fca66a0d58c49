"""SequenceMux (kvrelay.node.multiplex), the GenerateMany stream, on its own: what a sequence puts while the
previous message is still going out is sent before the stream ends; a sequence cancelled before its task ran
does not hold the stream open."""

from __future__ import annotations

import asyncio

import grpc

from kvrelay.common import wire
from kvrelay.node.multiplex import SequenceMux
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb


def _status_of(error: Exception) -> tuple[grpc.StatusCode, str, wire.NodeErrorKind]:
    raise AssertionError(f"no sequence fails here: {error!r}")


def test_the_last_sequence_s_final_chunk_put_during_a_send_is_sent():
    async def scenario() -> list[pb.SequenceUpdate]:
        gate = asyncio.Event()

        async def chunks(request: pb.GenerateRequest):
            yield pb.TokenChunk(token_ids=[1])
            await gate.wait()
            yield pb.TokenChunk(token_ids=[2], finish_reason="length")

        async def requests():
            yield pb.GenerateManyRequest(start=pb.GenerateRequest(request_id="a"))  # then the caller half-closes

        stream = SequenceMux(chunks, _status_of).run(requests())
        first = await anext(stream)  # the writer waits at its yield, as while gRPC sends a message
        gate.set()
        await asyncio.sleep(0.05)  # meanwhile the sequence puts its last chunk and its end, and is over
        rest = [message async for message in stream]
        return [update for message in [first, *rest] for update in message.updates]

    updates = asyncio.run(scenario())
    assert [t for u in updates for t in u.chunk.token_ids] == [1, 2]
    assert [u.end for u in updates] == [False, False, True] and updates[-1].error_code == 0


def test_a_sequence_cancelled_before_it_ran_ends_the_stream_with_nothing_from_it():
    async def scenario() -> list[pb.GenerateManyResponse]:
        async def chunks(request: pb.GenerateRequest):
            yield pb.TokenChunk(token_ids=[1], finish_reason="length")

        async def requests():  # both read before the loop runs the sequence's task once (the caller's buffer)
            yield pb.GenerateManyRequest(start=pb.GenerateRequest(request_id="a"))
            yield pb.GenerateManyRequest(cancel="a")
            yield pb.GenerateManyRequest(start=pb.GenerateRequest(request_id="b"))

        return [message async for message in SequenceMux(chunks, _status_of).run(requests())]

    messages = asyncio.run(asyncio.wait_for(scenario(), 5))
    updates = [update for message in messages for update in message.updates]
    assert [(u.request_id, u.end) for u in updates] == [("b", False), ("b", True)]
