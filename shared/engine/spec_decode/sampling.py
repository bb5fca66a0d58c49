"""The exact distributions and keyed random draws speculative sampling needs.

`probs` is the distribution the sampler's race draws from (suppression, penalties, temperature, min_p,
top-k with its ties, then top-p over the renormalised survivors), as a full [rows, vocab] tensor: rejection
sampling needs p(x) and q(x), not just a sample.

Keyed draws: a seeded row's randomness at a position comes from a generator seeded by (seed, position) and a
stream tag, as the sampler's own noise does (kvrelay.engine.sampler.noise_seed, which the residual and bonus
samples share), so a seeded request's tokens never depend on its batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvrelay.engine.sampler import Sampler, SamplingRow, noise_seed

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny
ACCEPT_STREAM = 0xA5A5_0001  # the accept/reject coin of a draft
DRAFT_STREAM = 0xA5A5_0002  # a draft model's sample


def probs(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """[R, V] float32: each (non-greedy) row's sampling distribution."""
    V = sampler.vocab_size
    x = sampler.processed_logits(logits[:, :V].float(), rows).clone()
    params = [r.params for r in rows]
    x /= torch.tensor([p.temperature for p in params], dtype=torch.float32, device=x.device)[:, None]
    for i, p in enumerate(params):
        row = x[i]
        if p.min_p > 0:
            row.masked_fill_(row < row.max() + math.log(p.min_p), _NEG_INF)
        if p.top_k or p.top_p < 1:
            _top_k_top_p_(row, p.top_k, p.top_p)
    return torch.softmax(x, dim=-1)


def _top_k_top_p_(row: torch.Tensor, top_k: int, top_p: float) -> None:
    vals, order = row.sort(descending=True)
    if top_k and top_k < row.numel():
        kth = vals[top_k - 1]
        vals = vals.masked_fill(vals < kth, _NEG_INF)  # ties of the k-th value stay, as in the sampler
    if top_p < 1:
        p = torch.softmax(vals, dim=-1)
        mass_before = p.cumsum(dim=-1) - p
        vals = vals.masked_fill(mass_before >= top_p, _NEG_INF)
    row.scatter_(0, order, vals)


class KeyedDraws:
    """Uniform draws for a stream: seeded rows from (seed, position, stream), the rest from one generator."""

    def __init__(self, stream: int, seed: int, device: torch.device) -> None:
        self.stream = stream
        self.device = device
        self._generator = torch.Generator(device)
        self._generator.manual_seed(seed ^ stream)
        self._seeded = torch.Generator(device)

    def uniform(self, row: SamplingRow, size: int, stream: int | None = None) -> torch.Tensor:
        out = torch.empty(size, device=self.device)
        seed = row.params.seed
        if seed is None:
            return out.uniform_(generator=self._generator)
        s = self.stream if stream is None else stream
        self._seeded.manual_seed(noise_seed(seed ^ s, row.position) if s else noise_seed(seed, row.position))
        return out.uniform_(generator=self._seeded)


def race(p: torch.Tensor, u: torch.Tensor) -> int:
    """A sample of distribution p [V] by the exponential race argmax(p_i / -log u_i)."""
    q = u.clamp_min(_TINY).log_().neg_().clamp_min_(_TINY)
    return int((p.log() - q.log_()).argmax())
