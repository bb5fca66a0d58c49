"""Run one sequence on the nodes a RouteDecision names, and clean up whatever way it ends.

Disaggregated: decode.Reserve (next decode node when one refuses) -> prefill.Prefill into the reserved
blocks -> decode.Generate(handoff). If the prefill or the transfer fails, the reservation is dropped and the
decode node prefills the sequence itself: a failed hand-off costs latency, never the request.
Local: decode.Generate without a hand-off (next decode node when one is down before any token).

A node that aborts the sequence itself (its shutdown timeout passed) ends the stream with a NodeFailure: the
client gets an error, not a truncated answer that looks finished.
Leaving the stream early (client gone, stop string, shutdown) aborts the sequence on every node that holds
it, from a task the cancellation cannot reach, so its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

from gateway.discovery import Discovery, Node
from gateway.errors import BadRequest, NoCapacity, NodeFailure
from gateway.node_client import EngineRequest, NodeClients, NodeRpcError
from gateway.router import RouteDecision, Router
from shared.wire import PrefillResult, ReserveResult, TokenChunk

logger = logging.getLogger(__name__)


@dataclass
class _Holders:
    """Nodes that may hold state for the sequence right now (to abort on an early exit)."""

    nodes: dict[str, tuple[Node, str]]
    trace: dict

    def add(self, node: Node, request_id: str) -> None:
        self.nodes[node.node_id] = (node, request_id)

    def remove(self, node: Node) -> None:
        self.nodes.pop(node.node_id, None)


class Dispatcher:
    def __init__(self, router: Router, clients: NodeClients, discovery: Discovery, metrics=None,
                 lease_ms: int = 0) -> None:
        self.router = router
        self.clients = clients
        self.discovery = discovery
        self.metrics = metrics
        self.lease_ms = lease_ms
        self._background: set[asyncio.Task] = set()

    async def stream(self, decision: RouteDecision, req: EngineRequest,
                     trace: dict | None = None) -> AsyncIterator[TokenChunk]:
        """The sequence's chunks; `trace` gets the nodes that actually served it ("prefill" None: local)."""
        holders = _Holders({}, trace if trace is not None else {})
        finished = False
        try:
            if decision.local_prefill:
                nodes = [decision.decode, *decision.decode_fallbacks]
                source = self._local(nodes, req, holders, decision.decode_cached_tokens)
            else:
                source = self._disaggregated(decision, req, holders)
            async with aclosing(source):
                async for chunk in source:
                    if chunk.finish_reason == "abort":  # the gateway never reads past its own aborts
                        finished = True  # nothing is left to abort: the node has dropped the sequence
                        raise NodeFailure("the node serving this request stopped before it finished "
                                          "(it was shut down); retry the request", code="node_stopped")
                    finished = bool(chunk.finish_reason)
                    yield chunk
                    if finished:
                        return
        finally:
            if not finished:
                self._abort_all(holders)

    # -------------------------------------------------------------------------------- disaggregated

    async def _disaggregated(self, decision: RouteDecision, req: EngineRequest,
                             holders: _Holders) -> AsyncIterator[TokenChunk]:
        decode, reservation = await self._reserve([decision.decode, *decision.decode_fallbacks], req, holders)
        prefill = decision.prefill
        result = await self._prefill(prefill, req, reservation, holders)
        if result is None:  # hand-off failed: the decode node computes the prompt itself
            holders.remove(decode)
            await self._abort(decode, req.request_id)
            local = replace(req, request_id=f"{req.request_id}.local")
            async with aclosing(self._local([decode], local, holders, reservation.num_cached_tokens)) as stream:
                async for chunk in stream:
                    yield chunk
            return
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

    async def _reserve(self, nodes: list[Node], req: EngineRequest, holders: _Holders) -> tuple[Node, ReserveResult]:
        refused = 0
        for node in nodes:
            holders.add(node, req.request_id)
            try:
                return node, await self.clients.get(node.address).reserve(req, self.lease_ms)
            except NodeRpcError as e:
                holders.remove(node)
                if e.bad_input:
                    raise BadRequest.from_value_error(ValueError(e.details)) from None
                if e.busy:
                    refused += 1
                    self._count("reservation_refusals")
                else:
                    self._node_failed(node, e)
        if refused:
            raise NoCapacity(f"every decode node refused the reservation ({refused} full); retry later")
        raise NoCapacity("no decode node could be reached; retry later")

    async def _prefill(self, node: Node, req: EngineRequest, reservation: ReserveResult,
                       holders: _Holders) -> PrefillResult | None:
        uncached = len(req.prompt_token_ids) - reservation.num_cached_tokens
        holders.add(node, req.request_id)
        try:
            with self.router.track_prefill(node.node_id, uncached), self._track(node):
                result = await self.clients.get(node.address).prefill(req, reservation)
        except NodeRpcError as e:
            if e.bad_input:
                raise BadRequest.from_value_error(ValueError(e.details)) from None
            logger.warning("prefill of %s on %s failed, decode node prefills it: %s", req.request_id,
                           node.node_id, e)
            self._count("transfer_failures")
            if not e.busy:
                self._node_failed(node, e)
            return None
        finally:
            holders.remove(node)
        if self.metrics is not None:
            self.metrics.observe_transfer(result.bytes_transferred, result.transfer_seconds)
        return result

    async def _continue(self, decode: Node, req: EngineRequest, handoff: PrefillResult) -> AsyncIterator[TokenChunk]:
        skip = 1  # the decode node streams from the handed-off token on; the caller already has it
        try:
            async with aclosing(self.clients.get(decode.address).generate(req, handoff)) as stream:
                async for chunk in stream:
                    if skip:
                        chunk, skip = _drop_first(chunk), 0
                        if not chunk.token_ids and not chunk.finish_reason:
                            continue
                    yield chunk
        except NodeRpcError as e:
            self._node_failed(decode, e)
            raise NodeFailure(f"decode node {decode.node_id} failed mid-stream: {e.details}") from None

    # ---------------------------------------------------------------------------------------- local

    async def _local(self, nodes: list[Node], req: EngineRequest, holders: _Holders,
                     cached: int = 0) -> AsyncIterator[TokenChunk]:
        """`cached`: the prompt tokens routing expects the node to hold (the rest is its prefill work)."""
        num_prompt = len(req.prompt_token_ids)
        for node in nodes:
            holders.add(node, req.request_id)
            started = False
            try:
                async with aclosing(self.clients.get(node.address).generate(req)) as stream:
                    with self._track(node):
                        with self.router.track_prefill(node.node_id, num_prompt - cached):
                            first = await anext(stream, None)
                        if first is None:
                            raise NodeFailure(f"decode node {node.node_id} ended the stream without output")
                        started = True
                        holders.trace.update(prefill=None, decode=node.node_id)
                        try:
                            yield first
                        finally:  # bookkeeping after the first token has gone out, not before
                            self._observe(local=True, num_prompt=num_prompt, num_cached=first.num_cached_tokens)
                        async for chunk in stream:
                            yield chunk
                return
            except NodeRpcError as e:
                holders.remove(node)
                if e.bad_input:
                    raise BadRequest.from_value_error(ValueError(e.details)) from None
                if e.busy and not started:
                    self._count("reservation_refusals")
                    continue
                self._node_failed(node, e)
                if started:
                    raise NodeFailure(f"decode node {node.node_id} failed mid-stream: {e.details}") from None
        raise NoCapacity("no decode node could take the request; retry later")

    # -------------------------------------------------------------------------------------- helpers

    def _track(self, node: Node) -> _Tracked:
        return _Tracked(self.router.track_sequence(node.node_id), self.metrics, node)

    def _observe(self, local: bool, num_prompt: int, num_cached: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_mode(local)
            self.metrics.observe_prefix(num_prompt, num_cached)

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).inc()

    def _node_failed(self, node: Node, err: Exception) -> None:
        self.discovery.mark_failed(node.node_id, err)
        if self.metrics is not None:
            self.metrics.node_failures.labels(node.node_id).inc()

    def _abort_all(self, holders: _Holders) -> None:
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


class _Tracked:
    """A sequence on a node: the router's in-flight count and the per-node gauge."""

    __slots__ = ("count", "metrics", "node")

    def __init__(self, count, metrics, node: Node) -> None:
        self.count, self.metrics, self.node = count, metrics, node

    def __enter__(self) -> _Tracked:
        self.count.__enter__()
        if self.metrics is not None:
            self.metrics.node_inflight(self.node.node_id, self.node.role, 1)
        return self

    def __exit__(self, *exc) -> None:
        self.count.__exit__()
        if self.metrics is not None:
            self.metrics.node_inflight(self.node.node_id, self.node.role, -1)


def _drop_first(chunk: TokenChunk) -> TokenChunk:
    return replace(chunk, token_ids=chunk.token_ids[1:], logprobs=chunk.logprobs[1:])
