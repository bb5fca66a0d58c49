"""Token sampler: turns a step's logits into one token per row (vLLM's order of operations).

suppress -> penalties -> argmax for greedy rows; for the others temperature -> min_p -> top_k -> top_p,
then the exponential race: argmax_i(p_i / q_i) with q_i ~ Exp(1), computed in log space as
argmax_i(x_i - log q_i) (the Gumbel-max trick, same winner, no softmax needed).

Reproducibility: a seeded row's noise comes from a generator seeded with hash(seed, position), one draw of
vocab_size values per row, so its token depends only on its own logits, params, seed and position, never
on the rest of the batch. Every mask is applied in token order and the final race is elementwise, so
the batched fast paths cannot change a seeded row's result either.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
# Exp(1) draws can round to 0; -log(0) = inf would turn a masked -inf into nan, and argmax picks nan.
_TINY = torch.finfo(torch.float32).tiny
_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    position: int  # index in the sequence of the token being sampled (== len(prompt) + len(output))
    suppress_token_ids: tuple[int, ...] = ()  # forbidden this step (eos + stop ids while output < min_tokens)


@dataclass(frozen=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token, under the raw model logits
    rank: int  # 1-based: 1 + the number of tokens with a strictly higher logprob
    top: tuple[tuple[int, float], ...]  # the params.logprobs most likely (token_id, logprob), descending


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where params.logprobs is None


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded row's draw: a pure function of (seed, position)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))


class Sampler:
    """Samples one token per row. Stateless across steps except for the unseeded rows' generator."""

    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._generator = torch.Generator(self.device)  # shared by all unseeded rows
        self._generator.manual_seed(seed)
        self._seeded_generator = torch.Generator(self.device)  # re-seeded per seeded row

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits: expected [{len(rows)}, >={self.vocab_size}], got {list(logits.shape)}")
        if not rows:
            return SamplerOutput([], [])
        # Columns past vocab_size are embedding padding, never real tokens.
        logits = logits[:, : self.vocab_size].float()
        processed = self.processed_logits(logits, rows)
        token_ids = self._choose(processed, rows)
        return SamplerOutput(token_ids.tolist(), self._logprobs(logits, token_ids, rows))

    # -- suppress + penalties (every row) ------------------------------------------------------------

    def processed_logits(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits after suppression and penalties, as greedy rows see them; the input is never written."""
        V = self.vocab_size
        logits = logits[:, :V]
        hits = [(i, t) for i, r in enumerate(rows) for t in r.suppress_token_ids if 0 <= t < V]
        penalised = [i for i, r in enumerate(rows) if _has_penalty(r.params)]
        if not hits and not penalised:
            return logits  # untouched: later steps never write into it
        x = logits.clone()
        if hits:
            ri, ti = zip(*hits)
            x[_long(ri, x.device), _long(ti, x.device)] = _NEG_INF
        if penalised:
            sub = x if len(penalised) == len(rows) else x[_long(penalised, x.device)]
            sub = _apply_penalties(sub, [rows[i] for i in penalised], V)
            if len(penalised) == len(rows):
                return sub
            x[_long(penalised, x.device)] = sub
        return x

    # -- token choice ----------------------------------------------------------------------------------

    def _choose(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not random:
            return x.argmax(dim=-1)
        if len(random) == len(rows):
            return self._sample(x, rows)
        token_ids = x.argmax(dim=-1)
        idx = _long(random, x.device)
        token_ids[idx] = self._sample(x.index_select(0, idx), [rows[i] for i in random])
        return token_ids

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        dev = x.device
        x = x / _col([p.temperature for p in params], dev)  # a fresh tensor: masks below work in place
        if any(p.min_p > 0 for p in params):
            _apply_min_p(x, [p.min_p for p in params])
        top_k = [min(p.top_k, self.vocab_size) for p in params]
        if any(p.top_p < 1 for p in params):
            _apply_top_k_top_p(x, top_k, [p.top_p for p in params])
        elif any(top_k):
            _apply_top_k(x, top_k)
        q = self._noise(rows, dev)
        return x.sub_(q.clamp_min_(_TINY).log_()).argmax(dim=-1)

    def _noise(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """Exp(1) noise [len(rows), V]: seeded rows from (seed, position) alone, the rest from the engine."""
        q = torch.empty(len(rows), self.vocab_size, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            return q.exponential_(generator=self._generator)
        if unseeded:
            idx = _long(unseeded, device)
            q[idx] = torch.empty(len(unseeded), self.vocab_size, device=device).exponential_(
                generator=self._generator
            )
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                self._seeded_generator.manual_seed(noise_seed(r.params.seed, r.position))
                q[i].exponential_(generator=self._seeded_generator)
        return q

    # -- logprobs ---------------------------------------------------------------------------------------

    def _logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> list[TokenLogprobs | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if not wanted:
            return out
        idx = _long(wanted, logits.device)
        raw = logits if len(wanted) == len(rows) else logits.index_select(0, idx)
        lp = torch.log_softmax(raw, dim=-1)  # "raw" logprobs: before penalties and temperature
        chosen = token_ids.index_select(0, idx)[:, None]
        chosen_lp = lp.gather(1, chosen)
        rank = (lp > chosen_lp).sum(dim=-1, keepdim=True) + 1
        k = max(rows[i].params.logprobs or 0 for i in wanted)
        cols = [chosen.double(), chosen_lp.double(), rank.double()]
        if k:
            top_lp, top_ids = lp.topk(k, dim=-1)
            cols += [top_ids.double(), top_lp.double()]
        # One device-to-host copy for the lot (token ids and ranks are exact in float64).
        packed = torch.cat(cols, dim=1).cpu().tolist()
        for i, vals in zip(wanted, packed):
            n = rows[i].params.logprobs or 0
            top = tuple((int(t), lpv) for t, lpv in zip(vals[3 : 3 + n], vals[3 + k : 3 + k + n]))
            out[i] = TokenLogprobs(int(vals[0]), vals[1], int(vals[2]), top)
        return out


# -- batched logit processors (all work in place on x [R, V], in token order) ---------------------------


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def _apply_penalties(x: torch.Tensor, rows: Sequence[SamplingRow], V: int) -> torch.Tensor:
    """Repetition (prompt + output, HF semantics), then frequency and presence (output, OpenAI)."""
    dev = x.device
    params = [r.params for r in rows]
    counts = _token_counts([r.output_token_ids for r in rows], V, dev)
    if any(p.repetition_penalty != 1 for p in params):
        # Rows without a repetition penalty get an empty prompt: their prompt tokens are never needed.
        prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1 else () for r in rows]
        seen = (_token_counts(prompts, V, dev) > 0) | (counts > 0)
        rep = _col([p.repetition_penalty for p in params], dev)
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if any(p.frequency_penalty != 0 for p in params):
        x = x.sub_(counts * _col([p.frequency_penalty for p in params], dev))
    if any(p.presence_penalty != 0 for p in params):
        x = x.sub_((counts > 0).float() * _col([p.presence_penalty for p in params], dev))
    return x


def _token_counts(seqs: Sequence[Sequence[int]], V: int, device: torch.device) -> torch.Tensor:
    """counts[r, t] = occurrences of t in seqs[r], by one scatter_add over a V-padded index tensor."""
    width = max(len(s) for s in seqs)
    counts = torch.zeros(len(seqs), V + 1, device=device)
    if width == 0:
        return counts[:, :V]
    flat: list[int] = []
    for s in seqs:  # one C-level extend per row; padding points at the spare column V
        flat.extend(s)
        flat.extend([V] * (width - len(s)))
    idx = torch.tensor(flat, dtype=torch.long).view(len(seqs), width).to(device, non_blocking=True)
    counts.scatter_add_(1, idx, torch.ones(idx.shape, device=device))
    return counts[:, :V]


def _apply_min_p(x: torch.Tensor, min_p: list[float]) -> None:
    # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p): no softmax needed.
    log_min_p = _col([math.log(m) if m > 0 else _NEG_INF for m in min_p], x.device)
    x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + log_min_p, _NEG_INF)


def _apply_top_k(x: torch.Tensor, top_k: list[int]) -> None:
    # A partial topk up to the largest k beats a full sort; ties with the k-th value are all kept.
    dev = x.device
    kth = x.topk(max(top_k), dim=-1).values.gather(1, _long([max(k, 1) - 1 for k in top_k], dev)[:, None])
    kth.masked_fill_(_long(top_k, dev)[:, None] == 0, _NEG_INF)
    x.masked_fill_(x < kth, _NEG_INF)


def _apply_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    """Top-k, then top-p over the renormalised survivors: keep the fewest top tokens with mass >= p."""
    dev = x.device
    V = x.shape[1]
    ascending, order = x.sort(dim=-1)
    drop = None
    if any(top_k):
        # k = 0 (off) reads column 0, the minimum, so nothing is dropped.
        kth = ascending.gather(1, _long([V - k if k else 0 for k in top_k], dev)[:, None])
        drop = ascending < kth
        ascending.masked_fill_(drop, _NEG_INF)
    mass_below = ascending.softmax(dim=-1).cumsum_(dim=-1)
    # The tail whose cumulative mass stays <= 1 - p can go; the largest token always stays.
    tail = mass_below <= _col([1.0 - p for p in top_p], dev)
    tail[:, -1] = False
    drop = tail if drop is None else drop.logical_or_(tail)
    x.masked_fill_(torch.empty_like(drop).scatter_(1, order, drop), _NEG_INF)


def _col(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)[:, None]


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
