"""Beam search in the engine: HF transformers' algorithm over beams that are ordinary requests sharing KV.

Lifecycle of a beam group:
1. `EngineCore.add_beam_search` queues one request, the root beam (the prompt), tagged with its group.
2. Each running beam computes the logits of its last token; its row returns the top-C logprobs
   (C = max(2, 1 + number of end tokens) * beam_width, HF's candidates) instead of a sampled token.
3. Once every running beam of the group has its candidates, `BeamGroup.step` picks the next beams and the
   finished hypotheses (HF's rules, in float32 as HF computes them). The scheduler makes the new beams: the
   first child of a beam continues it in place, each further child forks it (shares its blocks, one more
   reference each; the shared partial block is copied when either writes into it), and beams without
   children end, dropping their references.
4. The group ends when HF's stopping rule says so; its output is the finished hypotheses, best first.
5. A preempted beam takes its whole group back to waiting (a beam cannot step without its siblings), and
   a waiting group is admitted all at once or not at all, so no group waits on a sibling that cannot get
   blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvrelay.common.records import BeamSequence
from kvrelay.common.sampling_params import BeamSearchParams
from kvrelay.engine.request import Request, RequestStatus
from kvrelay.engine.scheduler_output import EngineCoreOutput

_F32 = np.float32


def num_candidates(beam_width: int, num_end_tokens: int) -> int:
    """HF's beams_to_keep: enough candidates that num_beams survive even if the best all end."""
    return max(2, 1 + num_end_tokens) * beam_width


@dataclass
class Beam:
    req: Request
    score: np.float32  # sum of the generated tokens' logprobs, accumulated in float32 as HF does


@dataclass(frozen=True)
class Hypothesis:
    token_ids: tuple[int, ...]
    cumulative_logprob: np.float32
    score: np.float32  # length-penalised


@dataclass(frozen=True)
class BeamStep:
    next_beams: tuple[tuple[str, int, np.float32], ...]  # (parent request id, token, score), best first
    done: bool


