"""grpc.aio clients of the engine service. Protobuf stays in this module (and shared.wire, which converts):
callers see the wire records.

One channel per node address, reused by every request (HTTP/2 multiplexes the streams), reconnecting within
a second or two once a restarted node listens again. Every unary call has a deadline; the token stream has
the request's own deadline, if it has one, and is cancelled with its request. A call made with a CallWatch
can be failed from outside (the liveness monitor, when its node stops answering): it then raises
NodeRpcError like any failed call.
"""

from __future__ import annotations

import asyncio
import logging
import time
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
    # gRPC's default reconnect backoff grows to two minutes: a node restarted after a crash would sit unused.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
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
    """What every engine RPC of one sequence carries. `deadline` (monotonic): the request's own, if any;
    no call outlives it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    cache_salt: str = ""
    beam_search: BeamSearchParams | None = None  # set: a beam search (Generate only, no hand-off)
    deadline: float | None = None
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


class NodeRpcError(Exception):
    """A failed engine call. `kind` is what the node itself said went wrong (shared.wire.NodeErrorKind), or
    None when the call failed without the node answering (down, hung, unreachable)."""

    def __init__(self, address: str, method: str, code: grpc.StatusCode, details: str,
                 kind: str | None = None) -> None:
        super().__init__(f"{method} on {address}: {code.name}: {details}")
        self.address, self.method, self.code, self.details, self.kind = address, method, code, details, kind

    @classmethod
    def from_grpc(cls, address: str, method: str, e: grpc.aio.AioRpcError) -> NodeRpcError:
        try:
            kind = dict(e.trailing_metadata() or ()).get(wire.NODE_ERROR_KEY)
        except (TypeError, ValueError):
            kind = None
        return cls(address, method, e.code(), e.details() or "", kind)

    @property
    def busy(self) -> bool:
        """Refused for capacity: the node is fine, its queues are full."""
        return self.code in _BUSY

    @property
    def bad_input(self) -> bool:
        return self.code in _BAD_INPUT

    @property
    def duplicate(self) -> bool:
        """The node still holds a sequence under this id: it must not run it twice."""
        return self.code == grpc.StatusCode.ALREADY_EXISTS

    @property
    def draining(self) -> bool:
        return self.kind == wire.NodeErrorKind.DRAINING.value

    @property
    def handoff_failed(self) -> bool:
        """The node answered that the KV transfer with its peer failed (the node itself is fine)."""
        return self.kind == wire.NodeErrorKind.HANDOFF.value

    @property
    def answered(self) -> bool:
        """The node's own code returned this error: the node is alive."""
        return self.kind is not None


class CallWatch:
    """One call in flight on one node, as the liveness monitor sees it: when it last heard from the node,
    and a way to fail the call from outside (the node stopped answering)."""

    __slots__ = ("node_id", "last", "call", "error")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.last = time.monotonic()
        self.call = None
        self.error: str | None = None

    def touch(self) -> None:
        self.last = time.monotonic()

    def fail(self, reason: str) -> None:
        self.error = reason
        if self.call is not None:
            self.call.cancel()

    def raise_if_failed(self, address: str, method: str) -> None:
        """Inside `except CancelledError`: the watch cancelled the call (not the caller's own task)."""
        if self.error is not None and not asyncio.current_task().cancelling():
            raise NodeRpcError(address, method, grpc.StatusCode.UNAVAILABLE, self.error) from None


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
        ), req.timeout(self.timeouts.reserve_s + queue_s), watch)
        return wire.reserve_result_from_proto(msg)

    async def prefill(self, req: EngineRequest, reservation: ReserveResult,
                      watch: CallWatch | None = None) -> PrefillResult:
        msg = await self._unary("Prefill", pb.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, params=req.proto_params(),
            cache_salt=req.cache_salt, decode_kv_address=reservation.kv_address,
            decode_cached_tokens=reservation.num_cached_tokens, dst_block_ids=reservation.dst_block_ids,
            decode_layout=wire.layout_to_proto(reservation.layout),
        ), req.timeout(self.timeouts.prefill_s), watch)
        return wire.prefill_result_from_proto(msg)

    async def generate(self, req: EngineRequest, handoff: PrefillResult | None = None,
                       watch: CallWatch | None = None) -> AsyncIterator[TokenChunk]:
        """Stream the sequence's tokens; leaving the loop early cancels the call on the node."""
        msg = pb.GenerateRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                 params=req.proto_params(), cache_salt=req.cache_salt)
        if handoff is not None:
            msg.handoff.CopyFrom(wire.handoff_to_proto(handoff))
        if req.beam_search is not None:
            msg.beam_search.CopyFrom(wire.beam_search_to_proto(req.beam_search))
        call = self._stub.Generate(msg, timeout=None if req.deadline is None else req.timeout(float("inf")))
        if watch is not None:
            watch.call = call
        try:
            async for chunk in call:
                if watch is not None:
                    watch.last = time.monotonic()
                yield wire.chunk_from_proto(chunk)
        except grpc.aio.AioRpcError as e:
            raise NodeRpcError.from_grpc(self.address, "Generate", e) from None
        except asyncio.CancelledError:
            if watch is not None:
                watch.raise_if_failed(self.address, "Generate")
            raise
        finally:
            if watch is not None:
                watch.call = None
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
