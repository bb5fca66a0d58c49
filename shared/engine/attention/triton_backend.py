"""The `triton` attention backend: paged attention on CUDA that reads the KV cache in place (triton_kernels.py),
one kernel launch per layer for every decode and prefill chunk of a step, plus one for the K/V write.

A decode-only step reads nothing from the host (no Python lists, no sizes that change with the contexts), so a
CUDA graph can capture it (`graph_safe`): the engine's CUDA graphs (kvrelay.engine.cuda_graphs) replay decode
steps at fixed batch sizes, padded rows carrying slot -1 (written nowhere) and a context of one token.

Caches of another dtype than the queries (fp8, int8 with their scales) go through the torch backend: the
kernels here read K/V in the queries' dtype.
"""

from __future__ import annotations

import torch

from .base import AttentionBackend, AttentionMetadata
from .torch_backend import TorchAttentionBackend

try:
    from . import triton_kernels
except ImportError as exc:  # the backend is only imported when asked for, so say what is missing
    raise ImportError("attention backend 'triton' needs the triton package (CUDA builds of torch ship it)") from exc

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        self._fallback: TorchAttentionBackend | None = None

    def graph_safe(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        """Decode steps run in the kernels here (which take padded rows and read only device tensors) when the cache
        holds the queries' dtype."""
        return dtype in _DTYPES and kv_dtype == dtype

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        if not self.graph_safe(q.dtype, kv_cache.dtype):
            self._fallback = self._fallback or TorchAttentionBackend(use_native=False)
            return self._fallback.forward(q, k, v, kv_cache, meta, scale, sliding_window)
        triton_kernels.write_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        triton_kernels.paged_attention(q, out, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                       meta.num_reqs, meta.max_query_len, scale, sliding_window or 0)
        return out
