"""The small GEMM for decode-sized batches (AVX2 and AVX512 machines): products against float64, rows independent of
the batch bit for bit, bias, output widths that are not a multiple of its 8- or 16-column blocks, and the fused
argmax equal to torch.argmax of the same kernel's logits, ties included."""

import pytest
import torch

from kvrelay.engine import kernels as cpu_kernels
from kvrelay.engine.models import cpu_linear

native = cpu_kernels.load()
pytestmark = pytest.mark.skipif(native is None or not native.small_gemm_available(),
                                reason="the small GEMM needs AVX2 + FMA or AVX512")


def _dtypes():
    # bf16 pairs need AVX512-BF16; elsewhere bf16 layers stay on oneDNN
    return [torch.float32] + ([torch.bfloat16] if native.attention_isa() == "avx512-bf16" else [])


@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (560, 64), (17, 32), (1000, 64), (33, 1536)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64, 131, 300])  # 131, 300: AMX items of 128 rows and a remainder
def test_products_and_bias(n, k, rows):
    for dtype in _dtypes():
        gen = torch.Generator().manual_seed(rows * n)
        w, b = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
        x = torch.randn(rows, k, generator=gen).to(dtype)
        packed = native.pack_small_gemm(w)
        want = x.double() @ w.double().T
        # fp32: summation order; bf16: exact products summed in fp32, then the output's rounding (2^-9 relative)
        tol = 1e-5 * k**0.5 if dtype == torch.float32 else 8e-3 * want.abs().max().item()
        got = native.small_gemm(x, packed, n, None)
        assert got.shape == (rows, n) and got.dtype == dtype
        assert (got.double() - want).abs().max().item() < tol
        assert (native.small_gemm(x, packed, n, b).double() - (want + b.double())).abs().max().item() < tol


def test_rows_do_not_depend_on_the_batch():
    for dtype in _dtypes():
        torch.manual_seed(3)
        w = torch.randn(700, 576).to(dtype)
        x = torch.randn(300, 576).to(dtype)
        packed = native.pack_small_gemm(w)
        alone = torch.cat([native.small_gemm(x[i : i + 1], packed, 700, None) for i in range(300)])
        # 25 and 32: tiles split evenly (5x5; 6+6+5+5+5+5); 129 and 300: more than one AMX item of 128 rows
        for rows in (1, 6, 7, 12, 25, 32, 40, 129, 300):
            assert torch.equal(native.small_gemm(x[:rows], packed, 700, None), alone[:rows])


@pytest.mark.parametrize("n", [576, 560, 960, 3072])
def test_results_do_not_depend_on_the_threads(n):
    """The panel width follows the thread count (576 outputs: panels of 3 blocks on 2 threads, of 4 on one);
    every output's sum runs over K in the same order whatever panel it is in."""
    before = torch.get_num_threads()
    for dtype in _dtypes():
        torch.manual_seed(n)
        w, x = torch.randn(n, 576).to(dtype), torch.randn(32, 576).to(dtype)
        packed = native.pack_small_gemm(w)
        try:
            runs = []
            for threads in (1, 2, 3, 4):
                torch.set_num_threads(threads)
                runs.append((native.small_gemm(x, packed, n, None), native.small_gemm_argmax(x, packed, n)))
        finally:
            torch.set_num_threads(before)
        for logits, best in runs[1:]:
            assert torch.equal(logits, runs[0][0]) and torch.equal(best, runs[0][1])
        assert torch.equal(runs[0][1], runs[0][0].argmax(dim=-1))


def test_argmax_is_that_of_the_logits_ties_to_the_lowest_column():
    for dtype in _dtypes():
        torch.manual_seed(4)
        n = 1000
        w = torch.randn(n, 64).to(dtype)
        w[700] = w[123]  # the same logit twice: column 123 must win wherever it is the largest
        w[999] = w[998]
        x = torch.randn(30, 64).to(dtype)
        x[5] = w[123] * 4  # row 5 peaks at 123 (and 700)
        x[6] = 0  # all logits 0: the first column
        packed = native.pack_small_gemm(w)
        logits = native.small_gemm(x, packed, n, None)
        got = native.small_gemm_argmax(x, packed, n)
        assert torch.equal(got, logits.argmax(dim=-1))
        assert got[5].item() == 123 and got[6].item() == 0


