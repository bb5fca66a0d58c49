"""kvrelay.engine.host_memory: zeroed, 2 MiB aligned, huge-page backed where the kernel allows it, and alive for as
long as a view of it is."""

import gc
import mmap
from pathlib import Path

import pytest
import torch

from kvrelay.common.system import huge_pages_on_request
from kvrelay.engine import host_memory


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_shape_dtype_alignment(dtype):
    t = host_memory.zeros((2, 5, 16, 3, 64), dtype, torch.device("cpu"))
    assert t.shape == (2, 5, 16, 3, 64) and t.dtype == dtype and t.is_contiguous()
    assert torch.count_nonzero(t).item() == 0
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert t.data_ptr() % host_memory.HUGE_PAGE == 0


def test_view_keeps_the_mapping_alive():
    t = host_memory.zeros((1024, 1024), torch.float32, torch.device("cpu"))
    view = t[3]
    del t
    gc.collect()
    view.fill_(7.0)  # would fault on an unmapped region
    assert view.sum().item() == 7.0 * 1024


@pytest.mark.skipif(not huge_pages_on_request() or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="transparent huge pages are off here")
def test_backed_by_huge_pages():
    t = host_memory.zeros((4 * host_memory.HUGE_PAGE // 4,), torch.float32, torch.device("cpu"))
    # The kernel may fall back to small pages when it has no free 2 MiB page; then this says so.
    assert _anon_huge_kib(t.data_ptr()) >= 2048