@dataclass
class BeamGroup:
    """One beam search: its running beams (best first), finished hypotheses, and the candidates of this
    round as they arrive."""

    group_id: str
    params: BeamSearchParams
    num_prompt_tokens: int
    end_token_ids: tuple[int, ...]  # empty with ignore_eos
    max_new_tokens: int  # max_tokens, within max_model_len
    beams: list[Beam] = field(default_factory=list)
    finished: list[Hypothesis] = field(default_factory=list)
    pending: dict[str, Sequence[tuple[int, float]]] = field(default_factory=dict)
    num_generated: int = 0
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    next_index: int = 1

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def num_candidates(self) -> int:
        return num_candidates(self.width, len(self.end_token_ids))

    def members(self) -> list[Request]:
        return [b.req for b in self.beams]

    def new_beam_id(self) -> str:
        rid = f"{self.group_id}:beam{self.next_index}"
        self.next_index += 1
        return rid

    def record(self, request_id: str, candidates: Sequence[tuple[int, float]]) -> bool:
        """A beam's top candidates (token, logprob); True once every running beam has reported."""
        self.pending[request_id] = candidates
        return all(b.req.request_id in self.pending for b in self.beams)

    # -- one round, as transformers' GenerationMixin._beam_search does it ----------------------------------

    def step(self) -> BeamStep:
        width, lp = self.width, self.params.length_penalty
        flat = [(_F32(b.score + _F32(logprob)), i, tok)
                for i, b in enumerate(self.beams) for tok, logprob in self.pending[b.req.request_id]]
        self.pending.clear()
        # torch.topk over the flattened [beams * vocab] scores; ties go to the lower flat index.
        flat.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = flat[: self.num_candidates]
        gen = self.num_generated + 1
        ends = [gen >= self.max_new_tokens or tok in self.end_token_ids for _, _, tok in top]
        running = [c for c, end in zip(top, ends) if not end][:width]
        if self.improvable and not (len(self.finished) == width and self.params.early_stopping is True):
            penalty = _F32(gen**lp)
            new = [Hypothesis((*self.beams[i].req.output_token_ids, tok), score, _F32(score / penalty))
                   for rank, ((score, i, tok), end) in enumerate(zip(top, ends)) if rank < width and end]
            # Earlier hypotheses first, so that a tie keeps the older one (HF concatenates them first).
            merged = sorted(self.finished + new, key=lambda h: -h.score)
            self.finished = merged[:width]
        self.num_generated = gen
        if self.improvable and len(self.finished) == width and running:
            length = self.max_new_tokens if self.params.early_stopping == "never" and lp > 0 else gen
            best_possible = _F32(running[0][0] / _F32(length**lp))
            self.improvable = bool(best_possible > min(h.score for h in self.finished))
        done = (not self.improvable or all(ends) or not running
                or (len(self.finished) == width and self.params.early_stopping is True))
        next_beams = tuple((self.beams[i].req.request_id, tok, score) for score, i, tok in running)
        return BeamStep(() if done else next_beams, done)

    def results(self) -> tuple[BeamSequence, ...]:
        """The finished hypotheses, best first (running beams fill the list if it is short)."""
        hyps = list(self.finished)
        for b in self.beams[: self.width - len(hyps)]:
            hyps.append(Hypothesis(tuple(b.req.output_token_ids), b.score, _F32(b.score)))
        main_eos = self.end_token_ids[0] if self.end_token_ids else None
        out = []
        for h in hyps:
            stopped = bool(h.token_ids) and h.token_ids[-1] in self.end_token_ids
            stop_reason = h.token_ids[-1] if stopped and h.token_ids[-1] != main_eos else None
            out.append(BeamSequence(h.token_ids, float(h.cumulative_logprob), float(h.score),
                                    "stop" if stopped else "length", stop_reason))
        return tuple(out)

    def output(self, num_cached_tokens: int) -> EngineCoreOutput:
        beams = self.results()
        return EngineCoreOutput(
            req_id=self.group_id, new_token_ids=(), logprobs=(), finish_reason=beams[0].finish_reason,
            stop_reason=beams[0].stop_reason, num_prompt_tokens=self.num_prompt_tokens,
            num_cached_tokens=num_cached_tokens, beams=beams,
        )

    def aborted_output(self, num_cached_tokens: int) -> EngineCoreOutput:
        return EngineCoreOutput(self.group_id, (), (), RequestStatus.FINISHED_ABORTED.value, None,
                                self.num_prompt_tokens, num_cached_tokens)


