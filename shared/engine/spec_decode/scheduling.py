"""What speculative decoding adds to the scheduler's plan: the scheduler plans each request's chunk of known
tokens and, when it was given a `Speculation`, asks it what rides along. The scheduler without one plans no
drafts and allocates no lookahead.

1. A request's drafts (proposed after its last step) are scheduled only with a chunk that reaches its last
   known token, as many as the budget, max_tokens and max_model_len allow.
2. After verification its computed count drops by the rejected drafts; the scheduler hashes the blocks now
   full of accepted tokens (only those: a draft is never hashed) and gives back the blocks past the computed
   tokens, but for the proposer's lookahead (`slots_to_keep`: a draft model's KV of its own proposals).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.engine.config import SchedulerConfig, SpeculativeConfig
from kvrelay.engine.request import Request
from kvrelay.engine.step_plan import Chunk


@dataclass(frozen=True)
class Speculation:
    """`lookahead`: the KV slots a proposer writes past the verified tokens (a draft model's own KV of its
    proposals, 0 for n-gram lookup). No drafts are proposed while `disable_by_batch_size` or more requests
    run. `max_model_len` and `max_num_batched_tokens` are the scheduler's."""

    lookahead: int
    max_model_len: int
    max_num_batched_tokens: int
    disable_by_batch_size: int | None = None

    @classmethod
    def create(cls, spec: SpeculativeConfig | None, sched: SchedulerConfig, max_model_len: int
               ) -> Speculation | None:
        """The scheduler's speculation for `spec` (None: speculative decoding is off)."""
        if spec is None:
            return None
        return cls(spec.lookahead_tokens, max_model_len, sched.max_num_batched_tokens, spec.disable_by_batch_size)

    def extend(self, req: Request, num_computed: int, n: int, budget: int, num_running: int) -> Chunk | None:
        """The chunk of `n` known tokens with its drafts, lookahead and proposal; None: it waits this step."""
        drafts = self._drafts(req, num_computed, n, budget)
        if drafts is None:
            return None
        proposes = self._proposes(req, num_computed, n, num_running)
        lookahead = 0
        if proposes and self.lookahead:
            lookahead = max(0, min(self.lookahead, self.max_model_len - num_computed - n - len(drafts)))
        return Chunk(n, drafts, lookahead, proposes)

    def slots_to_keep(self, req: Request, proposed: bool) -> int:
        """After verification: the KV slots a request keeps (its computed tokens and, if its proposer
        drafted this step, the lookahead)."""
        return req.num_computed_tokens + (self.lookahead if proposed else 0)

    def _drafts(self, req: Request, num_computed: int, n: int, budget: int) -> tuple[int, ...] | None:
        """The drafts to verify with this chunk: only a chunk that reaches the last known token carries them,
        as many as fit the budget, max_tokens and max_model_len. None: wait for a step with budget for all
        of them (a seeded sampled request: the drafts' positions decide its tokens, not only the seed)."""
        spec = req.spec_token_ids
        if not spec or num_computed + n < req.num_tokens:
            return ()
        limit = min(len(spec), self.max_model_len - req.num_tokens - 1)
        if req.max_tokens is not None:
            limit = min(limit, req.max_tokens - req.num_generated_tokens - 1)
        fits = min(limit, budget - n)
        # Wait only for what some step can give: the drafts that fit a whole step's budget.
        whole = min(limit, self.max_num_batched_tokens - n)
        if fits < whole and req.sampling_params.seed is not None and not req.sampling_params.greedy:
            return None
        return tuple(spec[: max(0, fits)])

    def _proposes(self, req: Request, num_computed: int, n: int, num_running: int) -> bool:
        """Whether the proposer drafts this request's next tokens after this step's sample. Not after its
        first token: that one comes from a prompt's computation, which a decode node never does, so every
        request's drafts start at the same position colocated or disaggregated."""
        if req.beam_group is not None or req.kv_send is not None:
            return False
        if req.sampling_params.structured_outputs is not None:
            return False  # a draft would need the grammar's mask at every draft position
        if num_computed + n < req.num_tokens or req.num_output_tokens == 0:
            return False
        if self.disable_by_batch_size is not None and num_running >= self.disable_by_batch_size:
            return False
        # Room for a draft next step, even if every one of this step's drafts is rejected.
        room = self.max_model_len - req.num_tokens - 1
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - req.num_generated_tokens - 1)
        return room >= 2
