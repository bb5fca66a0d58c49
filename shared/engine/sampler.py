"""Token sampler: turns a step's logits into one token per row (vLLM's order of operations).

grammar bitmask -> logit_bias -> suppress -> penalties -> argmax for greedy rows; for the others
temperature -> min_p -> top_k -> top_p, then the exponential race: argmax_i(p_i / q_i) with
q_i = -log(u_i) ~ Exp(1), computed in log space as argmax_i(x_i - log q_i) (the Gumbel-max trick: same
winner, no softmax needed).

Reproducibility: a seeded row's noise comes from a generator seeded with hash(seed, position), one draw of
vocab_size values per row, so its token depends only on its own logits, params, seed and position, never
on the rest of the batch. Which fast path a row takes also depends on that row alone, and every path
races the same elementwise values over the same support.

Structured outputs: a constrained row's disallowed tokens get -inf before anything else (as vLLM does),
so penalties, temperature and top-k/top-p only ever choose among tokens the grammar allows. The mask is
written into the logits of those rows only (the runner hands over a fresh logits tensor each step);
unconstrained rows are never touched, so their tokens do not depend on their neighbours' grammars.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvrelay.common.records import TokenLogprobs
from kvrelay.common.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_TINY = torch.finfo(torch.float32).tiny
_NEG_INF = float("-inf")
# Top-k/top-p look for each row's support among its top 64, 2048, then 16384 tokens before a full sort
# (on CPU: topk 64 costs ~2% of a full sort, 2048 ~15%, 16384 ~40%).
_WINDOWS = (64, 2048, 16384)


class TokenSpan(Sequence[int]):
    """tokens[start:stop] of a request's token list without copying it: a decode step makes a SamplingRow per request,
    and copying 1k-token prompts for each was ~1 ms a step at 256 rows, for rows that mostly read none of it. The
    list may grow past stop afterwards; the span does not."""

    __slots__ = ("_tokens", "_start", "_stop")

    def __init__(self, tokens: list[int], start: int, stop: int) -> None:
        self._tokens, self._start, self._stop = tokens, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self._tokens[self._start:self._stop][i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("token index out of range")
        return self._tokens[self._start + (i % n)]

    def __iter__(self):
        return itertools.islice(self._tokens, self._start, self._stop)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"TokenSpan({list(self)!r})"


@dataclass(slots=True)
class SamplingRow:
    """One token to sample. Not frozen, by measurement: the runner makes one per request per step, and a frozen
    dataclass's __init__ costs ~2.4 us against ~0.4 us. Nothing changes one once made."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    position: int  # index in the sequence of the token being sampled (== len(prompt) + len(output))
    suppress_token_ids: tuple[int, ...] = ()  # forbidden this step (eos + stop ids while output < min_tokens)


