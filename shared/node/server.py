"""The Engine gRPC service, common to both roles: node info, health, load, local Generate (a stream per
sequence, or many sequences over one stream with GenerateMany: kvrelay.node.multiplex), Abort, and Attach to a
sequence that outlives its caller (kvrelay.node.kept).

Role servers (prefill_node.server, decode_node.server) subclass NodeServer and fill in Prefill, Reserve and
Generate with a hand-off; an RPC meant for the other role answers FAILED_PRECONDITION naming the role.
Every handler turns engine errors into gRPC status codes at this edge: a bad request (ValueError) is
INVALID_ARGUMENT with the engine's message, an unknown LoRA adapter NOT_FOUND, a draining node UNAVAILABLE,
and only a bug is INTERNAL.

LoRA adapters are loaded and unloaded at runtime (LoadLoRAAdapter, UnloadLoRAAdapter): an adapter's files are
read and checked off the engine thread (a malformed one is INVALID_ARGUMENT and nothing changes), then
registered between two steps; an unload refuses new requests for the adapter at once and removes it once its
running requests are done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import aclosing, contextmanager, nullcontext
from dataclasses import dataclass

import grpc

from kvrelay.common import tracing, wire
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.config import dtype_name
from kvrelay.engine.core import EngineCore
from kvrelay.engine.engine_hooks import BlockEventSink, EngineDead, EngineDraining, EngineHooks
from kvrelay.engine.lora import UnknownAdapter
from kvrelay.engine.reservation_queue import DuplicateRequest, QueueFull
from kvrelay.engine.scheduler_output import EngineCoreOutput
from kvrelay.kv_transfer.base import KVConnector
from kvrelay.kv_transfer.types import LayoutMismatchError, TransferError
from kvrelay.node.kept import KeptSequences
from kvrelay.node.metrics import NodeMetrics
from kvrelay.node.multiplex import SequenceMux
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class RpcFailure(Exception):
    """End the RPC with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str,
                 kind: wire.NodeErrorKind = wire.NodeErrorKind.NODE) -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind


def transfer_failure(error: TransferError, what: str) -> RpcFailure:
    """A refused layout is the caller's deployment mistake (FAILED_PRECONDITION); anything else may pass."""
    refused = isinstance(error, LayoutMismatchError)
    code = grpc.StatusCode.FAILED_PRECONDITION if refused else grpc.StatusCode.UNAVAILABLE
    return RpcFailure(code, f"{what}: {error}", wire.NodeErrorKind.HANDOFF)


