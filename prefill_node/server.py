"""Prefill role: compute prompts and hand their KV to decode nodes.

Prefill lifecycle (the transfer id is the decode node's, from its Reserve: the request id and a secret):
1. Check the request against the reservation it names: decode layout, cached tokens, destination blocks.
2. The engine computes the prompt (its own prefix cache first); as each layer of the last chunk is written
   the runner enqueues the blocks the decode node lacks on the connector; the first token is sampled.
3. Wait until the decode node acknowledged every layer; the blocks stay held meanwhile.
4. Release the held blocks and answer with the first token and the transfer figures. A failed transfer
   releases them too, aborts the request, and fails the RPC: UNAVAILABLE (peer unreachable, lost) or
   FAILED_PRECONDITION (layout refused). A client that leaves mid-way gets its blocks released once the
   transfer is over, in the background.

    kvrelay prefill --model default --port 50061 --connector ucx
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvrelay.common import tracing, wire
from kvrelay.common.records import ImageInput
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.engine_hooks import EngineDead
from kvrelay.engine.request import KVSendSpec
from kvrelay.engine.reservation_queue import DuplicateRequest
from kvrelay.kv_transfer.types import TransferError
from kvrelay.node.server import (
    NodeServer,
    RpcFailure,
    checked_prompt,
    require_request_id,
    transfer_failure,
    unary_rpc,
)
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb

logger = logging.getLogger(__name__)


class PrefillServer(NodeServer):
    role = "prefill"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._background: set[asyncio.Task] = set()
        # Request ids whose transfer is not settled yet: the connector keys transfers by id, and a second
        # transfer under the same id would fail inside the engine step, taking other requests with it.
        self._inflight: set[str] = set()
        self._settling: set[str] = set()  # in flight still: a client left, its transfer is being waited out

    @unary_rpc
    async def Prefill(self, request, context):  # noqa: N802 - gRPC method names
        arrival, t0 = time.monotonic(), time.perf_counter()
        rid = request.request_id
        require_request_id(rid)
        prompt, params = checked_prompt(request)
        if params.n != 1:
            raise ValueError("n: a prefill is for one sequence; reserve and prefill each of n separately")
        spec = self._send_spec(request, len(prompt))
        if rid in self._inflight:
            raise DuplicateRequest(f"request_id: {rid!r} is already being prefilled on this node")
        self._inflight.add(rid)
        with self.span("node.prefill", request) as span:
            try:
                out = await self._compute(rid, prompt, params, spec, request.cache_salt, arrival, request.lora_name,
                                          wire.images_from_proto(request.images))
                prefill_s = time.perf_counter() - t0
                sending = {"kvrelay.connector": self.settings.connector_name,
                           "kvrelay.decode_kv_address": request.decode_kv_address}
                with tracing.span("kv_transfer", span, sending) as sent:
                    transfer = await self._finish_transfer(rid, spec.transfer_id, request.decode_kv_address)
                    if sent is not None:
                        sent.set_attributes({"kvrelay.kv_transfer.bytes": transfer.nbytes,
                                             "kvrelay.kv_transfer.seconds": transfer.seconds})
            finally:
                if rid not in self._settling:  # else _settle lets the id go once the transfer is over
                    self._inflight.discard(rid)
            if span is not None:
                span.set_attributes({"kvrelay.cached_tokens": out.num_cached_tokens,
                                     "kvrelay.prefill_seconds": prefill_s})
        token = out.new_token_ids[0]
        first_logprobs = out.logprobs[0] if out.logprobs else None
        return wire.prefill_result_to_proto(rid, wire.PrefillResult(
            first_token_id=token, first_logprobs=first_logprobs, num_cached_tokens=out.num_cached_tokens,
            bytes_transferred=transfer.nbytes, transfer_seconds=transfer.seconds, prefill_seconds=prefill_s,
            finish_reason=self._first_finish_reason(params, token, len(prompt)),
            last_layer_seconds=transfer.last_layer_seconds, prompt_logprobs=out.prompt_logprobs,
        ))

    def _send_spec(self, request: pb.PrefillRequest, num_prompt: int) -> KVSendSpec:
        layout = self.connector.layout
        if request.HasField("decode_layout"):
            theirs = wire.layout_from_proto(request.decode_layout)
            mismatches = layout.mismatches(theirs)
            if mismatches:
                refusal = layout.describe(mismatches, "prefill", "decode")
                raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, f"decode node's layout differs: {refusal}")
            if any(b >= theirs.num_blocks for b in request.dst_block_ids):
                raise ValueError(f"dst_block_ids: beyond the decode node's {theirs.num_blocks} blocks")
        scheme = f"{self.settings.connector_name}://"
        if not request.decode_kv_address.startswith(scheme):
            raise ValueError(f"decode_kv_address: {request.decode_kv_address!r} is not a {scheme}host:port address "
                             "(take ReserveResponse.kv_address)")
        bs, cached, dst = layout.block_size, request.decode_cached_tokens, tuple(request.dst_block_ids)
        if cached % bs or cached >= num_prompt:
            raise ValueError(f"decode_cached_tokens: {cached} must be a multiple of the block size {bs} and "
                             f"less than the prompt's {num_prompt} tokens")
        need = layout.blocks_for(num_prompt) - cached // bs
        if len(dst) != need:
            raise ValueError(f"dst_block_ids: {len(dst)} given; the prompt's blocks after the decode node's "
                             f"{cached} cached tokens are {need}")
        if len(set(dst)) != len(dst):
            raise ValueError("dst_block_ids: duplicate block ids")
        # The decode node's transfer id carries a secret only a caller of its Reserve knows (an older gateway's
        # requests fall back to the request id, which the decode node then refuses).
        return KVSendSpec(request.decode_kv_address, request.transfer_id or request.request_id, cached // bs, dst)

    async def _compute(self, rid: str, prompt: list[int], params: SamplingParams, spec: KVSendSpec,
                       salt: str, arrival: float, lora_name: str = "", images: tuple[ImageInput, ...] = ()):
        try:
            out = await self.engine.prefill(rid, prompt, params, spec, salt, arrival, lora_name, images)
        except asyncio.CancelledError:
            self._settle_later(rid, spec.transfer_id)  # the client left: the transfer may still read the blocks
            raise
        if not out.new_token_ids:
            await self.engine.release_held(rid)
            raise RpcFailure(grpc.StatusCode.ABORTED, f"request {rid!r} was aborted during its prefill")
        return out

    async def _finish_transfer(self, rid: str, tid: str, peer: str):
        # The wait runs in a thread that a cancelled RPC cannot stop; a client that leaves hands that same
        # wait to _settle, since the connector answers one waiter per transfer.
        waiting = self._wait_sent(tid)
        try:
            result = await asyncio.shield(waiting)
        except asyncio.CancelledError:
            self._settle_later(rid, tid, waiting)
            raise
        except TransferError as e:
            self.metrics.observe_transfer_failure("send")
            await self.engine.release_held(rid)
            await self.engine.abort(rid)
            logger.warning("prefill %s: KV transfer to %s failed, blocks released: %s", rid, peer, e)
            raise transfer_failure(e, f"KV transfer of {rid!r} to decode node {peer} failed") from None
        # The blocks go back between steps; the answer does not wait for that (a step under way would hold the
        # first token back by its whole length).
        self.engine.run_nowait(lambda core: core.release_held(rid))
        self.metrics.observe_transfer("send", result.nbytes, result.seconds)
        return result

    def _wait_sent(self, tid: str) -> asyncio.Future:
        """The wait for the decode node's acknowledgements, as a future that outlives a cancelled caller."""
        return self.blocking(self.connector.wait, tid, self.settings.transfer_timeout)

    def _settle_later(self, rid: str, tid: str, waiting: asyncio.Future | None = None) -> None:
        self._settling.add(rid)
        task = asyncio.get_running_loop().create_task(self._settle(rid, tid, waiting))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _settle(self, rid: str, tid: str, waiting: asyncio.Future | None) -> None:
        """Release a departed client's blocks once nothing reads them any more. `waiting`: the transfer wait
        already under way, if the client left during it."""
        try:
            if waiting is None:
                # A barrier first: the step running when the client left may have started the send, and only
                # once it is over does the connector know the transfer (the abort queued before it, too).
                await self.engine.call(lambda core: None)
                waiting = self._wait_sent(tid)
            try:
                await waiting
            except TransferError:
                pass  # never started, or failed: either way nothing reads the blocks any more
            await self.engine.release_held(rid)
        except EngineDead:
            pass  # nothing to release any more
        finally:
            self._settling.discard(rid)
            self._inflight.discard(rid)

    def _first_finish_reason(self, params: SamplingParams, token: int, num_prompt: int) -> str:
        """Whether the first token already ends the request, by the rules the engine applies."""
        generated = params.num_resumed_tokens + 1  # a resumed request's earlier output counts
        at_limit = params.max_tokens is not None and params.max_tokens <= generated
        if at_limit or num_prompt + 1 >= self.core.max_model_len:
            return "length"
        if params.min_tokens > generated:
            return ""
        if (token == self.core.info.eos_token_id and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        return ""

