"""Iteration-level scheduler: each step spends a token budget bringing num_computed_tokens up to num_tokens.

Request lifecycle:
1. `add_request` puts it in the waiting queue (fcfs order, by (priority, arrival), or shortest prompt
   first with aging: request_queue.py). A request whose grammar is still compiling (WAITING_FOR_GRAMMAR)
   keeps its place but is passed over until `grammar_ready`; the requests behind it are admitted meanwhile.
2. `schedule` first serves running requests (decodes and unfinished prefill chunks); when blocks run
   out it preempts the lowest-priority / latest-arrived running request (its blocks are freed, it goes
   back to waiting and is recomputed later, usually from the prefix cache). Then it admits waiting
   requests, counting their prefix-cache hits as computed tokens.
3. `update_from_output` appends sampled tokens and checks stop conditions.
4. Finished or aborted requests free their blocks at once; the runner hears of them next step.

Speculative decoding (spec_decode/scheduling.py): drafts ride along as more scheduled tokens of a request.
Beam search (beam_search.py): beams are requests of a group that steps together.

There is no prefill or decode phase: a prompt is simply a request far from its num_tokens, and chunked
prefill is what happens when the budget runs out mid-prompt. The scheduler never touches tensors.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

from kvrelay.common.records import NodeLoad
from kvrelay.engine.beam_search import BeamSchedulerMixin
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.kv_cache_manager import NO_HIT, KVCacheManager, PrefixHit, cdiv
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.request_queue import create_request_queue
from kvrelay.engine.reservation_queue import DuplicateRequest, QueuedReservation, QueueFull, ReservationQueue
from kvrelay.engine.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    KVSend,
    ModelRunnerOutput,
    NewRequestData,
    Reservation,
    SchedulerOutput,
)
from kvrelay.engine.spec_decode.scheduling import SpecSchedulerMixin

_COMPUTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.RUNNING)


@dataclass
class EngineCounters:
    """Cumulative counts for the metrics (the load itself is counted on demand: `Scheduler.load`)."""

    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    # Speculative decoding (vLLM's spec_decode metrics): verifications, drafts verified, drafts accepted,
    # and accepted drafts by position in their run (index 0: the first draft of a run).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class _StepPlan:
    tokens: dict[str, int] = field(default_factory=dict)
    spec: dict[str, tuple[int, ...]] = field(default_factory=dict)
    propose: set[str] = field(default_factory=set)
    new: list[NewRequestData] = field(default_factory=list)
    cached: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    budget: int = 0


class Scheduler(SpecSchedulerMixin, BeamSchedulerMixin):
    """`spec_lookahead`: None without speculative decoding; else the KV slots a proposer writes past the
    verified tokens (a draft model's own KV of its proposals, 0 for n-gram lookup). No drafts are proposed
    while `spec_disable_by_batch_size` or more requests run."""

    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, spec_lookahead: int | None = None,
        spec_disable_by_batch_size: int | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.spec_lookahead = spec_lookahead
        self.spec_disable_by_batch_size = spec_disable_by_batch_size
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.counters = EngineCounters()
        # Disaggregation: reservations awaiting a transfer (decode role), finished requests whose blocks a
        # transfer may still read (prefill role), and remote-prefilled requests the runner has not seen.
        self.reserved: dict[str, float] = {}  # req id -> lease deadline
        self.held: dict[str, float] = {}
        self.queued = ReservationQueue()  # reservations waiting for blocks
        # Requests whose runner state must be (re)built from a NewRequestData when next scheduled: admitted
        # without a step (a hand-off), or whose block table changed other than by appending.
        self._unseen: set[str] = set()
        self.beam_groups = {}  # beam search: group id -> BeamGroup

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
        self._end_beam(req)
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
            scheduled_spec_tokens=MappingProxyType(dict(plan.spec)),
            propose_req_ids=frozenset(plan.propose),
            block_copies=self.kv.drain_block_copies(),
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

    def _add_to_plan(self, req: Request, n: int, spec: tuple[int, ...], proposes: bool, plan: _StepPlan) -> None:
        rid = req.request_id
        plan.tokens[rid] = n + len(spec)
        plan.budget -= n + len(spec)
        if spec:
            plan.spec[rid] = spec
        if proposes:
            plan.propose.add(rid)

    def _schedule_running(self, plan: _StepPlan) -> None:
        # A snapshot: preemption removes requests from self.running while we walk it.
        for req in list(self.running):
            if plan.budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue
            chunk = self._plan_chunk(req, req.num_computed_tokens, plan.budget)
            if chunk is None:
                continue
            n, spec, lookahead, proposes = chunk
            new_blocks = self._allocate_or_preempt(req, n + len(spec), lookahead, plan)
            if new_blocks is None:
                continue
            self._add_to_plan(req, n, spec, proposes, plan)
            rid = req.request_id
            if rid in self._unseen or rid in self.kv.rewritten:
                self._unseen.discard(rid)
                self.kv.rewritten.discard(rid)
                plan.new.append(self._new_request_data(req))
            else:
                new_ids = tuple(b.block_id for b in new_blocks)
                plan.cached.append(CachedRequestData(rid, new_ids, req.num_computed_tokens))

    def _allocate_or_preempt(self, req: Request, n: int, lookahead: int, plan: _StepPlan) -> list | None:
        while (new_blocks := self.kv.allocate_slots(req, n, num_lookahead_tokens=lookahead)) is None:
            victim = self._pick_victim()
            self._preempt(victim, plan)
            if req.status != RequestStatus.RUNNING:  # it was the victim, or in the victim's beam group
                return None
        return new_blocks

    def _pick_victim(self) -> Request:
        if self.config.policy.value == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request, plan: _StepPlan) -> None:
        for member in self.preemption_unit(req):
            self._preempt_one(member, plan)

    def _preempt_one(self, req: Request, plan: _StepPlan) -> None:
        self.running.remove(req)
        rid = req.request_id
        if rid in plan.tokens:
            # Priority preemption can pick a request already scheduled this step: undo that.
            plan.budget += plan.tokens.pop(rid)
            plan.cached = [c for c in plan.cached if c.req_id != rid]
            plan.new = [d for d in plan.new if d.req_id != rid]
            plan.spec.pop(rid, None)
            plan.propose.discard(rid)
        self.kv.free(req)
        self._unseen.discard(rid)
        req.kv_received = False
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        plan.preempted.add(req.request_id)
        self.waiting.add_front(req)

    def _admission_headroom(self, plan: _StepPlan) -> int:
        """Free blocks an admission must leave: what the running requests still need for the rest of their
        prompts (past this step's chunk), and one block each to grow into. Admitting into the last free blocks
        only to preempt (and recompute) a running request a few steps later throws work away: 8% of the tokens
        computed in a 128-request fp32 benchmark whose KV cache held half of them."""
        return sum(self._blocks_to_grow(r, r.num_computed_tokens + plan.tokens.get(r.request_id, 0))
                   for r in self.running)

    def _blocks_to_grow(self, req: Request, num_computed: int) -> int:
        """Blocks for the rest of the prompt past num_computed tokens, and one to grow into."""
        return cdiv(max(0, req.num_prompt_tokens - num_computed), self.kv.block_size) + 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        compiling: list[Request] = []
        seqs = self.config.max_num_seqs
        keep = self.config.admission_headroom
        headroom = self._admission_headroom(plan) if keep else 0
        while len(self.waiting) and plan.budget > 0 and len(self.running) + self.beam_seats() < seqs:
            req = self.waiting.peek()
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                compiling.append(self.waiting.pop())
                continue
            if req.beam_group is not None:
                if not self.admit_beam_group(req, plan):
                    break
                continue
            hit = self._lookup(req)
            chunk = self._plan_chunk(req, hit.num_tokens, plan.budget)
            if chunk is None:
                break
            n, spec, lookahead, proposes = chunk
            if not self.config.enable_chunked_prefill and n < req.num_tokens - hit.num_tokens:
                break
            needed = self.kv.blocks_to_allocate(req, n + len(spec), hit, num_lookahead_tokens=lookahead)
            if self.running and self.kv.num_free_blocks - needed < headroom:  # wait for room instead
                break
            new_blocks = self.kv.allocate_slots(req, n + len(spec), hit, num_lookahead_tokens=lookahead)
            if new_blocks is None:
                break
            self.waiting.pop()
            if keep:
                headroom += self._blocks_to_grow(req, hit.num_tokens + n)
            self._admit(req, hit, plan)
            self._add_to_plan(req, n, spec, proposes, plan)
            plan.new.append(self._new_request_data(req))
        for req in reversed(compiling):  # back in their places, ahead of later arrivals
            self.waiting.add_front(req)

    def grammar_ready(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            req.status = RequestStatus.WAITING

    def _lookup(self, req: Request) -> PrefixHit:
        # Prompt logprobs need every prompt position computed: such a prompt never starts from the cache.
        if req.num_computed_tokens or req.sampling_params.prompt_logprobs is not None:
            return NO_HIT
        return self.kv.get_computed_blocks(req)

    def _admit(self, req: Request, hit: PrefixHit, plan: _StepPlan) -> None:
        if req.num_cached_tokens is None:
            req.num_cached_tokens = hit.num_tokens
            self.counters.prefix_cache_queries += req.num_tokens
            self.counters.prefix_cache_hits += hit.num_tokens
        req.num_computed_tokens = hit.num_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req_id=req.request_id,
            token_ids=tuple(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            sampling_params=req.sampling_params,
            block_ids=tuple(self.kv.block_ids(req.request_id)),
            num_computed_tokens=req.num_computed_tokens,
            num_external_tokens=req.num_prompt_tokens - (req.num_cached_tokens or 0) if req.kv_received else 0,
        )

    # -- update ---------------------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        for rid in sched.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            tokens = result.sampled_token_ids.get(rid)
            if not tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            logprobs = result.logprobs.get(rid, ())
            if req.beam_group is not None:
                outputs.extend(self.beam_candidates(req, logprobs[0].top))
                continue
            spec = sched.scheduled_spec_tokens.get(rid, ())
            if spec:
                self._count_verification(len(spec), len(tokens) - 1)
                req.num_computed_tokens -= len(spec) - (len(tokens) - 1)  # the rejected drafts' KV is void
            new = self._append_tokens(req, tokens)
            outputs.append(self._output(req, new, logprobs[: len(new)], result.prompt_logprobs.get(rid)))
            if req.is_finished:
                self.running.remove(req)
                self._free(req)
                continue
            req.spec_token_ids = list(result.spec_token_ids.get(rid, ()))
            if self.spec_lookahead is not None:
                self._settle_blocks(req, spec, rid in sched.propose_req_ids)
        return outputs

    def _append_tokens(self, req: Request, tokens) -> tuple[int, ...]:
        """Append until a stop condition: tokens after a stop token in an accepted run are dropped."""
        for i, token in enumerate(tokens):
            req.append_output_token(token)
            self._check_stop(req, token)
            if req.is_finished:
                return tuple(tokens[: i + 1])
        return tuple(tokens)

    @staticmethod
    def _output(req: Request, tokens: tuple[int, ...], logprobs, prompt_logprobs: tuple | None = None
                ) -> EngineCoreOutput:
        return EngineCoreOutput(
            req_id=req.request_id,
            new_token_ids=tokens,
            logprobs=tuple(logprobs),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens or 0,
            prompt_logprobs=prompt_logprobs,
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
        req.kv_received = True
        self.kv.cache_tokens(req)  # the transferred blocks become prefix-cache hits from now on
        req.append_output_token(first_token)
        self._check_stop(req, first_token)
        out = self._output(req, (first_token,), () if logprobs is None else (logprobs,))
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
