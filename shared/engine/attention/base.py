"""The attention backend interface.

A step's batch is flat: the new tokens of R requests laid end to end (no padding), request r owning
rows query_start_loc[r] : query_start_loc[r+1]. Requests are ordered with single-token decodes first
(num_decodes of them), then the multi-token chunks (prefill chunks, first or later). Each request's
attention covers its whole context: seq_lens[r] tokens, the last query_lens[r] of which are the new ones.

The KV cache of one layer is one tensor of shape [2, num_blocks, block_size, num_kv_heads, head_size]
(kvrelay.common.records.kv_cache_shape; index 0 = keys, 1 = values). Token t of the batch writes its key/value
at flat slot slot_mapping[t] (= block_id * block_size + offset). Request r's context lives in blocks
block_tables[r, :ceil(seq_len/bs)].
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


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values into their slots (the paged equivalent of appending), cast to the cache's dtype
    (fp8 e4m3: rounded to nearest even and saturated at +-448)."""
    num_kv_heads, head_size = k.shape[1], k.shape[2]
    flat = kv_cache.view(2, -1, num_kv_heads, head_size)
    k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    if kv_cache.element_size() == 1:  # torch has no index_copy_ for fp8: move the bytes
        flat, k, v = flat.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
