"""Structured outputs across real prefill and decode processes: the prefill node samples the first token
under the grammar, the decode node rebuilds the matcher from the grammar's source and that token, and the
output equals the colocated engine's (greedy and seeded). Prompt logprobs come back with the hand-off, a
bad grammar is refused before anything is reserved, and logit_bias crosses the wire."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import grpc
import pytest

from kvrelay.common.sampling_params import SamplingParams, StructuredOutputKind, StructuredOutputs
from tests.helpers.models import make_tiny_with_tokenizer
from tests.helpers.nodes import (
    all_blocks_free,
    colocated_engine,
    disaggregated,
    generate,
    reserve,
    rpc_error,
    run_colocated,
    start_nodes,
    stop_nodes,
    tiny_args,
    wait_for,
)

SCHEMA = {"type": "object", "properties": {
    "kind": {"type": "string", "enum": ["cat", "dog"]},
    "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    "names": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 2}},
    "required": ["kind", "legs", "names"], "additionalProperties": False}
SPEC = StructuredOutputs.json_schema(SCHEMA)
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=SPEC),
    "seeded": SamplingParams(temperature=1.0, seed=7, max_tokens=60, structured_outputs=SPEC),
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def model(tmp_path_factory, default_model_dir) -> str:
    return str(make_tiny_with_tokenizer(tmp_path_factory.mktemp("tiny-tok") / "m", Path(default_model_dir)))


@pytest.fixture(scope="module")
def reference(model):
    engine = colocated_engine(model, blocks=256)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def pair(model):
    prefill, decode = start_nodes([("prefill", tiny_args(model, "ucx", blocks=256)),
                                   ("decode", tiny_args(model, "ucx", blocks=256))])
    yield prefill, decode
    assert stop_nodes([prefill, decode]) == [0, 0], prefill.log_tail() + decode.log_tail()


def _prompt(seed: int, n: int) -> list[int]:
    return [(37 * i + 11 * seed + 5) % 40000 + 100 for i in range(n)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", list(PARAMS))
def test_constrained_disaggregated_equals_colocated(pair, reference, default_tokenizer, kind):
    prefill, decode = pair
    params = PARAMS[kind]
    for n in (20, 150):  # one chunk, and three 64-token chunks on the prefill node
        prompt = _prompt(n, n)
        expected = run_colocated(reference, f"c{next(_ids)}", prompt, params)
        got = disaggregated(prefill, decode, f"r{next(_ids)}", prompt, params)
        assert got.tokens == expected
        local, _ = generate(decode, f"l{next(_ids)}", prompt, params)  # the decode node prefilling itself
        assert local == expected
        text = default_tokenizer.decode(expected)
        assert text.startswith('{"kind": "')  # the random model's output is valid by construction only
        if got.chunks[-1].finish_reason == "stop":
            import jsonschema

            jsonschema.validate(json.loads(text), SCHEMA)
    wait_for(lambda: all_blocks_free(decode) and all_blocks_free(prefill), 10, "blocks freed")


@pytest.mark.timeout(120)
def test_prompt_logprobs_and_logit_bias_cross_the_handoff(pair, reference):
    prefill, decode = pair
    prompt = _prompt(3, 100)
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logprobs=1,
                            logit_bias={1234: 100.0})
    reference.add_request("plp", prompt, params)
    outs = []
    while reference.has_unfinished():
        outs += reference.step()
    expected = outs[0].prompt_logprobs
    got = disaggregated(prefill, decode, f"r{next(_ids)}", prompt, params)
    assert got.tokens == [1234] * 4
    assert len(got.prefill.prompt_logprobs) == len(prompt) - 1
    for ref, msg in zip(expected[1:], got.prefill.prompt_logprobs):
        assert msg.token_id == ref.token_id and msg.rank == ref.rank
        assert msg.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t.token_id for t in msg.top] == [t for t, _ in ref.top]
    local, chunks = generate(decode, f"l{next(_ids)}", prompt, params)
    assert len(chunks[0].prompt_logprobs) == len(prompt) - 1 and not chunks[1].prompt_logprobs


def test_bad_grammar_is_refused_before_reserving(pair):
    prefill, decode = pair
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(StructuredOutputKind.REGEX, "(a"))
    err = rpc_error(reserve, decode, f"r{next(_ids)}", _prompt(1, 40), bad)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs: invalid regex" in err.details()
    err = rpc_error(generate, prefill, f"g{next(_ids)}", _prompt(1, 40), bad)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert all_blocks_free(decode)
