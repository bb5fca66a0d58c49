"""Large, long-lived host tensors (the KV caches, the packed weights' arena) on transparent huge pages.

Decode attention reads each request's blocks in a random order across gigabytes of cache, so on 4 KiB pages
nearly every block read misses the TLB. Where the kernel leaves huge pages to `madvise` (the common default),
torch's allocations never get them: those tensors are mapped here privately, advised MADV_HUGEPAGE, aligned to
2 MiB and touched once up front (measured in docs/results/2026-11-26-xeon-amx/NOTES.md). Off Linux or off the
CPU this is plain `torch.zeros`; with THP off the advice is a no-op.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 * 1024 * 1024


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor; on a Linux CPU, backed by memory advised for huge pages."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if device.type != "cpu" or advice is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(advice)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping for as long as a view of it lives
    start = -raw.data_ptr() % HUGE_PAGE
    out = raw[start : start + nbytes].view(dtype).view(shape)
    out.zero_()  # anonymous pages read as zero already; this faults them in now rather than mid-step
    return out