@dataclass(frozen=True)
class TokenBitmask:
    """Grammar masks for some rows of a batch: bit t % 32 of words[j, t // 32] set allows token t in row
    rows[j] (the layout of kvrelay.engine.structured)."""

    rows: Sequence[int]
    words: torch.Tensor  # int32 [len(rows), >= ceil(V / 32)]


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

    @staticmethod
    def argmax_only(row: SamplingRow) -> bool:
        """Whether the row's token is just the argmax of its raw logits (greedy; nothing suppressed, biased or
        masked by a grammar; no penalty, no logprobs): the runner may then skip materialising its logits
        (Model.greedy_tokens)."""
        return not row.suppress_token_ids and Sampler.plain_params(row.params)

    @staticmethod
    def plain_params(p: SamplingParams) -> bool:
        """argmax_only as far as the request's parameters decide it (greedy; no penalty, bias, grammar or
        logprobs): all of it for a row that suppresses nothing."""
        return (p.greedy and p.logprobs is None and not _has_penalty(p) and not p.logit_bias
                and p.structured_outputs is None)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], bitmask: TokenBitmask | None = None,
    ) -> SamplerOutput:
        """`bitmask`: grammar masks, written into those rows of `logits` (the caller's tensor) in place."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits: expected [{len(rows)}, >={self.vocab_size}], got {list(logits.shape)}")
        if not rows:
            return SamplerOutput([], [])
        # Columns past vocab_size are embedding padding, never real tokens.
        logits = logits[:, : self.vocab_size].float()
        if bitmask is not None and len(bitmask.rows):
            apply_token_bitmask(logits, bitmask)
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
        biased = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if t < V]
        if not hits and not penalised and not biased:
            return logits  # untouched: later steps never write into it
        x = logits.clone()
        if biased:  # (row, token) pairs are unique: logit_bias is a mapping
            ri, ti, bias = zip(*biased)
            at = (_long(ri, x.device), _long(ti, x.device))
            x[at] = x[at] + torch.tensor(bias, dtype=x.dtype).to(x.device)
        if hits:
            ri, ti = zip(*hits)
            x[_long(ri, x.device), _long(ti, x.device)] = _NEG_INF
        if penalised:
            _apply_penalties(x, _long(penalised, x.device), [rows[i] for i in penalised], V)
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
        token_ids[idx] = self._sample(x[idx], [rows[i] for i in random])
        return token_ids

    def _sample(self, x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        params = [r.params for r in rows]
        dev = x.device
        x = x / _col([p.temperature for p in params], dev)  # a fresh tensor: min_p masks it in place
        if any(p.min_p > 0 for p in params):
            _apply_min_p(x, [p.min_p for p in params])
        u = self._uniform_noise(rows, dev)
        # Rows with top-k/top-p race among their few candidate tokens only; the rest over the vocabulary.
        # A row's route depends on its own params and logits, never on the batch.
        narrow = [i for i, p in enumerate(params) if p.top_p < 1 or p.top_k]
        if not narrow:
            return _race(x, u)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=dev)
        wide = [i for i, p in enumerate(params) if not (p.top_p < 1 or p.top_k)]
        if wide:
            idx = _long(wide, dev)
            token_ids[idx] = _race(x[idx], u[idx])
        narrow_idx = _long(narrow, dev)
        if len(narrow) < len(rows):
            x, u = x[narrow_idx], u[narrow_idx]
        top_k = [min(params[i].top_k, self.vocab_size) for i in narrow]
        top_p = [params[i].top_p for i in narrow]
        for sub, candidates, cand_logits in _narrow_supports(x, top_k, top_p):
            choice = _race(cand_logits, u[sub[:, None], candidates])  # a fresh [n, w] tensor
            token_ids[narrow_idx[sub]] = candidates.gather(1, choice[:, None])[:, 0]
        return token_ids

    def _uniform_noise(self, rows: Sequence[SamplingRow], device: torch.device) -> torch.Tensor:
        """U[0, 1) noise [len(rows), V]: seeded rows from (seed, position) alone, the rest from the engine.

        Uniform rather than exponential_: on CPU exponential_ is several times slower than uniform_ + log.
        """
        u = torch.empty(len(rows), self.vocab_size, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            return u.uniform_(generator=self._generator)
        if unseeded:
            fresh = torch.empty(len(unseeded), self.vocab_size, device=device)
            u[_long(unseeded, device)] = fresh.uniform_(generator=self._generator)
        for i, r in enumerate(rows):
            if r.params.seed is not None:
                self._seeded_generator.manual_seed(noise_seed(r.params.seed, r.position))
                u[i].uniform_(generator=self._seeded_generator)
        return u

    # -- logprobs ---------------------------------------------------------------------------------------

    def logprobs_of(
        self, logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> list[TokenLogprobs | None]:
        """The logprobs of given tokens (chosen elsewhere: speculative decoding's verification)."""
        return self._logprobs(logits[:, : self.vocab_size].float(), token_ids, rows)

    def _logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> list[TokenLogprobs | None]:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if not wanted:
            return out
        idx = _long(wanted, logits.device)
        raw = logits if len(wanted) == len(rows) else logits[idx]
        lp = torch.log_softmax(raw, dim=-1)  # "raw" logprobs: before penalties and temperature
        chosen = token_ids[idx][:, None]
        chosen_lp = lp.gather(1, chosen)
        rank = (lp > chosen_lp).sum(dim=-1, keepdim=True, dtype=torch.int32) + 1
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

@functools.cache
def _bits(device: torch.device) -> torch.Tensor:
    return (torch.ones(32, dtype=torch.int32) << torch.arange(32, dtype=torch.int32)).to(device)


def apply_token_bitmask(x: torch.Tensor, mask: TokenBitmask) -> None:
    """-inf where a constrained row's bit is clear, in place; other rows untouched."""
    n, V = len(mask.rows), x.shape[1]
    words = mask.words[:n].to(x.device, non_blocking=True)
    disallowed = (words[:, :, None] & _bits(x.device)).eq_(0).view(n, -1)[:, :V]
    idx = _long(list(mask.rows), x.device)
    x[idx] = x[idx].masked_fill_(disallowed.bool(), _NEG_INF)


def _has_penalty(p: SamplingParams) -> bool:
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def _apply_penalties(x: torch.Tensor, row_idx: torch.Tensor, rows: Sequence[SamplingRow], V: int) -> None:
    """Repetition (prompt + output, HF semantics), then frequency and presence (output, OpenAI), in place.

    Only the tokens that occurred are touched (gather, adjust, write back), not the whole vocabulary.
    """
    dev = x.device
    params = [r.params for r in rows]
    at = row_idx[:, None]
    if any(p.repetition_penalty != 1 for p in params):
        # Rows without a repetition penalty need none of their (long) prompts.
        seqs = [[*r.prompt_token_ids, *r.output_token_ids] if r.params.repetition_penalty != 1 else ()
                for r in rows]
        idx, _ = _padded(seqs, dev)
        vals = x[at, idx]
        # An empty row's padding (token 0) must come back unchanged.
        rep = _col([p.repetition_penalty if s else 1.0 for p, s in zip(params, seqs)], dev)
        x[at, idx] = torch.where(vals > 0, vals / rep, vals * rep)
    if any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params):
        idx, real = _padded([r.output_token_ids for r in rows], dev)
        counts = torch.zeros(len(rows), V, device=dev).scatter_add_(1, idx, real)
        n = counts.gather(1, idx)  # padding repeats a real token or is token 0 with a count of 0
        freq = _col([p.frequency_penalty for p in params], dev)
        presence = _col([p.presence_penalty for p in params], dev)
        x[at, idx] = x[at, idx] - n * freq - (n > 0).float() * presence


