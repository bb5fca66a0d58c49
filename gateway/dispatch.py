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

Hand-over between gateways: a keyed request's sequence runs with keep_s, so its node keeps it when this gateway
dies, and each time a node's token stream of it starts, `placed` gets its Placement (gateway.shared_answers
stores it in Redis). Another gateway calls stream() with that Placement as `resume`: it yields the chunks the
client had, then follows the node's record of the sequence (Attach), and goes on as the first gateway would
have, moves included.

Deadline: a request's deadline bounds every call (gRPC deadlines, so a node aborts the sequence by itself
even if the gateway is gone); past it the sequence ends with RequestTimeout.
Leaving the stream early (client gone, stop string, shutdown) aborts the sequence on every node that holds
it, from a task the cancellation cannot reach, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace

from kvrelay.common import tracing
from kvrelay.common.records import ImageInput
from kvrelay.common.wire import PrefillResult, ReserveResult, TokenChunk
from kvrelay.gateway.adapters import Adapters
from kvrelay.gateway.config import GatewayConfig
from kvrelay.gateway.discovery import Discovery, Node
from kvrelay.gateway.dispatch_outcomes import Outcomes
from kvrelay.gateway.errors import NoCapacity, NodeFailure, RunGone
from kvrelay.gateway.liveness import Liveness
from kvrelay.gateway.node_client import EngineRequest, NodeClients, NodeRpcError
from kvrelay.gateway.router import RouteDecision, Router
from kvrelay.gateway.sequence_state import Holders, Placement, SequenceAttempts, Tracked

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
        self.outcomes = Outcomes(discovery, metrics, self.config.queue_timeout_s)
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
                        raise self.outcomes.timeout() from None
                    raise failure or e from None
            exclude = ()  # the breakers keep dead nodes out; a node that failed once may be back
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------------------------------ stream

    async def stream(self, decision: RouteDecision | None, req: EngineRequest, trace: dict | None = None, *,
                     resume: Placement | None = None, exact: bool = False,
                     placed: Callable[[Placement], None] | None = None) -> AsyncIterator[TokenChunk]:
        """The sequence's chunks; `trace` gets the nodes that actually served it ("prefill" None: local).
        `resume`: go on with a sequence another gateway ran (no `decision` needed); RunGone when its node no
        longer keeps it. `exact`: the client already has part of its output (a stream resumed after an event),
        so a move, which computes the output past the recorded prefix again, is refused (RunGone) unless the
        sampling repeats itself (greedy or seeded). `placed`: told where each node's stream of the sequence
        starts."""
        seq = SequenceAttempts(req, trace if trace is not None else {}, keep_chunks=placed is not None)
        exact = exact and resume is not None and not (req.params.greedy or req.params.seed is not None)
        if resume is not None:
            seq.resume(resume)
            for chunk in resume.prefix:
                yield chunk
        on_node = (lambda node, rid, skip: placed(seq.placement(node, rid, skip))) if placed is not None else None
        while True:
            holders = Holders({}, seq.trace, on_node)
            finished = False
            attempt = (self._attach(resume, seq.current, holders) if resume is not None
                       else self._attempt(decision, seq.current, holders))
            resume = None
            try:
                async with aclosing(attempt) as source:
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
            if exact:
                raise RunGone(f"{req.request_id!r}: {failure.message}; its sampling is not seeded, so the output "
                              "its client already has cannot be computed again: send the request anew",
                              param="Last-Event-ID") from None
            decision = await self._redispatch(seq, failure)

    async def _redispatch(self, seq: SequenceAttempts, failure: NodeFailure) -> RouteDecision:
        if seq.current.expired():
            raise self.outcomes.timeout()
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
            self.outcomes.count_retry("local")
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
            self.outcomes.observe(local=False, num_prompt=len(req.prompt_token_ids),
                                  num_cached=result.num_cached_tokens)
        if result.finish_reason:
            return
        holders.placed(decode, req.request_id, True)
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
                self.outcomes.hop_failed(node, e, req, "reserve")
                if e.busy:
                    waited = time.monotonic() - start >= 0.9 * self.config.queue_timeout_s
                    timed_out, refused = timed_out + waited, refused + (not waited)
                last = e
                continue
            self.discovery.record_success(node.node_id)
            return node, res
        raise self.outcomes.exhausted("decode", refused, timed_out, last)

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
            self.outcomes.count("transfer_failures")
            if e.handoff_failed:
                # The prefill node is fine and says the transfer failed: blame the decode node only if it
                # does not answer a probe either.
                await self.discovery.probe(decode)
            else:
                self.outcomes.hop_failed(node, e, req, "prefill")
            return None
        finally:
            holders.remove(node)
        self.discovery.record_success(node.node_id)
        if self.metrics is not None:
            self.metrics.observe_transfer(result.bytes_transferred, result.transfer_seconds)
        return result

    async def _continue(self, decode: Node, req: EngineRequest, handoff: PrefillResult) -> AsyncIterator[TokenChunk]:
        try:
            with self.liveness.watch(decode) as watch, \
                    tracing.span("decode", req.span, {"kvrelay.node_id": decode.node_id}) as span:
                client = self.clients.get(decode.address)
                # The decode node streams from the handed-off token on; the caller already has it.
                async with aclosing(_skip_first(client.generate(_hop(req, span), handoff, watch))) as stream:
                    async for chunk in stream:
                        yield chunk
        except NodeRpcError as e:
            raise self.outcomes.stream_failed(decode, e, req) from None
        self.discovery.record_success(decode.node_id)

    async def _attach(self, place: Placement, req: EngineRequest, holders: Holders) -> AsyncIterator[TokenChunk]:
        """The rest of a sequence another gateway ran: the node's record of it, less what the client had."""
        node = next((n for n in self.discovery.nodes() if n.node_id == place.node_id), None)
        if node is None:
            raise NodeFailure(f"decode node {place.node_id}, which ran the request, is not among this gateway's "
                              "nodes", node_id=place.node_id)
        holders.add(node, req.request_id)
        holders.trace.update(prefill=place.prefill_node_id, decode=node.node_id)
        try:
            with self.liveness.watch(node) as watch, self._track(node), \
                    tracing.span("attach", req.span, {"kvrelay.node_id": node.node_id}):
                stream = self.clients.get(node.address).attach(req, 0, watch)
                if place.skip_first:
                    stream = _skip_first(stream)
                async with aclosing(stream):
                    async for chunk in stream:
                        yield chunk
        except NodeRpcError as e:
            if e.missing:
                holders.remove(node)
                raise RunGone(f"{place.request_id!r}: decode node {node.node_id} no longer keeps this request "
                              "(it ended or was aborted long enough ago); send it anew without Last-Event-ID",
                              param="Last-Event-ID") from None
            raise self.outcomes.stream_failed(node, e, req) from None
        self.discovery.record_success(node.node_id)

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
                    holders.placed(node, req.request_id, False)
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
                            self.outcomes.observe(local=True, num_prompt=num_prompt, num_cached=first.num_cached_tokens)
                        async for chunk in stream:
                            yield chunk
                self.discovery.record_success(node.node_id)
                return
            except NodeRpcError as e:
                holders.remove(node)
                if started:
                    raise self.outcomes.stream_failed(node, e, req) from None
                self.outcomes.hop_failed(node, e, req, "local")
                refused += e.busy
                last = e
        raise self.outcomes.exhausted("decode", refused, 0, last)

    # -------------------------------------------------------------------------------------- helpers

    async def _ensure_adapter(self, node: Node, req: EngineRequest) -> None:
        if req.lora_name and self.adapters is not None:
            await self.adapters.ensure(node, req.lora_name)

    def _routable(self, node: Node) -> bool:
        return any(n.node_id == node.node_id for n in self.discovery.routable(node.role))

    def _track(self, node: Node) -> Tracked:
        return Tracked(self.router.track_sequence(node.node_id), self.metrics, node)

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


async def _skip_first(stream: AsyncIterator[TokenChunk]) -> AsyncIterator[TokenChunk]:
    """A hand-off's decode stream without its first token (the prefill node's, which the caller has)."""
    first = True
    async with aclosing(stream):
        async for chunk in stream:
            if first:
                first = False
                chunk = replace(chunk, token_ids=chunk.token_ids[1:], logprobs=chunk.logprobs[1:])
                if not chunk.token_ids and not chunk.finish_reason:
                    continue
            yield chunk


def _hop(req: EngineRequest, span) -> EngineRequest:
    """The request as one node call sends it: with that call's span as the node's parent."""
    return req if span is None else replace(req, traceparent=tracing.traceparent(span))
