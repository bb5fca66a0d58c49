"""The attention backend interface.

A step's batch is flat: the new tokens of R requests laid end to end (no padding), request r owning
rows query_start_loc[r] : query_start_loc[r+1]. Requests are ordered with single-token decodes first
(num_decodes of them), then the multi-token chunks (prefill chunks, first or later). Each request's
attention covers its whole context: seq_lens[r] tokens, the last query_lens[r] of which are the new ones.

The KV cache of one layer is one tensor of shape [2, num_blocks, block_size, num_kv_heads, row]
(kvrelay.common.records.kv_cache_shape; index 0 = keys, 1 = values), a row being head_size values, or for an
int8 cache (`cache_row`) head_size / 16 bytes of fp16 scales, one per 32 values in reverse order, then head_size
int8 values (`quantize_int8`): the scales live beside the values, so every transfer moves them with them.
Token t of the batch writes its key/value at flat slot slot_mapping[t] (= block_id * block_size + offset).
Request r's context lives in blocks block_tables[r, :ceil(seq_len/bs)].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_reqs: int
    num_decodes: int  # leading requests with query_len == 1
    num_decode_tokens: int  # == num_decodes
    query_start_loc: torch.Tensor  # int32 [R+1], on device
    seq_lens: torch.Tensor  # int32 [R], on device
    query_lens_cpu: list[int]  # host copies: backends loop over prefills without syncing
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    block_tables: torch.Tensor  # int32 [R, max_blocks_per_req], on device (unused slots are 0)
    slot_mapping: torch.Tensor  # int64 [T], on device
    block_size: int


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged cache, writing the new K/V first."""

    name: str = "base"

    def graph_safe(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Whether a CUDA graph may capture its decode steps (queries of `dtype`, a cache of `kv_dtype`): they must
        read nothing from the host and take padded rows (slot -1, a one-token context). None does by default."""
        return False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_size]
        k: torch.Tensor,  # [T, num_kv_heads, head_size]
        v: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,  # keys fewer than this many positions before the query (None: all)
    ) -> torch.Tensor:  # [T, num_heads, head_size]
        ...


Q8_GROUP = 32  # values per fp16 scale in an int8 cache


def cache_row(head_size: int, kv_dtype: torch.dtype) -> int:
    """Elements of one head's row in a cache of kv_dtype: its values, plus an int8 row's scales."""
    if kv_dtype != torch.int8:
        return head_size
    if head_size % Q8_GROUP:
        raise ValueError(f"kv_cache_dtype: int8 needs a head size that is a multiple of {Q8_GROUP} (this model's "
                         f"is {head_size}); use fp8")
    return head_size + 2 * (head_size // Q8_GROUP)


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., d] as int8 cache rows [..., d + d / 16]: per group of 32, s = fp16(absmax / 127) and
    q = round-half-even(x / s) clamped to [-127, 127] (0 where s is 0); the scales first, last group's first.
    The native kernels' write (csrc/common.h, quantize_q8_row) computes the same bytes."""
    groups = x.float().unflatten(-1, (-1, Q8_GROUP))
    scale = (groups.abs().amax(-1) / 127).to(torch.float16)
    s = scale.float().unsqueeze(-1)
    q = torch.where(s > 0, torch.round(groups / s).clamp(-127, 127), 0).to(torch.int8).flatten(-2)
    return torch.cat([scale.flip(-1).contiguous().view(torch.int8), q], -1)


def dequantize_int8(rows: torch.Tensor, head_size: int) -> torch.Tensor:
    """int8 cache rows [..., d + d / 16] as float32 values [..., d]."""
    lead = rows.shape[-1] - head_size
    scale = rows[..., :lead].contiguous().view(torch.float16).flip(-1).float()
    values = rows[..., lead:].float().unflatten(-1, (-1, Q8_GROUP))
    return (values * scale.unsqueeze(-1)).flatten(-2)


def as_cached(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of kv_dtype gives it back (fp8: rounded; int8: quantized per group), in x's dtype."""
    if kv_dtype == torch.int8:
        return dequantize_int8(quantize_int8(x), x.shape[-1]).to(x.dtype)
    return x.to(kv_dtype).to(x.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into their slots (the paged equivalent of appending), cast to the cache's dtype
    (fp8 e4m3: rounded to nearest even and saturated at +-448; int8: quantized with their scales)."""
    num_kv_heads = k.shape[1]
    flat = kv_cache.view(2, -1, num_kv_heads, kv_cache.shape[-1])
    if kv_cache.dtype == torch.int8:
        k, v = quantize_int8(k), quantize_int8(v)
    else:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if kv_cache.element_size() == 1:  # torch has no index_copy_ for fp8: move the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
