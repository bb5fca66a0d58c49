"""Speculative decoding on the default model (SmolLM2-135M-Instruct, fp32) against the same engine without it:
greedy output token-identical with n-gram lookup, a tiny random draft model and the default model as its
own draft, in mixed batches; seeded sampling with n-gram lookup identical to plain seeded sampling; seeded
draft-model sampling reproducible; max_tokens, stop tokens, logprobs and preemption exact."""

from __future__ import annotations

import numpy as np
import pytest

from kvrelay.engine.llm import LLM, SamplingParams
from kvrelay.engine.spec_decode.ngram import ngram_lookup
from tests.helpers.models import make_tiny_checkpoint

TEXT = ("The block pool keeps every KV block in a doubly linked free list, so that a block whose last "
        "reference is dropped goes to the tail and the least recently used block is evicted first.")
RAW = [
    f"Repeat the following text exactly.\nText: {TEXT}\nRepeated text: {TEXT[:40]}",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "# the same function, renamed to fib:\ndef fib(n):\n",
    "The capital of France is",
]
CHAT = ["Name three planets of the solar system.", f"Fix the spelling: {TEXT.replace('block', 'blokc')}"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
KV = 64 * 2**20


def _ids(llm: LLM) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(p) for p in RAW] + [tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT]


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_all_free(llm: LLM) -> None:
    llm.engine.step()
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not llm.engine.kv.req_to_blocks
    assert not llm.engine.runner.states and not llm.engine.runner.drafts


@pytest.fixture(scope="module")
def base(default_model_dir) -> LLM:
    return LLM(model=default_model_dir, dtype="float32", kv_cache_memory=KV)


@pytest.fixture(scope="module")
def base_greedy(base) -> list[list[int]]:
    return _tokens(base, _ids(base), GREEDY)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> str:
    """A random draft with the default model's vocabulary: it proposes, and is mostly wrong."""
    path = tmp_path_factory.mktemp("draft") / "tiny-draft"
    return str(make_tiny_checkpoint("llama", path, vocab_size=49152, max_position_embeddings=8192))


@pytest.fixture(scope="module")
def ngram_llm(default_model_dir) -> LLM:
    return LLM(model=default_model_dir, dtype="float32", kv_cache_memory=KV,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})


def test_ngram_lookup_takes_the_latest_longest_match():
    t = np.array([5, 6, 7, 8, 1, 6, 7, 9, 9, 6, 7])
    assert ngram_lookup(t, 1, 4, 3) == [9, 9, 6]  # "6 7" last seen at 5..6, followed by 9 9 6
    assert ngram_lookup(t, 1, 4, 1) == [9]
    assert ngram_lookup(np.array([1, 2, 3]), 1, 4, 3) == []
    assert ngram_lookup(np.array([4, 4, 4]), 2, 2, 5) == [4]  # a match must leave a token after it


@pytest.mark.parametrize("method", ["ngram", "tiny_draft", "self_draft"])
def test_greedy_identical_in_a_mixed_batch(request, default_model_dir, base, base_greedy, method):
    if method == "ngram":
        llm = request.getfixturevalue("ngram_llm")
    else:
        draft = request.getfixturevalue("tiny_draft") if method == "tiny_draft" else str(default_model_dir)
        llm = LLM(model=default_model_dir, dtype="float32", kv_cache_memory=KV,
                  speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 3})
    before = llm.engine.counters().spec_num_drafts
    prompts = _ids(base)
    # Greedy requests batched with sampled ones (whose drafts are verified by rejection sampling).
    sampled = SamplingParams(temperature=1.0, max_tokens=20)
    outs = llm.generate(prompts + prompts[:2], [GREEDY] * len(prompts) + [sampled] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[: len(prompts)]] == base_greedy
    c = llm.engine.counters()
    assert c.spec_num_drafts > before and c.spec_num_draft_tokens > 0
    if method == "ngram":
        assert c.spec_num_accepted_tokens > 0
    if method == "self_draft":  # the target drafting for itself: its greedy drafts are its greedy tokens
        assert c.spec_num_accepted_tokens >= 0.9 * c.spec_num_draft_tokens
    _assert_all_free(llm)