def test_argmax_never_picks_nan_and_an_all_nan_row_gives_column_0():
    for dtype in _dtypes():
        torch.manual_seed(6)
        n = 1000
        w = torch.randn(n, 64).to(dtype)
        w[10] = float("nan")  # column 10 is NaN in every row
        x = torch.randn(40, 64).to(dtype)
        x[3] = w[20] * 4  # without the NaN rule row 3 peaks at 20 anyway
        x[7] = float("nan")  # every logit NaN
        packed = native.pack_small_gemm(w)
        logits = native.small_gemm(x, packed, n, None)
        got = native.small_gemm_argmax(x, packed, n)
        want = logits.float().nan_to_num(nan=float("-inf")).argmax(dim=-1)
        want[7] = 0
        assert torch.equal(got, want)
        assert 10 not in got.tolist() and got[3].item() == 20


def test_linear_layers_pick_the_small_gemm_up_to_its_row_limit():
    torch.manual_seed(5)
    w = torch.randn(300, 128)
    packed = cpu_linear.pack(w)
    assert packed.small is not None and packed.onednn is not None
    assert packed.small_rows == cpu_linear.SMALL_ROWS[native.attention_isa()]
    small = torch.randn(packed.small_rows, 128)
    assert torch.equal(cpu_linear.linear(small, w, None, packed), native.small_gemm(small, packed.small, 300, None))
    big = torch.randn(packed.small_rows + 1, 128)
    torch.testing.assert_close(cpu_linear.linear(big, w, None, packed), big @ w.T, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not native.amx_tiles(), reason="the fused gate|up + SiLU kernel runs on AMX tiles")
@pytest.mark.parametrize("rows", [1, 17, 128, 131, 300])
def test_fused_silu_mul_is_the_unfused_pair_bit_for_bit(rows):
    gen = torch.Generator().manual_seed(rows)
    n, k = 96, 64
    w = (torch.randn(2 * n, k, generator=gen) * 0.2).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    packed = cpu_linear.pack_silu_mul(w)
    got = cpu_linear.silu_mul_linear(x, packed)
    want = native.silu_mul(native.small_gemm(x, native.pack_small_gemm(w), 2 * n, None))
    assert got.shape == (rows, n) and torch.equal(got, want)
    # and within bf16 rounding of the formula in float64
    gu = x.double() @ w.double().T
    ref = torch.nn.functional.silu(gu[:, :n]) * gu[:, n:]
    torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2)


def test_packs_in_an_arena_sit_side_by_side_in_order_and_give_the_same_products():
    """PackArena: each adopted weight is a view of one buffer, 64-byte aligned, right after the one before; a
    weight larger than a buffer stays where it is; a full buffer is followed by a new one."""
    gen = torch.Generator().manual_seed(9)
    weights = [torch.randn(n, 64, generator=gen) for n in (96, 40, 200)]
    plain = [cpu_linear.pack(w, onednn=False) for w in weights]
    sizes = [p.small.numel() * p.small.element_size() for p in plain]
    arena = cpu_linear.PackArena(chunk_bytes=sizes[0] + sizes[1] + 64)  # the third does not fit beside them
    packed = [cpu_linear.pack(w, onednn=False, arena=arena) for w in weights]
    first, second, third = (p.small for p in packed)
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert first.data_ptr() % 64 == 0 and second.data_ptr() - first.data_ptr() == -(-sizes[0] // 64) * 64
    assert third.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()  # a new buffer
    x = torch.randn(5, 64, generator=gen)
    for w, p, q in zip(weights, plain, packed, strict=True):
        assert torch.equal(q.small, p.small)
        assert torch.equal(cpu_linear.linear(x, w, None, q), cpu_linear.linear(x, w, None, p))
    big = cpu_linear.PackArena(chunk_bytes=64).adopt(plain[0].small)
    assert big is plain[0].small  # larger than a buffer: left alone
