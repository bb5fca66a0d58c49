"""Structured outputs in the engine: the sampler's grammar bitmask and logit_bias, the grammar compiler's
cache and errors, and the default model generating under real xgrammar grammars (valid by construction,
neighbours untouched, a compiling grammar holds back only its own request), and prompt logprobs against
transformers."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams, StructuredOutputKind, StructuredOutputs
from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, StructuredOutputsConfig
from kvrelay.engine.core import EngineCore
from kvrelay.engine.request import RequestStatus
from kvrelay.engine.sampler import Sampler, SamplingRow, TokenBitmask
from kvrelay.engine.structured import GrammarCompiler, GrammarVocab, bitmask_words, create_grammar_backend

V = 64

# -- sampler ---------------------------------------------------------------------------------------------


def _row(params: SamplingParams, position: int = 10) -> SamplingRow:
    return SamplingRow(params, [1, 2, 3], [], position)


def _mask(allowed_per_row: dict[int, list[int]], vocab: int = V) -> TokenBitmask:
    rows = sorted(allowed_per_row)
    words = torch.zeros(len(rows), bitmask_words(vocab), dtype=torch.int32)
    for j, r in enumerate(rows):
        for t in allowed_per_row[r]:
            words[j, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    return TokenBitmask(rows, words)


def test_bitmask_constrains_only_its_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    rows = [_row(SamplingParams(temperature=0)), _row(SamplingParams(temperature=0)),
            _row(SamplingParams(temperature=0.9, seed=5)), _row(SamplingParams(temperature=0.9, seed=7))]
    free = Sampler(V)(logits.clone(), rows).token_ids
    allowed = {1: [3, 40], 3: [7, 8, 63]}
    got = Sampler(V)(logits.clone(), rows, _mask(allowed)).token_ids
    assert got[0] == free[0] and got[2] == free[2]  # unconstrained rows: token-identical
    assert got[1] == max(allowed[1], key=lambda t: logits[1, t].item())  # greedy: best allowed token
    assert got[3] in allowed[3]
    # A seeded constrained row's draw depends on its own logits, mask, seed and position only.
    alone = Sampler(V, seed=123)(logits[3:4].clone(), rows[3:4], _mask({0: allowed[3]})).token_ids
    assert alone == [got[3]]


def test_bitmask_comes_before_top_k_and_penalties():
    logits = torch.zeros(1, V)
    logits[0, 10], logits[0, 20], logits[0, 30] = 9.0, 5.0, 4.0
    # top_k=1 after the mask keeps the best *allowed* token (before it, nothing allowed would survive).
    params = SamplingParams(temperature=1.0, top_k=1, seed=1)
    assert Sampler(V)(logits.clone(), [_row(params)], _mask({0: [20, 30]})).token_ids == [20]
    # A repetition penalty on 20 (in the prompt) demotes it below 30, among the allowed.
    row = SamplingRow(SamplingParams(temperature=0, repetition_penalty=2.0), [20], [], 5)
    assert Sampler(V)(logits.clone(), [row], _mask({0: [20, 30]})).token_ids == [30]


def test_logit_bias():
    torch.manual_seed(1)
    logits = torch.randn(2, V)
    best = int(logits[0].argmax())
    rows = [_row(SamplingParams(temperature=0, logit_bias={best: -100.0}, logprobs=1)),
            _row(SamplingParams(temperature=0, logit_bias={17: 100.0}))]
    out = Sampler(V)(logits.clone(), rows)
    second = int(logits[0].topk(2).indices[1])
    assert out.token_ids == [second, 17]
    # Logprobs are the raw model's (before the bias), as vLLM reports them.
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[second].item(), abs=1e-5)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})


# -- specs and the compiler -------------------------------------------------------------------------------


def test_spec_validation():
    with pytest.raises(ValueError, match="structured_outputs: unknown kind"):
        StructuredOutputs("yaml", "x")
    with pytest.raises(ValueError, match="json: the schema must be a JSON object"):
        StructuredOutputs(StructuredOutputKind.JSON, "{not json")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputs(StructuredOutputKind.CHOICE, "[]")
    with pytest.raises(ValueError, match="needs its source"):
        StructuredOutputs(StructuredOutputKind.REGEX, "")
    assert StructuredOutputs.json_schema({"b": 1, "a": 2}).source == '{"b": 1, "a": 2}'  # order kept


@pytest.fixture(scope="module")
def vocab(default_model_dir) -> GrammarVocab:
    return GrammarVocab(str(default_model_dir), 49152, (2,))


def test_compiler_caches_per_spec_and_rejects_bad_grammars(vocab):
    compiler = GrammarCompiler(StructuredOutputsConfig(grammar_cache_size=2),
                               lambda: create_grammar_backend("xgrammar", vocab))
    spec = StructuredOutputs.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    first = compiler.submit(spec)
    assert compiler.submit(StructuredOutputs.json_schema(spec.source)) is first  # equal specs share a compile
    first.result(60)
    assert compiler.num_compiles == 1
    for bad in (StructuredOutputs(StructuredOutputKind.REGEX, "(ab"),
                StructuredOutputs(StructuredOutputKind.GRAMMAR, "root ::= ( \"a\""),
                StructuredOutputs.json_schema({"type": "object", "properties": {"a": {"type": "no-such-type"}}})):
        with pytest.raises(ValueError, match=r"^structured_outputs: invalid"):
            compiler.get(bad)
    assert len(compiler._cache) == 2  # least recently used evicted
    compiler.shutdown()


def test_matcher_follows_tokens(vocab, default_tokenizer):
    backend = create_grammar_backend("xgrammar", vocab)
    matcher = backend.compile(StructuredOutputs.choice(["yes", "no"])).matcher()
    bitmask = torch.zeros(1, bitmask_words(vocab.vocab_size), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    x = torch.zeros(1, vocab.vocab_size)
    from kvrelay.engine.sampler import apply_token_bitmask

    apply_token_bitmask(x, TokenBitmask([0], bitmask))
    allowed = set(torch.nonzero(x[0] == 0).flatten().tolist())
    assert default_tokenizer.encode("yes")[0] in allowed and default_tokenizer.encode("maybe")[0] not in allowed
    for t in default_tokenizer.encode("no"):
        assert matcher.accept(t)
    assert not matcher.accept(default_tokenizer.encode("x")[0])
    assert matcher.accept(2) and matcher.is_terminated()


# -- the default model under grammars ------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def _engine(model_dir, grammars: GrammarCompiler | None = None, budget: int = 64) -> EngineCore:
    return EngineCore(EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget),
    ), grammars=grammars)


@pytest.fixture(scope="module")
def engine(default_model_dir):
    eng = _engine(default_model_dir)
    yield eng
    eng.shutdown()


def _run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list, str]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.req_id].extend(out.new_token_ids)
            if out.finish_reason:
                reasons[out.req_id] = out.finish_reason
    return {rid: (tokens[rid], reasons[rid]) for rid in requests}


def _prompt(tok, text: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=120),
                                    SamplingParams(temperature=1.0, seed=11, max_tokens=120)],
                         ids=["greedy", "seeded"])
def test_json_schema_output_validates(engine, default_tokenizer, params):
    from dataclasses import replace

    spec = StructuredOutputs.json_schema(SCHEMA)
    prompt = _prompt(default_tokenizer, "Describe a user account as JSON.")
    (tokens, reason), = _run(engine, {"s": (prompt, replace(params, structured_outputs=spec))}).values()
    assert reason == "stop" and tokens[-1] == 2
    jsonschema.validate(json.loads(default_tokenizer.decode(tokens)), SCHEMA)


def test_choice_regex_and_grammar(engine, default_tokenizer):
    prompt = _prompt(default_tokenizer, "Is the sky blue?")
    got = _run(engine, {
        "choice": (prompt, SamplingParams(temperature=0.7, seed=3, max_tokens=10,
                                          structured_outputs=StructuredOutputs.choice(["yes", "no", "unsure"]))),
        "regex": (prompt, SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(
            StructuredOutputKind.REGEX, r"[A-Z][a-z]{2,6}-[0-9]{3}"))),
        "ebnf": (prompt, SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(
            StructuredOutputKind.GRAMMAR, 'root ::= "answer: " ("true" | "false")'))),
        "object": (prompt, SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputs(
            StructuredOutputKind.JSON_OBJECT))),
    })
    text = {rid: default_tokenizer.decode(toks) for rid, (toks, _) in got.items()}
    assert text["choice"] in ("yes", "no", "unsure")
    assert re.fullmatch(r"[A-Z][a-z]{2,6}-[0-9]{3}", text["regex"])
    assert text["ebnf"] in ("answer: true", "answer: false")
    assert got["choice"][1] == got["regex"][1] == got["ebnf"][1] == "stop"
    if got["object"][1] == "stop":
        assert isinstance(json.loads(text["object"]), dict)
    else:  # out of budget mid-object: still a prefix the grammar allowed
        assert text["object"].startswith("{")


def test_unconstrained_neighbours_are_unaffected(engine, default_tokenizer):
    free = [(_prompt(default_tokenizer, "Tell me about cats."), SamplingParams(temperature=0, max_tokens=24)),
            (_prompt(default_tokenizer, "Write a haiku."), SamplingParams(temperature=0.9, seed=5, max_tokens=24))]
    alone = _run(engine, {f"a{i}": r for i, r in enumerate(free)})
    spec = StructuredOutputs.json_schema(SCHEMA)
    constrained = {f"c{i}": (_prompt(default_tokenizer, f"User {i} as JSON"),
                             SamplingParams(temperature=0.5, seed=i, max_tokens=40, structured_outputs=spec))
                   for i in range(3)}
    mixed = _run(engine, {**{f"b{i}": r for i, r in enumerate(free)}, **constrained})
    for i in range(len(free)):
        assert mixed[f"b{i}"] == alone[f"a{i}"]


def test_compiling_grammar_holds_back_only_its_request(default_model_dir, vocab, default_tokenizer):
    gate = threading.Event()

    def slow_backend():
        gate.wait(60)
        return create_grammar_backend("xgrammar", vocab)

    compiler = GrammarCompiler(StructuredOutputsConfig(), slow_backend)
    eng = _engine(default_model_dir, grammars=compiler)
    try:
        prompt = _prompt(default_tokenizer, "Hello")
        eng.add_request("json", prompt, SamplingParams(temperature=0, max_tokens=120,
                                                       structured_outputs=StructuredOutputs.json_schema(SCHEMA)))
        eng.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=4))
        assert eng.scheduler.requests["json"].status == RequestStatus.WAITING_FOR_GRAMMAR
        done = {}
        while "free" not in done:
            for out in eng.step():
                assert out.req_id == "free"
                if out.finish_reason:
                    done["free"] = out
        assert eng.scheduler.requests["json"].status == RequestStatus.WAITING_FOR_GRAMMAR
        gate.set()
        tokens = []
        while eng.has_unfinished():
            for out in eng.step():
                tokens.extend(out.new_token_ids)
        jsonschema.validate(json.loads(default_tokenizer.decode(tokens)), SCHEMA)
    finally:
        gate.set()
        eng.shutdown()


def test_failed_compile_ends_the_request_and_is_refused_next_time(engine, default_tokenizer):
    bad = StructuredOutputs(StructuredOutputKind.REGEX, "[a-")
    prompt = _prompt(default_tokenizer, "Hi")
    got = _run(engine, {"bad": (prompt, SamplingParams(max_tokens=5, structured_outputs=bad)),
                        "ok": (prompt, SamplingParams(temperature=0, max_tokens=3))})
    assert got["bad"] == ([], "abort") and got["ok"][1] == "length"
    with pytest.raises(ValueError, match="structured_outputs: invalid regex"):
        engine.add_request("bad2", prompt, SamplingParams(max_tokens=5, structured_outputs=bad))
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks


def test_preempted_request_replays_its_grammar(default_model_dir, default_tokenizer, engine):
    # 12 blocks of 16 tokens: two requests growing past ~90 tokens each cannot both stay; one is preempted and
    # recomputed, its matcher rebuilt from its output so far.
    small = EngineCore(EngineConfig(
        model=ModelConfig(model=str(default_model_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=16, num_gpu_blocks_override=12, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
    ))
    spec = StructuredOutputs.json_schema({"type": "object", "properties": {
        "items": {"type": "array", "items": {"type": "integer"}, "minItems": 30, "maxItems": 30}},
        "required": ["items"], "additionalProperties": False})
    reqs = {f"r{i}": (_prompt(default_tokenizer, f"List {i}"),
                      SamplingParams(temperature=0.8, seed=i, max_tokens=70, structured_outputs=spec))
            for i in range(2)}
    got = _run(small, reqs)
    assert small.counters().num_preemptions > 0
    assert got == _run(engine, {k: v for k, v in reqs.items()})
    small.shutdown()


# -- prompt logprobs ------------------------------------------------------------------------------------------


def test_prompt_logprobs_match_transformers(engine, default_model_dir, default_tokenizer):
    from transformers import AutoModelForCausalLM

    prompt = default_tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)  # > one 64-token chunk
    assert len(prompt) > 64
    _run(engine, {"warm": (prompt[:40], SamplingParams(max_tokens=1))})  # a cached prefix must not be skipped
    engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    first = next(o for o in outs if o.req_id == "p")
    plp = first.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    assert all(o.prompt_logprobs is None for o in outs if o is not first)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    for pos in range(1, len(prompt)):
        entry = plp[pos]
        assert entry.token_id == prompt[pos]
        assert entry.logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=2e-3)
        row = ref[pos - 1]
        assert [lp for _, lp in entry.top] == pytest.approx(row.topk(3).values.tolist(), abs=2e-3)
        target = row[prompt[pos]]
        assert int((row > target + 2e-3).sum()) + 1 <= entry.rank <= int((row > target - 2e-3).sum()) + 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=80),
                                    SamplingParams(temperature=1.0, seed=21, max_tokens=80)], ids=["greedy", "seeded"])
def test_resumed_request_replays_its_grammar(engine, default_tokenizer, params):
    """A request moved to another node mid-way (migration) goes on exactly as it would have."""
    from dataclasses import replace

    spec = StructuredOutputs.json_schema(SCHEMA)
    prompt = _prompt(default_tokenizer, "Describe a user account as JSON.")
    constrained = replace(params, structured_outputs=spec)
    (full, reason), = _run(engine, {"whole": (prompt, constrained)}).values()
    assert len(full) > 12
    for cut in (1, 9, len(full) - 2):
        # Migration resumes a request as prompt + its output so far, the last `cut` tokens marked as output.
        engine.add_request(f"resumed-{cut}", prompt + full[:cut], replace(constrained, num_resumed_tokens=cut))
        rest: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                rest.extend(out.new_token_ids)
        assert full[:cut] + rest == full
    with pytest.raises(ValueError, match="num_resumed_tokens"):
        engine.add_request("done", prompt + full, replace(constrained, num_resumed_tokens=80))
