"""GGUF weights kept in their blocks (--quantization gguf): the kernel against an exact integer reference, the
dequantization against the gguf package's, and the loader's placement against the float32 conversion of the
same file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine import kernels
from kvrelay.engine.models import gguf_blocks
from kvrelay.engine.models.gguf_blocks import BlockEmbedding, BlockWeight, block_rows
from kvrelay.model_files.gguf import ensure_converted
from tests.helpers.gguf_files import kquant_rows, write_tiny_gguf

Q = gguf.GGMLQuantizationType
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, *KQUANTS]


def _blocks(qtype, rows: int = 48, cols: int = 96, seed: int = 0) -> tuple[BlockWeight, np.ndarray]:
    rng = np.random.default_rng(seed)
    if qtype in KQUANTS:
        cols = 512
        data = kquant_rows(qtype, rows, cols, rng)
    else:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    return BlockWeight(block_rows(data, int(qtype), cols), int(qtype), cols), gguf.quants.dequantize(data, qtype)


def _int8_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x quantized per block of 32 to int8 (scale max|x| / 127, rounded half away from zero, as llama.cpp's
    reference), then multiplied exactly (float64) with the dequantized weight."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float64)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127.0
    q = np.sign(blocks) * np.floor(np.abs(blocks / np.where(d > 0, d, 1.0)) + 0.5)
    return (q * d).reshape(x.shape) @ w.astype(np.float64).T


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_equals_the_gguf_package(qtype):
    blocks, reference = _blocks(qtype)
    np.testing.assert_array_equal(blocks.dequantize().numpy(), reference)
    np.testing.assert_array_equal(gguf_blocks._dequantize_torch(blocks.raw, blocks.qtype, blocks.cols).numpy(),
                                  reference)


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_is_the_int8_dot_product_and_rows_are_independent(qtype):
    blocks, w = _blocks(qtype)
    x = np.random.default_rng(1).standard_normal((5, blocks.cols)).astype(np.float32)
    x[2, :32] = 0.0  # an all-zero block: scale 0
    # A block whose scale is exactly 1, with values halfway between integers: each rounds away from zero (lround),
    # not to even as a vector round instruction does by itself.
    x[3, :32] = [127.0] + [v * s for v in (0.5, 1.5, 2.5, 3.5, 4.5, 63.5, 126.5, 0.25) for s in (1, -1)] + [0.0] * 15
    bias = torch.arange(48, dtype=torch.float32)
    y = blocks.linear(torch.from_numpy(x), bias)
    np.testing.assert_allclose(y.numpy(), _int8_reference(x, w) + bias.numpy(), rtol=2e-5, atol=2e-4)
    for row in range(5):  # alone or in a batch of 5 (a tile of 4 and one of 1): the same bits
        assert torch.equal(blocks.linear(torch.from_numpy(x[row : row + 1]), bias)[0], y[row])


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_batch_is_the_int8_dot_product_and_its_rows_are_independent(qtype):
    """From 8 rows (12 for the K-quants), with AVX512-VNNI, the lanes kernel (16 rows per vector; gguf_lanes.h):
    the same exact integer block sums, and each row's result the same in any batch that large (37 rows: a pass
    of two 16-row blocks and one of a partial block; 12: one partial block)."""
    blocks, w = _blocks(qtype)
    x = np.random.default_rng(2).standard_normal((37, blocks.cols)).astype(np.float32)
    x[2, :32] = 0.0
    bias = torch.arange(48, dtype=torch.float32)
    y = blocks.linear(torch.from_numpy(x), bias)
    np.testing.assert_allclose(y.numpy(), _int8_reference(x, w) + bias.numpy(), rtol=2e-5, atol=2e-4)
    others = np.random.default_rng(3).standard_normal((11, blocks.cols)).astype(np.float32)
    for row in (0, 2, 20, 36):  # first in a batch of 12 beside other rows
        batch = torch.from_numpy(np.concatenate([x[row : row + 1], others]))
        assert torch.equal(blocks.linear(batch, bias)[0], y[row])


@pytest.mark.skipif(kernels.load() is None, reason="no native kernels here")
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_bf16_in_and_out_is_the_fp32_result_rounded(rows):
    blocks, _ = _blocks(Q.Q4_1)
    x = torch.randn(rows, blocks.cols).to(torch.bfloat16)
    bias = torch.randn(48)
    y = kernels.load().gguf_gemm(x, blocks.raw, blocks.qtype, bias)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, kernels.load().gguf_gemm(x.float(), blocks.raw, blocks.qtype, bias).to(torch.bfloat16))


@pytest.mark.skipif(kernels.load() is None or not kernels.load().gguf_any_rows(int(Q.Q4_1)),
                    reason="no AVX512-VNNI here: past KERNEL_ROWS rows run on dequantized tiles")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_the_wide_kernel_takes_any_row_count_with_vnni(qtype):
    """Q4_0, Q4_1 and Q8_0 with AVX512-VNNI (gguf_wide.h): a prefill chunk past KERNEL_ROWS is the int8 product
    too, and each row's result the same bits in a batch of 8 as in one of 300."""
    assert gguf_blocks.on_kernel(int(qtype), 10_000)
    blocks, w = _blocks(qtype, rows=45)  # two tiles of 16 output rows and a partial one
    x = np.random.default_rng(4).standard_normal((gguf_blocks.KERNEL_ROWS + 172, blocks.cols)).astype(np.float32)
    bias = torch.arange(45, dtype=torch.float32)
    y = blocks.linear(torch.from_numpy(x), bias)
    np.testing.assert_allclose(y.numpy(), _int8_reference(x, w) + bias.numpy(), rtol=2e-5, atol=2e-4)
    others = np.random.default_rng(5).standard_normal((7, blocks.cols)).astype(np.float32)
    for row in (0, 150, 299):
        batch = torch.from_numpy(np.concatenate([others, x[row : row + 1]]))
        assert torch.equal(blocks.linear(batch, bias)[-1], y[row])
    xb = torch.from_numpy(x).to(torch.bfloat16)
    assert torch.equal(blocks.linear(xb, bias), kernels.load().gguf_gemm(xb, blocks.raw, blocks.qtype, bias))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_many_rows_run_on_dequantized_tiles(qtype, monkeypatch):
    """Past KERNEL_ROWS, a type the kernel does not take at any count here (all of them without AVX512-VNNI)."""
    monkeypatch.setattr(gguf_blocks, "_TILE_ROWS", 16)  # 48 output rows: three tiles
    monkeypatch.setattr(gguf_blocks, "on_kernel", lambda qtype, rows: False)
    blocks, w = _blocks(qtype)
    x = torch.randn(gguf_blocks.KERNEL_ROWS + 4, blocks.cols)
    y = blocks.linear(x.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16  # bf16's GEMM on the weights rounded to bf16, as a dense bf16 model holds them
    dense_bf16 = F.linear(x.to(torch.bfloat16), torch.from_numpy(w).to(torch.bfloat16))
    torch.testing.assert_close(y, dense_bf16, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(blocks.linear(x), F.linear(x, torch.from_numpy(w)), rtol=1e-5, atol=1e-5)


def test_malformed_blocks_are_refused():
    raw = torch.zeros(4, 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="no kernel for ggml type 10"):
        BlockWeight(raw, 10, 256)  # Q2_K
    with pytest.raises(ValueError, match="Q4_1 rows of 64 weights do not fit 20 bytes"):
        BlockWeight(raw, 3, 64)
    with pytest.raises(ValueError, match="Q4_K rows of 576 weights do not fit 20 bytes"):
        BlockWeight(raw, 12, 576)  # not a whole number of super-blocks (SmolLM2's hidden size)
    assert [gguf_blocks.fits_blocks(t, 576) for t in (3, 12, 13, 14)] == [True, False, False, False]
    assert [gguf_blocks.fits_blocks(t, 1536) for t in (3, 10, 12, 13, 14)] == [True, False, True, True, True]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """The tiny GGUF loaded twice: dequantized (the float32 conversion) and kept in its blocks."""
    from kvrelay.engine.models.loader import load_model

    root = tmp_path_factory.mktemp("gguf-blocks")
    path = root / "tiny.gguf"
    write_tiny_gguf(path)
    folder = root / "converted"
    ensure_converted(path, folder, progress=False)
    dense = load_model(folder, torch.float32, "cpu", "torch")
    quantized = load_model(folder, torch.float32, "cpu", "torch", gguf_blocks=path)
    return dense, quantized


def test_loader_keeps_blocks_where_a_kernel_exists_and_places_them_as_the_conversion(tiny_models, monkeypatch):
    dense, quantized = tiny_models
    layer, dense_layer = quantized.model.layers[1], dense.model.layers[1]
    # q_proj is F32 in the file: the fused q|k|v is dense (its Q4_1 k and v dequantized into it).
    assert layer.self_attn.qkv_proj.blocks is None
    assert torch.equal(layer.self_attn.qkv_proj.weight, dense_layer.self_attn.qkv_proj.weight)
    kept = {"o_proj": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj}
    assert {name: gguf_blocks.TYPE_NAMES[m.blocks.qtype] for name, m in kept.items()} == \
        {"o_proj": "Q8_0", "gate_up": "Q4_1", "down": "Q8_0"}
    assert isinstance(quantized.model.embed_tokens, BlockEmbedding)
    assert quantized.lm_head.blocks is quantized.model.embed_tokens.blocks  # tied: one copy
    dense_kept = {"o_proj": dense_layer.self_attn.o_proj, "gate_up": dense_layer.mlp.gate_up_proj,
                  "down": dense_layer.mlp.down_proj}
    for name, module in kept.items():  # the same weights, row for row (gate before up)
        torch.testing.assert_close(module.blocks.dequantize(), dense_kept[name].weight, rtol=0, atol=0, msg=name)
    ids = torch.tensor([[0, 5, 259], [3, 3, 1]])
    assert torch.equal(quantized.model.embed_tokens(ids), dense.model.embed_tokens(ids))
    hidden = torch.randn(gguf_blocks.KERNEL_ROWS + 1, 64)
    # On dequantized tiles (as without AVX512-VNNI): the dense GEMM on the same weights, so the head's placement
    # shows as equal logits.
    monkeypatch.setattr(gguf_blocks, "on_kernel", lambda qtype, rows: False)
    torch.testing.assert_close(quantized.compute_logits(hidden), dense.compute_logits(hidden), rtol=1e-5, atol=1e-5)
    assert torch.equal(quantized.greedy_tokens(hidden[:2]), quantized.compute_logits(hidden[:2]).argmax(-1))


def test_quantization_needs_a_gguf_on_cpu(tmp_path):
    from kvrelay.engine.config import EngineConfig
    from kvrelay.engine.model_info import ConfigError, check_engine_config

    for model, device, why in ((str(tmp_path), "cpu", "is not one"), ("default", "cuda", "CPU only")):
        with pytest.raises(ConfigError, match=why) as e:
            check_engine_config(EngineConfig().with_kwargs(model=model, device=device, quantization="gguf"))
        assert e.value.field == "quantization"


def test_the_default_model_served_from_its_blocks_answers():
    from kvrelay.common.sampling_params import SamplingParams
    from kvrelay.engine.llm import LLM

    llm = LLM(model="default", dtype="float32", quantization="gguf", kv_cache_memory=64 << 20)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].text.startswith(" Paris")
    # Its KV is not the dense weights' KV: a transfer to or from a dense node is refused by the layout check.
    assert llm.engine.kv_layout().model_id == "SmolLM2-135M-Instruct (gguf weights)"


@pytest.mark.parametrize("rows", [1, 32])
def test_a_quantized_heads_greedy_token_is_the_first_of_equal_largest_logits_in_bf16(rows):
    from kvrelay.engine.models.llama import LMHead

    data = gguf.quants.quantize(np.random.default_rng(3).standard_normal((64, 96)).astype(np.float32), Q.Q8_0)
    data[40] = data[7]  # two vocabulary rows of the same bytes: their logits tie exactly
    head = LMHead(96, 64, torch.bfloat16)
    head.use_blocks(BlockWeight(block_rows(data, int(Q.Q8_0), 96), int(Q.Q8_0), 96))
    hidden = (torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)) * 0.1).bfloat16()
    hidden[0] = torch.from_numpy(gguf.quants.dequantize(data[7:8], Q.Q8_0)[0]).bfloat16()  # row 7's own direction
    logits = head(hidden)
    assert logits.dtype == torch.bfloat16 and logits[0, 7] == logits[0, 40] == logits[0].max()
    assert head.greedy(hidden)[0].item() == 7
    assert torch.equal(head.greedy(hidden), logits.argmax(dim=-1))
