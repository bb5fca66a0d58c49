"""Attention over the paged KV cache on CPU: the native kernels (kvrelay.engine.kernels: one call per layer for
every decode and prefill chunk of the step, K/V read in place), else a portable path built on torch's
scaled_dot_product_attention, described below (also the CUDA path when flash-attn is not installed).

Decodes are batched: their contexts are gathered block by block into one padded tensor and attended in a
single SDPA call with a length mask. Prefill chunks go one request at a time: a chunk with no prior context
attends over its own fresh k/v (no gather); a later chunk gathers its context and uses a causal mask offset
by the context length. Index tensors and masks are built once per step (per metadata object) and shared by
all layers; gathers land in reused workspace buffers.

Padding and the unused tail of a request's last block are read and masked out, so the cache must hold finite
values there (allocate it with zeros, not empty: NaN garbage would leak through the masked softmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvrelay.engine import kernels as cpu_kernels

from .base import AttentionBackend, AttentionMetadata, as_cached, dequantize_int8, write_kv

# On Hopper GPUs torch picks cuDNN's fused attention for bf16/fp16, and cuDNN builds an execution plan for each
# new shape (tens of ms). Here shapes are new nearly every step (contexts grow, prompt lengths vary): on an H200
# the throughput benchmark ran 3x slower in bf16 (attention in cuDNN, per a profile) than in fp32 (math and
# memory-efficient kernels). Flash and memory-efficient attention build no plans.
_CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class _DecodePlan:
    blocks: torch.Tensor  # int64 [num_decodes * blocks_per_req]: block ids to gather, request-major
    blocks_per_req: int
    positions: torch.Tensor  # int64 [blocks_per_req * block_size]
    seq_lens: torch.Tensor  # int64 [num_decodes, 1]


@dataclass
class _StepPlan:
    meta: AttentionMetadata  # held so the identity check below cannot match a recycled object
    query_starts: list[int]
    decode: _DecodePlan | None
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, use_native: bool = True) -> None:
        self._plan: _StepPlan | None = None
        # The native kernels read K/V in place from the block table; the gather path is the portable fallback
        # (and the path for multi-token chunks on a CPU with neither AVX2 nor AVX512).
        self._native = cpu_kernels.load() if use_native else None
        self._native_chunks = self._native is not None and self._native.attention_isa() != "scalar"
        self._buffers: dict[tuple[torch.dtype, torch.device, int], torch.Tensor] = {}

    def runs_native(self, dtype: torch.dtype, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether a step of `meta` with CPU queries of `dtype` (each head's row contiguous) on this cache runs
        in the native kernel, which writes the step's K/V itself (models/gguf_stack.py calls it directly then)."""
        return (
            self._native is not None
            and kv_cache.device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and kv_cache.dtype in (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
            and kv_cache.is_contiguous()
            and (meta.num_decodes == meta.num_reqs or self._native_chunks)
        )

    def _native_ok(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        return (q.device.type == "cpu" and q.stride(2) == 1 and q.stride(1) == q.shape[2]
                and self.runs_native(q.dtype, kv_cache, meta))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        if self._native_ok(q, kv_cache, meta):
            fused = k.dtype == q.dtype  # then the kernel writes the step's K/V itself before attending
            if not fused:
                write_kv(k, v, kv_cache, meta.slot_mapping)
            # Every row of the step in one call, K/V read in place through the block tables.
            return self._native.paged_attention(q, k if fused else None, v if fused else None, kv_cache,
                                                meta.slot_mapping if fused else None, meta.block_tables,
                                                meta.query_start_loc, meta.seq_lens, meta.num_decodes, scale,
                                                sliding_window or 0)
        if q.is_cuda:  # the backends chosen once per layer: the context manager costs ~12 us a call
            with sdpa_kernel(_CUDA_SDPA_BACKENDS):
                return self._portable(q, k, v, kv_cache, meta, scale, sliding_window)
        return self._portable(q, k, v, kv_cache, meta, scale, sliding_window)

    def _portable(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None):
        write_kv(k, v, kv_cache, meta.slot_mapping)
        if kv_cache.element_size() == 1:  # fp8, int8: a first chunk attends over its K/V as the cache holds
            k, v = as_cached(k, kv_cache.dtype), as_cached(v, kv_cache.dtype)  # them, as the native kernels do
        plan = self._step_plan(meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if plan.decode is not None:
            out[:nd] = self._decode(q[:nd], kv_cache, plan, scale, sliding_window)
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
        self._plan = _StepPlan(meta, starts, _decode_plan(meta) if meta.num_decodes else None)
        return self._plan

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan, scale: float, window: int | None
    ) -> torch.Tensor:
        dec = plan.decode
        assert dec is not None
        nd, num_heads, d = q.shape
        num_kv_heads = kv_cache.shape[3]
        kv = self._gather(kv_cache, dec.blocks, q.dtype)  # [2, nd * nb, bs, kvh, d]
        kv = kv.view(2, nd, -1, num_kv_heads, d).transpose(2, 3)  # [2, nd, kvh, L, d]
        key = ("decode", window, q.dtype)
        if key not in plan.masks:
            plan.masks[key] = _additive(_decode_keep(dec, window), q.dtype)
        # One query per request, so the query heads sharing a kv head can stand in as that head's query
        # rows: [nd, kvh, group, d]. No k/v expansion for GQA; measured faster than enable_gqa on CPU.
        qg = q.reshape(nd, num_kv_heads, num_heads // num_kv_heads, d)
        out = F.scaled_dot_product_attention(qg, kv[0], kv[1], attn_mask=plan.masks[key], scale=scale)
        return out.reshape(nd, num_heads, d)

    def _prefill(
        self,
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
        if seq_len == query_len and window is None:
            return _sdpa(q, k, v, scale, mask=None)  # the whole context is this chunk: plain causal
        if seq_len > query_len:
            blocks = meta.block_tables[r, : -(-seq_len // meta.block_size)].long()
            kv = self._gather(kv_cache, blocks, q.dtype).flatten(1, 2)[:, :seq_len]
            k, v = kv[0], kv[1]
        key = ("prefill", r, window, q.dtype)
        if key not in plan.masks:
            plan.masks[key] = _additive(_causal_keep(query_len, seq_len, window, q.device), q.dtype)
        return _sdpa(q, k, v, scale, mask=plan.masks[key])

    def _gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Keys and values of the given blocks, [2, n, block_size, kvh, head_size], in `dtype`.

        Lands in a reused buffer: fresh tensors this big are mmap'ed and page-faulted on every call, which
        costs more than the copy itself. Valid until the next gather.
        """
        two, num_blocks, *block_shape = kv_cache.shape
        per_block = kv_cache[0, 0].numel()
        index = torch.cat([blocks, blocks + num_blocks])  # keys' blocks then values' blocks, one dim-0 gather
        raw = self._buffer(kv_cache.dtype, kv_cache.device, 0, index.numel() * per_block)
        raw = torch.index_select(kv_cache.view(two * num_blocks, per_block), 0, index, out=raw.view(-1, per_block))
        if kv_cache.dtype == torch.int8:  # values carrying their scales: dequantized (a fresh tensor)
            return dequantize_int8(raw.view(two, blocks.numel(), *block_shape)).to(dtype)
        if dtype != kv_cache.dtype:  # a narrow cache under wider compute (see kvrelay.engine.models.loader)
            raw = self._buffer(dtype, kv_cache.device, 1, raw.numel()).view_as(raw).copy_(raw)
        return raw.view(two, blocks.numel(), *block_shape)

    def _buffer(self, dtype: torch.dtype, device: torch.device, slot: int, numel: int) -> torch.Tensor:
        key = (dtype, device, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


def _decode_plan(meta: AttentionMetadata) -> _DecodePlan:
    nd, bs = meta.num_decodes, meta.block_size
    blocks_per_req = -(-max(meta.seq_lens_cpu[:nd]) // bs)
    device = meta.block_tables.device
    return _DecodePlan(
        blocks=meta.block_tables[:nd, :blocks_per_req].reshape(-1).long(),
        blocks_per_req=blocks_per_req,
        positions=torch.arange(blocks_per_req * bs, device=device),
        seq_lens=meta.seq_lens[:nd, None].long(),
    )


def _decode_keep(dec: _DecodePlan, window: int | None) -> torch.Tensor:
    """bool [num_decodes, 1, 1, L]: True where the key is inside the context (and the window)."""
    keep = dec.positions[None, :] < dec.seq_lens
    if window is not None:
        keep &= dec.positions[None, :] >= dec.seq_lens - window
    return keep[:, None, None, :]


def _causal_keep(query_len: int, seq_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """bool [query_len, seq_len]: query i sits at position seq_len - query_len + i and sees keys up to it."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    k_pos = torch.arange(seq_len, device=device)[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    return keep


def _additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Additive float masks: CPU SDPA measured 2-3x faster with them than with bool masks. Every query
    # keeps at least its own key, so no row is all -inf.
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """One request: q [Lq, H, d], k/v [Lk, kvh, d] -> [Lq, H, d]; causal when no mask is given."""
    # 4-D inputs: on CPU, 3-D ones (or expanded kv heads) miss the fused flash kernel for the math path,
    # which measured 2-5x slower; enable_gqa beat expanding the kv heads.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)
