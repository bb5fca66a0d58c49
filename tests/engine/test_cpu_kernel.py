"""The native CPU decode kernel against the portable gather + SDPA path: same numbers, fp32 and bf16 caches,
full and sliding-window attention, ragged context lengths and shuffled block tables."""

import pytest
import torch

from shared.engine.attention import cpu_kernels
from shared.engine.attention.base import AttentionMetadata
from shared.engine.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler for the native kernel")


def _meta(lens: list[int], tables: torch.Tensor, bs: int) -> AttentionMetadata:
    nd = len(lens)
    slots = [int(tables[i, (n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)]
    return AttentionMetadata(
        num_reqs=nd, num_decodes=nd, num_decode_tokens=nd,
        query_start_loc=torch.arange(nd + 1, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_lens_cpu=[1] * nd, seq_lens_cpu=lens, max_query_len=1, max_seq_len=max(lens),
        block_tables=tables, slot_mapping=torch.tensor(slots), block_size=bs,
    )


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_native_decode_matches_portable_path(kv_dtype, window):
    torch.manual_seed(0)
    bs, nb, heads, kv_heads, d = 16, 128, 9, 3, 64
    lens = [1, 5, 16, 17, 33, 100, 200]
    tables = torch.randperm(nb)[: len(lens) * 13].view(len(lens), 13).int()
    kv = torch.randn(2, nb, bs, kv_heads, d).to(kv_dtype)
    q, k, v = torch.randn(len(lens), heads, d), torch.randn(len(lens), kv_heads, d), torch.randn(len(lens), kv_heads, d)
    kwargs = {"sliding_window": window} if window else {}
    native = TorchAttentionBackend(use_native=True)
    portable = TorchAttentionBackend(use_native=False)
    assert native._native is not None and portable._native is None
    a = native.forward(q, k, v, kv.clone(), _meta(lens, tables, bs), 0.125, **kwargs)
    b = portable.forward(q, k, v, kv.clone(), _meta(lens, tables, bs), 0.125, **kwargs)
    assert (a - b).abs().max().item() < 1e-5