class BeamSchedulerMixin:
    """The scheduler's beam-search half: making the beams a step chose, and keeping a group together
    through preemption and admission. Mixed into `Scheduler` (it works on the scheduler's own queues)."""

    beam_groups: dict[str, BeamGroup]

    def add_beam_group(self, group: BeamGroup, root: Request) -> None:
        if group.group_id in self.beam_groups or {group.group_id, root.request_id} & self.requests.keys():
            raise ValueError(f"request_id: {group.group_id!r} is already in use")
        root.beam_group = group.group_id
        group.beams = [Beam(root, _F32(0.0))]
        self.beam_groups[group.group_id] = group
        self.add_request(root)

    def abort_beam_groups(self, group_ids) -> list[str]:
        done = []
        for gid in group_ids:
            group = self.beam_groups.get(gid)
            if group is not None:
                self.finish_requests([m.request_id for m in group.members()], RequestStatus.FINISHED_ABORTED)
                done.append(gid)
        return done

    def beam_seats(self) -> int:
        """Sequence slots running groups hold for the beams they will fork (a group counts as beam_width)."""
        return sum(g.width - len(g.beams) for g in self.beam_groups.values()
                   if g.beams and g.beams[0].req.status == RequestStatus.RUNNING)

    def preemption_unit(self, req: Request) -> list[Request]:
        """What goes back to waiting with `req`: its whole beam group (the round's candidates are dropped)."""
        group = self.beam_groups.get(req.beam_group) if req.beam_group is not None else None
        if group is None:
            return [req]
        group.pending.clear()
        return [m for m in group.members() if m.status == RequestStatus.RUNNING]

    def admit_beam_group(self, head: Request, plan) -> bool:
        """Admit every beam of head's group, or none (False: the group waits and so does the queue)."""
        group = self.beam_groups[head.beam_group]
        members = group.members()
        if len(self.running) + self.beam_seats() + group.width > self.config.max_num_seqs:
            return False
        placed: list[tuple[Request, object, int]] = []
        for m in members:
            hit = self._lookup(m)
            n = max(0, self._num_new_tokens(m, hit.num_tokens, plan.budget))
            partial = 0 < n < m.num_tokens - hit.num_tokens
            if (partial and not self.config.enable_chunked_prefill) or self.kv.allocate_slots(m, n, hit) is None:
                for done, _, spent in placed:  # roll back: the blocks go, the queue is untouched
                    self.kv.free(done)
                    done.num_computed_tokens = 0
                    plan.budget += spent
                return False
            m.num_computed_tokens = hit.num_tokens  # what free() needs to uncache only unscheduled blocks
            placed.append((m, hit, n))
            plan.budget -= n
        for m, hit, n in placed:
            self.waiting.remove(m)
            self._admit(m, hit, plan)
            if n:
                plan.tokens[m.request_id] = n
                plan.new.append(self._new_request_data(m))
            else:  # no budget left this step: it starts next step
                self._unseen.add(m.request_id)
        return True

    def beam_candidates(self, req: Request, candidates) -> list[EngineCoreOutput]:
        """A beam's top candidates arrived; once the group has all of them it steps."""
        group = self.beam_groups[req.beam_group]
        if not group.record(req.request_id, candidates):
            return []
        step = group.step()
        if not step.done:
            self._make_beams(group, step)
            return []
        out = group.output(group.beams[0].req.num_cached_tokens or 0)
        del self.beam_groups[group.group_id]
        for m in group.members():
            m.status = RequestStatus.FINISHED_STOPPED
            self.running.remove(m)
            self._free(m)
        return [out]

    def _make_beams(self, group: BeamGroup, step: BeamStep) -> None:
        parents = {b.req.request_id: b.req for b in group.beams}
        continued: dict[str, int] = {}
        beams: list[Beam] = []
        for parent_id, token, score in step.next_beams:
            parent = parents[parent_id]
            if parent_id in continued:
                beams.append(Beam(self._fork_beam(group, parent, token), score))
            else:
                continued[parent_id] = token
                beams.append(Beam(parent, score))
        group.beams = beams  # before the drops below: a member ending outside the group ends the group
        for rid, req in parents.items():
            if rid not in continued:
                req.status = RequestStatus.FINISHED_STOPPED
                self.running.remove(req)
                self._free(req)
        for rid, token in continued.items():
            parents[rid].append_output_token(token)
            self._unseen.add(rid)  # the runner appended its own sample: rebuild its state

    def _fork_beam(self, group: BeamGroup, parent: Request, token: int) -> Request:
        child = Request(group.new_beam_id(), parent.prompt_token_ids, parent.sampling_params,
                        eos_token_id=parent.eos_token_id, arrival_time=parent.arrival_time,
                        cache_salt=parent.cache_salt)
        child.output_token_ids = [*parent.output_token_ids, token]
        child.all_token_ids = [*parent.all_token_ids, token]
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.beam_group = group.group_id
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent, child)
        self.requests[child.request_id] = child
        self.running.append(child)
        self._unseen.add(child.request_id)
        return child

    def _end_beam(self, req: Request) -> None:
        """A member ended outside a step (abort, a lease): its group cannot step again, so it all ends."""
        group = self.beam_groups.get(req.beam_group) if req.beam_group is not None else None
        if group is None or not any(m is req for m in group.members()):
            return
        del self.beam_groups[group.group_id]
        others = [m.request_id for m in group.members() if m is not req]
        self.finish_requests(others, RequestStatus.FINISHED_ABORTED)
