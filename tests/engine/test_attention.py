"""Attention backends against a dense reference: batched decodes, fresh and continued prefill chunks, GQA,
sliding windows, bf16, backend selection; flash-attn against the torch backend on a GPU."""

from __future__ import annotations

import importlib
import importlib.util
import random
import sys
import types

import pytest
import torch

from kvrelay.common.records import kv_cache_shape
from kvrelay.engine import kernels as cpu_kernels
from kvrelay.engine.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    get_attention_backend,
)
from kvrelay.engine.attention.base import as_cached, cache_row, dequantize_int8, int8_scales, quantize_int8

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 8, 2, 32
SCALE = HEAD_SIZE**-0.5

# (context already cached, new tokens): decodes first, then a fresh prompt and a continued chunk.
BATCH = [(0, 1), (16, 1), (39, 1), (70, 1), (0, 23), (20, 13), (47, 30)]
# The same with a decode and a chunk long enough to span many 16-token blocks.
LONG_BATCH = [(300, 1), *BATCH, (290, 40)]


class Case:
    """Random k/v histories for a batch of requests, their paged layout, and the step's metadata."""

    def __init__(self, batch, block_size: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0,
                 head_size: int = HEAD_SIZE) -> None:
        lens = [n for _, n in batch]
        # The metadata contract: every single-token decode comes before the first multi-token chunk.
        assert lens[: lens.count(1)] == [1] * lens.count(1), f"decodes must lead the batch: {batch}"
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-(c + n) // block_size) for c, n in batch) + 8
        free = random.Random(seed).sample(range(1, num_blocks), num_blocks - 1)
        self.batch, self.block_size, self.device, self.d = batch, block_size, device, head_size
        self.keys, self.values, self.blocks = [], [], []
        for context, new in batch:
            total = context + new
            self.keys.append(torch.randn(total, NUM_KV_HEADS, self.d, generator=gen).to(dtype))
            self.values.append(torch.randn(total, NUM_KV_HEADS, self.d, generator=gen).to(dtype))
            self.blocks.append([free.pop() for _ in range(-(-total // block_size))])
        num_tokens = sum(new for _, new in batch)
        self.q = torch.randn(num_tokens, NUM_HEADS, self.d, generator=gen).to(dtype)
        shape = kv_cache_shape(num_blocks, block_size, NUM_KV_HEADS, self.d)
        self.cache = (torch.randn(shape, generator=gen) * 100).to(dtype)  # unwritten slots hold garbage
        for i, (context, _) in enumerate(batch):
            slots = self.slots(i, range(context))
            self.cache[0].view(-1, NUM_KV_HEADS, self.d)[slots] = self.keys[i][:context]
            self.cache[1].view(-1, NUM_KV_HEADS, self.d)[slots] = self.values[i][:context]
        self.cache = self.cache.to(device)

    def slots(self, i: int, positions: range) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([self.blocks[i][p // bs] * bs + p % bs for p in positions], dtype=torch.int64)

    def inputs(self):
        """The step's q, new k, new v and metadata, on the case's device."""
        new_k = torch.cat([k[c:] for k, (c, _) in zip(self.keys, self.batch)])
        new_v = torch.cat([v[c:] for v, (c, _) in zip(self.values, self.batch)])
        query_lens = [n for _, n in self.batch]
        seq_lens = [c + n for c, n in self.batch]
        width = max(len(b) for b in self.blocks)
        starts = torch.tensor([0] + query_lens).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(
            num_reqs=len(self.batch),
            num_decodes=sum(1 for n in query_lens if n == 1),
            num_decode_tokens=sum(1 for n in query_lens if n == 1),
            query_start_loc=starts.to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_tables=torch.tensor([b + [0] * (width - len(b)) for b in self.blocks], dtype=torch.int32).to(
                self.device
            ),
            slot_mapping=torch.cat([self.slots(i, range(c, c + n)) for i, (c, n) in enumerate(self.batch)]).to(
                self.device
            ),
            block_size=self.block_size,
        )
        return self.q.to(self.device), new_k.to(self.device), new_v.to(self.device), meta

    def reference(self, window: int | None = None) -> torch.Tensor:
        outs, start = [], 0
        for i, (_, new) in enumerate(self.batch):
            q = self.q[start : start + new].float()
            outs.append(_dense_attention(q, self.keys[i].float(), self.values[i].float(), window, self.d**-0.5))
            start += new
        return torch.cat(outs)


def _dense_attention(q, keys, values, window, scale=SCALE):
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(len(keys) - len(q), len(keys))[:, None]
    k_pos = torch.arange(len(keys))[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_torch_backend_mixed_batch(block_size, window):
    case = Case(BATCH, block_size, torch.float32)
    q, k, v, meta = case.inputs()
    out = TorchAttentionBackend().forward(q, k, v, case.cache, meta, SCALE, sliding_window=window)
    assert out.shape == q.shape
    assert (out - case.reference(window)).abs().max().item() < 1e-5


def test_torch_backend_writes_new_kv():
    case = Case(BATCH, 16, torch.float32)
    q, k, v, meta = case.inputs()
    TorchAttentionBackend().forward(q, k, v, case.cache, meta, SCALE)
    flat = case.cache.view(2, -1, NUM_KV_HEADS, HEAD_SIZE)
    assert torch.equal(flat[0][meta.slot_mapping], k) and torch.equal(flat[1][meta.slot_mapping], v)


def test_torch_backend_bf16():
    case = Case(BATCH, 16, torch.bfloat16)
    q, k, v, meta = case.inputs()
    out = TorchAttentionBackend().forward(q, k, v, case.cache, meta, SCALE)
    assert out.dtype == torch.bfloat16
    assert (out.float() - case.reference()).abs().max().item() < 3e-2


def test_torch_backend_bf16_cache_fp32_compute():
    # The loader computes in fp32 over a bf16 cache on CPUs without fast bf16 matmuls.
    case = Case(BATCH, 16, torch.float32)
    case.cache = case.cache.bfloat16()
    case.keys = [k.bfloat16().float() for k in case.keys]  # what the cache can hold
    case.values = [v.bfloat16().float() for v in case.values]
    q, k, v, meta = case.inputs()
    out = TorchAttentionBackend().forward(q, k, v, case.cache, meta, SCALE)
    assert out.dtype == torch.float32
    assert (out - case.reference()).abs().max().item() < 1e-5


@pytest.mark.parametrize("native", [True, False], ids=["native", "portable"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_a_quantized_cache_equals_attention_over_the_values_it_holds(kv_dtype, compute, native):
    """--kv-cache-dtype fp8 / int8: the kernels read the cache's bytes in place (e4m3 values; int8 values and the
    fp16 scale each 32 carry in their bits) and attend exactly as over those values widened. The step's new rows
    are written as torch casts them (fp8: nearest even, saturated) or as quantize_int8 computes them, byte for
    byte."""
    d = 64  # the vector paths (AVX2, AVX512) of the decode kernels
    case = Case(LONG_BATCH, 16, torch.float32, head_size=d)
    for k in case.keys:  # beyond e4m3's largest finite (448): saturated, not NaN; an int8 group's scale grows
        k[0, 0, :3], k[-1, 1, :3] = torch.tensor([1000.0, -500.0, 449.0]), torch.tensor([-1000.0, 600.0, 3.0])
    case.q = case.q.to(compute).float()  # the reference attends with the query as the step computes it

    def held(x: torch.Tensor, context: int) -> torch.Tensor:  # the cache's rows: the step's new ones via `compute`
        return torch.cat([as_cached(x[:context], kv_dtype), as_cached(x[context:].to(compute), kv_dtype).float()])

    keys = [held(k, c) for k, (c, _) in zip(case.keys, case.batch)]
    values = [held(v, c) for v, (c, _) in zip(case.values, case.batch)]
    flat = case.cache.view(2, -1, NUM_KV_HEADS, d)
    for i, (context, _) in enumerate(case.batch):
        flat[0][case.slots(i, range(context))] = case.keys[i][:context]
    case.cache = quantize_int8(case.cache) if kv_dtype == torch.int8 else case.cache.to(kv_dtype)
    q, k, v, meta = case.inputs()
    backend = TorchAttentionBackend(use_native=native)
    assert backend._native_ok(q.to(compute), case.cache, meta) == (backend._native is not None and native)
    out = backend.forward(q.to(compute), k.to(compute), v.to(compute), case.cache, meta, d**-0.5)
    new = case.cache.view(2, -1, NUM_KV_HEADS, case.cache.shape[-1])[:, meta.slot_mapping]
    for written, fresh in zip(new, (k, v)):
        expected = (quantize_int8(fresh.to(compute)) if kv_dtype == torch.int8 else fresh.to(compute).to(kv_dtype))
        assert torch.equal(written.view(torch.uint8), expected.view(torch.uint8))
    case.keys, case.values = keys, values
    ref = case.reference()
    if compute == torch.float32 and native:
        assert (out - ref).abs().max().item() < 1e-4
    else:  # bf16 rounding of the output
        decodes = meta.num_decodes
        assert (out[:decodes].float() - ref[:decodes]).abs().max().item() < 2e-2
        assert (out.float() - ref).abs().mean().item() < 1e-2


@pytest.mark.parametrize("held", ["random", "every_code"])
def test_an_fp8_cache_attends_as_a_bf16_cache_holding_the_same_values(held):
    """With bf16 queries, the native kernels widen fp8 rows to bf16 (exactly) as they read them and compute as over
    a bf16 cache: decodes and chunks come out the same to the bit as over a bf16 cache holding the fp8 cache's
    values, so the two caches differ in what they store only. (With AMX, tiles compute a bf16 cache.)"""
    native = cpu_kernels.load()
    if native is None or native.amx_tiles():
        pytest.skip("needs the native kernels, computing bf16 caches without AMX tiles")
    d = 64
    case = Case(LONG_BATCH, 16, torch.bfloat16, head_size=d)
    fp8 = case.cache.to(torch.float8_e4m3fn)
    if held == "every_code":  # each of the 254 e4m3 numbers (subnormals too; not the NaN codes), over and over
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
        flat = fp8.view(torch.uint8).view(-1)
        flat.copy_(codes.repeat(flat.numel() // len(codes) + 1)[: flat.numel()])
    q, k, v, meta = case.inputs()
    k, v = (x.to(fp8.dtype).to(torch.bfloat16) for x in (k, v))  # new rows fp8 holds exactly
    backend = TorchAttentionBackend(use_native=True)
    assert backend._native_ok(q, fp8, meta)
    assert meta.num_decodes == 5 and meta.max_query_len == 40  # decodes and chunks, short and long
    fp8_out, bf16_out = (backend.forward(q, k, v, cache, meta, d**-0.5) for cache in (fp8, fp8.to(torch.bfloat16)))
    assert torch.equal(fp8_out, bf16_out)


def test_int8_rows_carry_their_scales_in_their_values_lowest_bits():
    """An int8 row is d bytes: group g's fp16 scale is the lowest bits of its values 16-31 (bit j in value 16 + j),
    those values being the nearest integers of the parity their bit sets."""
    x = torch.tensor([[0.5] * 32 + [-254.0] + [1.0] * 31])
    rows = quantize_int8(x)
    assert rows.shape == (1, 64) and cache_row(64, torch.int8) == 64 and cache_row(64, torch.bfloat16) == 64
    small = torch.tensor(0.5 / 127).half()  # the first group's scale, as fp16 holds it: 0x1C08
    bits = [(small.view(torch.int16).item() >> j) & 1 for j in range(16)]
    assert bits == [0, 0, 0, 1] + [0] * 6 + [1, 1, 1] + [0] * 3
    # y = 0.5 / small = 126.98...: 127 where odd, 126 where the bit says even
    assert rows[0, :32].tolist() == [127] * 16 + [126 + b for b in bits]
    # s = 2.0 = 0x4000, bit 14 only; y = -127 and 0.5 (a tie, to the even half: 0 or 1 by parity)
    assert rows[0, 32:].tolist() == [-127] + [0] * 15 + [0] * 14 + [1, 0]
    assert int8_scales(rows).tolist() == [[small.item(), 2.0]]
    expected = torch.cat([rows[0, :32].float() * small.float(), rows[0, 32:].float() * 2.0])
    assert torch.equal(dequantize_int8(rows), expected[None])
    with pytest.raises(ValueError, match="multiple of 32 .* is 48"):
        cache_row(48, torch.int8)


@pytest.mark.parametrize("seed", range(3))
def test_int8_values_err_by_half_a_step_or_one_where_they_carry_a_scale_bit(seed):
    """Over random rows (and all-zero groups): the scales read back are fp16(absmax / 127), the first 16 values of
    a group are off by at most half a step, the 16 carrying the scale's bits by at most one (plus what the clamp
    at 127 or 126 takes off a group's largest, which the scale's rounding to fp16 may put past 127 steps)."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-3, 3, 64)[:, None]
    x[5, 32:64] = 0
    rows = quantize_int8(x)
    scale = (x.unflatten(-1, (-1, 32)).abs().amax(-1) / 127).half()
    assert torch.equal(int8_scales(rows), scale)
    s = scale.float().clamp_min(1e-30).unsqueeze(-1)
    y = x.unflatten(-1, (-1, 32)) / s
    err = (dequantize_int8(rows).unflatten(-1, (-1, 32)) / s - y).abs()
    assert (err[..., :16] <= 0.5 + (y[..., :16].abs() - 127).clamp_min(0) + 1e-4).all()
    assert (err[..., 16:] <= 1 + (y[..., 16:].abs() - 126).clamp_min(0) + 1e-4).all()
    assert err[..., 16:].max().item() > 0.9  # the bound is reached: those values are a bit coarser
    assert torch.equal(dequantize_int8(rows)[5, 32:64], torch.zeros(32))


def test_the_native_write_quantizes_int8_rows_as_quantize_int8_does_ties_included():
    """Rows whose quotients x / s are halves and integers of the wrong parity (the ties of both roundings), zero
    groups, and subnormal scales: the kernels write the bytes quantize_int8 computes."""
    native = cpu_kernels.load()
    if native is None:
        pytest.skip("needs the native kernels")
    d = 64
    case = Case([(3, 1)] * 8, 16, torch.float32, head_size=d)  # decodes: native on every build
    q, k, v, meta = case.inputs()
    y = torch.randint(-126, 127, (8, d), generator=torch.Generator().manual_seed(0)).float()
    y[2:4] += 0.5  # halves: round-half-even's ties (integers of the wrong parity are the odd/even rounding's)
    y[:, ::32] = 127  # each group's absmax: x / s is y exactly, for the exact scales below
    x = y * torch.tensor([0.5, 0.5, 0.5, 0.5, 0, 2**-20, 3, 3])[:, None]  # a zero row; subnormal fp16 scales
    k[:], v[:] = x[:, None], -x.flip(-1)[:, None]
    cache = torch.zeros(kv_cache_shape(case.cache.shape[1], 16, NUM_KV_HEADS, d), dtype=torch.int8)
    backend = TorchAttentionBackend(use_native=True)
    assert backend._native_ok(q, cache, meta)
    backend.forward(q, k, v, cache, meta, d**-0.5)
    written = cache.view(2, -1, NUM_KV_HEADS, d)[:, meta.slot_mapping]
    assert torch.equal(written[0], quantize_int8(k)) and torch.equal(written[1], quantize_int8(v))


def test_torch_backend_new_metadata_each_step():
    # Per-step plans are reused across layers; a new metadata object must never see a stale one.
    backend = TorchAttentionBackend()
    for seed, batch in enumerate([BATCH, [(5, 1), (60, 1), (0, 9)], [(0, 1), (33, 4)]]):
        case = Case(batch, 16, torch.float32, seed=seed)
        q, k, v, meta = case.inputs()
        for _ in range(2):  # two "layers" over the same step
            out = backend.forward(q, k, v, case.cache, meta, SCALE)
            assert (out - case.reference()).abs().max().item() < 1e-5


def test_get_attention_backend(monkeypatch):
    assert isinstance(get_attention_backend("auto", "cpu"), TorchAttentionBackend)
    assert isinstance(get_attention_backend("torch", torch.device("cpu")), TorchAttentionBackend)
    with pytest.raises(ValueError, match="CUDA"):
        get_attention_backend("flash_attn", "cpu")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("xformers", "cpu")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # as if the package were not installed
    monkeypatch.delitem(sys.modules, "kvrelay.engine.attention.flash_backend", raising=False)
    with pytest.raises(ImportError, match="flash-attn"):
        get_attention_backend("flash_attn", "cuda")


def _fake_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    window_size,
    block_table=None,
):
    """flash-attn's documented semantics in plain torch (bottom-right causal, inclusive windows)."""
    assert causal and q.dtype in (torch.float16, torch.bfloat16) and cu_seqlens_k.dtype == torch.int32
    assert block_table is None or k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
    outs = []
    for b in range(len(cu_seqlens_q) - 1):
        qb = q[cu_seqlens_q[b] : cu_seqlens_q[b + 1]].float()
        if block_table is None:
            kb, vb = (x[cu_seqlens_k[b] : cu_seqlens_k[b + 1]] for x in (k, v))
        else:
            seqlen = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
            kb, vb = (x[block_table[b].long()].flatten(0, 1)[:seqlen] for x in (k, v))
        group = q.shape[1] // k.shape[-2]
        kb, vb = kb.float().repeat_interleave(group, 1), vb.float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", qb, kb) * softmax_scale
        i = torch.arange(len(qb))[:, None] + len(kb) - len(qb)
        j = torch.arange(len(kb))[None, :]
        keep = j <= i
        if window_size[0] >= 0:
            keep &= j >= i - window_size[0]
        probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, vb).to(q.dtype))
    return torch.cat(outs)


@pytest.fixture
def fake_flash_module(monkeypatch):
    """kvrelay.engine.attention.flash_backend imported over a stand-in flash_attn, dropped again afterwards."""
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = _fake_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.delitem(sys.modules, "kvrelay.engine.attention.flash_backend", raising=False)
    yield importlib.import_module("kvrelay.engine.attention.flash_backend")
    sys.modules.pop("kvrelay.engine.attention.flash_backend", None)  # monkeypatch then restores any real one


@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_backend_plumbing_on_cpu(block_size, window, fake_flash_module):
    # No GPU here: run the backend's index and window plumbing against a stand-in kernel.
    FlashAttentionBackend = fake_flash_module.FlashAttentionBackend

    case = Case(BATCH + [(290, 40)], block_size, torch.bfloat16)
    q, k, v, meta = case.inputs()
    backend = FlashAttentionBackend()
    for _ in range(2):  # the second layer reuses the step's plan
        out = backend.forward(q, k, v, case.cache, meta, SCALE, sliding_window=window)
        assert (out.float() - case.reference(window)).abs().max().item() < 3e-2


def _flash_ready() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _flash_ready(), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("block_size", [16, 256])
def test_flash_matches_torch_backend(block_size, window):
    case = Case(LONG_BATCH, block_size, torch.bfloat16, device="cuda")
    q, k, v, meta = case.inputs()
    cache = case.cache.clone()
    flash = get_attention_backend("flash_attn", "cuda").forward(q, k, v, case.cache, meta, SCALE, window)
    torch_out = TorchAttentionBackend().forward(q, k, v, cache, meta, SCALE, window)
    assert torch.equal(case.cache, cache)  # both wrote the same new k/v
    assert (flash.float() - torch_out.float()).abs().max().item() < 2e-2
    assert (flash.float().cpu() - case.reference(window)).abs().max().item() < 3e-2
