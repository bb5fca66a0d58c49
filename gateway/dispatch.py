"""Run one sequence on the nodes a RouteDecision names, move it when a node fails, clean up however it ends.

An attempt, with a retry on every hop:
  disaggregated: decode.Reserve (queued on the node while its cache is full; next decode node when one is
  at its queue bound or fails) -> prefill.Prefill into the reserved blocks (next prefill node when one fails,
  each hand-off into a fresh reservation under a fresh transfer id, so a late layer of an abandoned hand-off
  can never land in a new one) -> decode.Generate(handoff). When no prefill node could do it, a live decode
  node prefills the sequence itself.
  local: decode.Generate without a hand-off (next decode node when one refuses or fails before any token).
A failed call from a node that did not answer makes discovery probe it (a dead or hung node leaves rotation
at once); a failure a live node reports (a KV transfer between two nodes) ejects nobody without a probe
of the peer. A node that refuses for capacity or still holds the id (ALREADY_EXISTS) is simply skipped.

Migration: when the node streaming a sequence fails (stream error, hung past the liveness probe, shut down
under it) or an attempt runs out of nodes, the sequence is routed again (the failed node excluded) and
re-dispatched as prompt + the tokens streamed so far, with `num_resumed_tokens` telling the engine which
prompt tokens are output: the seeded draw is keyed by absolute position and max_tokens, min_tokens, stop ids
and penalties count the earlier output, so greedy and seeded sequences continue with exactly the tokens
they would have produced. The client's stream just goes on. At most `migration_limit` times per sequence.

LoRA: a sequence keeps its adapter through every hop, retry and move; before a node is called with it, the
adapter is loaded there if the node lacks it (gateway.adapters), and a node that answers it does not hold the
adapter is skipped like a full one.

Deadline: a request's deadline bounds every call (gRPC deadlines, so a node aborts the sequence by itself
even if the gateway is gone); past it the sequence ends with RequestTimeout.
Leaving the stream early (client gone, stop string, shutdown) aborts the sequence on every node that holds
it, from a task the cancellation cannot reach, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

from kvrelay.common import tracing
from kvrelay.common.records import ImageInput
from kvrelay.common.wire import PrefillResult, ReserveResult, TokenChunk
from kvrelay.gateway.adapters import Adapters
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.discovery import Discovery, Node
from kvrelay.gateway.errors import BadRequest, ModelNotFound, NoCapacity, NodeFailure, Overloaded, RequestTimeout
from kvrelay.gateway.liveness import Liveness
from kvrelay.gateway.node_client import EngineRequest, NodeClients, NodeRpcError
from kvrelay.gateway.router import RouteDecision, Router
from kvrelay.gateway.sequence_state import Holders, SequenceAttempts, Tracked

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DispatchConfig:
    lease_ms: int = GatewayConfig.kv_lease_ms  # reservation lease asked of decode nodes (0: theirs)
    migration_limit: int = GatewayConfig.migration_limit  # re-dispatches of one sequence after node failures
    queue_timeout_s: float = GatewayConfig.queue_timeout  # how long a reservation may wait in a decode node's queue
    capacity_wait_s: float = GatewayConfig.capacity_wait  # how long a request waits for any decode node to be up


class Dispatcher:
    def __init__(self, router: Router, clients: NodeClients, discovery: Discovery, liveness: Liveness,
                 metrics=None, config: DispatchConfig | None = None, adapters: Adapters | None = None) -> None:
        self.router = router
        self.adapters = adapters
        self.clients = clients
        self.discovery = discovery
        self.liveness = liveness
        self.metrics = metrics
        self.config = config or DispatchConfig()
        self._background: set[asyncio.Task] = set()

    # ----------------------------------------------------------------------------------------- routing

    async def route(self, prompt: Sequence[int], cache_salt: str = "", deadline: float | None = None,
                    exclude: Collection[str] = (), failure: NodeFailure | None = None,
                    user: str | None = None, lora_name: str = "", images: Sequence[ImageInput] = ()) -> RouteDecision:
        """Route, waiting up to capacity_wait_s (and the deadline) for a decode node to be up. Without one:
        `failure` when re-dispatching after it, else NoCapacity."""
        wait_until = time.monotonic() + self.config.capacity_wait_s
        if deadline is not None:
            wait_until = min(wait_until, deadline)
        while True:
            try:
                return await self.router.route(prompt, cache_salt, exclude, user, lora_name, images)
            except NoCapacity as e:
                if time.monotonic() >= wait_until:
                    if deadline is not None and time.monotonic() >= deadline:
                        raise self._timeout() from None
                    raise failure or e from None
            exclude = ()  # the breakers keep dead nodes out; a node that failed once may be back
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------------------------------ stream

    async def stream(self, decision: RouteDecision, req: EngineRequest,
                     trace: dict | None = None) -> AsyncIterator[TokenChunk]:
        """The sequence's chunks; `trace` gets the nodes that actually served it ("prefill" None: local)."""
        seq = SequenceAttempts(req, trace if trace is not None else {})
        while True:
            holders = Holders({}, seq.trace)
            finished = False
            try:
                async with aclosing(self._attempt(decision, seq.current, holders)) as source:
                    async for chunk in source:
                        if chunk.finish_reason == "abort":  # the gateway never reads past its own aborts
                            finished = True  # nothing is left to abort: the node has dropped the sequence
                            raise NodeFailure("the node serving this request stopped before it finished "
                                              "(it was shut down); retry the request", code="node_stopped",
                                              node_id=seq.trace.get("decode"))
                        finished = bool(chunk.finish_reason)
                        yield seq.observe(chunk)
                        if finished:
                            return
                raise NodeFailure("the node ended the stream without finishing it", node_id=seq.trace.get("decode"))
            except NodeFailure as e:
                failure = e
            finally:
                if not finished:
                    self._abort_all(holders)
            decision = await self._redispatch(seq, failure)

    async def _redispatch(self, seq: SequenceAttempts, failure: NodeFailure) -> RouteDecision:
        if seq.current.expired():
            raise self._timeout()
        if seq.moves >= self.config.migration_limit:
            logger.warning("%s: not moved again after %d moves: %s", seq.original.request_id, seq.moves,
                           failure.message)
            raise seq.cause or failure
        stage = "mid_stream" if seq.generated else "before_first_token"
        tracing.end(tracing.start_span("migrate", seq.current.span, {
            "kvrelay.migration.stage": stage, "kvrelay.migration.tokens_streamed": len(seq.generated),
            "kvrelay.migration.failed_node": failure.node_id, "kvrelay.migration.reason": failure.message}))
        seq.move(failure)
        logger.warning("migrating %s (%s, %d tokens streamed) to %s: %s", seq.original.request_id, stage,
                       len(seq.generated), seq.current.request_id, failure.message)
        if self.metrics is not None:
            self.metrics.migrations.labels(stage).inc()
        req = seq.current
        return await self.route(req.prompt_token_ids, req.cache_salt, req.deadline, seq.failed, seq.cause,
                                lora_name=req.lora_name, images=req.images)

    def _attempt(self, decision: RouteDecision, req: EngineRequest, holders: Holders) -> AsyncIterator[TokenChunk]:
        if decision.local_prefill or req.params.pooling is not None:  # a pooling request: where its prompt ends
            return self._local([decision.decode, *decision.decode_fallbacks], req, holders,
                               decision.decode_cached_tokens)
        return self._disaggregated(decision, req, holders)

    # -------------------------------------------------------------------------------- disaggregated

    async def _disaggregated(self, decision: RouteDecision, req: EngineRequest,
                             holders: Holders) -> AsyncIterator[TokenChunk]:
        decodes = [decision.decode, *decision.decode_fallbacks]
        hop = req
        result: PrefillResult | None = None
        for i, prefill in enumerate([decision.prefill, *decision.prefill_fallbacks]):
            decode, reservation = await self._reserve(decodes, hop, holders)
            result = await self._prefill(prefill, decode, hop, reservation, holders)
            if result is not None:
                break
            holders.remove(decode)  # the hand-off failed: free its reservation; the next gets a fresh one
            self._spawn(self._abort(decode, hop.request_id))
            decodes = [d for d in decodes if d.node_id != decode.node_id or self._routable(d)]
            if not decodes:
                raise NodeFailure("every decode node failed during the hand-off")
            hop = replace(req, request_id=f"{req.request_id}.h{i + 1}")
        if result is None:  # no prefill node could do it: a live decode node prefills the sequence itself
            self._count_retry("local")
            async with aclosing(self._local(decodes, hop, holders)) as stream:
                async for chunk in stream:
                    yield chunk
            return
        async with aclosing(self._handed_off(decode, prefill, hop, result, holders)) as stream:
            async for chunk in stream:
                yield chunk

    async def _handed_off(self, decode: Node, prefill: Node, req: EngineRequest, result: PrefillResult,
                          holders: Holders) -> AsyncIterator[TokenChunk]:
        holders.trace.update(prefill=prefill.node_id, decode=decode.node_id)
        first = TokenChunk((result.first_token_id,),
                           (result.first_logprobs,) if result.first_logprobs is not None else (),
                           finish_reason=result.finish_reason, num_prompt_tokens=len(req.prompt_token_ids),
                           num_output_tokens=1, num_cached_tokens=result.num_cached_tokens,
                           prompt_logprobs=result.prompt_logprobs)
        if result.finish_reason:  # the first token ended it: the reservation is not needed
            holders.remove(decode)
            self._spawn(self._abort(decode, req.request_id))
        try:
            yield first
        finally:  # bookkeeping after the first token has gone out, not before
            self._observe(local=False, num_prompt=len(req.prompt_token_ids), num_cached=result.num_cached_tokens)
        if result.finish_reason:
            return
        with self._track(decode):
            async with aclosing(self._continue(decode, req, result)) as stream:
                async for chunk in stream:
                    yield chunk

    async def _reserve(self, nodes: list[Node], req: EngineRequest, holders: Holders) -> tuple[Node, ReserveResult]:
        refused = timed_out = 0
        last: NodeRpcError | None = None
        for node in nodes:
            holders.add(node, req.request_id)
            start = time.monotonic()
            try:  # tracked while queued too, so that a burst spreads over the decode nodes
                await self._ensure_adapter(node, req)
                with self.liveness.watch(node) as watch, self._track(node), \
                        tracing.span("reserve", req.span, {"kvrelay.node_id": node.node_id}) as span:
                    res = await self.clients.get(node.address).reserve(
                        _hop(req, span), self.config.lease_ms, self.config.queue_timeout_s, watch)
                    if span is not None:
                        span.set_attribute("kvrelay.cached_tokens", res.num_cached_tokens)
            except NodeRpcError as e:
                holders.remove(node)
                self._hop_failed(node, e, req, "reserve")
                if e.busy:
                    waited = time.monotonic() - start >= 0.9 * self.config.queue_timeout_s
                    timed_out, refused = timed_out + waited, refused + (not waited)
                last = e
                continue
            self.discovery.record_success(node.node_id)
            return node, res
        raise self._exhausted("decode", refused, timed_out, last)

    async def _prefill(self, node: Node, decode: Node, req: EngineRequest, reservation: ReserveResult,
                       holders: Holders) -> PrefillResult | None:
        """The hand-off's result, or None when it failed for a reason another node may not have."""
        uncached = len(req.prompt_token_ids) - reservation.num_cached_tokens
        holders.add(node, req.request_id)
        try:
            await self._ensure_adapter(node, req)
            with self.router.track_prefill(node.node_id, uncached), self._track(node), \
                    self.liveness.watch(node) as watch, \
                    tracing.span("prefill", req.span, {"kvrelay.node_id": node.node_id,
                                                       "kvrelay.decode_node_id": decode.node_id,
                                                       "kvrelay.uncached_tokens": uncached}) as span:
                result = await self.clients.get(node.address).prefill(_hop(req, span), reservation, watch)
                if span is not None:
                    span.set_attributes({"kvrelay.kv_transfer.bytes": result.bytes_transferred,
                                         "kvrelay.kv_transfer.seconds": result.transfer_seconds})
        except NodeRpcError as e:
            logger.warning("prefill of %s on %s failed, trying the next node: %s", req.request_id, node.node_id, e)
            self._count("transfer_failures")
            if e.handoff_failed:
                # The prefill node is fine and says the transfer failed: blame the decode node only if it
                # does not answer a probe either.
                await self.discovery.probe(decode)
            else:
                self._hop_failed(node, e, req, "prefill")
            return None
        finally:
            holders.remove(node)
        self.discovery.record_success(node.node_id)
        if self.metrics is not None:
            self.metrics.observe_transfer(result.bytes_transferred, result.transfer_seconds)
        return result

    async def _continue(self, decode: Node, req: EngineRequest, handoff: PrefillResult) -> AsyncIterator[TokenChunk]:
        skip = 1  # the decode node streams from the handed-off token on; the caller already has it
        try:
            with self.liveness.watch(decode) as watch, \
                    tracing.span("decode", req.span, {"kvrelay.node_id": decode.node_id}) as span:
                client = self.clients.get(decode.address)
                async with aclosing(client.generate(_hop(req, span), handoff, watch)) as stream:
                    async for chunk in stream:
                        if skip:
                            chunk, skip = _drop_first(chunk), 0
                            if not chunk.token_ids and not chunk.finish_reason:
                                continue
                        yield chunk
        except NodeRpcError as e:
            raise self._stream_failed(decode, e, req) from None
        self.discovery.record_success(decode.node_id)

    # ---------------------------------------------------------------------------------------- local

    async def _local(self, nodes: list[Node], req: EngineRequest, holders: Holders,
                     cached: int = 0) -> AsyncIterator[TokenChunk]:
        """`cached`: the prompt tokens routing expects the node to hold (the rest is its prefill work)."""
        num_prompt = len(req.prompt_token_ids)
        refused = 0
        last: NodeRpcError | None = None
        for node in nodes:
            holders.add(node, req.request_id)
            started = False
            try:
                await self._ensure_adapter(node, req)
                with self.liveness.watch(node) as watch, self._track(node), \
                        tracing.span("decode", req.span, {"kvrelay.node_id": node.node_id,
                                                          "kvrelay.local_prefill": True}) as span:
                    client = self.clients.get(node.address)
                    async with aclosing(client.generate(_hop(req, span), watch=watch)) as stream:
                        with self.router.track_prefill(node.node_id, num_prompt - cached):
                            first = await anext(stream, None)
                        if first is None:
                            raise NodeFailure(f"decode node {node.node_id} ended the stream without output",
                                              node_id=node.node_id)
                        started = True
                        holders.trace.update(prefill=None, decode=node.node_id)
                        try:
                            yield first
                        finally:  # bookkeeping after the first token has gone out, not before
                            self._observe(local=True, num_prompt=num_prompt, num_cached=first.num_cached_tokens)
                        async for chunk in stream:
                            yield chunk
                self.discovery.record_success(node.node_id)
                return
            except NodeRpcError as e:
                holders.remove(node)
                if started:
                    raise self._stream_failed(node, e, req) from None
                self._hop_failed(node, e, req, "local")
                refused += e.busy
                last = e
        raise self._exhausted("decode", refused, 0, last)

    # -------------------------------------------------------------------------------------- failures

    def _hop_failed(self, node: Node, e: NodeRpcError, req: EngineRequest, hop: str) -> None:
        """A call before any output failed: raise if the request cannot go on, else note it and move on."""
        if e.bad_input and not e.method.endswith("LoRAAdapter"):
            raise BadRequest.from_value_error(ValueError(e.details)) from None
        if req.expired():
            raise self._timeout() from None
        self._count_retry(hop)
        if e.busy or e.duplicate or e.draining or e.missing or e.method.endswith("LoRAAdapter"):
            if e.busy:
                self._count("reservation_refusals")
            return  # the node is fine; it just cannot take this one
        self._node_failed(node, e)

    def _stream_failed(self, node: Node, e: NodeRpcError, req: EngineRequest) -> Exception:
        if req.expired():
            return self._timeout()
        if not e.draining:
            self._node_failed(node, e)
        return NodeFailure(f"decode node {node.node_id} failed mid-stream: {e.details or e.code.name}",
                           node_id=node.node_id)

    def _exhausted(self, role: str, refused: int, timed_out: int, last: NodeRpcError | None) -> Exception:
        if refused:
            return Overloaded(f"every {role} node that could take the request is at its queue bound "
                              f"({refused} refused); retry later")
        if timed_out:
            return NoCapacity(f"no {role} node had room for the request within "
                              f"{self.config.queue_timeout_s:g}s; retry later")
        if last is not None and last.missing:
            return ModelNotFound(last.details, param="model")
        detail = f": {last.details or last.code.name}" if last is not None else ""
        return NodeFailure(f"no {role} node could take the request{detail}")

    def _node_failed(self, node: Node, e: NodeRpcError) -> None:
        self.discovery.record_failure(node, e, answered=e.answered)
        if self.metrics is not None:
            self.metrics.node_failures.labels(node.node_id).inc()

    async def _ensure_adapter(self, node: Node, req: EngineRequest) -> None:
        if req.lora_name and self.adapters is not None:
            await self.adapters.ensure(node, req.lora_name)

    def _routable(self, node: Node) -> bool:
        return any(n.node_id == node.node_id for n in self.discovery.routable(node.role))

    def _timeout(self) -> RequestTimeout:
        if self.metrics is not None:
            self.metrics.request_timeouts.inc()
        return RequestTimeout("the request passed its deadline (--request-timeout) and was aborted")

    # -------------------------------------------------------------------------------------- helpers

    def _track(self, node: Node) -> Tracked:
        return Tracked(self.router.track_sequence(node.node_id), self.metrics, node)

    def _observe(self, local: bool, num_prompt: int, num_cached: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_mode(local)
            self.metrics.observe_prefix(num_prompt, num_cached)

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).inc()

    def _count_retry(self, hop: str) -> None:
        if self.metrics is not None:
            self.metrics.retries.labels(hop).inc()

    def _abort_all(self, holders: Holders) -> None:
        for node, request_id in list(holders.nodes.values()):
            self._spawn(self._abort(node, request_id))
        holders.nodes.clear()

    def _spawn(self, coro) -> None:
        # Held in a set: the event loop keeps only weak references to tasks.
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort(self, node: Node, request_id: str) -> None:
        try:
            await self.clients.get(node.address).abort(request_id)
        except NodeRpcError as e:
            logger.debug("abort of %s on %s: %s", request_id, node.node_id, e)

    async def drain(self, timeout_s: float) -> None:
        """Let the abort calls already sent finish (shutdown)."""
        if self._background:
            await asyncio.wait(list(self._background), timeout=timeout_s)


def _drop_first(chunk: TokenChunk) -> TokenChunk:
    return replace(chunk, token_ids=chunk.token_ids[1:], logprobs=chunk.logprobs[1:])


def _hop(req: EngineRequest, span) -> EngineRequest:
    """The request as one node call sends it: with that call's span as the node's parent."""
    return req if span is None else replace(req, traceparent=tracing.traceparent(span))
