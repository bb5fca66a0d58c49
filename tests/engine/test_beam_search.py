"""Beam search on the default model (SmolLM2-135M-Instruct, fp32) against HF transformers' generate(num_beams=k,
do_sample=False) on the same weights: every returned beam's tokens and score, for beam widths 2 (five prompts) and 4
(three), and HF's length_penalty / early_stopping semantics; blocks all free after beams finish or abort."""

from __future__ import annotations

import pytest
import torch

from kvrelay.engine.llm import LLM, BeamSearchParams
from tests.engine.test_engine import RAW_PROMPTS

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def llm(default_model_dir) -> LLM:
    return LLM(model=default_model_dir, dtype="float32", kv_cache_memory=128 * 2**20)


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def hf_beams(hf_model, ids: list[int], params: BeamSearchParams) -> list[tuple[list[int], float]]:
    """HF's num_return_sequences = num_beams best beams: (generated tokens, score), best first."""
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=params.beam_width, num_return_sequences=params.beam_width, do_sample=False,
            max_new_tokens=params.max_tokens, length_penalty=params.length_penalty,
            early_stopping=params.early_stopping, return_dict_in_generate=True, output_scores=True,
        )
    beams = []
    for i in range(params.beam_width):
        n = int((out.beam_indices[i] != -1).sum())  # its generated length (the rest is padding)
        beams.append((out.sequences[i, len(ids) : len(ids) + n].tolist(), float(out.sequences_scores[i])))
    return beams


def _assert_all_free(llm: LLM) -> None:
    llm.engine.step()
    pool = llm.engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and not llm.engine.kv.req_to_blocks
    assert not llm.engine.runner.states and not llm.engine.scheduler.beam_groups


@pytest.mark.parametrize("width, num_prompts", [(2, 4), (4, 3)])
def test_beams_equal_hf_num_beams(llm, hf_model, width, num_prompts):
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS)
    ids = [llm.tokenizer.encode(p) for p in RAW_PROMPTS[:num_prompts]]
    outs = llm.beam_search(ids, params)  # all the prompts' beams share the engine's batches
    for prompt_ids, out in zip(ids, outs):
        want = hf_beams(hf_model, prompt_ids, params)
        got = [(s.tokens[len(prompt_ids) :], s.score) for s in out.sequences]
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-4)
        for s in out.sequences:
            assert s.cum_logprob == pytest.approx(s.score * (len(s.tokens) - len(prompt_ids)) ** params.length_penalty,
                                                  abs=1e-4)
    _assert_all_free(llm)


@pytest.mark.parametrize(
    "width, length_penalty, early_stopping",
    [(3, 0.0, True), (2, 2.0, "never"), (3, -0.5, False)],
)
def test_length_penalty_and_early_stopping_as_hf(llm, hf_model, width, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=width, max_tokens=12, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}]),
               llm.tokenizer.encode(RAW_PROMPTS[3])]
    for prompt_ids, out in zip(prompts, llm.beam_search(prompts, params)):
        want = hf_beams(hf_model, prompt_ids, params)
        assert [s.tokens[len(prompt_ids) :] for s in out.sequences] == [t for t, _ in want]
    _assert_all_free(llm)


def test_text_and_finish_reasons(llm):
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    (out,) = llm.beam_search([{"prompt_token_ids": chat}], BeamSearchParams(beam_width=2, max_tokens=40))
    eos = llm.engine.info.eos_token_id
    for s in out.sequences:
        gen = s.tokens[len(chat) :]
        assert s.finish_reason == ("stop" if gen[-1] == eos else "length")
        assert s.text == llm.tokenizer.decode(gen[:-1] if gen[-1] == eos else gen)
    assert any(s.finish_reason == "stop" for s in out.sequences)


def test_abort_mid_search_frees_every_block(llm):
    engine = llm.engine
    ids = llm.tokenizer.encode(RAW_PROMPTS[2] * 3)
    engine.add_beam_search("b1", ids, BeamSearchParams(beam_width=4, max_tokens=64, ignore_eos=True))
    for _ in range(4):
        engine.step()
    group = engine.scheduler.beam_groups["b1"]
    assert len(group.beams) == 4
    # The beams share the prompt's blocks: one reference per beam on each.
    first = engine.kv.req_to_blocks[group.beams[0].req.request_id][0]
    assert first.ref_cnt == 4
    assert engine.abort(["b1"]) == ["b1"]
    _assert_all_free(llm)


def test_bad_beam_params(llm):
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=11))
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, temperature=0.7)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, early_stopping="sometimes")
    assert not llm.engine.has_unfinished()
