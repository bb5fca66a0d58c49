"""The engine on a CUDA device (skipped without one): the torch attention backend against the dense reference,
and the default model on the GPU against HF transformers on the same GPU and weights (greedy, fp32), with
preemption and seeded sampling."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.attention import get_attention_backend
from kvrelay.engine.llm import LLM, SamplingParams
from tests.engine.test_attention import LONG_BATCH, SCALE, Case
from tests.engine.test_engine import CHAT_PROMPTS, RAW_PROMPTS, _assert_all_free, _hf_greedy, _tokens

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 8], ids=["full", "window8"])
@pytest.mark.parametrize("block_size", [16, 4])
def test_torch_backend_on_cuda(dtype, tol, window, block_size):
    case = Case(LONG_BATCH, block_size, dtype, device="cuda")
    q, k, v, meta = case.inputs()
    out = get_attention_backend("torch", "cuda").forward(q, k, v, case.cache, meta, SCALE, window)
    assert out.is_cuda and out.dtype == dtype
    assert (out.float().cpu() - case.reference(window)).abs().max().item() < tol


@pytest.fixture(scope="module")
def cuda_llm(default_model_dir) -> LLM:
    return LLM(model=default_model_dir, dtype="float32", device="cuda", kv_cache_memory=256 * 2**20,
               max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def hf_cuda(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).to("cuda").eval()


def test_engine_runs_on_cuda_with_the_kv_budget_asked(cuda_llm):
    assert cuda_llm.engine.info.device.type == "cuda"
    # kv_cache_memory is honoured on CUDA too (not 90% of the card): 256 MiB of fp32 blocks.
    layout = cuda_llm.engine.kv_layout()
    assert layout.dtype == "float32"
    assert layout.num_blocks == 256 * 2**20 // layout.transfer_nbytes(1)


def test_default_model_greedy_matches_hf_on_cuda(cuda_llm, hf_cuda):
    tok = cuda_llm.tokenizer
    ids = [tok.encode(p) for p in RAW_PROMPTS]
    ids += [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    outs = cuda_llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    eos = cuda_llm.engine.info.eos_token_id
    assert [o.outputs[0].token_ids for o in outs] == [_hf_greedy(hf_cuda, i, 32, eos) for i in ids]
    _assert_all_free(cuda_llm)


def test_preemption_on_cuda_gives_same_tokens(default_model_dir, cuda_llm):
    prompts = [f"Question {i}: why do cats purr? Answer in detail." for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = _tokens(cuda_llm, prompts, params)
    small = LLM(model=default_model_dir, dtype="float32", device="cuda", num_gpu_blocks_override=12,
                max_num_batched_tokens=256)
    got = _tokens(small, prompts, params)
    assert small.engine.counters().num_preemptions > 0
    assert got == expected
    _assert_all_free(small)


def test_seeded_sampling_on_cuda_is_reproducible(cuda_llm):
    p = "Write a short poem about the ocean."
    a, b, c = (_tokens(cuda_llm, [p], SamplingParams(temperature=1.0, seed=s, max_tokens=16))[0] for s in (7, 7, 8))
    assert a == b
    assert a != c


def test_cuda_graphs_give_the_eager_tokens(default_model_dir, cuda_llm):
    # cuda_llm replays CUDA graphs for its decode steps (the default on CUDA); the eager engine launches every
    # kernel. Batches of 1 to 7 rows replay graphs of 1, 2, 4 and 8 (padded) rows.
    assert cuda_llm.engine.runner.graphs is not None
    eager = LLM(model=default_model_dir, dtype="float32", device="cuda", kv_cache_memory=256 * 2**20,
                max_num_batched_tokens=512, enforce_eager=True)
    assert eager.engine.runner.graphs is None
    prompts = [f"Tell me fact number {i} about the moon." for i in range(7)]
    for n in (1, 3, 7):
        params = SamplingParams(temperature=0.0, max_tokens=24 + n, ignore_eos=True)
        assert _tokens(cuda_llm, prompts[:n], params) == _tokens(eager, prompts[:n], params)
    _assert_all_free(cuda_llm)
