"""The attention backend interface.

A step's batch is flat: the new tokens of R requests laid end to end (no padding), request r owning
rows query_start_loc[r] : query_start_loc[r+1]. Requests are ordered with single-token decodes first
(num_decodes of them), then the multi-token chunks (prefill chunks, first or later). Each request's
attention covers its whole context: seq_lens[r] tokens, the last query_lens[r] of which are the new ones.

The KV cache of one layer is one tensor of shape [2, num_blocks, block_size, num_kv_heads, row]
(kvrelay.common.records.kv_cache_shape; index 0 = keys, 1 = values), a row being head_size values. An int8
cache's rows (`quantize_int8`) carry their scales inside their values: each group of 32 values has an fp16 scale
whose 16 bits are the lowest bits of the group's last 16 values. So an int8 row is exactly half a bf16 row, and
every transfer moves the scales with the values.
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
Q8_SCALE_BITS = 16  # the group's last 16 values carry its scale's bits, bit j in value 16 + j's lowest bit


def cache_row(head_size: int, kv_dtype: torch.dtype) -> int:
    """Elements of one head's row in a cache of kv_dtype: head_size (an int8 row holds its scales in its values,
    so its head size must be a multiple of 32)."""
    if kv_dtype == torch.int8 and head_size % Q8_GROUP:
        raise ValueError(f"kv_cache_dtype: int8 needs a head size that is a multiple of {Q8_GROUP} (this model's "
                         f"is {head_size}); use fp8")
    return head_size


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., d] as int8 cache rows [..., d]: per group of 32, s = fp16(absmax / 127) and y = x / s (0 where s
    is 0). The first 16 values are round-half-even(y) clamped to [-127, 127]. Value 16 + j is n, the integer
    nearest to y whose lowest bit b is bit j of s (a tie to the n whose (n - b) / 2 is even), clamped to [-127, 127]
    or [-126, 126]: so the group's scale costs no bytes, and those 16 values err by at most 1 instead of 0.5.
    The native kernels' write (csrc/common.h, quantize_q8_row) computes the same bytes."""
    groups = x.float().unflatten(-1, (-1, Q8_GROUP))
    scale = (groups.abs().amax(-1) / 127).to(torch.float16)
    s = scale.float().unsqueeze(-1)
    y = torch.where(s > 0, groups / s, 0)
    lead = Q8_GROUP - Q8_SCALE_BITS
    shifts = torch.arange(Q8_SCALE_BITS, device=x.device, dtype=torch.int32)
    bit = ((scale.view(torch.int16).int().unsqueeze(-1) >> shifts) & 1).float()
    low = torch.round(y[..., :lead]).clamp(-127, 127)
    high = torch.clamp(2 * torch.round((y[..., lead:] - bit) * 0.5) + bit, -126 - bit, 126 + bit)
    return torch.cat([low, high], -1).to(torch.int8).flatten(-2)


def int8_scales(rows: torch.Tensor) -> torch.Tensor:
    """The fp16 scales [..., d / 32] that int8 cache rows [..., d] carry in their values' lowest bits."""
    high = rows.unflatten(-1, (-1, Q8_GROUP))[..., Q8_GROUP - Q8_SCALE_BITS:]
    shifts = torch.arange(Q8_SCALE_BITS, device=rows.device, dtype=torch.int32)
    bits = ((high.int() & 1) << shifts).sum(-1)
    return bits.to(torch.int16).view(torch.float16)


def dequantize_int8(rows: torch.Tensor) -> torch.Tensor:
    """int8 cache rows [..., d] as float32 values [..., d]: each value times its group's scale."""
    values = rows.float().unflatten(-1, (-1, Q8_GROUP))
    return (values * int8_scales(rows).float().unsqueeze(-1)).flatten(-2)


def as_cached(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of kv_dtype gives it back (fp8: rounded; int8: quantized per group), in x's dtype."""
    if kv_dtype == torch.int8:
        return dequantize_int8(quantize_int8(x)).to(x.dtype)
    return x.to(kv_dtype).to(x.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into their slots (the paged equivalent of appending), cast to the cache's dtype
    (fp8 e4m3: rounded to nearest even and saturated at +-448; int8: quantized, scales in the values' bits)."""
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
