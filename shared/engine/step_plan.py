"""One scheduler step while the scheduler builds it: the chunk each request computes, the requests the
runner must (re)build, the preemptions. `StepPlan.output` freezes it into the `SchedulerOutput` the model
runner executes. Ids and counts only, like the rest of the scheduler."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from types import MappingProxyType

from kvrelay.engine.scheduler_output import CachedRequestData, KVSend, NewRequestData, SchedulerOutput


@dataclass(frozen=True)
class Chunk:
    """A request's share of one step: `num_new` of its known tokens, then `drafts` to verify (speculative
    decoding: only with a chunk that reaches its last known token). `lookahead`: KV slots to allocate past
    them for a proposer's own KV; `proposes`: its proposer drafts the next tokens after this step's sample."""

    num_new: int
    drafts: tuple[int, ...] = ()
    lookahead: int = 0
    proposes: bool = False
    # What the step computes for the request (and what its budget pays): set once, read for every row.
    num_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tokens", self.num_new + len(self.drafts))


@dataclass
class StepPlan:
    budget: int  # tokens still to spend this step
    tokens: dict[str, int] = field(default_factory=dict)  # req id -> tokens scheduled (drafts included)
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    propose: set[str] = field(default_factory=set)
    new: list[NewRequestData] = field(default_factory=list)
    cached: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    loras: set[str] = field(default_factory=set)  # the LoRA adapters of the requests scheduled
    pooling_budget: int | None = None  # tokens pooling requests may still take (None: no cap this step)
    pooled: bool = False  # a pooling request has a chunk this step (counted while pooling_budget is set)

    def add(self, req_id: str, chunk: Chunk, lora_name: str = "", pooling: bool = False) -> None:
        if lora_name:
            self.loras.add(lora_name)
        n = chunk.num_tokens
        if pooling:
            self.pooled = True
            if self.pooling_budget is not None:
                self.pooling_budget -= n
        self.tokens[req_id] = n
        self.budget -= n
        if chunk.drafts:
            self.drafts[req_id] = chunk.drafts
        if chunk.proposes:
            self.propose.add(req_id)

    def scheduled(self, req_id: str) -> int:
        return self.tokens.get(req_id, 0)

    def preempt(self, req_id: str) -> None:
        """The request goes back to waiting; priority preemption can pick one already scheduled this step,
        whose chunk is then taken back."""
        if req_id in self.tokens:
            self.budget += self.tokens.pop(req_id)
            # In place: the scheduler holds these lists while it walks the running requests.
            self.cached[:] = [c for c in self.cached if c.req_id != req_id]
            self.new[:] = [d for d in self.new if d.req_id != req_id]
            self.drafts.pop(req_id, None)
            self.propose.discard(req_id)
        self.preempted.add(req_id)

    def output(self, finished_req_ids: Iterable[str], kv_sends: tuple[KVSend, ...],
               block_copies: tuple[tuple[int, int], ...]) -> SchedulerOutput:
        return SchedulerOutput(
            new_reqs=tuple(self.new),
            cached_reqs=tuple(self.cached),
            num_scheduled_tokens=MappingProxyType(dict(self.tokens)),
            total_num_scheduled_tokens=sum(self.tokens.values()),
            finished_req_ids=frozenset(finished_req_ids),
            preempted_req_ids=frozenset(self.preempted),
            kv_sends=kv_sends,
            scheduled_spec_tokens=MappingProxyType(dict(self.drafts)),
            propose_req_ids=frozenset(self.propose),
            block_copies=block_copies,
        )
