"""Our models vs HF transformers on tiny random checkpoints (fp32, teacher-forced logits).

Covers a whole prompt in one step, the same prompt in chunks read back from the paged cache, a prefix-cache
hit (shared blocks reused through the block table), and a mixed decode + prefill batch. Block ids are
shuffled and non-contiguous so paging bugs show.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from kvrelay.common.records import kv_cache_shape
from kvrelay.engine.attention import AttentionMetadata
from kvrelay.engine.models import load_model
from tests.helpers.models import TINY_ARCHS, make_tiny_checkpoint

BLOCK_SIZE = 16
NUM_BLOCKS = 48
TOL = 1e-4
VOCAB = 512


@dataclass
class Seq:
    """One request as the engine sees it: all its tokens so far, its blocks, how many are in the cache."""

    tokens: list[int]
    blocks: list[int]
    computed: int = 0


class Pool:
    """Hands out block ids in a fixed shuffled order, so consecutive blocks are never adjacent."""

    def __init__(self, seed: int = 0) -> None:
        self.free = random.Random(seed).sample(range(1, NUM_BLOCKS), NUM_BLOCKS - 1)

    def blocks_for(self, seq: Seq, upto: int) -> None:
        while len(seq.blocks) * BLOCK_SIZE < upto:
            seq.blocks.append(self.free.pop())


def build_meta(seqs: list[Seq], counts: list[int]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata, input ids and positions for one step computing counts[i] new tokens of seqs[i]."""
    num_decodes = 0
    while num_decodes < len(counts) and counts[num_decodes] == 1:
        num_decodes += 1
    ids, positions, slots, seq_lens = [], [], [], []
    for seq, n in zip(seqs, counts, strict=True):
        span = range(seq.computed, seq.computed + n)
        ids += seq.tokens[span.start : span.stop]
        positions += list(span)
        slots += [seq.blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in span]
        seq_lens.append(span.stop)
    width = max(len(s.blocks) for s in seqs)
    tables = [s.blocks + [0] * (width - len(s.blocks)) for s in seqs]
    starts = [0]
    for n in counts:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        num_reqs=len(seqs),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_lens_cpu=list(counts),
        seq_lens_cpu=seq_lens,
        max_query_len=max(counts),
        max_seq_len=max(seq_lens),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=BLOCK_SIZE,
    )
    return meta, torch.tensor(ids), torch.tensor(positions)


def step(model, caches, seqs: list[Seq], counts: list[int]) -> torch.Tensor:
    """Run one forward over the given new-token counts; returns the logits of every new token."""
    meta, ids, positions = build_meta(seqs, counts)
    with torch.inference_mode():
        logits = model.compute_logits(model(ids, positions, caches, meta))
    for seq, n in zip(seqs, counts, strict=True):
        seq.computed += n
    return logits


def new_caches(model, dtype=torch.float32) -> list[torch.Tensor]:
    shape = kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_size)
    # Garbage, not zeros: a read of a slot that was never written must not go unnoticed.
    return [torch.randn(shape).to(dtype) * 50 for _ in range(model.num_layers)]


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].float()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=TINY_ARCHS)
def models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(str(path), torch.float32, torch.device("cpu"), "torch")
    return request.param, path, hf, ours


def test_whole_prompt(models):
    _, _, hf, model = models
    seq, pool = Seq(tokens(40, 1), []), Pool()
    pool.blocks_for(seq, 40)
    got = step(model, new_caches(model), [seq], [40])
    assert (got - hf_logits(hf, seq.tokens)).abs().max().item() <= TOL


def test_chunked_prompt(models):
    _, _, hf, model = models
    seq, pool, caches = Seq(tokens(40, 2), []), Pool(1), new_caches(model)
    chunks = []
    for n in (7, 16, 17):
        pool.blocks_for(seq, seq.computed + n)
        chunks.append(step(model, caches, [seq], [n]))
    assert (torch.cat(chunks) - hf_logits(hf, seq.tokens)).abs().max().item() <= TOL


def test_prefix_cache_hit(models):
    _, _, hf, model = models
    pool, caches = Pool(2), new_caches(model)
    first = Seq(tokens(40, 3), [])
    pool.blocks_for(first, 40)
    step(model, caches, [first], [40])
    # Same first 32 tokens (two full blocks, reused by id), then its own continuation.
    second = Seq(first.tokens[:32] + tokens(10, 4), first.blocks[:2], computed=32)
    pool.blocks_for(second, 42)
    got = step(model, caches, [second], [10])
    assert (got - hf_logits(hf, second.tokens)[32:]).abs().max().item() <= TOL


