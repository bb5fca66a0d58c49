"""Iteration-level scheduler: each step spends a token budget bringing num_computed_tokens up to num_tokens.

Request lifecycle:
1. `add_request` puts it in the waiting queue (fcfs order, or by (priority, arrival)).
2. `schedule` first serves running requests (decodes and unfinished prefill chunks); when blocks run
   out it preempts the lowest-priority / latest-arrived running request (its blocks are freed, it goes
   back to waiting and is recomputed later, usually from the prefix cache). Then it admits waiting
   requests, counting their prefix-cache hits as computed tokens.
3. `update_from_output` appends sampled tokens and checks stop conditions.
4. Finished or aborted requests free their blocks at once; the runner hears of them next step.

There is no prefill or decode phase: a prompt is simply a request far from its num_tokens, and chunked
prefill is what happens when the budget runs out mid-prompt. The scheduler never touches tensors.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

from shared.config import SchedulerConfig
from shared.engine.kv_cache_manager import NO_HIT, KVCacheManager, PrefixHit, cdiv
from shared.engine.request import Request, RequestStatus
from shared.engine.request_queue import create_request_queue
from shared.engine.reservation_queue import DuplicateRequest, QueuedReservation, QueueFull, ReservationQueue
from shared.engine.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    KVSend,
    ModelRunnerOutput,
    NewRequestData,
    Reservation,
    SchedulerOutput,
)
from shared.records import NodeLoad

_COMPUTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.RUNNING)


@dataclass
class EngineCounters:
    """Cumulative counts for the metrics (the load itself is counted on demand: `Scheduler.load`)."""

    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0


@dataclass
class _StepPlan:
    tokens: dict[str, int] = field(default_factory=dict)
    new: list[NewRequestData] = field(default_factory=list)
    cached: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    budget: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.counters = EngineCounters()
        # Disaggregation: reservations awaiting a transfer (decode role), finished requests whose blocks a
        # transfer may still read (prefill role), and remote-prefilled requests the runner has not seen.
        self.reserved: dict[str, float] = {}  # req id -> lease deadline
        self.held: dict[str, float] = {}
        self.queued = ReservationQueue()  # reservations waiting for blocks
        self._unseen: set[str] = set()

    # -- queue management -------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        self._check_new_id(req.request_id)
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.queued:
            raise DuplicateRequest(f"request_id: {request_id!r} is already in use")

    def check_room_to_wait(self, n: int = 1) -> None:
        """QueueFull when n more waiting requests would pass max_waiting_requests (0: no bound)."""
        limit = self.config.max_waiting_requests
        waiting = len(self.waiting) + len(self.queued)
        if limit and waiting + n > limit:
            raise QueueFull(f"{waiting} requests are already waiting on this node (max_waiting_requests {limit}); "
                            "retry later")

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise end) requests wherever they are; unknown ids are ignored."""
        done = []
        for rid in request_ids:
            queued = self.queued.remove(rid)
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
                del self.reserved[rid]
            else:
                self.waiting.remove(req)
            req.status = status
            self._free(req)
            done.append(req)
        return done

    def _free(self, req: Request) -> None:
        if req.kv_send_started:
            self.kv.hold(req)
            self.held[req.request_id] = time.monotonic() + self.config.kv_lease_s
        else:
            self.kv.free(req)
        self.finished_req_ids.add(req.request_id)
        self._unseen.discard(req.request_id)
        del self.requests[req.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_unfinished(self) -> int:
        return len(self.running) + len(self.waiting)

    # -- schedule -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        out = SchedulerOutput(
            new_reqs=tuple(plan.new),
            cached_reqs=tuple(plan.cached),
            num_scheduled_tokens=MappingProxyType(dict(plan.tokens)),
            total_num_scheduled_tokens=sum(plan.tokens.values()),
            finished_req_ids=frozenset(self.finished_req_ids),
            preempted_req_ids=frozenset(plan.preempted),
            kv_sends=self._kv_sends(plan),
        )
        self.finished_req_ids = set()
        # Tokens count as computed once scheduled: the runner computes them before the next schedule.
        for rid, n in plan.tokens.items():
            self.requests[rid].num_computed_tokens += n
        return out

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        n = req.num_tokens - num_computed
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def _schedule_running(self, plan: _StepPlan) -> None:
        # A snapshot: preemption removes requests from self.running while we walk it.
        for req in list(self.running):
            if plan.budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue
            n = self._num_new_tokens(req, req.num_computed_tokens, plan.budget)
            if n <= 0:
                continue
            new_blocks = self._allocate_or_preempt(req, n, plan)
            if new_blocks is None:
                continue
            plan.tokens[req.request_id] = n
            plan.budget -= n
            if req.request_id in self._unseen:
                self._unseen.discard(req.request_id)
                plan.new.append(self._new_request_data(req))
            else:
                new_ids = tuple(b.block_id for b in new_blocks)
                plan.cached.append(CachedRequestData(req.request_id, new_ids, req.num_computed_tokens))

    def _allocate_or_preempt(self, req: Request, n: int, plan: _StepPlan) -> list | None:
        while (new_blocks := self.kv.allocate_slots(req, n)) is None:
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if victim is req:
                return None
        return new_blocks

    def _pick_victim(self) -> Request:
        if self.config.policy.value == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, plan: _StepPlan) -> None:
        self.running.remove(req)
        if req.request_id in plan.tokens:
            # Priority preemption can pick a request already scheduled this step: undo that.
            plan.budget += plan.tokens.pop(req.request_id)
            plan.cached = [c for c in plan.cached if c.req_id != req.request_id]
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        plan.preempted.add(req.request_id)
        self.waiting.add_front(req)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while len(self.waiting) and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            hit = self._lookup(req)
            n = self._num_new_tokens(req, hit.num_tokens, plan.budget)
            if not self.config.enable_chunked_prefill and n < req.num_tokens - hit.num_tokens:
                break
            new_blocks = self.kv.allocate_slots(req, n, hit)
            if new_blocks is None:
                break
            self.waiting.pop()
            self._admit(req, hit, n, plan)

    def _lookup(self, req: Request) -> PrefixHit:
        return self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else NO_HIT

    def _admit(self, req: Request, hit: PrefixHit, n: int, plan: _StepPlan) -> None:
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.num_tokens
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += hit.num_tokens
        req.num_computed_tokens = hit.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.tokens[req.request_id] = n
        plan.budget -= n
        plan.new.append(self._new_request_data(req))

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req_id=req.request_id,
            token_ids=tuple(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            sampling_params=req.sampling_params,
            block_ids=tuple(self.kv.block_ids(req.request_id)),
            num_computed_tokens=req.num_computed_tokens,
        )

    # -- update ---------------------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for rid in sched.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            token = result.sampled_token_ids.get(rid)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            req.append_output_token(token)
            self._check_stop(req, token)
            outputs.append(self._output(req, token, result.logprobs.get(rid)))
            if req.is_finished:
                self.running.remove(req)
                self._free(req)
        return outputs

    @staticmethod
    def _output(req: Request, token: int, logprobs) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=req.request_id,
            new_token_ids=(token,),
            logprobs=logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
        )

    def _check_stop(self, req: Request, token: int) -> None:
        # Length first, as vLLM does: a stop token that is also the last allowed token ends as "length".
        generated = req.num_generated_tokens  # a resumed request's earlier output counts
        at_limit = req.max_tokens is not None and generated >= req.max_tokens
        if at_limit or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            return
        params = req.sampling_params
        if generated < params.min_tokens:
            return
        if token == req.eos_token_id and not params.ignore_eos:
            req.status = RequestStatus.FINISHED_STOPPED
        elif token in params.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token

    def load(self) -> NodeLoad:
        queued = sum(r.num_prompt_tokens - r.num_computed_tokens for r in self.requests.values()
                     if r.status in _COMPUTING and r.num_computed_tokens < r.num_prompt_tokens)
        pool = self.kv.pool
        return NodeLoad(
            num_waiting=len(self.waiting) + len(self.queued), num_running=len(self.running),
            num_reserved=len(self.reserved), num_held=len(self.held), queued_prefill_tokens=queued,
            free_kv_blocks=pool.num_free_blocks, total_kv_blocks=pool.num_blocks, kv_cache_usage=pool.usage(),
        )

    # -- disaggregation ------------------------------------------------------------------------------

    def _kv_sends(self, plan: _StepPlan) -> tuple[KVSend, ...]:
        """Requests whose prompt completes this step and whose KV goes to a peer."""
        sends = []
        for rid, n in plan.tokens.items():
            req = self.requests[rid]
            spec = req.kv_send
            if spec is None or req.num_computed_tokens + n < req.num_prompt_tokens or req.kv_send_started:
                continue
            blocks = self.kv.block_ids(rid)[spec.skip_blocks : cdiv(req.num_prompt_tokens, self.kv.block_size)]
            if len(blocks) != len(spec.dst_block_ids):
                raise ValueError(
                    f"dst_block_ids: {len(spec.dst_block_ids)} given for {len(blocks)} blocks of request {rid}"
                )
            req.kv_send_started = True
            sends.append(KVSend(rid, spec.transfer_id, spec.peer, tuple(blocks), spec.dst_block_ids))
        return tuple(sends)

    def reserve(self, req: Request, lease_s: float, queue_until: float | None = None) -> Reservation | None:
        """Decode role: set aside blocks for a prompt whose KV a prefill node will write. None when the
        blocks are not there: refused, or (with `queue_until`) queued until then, behind any queued earlier
        (`queued`; `admit_queued` grants them). QueueFull when the waiting requests are at their bound."""
        self._check_new_id(req.request_id)
        if not len(self.queued):
            res = self._try_reserve(req, lease_s)
            if res is not None or queue_until is None:
                return res
        elif queue_until is None:
            return None  # others wait ahead of it
        self.check_room_to_wait()
        self.queued.add(QueuedReservation(req, lease_s, queue_until))
        return None

    def admit_queued(self, now: float | None = None) -> tuple[list[Reservation], list[str]]:
        """Grant queued reservations that fit now, in arrival order; drop those past their wait.
        Returns (granted, expired ids)."""
        now = time.monotonic() if now is None else now
        expired = self.queued.expire(now)
        granted: list[Reservation] = []
        free = self.kv.pool.num_free_blocks
        if free == self.queued.free_blocks_at_last_try:
            return granted, expired  # nothing was freed since the head last failed to fit
        for item in self.queued:
            res = self._try_reserve(item.req, item.lease_s)
            if res is None:
                self.queued.free_blocks_at_last_try = self.kv.pool.num_free_blocks
                break
            self.queued.remove(item.req.request_id)
            granted.append(res)
        return granted, expired

    def _try_reserve(self, req: Request, lease_s: float) -> Reservation | None:
        hit = self._lookup(req)
        if self.kv.allocate_slots(req, req.num_prompt_tokens - hit.num_tokens, hit, cache=False) is None:
            self.kv.free(req)
            return None
        req.status = RequestStatus.WAITING_FOR_KV
        req.num_computed_tokens = req.num_cached_tokens = hit.num_tokens
        self.counters.prefix_cache_queries += req.num_prompt_tokens
        self.counters.prefix_cache_hits += hit.num_tokens
        self.requests[req.request_id] = req
        deadline = time.monotonic() + lease_s
        self.reserved[req.request_id] = deadline
        dst = self.kv.block_ids(req.request_id)[len(hit.blocks) :]
        return Reservation(req.request_id, hit.num_tokens, tuple(dst), deadline)

    def admit_reserved(self, request_id: str, first_token: int, logprobs=None) -> EngineCoreOutput:
        """Decode role: the prompt's KV is in place and the prefill node sampled `first_token`."""
        req = self.requests.get(request_id)
        if req is None or request_id not in self.reserved:
            raise KeyError(f"request_id: no reservation for {request_id!r} (expired or unknown)")
        del self.reserved[request_id]
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_tokens(req)  # the transferred blocks become prefix-cache hits from now on
        req.append_output_token(first_token)
        self._check_stop(req, first_token)
        out = self._output(req, first_token, logprobs)
        if req.is_finished:
            self._free(req)
        else:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._unseen.add(request_id)
        return out

    def release_held(self, request_id: str) -> bool:
        """Prefill role: the transfer that read these blocks is over."""
        self.held.pop(request_id, None)
        return self.kv.release(request_id)

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free reservations nobody filled and held blocks nobody released before their deadline."""
        now = time.monotonic() if now is None else now
        expired = [rid for rid, t in self.reserved.items() if t <= now]
        self.finish_requests(expired, RequestStatus.FINISHED_ABORTED)
        for rid in [rid for rid, t in self.held.items() if t <= now]:
            self.release_held(rid)
            expired.append(rid)
        return expired
