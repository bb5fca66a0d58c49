"""The scheduler's step: each step spends a token budget bringing requests' num_computed_tokens up to their
num_tokens, on ids and counts only (the model runner holds the tensors). Where each request is, and the moves
between those places, are the request table's (request_table.py), which the scheduler extends.

1. `schedule` first serves the running requests (decodes and unfinished prefill chunks) in order; when
   blocks run out it preempts the lowest-priority / latest-arrived running request. Then it admits waiting
   requests in queue order while there is budget, a sequence slot and blocks, leaving the running requests
   room for the rest of their prompts (`admission_headroom`). Under a priority-keyed policy a running prompt
   that a waiting request outranks takes only what the admissions leave of the budget, and a prompt a whole
   class behind (`priority_step_gap`) none of it: a step's length is its most urgent prompt's first-token time,
   and a burst it outranks would lengthen it.
2. Each request gets a chunk (`_plan_chunk`): its next known tokens within the budget and the long-prefill
   threshold. With speculative decoding the scheduler is given a `Speculation` (spec_decode/scheduling.py)
   that adds the drafts to verify, the proposer's lookahead slots, and whether it proposes after the step.
3. `update_from_output` appends the sampled tokens (the accepted drafts, then one more) and checks the stop
   conditions; a beam's candidates step its group once all have arrived (beam_search.py).

There is no prefill or decode phase: a prompt is simply a request far from its num_tokens, and chunked
prefill is what happens when the budget runs out mid-prompt.

LoRA: a step holds requests of at most `max_loras` distinct adapters (the model's slots); a running request of
another adapter sits the step out, and a waiting one keeps its place in the queue while later ones are admitted.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from functools import partial
from typing import TYPE_CHECKING

from kvrelay.engine.beam_search import BeamGroup, BeamStep
from kvrelay.engine.config import SchedulerConfig, SchedulingPolicy
from kvrelay.engine.kv_cache_manager import KVCacheManager, PrefixHit, cdiv
from kvrelay.engine.kv_handoff import KVHandoff
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.request_table import RequestTable
from kvrelay.engine.scheduler_output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from kvrelay.engine.step_plan import Chunk, StepPlan

if TYPE_CHECKING:
    from kvrelay.engine.spec_decode.scheduling import Speculation


_ONE_TOKEN = Chunk(1)
# Steps in a row that pooling requests may yield their share to generating prompts: chats that keep arriving
# delay embeddings, they never stop them.
MAX_POOLING_YIELDS = 8


# A CachedRequestData from its three fields as one tuple: the named tuple's own __new__ is a Python-level call,
# and one is made per running request per step.
_cached_row = partial(tuple.__new__, CachedRequestData)


class Scheduler(RequestTable):
    """`speculation`: what speculative decoding adds to each chunk (None: it is off); `handoff`: see
    RequestTable; `max_loras`: distinct LoRA adapters one step may run (0: LoRA is off)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int,
                 speculation: Speculation | None = None, handoff: KVHandoff | None = None,
                 max_loras: int = 0, generates: bool = True) -> None:
        super().__init__(config, kv, max_model_len, handoff)
        self.speculation = speculation
        self.max_loras = max_loras
        # A model that generates may get a chat at any moment: pooling requests take capped steps, so none waits
        # long behind one; an embedder or classifier only (an encoder, a cross-encoder) gives them whole steps.
        self.generates = generates
        self._pooling_yields = 0  # steps in a row whose pooling share went to generating requests' prompts

    # -- schedule -------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(budget=self.config.max_num_batched_tokens)
        keep = 0
        if self.num_pooling:  # (the common step has none: nothing more to do for it)
            plan.pooling_budget = self._pooling_budget()
            # The pooling share is kept from the running prompts: after yielding, pooling requests still waiting
            # start.
            keep = min(plan.pooling_budget or 0, plan.budget // 2)
            plan.budget -= keep
        yielded = self._schedule_running(self.running, plan, self._outranked_prefills())
        plan.budget += keep
        admitted = len(plan.new)
        lead = self._schedule_waiting(plan) if not plan.preempted else None
        if lead is not None:  # the yielded prompts a class behind the most urgent one admitted sit the step out
            yielded = [r for r in yielded if not self._behind(r, lead)]
        if yielded and plan.budget > 0:
            # What the waiting requests left of the budget: without preempting the requests just admitted; when
            # none could be admitted, the yield bought nothing and the prompts go on as if they had not yielded
            # (preempting if their blocks demand it), so that someone always progresses.
            self._schedule_running(yielded, plan, frozenset(), preempt=len(plan.new) == admitted)
        kv_sends = self.handoff.kv_sends((self.requests[rid], n) for rid, n in plan.tokens.items())
        out = plan.output(self.finished_req_ids, kv_sends, self.kv.drain_block_copies())
        self.finished_req_ids = set()
        # Tokens count as computed once scheduled: the runner computes them before the next schedule.
        for rid, n in plan.tokens.items():
            self.requests[rid].num_computed_tokens += n
        return out

    def _pooling_budget(self) -> int | None:
        """This step's share of pooling tokens (None: uncapped). On a model that generates, pooling requests get
        `max_pooling_tokens_per_step`, and nothing while a generating request has prompt left to compute (a chat
        waiting for its first token goes first), but never for more than MAX_POOLING_YIELDS steps in a row."""
        cap = self.config.max_pooling_tokens_per_step
        if not (cap and self.generates):
            return None
        if self._pooling_yields < MAX_POOLING_YIELDS and self._generation_in_prompt():
            self._pooling_yields += 1
            return 0
        self._pooling_yields = 0
        return cap

    def _generation_in_prompt(self) -> bool:
        if len(self.requests) == self.num_pooling:
            return False
        return (any(r.sampling_params.pooling is None and r.num_computed_tokens < r.num_prompt_tokens
                    for r in self.running)
                or any(r.sampling_params.pooling is None and r.status.computing for r in self.waiting))

    def _num_new_tokens(self, req: Request, num_computed: int, budget: int) -> int:
        n = req.num_tokens - num_computed
        if self.config.long_prefill_token_threshold > 0:
            n = min(n, self.config.long_prefill_token_threshold)
        return min(n, budget)

    def _plan_chunk(self, req: Request, num_computed: int, budget: int, plan: StepPlan | None = None) -> Chunk | None:
        """This step's chunk of a request with `num_computed` tokens computed: its next known tokens within the
        budget and the long-prefill threshold (a pooling request's within the step's pooling share, though the
        first of a step may take a whole sequence that cannot be chunked), and what speculation adds. None: it
        waits this step."""
        if plan is not None and _capped_pooling(plan, req):
            share = max(0, plan.pooling_budget)
            if share < req.num_tokens - num_computed and not self.config.enable_chunked_prefill and not plan.pooled:
                share = budget  # a sequence it cannot chunk: one per step, so it is never starved
            budget = min(budget, share)
        n = self._num_new_tokens(req, num_computed, budget)
        if n <= 0:
            return None
        if self.speculation is None:
            return _ONE_TOKEN if n == 1 else Chunk(n)  # a decode's chunk: one frozen record shared by all
        return self.speculation.extend(req, num_computed, n, budget, len(self.running))

    def _lora_fits(self, req: Request, plan: StepPlan) -> bool:
        """Whether the step has room for the request's adapter (it runs one already, or has a slot left)."""
        name = req.lora_name
        return not name or not self.max_loras or name in plan.loras or len(plan.loras) < self.max_loras

    def _outranked_prefills(self) -> set[str]:
        """Running requests still in their prompts that a waiting request outranks (a lower priority value,
        policies other than fcfs): they yield this step's budget to the waiting ones and take what is left.
        A prompt admitted a moment earlier thus does not keep a more urgent request (another tenant's, a
        higher band: gateway.admission) waiting for all of its chunks; work already computed is kept."""
        if self.config.policy == SchedulingPolicy.FCFS or not len(self.waiting):
            return set()
        best = self.waiting.peek().priority
        return {r.request_id for r in self.running
                if r.priority > best and r.num_computed_tokens < r.num_prompt_tokens and r.beam_group is None}

    def _schedule_running(self, requests: list[Request], plan: StepPlan, defer: AbstractSet[str],
                          preempt: bool = True) -> list[Request]:
        """Chunks for `requests` (running) in order; those in `defer` are skipped and returned. Without
        `preempt`, a request whose blocks do not fit sits the step out."""
        deferred = []
        # A decode row (one known token left) with no speculation and no pooling cap has a one-token chunk:
        # taken without _plan_chunk, since every running request of every step comes through here.
        plain = self.speculation is None and plan.pooling_budget is None
        allocate, running = self.kv.allocate_slots, RequestStatus.RUNNING
        unseen, rewritten, tokens, cached = self._unseen, self.kv.rewritten, plan.tokens, plan.cached
        # A snapshot: preemption removes requests from self.running while we walk it.
        for req in list(requests):
            if plan.budget <= 0:
                break
            if req.status is not running or (req.lora_name and not self._lora_fits(req, plan)):
                continue
            rid = req.request_id
            if rid in defer:
                deferred.append(req)
                continue
            if plain and len(req.all_token_ids) - req.num_computed_tokens == 1:
                # The decode row, spelled out: StepPlan.add's work for a one-token chunk and no pooling cap.
                new_blocks = allocate(req, 1)
                if new_blocks is None and (
                        not preempt or (new_blocks := self._preempt_for(req, _ONE_TOKEN, plan)) is None):
                    continue
                tokens[rid] = 1
                plan.budget -= 1
                if req.lora_name:
                    plan.loras.add(req.lora_name)
            else:
                if (chunk := self._plan_chunk(req, req.num_computed_tokens, plan.budget, plan)) is None:
                    continue
                new_blocks = allocate(req, chunk.num_tokens, num_lookahead_tokens=chunk.lookahead)
                if new_blocks is None and (
                        not preempt or (new_blocks := self._preempt_for(req, chunk, plan)) is None):
                    continue
                plan.add(rid, chunk, req.lora_name, _capped_pooling(plan, req))
            if rid in unseen or rid in rewritten:
                unseen.discard(rid)
                rewritten.discard(rid)
                plan.new.append(self._new_request_data(req))
            else:
                new_ids = tuple([b.block_id for b in new_blocks]) if new_blocks else ()
                cached.append(_cached_row((rid, new_ids, req.num_computed_tokens)))
        return deferred

    def _preempt_for(self, req: Request, chunk: Chunk, plan: StepPlan) -> list | None:
        """Preempt until the chunk's blocks fit; None if the request itself was preempted."""
        while True:
            self._preempt(self._pick_victim(), plan)
            if req.status != RequestStatus.RUNNING:  # it was the victim, or in the victim's beam group
                return None
            if (new_blocks := self.kv.allocate_slots(req, chunk.num_tokens, num_lookahead_tokens=chunk.lookahead)
                    ) is not None:
                return new_blocks

    def _pick_victim(self) -> Request:
        if self.config.policy.value == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        for req in self.beam_groups.preemption_unit(victim):
            plan.preempt(req.request_id)
            self._requeue(req)

    # -- admission ------------------------------------------------------------------------------------

    def _admission_headroom(self, plan: StepPlan) -> int:
        """Free blocks an admission must leave: what the running requests still need for the rest of their
        prompts (past this step's chunk), and one block each to grow into. Admitting into the last free blocks
        only to preempt (and recompute) a running request a few steps later throws work away."""
        return sum(self._blocks_to_grow(r, r.num_computed_tokens + plan.scheduled(r.request_id))
                   for r in self.running)

    def _blocks_to_grow(self, req: Request, num_computed: int) -> int:
        """Blocks for the rest of the prompt past num_computed tokens, and one to grow into."""
        return cdiv(max(0, req.num_prompt_tokens - num_computed), self.kv.block_size) + 1

    def _behind(self, req: Request, lead: int | None) -> bool:
        """Whether `req` is a priority class behind `lead` (SchedulerConfig.priority_step_gap)."""
        gap = self.config.priority_step_gap
        return bool(gap) and lead is not None and req.priority - lead >= gap

    def _schedule_waiting(self, plan: StepPlan) -> int | None:
        """Admits waiting requests into the step; returns the most urgent priority admitted (None: none, or
        fcfs, whose queue is not in priority order)."""
        ranked = self.config.policy != SchedulingPolicy.FCFS
        lead: int | None = None
        compiling: list[Request] = []  # and those whose adapter has no slot this step: they keep their places
        seqs = self.config.max_num_seqs
        keep = self.config.admission_headroom
        headroom = self._admission_headroom(plan) if keep and len(self.waiting) else 0
        while len(self.waiting) and plan.budget > 0 and len(self.running) + self.beam_groups.seats() < seqs:
            req = self.waiting.peek()
            if self._behind(req, lead):  # (lead stays None under fcfs)
                break  # the queue is in priority order: everything after it is as far behind
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR or not self._lora_fits(req, plan):
                compiling.append(self.waiting.pop())
                continue
            if req.beam_group is not None:
                if not self._admit_beam_group(self.beam_groups[req.beam_group], plan):
                    break
                continue
            hit = self._lookup(req)
            chunk = self._plan_chunk(req, hit.num_tokens, plan.budget, plan)
            if chunk is None and req.sampling_params.pooling is not None and plan.budget > 0:
                compiling.append(self.waiting.pop())  # past the step's pooling share: it keeps its place, and
                continue  # the requests behind it may start
            if chunk is None:
                break
            if not self.config.enable_chunked_prefill and chunk.num_new < req.num_tokens - hit.num_tokens:
                break
            n, lookahead = chunk.num_tokens, chunk.lookahead
            needed = self.kv.blocks_to_allocate(req, n, hit, num_lookahead_tokens=lookahead)
            if self.running and self.kv.num_free_blocks - needed < headroom:  # wait for room instead
                break
            if self.kv.allocate_slots(req, n, hit, num_lookahead_tokens=lookahead) is None:
                break
            self.waiting.pop()
            if keep:
                headroom += self._blocks_to_grow(req, hit.num_tokens + chunk.num_new)
            self._admit(req, hit)
            plan.add(req.request_id, chunk, req.lora_name, _capped_pooling(plan, req))
            plan.new.append(self._new_request_data(req))
            if ranked:
                lead = req.priority if lead is None else min(lead, req.priority)
        for req in reversed(compiling):  # back in their places, ahead of later arrivals
            self.waiting.add_front(req)
        return lead

    def _admit_beam_group(self, group: BeamGroup, plan: StepPlan) -> bool:
        """Admit every beam of a group, or none (False: the group waits and so does the queue)."""
        if len(self.running) + self.beam_groups.seats() + group.width > self.config.max_num_seqs:
            return False
        placed: list[tuple[Request, PrefixHit, int]] = []
        budget = plan.budget
        for m in group.members():
            hit = self._lookup(m)
            n = max(0, self._num_new_tokens(m, hit.num_tokens, budget))
            partial = 0 < n < m.num_tokens - hit.num_tokens
            if (partial and not self.config.enable_chunked_prefill) or self.kv.allocate_slots(m, n, hit) is None:
                for done, _, _ in placed:  # roll back: the blocks go, the queue is untouched
                    self.kv.free(done)
                    done.num_computed_tokens = 0
                return False
            m.num_computed_tokens = hit.num_tokens  # what free() needs to uncache only unscheduled blocks
            placed.append((m, hit, n))
            budget -= n
        for m, hit, n in placed:
            self.waiting.remove(m)
            self._admit(m, hit)
            if n:
                plan.add(m.request_id, Chunk(n), m.lora_name)
                plan.new.append(self._new_request_data(m))
            else:  # no budget left this step: it starts next step
                self._unseen.add(m.request_id)
        return True

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req_id=req.request_id,
            token_ids=tuple(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            sampling_params=req.sampling_params,
            block_ids=tuple(self.kv.block_ids(req.request_id)),
            num_computed_tokens=req.num_computed_tokens,
            num_external_tokens=req.num_prompt_tokens - (req.num_cached_tokens or 0) if req.kv_received else 0,
            lora_name=req.lora_name,
            images=req.images,
        )

    # -- update ---------------------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs = []
        # Every request of every step comes through here: the lookups are bound once.
        request_of, sampled_of, logprobs_of = self.requests.get, result.sampled_token_ids.get, result.logprobs.get
        drafts_of, prompt_logprobs_of, drafted_of = (sched.scheduled_spec_tokens.get, result.prompt_logprobs.get,
                                                     result.spec_token_ids.get)
        # A step with nothing but sampled tokens (no pooling, logprobs, drafts or beams) takes the short path.
        plain = not (result.pooled or result.logprobs or result.prompt_logprobs or result.spec_token_ids
                     or sched.scheduled_spec_tokens or self.speculation is not None or len(self.beam_groups))
        max_model_len = self.max_model_len
        for rid in sched.num_scheduled_tokens:
            req = request_of(rid)
            if req is None or req.is_finished:
                continue
            if plain:
                if tokens := sampled_of(rid):
                    new = req.append_sampled(tokens, max_model_len)
                    outputs.append(EngineCoreOutput.of(req, new))
                    if req.is_finished:
                        self.running.remove(req)
                        self._free(req)
                continue
            if result.pooled and (vector := result.pooled.get(rid)) is not None:  # its prompt is done: it ends
                req.status = RequestStatus.FINISHED_STOPPED
                outputs.append(EngineCoreOutput.of(req, (), pooled=vector))
                self.running.remove(req)
                self._free(req)
                continue
            tokens = sampled_of(rid)
            if not tokens:
                continue  # a prefill chunk that did not reach the end of the prompt
            logprobs = logprobs_of(rid, ())
            if req.beam_group is not None:
                outputs.extend(self._beam_candidates(req, logprobs[0].top))
                continue
            drafts = drafts_of(rid, ())
            if drafts:
                self.counters.count_verification(len(drafts), len(tokens) - 1)
                req.num_computed_tokens -= len(drafts) - (len(tokens) - 1)  # the rejected drafts' KV is void
            new = req.append_sampled(tokens, self.max_model_len)
            outputs.append(EngineCoreOutput.of(req, new, logprobs[: len(new)], prompt_logprobs_of(rid)))
            if req.is_finished:
                self.running.remove(req)
                self._free(req)
                continue
            drafted = drafted_of(rid)
            if drafted or req.spec_token_ids:
                req.spec_token_ids = list(drafted or ())
            if self.speculation is not None:
                self._settle_blocks(req, drafts, self.speculation.slots_to_keep(req, rid in sched.propose_req_ids))
        return outputs

    def _settle_blocks(self, req: Request, drafts: tuple[int, ...], slots: int) -> None:
        """After a step with speculation: hash the blocks now full of accepted tokens (a draft is never
        hashed), and give back the blocks past the first `slots` (those of rejected drafts)."""
        if drafts:
            self.kv.cache_tokens(req)
        if self.kv.trim(req, slots):
            self._unseen.add(req.request_id)  # the runner's table must shrink too

    def _beam_candidates(self, req: Request, candidates) -> list[EngineCoreOutput]:
        """A beam's top candidates arrived; once its group has all of them it steps."""
        group = self.beam_groups[req.beam_group]
        if not group.record(req.request_id, candidates):
            return []
        step = group.step()
        if not step.done:
            self._make_beams(group, step)
            return []
        out = group.output(group.beams[0].req.num_cached_tokens or 0)
        self.beam_groups.remove(group.group_id)
        for m in group.members():
            self._end_running(m, RequestStatus.FINISHED_STOPPED)
        return [out]

    def _make_beams(self, group: BeamGroup, step: BeamStep) -> None:
        beams = group.advance(step)
        for parent, child in beams.forks:
            self._add_fork(parent, child)
        for parent in beams.dropped:
            self._end_running(parent, RequestStatus.FINISHED_STOPPED)
        for parent, token in beams.continued:
            parent.append_output_token(token)
            self._unseen.add(parent.request_id)  # the runner appended its own sample: rebuild its state


def _capped_pooling(plan: StepPlan, req: Request) -> bool:
    """A pooling request in a step that caps them (checked in that order: the common step has no cap)."""
    return plan.pooling_budget is not None and req.sampling_params.pooling is not None
