"""A request's way through the simulated fleet, as `gateway/dispatch.py` takes it through the real one.

  local (the decode node prefills: few tokens to compute, no prefill node, or a colocated fleet): the node
      queues it (the next ranked node when one is at its waiting bound) and streams its tokens.
  disaggregated: Reserve on the decode node (queued there while its cache is full; the next decode node when
      one is at its bound) -> Prefill on the prefill node into the reserved blocks (the next prefill node when
      one is at its bound; none left: a decode node prefills it itself) -> the prefill step that completes the
      prompt starts the KV transfer and samples the first token -> when the transfer is done the client has
      its first token, the prefill node frees its held blocks and the decode node admits the request
      (`admit_reserved`) and decodes the rest.

The gateway's in-flight counts (`Router.track_sequence`, `track_prefill`) are held over the same spans as in
the real dispatch, so the router sees its own load as it would. Every engine call is the production one; what
is simulated is time: steps (the node's step model), transfers (the profile's transfer model) and one
gateway-node hop (`hop_s`) per call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.request import KVSendSpec, Request, RequestStatus
from kvrelay.engine.reservation_queue import QueueFull
from kvrelay.engine.scheduler_output import EngineCoreOutput, KVSend, Reservation
from kvrelay.gateway.errors import NoCapacity
from kvrelay.sim.node import SimNode

if TYPE_CHECKING:
    from kvrelay.gateway.discovery import Node
    from kvrelay.sim.events import EventLoop
    from kvrelay.sim.gateway import SimGateway


class FleetView(Protocol):
    """What a request's way needs of the fleet (kvrelay.sim.fleet.Fleet)."""

    loop: EventLoop
    spec: object  # FleetSpec: hop_s, queue_timeout_s, capacity_wait_s, max_concurrent_requests
    nodes: dict[str, SimNode]
    block_size: int
    max_model_len: int

    def publish(self, node: SimNode, events: list, entry_id: str | None = None) -> None: ...

    def cached_anywhere(self, hashes: Sequence[bytes], num_tokens: int) -> int: ...

    def transfer_s(self, num_blocks: int, step_s: float) -> float: ...


class SimRequest:
    """One trace request, as the client and the gateway see it."""

    __slots__ = ("index", "prompt", "output", "params", "arrival_s", "user", "tenant", "gateway", "first_token_s",
                 "last_token_s", "finish_s", "num_tokens", "cached_tokens", "cached_anywhere", "outcome", "tracks",
                 "first_token", "retry_until", "decodes", "prefills", "decode_node", "prefill_node")

    def __init__(self, index: int, prompt: list[int], output: list[int], arrival_s: float, user: str | None,
                 tenant: str | None = None):
        self.index, self.prompt, self.output, self.arrival_s, self.user = index, prompt, output, arrival_s, user
        self.tenant = tenant
        self.params = SamplingParams(max_tokens=len(output), ignore_eos=True)
        self.gateway: SimGateway | None = None
        self.first_token_s = self.last_token_s = self.finish_s = -1.0
        self.num_tokens = 0
        self.cached_tokens = self.cached_anywhere = 0
        self.outcome = ""  # "" while in flight, "ok", or why it failed
        self.tracks: dict[str, object] = {}  # the router's in-flight counts this request holds, by span
        self.first_token = 0
        self.retry_until = 0.0
        self.decodes: list[Node] = []
        self.prefills: list[Node] = []
        self.decode_node: SimNode | None = None
        self.prefill_node: SimNode | None = None

    @property
    def rid(self) -> str:
        return f"r{self.index}"

    @property
    def computed_on(self) -> str | None:
        """The node that computed its prompt."""
        node = self.prefill_node or self.decode_node
        return node.node_id if node is not None else None


