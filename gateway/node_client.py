"""grpc.aio clients of the engine service. Protobuf stays in this module (and shared.wire, which converts):
callers see the wire records.

One channel per node address, reused by every request (HTTP/2 multiplexes the streams). Every unary call
has a deadline; the token stream has none (a generation may run long) but is cancelled with its request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from shared import wire
from shared.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from shared.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc
from shared.records import NodeLoad
from shared.sampling_params import BeamSearchParams, SamplingParams
from shared.wire import Health, NodeInfo, PrefillResult, ReserveResult, TokenChunk

logger = logging.getLogger(__name__)

_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
]
_BUSY = {grpc.StatusCode.RESOURCE_EXHAUSTED}
_BAD_INPUT = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


@dataclass(frozen=True)
class Timeouts:
    info_s: float = 3.0
    reserve_s: float = 10.0
    prefill_s: float = 300.0
    abort_s: float = 2.0


@dataclass
class EngineRequest:
    """What every engine RPC of one sequence carries."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    cache_salt: str = ""
    beam_search: BeamSearchParams | None = None  # set: a beam search (Generate only, no hand-off)
    _proto_params: pb.SamplingParams | None = field(default=None, repr=False)

    def proto_params(self) -> pb.SamplingParams:
        if self._proto_params is None:
            self._proto_params = wire.sampling_to_proto(self.params)
        return self._proto_params


class NodeRpcError(Exception):
    """A failed engine call; `busy` (refused for capacity), `bad_input` (the caller's fault) or neither."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{method} on {address}: {code.name}: {details}")
        self.address, self.method, self.code, self.details = address, method, code, details

    @property
    def busy(self) -> bool:
        return self.code in _BUSY

    @property
    def bad_input(self) -> bool:
        return self.code in _BAD_INPUT


# ------------------------------------------------------------------------------------------- client


class NodeClient:
    """The engine service of one node, over one channel."""

    def __init__(self, address: str, timeouts: Timeouts | None = None) -> None:
        self.address = address
        self.timeouts = timeouts or Timeouts()
        self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self._stub = pb_grpc.EngineStub(self._channel)

    async def close(self) -> None:
        await self._channel.close(grace=None)

    async def _unary(self, method: str, request, timeout: float):
        try:
            return await getattr(self._stub, method)(request, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise NodeRpcError(self.address, method, e.code(), e.details() or "") from None

    async def info(self, timeout: float | None = None) -> NodeInfo:
        msg = await self._unary("GetNodeInfo", pb.NodeInfoRequest(), timeout or self.timeouts.info_s)
        return wire.node_info_from_proto(msg)

    async def health(self, timeout: float | None = None) -> Health:
        msg = await self._unary("Health", pb.HealthRequest(), timeout or self.timeouts.info_s)
        return Health(msg.healthy, msg.draining, msg.message)

    async def load(self, timeout: float | None = None) -> NodeLoad:
        return wire.load_from_proto(await self._unary("GetLoad", pb.LoadRequest(), timeout or self.timeouts.info_s))

    async def reserve(self, req: EngineRequest, lease_ms: int = 0) -> ReserveResult:
        msg = await self._unary("Reserve", pb.ReserveRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, params=req.proto_params(),
            cache_salt=req.cache_salt, lease_ms=lease_ms,
        ), self.timeouts.reserve_s)
        return wire.reserve_result_from_proto(msg)

    async def prefill(self, req: EngineRequest, reservation: ReserveResult) -> PrefillResult:
        msg = await self._unary("Prefill", pb.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, params=req.proto_params(),
            cache_salt=req.cache_salt, decode_kv_address=reservation.kv_address,
            decode_cached_tokens=reservation.num_cached_tokens, dst_block_ids=reservation.dst_block_ids,
            decode_layout=wire.layout_to_proto(reservation.layout),
        ), self.timeouts.prefill_s)
        return wire.prefill_result_from_proto(msg)

    async def generate(self, req: EngineRequest, handoff: PrefillResult | None = None) -> AsyncIterator[TokenChunk]:
        """Stream the sequence's tokens; leaving the loop early cancels the call on the node."""
        msg = pb.GenerateRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                 params=req.proto_params(), cache_salt=req.cache_salt)
        if handoff is not None:
            msg.handoff.CopyFrom(wire.handoff_to_proto(handoff))
        if req.beam_search is not None:
            msg.beam_search.CopyFrom(wire.beam_search_to_proto(req.beam_search))
        call = self._stub.Generate(msg)
        try:
            async for chunk in call:
                yield wire.chunk_from_proto(chunk)
        except grpc.aio.AioRpcError as e:
            raise NodeRpcError(self.address, "Generate", e.code(), e.details() or "") from None
        finally:
            call.cancel()

    async def abort(self, request_id: str) -> bool:
        msg = await self._unary("Abort", pb.AbortRequest(request_id=request_id), self.timeouts.abort_s)
        return msg.aborted


class NodeClients:
    """Clients by address, created on first use and kept: channels are expensive, streams are cheap."""

    def __init__(self, timeouts: Timeouts | None = None) -> None:
        self.timeouts = timeouts or Timeouts()
        self._clients: dict[str, NodeClient] = {}

    def get(self, address: str) -> NodeClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = NodeClient(address, self.timeouts)
        return client

    async def drop(self, address: str) -> None:
        client = self._clients.pop(address, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.close()
