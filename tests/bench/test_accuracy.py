"""`kvrelay bench accuracy`: its chunks and scores as llama-perplexity computes them, and its agreement figures."""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.bench.accuracy import (
    CHAT_QUESTIONS,
    agreement,
    chat_prompts,
    chunked_tokens,
    perplexity,
    top1,
    top1_agreement,
)


def test_chunks_are_consecutive_and_start_with_bos_when_the_model_adds_one():
    tokens = list(range(10, 35))
    assert chunked_tokens(tokens, 8, 5, bos=1) == [[1, *range(11, 18)], [1, *range(19, 26)], [1, *range(27, 34)]]
    assert chunked_tokens(tokens, 8, 2, bos=None) == [list(range(10, 18)), list(range(18, 26))]


def test_agreement_counts_tokens_before_the_first_divergence_and_equal_positions():
    ours, reference = [[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]]
    assert agreement(ours, reference) == {"tokens": 8, "before_first_divergence": 6 / 8, "positions_equal": 7 / 8}


def test_an_answer_that_ends_early_or_runs_on_diverges_where_the_shorter_ends():
    reference = [[1, 2, 3, 4], [5, 6]]
    assert agreement([[1, 2], [5, 6, 7]], reference) == {"tokens": 6, "before_first_divergence": 4 / 6,
                                                         "positions_equal": 4 / 6}


def test_top1_agreement_is_the_share_of_equal_positions():
    assert top1_agreement([[1, 2, 3], [4]], [[1, 9, 3], [4]]) == 3 / 4


def test_chat_prompts_are_the_questions_through_the_chat_template(default_tokenizer):
    tokenizer = default_tokenizer
    prompts = chat_prompts(tokenizer)
    assert len(prompts) == len(CHAT_QUESTIONS)
    assert prompts[0] == tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": CHAT_QUESTIONS[0]}]),
                                          add_special_tokens=False)
    assert CHAT_QUESTIONS[0] in tokenizer.decode(prompts[0], skip_special_tokens=False)


def test_perplexity_scores_each_chunks_second_half_as_transformers_would(tmp_path, default_model_dir):
    from transformers import AutoModelForCausalLM

    from kvrelay.engine.llm import LLM
    from tests.helpers.models import make_tiny_with_tokenizer

    path = make_tiny_with_tokenizer(tmp_path / "tiny", default_model_dir)
    chunks = [[(7 * i + 3 * c) % 500 for i in range(32)] for c in range(2)]
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=4 << 20, enable_prefix_caching=False)
    ours = perplexity(llm, chunks)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for chunk in chunks:
            logprobs = torch.log_softmax(hf(torch.tensor([chunk])).logits[0], dim=-1)
            for j in range(16, 31):  # logits at j predict token j + 1: tokens 17..31 of each chunk
                nll -= logprobs[j, chunk[j + 1]].item()
                count += 1
    assert ours == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_top1_is_the_most_likely_token_at_each_continuation_position_as_transformers_has_it(tmp_path,
                                                                                              default_model_dir):
    from transformers import AutoModelForCausalLM

    from kvrelay.engine.llm import LLM
    from tests.helpers.models import make_tiny_with_tokenizer

    path = make_tiny_with_tokenizer(tmp_path / "tiny", default_model_dir)
    prompts, continuations = [[11, 42, 7, 300], [5, 9]], [[17, 23, 99], [401, 2, 2, 64]]
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory=4 << 20, enable_prefix_caching=False)
    ours = top1(llm, prompts, continuations)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for p, c, got in zip(prompts, continuations, ours):
            logits = hf(torch.tensor([p + c])).logits[0]
            assert got == [int(logits[len(p) - 1 + i].argmax()) for i in range(len(c))]