def test_seeded_ngram_equals_plain_seeded(base, ngram_llm):
    prompts = _ids(base)[:3]
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=24)
    before = ngram_llm.engine.counters().spec_num_accepted_tokens
    assert _tokens(ngram_llm, prompts, params) == _tokens(base, prompts, params)
    assert ngram_llm.engine.counters().spec_num_accepted_tokens > before  # drafts were accepted, not just tried
    _assert_all_free(ngram_llm)


def test_seeded_draft_model_reproducible(default_model_dir, base, tiny_draft):
    llm = LLM(model=default_model_dir, dtype="float32", kv_cache_memory=KV,
              speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3})
    prompts = _ids(base)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=16)
    alone = _tokens(llm, prompts[:1], params)[0]
    others = SamplingParams(temperature=1.0, max_tokens=12)
    mixed = llm.generate(prompts, [others, others, params, others, others], use_tqdm=False)
    # Prompt 0 as the third request of a batch, and again with its prompt now a prefix-cache hit.
    batch = llm.generate([prompts[1], prompts[2], prompts[0]], [others, others, params], use_tqdm=False)
    assert batch[2].outputs[0].token_ids == alone
    assert _tokens(llm, prompts[:1], params)[0] == alone
    assert len(mixed) == 5
    _assert_all_free(llm)


def test_max_tokens_stop_tokens_and_logprobs(base, base_greedy, ngram_llm):
    prompt = _ids(base)[0]
    ref = base_greedy[0]
    exact = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    out = ngram_llm.generate([prompt], exact, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:7] and out.finish_reason == "length"
    # A stop token inside an accepted run ends the request there.
    j = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    stop = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ref[j]])
    out = ngram_llm.generate([prompt], stop, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[: j + 1] and (out.finish_reason, out.stop_reason) == ("stop", ref[j])
    # Logprobs of accepted drafts are the target's, as without speculation.
    lp = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    got = ngram_llm.generate([prompt], lp, use_tqdm=False)[0].outputs[0]
    want = base.generate([prompt], lp, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs) == 16
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.token_id == b.token_id and a.rank == b.rank and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    _assert_all_free(ngram_llm)


def test_preemption_keeps_greedy_output(default_model_dir, base, base_greedy):
    llm = LLM(model=default_model_dir, dtype="float32", num_gpu_blocks_override=9, max_model_len=144,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    prompts = _ids(base)
    assert _tokens(llm, prompts, GREEDY) == base_greedy
    assert llm.engine.counters().num_preemptions > 0
    _assert_all_free(llm)


def test_constrained_requests_get_no_drafts_beside_speculating_ones(base, ngram_llm):
    """A grammar-constrained request in a speculating batch: it is never given drafts (its mask holds for
    one position), its output equals the plain engine's, and its unconstrained neighbours still speculate."""
    from kvrelay.common.sampling_params import StructuredOutputKind, StructuredOutputs

    regex = StructuredOutputs(StructuredOutputKind.REGEX, r"(block|pool|list)( (block|pool|list)){5,9}")
    constrained = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=regex)
    prompts = _ids(base)
    params = [constrained if i % 2 else GREEDY for i in range(len(prompts))]
    want = _tokens(base, prompts, params)
    before = ngram_llm.engine.scheduler.counters.spec_num_draft_tokens
    got = _tokens(ngram_llm, prompts, params)
    assert got == want
    assert ngram_llm.engine.scheduler.counters.spec_num_draft_tokens > before
    text = ngram_llm.tokenizer.decode(got[1])
    assert set(text.split()) <= {"block", "pool", "list"}, text
    _assert_all_free(ngram_llm)
