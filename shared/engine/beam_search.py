"""Beam search in the engine: HF transformers' algorithm over beams that are ordinary requests sharing KV.

Lifecycle of a beam group:
1. `EngineCore.add_beam_search` queues one request, the root beam (the prompt), tagged with its group.
2. Each running beam computes the logits of its last token; its row returns the top-C logprobs
   (C = max(2, 1 + number of end tokens) * beam_width, HF's candidates) instead of a sampled token.
3. Once every running beam of the group has its candidates, `BeamGroup.step` picks the next beams and the
   finished hypotheses (HF's rules, in float32 as HF computes them), and `BeamGroup.advance` what becomes
   of each beam: the first child of a beam continues it in place, each further child is a new request forked
   from it, and beams without children end. The scheduler carries that out on its requests and blocks (a
   fork shares its parent's blocks, one more reference each; the shared partial block is copied when either
   writes into it).
4. The group ends when HF's stopping rule says so; its output is the finished hypotheses, best first.
5. A preempted beam takes its whole group back to waiting (a beam cannot step without its siblings:
   `BeamGroups.preemption_unit`), and a waiting group is admitted all at once or not at all, so no group
   waits on a sibling that cannot get blocks.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
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


@dataclass(frozen=True)
class NextBeams:
    """What a step makes of a group's requests: children forked from a parent (parent, child), parents that
    continue in place with a token, and parents without children, which end."""

    forks: tuple[tuple[Request, Request], ...]
    continued: tuple[tuple[Request, int], ...]
    dropped: tuple[Request, ...]


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

    def advance(self, step: BeamStep) -> NextBeams:
        """The beams a step chose: the first child of a beam continues it in place, each further child is a
        new request forked from it (the scheduler shares the parent's blocks with it), and beams without
        children end."""
        parents = {b.req.request_id: b.req for b in self.beams}
        continued: dict[str, int] = {}
        beams: list[Beam] = []
        forks: list[tuple[Request, Request]] = []
        for parent_id, token, score in step.next_beams:
            parent = parents[parent_id]
            if parent_id in continued:
                child = self._fork(parent, token)
                forks.append((parent, child))
                beams.append(Beam(child, score))
            else:
                continued[parent_id] = token
                beams.append(Beam(parent, score))
        self.beams = beams
        return NextBeams(
            forks=tuple(forks),
            continued=tuple((parents[rid], token) for rid, token in continued.items()),
            dropped=tuple(req for rid, req in parents.items() if rid not in continued),
        )

    def _fork(self, parent: Request, token: int) -> Request:
        child = Request(f"{self.group_id}:beam{self.next_index}", parent.prompt_token_ids, parent.sampling_params,
                        eos_token_id=parent.eos_token_id, arrival_time=parent.arrival_time,
                        cache_salt=parent.cache_salt, lora_name=parent.lora_name)
        self.next_index += 1
        child.output_token_ids = [*parent.output_token_ids, token]
        child.all_token_ids = [*parent.all_token_ids, token]
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.beam_group = self.group_id
        child.status = RequestStatus.RUNNING
        return child


class BeamGroups(Mapping[str, BeamGroup]):
    """The engine's beam searches by group id, and what the scheduler asks of them: the sequence seats they
    hold, what a preemption takes along, what ends with a member. The scheduler itself moves the beams'
    requests and blocks."""

    def __init__(self) -> None:
        self._groups: dict[str, BeamGroup] = {}

    def __getitem__(self, group_id: str) -> BeamGroup:
        return self._groups[group_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, group: BeamGroup, root: Request) -> None:
        """A new search, its root beam (the prompt) not yet queued."""
        root.beam_group = group.group_id
        group.beams = [Beam(root, _F32(0.0))]
        self._groups[group.group_id] = group

    def remove(self, group_id: str) -> None:
        del self._groups[group_id]

    def of(self, req: Request) -> BeamGroup | None:
        return self._groups.get(req.beam_group) if req.beam_group is not None else None

    def seats(self) -> int:
        """Sequence slots running groups hold for the beams they will fork (a group counts as beam_width)."""
        return sum(g.width - len(g.beams) for g in self._groups.values()
                   if g.beams and g.beams[0].req.status == RequestStatus.RUNNING)

    def preemption_unit(self, req: Request) -> list[Request]:
        """What goes back to waiting with `req`: its whole beam group (the round's candidates are dropped)."""
        group = self.of(req)
        if group is None:
            return [req]
        group.pending.clear()
        return [m for m in group.members() if m.status == RequestStatus.RUNNING]

    def end_with(self, req: Request) -> list[str]:
        """A member ended outside a step (an abort, a lease): its group cannot step again, so it ends; the
        ids of its other members, which end too."""
        group = self.of(req)
        if group is None or not any(m is req for m in group.members()):
            return []
        del self._groups[group.group_id]
        return [m.request_id for m in group.members() if m is not req]