def _mixed_batch_setup(model, caches):
    """Three requests ready to decode (prompts of 20, 33, 45) and one prompt of 30 with 12 computed."""
    pool = Pool(3)
    seqs = [Seq(tokens(n, 10 + i), []) for i, n in enumerate((20, 33, 45, 30))]
    for seq, n in zip(seqs, (20, 33, 45, 12), strict=True):
        pool.blocks_for(seq, n)
        step(model, caches, [seq], [n])
    for i, seq in enumerate(seqs[:3]):
        seq.tokens.append(tokens(1, 20 + i)[0])  # the "sampled" token each decode feeds in
        pool.blocks_for(seq, len(seq.tokens))
    pool.blocks_for(seqs[3], 30)
    return seqs


def test_mixed_batch_matches_alone(models):
    _, _, hf, model = models
    caches = new_caches(model)
    seqs = _mixed_batch_setup(model, caches)
    snapshot = [c.clone() for c in caches]
    counts = [1, 1, 1, 18]
    mixed = step(model, caches, [Seq(s.tokens, s.blocks, s.computed) for s in seqs], counts)
    alone = torch.cat([step(model, [c.clone() for c in snapshot], [s], [n]) for s, n in zip(seqs, counts)])
    assert (mixed - alone).abs().max().item() <= TOL
    expected = [hf_logits(hf, s.tokens)[-n:] for s, n in zip(seqs, counts, strict=True)]
    assert (mixed - torch.cat(expected)).abs().max().item() <= TOL


@pytest.mark.parametrize("native", [False, True], ids=["auto-compute", "native-bf16"])
@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_bf16_smoke(arch, native, tmp_path, monkeypatch):
    from kvrelay.engine.models import loader

    if native:  # bf16 matmuls even where the loader would compute in fp32 (CPUs without AVX512/AMX)
        monkeypatch.setattr(loader, "compute_dtype", lambda dtype, device: dtype)
    path = make_tiny_checkpoint(arch, tmp_path)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(str(path), dtype, torch.device("cpu"), "torch")
        assert model.lm_head.weight.dtype == loader.compute_dtype(dtype, torch.device("cpu"))
        caches = new_caches(model, dtype)  # the KV cache is in the requested dtype either way
        seq, pool = Seq(tokens(41, 5), []), Pool(4)
        pool.blocks_for(seq, 41)
        logits[dtype] = torch.cat([step(model, caches, [seq], [40]), step(model, caches, [seq], [1])])
    fp32, bf16 = logits[torch.float32], logits[torch.bfloat16]
    assert bf16.dtype == torch.float32 and torch.isfinite(bf16).all()
    assert (bf16 - fp32).abs().max().item() <= 0.05 * fp32.abs().max().item()


def test_sharded_checkpoint(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_checkpoint("qwen2", tmp_path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(str(path), torch.float32, torch.device("cpu"), "torch")
    seq, pool = Seq(tokens(20, 6), []), Pool(5)
    pool.blocks_for(seq, 20)
    got = step(model, new_caches(model), [seq], [20])
    assert (got - hf_logits(hf, seq.tokens)).abs().max().item() <= TOL


def test_unsupported_architecture_and_rope():
    from kvrelay.engine.models import get_model_class
    from kvrelay.engine.models.rotary import rope_parameters
    from tests.helpers.models import tiny_config

    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model_class("GPT2LMHeadModel")
    config = tiny_config("llama")
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    with pytest.raises(ValueError, match="dynamic"):
        get_model_class("LlamaForCausalLM")(config, None, torch.float32)
    assert rope_parameters(tiny_config("llama3"))["rope_type"] == "llama3"


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_loader_rejects_mismatched_checkpoints(change, tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_checkpoint("llama-tied", tmp_path)
    tensors = load_file(path / "model.safetensors")
    if change == "missing":
        del tensors["model.norm.weight"]
    elif change == "unexpected":
        tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    else:
        tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    match = {"missing": "lacks.*model.norm.weight", "unexpected": "does not know", "shape": "k_proj.*shape"}
    with pytest.raises(ValueError, match=match[change]):
        load_model(str(path), torch.float32, torch.device("cpu"), "torch")


@pytest.mark.parametrize("tile", [7, 100, 8192])
@pytest.mark.parametrize("rows", [6, 300])
def test_greedy_tokens_equal_the_argmax_of_the_logits(models, tile, rows):
    """The head's argmax (no logits materialised: the small GEMM's running argmax up to its row limit, vocabulary
    tiles beyond) picks exactly torch.argmax's token, ties included, and the logits equal one plain matmul's to
    rounding."""
    _, _, _, model = models
    torch.manual_seed(5)
    hidden = torch.randn(rows, model.hidden_size)
    hidden[3] = 0.0  # all-zero logits: every token ties, the first one wins
    model.lm_head.after_load(tile=tile)
    try:
        logits = model.compute_logits(hidden)
        assert logits.shape == (rows, model.vocab_size)
        torch.testing.assert_close(logits, hidden @ model.lm_head.weight.T, rtol=1e-5, atol=1e-5)
        assert torch.equal(model.greedy_tokens(hidden), logits.argmax(dim=-1))
        assert model.greedy_tokens(hidden)[3].item() == 0
    finally:
        model.lm_head.after_load()
