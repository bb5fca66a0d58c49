"""--kv-cache-dtype fp8 / int8: the engine keeps K/V as e4m3 bytes, or int8 values carrying an fp16 scale per 32
in their lowest bits (kvrelay.engine.attention, csrc kernels).

What it buys: the same memory holds 4x the tokens of a float32 cache (2x bf16) in either, and a transfer moves
that much fewer bytes. What it must keep: the tokens the engine would compute
over K/V as the cache holds them (a beam's forked blocks copied byte for byte), and hashes of its own (the gateway
hashes prompts the same way).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvrelay.common.hashing import prompt_block_hashes
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.block_pool import BlockPool
from kvrelay.engine.config import EngineConfig
from kvrelay.engine.core import EngineCore
from kvrelay.engine.kv_cache_manager import KVCacheManager
from kvrelay.engine.llm import LLM, BeamSearchParams
from kvrelay.engine.request import Request
from tests.helpers.models import make_tiny_checkpoint, make_tiny_with_tokenizer

MEMORY = 3 * 2**20


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny")))


def core(model: str, dtype: str, kv: str, **kw) -> EngineCore:
    return EngineCore(EngineConfig().with_kwargs(model=model, dtype=dtype, device="cpu", kv_cache_memory=MEMORY,
                                                 kv_cache_dtype=kv, **kw))


def test_fp8_holds_four_times_float32_and_twice_bf16_tokens_in_the_same_memory(tiny):
    f32, bf16, fp8 = core(tiny, "float32", "auto"), core(tiny, "bfloat16", "auto"), core(tiny, "float32", "fp8")
    assert fp8.num_blocks == 4 * f32.num_blocks == 2 * bf16.num_blocks
    layout = fp8.kv_layout()
    assert layout.dtype == "float8_e4m3fn" and {c.dtype for c in fp8.runner.kv_caches} == {torch.float8_e4m3fn}
    assert 4 * layout.transfer_nbytes(10) == f32.kv_layout().transfer_nbytes(10)
    with pytest.raises(ValueError, match="kv_cache_dtype: unknown 'int4'"):
        core(tiny, "float32", "int4")
    with pytest.raises(ValueError, match="int8 needs a head size that is a multiple of 32 .*is 16"):
        core(tiny, "float32", "int8")


def test_int8_holds_four_times_float32_and_twice_bf16_tokens_in_the_same_memory(tmp_path):
    """Heads of 32: a row is 32 bytes, its scale in its values' bits, so 4x the tokens of float32 (2x bf16)."""
    model = str(make_tiny_checkpoint("llama", tmp_path, head_dim=32))
    f32, bf16, q8 = core(model, "float32", "auto"), core(model, "bfloat16", "auto"), core(model, "float32", "int8")
    assert q8.kv_layout().head_size == 32 and q8.kv_layout().dtype == "int8"
    assert q8.num_blocks == MEMORY // (3 * 2 * 16 * 2 * 32) == 4 * f32.num_blocks == 2 * bf16.num_blocks
    assert 4 * q8.kv_layout().transfer_nbytes(10) == f32.kv_layout().transfer_nbytes(10)


def test_the_engine_hashes_fp8_blocks_as_the_gateway_routes():
    tokens = list(range(64))
    kv = KVCacheManager(BlockPool(16), 16, "m", kv_dtype="fp8_e4m3")
    req = Request("r", tokens, SamplingParams())
    kv.update_block_hashes(req)
    assert req.block_hashes == prompt_block_hashes(tokens, "m", 16, kv_dtype="fp8_e4m3")
    assert set(req.block_hashes).isdisjoint(prompt_block_hashes(tokens, "m", 16))


@pytest.mark.parametrize("kv", ["fp8", "int8"])
def test_beams_with_forked_blocks_equal_beams_that_never_share_a_block(tmp_path, default_model_dir, kv):
    """Beams fork mid-block and copy the shared block before writing (copy-on-write, byte for byte: fp8 values,
    int8 values with their scales); with one-token blocks no block is ever written after it is shared. The same
    cached values either way: the same beams."""
    model = str(make_tiny_with_tokenizer(tmp_path / "m", Path(default_model_dir), head_dim=32))
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + 3 * i for i in range(21)]}, {"prompt_token_ids": list(range(100, 140))}]
    beams = []
    for block_size in (16, 1):
        llm = LLM(model=model, dtype="float32", kv_cache_memory=MEMORY, kv_cache_dtype=kv, block_size=block_size,
                  enable_prefix_caching=False)
        outs = llm.beam_search(prompts, params)
        beams.append([[(s.tokens, round(s.score, 4)) for s in out.sequences] for out in outs])
        assert llm.engine.kv.num_free_blocks == llm.engine.num_blocks
    assert beams[0] == beams[1]
    assert len({tuple(t) for t, _ in beams[0][0]}) == 3
