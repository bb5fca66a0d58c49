"""CUDA attention through flash-attn's variable-length kernel, one call per layer for the whole batch.

flash_attn_varlen_func covers decodes and prefill chunks alike: causal masking is aligned to the bottom
right, so a chunk's queries see its prior context plus the causal part of itself. Upstream flash-attn 2.x
reads the paged cache directly (block_table=) only when the block size is a multiple of 256; for smaller
blocks (the engine's default is 16) each step's context is gathered into packed k/v first, with the slot
indices computed once per step on the device (no host sync) and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import AttentionBackend, AttentionMetadata, write_kv
from .torch_backend import TorchAttentionBackend

try:
    from flash_attn import flash_attn_varlen_func
except ImportError as exc:  # the backend is only imported when asked for, so say what is missing
    raise ImportError(
        "attention backend 'flash_attn' needs the flash-attn package (pip install 'flash-attn>=2.6')"
    ) from exc

PAGED_BLOCK_MULTIPLE = 256  # flash-attn 2.x: "Paged KV cache block size must be divisible by 256"
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class _StepPlan:
    meta: AttentionMetadata  # held so the identity check cannot match a recycled object
    cu_seqlens_k: torch.Tensor  # int32 [R + 1]
    slots: torch.Tensor | None  # int64 [sum(seq_lens)]: context slots in request order; None when paged


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"

    def __init__(self) -> None:
        self._plan: _StepPlan | None = None
        self._fallback: TorchAttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        if q.dtype not in _FLASH_DTYPES or kv_cache.dtype != q.dtype:
            # flash-attn has no fp32 kernels; keep fp32 runs (tests, debugging) working.
            self._fallback = self._fallback or TorchAttentionBackend(use_native=False)  # CUDA: no CPU kernels
            return self._fallback.forward(q, k, v, kv_cache, meta, scale, sliding_window)
        write_kv(k, v, kv_cache, meta.slot_mapping)
        plan = self._step_plan(meta)
        # HF's window keeps keys with q_pos - key_pos < W; flash counts keys to the left inclusively.
        window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
        common = dict(
            cu_seqlens_q=meta.query_start_loc,
            cu_seqlens_k=plan.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            softmax_scale=scale,
            causal=True,
            window_size=window,
        )
        if plan.slots is None:
            return flash_attn_varlen_func(q, kv_cache[0], kv_cache[1], block_table=meta.block_tables, **common)
        num_kv_heads, head_size = kv_cache.shape[3], kv_cache.shape[4]
        flat = kv_cache.view(2, -1, num_kv_heads, head_size)
        keys = flat[0].index_select(0, plan.slots)
        values = flat[1].index_select(0, plan.slots)
        return flash_attn_varlen_func(q, keys, values, **common)

    def _step_plan(self, meta: AttentionMetadata) -> _StepPlan:
        if self._plan is not None and self._plan.meta is meta:
            return self._plan
        device = meta.seq_lens.device
        cu_seqlens_k = torch.zeros(meta.num_reqs + 1, dtype=torch.int32, device=device)
        cu_seqlens_k[1:] = torch.cumsum(meta.seq_lens, dim=0)
        slots = None
        if meta.block_size % PAGED_BLOCK_MULTIPLE != 0:
            slots = _context_slots(meta, cu_seqlens_k)
        self._plan = _StepPlan(meta, cu_seqlens_k, slots)
        return self._plan


def _context_slots(meta: AttentionMetadata, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """Cache slot of every context token, request after request (the packed layout of cu_seqlens_k)."""
    device, bs = meta.seq_lens.device, meta.block_size
    total = sum(meta.seq_lens_cpu)  # host-side, so repeat_interleave needs no sync
    requests = torch.arange(meta.num_reqs, device=device)
    owner = torch.repeat_interleave(requests, meta.seq_lens, output_size=total)
    pos = torch.arange(total, device=device) - cu_seqlens_k[owner]
    blocks = meta.block_tables[owner, pos // bs].long()
    return blocks * bs + pos % bs
