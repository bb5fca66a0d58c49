"""AWQ, GPTQ and FP8 checkpoints (models/quant_weights.py): on two architectures, the engine's greedy tokens equal
HF transformers' computing in fp32 with the same dequantized weights; the weights stay quantized in memory; a
malformed quantization_config is refused before loading, naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.config import EngineConfig, ModelConfig
from kvrelay.engine.model_info import ConfigError, check_engine_config
from kvrelay.engine.models import quant_weights
from kvrelay.engine.models.quant_weights import GroupIntWeight, StackedWeight
from kvrelay.engine.quant_config import QuantSpec
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb
from tests.helpers.models import make_tiny_checkpoint
from tests.helpers.nodes import colocated_engine, disaggregated, run_colocated, start_nodes, stop_nodes, tiny_args
from tests.helpers.quant import quantization_config, quantize_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * s + 1) % 500 for i in range(n)] for s, n in ((0, 5), (1, 40), (2, 77))]
CASES = [  # (arch, method, options)
    ("llama", "awq", {}),
    ("llama", "gptq", {"act_order": True}),
    ("llama", "fp8", {}),
    ("llama", "fp8", {"block": (32, 32)}),
    ("qwen2", "awq", {}),
    ("qwen2", "gptq", {}),
    ("qwen2", "fp8", {"block": (16, 32)}),
]


def _hf_greedy(folder, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                             min_new_tokens=GREEDY.max_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize(("arch", "method", "options"), CASES,
                         ids=[f"{a}-{m}{'-' + '-'.join(o) if o else ''}" for a, m, o in CASES])
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(tmp_path, arch, method, options):
    src = make_tiny_checkpoint(arch, tmp_path / "fp32")
    quantize_checkpoint(src, tmp_path / method, tmp_path / "ref", method, **options)
    engine = colocated_engine(str(tmp_path / method))
    assert engine.info.quantization == method  # read from config.json: no flag given
    layers = engine.runner.model.model.layers
    assert all(layer.self_attn.qkv_proj.blocks is not None for layer in layers)
    got = [run_colocated(engine, f"q-{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
    assert got == [_hf_greedy(tmp_path / "ref", p) for p in PROMPTS]


@pytest.mark.parametrize(("arch", "method", "options"), CASES,
                         ids=[f"{a}-{m}{'-' + '-'.join(o) if o else ''}" for a, m, o in CASES])
def test_every_projection_dequantizes_to_the_reference_values(tmp_path, arch, method, options):
    src = make_tiny_checkpoint(arch, tmp_path / "fp32")
    quantize_checkpoint(src, tmp_path / method, tmp_path / "ref", method, **options)
    model = colocated_engine(str(tmp_path / method)).runner.model
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ref"), dtype=torch.float32)
    for ours, theirs in zip(model.model.layers, ref.model.layers, strict=True):
        a, m = theirs.self_attn, theirs.mlp
        for proj, dense in ((ours.self_attn.qkv_proj, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                            (ours.self_attn.o_proj, a.o_proj.weight),
                            (ours.mlp.gate_up_proj, torch.cat([m.gate_proj.weight, m.up_proj.weight])),
                            (ours.mlp.down_proj, m.down_proj.weight)):
            assert proj.weight.stride() == (0, 0)  # no dense values behind the parameter
            torch.testing.assert_close(proj.blocks.dequantize(), dense, rtol=0, atol=0)


def test_a_projection_stays_quantized_and_dequantizes_per_tile(tmp_path, monkeypatch):
    src = make_tiny_checkpoint("llama", tmp_path / "fp32")
    quantize_checkpoint(src, tmp_path / "awq", tmp_path / "ref", "awq")
    engine = colocated_engine(str(tmp_path / "awq"))
    qkv = engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.blocks, StackedWeight) and all(isinstance(p, GroupIntWeight) for p in qkv.blocks.parts)
    packed = qkv.blocks.parts[0].packed
    assert packed.dtype == torch.uint8 and packed.shape == (64, 32)  # two 4-bit weights a byte
    dense = qkv.blocks.dequantize()
    x = torch.randn(3, 64)
    monkeypatch.setattr(quant_weights, "_TILE_ROWS", 24)  # tiles that cross the q|k|v boundaries
    torch.testing.assert_close(qkv.blocks.tile(10, 90), dense[10:90], rtol=0, atol=0)
    torch.testing.assert_close(qkv(x), x @ dense.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    ({"quant_method": "bnb"}, "quant_method: 'bnb' is not one of awq, gptq, fp8"),
    ({"quant_method": "awq", "bits": 3}, "awq weights are 4-bit, got 3"),
    ({"quant_method": "awq", "version": "gemv"}, "only AutoAWQ's gemm layout loads"),
    ({"quant_method": "gptq", "group_size": 30}, "group_size: 30 is neither -1 nor a positive multiple of 8"),
    ({"quant_method": "gptq", "bits": "4"}, "bits: gptq needs an integer, got '4'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size: [128] is not two positive integers"),
])
def test_a_malformed_quantization_config_is_refused_before_loading(tmp_path, change, message):
    src = make_tiny_checkpoint("llama", tmp_path / "m")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {**quantization_config(change["quant_method"]), **change}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="quantization: .*" + message.replace("[", r"\[").replace("]", r"\]")):
        check_engine_config(EngineConfig(model=ModelConfig(model=str(src), dtype="float32", device="cpu")))


def test_the_flag_must_name_the_checkpoint_s_method(tmp_path):
    src = make_tiny_checkpoint("llama", tmp_path / "fp32")
    quantize_checkpoint(src, tmp_path / "gptq", tmp_path / "ref", "gptq")
    for folder, flag, message in ((tmp_path / "gptq", "awq", "quantized with gptq; give --quantization gptq"),
                                  (src, "fp8", "has no quantization_config")):
        with pytest.raises(ConfigError, match=message):
            check_engine_config(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", device="cpu",
                                                               quantization=flag)))


def test_missing_and_misshapen_tensors_name_the_tensor():
    spec = QuantSpec("gptq", 4, 32)
    words = torch.zeros(8, 64, dtype=torch.int32)  # 64 inputs, 64 outputs
    with pytest.raises(ValueError, match=r"layer\.q_proj: the checkpoint lacks layer\.q_proj\.scales"):
        quant_weights.gptq_weight({"qweight": words, "qzeros": torch.zeros(2, 8, dtype=torch.int32)}, spec,
                                  "layer.q_proj")
    with pytest.raises(ValueError, match=r"layer\.q_proj: \(3, 2\) groups of scales and zeros, expected 2"):
        quant_weights.gptq_weight({"qweight": words, "qzeros": torch.zeros(2, 8, dtype=torch.int32),
                                   "scales": torch.ones(3, 64)}, spec, "layer.q_proj")


@pytest.mark.timeout(180)
def test_disaggregated_equals_colocated_on_a_quantized_checkpoint_and_cache(tmp_path):
    """Prefill and decode nodes on a GPTQ checkpoint (found from its config.json, no flag) with an int8 KV cache:
    the KV handed over is the quantized model's, its values carrying their scales, and the tokens are the colocated
    engine's."""
    src = make_tiny_checkpoint("qwen2", tmp_path / "fp32", head_dim=32)
    quantize_checkpoint(src, tmp_path / "gptq", tmp_path / "ref", "gptq", act_order=True)
    model = str(tmp_path / "gptq")
    expected = [run_colocated(colocated_engine(model, kv_cache_dtype="int8"), f"c-{i}", p, GREEDY)
                for i, p in enumerate(PROMPTS)]
    args = tiny_args(model, "auto", "--kv-cache-dtype", "int8")
    prefill, decode = start_nodes([("prefill", args), ("decode", args)])
    try:
        got = [disaggregated(prefill, decode, f"d-{i}", p, GREEDY).tokens for i, p in enumerate(PROMPTS)]
        layout = decode.stub().GetNodeInfo(pb.NodeInfoRequest(), timeout=5).layout
        assert "(gptq weights)" in layout.model_id and (layout.dtype, layout.head_size) == ("int8", 32)
    finally:
        assert stop_nodes([prefill, decode]) == [0, 0], prefill.log_tail() + decode.log_tail()
    assert got == expected