def _padded(seqs: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [n, L] padded with each row's first token (0 if empty), and 1.0 where real, 0.0 where pad.

    Padding duplicates a real token, so writes through these indices carry equal values for equal ids
    and index_put stays deterministic.
    """
    width = max(1, max(len(s) for s in seqs))
    flat: list[int] = []
    for s in seqs:  # one C-level extend per row, no python loop over tokens
        flat.extend(s)
        flat.extend([s[0] if len(s) else 0] * (width - len(s)))
    # numpy converts a long list of python ints about 4x faster than torch.tensor does.
    idx = torch.from_numpy(np.fromiter(flat, dtype=np.int64, count=len(flat))).view(len(seqs), width)
    idx = idx.to(device, non_blocking=True)
    lengths = _long([len(s) for s in seqs], device)
    real = (torch.arange(width, device=device)[None, :] < lengths[:, None]).float()
    return idx, real


def _apply_min_p(x: torch.Tensor, min_p: list[float]) -> None:
    # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p): no softmax needed.
    log_min_p = _col([math.log(m) if m > 0 else _NEG_INF for m in min_p], x.device)
    x.masked_fill_(x < x.amax(dim=-1, keepdim=True) + log_min_p, _NEG_INF)


def _race(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """argmax(p / q) with q = -log(u) ~ Exp(1), as argmax(logits - log q); u is consumed."""
    # Clamped so that a masked -inf can never meet log(q) = -inf and make nan (argmax would pick it).
    log_q = u.log_().neg_().clamp_min_(_TINY).log_()
    return log_q.neg_().add_(logits).argmax(dim=-1)


def _narrow_supports(x: torch.Tensor, top_k: list[int], top_p: list[float]):
    """Top-k, then top-p over the renormalised survivors (the fewest top tokens with mass >= p).

    Yields (rows, candidate token ids [n, w], their logits [n, w], -inf where dropped) per group of rows.
    A full sort of the vocabulary is slow and the support is usually small, so each row is first tried
    in a window of its most likely tokens, and only sorted in full when the window cannot hold its
    support. Whether a row is resolved in a window depends on that row alone.
    """
    n, V = x.shape
    dev = x.device
    k = _long([t or V for t in top_k], dev)[:, None]
    p = _col([q if q < 1 else math.inf for q in top_p], dev)  # inf: top-k only, keep all its survivors
    # Top-p without top-k renormalises over the whole vocabulary.
    lse = x.logsumexp(dim=-1, keepdim=True) if any(t == V for t in top_k) or 0 in top_k else None
    pending = list(range(n))
    for width in [w for w in _WINDOWS if w < V] + [V]:
        idx = _long(pending, dev)
        sub = x if len(pending) == n else x[idx]
        resolved, candidates, cand_logits = _window(sub, width, k[idx], p[idx], None if lse is None else lse[idx])
        yield idx[resolved], candidates[resolved], cand_logits[resolved]
        pending = [i for i, done in zip(pending, resolved.tolist()) if not done]
        if not pending:
            return


def _window(
    x: torch.Tensor, width: int, k: torch.Tensor, p: torch.Tensor, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The support of each row within its `width` most likely tokens: (rows resolved, ids, logits)."""
    V = x.shape[1]
    vals, order = x.sort(dim=-1, descending=True) if width >= V else x.topk(width, dim=-1)
    k_off = k >= V
    kth = vals.gather(1, k.clamp(max=width) - 1)
    # Top-k keeps every tie of the k-th value (as vLLM and HF do). The window holds all survivors unless
    # it ends inside that run of ties; -inf: min_p already left fewer than k tokens, all of them here.
    fits = (k <= width) & ((vals[:, -1:] < kth) | (kth == _NEG_INF) | (width >= V))
    vals = vals.masked_fill_((vals < kth) & ~k_off, _NEG_INF)
    norm = vals.logsumexp(dim=-1, keepdim=True)
    if lse is not None:
        norm = torch.where(k_off, lse, norm)
    probs = (vals - norm).exp_()
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    # A row without top-k is resolved once its window reaches p. The first token always has
    # mass_before == 0 < p, so at least one token survives.
    resolved = fits | (k_off & (probs.sum(dim=-1, keepdim=True) >= p))
    return resolved[:, 0], order, vals.masked_fill_(mass_before >= p, _NEG_INF)


def _col(values: Sequence[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)[:, None]


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
