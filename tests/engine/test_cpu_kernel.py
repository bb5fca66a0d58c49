"""The native CPU decode kernel against the portable gather + SDPA path: same numbers, fp32 and bf16 caches,
full and sliding-window attention, ragged context lengths and shuffled block tables."""

import pytest
import torch

from kvrelay.engine import kernels as cpu_kernels
from kvrelay.engine.attention.base import AttentionMetadata
from kvrelay.engine.attention.torch_backend import TorchAttentionBackend

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


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 4), (8, 2), (10, 2), (16, 2)])
def test_native_decode_query_groups(kv_dtype, heads, kv_heads):
    """Every split of a kv head's query rows into the kernel's tiles of 3, 2 and 1 (groups 1, 2, 4, 5, 8),
    with block-ragged lengths so each block's token loop has a tail."""
    torch.manual_seed(1)
    bs, nb, d = 16, 64, 64
    lens = [3, 18, 47, 64]
    tables = torch.randperm(nb)[: len(lens) * 4].view(len(lens), 4).int()
    kv = torch.randn(2, nb, bs, kv_heads, d).to(kv_dtype)
    q, k, v = torch.randn(len(lens), heads, d), torch.randn(len(lens), kv_heads, d), torch.randn(len(lens), kv_heads, d)
    a = TorchAttentionBackend(use_native=True).forward(q, k, v, kv.clone(), _meta(lens, tables, bs), 0.125)
    b = TorchAttentionBackend(use_native=False).forward(q, k, v, kv.clone(), _meta(lens, tables, bs), 0.125)
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_native_decode_takes_bf16_queries(kv_dtype):
    """bf16 compute (CPUs with native bf16 matmul) stays on the in-place kernel, returned in bf16. With a bf16
    cache on a CPU with AVX512-BF16, the dot products take bf16 pairs (each weight split into hi + lo for p . v):
    within one bf16 step of the fp32-query result (AMX tiles round the weights to bf16: within bf16 rounding);
    otherwise the queries are widened and the numbers are those of fp32 queries rounded to bf16, exactly."""
    torch.manual_seed(1)
    bs, nb, heads, kv_heads, d = 16, 64, 8, 2, 64
    lens = [3, 40, 90]
    tables = torch.randperm(nb)[: len(lens) * 6].view(len(lens), 6).int()
    kv = torch.randn(2, nb, bs, kv_heads, d).to(kv_dtype)
    q = torch.randn(len(lens), heads, d).to(torch.bfloat16)
    native = cpu_kernels.load()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    got = native.paged_attention(q, None, None, kv, None, tables, starts, seq_lens, len(lens), 0.125, 0)
    want = native.paged_attention(q.float(), None, None, kv, None, tables, starts, seq_lens, len(lens), 0.125, 0)
    assert got.dtype == torch.bfloat16
    if kv_dtype == torch.bfloat16 and native.amx_tiles():
        # p rounded to bf16 (relative 2^-9) over values of size ~1, then the output's own bf16 rounding
        assert (got.float() - want).abs().max().item() < 2e-2
    elif kv_dtype == torch.bfloat16 and native.attention_isa() == "avx512-bf16":
        # sums in another order (q . k) and 16-bit weights: at most one bf16 step (2^-7 relative) from `want`
        assert ((got.float() - want).abs() <= want.abs() * 2**-7 + 1e-6).all()
    else:
        assert torch.equal(got, want.to(torch.bfloat16))


# -- fused elementwise kernels against the torch ops they replace -------------------------------------------


def _ops():
    from kvrelay.engine.models.ops import LayerOps, NativeLayerOps

    return LayerOps(), NativeLayerOps(cpu_kernels.load())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rms_norm(dtype, with_residual):
    torch_ops, native = _ops()
    torch.manual_seed(2)
    x, w = torch.randn(37, 576).to(dtype), torch.randn(576).to(dtype)
    res = torch.randn(37, 576).to(dtype) if with_residual else None
    want, want_res = torch_ops.add_rms_norm(x.clone(), None if res is None else res.clone(), w, 1e-5)
    got, got_res = native.add_rms_norm(x.clone(), None if res is None else res.clone(), w, 1e-5)
    assert torch.equal(got_res, want_res)  # the residual add is exact
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # the sum of squares is vectorised: last-bit differences
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul(dtype):
    torch_ops, native = _ops()
    torch.manual_seed(3)
    gate_up = (torch.randn(19, 2 * 1536) * 4).to(dtype)
    want, got = torch_ops.silu_mul(gate_up.clone()), native.silu_mul(gate_up.clone())
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    assert (got.float() - want.float()).abs().max().item() <= tol * want.float().abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_at_the_ends_of_exp(dtype):
    """Gates where exp(-x) overflows or underflows (the vectorised exp's clamps), in full vectors and the
    scalar tail: silu(x) -> x for large x, -> 0 for very negative x, never NaN; NaN gates stay NaN."""
    _, native = _ops()
    gate = torch.tensor([-1e4, -100.0, -88.5, -88.0, -87.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 87.5, 88.5, 100.0,
                         1e4, -3.0, 3.0, 0.5], dtype=torch.float32)
    gate_up = torch.cat([gate, torch.ones_like(gate)])[None].to(dtype)
    got = native.silu_mul(gate_up.clone())[0].float()
    want = torch.nn.functional.silu(gate.to(dtype).float())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=1e-30)
    nan = native.silu_mul(torch.full((1, 32), float("nan"), dtype=dtype))
    assert torch.isnan(nan).all()


