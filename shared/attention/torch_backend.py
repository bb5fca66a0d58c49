"""Portable attention over the paged KV cache, built on torch's scaled_dot_product_attention.

Decodes are batched: their contexts are gathered block by block into one padded tensor and attended in a
single SDPA call with a length mask. Prefill chunks go one request at a time: a chunk with no prior context
attends over its own fresh k/v (no gather); a later chunk gathers its context and uses a causal mask offset
by the context length. Per-step index tensors are built once per metadata object and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionMetadata, write_kv


@dataclass
class _DecodePlan:
    blocks: torch.Tensor  # int64 [num_decodes * blocks_per_req]: block ids to gather, request-major
    max_len: int  # padded context length (a whole number of blocks)
    positions: torch.Tensor  # int64 [max_len]
    seq_lens: torch.Tensor  # int64 [num_decodes, 1]
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # by sliding window

    def mask(self, window: int | None) -> torch.Tensor:
        """bool [num_decodes, 1, 1, max_len]: True where the key is inside the context (and the window)."""
        if window not in self.masks:
            keep = self.positions[None, :] < self.seq_lens
            if window is not None:
                keep &= self.positions[None, :] >= self.seq_lens - window
            self.masks[window] = keep[:, None, None, :]
        return self.masks[window]


@dataclass
class _StepPlan:
    meta: AttentionMetadata  # held so the identity check below cannot match a recycled object
    query_starts: list[int]
    decode: _DecodePlan | None
    prefill_masks: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        self._plan: _StepPlan | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, meta.slot_mapping)
        plan = self._step_plan(meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if plan.decode is not None:
            out[:nd] = self._decode(q[:nd], kv_cache, plan.decode, scale, sliding_window)
        starts = plan.query_starts
        for r in range(nd, meta.num_reqs):
            rows = slice(starts[r], starts[r + 1])
            out[rows] = self._prefill(r, q[rows], k[rows], v[rows], kv_cache, plan, scale, sliding_window)
        return out

    def _step_plan(self, meta: AttentionMetadata) -> _StepPlan:
        if self._plan is not None and self._plan.meta is meta:
            return self._plan
        starts = [0]
        for n in meta.query_lens_cpu:
            starts.append(starts[-1] + n)
        decode = _decode_plan(meta) if meta.num_decodes else None
        self._plan = _StepPlan(meta, starts, decode)
        return self._plan

    @staticmethod
    def _decode(
        q: torch.Tensor, kv_cache: torch.Tensor, plan: _DecodePlan, scale: float, window: int | None
    ) -> torch.Tensor:
        nd, num_heads, d = q.shape
        num_kv_heads = kv_cache.shape[3]
        # [2, nd * nb, bs, kvh, d] -> [2, nd, L, kvh, d] -> heads before length, as SDPA wants.
        kv = kv_cache[:, plan.blocks].view(2, nd, plan.max_len, num_kv_heads, d).transpose(2, 3)
        # One query per request, so the query heads sharing a kv head can stand in as that head's
        # query rows: [nd, kvh, group, d]. No k/v expansion for GQA, and bigger matmuls.
        group = num_heads // num_kv_heads
        qg = q.reshape(nd, num_kv_heads, group, d)
        out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=plan.mask(window), scale=scale)
        return out.reshape(nd, num_heads, d)

    @staticmethod
    def _prefill(
        r: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: _StepPlan,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        meta = plan.meta
        query_len, seq_len = meta.query_lens_cpu[r], meta.seq_lens_cpu[r]
        context_len = seq_len - query_len
        if context_len > 0:
            num_blocks = -(-seq_len // meta.block_size)
            kv = kv_cache[:, meta.block_tables[r, :num_blocks].long()].flatten(1, 2)[:, :seq_len]
            k, v = kv[0], kv[1]
        if context_len == 0 and window is None:
            return _sdpa(q, k, v, scale, mask=None)
        key = (r, window)
        if key not in plan.prefill_masks:
            plan.prefill_masks[key] = _causal_mask(query_len, seq_len, window, q.device)
        return _sdpa(q, k, v, scale, mask=plan.prefill_masks[key])


def _decode_plan(meta: AttentionMetadata) -> _DecodePlan:
    nd, bs = meta.num_decodes, meta.block_size
    max_len = max(meta.seq_lens_cpu[:nd])
    blocks_per_req = -(-max_len // bs)
    device = meta.block_tables.device
    return _DecodePlan(
        blocks=meta.block_tables[:nd, :blocks_per_req].reshape(-1).long(),
        max_len=blocks_per_req * bs,
        positions=torch.arange(blocks_per_req * bs, device=device),
        seq_lens=meta.seq_lens[:nd, None].long(),
    )


def _causal_mask(query_len: int, seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """bool [query_len, seq_len]: query i sits at position seq_len - query_len + i and sees keys up to it."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    return keep


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """One request: q [Lq, H, d], k/v [Lk, kvh, d] -> [Lq, H, d]; causal when no mask is given."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.transpose(0, 1)
