"""End-to-end engine tests on the default model (SmolLM2-135M-Instruct, fp32): against HF transformers,
batch invariance, bad input, n > 1, preemption and abort."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.llm import LLM, SamplingParams

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "To make a cup of tea, first",
]
CHAT_PROMPTS = [
    "What is the boiling point of water?",
    "Write a haiku about autumn.",
    "Name three planets of the solar system.",
    "How do I reverse a list in Python?",
    "Give me a tip for learning a new language.",
]
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def llm(default_model_dir) -> LLM:
    return LLM(model=default_model_dir, dtype="float32", kv_cache_memory=256 * 2**20, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def _hf_greedy(hf_model, ids: list[int], n: int, eos: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids], device=hf_model.device),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=hf_model.device),
            max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos,
        )
    return out[0, len(ids):].tolist()


def _assert_all_free(llm: LLM) -> None:
    llm.engine.step()  # an empty step tells the runner which requests ended, so it drops their state
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not llm.engine.kv.req_to_blocks
    assert not llm.engine.runner.states


@pytest.mark.parametrize("chat", [False, True], ids=["raw", "chat"])
def test_greedy_matches_hf_generate(llm, hf_model, chat):
    prompts = CHAT_PROMPTS if chat else RAW_PROMPTS
    tok = llm.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) if chat else tok.encode(p) for p in prompts]
    outs = llm.generate(ids, GREEDY_32, use_tqdm=False)
    eos = llm.engine.info.eos_token_id
    for prompt_ids, out in zip(ids, outs):
        expected = _hf_greedy(hf_model, prompt_ids, 32, eos)
        assert out.outputs[0].token_ids == expected
    assert any(len(o.outputs[0].token_ids) == 32 for o in outs)
    _assert_all_free(llm)


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0, max_tokens=24),
     SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=24)],
    ids=["greedy", "seeded"],
)
def test_batch_invariance(default_model_dir, llm, params):
    target = "Explain why the sky is blue in one paragraph. " * 3
    alone = _tokens(llm, [target], params)[0]
    others = [f"Story number {i}: a fox and a crow" for i in range(6)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=20)
    mixed = llm.generate([*others[:3], target, *others[3:]], [unseeded] * 3 + [params] + [unseeded] * 3,
                         use_tqdm=False)
    assert mixed[3].outputs[0].token_ids == alone
    # Same request again: its prompt blocks are now a prefix-cache hit.
    again = llm.generate([target], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == alone
    # Small chunks: the prompt is computed over several steps.
    chunked = LLM(model=default_model_dir, dtype="float32", kv_cache_memory=64 * 2**20,
                  max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _tokens(chunked, [target], params)[0] == alone
    _assert_all_free(llm)


def test_seed_reproducible_and_distinct(llm):
    p = "Write a short poem about the ocean."
    a = _tokens(llm, [p], SamplingParams(temperature=1.0, seed=7, max_tokens=16))[0]
    b = _tokens(llm, [p], SamplingParams(temperature=1.0, seed=7, max_tokens=16))[0]
    c = _tokens(llm, [p], SamplingParams(temperature=1.0, seed=8, max_tokens=16))[0]
    assert a == b
    assert a != c


def test_n_children_share_prompt_blocks(llm):
    prompt = "List some facts about the moon. " * 6
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Children after the first hit the first child's prompt blocks.
    assert out.num_cached_tokens >= 16 * ((len(out.prompt_token_ids) - 1) // 16) - 16
    _assert_all_free(llm)


def test_bad_input_raises_and_keeps_serving(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([[]], GREEDY_32, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([[1, 2, vocab + 5]], GREEDY_32, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * llm.engine.max_model_len], GREEDY_32, use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="^n:"):
        SamplingParams(n=0)
    # A bad prompt in a batch rejects the batch before anything is queued.
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["fine prompt", [vocab]], GREEDY_32, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    _assert_all_free(llm)
    assert len(_tokens(llm, ["still serving"], SamplingParams(max_tokens=4, ignore_eos=True))[0]) == 4


def test_engine_abort_mid_generation_frees_blocks(llm):
    eng = llm.engine
    eng.add_request("a", llm.tokenizer.encode("Tell me a long story about dragons."),
                    SamplingParams(max_tokens=200, ignore_eos=True))
    eng.add_request("b", llm.tokenizer.encode("Count to ten."), SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.abort(["a"]) == ["a"]
    finished = []
    while eng.has_unfinished():
        finished += [o for o in eng.step() if o.finish_reason]
    assert [o.req_id for o in finished] == ["b"]
    _assert_all_free(llm)


def test_preemption_gives_same_tokens(default_model_dir, llm):
    prompts = [f"Question {i}: why do cats purr? Answer in detail." for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = _tokens(llm, prompts, params)
    # 12 blocks of 16 tokens cannot hold six requests of ~56 tokens: the scheduler must preempt.
    small = LLM(model=default_model_dir, dtype="float32", num_gpu_blocks_override=12, max_num_batched_tokens=256)
    got = _tokens(small, prompts, params)
    assert small.engine.counters().num_preemptions > 0
    assert got == expected
    _assert_all_free(small)