class Dispatcher:
    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet
        self.loop = fleet.loop
        self.by_rid: dict[str, SimRequest] = {}
        self.itl: list[float] = []
        self.failures: dict[str, int] = {}
        self.on_done = None  # callable(SimRequest): the fleet's bookkeeping
        self.log: list[tuple[float, str, str]] | None = None  # a list: every token and end, (time, request, what)

    # -- spans of the router's in-flight counts ---------------------------------------------------------

    @staticmethod
    def _queue(sim, engine_req: Request) -> bool:
        """Queue a request on a node's scheduler, as the node's Generate/Prefill does; False at its waiting bound."""
        try:
            sim.scheduler.check_room_to_wait(1)
            sim.scheduler.add_request(engine_req)
        except QueueFull:
            return False
        return True

    def _hold(self, req: SimRequest, span: str, count) -> None:
        count.__enter__()
        req.tracks[span] = count

    def _release(self, req: SimRequest, span: str) -> None:
        count = req.tracks.pop(span, None)
        if count is not None:
            count.__exit__(None, None, None)

    # -- arrival and routing ----------------------------------------------------------------------------

    def arrive(self, req: SimRequest, gateway: SimGateway) -> None:
        cfg = self.fleet.spec
        if cfg.max_concurrent_requests and gateway.inflight >= cfg.max_concurrent_requests:
            self._fail(req, "gateway_full")
            return
        req.gateway = gateway
        gateway.inflight += 1
        self.by_rid[req.rid] = req
        req.retry_until = self.loop.now + cfg.capacity_wait_s
        self._route(req)

    def _route(self, req: SimRequest) -> None:
        if len(req.prompt) + 1 > self.fleet.max_model_len:
            self._fail(req, "too_long")
            return
        try:
            decision, hashes = req.gateway.route(req.prompt, self.loop.now, req.user)
        except NoCapacity:
            if self.loop.now >= req.retry_until:
                self._fail(req, "no_capacity")
            else:
                self.loop.after(0.1, self._route, req)
            return
        req.cached_anywhere = self.fleet.cached_anywhere(hashes, len(req.prompt))
        req.decodes = [decision.decode, *decision.decode_fallbacks]
        req.prefills = [] if decision.prefill is None else [decision.prefill, *decision.prefill_fallbacks]
        if decision.local_prefill:
            self.loop.after(self.fleet.spec.hop_s, self._local, req, decision.decode_cached_tokens)
        else:
            self.loop.after(self.fleet.spec.hop_s, self._reserve, req)

    # -- local: the decode node prefills ----------------------------------------------------------------

    def _local(self, req: SimRequest, expected_cached: int) -> None:
        for node in req.decodes:
            sim = self.fleet.nodes.get(node.node_id)
            if sim is None or sim.draining:
                continue
            if not self._queue(sim, Request(req.rid, req.prompt, req.params, None, self.loop.now)):
                continue
            router = req.gateway.router
            self._hold(req, "sequence", router.track_sequence(sim.node_id))
            self._hold(req, "prefill", router.track_prefill(sim.node_id, len(req.prompt) - expected_cached))
            req.decode_node = sim
            sim.answers[req.rid] = req.output
            sim.wake()
            return
        self._fail(req, "no_room")

    # -- disaggregated ----------------------------------------------------------------------------------

    def _reserve(self, req: SimRequest) -> None:
        now = self.loop.now
        for node in req.decodes:
            sim = self.fleet.nodes.get(node.node_id)
            if sim is None or sim.draining:
                continue
            engine_req = Request(req.rid, req.prompt, req.params, None, now)
            try:
                res = sim.scheduler.reserve(engine_req, sim.scheduler.config.kv_lease_s,
                                            queue_until=now + self.fleet.spec.queue_timeout_s)
            except QueueFull:
                continue
            self._hold(req, "sequence", req.gateway.router.track_sequence(sim.node_id))
            req.decode_node = sim
            sim.answers[req.rid] = req.output
            sim.flush_events()
            if res is not None:
                self.loop.after(self.fleet.spec.hop_s, self._prefill, req, res)
            return  # else queued: the node grants it after a step frees blocks (`_granted`)
        self._fail(req, "no_room")

    def _granted(self, node: SimNode) -> None:
        granted, expired = node.scheduler.admit_queued()
        node.flush_events()
        for res in granted:
            self.loop.after(self.fleet.spec.hop_s, self._prefill, self.by_rid[res.req_id], res)
        for rid in expired:
            self._fail(self.by_rid[rid], "queue_timeout")

    def _prefill(self, req: SimRequest, res: Reservation) -> None:
        bs = self.fleet.block_size
        spec = KVSendSpec(req.decode_node.node_id, req.rid, res.num_cached_tokens // bs, res.dst_block_ids)
        for node in req.prefills:
            sim = self.fleet.nodes.get(node.node_id)
            if sim is None or sim.draining:
                continue
            engine_req = Request(req.rid, req.prompt, req.params, None, self.loop.now)
            engine_req.kv_send, engine_req.max_tokens = spec, 1
            if not self._queue(sim, engine_req):
                continue
            router = req.gateway.router
            self._hold(req, "prefill", router.track_prefill(sim.node_id, len(req.prompt) - res.num_cached_tokens))
            self._hold(req, "prefill_sequence", router.track_sequence(sim.node_id))
            req.prefill_node = sim
            sim.answers[req.rid] = req.output
            sim.wake()
            return
        # No prefill node could take it: the reservation goes, a decode node prefills it itself.
        req.decode_node.scheduler.finish_requests([req.rid], RequestStatus.FINISHED_ABORTED)
        req.decode_node.answers.pop(req.rid, None)
        self._release(req, "sequence")
        self._local(req, 0)

    def _handed_off(self, req: SimRequest, prefill: SimNode) -> None:
        """The KV is in the decode node's blocks: the first token reaches the client, the decode node goes on."""
        prefill.scheduler.release_held(req.rid)
        prefill.answers.pop(req.rid, None)
        prefill.wake()
        self._release(req, "prefill")
        self._release(req, "prefill_sequence")
        self._token(req, 1)
        decode = req.decode_node
        if len(req.output) == 1:
            decode.scheduler.finish_requests([req.rid], RequestStatus.FINISHED_ABORTED)
            self._done(req)
            return
        try:
            decode.scheduler.admit_reserved(req.rid, req.first_token)
        except KeyError:  # its lease ran out while the prefill queued
            self._fail(req, "lease_expired")
            return
        decode.flush_events()
        decode.wake()

    # -- what nodes report ------------------------------------------------------------------------------

    def on_step(self, node: SimNode, outputs: list[EngineCoreOutput], sends: tuple[KVSend, ...],
                expired: list[str]) -> None:
        if node.role == "prefill":
            by_rid = {s.req_id: s for s in sends}
            for out in outputs:
                req = self.by_rid.get(out.req_id)
                send = by_rid.get(out.req_id)
                if req is None or send is None:  # it failed meanwhile: nobody will read its blocks
                    node.scheduler.release_held(out.req_id)
                    continue
                req.first_token = out.new_token_ids[0]
                req.cached_tokens = out.num_cached_tokens
                delay = self.fleet.transfer_s(len(send.src_block_ids), node.last_step_s)
                self.loop.after(delay + self.fleet.spec.hop_s, self._handed_off, req, node)
        else:
            by_rid, itl = self.by_rid, self.itl
            now = self.loop.now + self.fleet.spec.hop_s
            for out in outputs:
                req = by_rid.get(out.req_id)
                if req is None or req.outcome:
                    continue
                n = len(out.new_token_ids)
                if req.num_tokens == 0:
                    req.cached_tokens = out.num_cached_tokens
                    self._release(req, "prefill")
                    self._token(req, n)
                elif n == 1 and self.log is None:  # the common case, inline: a decode row's one token
                    itl.append(now - req.last_token_s)
                    req.last_token_s = now
                    req.num_tokens += 1
                else:
                    self._token(req, n)
                if out.finish_reason is not None:
                    self._done(req)
            if len(node.handoff.queued):
                self._granted(node)
        for rid in expired:
            req = self.by_rid.get(rid)
            if req is not None and not req.outcome and node.role != "prefill":
                self._fail(req, "lease_expired")

    def on_block_events(self, node: SimNode, events: list, entry_id: str | None = None) -> None:
        self.fleet.publish(node, events, entry_id)

    # -- the client's side ------------------------------------------------------------------------------

    def _token(self, req: SimRequest, n: int) -> None:
        now = self.loop.now + self.fleet.spec.hop_s
        if self.log is not None:
            self.log.append((round(now, 9), req.rid, f"tokens {req.num_tokens + 1}-{req.num_tokens + n}"))
        if req.num_tokens == 0:
            req.first_token_s = now
        elif n == 1:
            self.itl.append(now - req.last_token_s)
        else:
            self.itl.extend([(now - req.last_token_s) / n] * n)
        req.last_token_s = now
        req.num_tokens += n

    def _done(self, req: SimRequest) -> None:
        req.outcome = "ok"
        req.finish_s = self.loop.now + self.fleet.spec.hop_s
        if self.log is not None:
            self.log.append((round(req.finish_s, 9), req.rid, "done"))
        self._end(req)

    def _fail(self, req: SimRequest, why: str) -> None:
        if req.outcome:
            return
        req.outcome = why
        self.failures[why] = self.failures.get(why, 0) + 1
        for sim in (req.decode_node, req.prefill_node):
            if sim is not None:
                sim.scheduler.finish_requests([req.rid], RequestStatus.FINISHED_ABORTED)
                sim.scheduler.release_held(req.rid)
        self._end(req)

    def _end(self, req: SimRequest) -> None:
        for sim in (req.decode_node, req.prefill_node):
            if sim is not None:
                sim.answers.pop(req.rid, None)
        for span in list(req.tracks):
            self._release(req, span)
        if req.gateway is not None:
            req.gateway.inflight -= 1
        self.by_rid.pop(req.rid, None)
        self.on_done(req)
