"""The native paged attention for whole steps (decodes and multi-token chunks in one call) against a dense
reference: prefill chunks with and without cached context, GQA groups, head sizes with and without a compiled-in
specialisation, sliding windows, block sizes, chunk lengths around the kernel's tile sizes; a chunk's rows do
not depend on how the chunk was split; and the call reads a strided query view in place."""

import random

import pytest
import torch

from kvrelay.common.records import kv_cache_shape
from kvrelay.engine import kernels as cpu_kernels
from kvrelay.engine.attention.base import AttentionMetadata
from kvrelay.engine.attention.torch_backend import TorchAttentionBackend

native = cpu_kernels.load()
pytestmark = pytest.mark.skipif(native is None or native.attention_isa() == "scalar",
                                reason="native chunk attention needs a C++ compiler and AVX2 or AVX512")


class Step:
    """Requests (cached context, new tokens) with random K/V histories in a shuffled paged cache."""

    def __init__(self, batch, heads, kv_heads, d, bs, dtype, seed=0, q_scale=1.0):
        gen = torch.Generator().manual_seed(seed)
        self.batch, self.heads, self.kv_heads, self.d, self.bs = batch, heads, kv_heads, d, bs
        num_blocks = sum(-(-(c + n) // bs) for c, n in batch) + 4
        free = random.Random(seed).sample(range(num_blocks), num_blocks)
        self.cache = (torch.randn(kv_cache_shape(num_blocks, bs, kv_heads, d), generator=gen) * 50).to(dtype)
        self.keys, self.values, self.tables = [], [], []
        for context, new in batch:
            total = context + new
            k = torch.randn(total, kv_heads, d, generator=gen).to(dtype)
            v = torch.randn(total, kv_heads, d, generator=gen).to(dtype)
            blocks = [free.pop() for _ in range(-(-total // bs))]
            for p in range(total):  # the whole context is in the cache, as after write_kv
                self.cache[0, blocks[p // bs], p % bs] = k[p]
                self.cache[1, blocks[p // bs], p % bs] = v[p]
            self.keys.append(k)
            self.values.append(v)
            self.tables.append(blocks)
        tokens = sum(n for _, n in batch)
        self.q = (torch.randn(tokens, heads, d, generator=gen) * q_scale).to(dtype)

    def call(self, q=None, window=0):
        width = max(len(t) for t in self.tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)
        starts = torch.tensor([0] + [n for _, n in self.batch], dtype=torch.int32).cumsum(0).to(torch.int32)
        lens = torch.tensor([c + n for c, n in self.batch], dtype=torch.int32)
        decodes = sum(1 for _, n in self.batch if n == 1)
        assert all(n == 1 for _, n in self.batch[:decodes])
        q = self.q if q is None else q
        return native.paged_attention(q, None, None, self.cache, None, tables, starts, lens, decodes, self.d**-0.5,
                                      window)

    def reference(self, window=0):
        outs, row = [], 0
        group = self.heads // self.kv_heads
        for (context, new), k, v in zip(self.batch, self.keys, self.values):
            q = self.q[row : row + new].double()
            row += new
            kk, vv = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q, kk) * self.d**-0.5
            qpos = torch.arange(context, context + new)[:, None]
            kpos = torch.arange(context + new)[None, :]
            keep = (kpos <= qpos) & ((kpos > qpos - window) if window > 0 else True)
            outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~keep, float("-inf")).softmax(-1), vv))
        return torch.cat(outs)


def _tolerance(dtype, d):
    # fp32: summation order only. bf16: the output's own rounding (2^-9 relative, values up to ~3), and on
    # AVX512-BF16 the prefill tiles' weights rounded to bf16 for p . v (decodes split them into hi + lo).
    return 2e-5 if dtype == torch.float32 else 4e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d",
                         [(9, 3, 64), (8, 2, 128), (4, 4, 32), (16, 2, 64), (6, 2, 80), (4, 2, 192), (2, 1, 256)])
def test_mixed_step_matches_dense_attention(dtype, heads, kv_heads, d):
    batch = [(0, 1), (40, 1), (130, 1), (0, 37), (19, 45), (100, 16), (0, 2), (300, 70)]
    step = Step(batch, heads, kv_heads, d, 16, dtype)
    out = step.call()
    assert out.dtype == dtype and out.shape == step.q.shape
    assert (out.double() - step.reference()).abs().max().item() < _tolerance(dtype, d)


def test_bf16_decode_error_is_that_of_rounding_the_exact_result():
    """A bf16 cache and queries, SmolLM2's shape, 64 decodes x 600 tokens of context: the kernel's output against
    attention computed in fp64 from the same bf16 numbers. Its error (rms) is that of rounding the exact result
    to bf16; rounding the softmax weights to bf16 for p . v made it 1.35x that. AMX tiles still round them."""
    step = Step([(599, 1)] * 64, 9, 3, 64, 16, torch.bfloat16, q_scale=4.0)  # scores spread as in trained heads
    exact = step.reference()

    def rms(x):
        return x.pow(2).mean().sqrt().item()

    rounding = rms(exact.to(torch.bfloat16).double() - exact)
    assert rms(step.call().double() - exact) <= (1.6 if native.amx_tiles() else 1.02) * rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [300, 700])
def test_windows_over_long_contexts(dtype, window):
    """Windows whose first key lies some segments into the context (the AMX prefill walks 512 keys at a time):
    rows that see nothing in a segment, and rows whose window starts inside one."""
    step = Step([(1200, 1), (1100, 90), (0, 1300)], 6, 2, 64, 16, dtype, seed=11)
    assert (step.call(window=window).double() - step.reference(window)).abs().max().item() < _tolerance(dtype, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 7, 33, 100])
@pytest.mark.parametrize("bs", [16, 4, 1])
def test_windows_and_block_sizes(dtype, window, bs):
    batch = [(5, 1), (90, 1), (0, 50), (61, 40), (200, 33)]
    step = Step(batch, 6, 2, 64, bs, dtype, seed=3)
    out = step.call(window=window)
    assert (out.double() - step.reference(window)).abs().max().item() < _tolerance(dtype, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("new", list(range(2, 20)) + [31, 32, 33, 47, 48, 49, 64, 65])
def test_chunk_lengths_around_the_tiles(new, dtype):
    """Every chunk length from 2 to past the kernels' query tiles (16 tokens x 3 heads, or 5 with 8 lanes; 16-row
    AMX tiles) and key chunks (32): partial tiles, padded rows and padded keys."""
    step = Step([(23, new), (0, new)], 9, 3, 64, 16, dtype, seed=new)
    assert (step.call().double() - step.reference()).abs().max().item() < _tolerance(dtype, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_split_in_two_gives_the_same_rows_bit_for_bit(dtype):
    """A row's result does not depend on the rows computed beside it: prefilling 70 tokens at once, or 29
    then 41 with the first 29 as context, gives identical outputs for the last 41."""
    whole = Step([(0, 70)], 9, 3, 64, 16, dtype, seed=7)
    tail = Step([(29, 41)], 9, 3, 64, 16, dtype, seed=7)
    tail.cache, tail.tables = whole.cache, whole.tables  # same keys and values, same blocks
    tail.q = whole.q[29:]
    assert torch.equal(whole.call()[29:], tail.call())


def test_queries_are_read_in_place_from_a_fused_projection():
    """q as the model passes it: a view of the qkv projection's rows (stride > heads x d)."""
    step = Step([(3, 1), (0, 20)], 9, 3, 64, 16, torch.float32, seed=2)
    qkv = torch.randn(step.q.shape[0], (9 + 6) * 64)
    qkv[:, : 9 * 64] = step.q.reshape(step.q.shape[0], -1)
    view = qkv[:, : 9 * 64].view(-1, 9, 64)
    assert not view.is_contiguous()
    assert torch.equal(step.call(q=view), step.call())


def test_backend_uses_one_native_call_for_a_mixed_step():
    """Through the backend: the mixed step equals the portable gather + SDPA path."""
    batch = [(0, 1), (16, 1), (0, 23), (20, 13)]
    step = Step(batch, 8, 2, 32, 16, torch.float32, seed=4)
    width = max(len(t) for t in step.tables)
    q_lens, seq_lens = [n for _, n in batch], [c + n for c, n in batch]
    slots = [step.tables[i][p // 16] * 16 + p % 16 for i, (c, n) in enumerate(batch) for p in range(c, c + n)]
    meta = AttentionMetadata(
        num_reqs=len(batch), num_decodes=2, num_decode_tokens=2,
        query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_lens_cpu=q_lens, seq_lens_cpu=seq_lens,
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in step.tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), block_size=16,
    )
    new_k = torch.cat([k[c:] for k, (c, _) in zip(step.keys, batch)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(step.values, batch)])
    a = TorchAttentionBackend(use_native=True).forward(step.q, new_k, new_v, step.cache.clone(), meta, 32**-0.5)
    b = TorchAttentionBackend(use_native=False).forward(step.q, new_k, new_v, step.cache.clone(), meta, 32**-0.5)
    assert (a - b).abs().max().item() < 1e-5


@pytest.mark.parametrize("tokens", [1, 2, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_call_writes_the_new_keys_and_values_first(tokens, dtype):
    """k and v as the model passes them (views of the fused qkv rows; with one token their row strides differ)
    land in their slots before anything is read: the result equals writing them first and calling without."""
    heads, kvh, d, bs = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kvh) * d, generator=gen).to(dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d : (heads + kvh) * d].view(tokens, kvh, d)
    v = qkv[:, (heads + kvh) * d :].view(tokens, kvh, d)
    cache = torch.randn(kv_cache_shape(8, bs, kvh, d), generator=gen).to(dtype)
    context = 20  # one request: 20 cached tokens, then the new ones, in shuffled blocks
    tables = torch.tensor([[5, 2, 7, 0, 0, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([int(tables[0, p // bs]) * bs + p % bs for p in range(context, context + tokens)])
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([context + tokens], dtype=torch.int32)
    decodes = 1 if tokens == 1 else 0
    written = cache.clone()
    got = native.paged_attention(q, k, v, written, slots, tables, starts, lens, decodes, d**-0.5, 0)
    want_cache = cache.clone()
    want_cache[0].view(-1, kvh, d)[slots] = k
    want_cache[1].view(-1, kvh, d)[slots] = v
    assert torch.equal(written, want_cache)
    want = native.paged_attention(q, None, None, want_cache, None, tables, starts, lens, decodes, d**-0.5, 0)
    assert torch.equal(got, want)


def _slots_outside(step, window=0):
    """Each request's cache slots its rows must never read: past its context in its last block, and before its
    oldest visible key (window) in its first visible blocks."""
    bs, slots = step.bs, []
    for (context, new), blocks in zip(step.batch, step.tables):
        total = context + new
        outside = list(range(total, len(blocks) * bs))
        if window > 0:  # a decode sees keys (total - window, total - 1]
            first = max(0, total - window)
            outside += range(first // bs * bs, first)
        slots += [blocks[p // bs] * bs + p % bs for p in outside]
    return slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 21])
def test_stale_slots_beside_the_context_never_reach_a_decode(dtype, window):
    """The AMX decode loads whole 16-key tiles from a block: slots past the context (and before a window) hold
    whatever an earlier request left there, NaN included, and must change nothing, bit for bit."""
    batch = [(0, 1), (4, 1), (40, 1), (77, 1), (130, 1), (300, 1)]
    step = Step(batch, 9, 3, 64, 16, dtype, seed=11)
    clean = step.call(window=window)
    for kv in (0, 1):
        step.cache[kv].view(-1, 3, 64)[_slots_outside(step, window)] = float("nan")
    assert torch.equal(step.call(window=window), clean)
    assert torch.isfinite(clean).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, d", [(9, 3, 64), (8, 2, 128), (16, 1, 64), (6, 6, 64)])
def test_decodes_over_contexts_around_the_tiles(dtype, heads, kv_heads, d):
    """Context lengths around the decode tiles (16 keys per score tile, 32 per P V step) and long ones, for
    groups of 3, 4, 16 and 1 query heads per kv head."""
    batch = [(c - 1, 1) for c in (1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 700, 1500)]
    step = Step(batch, heads, kv_heads, d, 16, dtype, seed=d + heads)
    assert (step.call().double() - step.reference()).abs().max().item() < _tolerance(dtype, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_running_maximum_that_keeps_rising(dtype):
    """Scores that grow along the keys (each chunk's maximum far above the last): the sums kept so far are
    rescaled whenever a row's maximum rises (the AMX prefill: from one segment of 512 keys to the next)."""
    step = Step([(100, 60), (0, 200), (1000, 40), (0, 1100)], 9, 3, 64, 16, dtype, seed=5)
    for i, (context, new) in enumerate(step.batch):
        ramp = torch.linspace(0.0, 3.0, context + new)[:, None, None]
        step.keys[i] = (step.keys[i].float().abs() * ramp).to(dtype)  # q . k grows with the key's position
        for p in range(context + new):
            step.cache[0, step.tables[i][p // 16], p % 16] = step.keys[i][p]
    step.q = step.q.float().abs().to(dtype)
    assert (step.call().double() - step.reference()).abs().max().item() < _tolerance(dtype, 64)
