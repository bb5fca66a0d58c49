"""A request that resumes elsewhere (mid-stream migration) samples exactly what it would have sampled.

The gateway re-dispatches a failed sequence as prompt + the tokens generated so far, with
`num_resumed_tokens` saying how many of those prompt tokens are output. The continuation must equal the
uninterrupted run token for token: the seeded draw is keyed by absolute position, and max_tokens,
min_tokens, stop ids and the output penalties must count the resumed tokens as output.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.core import EngineCore
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import colocated_engine

PROMPT = [(7 * i + 3) % 500 for i in range(37)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> EngineCore:
    return colocated_engine(str(make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-resume"))), blocks=128)


def _run(engine: EngineCore, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    engine.add_request(rid, prompt, params)
    tokens, reason = [], ""
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            reason = out.finish_reason or reason
    return tokens, reason


CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True, frequency_penalty=1.5,
                                presence_penalty=0.7, repetition_penalty=1.3),
    "greedy-penalties": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_continuation_is_identical(engine, name):
    params = CASES[name]
    full, reason = _run(engine, f"{name}-full", PROMPT, params)
    assert len(full) == 24 and reason == "length"
    for k in (1, 9, 23):
        resumed = replace(params, num_resumed_tokens=k)
        rest, rest_reason = _run(engine, f"{name}-from-{k}", PROMPT + full[:k], resumed)
        assert rest == full[k:], (name, k)
        assert rest_reason == reason


def test_penalties_see_the_resumed_tokens_as_output(engine):
    """Without num_resumed_tokens the frequency penalty would not count the earlier output: another run."""
    params = CASES["greedy-penalties"]
    full, _ = _run(engine, "fp-full", PROMPT, params)
    k = 12
    as_prompt, _ = _run(engine, "fp-as-prompt", PROMPT + full[:k], replace(params, max_tokens=24 - k))
    assert as_prompt != full[k:]  # the check above is not vacuous for this model and prompt


def test_min_tokens_and_stop_ids_count_resumed_output(engine):
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    base, _ = _run(engine, "stop-base", PROMPT, free)
    stop = base[4]
    # The stop id first appears at output 5; min_tokens 8 suppresses it until then.
    params = replace(free, stop_token_ids=(stop,), min_tokens=8)
    full, reason = _run(engine, "stop-full", PROMPT, params)
    assert len(full) >= 8
    for k in (3, 6):
        rest, rest_reason = _run(engine, f"stop-from-{k}", PROMPT + full[:k], replace(params, num_resumed_tokens=k))
        assert rest == full[k:] and rest_reason == reason, (k, rest, full)


def test_prefill_request_resumes_too(engine):
    """max_tokens bounds resumed + new output: a request resumed one token before its limit ends at once."""
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    full, _ = _run(engine, "edge-full", PROMPT, params)
    rest, reason = _run(engine, "edge-last", PROMPT + full[:4], replace(params, num_resumed_tokens=4))
    assert rest == full[4:] and reason == "length"


def test_resume_validation(engine):
    with pytest.raises(ValueError, match="num_resumed_tokens"):
        SamplingParams(max_tokens=4, num_resumed_tokens=4)
    with pytest.raises(ValueError, match="num_resumed_tokens"):
        SamplingParams(num_resumed_tokens=-1)
    with pytest.raises(ValueError, match="num_resumed_tokens"):
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=10, num_resumed_tokens=3))
    assert not engine.has_unfinished()
