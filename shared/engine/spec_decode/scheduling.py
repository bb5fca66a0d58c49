"""The scheduler's speculative-decoding half: which drafts ride along with a chunk, who proposes next, and
what happens to the blocks after verification. Mixed into `Scheduler` (it works on the scheduler's state).

1. A request's drafts (proposed after its last step) are scheduled only with a chunk that reaches its last
   known token, as many as the budget, max_tokens and max_model_len allow.
2. After verification its computed count drops by the rejected drafts; blocks now full of accepted tokens
   are hashed (only those: a draft is never hashed), and the blocks past the computed tokens go back to the
   pool, but for the proposer's lookahead (a draft model's KV of its own proposals).
"""

from __future__ import annotations

from kvrelay.engine.request import Request


class SpecSchedulerMixin:
    spec_lookahead: int | None  # None: no speculative decoding
    spec_disable_by_batch_size: int | None = None

    def _spec_tokens(self, req: Request, num_computed: int, n: int, budget: int) -> tuple[int, ...] | None:
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
        whole = min(limit, self.config.max_num_batched_tokens - n)
        if fits < whole and req.sampling_params.seed is not None and not req.sampling_params.greedy:
            return None
        return tuple(spec[: max(0, fits)])

    def _proposes(self, req: Request, num_computed: int, n: int) -> bool:
        """Whether the proposer drafts this request's next tokens after this step's sample. Not after its
        first token: that one comes from a prompt's computation, which a decode node never does, so every
        request's drafts start at the same position colocated or disaggregated."""
        if self.spec_lookahead is None or req.beam_group is not None or req.kv_send is not None:
            return False
        if req.sampling_params.structured_outputs is not None:
            return False  # a draft would need the grammar's mask at every draft position
        if num_computed + n < req.num_tokens or req.num_output_tokens == 0:
            return False
        if self.spec_disable_by_batch_size is not None and len(self.running) >= self.spec_disable_by_batch_size:
            return False
        # Room for a draft next step, even if every one of this step's drafts is rejected.
        room = self.max_model_len - req.num_tokens - 1
        if req.max_tokens is not None:
            room = min(room, req.max_tokens - req.num_generated_tokens - 1)
        return room >= 2

    def _plan_chunk(self, req: Request, num_computed: int, budget: int):
        """(known tokens, drafts, lookahead slots, proposes) of this step, or None when it waits."""
        n = self._num_new_tokens(req, num_computed, budget)
        if n <= 0:
            return None
        spec = self._spec_tokens(req, num_computed, n, budget)
        if spec is None:
            return None
        proposes = self._proposes(req, num_computed, n)
        lookahead = 0
        if proposes and self.spec_lookahead:
            lookahead = max(0, min(self.spec_lookahead, self.max_model_len - num_computed - n - len(spec)))
        return n, spec, lookahead, proposes

    def _settle_blocks(self, req: Request, spec: tuple[int, ...], proposed: bool) -> None:
        """After a step with speculation: hash the blocks now full of accepted tokens, and give back the
        blocks past the computed tokens (those of rejected drafts), but for the proposer's lookahead."""
        if spec:
            self.kv.cache_tokens(req)
        lookahead = self.spec_lookahead if proposed else 0
        if self.kv.trim(req, req.num_computed_tokens + lookahead):
            self._unseen.add(req.request_id)  # the runner's table must shrink too

    def _count_verification(self, num_drafts: int, num_accepted: int) -> None:
        c = self.counters
        c.spec_num_drafts += 1
        c.spec_num_draft_tokens += num_drafts
        c.spec_num_accepted_tokens += num_accepted
        if len(c.spec_accepted_per_pos) < num_drafts:
            c.spec_accepted_per_pos.extend([0] * (num_drafts - len(c.spec_accepted_per_pos)))
        for i in range(num_accepted):
            c.spec_accepted_per_pos[i] += 1
