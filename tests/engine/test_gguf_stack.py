"""All decoder layers in one native call (models/gguf_stack.py): the same bits as the layers' own forwards, and
used only where it applies."""

from __future__ import annotations

import math

import pytest
import torch

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine import kernels
from kvrelay.engine.llm import LLM
from kvrelay.engine.models.gguf_blocks import BlockShards, BlockWeight
from kvrelay.engine.models.gguf_stack import GGUFLayerStack
from tests.helpers.gguf_files import write_kquant_gguf

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    # Past the GGUF kernel's 128 rows (but for Q4_1 with AVX512-VNNI): its prefill takes the Python path, its
    # decode steps the stack.
    "Tell me a long story about a lighthouse keeper. " * 14,
]


def _generate(kv_cache_dtype: str, model: str = "default", prompts: list[str] = PROMPTS) -> tuple[list, list, object]:
    llm = LLM(model=model, dtype="float32", quantization="gguf", kv_cache_memory=64 << 20,
              kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    return tokens, logprobs, llm.engine.runner.model


def _qtypes(layer) -> list[int]:
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    return [p.blocks.qtype for p in projections]


@pytest.mark.parametrize("kv_cache_dtype", ["auto"])
def test_the_stack_gives_the_layers_own_tokens_and_logprobs(kv_cache_dtype, monkeypatch):
    calls = []
    forward = GGUFLayerStack.forward
    monkeypatch.setattr(GGUFLayerStack, "forward", lambda self, *a: calls.append(forward(self, *a)) or calls[-1])
    tokens, logprobs, model = _generate(kv_cache_dtype)
    assert isinstance(model.gguf_stack, GGUFLayerStack)
    # One prefill step of all three prompts (past 128 rows: the Python path, unless the kernel takes the default
    # model's Q4_1 projections at any row count), then 11 decode steps in the stack.
    assert {q for layer in model.model.layers for q in _qtypes(layer)} == {3}
    assert [c is None for c in calls] == [not kernels.load().gguf_any_rows(3)] + [False] * 11
    monkeypatch.setattr(GGUFLayerStack, "build", classmethod(lambda cls, model: None))
    python_tokens, python_logprobs, python_model = _generate(kv_cache_dtype)
    assert python_model.gguf_stack is None
    assert python_tokens == tokens
    assert python_logprobs == logprobs  # the same floats, not close ones


def test_a_q4_k_m_layout_keeps_its_mixed_shards_and_the_stack_gives_the_same_bits(tmp_path, monkeypatch):
    path = tmp_path / "q4km.gguf"
    write_kquant_gguf(path)  # q|k in Q4_K, v in Q6_K: one fused projection of two types
    prompts = ["hello there", "the theme"]
    tokens, logprobs, model = _generate("auto", str(path), prompts)
    qkv, down = model.model.layers[0].self_attn.qkv_proj.blocks, model.model.layers[0].mlp.down_proj.blocks
    assert isinstance(qkv, BlockShards) and [p.qtype for p in qkv.parts] == [12, 12, 14]
    assert isinstance(down, BlockWeight) and down.qtype == 14
    assert isinstance(model.gguf_stack, GGUFLayerStack)
    assert all(math.isfinite(lp.logprob) for out in logprobs for lp in out)  # the random weights stay finite
    monkeypatch.setattr(GGUFLayerStack, "build", classmethod(lambda cls, model: None))
    assert _generate("auto", str(path), prompts)[:2] == (tokens, logprobs)


def test_it_does_not_apply_to_a_model_with_dense_projections(tmp_path):
    from kvrelay.engine.models.loader import load_model
    from kvrelay.model_files.gguf import ensure_converted
    from tests.helpers.gguf_files import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)  # q_proj and k_proj in F32: the fused q|k|v is dense
    ensure_converted(path, tmp_path / "converted", progress=False)
    model = load_model(tmp_path / "converted", torch.float32, "cpu", "torch", gguf_blocks=path)
    assert model.gguf_stack is None
    assert model.model.layers[0].mlp.gate_up_proj.blocks is not None  # blocks, but not every projection's

