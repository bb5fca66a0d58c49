"""Verification: the target's logits at a request's last known token and at each of its drafts decide which
drafts stand; then one more token is sampled (where the first draft fell, or after the last).

Two exact ways, per request:
- Coupled (greedy rows, and drafts that are certain, as n-gram lookup's are): sample each position as the
  sampler would without speculation (same noise for a seeded row: (seed, position)) and keep drafts while
  they equal those samples. A certain draft d is thereby accepted with probability p(d), and a rejected one
  is replaced by a sample of p conditioned on "not d" - exactly rejection sampling's min(1, p/q) test and
  its residual (p - q)+ for a point mass q. The tokens are also exactly those of the same request without
  speculation: greedy output is identical, and so is seeded output.
- Rejection sampling (a draft model's sampled drafts, drawn from q): accept d with probability
  min(1, p(d) / q(d)), else sample from norm(max(0, p - q)); after all drafts, sample p. The coin and the
  residual are keyed by (seed, position) for seeded rows.
Either way every emitted token is distributed exactly as the target's sampler would have drawn it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrelay.common.records import TokenLogprobs
from kvrelay.engine.sampler import Sampler, SamplingRow, TokenBitmask
from kvrelay.engine.spec_decode.sampling import ACCEPT_STREAM, KeyedDraws, probs, race


@dataclass(frozen=True)
class VerifyGroup:
    """One request's rows in the step's logits: row `first` scores the first draft's position; drafts
    follow. Without drafts it is a plain one-row sample."""

    req_id: str
    first: int
    drafts: tuple[int, ...] = ()
    draft_probs: torch.Tensor | None = None  # [len(drafts), V]: None for certain drafts


@dataclass(frozen=True)
class Verified:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]  # empty unless asked for


class Verifier:
    def __init__(self, sampler: Sampler, seed: int, device: torch.device) -> None:
        self.sampler = sampler
        self.coin = KeyedDraws(ACCEPT_STREAM, seed, device)
        self.noise = KeyedDraws(0, seed, device)  # stream 0: the sampler's own (seed, position) noise

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], groups: Sequence[VerifyGroup],
        bitmask: TokenBitmask | None = None,
    ) -> dict[str, Verified]:
        """`bitmask`: grammar masks of rows without drafts (a constrained request is never given drafts)."""
        out = self.sampler(logits, rows, bitmask)
        result = {}
        for g in groups:
            s = len(g.drafts)
            if g.draft_probs is None or rows[g.first].params.greedy:
                sampled = out.token_ids[g.first : g.first + s + 1]
                m = next((j for j in range(s) if g.drafts[j] != sampled[j]), s)
                tokens = (*g.drafts[:m], sampled[m])
                lps = out.logprobs[g.first : g.first + m + 1]
            else:
                tokens = self._rejection_sample(logits, rows, g, out.token_ids[g.first + s])
                lps = self._logprobs(logits, rows, g.first, tokens, out.token_ids, out.logprobs)
            result[g.req_id] = Verified(tokens, tuple(lp for lp in lps if lp is not None))
        return result

    def _rejection_sample(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], g: VerifyGroup, bonus: int
    ) -> tuple[int, ...]:
        s = len(g.drafts)
        p = probs(self.sampler, logits[g.first : g.first + s], rows[g.first : g.first + s])
        q = g.draft_probs.to(p.device)
        for j, d in enumerate(g.drafts):
            u = float(self.coin.uniform(rows[g.first + j], 1)[0])
            if u * float(q[j, d]) < float(p[j, d]):
                continue
            residual = (p[j] - q[j]).clamp_min_(0.0)
            if float(residual.sum()) <= 0.0:  # p == q to rounding: the residual is p itself
                residual = p[j]
            row = rows[g.first + j]
            return (*g.drafts[:j], race(residual, self.noise.uniform(row, residual.numel())))
        return (*g.drafts, bonus)  # the bonus: the sampler's own draw at the position after the drafts

    def _logprobs(self, logits, rows, first: int, tokens, sampled, sampled_lps) -> list[TokenLogprobs | None]:
        if rows[first].params.logprobs is None:
            return []
        span = slice(first, first + len(tokens))
        if list(tokens) == list(sampled[span]):
            return list(sampled_lps[span])
        ids = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        return self.sampler.logprobs_of(logits[span], ids, rows[span])
