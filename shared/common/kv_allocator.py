"""Where a node's KV caches are allocated: the one contract between the engine, which takes an allocator at
construction, and a KV connector that must allocate them itself (shared memory that peers map)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class KVAllocator(Protocol):
    def allocate_kv_caches(
        self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        """One cache per layer, each of `shape` and `dtype` on `device`, zero-filled."""
        ...