def _status(error: Exception) -> tuple[grpc.StatusCode, str, wire.NodeErrorKind]:
    kind = wire.NodeErrorKind
    if isinstance(error, RpcFailure):
        return error.code, str(error), error.kind
    if isinstance(error, DuplicateRequest):
        return grpc.StatusCode.ALREADY_EXISTS, str(error), kind.DUPLICATE
    if isinstance(error, UnknownAdapter):
        return grpc.StatusCode.NOT_FOUND, str(error.args[0]), kind.NODE
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(error), kind.NODE
    if isinstance(error, QueueFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(error), kind.FULL
    if isinstance(error, EngineDraining):
        return grpc.StatusCode.UNAVAILABLE, str(error), kind.DRAINING
    if isinstance(error, EngineDead):
        return grpc.StatusCode.UNAVAILABLE, str(error), kind.NODE
    logger.exception("RPC failed unexpectedly", exc_info=error)
    return grpc.StatusCode.INTERNAL, f"internal error: {error!r}", kind.NODE


async def _abort(context: grpc.aio.ServicerContext, error: Exception) -> None:
    code, message, kind = _status(error)
    await context.abort(code, message, trailing_metadata=((wire.NODE_ERROR_KEY, kind.value),))


def unary_rpc(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(self: NodeServer, request, context: grpc.aio.ServicerContext):
        try:
            return await fn(self, request, context)
        except Exception as e:  # noqa: BLE001 - mapped to a status code, bugs logged
            await _abort(context, e)

    return wrapper


def stream_rpc(fn: Callable) -> Callable:
    @functools.wraps(fn)
    async def wrapper(self: NodeServer, request, context: grpc.aio.ServicerContext):
        try:
            async with aclosing(fn(self, request, context)) as stream:
                async for item in stream:
                    yield item
        except Exception as e:  # noqa: BLE001 - mapped to a status code, bugs logged
            await _abort(context, e)

    return wrapper


@dataclass(frozen=True)
class NodeSettings:
    """Who this node is and where it is reached (known once its ports are bound)."""

    node_id: str
    served_model_name: str
    connector_name: str
    grpc_address: str = ""
    metrics_address: str = ""
    transfer_timeout: float = 30.0  # how long a Prefill waits for its acks once the first token is out
    kv_lease_s: float = 30.0
    lora_unload_timeout_s: float = 600.0  # how long an unload waits for the adapter's running requests


class NodeServer(pb_grpc.EngineServicer):
    """The role servers' base. It runs the engine on its own thread (AsyncEngine), wired at construction to
    the metrics, the index publishers (`block_events`; `tier_events`, its offload tiers') and the role's lease
    hook."""

    role = "node"

    def __init__(
        self, core: EngineCore, connector: KVConnector, metrics: NodeMetrics, settings: NodeSettings,
        block_events: BlockEventSink | None = None, tier_events: Mapping[str, BlockEventSink] | None = None,
    ) -> None:
        self.core = core
        self.connector = connector
        self.metrics = metrics
        self.settings = settings
        hooks = EngineHooks(observer=metrics, block_events=block_events, tier_events=tier_events,
                            on_lease_expired=self.leases_expired)
        self.engine = AsyncEngine(core, hooks)
        # Transfer waits block a thread each (up to a lease): keep them off the default executor.
        self.waits = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="kvrelay-wait")
        self._sequences = 0  # token streams open (Generate calls and GenerateMany's sequences)
        self._muxes: set[SequenceMux] = set()
        self.kept = KeptSequences()  # sequences started with keep_ms, by request id

    # -- hooks for the roles ------------------------------------------------------------------------
    def leases_expired(self, request_ids: list[str]) -> None:
        """Engine thread: these reservations or held blocks outlived their lease and were freed."""

    def generate_handoff(self, request: pb.GenerateRequest, arrival: float,
                         span=None) -> AsyncIterator[EngineCoreOutput]:
        """`span`: the sequence's node.generate span (kvrelay.common.tracing), the parent of the role's own."""
        raise self.wrong_role("Generate with a hand-off")

    def before_abort(self, request_id: str) -> None:
        """Runs on the event loop before an Abort reaches the engine."""

    async def streams_flushed(self, timeout: float) -> bool:
        """Wait until every token stream has ended and its last message is with gRPC (a draining node's
        aborts must reach the callers before the server closes); False if `timeout` passed first."""
        deadline = time.monotonic() + timeout
        while self._sequences or not all(m.settled for m in self._muxes):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def close(self) -> None:
        self.kept.close()
        self.waits.shutdown(wait=False, cancel_futures=True)
        self.core.shutdown()

    def wrong_role(self, what: str) -> RpcFailure:
        other = "decode" if self.role == "prefill" else "prefill"
        return RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{what} is served by {other} nodes; {self.settings.node_id} is a {self.role} node")

    # -- info ---------------------------------------------------------------------------------------
    def node_info(self) -> wire.NodeInfo:
        s, core = self.settings, self.core
        layout = self.connector.layout
        lora = core.config.lora if core.lora is not None else None
        return wire.NodeInfo(
            node_id=s.node_id, role=self.role, model_id=core.info.model_id, block_size=layout.block_size,
            dtype=dtype_name(core.info.dtype), max_model_len=core.max_model_len, vocab_size=core.vocab_size,
            capacity_tokens=core.num_blocks * layout.block_size, layout=layout, connector=s.connector_name,
            kv_address=self.connector.address, grpc_address=s.grpc_address, metrics_address=s.metrics_address,
            lora_adapters=self.engine.load().lora_adapters, max_loras=lora.max_loras if lora else 0,
            max_lora_rank=lora.max_lora_rank if lora else 0, lora_capacity=lora.cpu_capacity if lora else 0,
        )

    def health(self) -> dict:
        alive = self.engine.running
        message = "draining" if self.engine.draining else ("ok" if alive else "engine thread stopped")
        return {"healthy": alive, "draining": self.engine.draining, "message": message,
                "node_id": self.settings.node_id, "role": self.role}

    def start(self) -> None:
        """Start the engine thread (inside the running event loop)."""
        self.engine.start()
        # The grammar backend reads the tokenizer once (~0.5 s, on its own thread): not on a first request.
        self.core.warm_up_grammars()

    @unary_rpc
    async def GetNodeInfo(self, request, context):  # noqa: N802 - gRPC method names
        return wire.node_info_to_proto(self.node_info())

    @unary_rpc
    async def Health(self, request, context):  # noqa: N802
        h = self.health()
        return pb.HealthResponse(healthy=h["healthy"], draining=h["draining"], message=h["message"])

    @unary_rpc
    async def GetLoad(self, request, context):  # noqa: N802
        return wire.load_to_proto(self.engine.load())

    # -- requests -----------------------------------------------------------------------------------
    @unary_rpc
    async def Reserve(self, request, context):  # noqa: N802
        raise self.wrong_role("Reserve")

    @unary_rpc
    async def Prefill(self, request, context):  # noqa: N802
        raise self.wrong_role("Prefill")

    @stream_rpc
    async def Generate(self, request, context):  # noqa: N802
        async with aclosing(self.token_chunks(request)) as chunks:
            async for chunk in chunks:
                yield chunk

    @stream_rpc
    async def GenerateMany(self, request_iterator, context):  # noqa: N802
        mux = SequenceMux(self.token_chunks, _status)
        self._muxes.add(mux)
        try:
            async with aclosing(mux.run(request_iterator)) as responses:
                async for response in responses:
                    yield response
        finally:
            self._muxes.discard(mux)

    async def token_chunks(self, request: pb.GenerateRequest) -> AsyncIterator[pb.TokenChunk]:
        """One sequence's stream, for Generate and GenerateMany alike. With keep_ms, the caller follows a kept
        sequence, which goes on when the caller leaves without an Abort."""
        arrival = time.monotonic()
        require_request_id(request.request_id)
        source = self._traced_chunks(request, arrival)
        if request.keep_ms and not request.HasField("beam_search"):
            source = self.kept.start(request.request_id, source, request.keep_ms / 1000).follow()
        with self._open_stream():
            async with aclosing(source) as chunks:
                async for chunk in chunks:
                    yield chunk

    @stream_rpc
    async def Attach(self, request, context):  # noqa: N802
        require_request_id(request.request_id)
        kept = self.kept.get(request.request_id)
        if kept is None:
            raise RpcFailure(grpc.StatusCode.NOT_FOUND,
                             f"{request.request_id!r} is not running on {self.settings.node_id}, nor did it end "
                             "within its keep_ms (it was never kept here, was aborted, or ended long ago)")
        with self._open_stream():
            async with aclosing(kept.follow(request.from_chunk)) as chunks:
                async for chunk in chunks:
                    yield chunk

    @contextmanager
    def _open_stream(self) -> Iterator[None]:
        """A caller's token stream, counted while it is open (a draining node waits for them to end)."""
        self._sequences += 1
        try:
            yield
        finally:
            self._sequences -= 1

    async def _traced_chunks(self, request: pb.GenerateRequest, arrival: float) -> AsyncIterator[pb.TokenChunk]:
        with self.span("node.generate", request) as span:
            async with aclosing(self._token_chunks(request, arrival, span)) as chunks:
                async for chunk in chunks:
                    yield chunk

    def span(self, name: str, request):
        """A span of this node around a block, for `request`: the child of the gateway's call (its traceparent),
        failed if the block raises; the block gets None when the node does not trace."""
        if not tracing.enabled():
            return nullcontext(None)
        return tracing.span(name, tracing.parent_from(request.traceparent), {
            "kvrelay.node_id": self.settings.node_id, "gen_ai.request.id": request.request_id,
            "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids)}, server=True)

    async def _token_chunks(self, request: pb.GenerateRequest, arrival: float, span) -> AsyncIterator[pb.TokenChunk]:
        if request.HasField("beam_search"):
            if request.HasField("handoff"):
                raise ValueError("beam_search: runs on one node from the prompt; it takes no hand-off")
            prompt, params = checked_prompt(request)
            beams = wire.beam_search_from_proto(request.beam_search)
            stream = self.engine.generate(request.request_id, prompt, params, request.cache_salt, arrival,
                                          beam_search=beams, lora_name=request.lora_name)
        elif request.HasField("handoff"):
            stream = self.generate_handoff(request, arrival, span)
        else:
            prompt, params = checked_prompt(request)
            if params.n != 1:
                raise ValueError("n: Generate streams one sequence (TokenChunk has no index); send n requests")
            stream = self.engine.generate(request.request_id, prompt, params, request.cache_salt, arrival,
                                          lora_name=request.lora_name, images=wire.images_from_proto(request.images))
        num_output = 0
        async with aclosing(stream):
            async for out in stream:
                if num_output == 0 and span is not None:
                    span.set_attributes({"gen_ai.latency.time_to_first_token": time.monotonic() - arrival,
                                         "kvrelay.cached_tokens": out.num_cached_tokens or 0})
                num_output += len(out.new_token_ids)
                yield wire.chunk_to_proto(token_chunk(out, num_output))
        if span is not None:
            span.set_attribute("gen_ai.usage.completion_tokens", num_output)

    @unary_rpc
    async def LoadLoRAAdapter(self, request, context):  # noqa: N802
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise ValueError("lora_name and lora_path: both are required")
        known = await self.engine.call(lambda core: core.lora.paths.get(name) if core.lora is not None else None)
        if known != path:  # the same adapter again is a no-op (a gateway loads it wherever it routes it)
            adapter = await asyncio.to_thread(self.core.read_lora, name, path)  # files read off the engine thread
            await self.engine.call(lambda core: core.add_lora(name, adapter))
        return pb.LoRAAdaptersResponse(lora_adapters=await self._lora_names())

    @unary_rpc
    async def UnloadLoRAAdapter(self, request, context):  # noqa: N802
        name = request.lora_name
        await self.engine.call(lambda core: core.begin_unload_lora(name))
        timeout = request.timeout_ms / 1000 if request.timeout_ms else self.settings.lora_unload_timeout_s
        deadline = time.monotonic() + timeout
        while (left := await self.engine.call(lambda core: core.lora_in_use(name))) > 0:
            if time.monotonic() > deadline:
                await self.engine.call(lambda core: core.lora.unloading.discard(name))
                raise RpcFailure(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"LoRA adapter {name!r}: {left} requests still use it after {timeout:g} s; "
                                 "it stays loaded")
            await asyncio.sleep(0.02)
        await self.engine.call(lambda core: core.remove_lora(name))
        return pb.LoRAAdaptersResponse(lora_adapters=await self._lora_names())

    async def _lora_names(self) -> list[str]:
        return await self.engine.call(lambda core: core.lora.names() if core.lora is not None else [])

    @unary_rpc
    async def Abort(self, request, context):  # noqa: N802
        require_request_id(request.request_id)
        self.before_abort(request.request_id)
        self.kept.abort(request.request_id)
        return pb.AbortResponse(aborted=await self.engine.abort(request.request_id))

    # -- helpers ------------------------------------------------------------------------------------
    def blocking(self, fn: Callable, *args) -> asyncio.Future:
        """A blocking connector call (transfer waits) started on the wait pool. Its thread runs to the end
        whatever happens to the caller: await it shielded to keep its answer when the caller is cancelled."""
        return asyncio.get_running_loop().run_in_executor(self.waits, fn, *args)


def require_request_id(request_id: str) -> None:
    if not request_id:
        raise ValueError("request_id: must not be empty")


def checked_prompt(request) -> tuple[list[int], SamplingParams]:
    """(prompt token ids, SamplingParams) of a Reserve / Prefill / Generate request; ValueError if bad."""
    prompt = wire.prompt_ids(request.prompt_token_ids)
    wire.check_token_ids("prompt_token_ids", prompt)
    return prompt, wire.request_params(request)


def token_chunk(out: EngineCoreOutput, num_output_tokens: int) -> wire.TokenChunk:
    return wire.TokenChunk(
        token_ids=out.new_token_ids, logprobs=out.logprobs,
        finish_reason=out.finish_reason or "", stop_reason=out.stop_reason,
        num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=num_output_tokens,
        num_cached_tokens=out.num_cached_tokens, prompt_logprobs=out.prompt_logprobs, beams=out.beams,
        embedding=out.pooled or (),
    )
