"""Decode role: reservations, admission of transferred requests, token streaming.

Reservation lifecycle:
1. Reserve: the engine sets aside blocks under a lease and, on the engine thread, the connector starts
   expecting a transfer into exactly those blocks; the id joins `_expected`. The transfer's id is the request id
   and 128 random bits, returned to the caller of Reserve only (over the fleet's authenticated channel): a
   process that did not reserve cannot name a transfer, so it cannot write into reserved blocks. With
   queue_timeout_ms and no room, the reservation first waits in the engine's queue (first come, first served).
2. A prefill node writes the blocks layer by layer.
3. Generate with a hand-off claims the id, waits for the transfer, admits the request with the first
   token and streams the rest.
4. If the lease runs out first, or Abort comes, the cleanup claims the id, the connector stops accepting
   layers for it, and the blocks are freed. Whoever claims an id closes its transfer: the connector allows
   one waiter per transfer.

    kvrelay decode --model default --port 50062 --connector ucx
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from contextlib import aclosing, suppress

import grpc

from kvrelay.common import tracing, wire
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

_LEASE_MARGIN_S = 0.1


class DecodeServer(NodeServer):
    role = "decode"

    def __init__(self, *args, **kwargs) -> None:
        self._expected: dict[str, float] = {}  # request id -> lease deadline (monotonic)
        self._transfer_ids: dict[str, str] = {}  # request id -> the transfer id its Reserve handed out
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)

    # -- reservations ---------------------------------------------------------------------------------
    @unary_rpc
    async def Reserve(self, request, context):  # noqa: N802 - gRPC method names
        rid = request.request_id
        require_request_id(rid)
        prompt, params = checked_prompt(request)
        lease_s = request.lease_ms / 1000 if request.lease_ms else self.settings.kv_lease_s
        wait_s = request.queue_timeout_ms / 1000

        tid = f"{rid}.{secrets.token_hex(16)}"

        def expect(res) -> None:  # engine thread: no layer can arrive before the blocks are named
            with self._lock:
                self._transfer_ids[rid] = tid
            self.connector.expect(tid, list(res.dst_block_ids))
            with self._lock:
                self._expected[rid] = res.deadline

        with self.span("node.reserve", request) as span:
            try:
                res = await self.engine.reserve(rid, prompt, params, lease_s, request.cache_salt,
                                                on_reserved=expect, wait_s=wait_s, lora_name=request.lora_name,
                                                images=wire.images_from_proto(request.images))
            except asyncio.CancelledError:
                # The caller left while the reservation waited: after the abort the engine runs (queued before
                # this), nothing may still expect its layers.
                self.engine.run_nowait(lambda core: self._forget_transfer(rid))
                raise
            if span is not None and res is not None:
                span.set_attributes({"kvrelay.cached_tokens": res.num_cached_tokens,
                                     "kvrelay.reserved_blocks": len(res.dst_block_ids)})
        if res is None:
            load = self.engine.load()
            need = self.connector.layout.blocks_for(len(prompt))
            waited = f" within {wait_s:g} s" if wait_s else ""
            raise RpcFailure(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"no room to reserve {rid!r}{waited}: the prompt needs up to {need} KV blocks, "
                             f"{load.free_kv_blocks} of {load.total_kv_blocks} are free", wire.NodeErrorKind.FULL)
        logger.debug("reserved %s: %d cached tokens, %d blocks to fill, lease %.1fs",
                     rid, res.num_cached_tokens, len(res.dst_block_ids), lease_s)
        expires_ms = int((time.time() + (res.deadline - time.monotonic())) * 1000)
        return wire.reserve_result_to_proto(wire.ReserveResult(
            request_id=rid, node_id=self.settings.node_id, kv_address=self.connector.address,
            num_cached_tokens=res.num_cached_tokens, dst_block_ids=res.dst_block_ids,
            layout=self.connector.layout, lease_expires_unix_ms=expires_ms, transfer_id=tid,
        ))

    def _claim(self, rid: str) -> float | None:
        """Take the reservation's transfer (its lease deadline), or None when someone else has."""
        with self._lock:
            return self._expected.pop(rid, None)

    def _tid(self, rid: str, forget: bool = False) -> str:
        with self._lock:
            return (self._transfer_ids.pop(rid, rid) if forget else self._transfer_ids.get(rid, rid))

    def _forget_transfer(self, rid: str) -> None:
        """Stop accepting layers for a reservation that will not be admitted: closed here, or abandoned when a
        Generate waits for them (its wait answers at once; nothing happens to a transfer already over)."""
        if self._claim(rid) is not None:
            self._close_transfer(rid)
        else:
            self.connector.abandon_received(self._tid(rid))

    def _close_transfer(self, rid: str) -> None:
        try:
            self.connector.wait_received(self._tid(rid, forget=True), 0)  # 0 s: answers at once, forgets it
        except TransferError:
            self.metrics.observe_transfer_failure("recv")

    def leases_expired(self, request_ids: list[str]) -> None:  # engine thread
        for rid in request_ids:
            self._forget_transfer(rid)

    def before_abort(self, request_id: str) -> None:
        self._forget_transfer(request_id)  # first, so that no layer lands in blocks about to be freed

    # -- hand-off -------------------------------------------------------------------------------------
    async def generate_handoff(self, request: pb.GenerateRequest, arrival: float, span=None):
        rid, handoff = request.request_id, request.handoff
        deadline = self._claim(rid)
        if deadline is None:
            raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION,
                             f"no reservation for {rid!r} on {self.settings.node_id} "
                             "(never made, expired, aborted, or already admitted)")
        waited = admitted = False
        try:
            if not 0 <= handoff.first_token_id < self.core.vocab_size:
                raise ValueError(f"first_token_id: {handoff.first_token_id} is outside the vocabulary "
                                 f"[0, {self.core.vocab_size})")
            waited = True  # the wait below closes the transfer whatever its outcome
            with tracing.span("kv_receive", span, {"kvrelay.connector": self.settings.connector_name}):
                await self._wait_kv(rid, deadline)
            logprobs = (wire.logprobs_from_proto(handoff.first_logprobs)
                        if handoff.HasField("first_logprobs") else None)
            try:
                async with aclosing(self.engine.admit_reserved(rid, handoff.first_token_id, logprobs, arrival)) as s:
                    async for out in s:
                        admitted = True
                        yield out
            except KeyError as e:
                raise RpcFailure(grpc.StatusCode.FAILED_PRECONDITION, str(e.args[0])) from None
        finally:
            if not admitted:  # a bad hand-off, a failed transfer, a client gone: free the blocks now
                if not waited:
                    self._close_transfer(rid)
                self.engine.abort_nowait(rid)

    async def _wait_kv(self, rid: str, deadline: float) -> None:
        # The KV may take as long as the lease allows (a Generate may come before the prefill is done), and
        # the wait must close the transfer before the lease frees the blocks a late layer would land in.
        timeout = max(0.0, deadline - time.monotonic() - _LEASE_MARGIN_S)
        waiting = self.blocking(self.connector.wait_received, self._tid(rid), timeout)
        try:
            result = await asyncio.shield(waiting)
        except asyncio.CancelledError:
            # The client left; the caller frees the blocks next. The wait (in a thread a cancel cannot stop)
            # must close the transfer first, or a late layer would land in blocks another request may own.
            self._forget_transfer(rid)
            with suppress(TransferError):
                await waiting  # answers at once now
            raise
        except TransferError as e:
            self.metrics.observe_transfer_failure("recv")
            raise transfer_failure(e, f"the KV of {rid!r} did not arrive") from None
        finally:
            if waiting.done():
                self._tid(rid, forget=True)
        self.metrics.observe_transfer("recv", result.nbytes, result.seconds)