@pytest.mark.parametrize("d", [64, 72])  # 72: half a head is 36, so the vector loops leave a scalar tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_equals_hf_formula(dtype, d):
    """q * cos + rotate_half(q) * sin, as transformers computes it: identical to the last bit (each product
    rounds on its own), and within a rounding of the portable path (which fuses a multiply-add)."""
    torch_ops, native = _ops()
    torch.manual_seed(4)
    freqs = torch.arange(4096).float()[:, None] * (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    qkv = torch.randn(23, (9 + 3 + 3) * d).to(dtype)
    positions = torch.randint(0, 4096, (23,))
    a, b = qkv.clone(), qkv.clone()
    qk_a, qk_b = a[:, : 12 * d].view(23, 12, d), b[:, : 12 * d].view(23, 12, d)
    torch_ops.rope_(qk_a, torch_ops.rope_prepare(cos, sin, positions))
    native.rope_(qk_b, native.rope_prepare(cos, sin, positions))
    x = qkv[:, : 12 * d].view(23, 12, d)
    c = torch.cat([cos[positions], cos[positions]], -1)[:, None]
    s = torch.cat([sin[positions], sin[positions]], -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    hf = x * c + torch.cat([-x2, x1], -1) * s
    assert torch.equal(qk_b, hf)
    assert torch.equal(b[:, 12 * d :], qkv[:, 12 * d :])  # v untouched
    assert (qk_a.float() - hf.float()).abs().max().item() <= (1e-6 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("head_size", [64, 128, 80])
@pytest.mark.parametrize("scale", [0.125, 4.0])
def test_native_decode_softmax_and_dots_at_every_head_size(head_size, scale):
    """The vectorised exp and dot products: peaked scores (scale 4: most weights underflow to 0) and head
    sizes with (64, 128) and without (80) a compiled-in specialisation agree with the portable path."""
    torch.manual_seed(2)
    bs, nb, heads, kv_heads = 16, 96, 6, 2
    lens = [1, 9, 31, 64, 150]
    tables = torch.randperm(nb)[: len(lens) * 10].view(len(lens), 10).int()
    kv = torch.randn(2, nb, bs, kv_heads, head_size)
    q = torch.randn(len(lens), heads, head_size)
    k, v = torch.randn(len(lens), kv_heads, head_size), torch.randn(len(lens), kv_heads, head_size)
    a = TorchAttentionBackend(use_native=True).forward(q, k, v, kv.clone(), _meta(lens, tables, bs), scale)
    b = TorchAttentionBackend(use_native=False).forward(q, k, v, kv.clone(), _meta(lens, tables, bs), scale)
    assert torch.isfinite(a).all()
    # Scores of size ~scale * sqrt(d) carry fp32 rounding of that size; softmax passes it on to the weights.
    assert (a - b).abs().max().item() < 1e-5 * max(1.0, scale * head_size**0.5 / 8)


@pytest.mark.parametrize("k_dim", [576, 1536, 67])
def test_skinny_linear_rows_do_not_depend_on_the_batch(k_dim):
    """Every row of a batch of 1..40 rows equals the same row computed alone, bit for bit (W is walked in
    L2-sized chunks with tiles of 8 rows; N is not a multiple of either), and matches torch's GEMM."""
    torch.manual_seed(3)
    n_out = 1000
    w, bias = torch.randn(n_out, k_dim), torch.randn(n_out)
    x = torch.randn(40, k_dim)
    native = cpu_kernels.load()
    alone = torch.cat([native.skinny_linear(x[i : i + 1], w, bias) for i in range(40)])
    for rows in (1, 3, 8, 9, 17, 32, 40):
        assert torch.equal(native.skinny_linear(x[:rows], w, bias), alone[:rows])
    torch.testing.assert_close(alone, torch.nn.functional.linear(x, w, bias), rtol=1e-4, atol=1e-4)
