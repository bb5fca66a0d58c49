"""grpc.aio clients of the engine service. Protobuf stays in this module, gateway.node_streams and kvrelay.common.wire
(which converts): callers see the wire records.

One channel per node address, reused by every request, reconnecting within a second or two once a restarted
node listens again. Every unary call has a deadline. Token streams go over one GenerateMany call per node
(gateway.node_streams: a message per engine step rather than per token per sequence), or a Generate call per
sequence to a node that lacks GenerateMany; either way a stream has the request's own deadline, if it has one,
and is cancelled with its request. A call made with a CallWatch can be failed from outside (the liveness
monitor, when its node stops answering): it then raises NodeRpcError like any failed call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc

from kvrelay.common import wire
from kvrelay.common.records import ImageInput, NodeLoad
from kvrelay.common.sampling_params import BeamSearchParams, SamplingParams
from kvrelay.common.tls import TLSFiles
from kvrelay.common.wire import Health, NodeInfo, PrefillResult, ReserveResult, TokenChunk
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.node_errors import CallWatch, NodeRpcError
from kvrelay.gateway.node_streams import SequenceStream
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # gRPC's default reconnect backoff grows to two minutes: a node restarted after a crash would sit unused.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass(frozen=True)
class Timeouts:
    info_s: float = 3.0
    reserve_s: float = 10.0
    prefill_s: float = GatewayConfig.prefill_timeout
    abort_s: float = 2.0
    lora_s: float = 60.0  # reading an adapter (a URL's files included)
    lora_unload_s: float = 660.0  # the node waits up to 600 s for the adapter's running requests


@dataclass
class EngineRequest:
    """What every engine RPC of one sequence carries. `deadline` (monotonic): the request's own, if any;
    no call outlives it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    cache_salt: str = ""
    beam_search: BeamSearchParams | None = None  # set: a beam search (Generate only, no hand-off)
    deadline: float | None = None
    lora_name: str = ""  # the LoRA adapter it runs with ("": the base model)
    images: tuple[ImageInput, ...] = ()  # the prompt's images (a vision-language model)
    keep_s: float = 0.0  # > 0: the node keeps the sequence this long after its stream breaks (kvrelay.node.kept)
    span: object | None = field(default=None, repr=False)  # the sequence's span (kvrelay.common.tracing)
    traceparent: str = ""  # this call's parent span, as sent to the node
    _proto_params: pb.SamplingParams | None = field(default=None, repr=False)

    def proto_params(self) -> pb.SamplingParams:
        if self._proto_params is None:
            self._proto_params = wire.sampling_to_proto(self.params)
        return self._proto_params

    def remaining(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def expired(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def timeout(self, limit: float) -> float:
        """A call's timeout: `limit`, or less where the request's deadline comes first."""
        left = self.remaining()
        return limit if left is None else max(0.001, min(limit, left))


# ------------------------------------------------------------------------------------------- client


class NodeClient:
    """The engine service of one node, over one channel."""

    def __init__(self, address: str, timeouts: Timeouts | None = None, tls: TLSFiles | None = None) -> None:
        self.address = address
        self.timeouts = timeouts or Timeouts()
        self._channel = (grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS) if tls is None else
                         grpc.aio.secure_channel(address, tls.channel_credentials(),
                                                 options=[*_CHANNEL_OPTIONS, *tls.channel_options()]))
        self._stub = pb_grpc.EngineStub(self._channel)
        self._streams: SequenceStream | None = None
        self._many = True  # False once the node answered that it has no GenerateMany

    @property
    def multiplexed(self) -> bool | None:
        """True: this node's token streams share one GenerateMany call; False: the node lacks it, so each
        sequence has its own Generate call; None: no token stream yet."""
        if not self._many:
            return False
        return None if self._streams is None else True

    async def close(self) -> None:
        if self._streams is not None:
            self._streams.close()
        await self._channel.close(grace=None)

    async def _unary(self, method: str, request, timeout: float, watch: CallWatch | None = None):
        call = getattr(self._stub, method)(request, timeout=timeout)
        if watch is not None:
            watch.call = call
        try:
            return await call
        except grpc.aio.AioRpcError as e:
            raise NodeRpcError.from_grpc(self.address, method, e) from None
        except asyncio.CancelledError:
            if watch is not None:
                watch.raise_if_failed(self.address, method)
            raise
        finally:
            if watch is not None:
                watch.call = None

    async def info(self, timeout: float | None = None) -> NodeInfo:
        msg = await self._unary("GetNodeInfo", pb.NodeInfoRequest(), timeout or self.timeouts.info_s)
        return wire.node_info_from_proto(msg)

    async def health(self, timeout: float | None = None) -> Health:
        msg = await self._unary("Health", pb.HealthRequest(), timeout or self.timeouts.info_s)
        return Health(msg.healthy, msg.draining, msg.message)

    async def load(self, timeout: float | None = None) -> NodeLoad:
        return wire.load_from_proto(await self._unary("GetLoad", pb.LoadRequest(), timeout or self.timeouts.info_s))

    async def reserve(self, req: EngineRequest, lease_ms: int = 0, queue_s: float = 0.0,
                      watch: CallWatch | None = None) -> ReserveResult:
        """queue_s > 0: the node may queue the reservation that long for blocks (within the deadline)."""
        left = req.remaining()
        queue_s = max(0.0, queue_s if left is None else min(queue_s, left))
        msg = await self._unary("Reserve", pb.ReserveRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, params=req.proto_params(),
            cache_salt=req.cache_salt, lease_ms=lease_ms, queue_timeout_ms=int(queue_s * 1000),
            lora_name=req.lora_name, traceparent=req.traceparent, images=wire.images_to_proto(req.images),
        ), req.timeout(self.timeouts.reserve_s + queue_s), watch)
        return wire.reserve_result_from_proto(msg)

    async def prefill(self, req: EngineRequest, reservation: ReserveResult,
                      watch: CallWatch | None = None) -> PrefillResult:
        msg = await self._unary("Prefill", pb.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, params=req.proto_params(),
            cache_salt=req.cache_salt, decode_kv_address=reservation.kv_address,
            decode_cached_tokens=reservation.num_cached_tokens, dst_block_ids=reservation.dst_block_ids,
            decode_layout=wire.layout_to_proto(reservation.layout), lora_name=req.lora_name,
            traceparent=req.traceparent, transfer_id=reservation.transfer_id, images=wire.images_to_proto(req.images),
        ), req.timeout(self.timeouts.prefill_s), watch)
        return wire.prefill_result_from_proto(msg)

    async def generate(self, req: EngineRequest, handoff: PrefillResult | None = None,
                       watch: CallWatch | None = None) -> AsyncIterator[TokenChunk]:
        """Stream the sequence's tokens; leaving the loop early cancels the call on the node."""
        msg = pb.GenerateRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                 params=req.proto_params(), cache_salt=req.cache_salt, lora_name=req.lora_name,
                                 traceparent=req.traceparent, images=wire.images_to_proto(req.images),
                                 keep_ms=int(req.keep_s * 1000))
        if handoff is not None:
            msg.handoff.CopyFrom(wire.handoff_to_proto(handoff))
        if req.beam_search is not None:
            msg.beam_search.CopyFrom(wire.beam_search_to_proto(req.beam_search))
        if self._many:
            if self._streams is None or self._streams.ended:
                self._streams = SequenceStream(self.address, self._stub)
            stream = self._streams  # another sequence may replace self._streams once this call has ended
            try:
                async with aclosing(stream.sequence(msg, req.deadline, watch)) as chunks:
                    async for chunk in chunks:
                        yield wire.chunk_from_proto(chunk)
                return
            except NodeRpcError as e:
                if not stream.refused(e):  # (a call that streamed anything was answered: never refused)
                    raise
                self._many = False
                logger.info("node %s has no GenerateMany: a Generate call per sequence", self.address)
        async with aclosing(self._stream("Generate", msg, req, watch)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def attach(self, req: EngineRequest, from_chunk: int = 0,
                     watch: CallWatch | None = None) -> AsyncIterator[TokenChunk]:
        """Follow the kept sequence `req.request_id` from its chunk `from_chunk` (NodeRpcError NOT_FOUND: the
        node does not keep it); leaving the loop early leaves the sequence running there."""
        msg = pb.AttachRequest(request_id=req.request_id, from_chunk=from_chunk)
        async with aclosing(self._stream("Attach", msg, req, watch)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _stream(self, method: str, msg, req: EngineRequest,
                      watch: CallWatch | None) -> AsyncIterator[TokenChunk]:
        """A server-streaming call of TokenChunks, on its own (not over GenerateMany)."""
        call = getattr(self._stub, method)(msg, timeout=None if req.deadline is None else req.timeout(float("inf")))
        if watch is not None:
            watch.call = call
        try:
            async for chunk in call:
                if watch is not None:
                    watch.output()
                yield wire.chunk_from_proto(chunk)
        except grpc.aio.AioRpcError as e:
            raise NodeRpcError.from_grpc(self.address, method, e) from None
        except asyncio.CancelledError:
            if watch is not None:
                watch.raise_if_failed(self.address, method)
            raise
        finally:
            if watch is not None:
                watch.call = None
            call.cancel()

    async def load_lora_adapter(self, name: str, path: str) -> list[str]:
        """Load a LoRA adapter on the node (a malformed one: NodeRpcError with bad_input); its adapters after."""
        msg = await self._unary("LoadLoRAAdapter", pb.LoadLoRAAdapterRequest(lora_name=name, lora_path=path),
                                self.timeouts.lora_s)
        return list(msg.lora_adapters)

    async def unload_lora_adapter(self, name: str) -> list[str]:
        """Unload it once its running requests are done (NOT_FOUND: the node does not hold it)."""
        msg = await self._unary("UnloadLoRAAdapter", pb.UnloadLoRAAdapterRequest(lora_name=name),
                                self.timeouts.lora_unload_s)
        return list(msg.lora_adapters)

    async def abort(self, request_id: str) -> bool:
        msg = await self._unary("Abort", pb.AbortRequest(request_id=request_id), self.timeouts.abort_s)
        return msg.aborted


class NodeClients:
    """Clients by address, created on first use and kept: channels are expensive, streams are cheap."""

    def __init__(self, timeouts: Timeouts | None = None, tls: TLSFiles | None = None) -> None:
        self.timeouts = timeouts or Timeouts()
        self.tls = tls
        self._clients: dict[str, NodeClient] = {}

    def get(self, address: str) -> NodeClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = NodeClient(address, self.timeouts, self.tls)
        return client

    async def drop(self, address: str) -> None:
        client = self._clients.pop(address, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
