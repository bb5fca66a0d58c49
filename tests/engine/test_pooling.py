"""Pooling requests (embeddings, engine/pooling.py) against HF transformers' last_hidden_state on tiny random
checkpoints: last-token, mean and first-token pooling, normalised or not, truncated to fewer dimensions; prompts
longer than a chunk, in one batch with generation, and again from a warm prefix cache. No blocks stay held."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel

from kvrelay.common.sampling_params import PoolingParams, PoolingType, SamplingParams
from kvrelay.engine.scheduler import MAX_POOLING_YIELDS
from tests.helpers.models import make_tiny_checkpoint, make_tiny_classifier, make_tiny_with_tokenizer
from tests.helpers.nodes import colocated_engine

PROMPTS = [[(5 * i + 11 * s + 2) % 500 for i in range(n)] for s, n in ((0, 7), (1, 64), (2, 150))]  # chunks of 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _hf_hidden(folder, prompt: list[int]) -> torch.Tensor:
    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).last_hidden_state[0]


def _reference(hidden: torch.Tensor, pooling: PoolingParams) -> torch.Tensor:
    vec = {PoolingType.LAST: hidden[-1], PoolingType.MEAN: hidden.mean(dim=0),
           PoolingType.CLS: hidden[0]}[pooling.pooling_type]
    vec = vec[: pooling.dimensions]
    return F.normalize(vec, dim=-1) if pooling.normalize else vec


def _run(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every request at once; per request id its outputs."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outs: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.req_id].append(out)
    return outs


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("pooling", [
    PoolingParams(),
    PoolingParams(PoolingType.MEAN),
    PoolingParams(PoolingType.CLS, normalize=False),
    PoolingParams(PoolingType.LAST, dimensions=16),
], ids=["last", "mean", "cls-raw", "last-16"])
def test_vectors_equal_transformers_beside_generation(model, pooling):
    engine = colocated_engine(str(model))
    params = SamplingParams(pooling=pooling)
    requests = {f"e{i}": (p, params) for i, p in enumerate(PROMPTS)}
    requests["chat"] = (PROMPTS[2], GREEDY)  # a generation in the same steps
    for again in (False, True):  # the second time the prefix cache holds every prompt
        outs = _run(engine, {f"{rid}-{again}": r for rid, r in requests.items()})
        assert len(outs[f"chat-{again}"][-1].new_token_ids) >= 1
        for i, prompt in enumerate(PROMPTS):
            (out,) = outs[f"e{i}-{again}"]  # one output: the vector, and the end
            assert out.new_token_ids == () and out.finish_reason == "stop" and out.num_prompt_tokens == len(prompt)
            want = _reference(_hf_hidden(model, prompt), pooling)
            got = torch.tensor(out.pooled)
            assert got.shape == want.shape
            assert F.cosine_similarity(got, want, dim=0) > 1 - 1e-5
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            if again and pooling.needs_every_position:
                assert out.num_cached_tokens == 0  # a mean needs every position: never from the cache
    load = engine.load()
    assert not engine.request_ids() and load.kv_cache_usage == 0 and load.free_kv_blocks == load.total_kv_blocks


def test_a_pooling_prompt_may_fill_the_context_and_is_never_handed_off(model):
    engine = colocated_engine(str(model))
    params = SamplingParams(pooling=PoolingParams())
    prompt = [3] * engine.max_model_len
    (out,) = _run(engine, {"full": (prompt, params)})["full"]
    assert len(out.pooled) == 64
    with pytest.raises(ValueError, match="exceed max_model_len"):
        engine.add_request("over", prompt + [3], params)
    with pytest.raises(ValueError, match="pooling: a pooling request samples nothing"):
        SamplingParams(n=2, pooling=PoolingParams())
    with pytest.raises(ValueError, match="pooling_type: unknown 'max'"):
        PoolingParams("max")


def test_llm_embed_is_vllm_s_offline_call(tmp_path, default_model_dir):
    from kvrelay.engine.llm import LLM

    model = make_tiny_with_tokenizer(tmp_path / "tiny", default_model_dir)
    llm = LLM(model=str(model), dtype="float32", kv_cache_memory=8 * 2**20)
    text = "The capital of France is Paris."
    outs = llm.embed([text, PROMPTS[1]], PoolingParams(PoolingType.MEAN), use_tqdm=False)
    assert outs[0].prompt_token_ids == llm.tokenizer.encode(text) and outs[1].prompt_token_ids == PROMPTS[1]
    for out in outs:
        want = _reference(_hf_hidden(model, out.prompt_token_ids), PoolingParams(PoolingType.MEAN))
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("arch", "num_labels"), [("llama", 1), ("qwen2", 3)])
def test_a_sequence_classifier_scores_as_transformers_and_generates_nothing(tmp_path, arch, num_labels):
    folder = tmp_path / arch
    hf = make_tiny_classifier(folder, arch, num_labels)
    engine = colocated_engine(str(folder))
    params = SamplingParams(pooling=PoolingParams(PoolingType.CLASSIFY))
    outs = _run(engine, {f"s{i}": (p, params) for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0]
        want = torch.sigmoid(logits) if num_labels == 1 else torch.softmax(logits, dim=-1)
        torch.testing.assert_close(torch.tensor(outs[f"s{i}"][0].pooled), want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="takes classify pooling requests only"):
        engine.add_request("gen", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="takes classify pooling requests only"):
        engine.add_request("embed", PROMPTS[0], SamplingParams(pooling=PoolingParams()))


def test_classify_needs_a_classifier(model):
    engine = colocated_engine(str(model))
    with pytest.raises(ValueError, match="classify needs a sequence classifier"):
        engine.add_request("c", PROMPTS[0], SamplingParams(pooling=PoolingParams(PoolingType.CLASSIFY)))


def _tiny_bert(folder):
    from transformers import BertConfig
    from transformers import BertModel as HFBert

    config = BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128)
    torch.manual_seed(2)
    model = HFBert(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "LayerNorm.weight" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(folder)
    return folder, model


@pytest.mark.parametrize("pooling", [PoolingParams(PoolingType.MEAN), PoolingParams(PoolingType.CLS, normalize=False)],
                         ids=["mean", "cls-raw"])
def test_a_bert_encoder_embeds_as_transformers(tmp_path, pooling):
    folder, hf = _tiny_bert(tmp_path / "bert")
    engine = colocated_engine(str(folder))
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0][:3]]  # whole sequences of 7, 64 and 3 tokens in one step
    params = SamplingParams(pooling=pooling)
    for again in (False, True):  # no prefix cache: the second pass computes everything again
        outs = _run(engine, {f"b{i}-{again}": (p, params) for i, p in enumerate(prompts)})
        for i, prompt in enumerate(prompts):
            (out,) = outs[f"b{i}-{again}"]
            assert out.num_cached_tokens == 0
            with torch.inference_mode():
                want = _reference(hf(torch.tensor([prompt])).last_hidden_state[0], pooling)
            torch.testing.assert_close(torch.tensor(out.pooled), want, rtol=1e-4, atol=1e-4)
    assert engine.max_model_len == 64  # a sequence is one step: no longer than the step's budget
    with pytest.raises(ValueError, match="exceed max_model_len 64"):
        engine.add_request("long", PROMPTS[2], params)
    for wrong in (GREEDY, SamplingParams(pooling=PoolingParams(PoolingType.CLASSIFY))):
        with pytest.raises(ValueError, match="is an encoder; it takes embedding requests only"):
            engine.add_request("gen", PROMPTS[0], wrong)


def test_pooling_takes_a_capped_share_of_each_step_on_a_model_that_generates(model):
    params = SamplingParams(pooling=PoolingParams())

    def engine_with(chats: int, prompt: list[int] = PROMPTS[1]):
        engine = colocated_engine(str(model))  # 64-token steps
        engine.scheduler.config = replace(engine.scheduler.config, max_pooling_tokens_per_step=16)
        for i, p in enumerate(PROMPTS):  # 7, 64 and 150 tokens, queued first
            engine.add_request(f"e{i}", p, params)
        for i in range(chats):  # each its own prompt: no prefix-cache hits between them
            engine.add_request(f"chat{i}", prompt[i:] + prompt[:i], GREEDY)
        return engine

    # On a model that generates, pooling takes 16 tokens of a step (7, then 9 of the next prompt): a chat may arrive
    # at any moment and would wait for the step's end.
    assert dict(engine_with(0).scheduler.schedule().num_scheduled_tokens) == {"e0": 7, "e1": 9}
    # A chat's prompt goes first: the chat queued behind the embeddings takes the whole step; once it decodes,
    # pooling has its share again.
    assert dict(engine_with(1).scheduler.schedule().num_scheduled_tokens) == {"chat0": 64}
    engine = engine_with(1)
    engine.step()  # that step: the chat's prompt
    assert dict(engine.scheduler.schedule().num_scheduled_tokens) == {"chat0": 1, "e0": 7, "e1": 9}
    # Chats that keep coming delay pooling by MAX_POOLING_YIELDS steps at most, then it has its share.
    engine = engine_with(4, PROMPTS[2])  # 600 prompt tokens: 10 steps of them
    steps = [dict(engine.scheduler.schedule().num_scheduled_tokens) for _ in range(MAX_POOLING_YIELDS + 1)]
    assert all("e0" not in s for s in steps[:-1]) and steps[-1]["e0"] == 7
    engine = engine_with(1)
    done: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            done.setdefault(out.req_id, []).append(out)
    assert all(done[f"e{i}"][-1].pooled is not None for i in range(3)) and done["chat0"][-1].finish_reason
