"""grpc.aio clients of the engine service. Protobuf stays in this module: callers see dataclasses.

One channel per node address, reused by every request (HTTP/2 multiplexes the streams). Every unary call
has a deadline; the token stream has none (a generation may run long) but is cancelled with its request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from shared.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from shared.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc
from shared.sampling_params import SamplingParams

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


@dataclass(frozen=True)
class KVLayoutInfo:
    model_id: str = ""
    dtype: str = ""
    block_size: int = 0
    num_layers: int = 0
    num_kv_heads: int = 0
    head_size: int = 0
    num_blocks: int = 0


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    role: str
    model_id: str
    block_size: int
    max_model_len: int = 0
    vocab_size: int = 0
    capacity_tokens: int = 0
    connector: str = ""
    kv_address: str = ""
    grpc_address: str = ""
    dtype: str = ""
    layout: KVLayoutInfo | None = None


@dataclass(frozen=True)
class Load:
    num_waiting: int = 0
    num_running: int = 0
    queued_prefill_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    kv_cache_usage: float = 0.0

    @classmethod
    def of(cls, obj) -> Load | None:
        """From a protobuf Load or the registry's NodeLoad (same field names)."""
        if obj is None:
            return None
        return cls(**{f: getattr(obj, f, 0) for f in cls.__dataclass_fields__})


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int = 0
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Reservation:
    request_id: str
    node_id: str
    kv_address: str
    num_cached_tokens: int
    dst_block_ids: tuple[int, ...]
    layout: KVLayoutInfo | None
    lease_expires_unix_ms: int = 0


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    first_logprobs: TokenLogprob | None
    num_cached_tokens: int
    bytes_transferred: int = 0
    transfer_seconds: float = 0.0
    prefill_seconds: float = 0.0
    finish_reason: str = ""


@dataclass(frozen=True)
class TokenChunk:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str = ""
    stop_reason: int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class Health:
    healthy: bool
    draining: bool = False
    message: str = ""


@dataclass
class EngineRequest:
    """What every engine RPC of one sequence carries."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    cache_salt: str = ""
    _proto_params: pb.SamplingParams | None = field(default=None, repr=False)

    def proto_params(self) -> pb.SamplingParams:
        if self._proto_params is None:
            self._proto_params = params_to_proto(self.params)
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


# --------------------------------------------------------------------------------------- conversion


def params_to_proto(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, priority=p.priority,
    )
    if p.seed is not None:
        msg.seed = p.seed
    if p.max_tokens is not None:
        msg.max_tokens = p.max_tokens
    if p.logprobs is not None:
        msg.logprobs = p.logprobs
    return msg


def _layout(msg: pb.KVLayout) -> KVLayoutInfo:
    return KVLayoutInfo(msg.model_id, msg.dtype, msg.block_size, msg.num_layers, msg.num_kv_heads,
                        msg.head_size, msg.num_blocks)


def _layout_proto(layout: KVLayoutInfo | None) -> pb.KVLayout | None:
    if layout is None:
        return None
    return pb.KVLayout(model_id=layout.model_id, dtype=layout.dtype, block_size=layout.block_size,
                       num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                       head_size=layout.head_size, num_blocks=layout.num_blocks)


def _logprob(msg: pb.TokenLogprobs) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, msg.rank, tuple((t.token_id, t.logprob) for t in msg.top))


def _logprob_proto(lp: TokenLogprob | None) -> pb.TokenLogprobs | None:
    if lp is None:
        return None
    top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top]
    return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top=top)


def node_info(msg: pb.NodeInfo) -> NodeInfo:
    return NodeInfo(
        node_id=msg.node_id, role=msg.role, model_id=msg.model_id, block_size=msg.block_size,
        max_model_len=msg.max_model_len, vocab_size=msg.vocab_size, capacity_tokens=msg.capacity_tokens,
        connector=msg.connector, kv_address=msg.kv_address, grpc_address=msg.grpc_address, dtype=msg.dtype,
        layout=_layout(msg.layout) if msg.HasField("layout") else None,
    )


def token_chunk(msg: pb.TokenChunk) -> TokenChunk:
    return TokenChunk(
        token_ids=tuple(msg.token_ids), logprobs=tuple(_logprob(lp) for lp in msg.logprobs),
        finish_reason=msg.finish_reason, stop_reason=msg.stop_reason if msg.HasField("stop_reason") else None,
        num_prompt_tokens=msg.num_prompt_tokens, num_output_tokens=msg.num_output_tokens,
        num_cached_tokens=msg.num_cached_tokens,
    )


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
        return node_info(await self._unary("GetNodeInfo", pb.NodeInfoRequest(), timeout or self.timeouts.info_s))

    async def health(self, timeout: float | None = None) -> Health:
        msg = await self._unary("Health", pb.HealthRequest(), timeout or self.timeouts.info_s)
        return Health(msg.healthy, msg.draining, msg.message)

    async def load(self, timeout: float | None = None) -> Load:
        return Load.of(await self._unary("GetLoad", pb.LoadRequest(), timeout or self.timeouts.info_s))

    async def reserve(self, req: EngineRequest, lease_ms: int = 0) -> Reservation:
        msg = await self._unary("Reserve", pb.ReserveRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, params=req.proto_params(),
            cache_salt=req.cache_salt, lease_ms=lease_ms,
        ), self.timeouts.reserve_s)
        return Reservation(
            request_id=msg.request_id, node_id=msg.node_id, kv_address=msg.kv_address,
            num_cached_tokens=msg.num_cached_tokens, dst_block_ids=tuple(msg.dst_block_ids),
            layout=_layout(msg.layout) if msg.HasField("layout") else None,
            lease_expires_unix_ms=msg.lease_expires_unix_ms,
        )

    async def prefill(self, req: EngineRequest, reservation: Reservation) -> PrefillResult:
        msg = await self._unary("Prefill", pb.PrefillRequest(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, params=req.proto_params(),
            cache_salt=req.cache_salt, decode_kv_address=reservation.kv_address,
            decode_cached_tokens=reservation.num_cached_tokens, dst_block_ids=reservation.dst_block_ids,
            decode_layout=_layout_proto(reservation.layout),
        ), self.timeouts.prefill_s)
        return PrefillResult(
            first_token_id=msg.first_token_id,
            first_logprobs=_logprob(msg.first_logprobs) if msg.HasField("first_logprobs") else None,
            num_cached_tokens=msg.num_cached_tokens, bytes_transferred=msg.bytes_transferred,
            transfer_seconds=msg.transfer_seconds, prefill_seconds=msg.prefill_seconds,
            finish_reason=msg.finish_reason,
        )

    async def generate(self, req: EngineRequest, handoff: PrefillResult | None = None) -> AsyncIterator[TokenChunk]:
        """Stream the sequence's tokens; leaving the loop early cancels the call on the node."""
        msg = pb.GenerateRequest(request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
                                 params=req.proto_params(), cache_salt=req.cache_salt)
        if handoff is not None:
            msg.handoff.CopyFrom(pb.Handoff(first_token_id=handoff.first_token_id,
                                            first_logprobs=_logprob_proto(handoff.first_logprobs)))
        call = self._stub.Generate(msg)
        try:
            async for chunk in call:
                yield token_chunk(chunk)
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
