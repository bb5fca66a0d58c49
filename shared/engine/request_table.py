"""Where each of the engine's requests is, and the moves between those places. The scheduler (scheduler.py)
extends it with the step: which requests run, how much of each, and what their results do.

Places:
- the waiting queue (fcfs, by (priority, arrival), or shortest prompt first with aging: request_queue.py),
  where a request whose grammar is still compiling (WAITING_FOR_GRAMMAR) keeps its place until
  `grammar_ready`;
- the running batch;
- for disaggregation (kv_handoff.py): blocks reserved for a prompt a prefill node computes, reservations
  queued for blocks, and the blocks of a finished request that a transfer may still read;
- beam groups (beam_search.py): their beams are requests that are admitted, preempted and end together.

Moves: admission (waiting -> running, prefix-cache hits counted as computed tokens), preemption (running ->
the front of the queue), a hand-off (reserved -> running, with the prefill node's first token), and the end
of a request from anywhere (`finish_requests`): its blocks are freed at once, or held while a transfer may
read them; the runner hears of it next step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvrelay.common.records import NodeLoad
from kvrelay.engine.beam_search import BeamGroup, BeamGroups
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.kv_cache_manager import NO_HIT, KVCacheManager, PrefixHit
from kvrelay.engine.kv_handoff import KVHandoff
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.request_queue import create_request_queue
from kvrelay.engine.reservation_queue import DuplicateRequest, QueuedReservation, QueueFull, ReservationQueue
from kvrelay.engine.scheduler_output import EngineCoreOutput, EngineCounters, Reservation


class RequestTable:
    """`handoff`: disaggregation's reservations and held blocks (default: its own)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 handoff: KVHandoff | None = None) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.handoff = handoff or KVHandoff(kv)
        self.requests: dict[str, Request] = {}  # every unfinished request, reservations included
        self.num_pooling = 0  # of them, pooling requests (embeddings, scores)
        self.waiting = create_request_queue(config)
        self.running: list[Request] = []
        self.beam_groups = BeamGroups()
        self.finished_req_ids: set[str] = set()  # since the last step, for the runner
        self.counters = EngineCounters()
        # Requests whose runner state must be (re)built from a NewRequestData when next scheduled: admitted
        # without a step (a hand-off), or whose block table changed other than by appending.
        self._unseen: set[str] = set()

    @property
    def queued(self) -> ReservationQueue:
        """Decode role: reservations waiting for blocks."""
        return self.handoff.queued

    @property
    def reserved(self) -> Mapping[str, float]:
        """Decode role: reservations awaiting their KV, by request id (their lease deadlines)."""
        return self.handoff.reserved

    # -- adding and ending ---------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self._check_new_id(req.request_id)
        self.requests[req.request_id] = req
        self.num_pooling += req.sampling_params.pooling is not None
        self.waiting.add(req)
        if self._uses_cache(req):
            self.kv.prefetch(req)

    def add_beam_group(self, group: BeamGroup, root: Request) -> None:
        """Queue a beam search: its root beam (the prompt), admitted with the rest of its group."""
        if group.group_id in self.beam_groups or {group.group_id, root.request_id} & self.requests.keys():
            raise ValueError(f"request_id: {group.group_id!r} is already in use")
        self.beam_groups.add(group, root)
        self.add_request(root)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.handoff.queued:
            raise DuplicateRequest(f"request_id: {request_id!r} is already in use")

    def check_room_to_wait(self, n: int = 1) -> None:
        """QueueFull when n more waiting requests would pass max_waiting_requests (0: no bound)."""
        limit = self.config.max_waiting_requests
        waiting = len(self.waiting) + len(self.handoff.queued)
        if limit and waiting + n > limit:
            raise QueueFull(f"{waiting} requests are already waiting on this node (max_waiting_requests {limit}); "
                            "retry later")

    def grammar_ready(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            req.status = RequestStatus.WAITING

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise end) requests wherever they are; unknown ids are ignored."""
        done = []
        for rid in request_ids:
            queued = self.handoff.queued.remove(rid)
            if queued is not None:  # still waiting for blocks: nothing to free
                queued.req.status = status
                done.append(queued.req)
                continue
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_KV:
                self.handoff.end_reservation(rid)
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def abort_beam_groups(self, group_ids: Iterable[str]) -> list[str]:
        """End the beam searches of these ids (every beam); returns the ids that were searches."""
        done = []
        for gid in group_ids:
            group = self.beam_groups.get(gid)
            if group is not None:
                self.finish_requests([m.request_id for m in group.members()], RequestStatus.FINISHED_ABORTED)
                done.append(gid)
        return done

    def _end_running(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.running.remove(req)
        self._free(req)

    def _free(self, req: Request) -> None:
        others = self.beam_groups.end_with(req)
        if others:
            self.finish_requests(others, RequestStatus.FINISHED_ABORTED)
        if req.kv_send_started:
            self.handoff.hold(req, self.config.kv_lease_s)
        else:
            self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        self._unseen.discard(req.request_id)
        del self.requests[req.request_id]
        self.num_pooling -= req.sampling_params.pooling is not None

    # -- admission and preemption --------------------------------------------------------------------

    def _lookup(self, req: Request) -> PrefixHit:
        return self.kv.get_computed_blocks(req) if self._uses_cache(req) else NO_HIT

    @staticmethod
    def _uses_cache(req: Request) -> bool:
        # Prompt logprobs, and a mean or first-token pooling, need every prompt position computed: such a prompt
        # never starts from the cache.
        params = req.sampling_params
        return not (req.num_computed_tokens or params.prompt_logprobs is not None or (
            params.pooling is not None and params.pooling.needs_every_position))

    def _admit(self, req: Request, hit: PrefixHit) -> None:
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.num_tokens
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += hit.num_tokens
        req.num_computed_tokens = hit.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _requeue(self, req: Request) -> None:
        """Preemption: back to the front of the waiting queue, its blocks freed; it is recomputed later (usually
        from the prefix cache)."""
        self.running.remove(req)
        self.kv.free(req)
        self._unseen.discard(req.request_id)
        req.kv_received = False
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.add_front(req)

    def _add_fork(self, parent: Request, child: Request) -> None:
        """Beam search: a new beam runs, sharing its parent's blocks (one more reference each)."""
        self.kv.fork(parent, child)
        self.requests[child.request_id] = child
        self.running.append(child)
        self._unseen.add(child.request_id)

    def load(self) -> NodeLoad:
        """The node's load now: queues, prefill tokens still to compute, KV blocks."""
        queued = sum(r.num_prompt_tokens - r.num_computed_tokens for r in self.requests.values()
                     if r.status.computing and r.num_computed_tokens < r.num_prompt_tokens)
        pool = self.kv.pool
        return NodeLoad(
            num_waiting=len(self.waiting) + len(self.handoff.queued), num_running=len(self.running),
            num_reserved=len(self.handoff.reserved), num_held=len(self.handoff.held), queued_prefill_tokens=queued,
            free_kv_blocks=pool.num_free_blocks, total_kv_blocks=pool.num_blocks, kv_cache_usage=pool.usage(),
        )

    # -- disaggregation (kv_handoff.py) ---------------------------------------------------------------

    def reserve(self, req: Request, lease_s: float, queue_until: float | None = None) -> Reservation | None:
        """Decode role: set aside blocks for a prompt whose KV a prefill node will write. None when the
        blocks are not there: refused, or (with `queue_until`) queued until then, behind any queued earlier
        (`queued`; `admit_queued` grants them). QueueFull when the waiting requests are at their bound."""
        self._check_new_id(req.request_id)
        if not len(self.handoff.queued):
            res = self._try_reserve(req, lease_s)
            if res is not None or queue_until is None:
                return res
        elif queue_until is None:
            return None  # others wait ahead of it
        self.check_room_to_wait()
        self.handoff.queued.add(QueuedReservation(req, lease_s, queue_until))
        return None

    def admit_queued(self, now: float | None = None) -> tuple[list[Reservation], list[str]]:
        """Grant queued reservations that fit now, in arrival order; drop those past their wait.
        Returns (granted, expired ids)."""
        queued = self.handoff.queued
        expired = queued.expire(self.handoff.clock() if now is None else now)
        granted: list[Reservation] = []
        if self.kv.pool.num_free_blocks == queued.free_blocks_at_last_try:
            return granted, expired  # nothing was freed since the head last failed to fit
        for item in queued:
            res = self._try_reserve(item.req, item.lease_s)
            if res is None:
                queued.free_blocks_at_last_try = self.kv.pool.num_free_blocks
                break
            queued.remove(item.req.request_id)
            granted.append(res)
        return granted, expired

    def _try_reserve(self, req: Request, lease_s: float) -> Reservation | None:
        hit = self._lookup(req)
        res = self.handoff.reserve(req, hit, lease_s)
        if res is not None:
            self.counters.prefix_cache_queries += req.num_prompt_tokens
            self.counters.prefix_cache_hits += hit.num_tokens
            self.requests[req.request_id] = req
        return res

    def admit_reserved(self, request_id: str, first_token: int, logprobs=None) -> EngineCoreOutput:
        """Decode role: the prompt's KV is in place and the prefill node sampled `first_token`."""
        req = self.requests.get(request_id)
        if req is None or not self.handoff.end_reservation(request_id):
            raise KeyError(f"request_id: no reservation for {request_id!r} (expired or unknown)")
        req.num_computed_tokens = req.num_prompt_tokens
        req.kv_received = True
        self.kv.cache_tokens(req)  # the transferred blocks become prefix-cache hits from now on
        req.append_sampled((first_token,), self.max_model_len)
        out = EngineCoreOutput.of(req, (first_token,), () if logprobs is None else (logprobs,))
        if req.is_finished:
            self._free(req)
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._unseen.add(request_id)
        return out

    def release_held(self, request_id: str) -> bool:
        """Prefill role: the transfer that read these blocks is over."""
        return self.handoff.release(request_id)

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free reservations nobody filled and held blocks nobody released before their deadline."""
        reserved, held = self.handoff.expired(self.handoff.clock() if now is None else now)
        self.finish_requests(reserved, RequestStatus.FINISHED_ABORTED)
        for rid in held:
            self.handoff.release(rid)
        return reserved + held
