"""A tiny llama GGUF written from random weights (2 layers, 64 wide): the conversion's and the GGUF block
loader's tests read it. Q4_1 and Q8_0 tensors as llama.cpp stores them (Q and K rows permuted), q_proj in F32 so
that the permutation is checked bit for bit."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_HEADS, TINY_KV_HEADS, TINY_HIDDEN, TINY_FFN = 4, 2, 64, 128


# ---------------------------------------------------------------- a tiny synthetic llama GGUF


def _byte_alphabet() -> list[str]:
    # GPT-2's printable stand-ins for the 256 byte values, as byte-level BPE vocabularies store them.
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # Mirror of LlamaModel.permute in llama.cpp's convert_hf_to_gguf.py (HF layout -> GGUF layout).
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


Q8, Q4, F32 = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F32
KV_DIM = TINY_HIDDEN // TINY_HEADS * TINY_KV_HEADS
# (GGUF name, HF name, HF shape, storage type, heads whose rows llama.cpp permutes)
TINY_LAYER_TENSORS = [
    ("attn_norm.weight", "input_layernorm.weight", (TINY_HIDDEN,), F32, None),
    ("ffn_norm.weight", "post_attention_layernorm.weight", (TINY_HIDDEN,), F32, None),
    ("attn_q.weight", "self_attn.q_proj.weight", (TINY_HIDDEN, TINY_HIDDEN), F32, TINY_HEADS),
    ("attn_k.weight", "self_attn.k_proj.weight", (KV_DIM, TINY_HIDDEN), F32, TINY_KV_HEADS),
    ("attn_v.weight", "self_attn.v_proj.weight", (KV_DIM, TINY_HIDDEN), Q4, None),
    ("attn_output.weight", "self_attn.o_proj.weight", (TINY_HIDDEN, TINY_HIDDEN), Q8, None),
    ("ffn_gate.weight", "mlp.gate_proj.weight", (TINY_FFN, TINY_HIDDEN), Q4, None),
    ("ffn_up.weight", "mlp.up_proj.weight", (TINY_FFN, TINY_HIDDEN), Q4, None),
    ("ffn_down.weight", "mlp.down_proj.weight", (TINY_HIDDEN, TINY_FFN), Q8, None),
]


def _tiny_tensors(n_vocab: int) -> list[tuple]:
    tensors = [
        ("token_embd.weight", "model.embed_tokens.weight", (n_vocab, TINY_HIDDEN), Q8, None),
        ("output_norm.weight", "model.norm.weight", (TINY_HIDDEN,), F32, None),
    ]
    for i in range(2):
        tensors += [(f"blk.{i}.{g}", f"model.layers.{i}.{h}", *rest) for g, h, *rest in TINY_LAYER_TENSORS]
    return tensors


def _write_tiny_metadata(writer: gguf.GGUFWriter, tokens: list[str], hidden: int = TINY_HIDDEN, ffn: int = TINY_FFN,
                         heads: int = TINY_HEADS, kv_heads: int = TINY_KV_HEADS) -> None:
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3: control (special) tokens
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """Writes a 2-layer llama GGUF; returns the float32 weights the conversion must produce (HF layout)."""
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "Ġt", "he"]
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_tiny_metadata(writer, tokens)
    rng = np.random.default_rng(0)
    expected: dict[str, np.ndarray] = {}
    for gguf_name, hf_name, shape, qtype, n_heads in _tiny_tensors(len(tokens)):
        hf_array = rng.standard_normal(shape).astype(np.float32)
        stored = _llama_cpp_permute(hf_array, n_heads) if n_heads else hf_array
        if qtype == F32:  # exact: checks the permutation is undone bit for bit
            writer.add_tensor(gguf_name, stored)
            expected[hf_name] = hf_array
        else:
            quantized = gguf.quants.quantize(stored, qtype)
            writer.add_tensor(gguf_name, quantized, raw_dtype=qtype)
            expected[hf_name] = gguf.quants.dequantize(quantized, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# ---------------------------------------------------------------- a K-quant llama GGUF, as llama.cpp's Q4_K_M

KQ_HIDDEN, KQ_FFN, KQ_HEADS, KQ_KV_HEADS = 256, 512, 4, 2  # widths of whole 256-weight super-blocks


def kquant_rows(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator,
                scale: tuple[float, float] = (1e-3, 1e-2)) -> np.ndarray:
    """Random super-blocks of a K-quant (the gguf package cannot quantize to them): any bytes are valid scales and
    values, with the fp16 factors (d, and dmin for Q4_K and Q5_K) drawn from `scale`."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for at in ((size - 2,) if qtype == gguf.GGMLQuantizationType.Q6_K else (0, 2)):  # Q6_K: d last
        raw[..., at : at + 2] = rng.uniform(*scale, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_kquant_gguf(path: Path) -> None:
    """A 2-layer llama GGUF laid out as llama.cpp's Q4_K_M: Q4_K projections, but attn_v and ffn_down in Q6_K
    (so the fused q|k|v mixes types), the embedding in Q8_0; random values."""
    q4k, q6k = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_alphabet(), "Ġt", "he"]
    writer = gguf.GGUFWriter(str(path), "llama")
    _write_tiny_metadata(writer, tokens, KQ_HIDDEN, KQ_FFN, KQ_HEADS, KQ_KV_HEADS)
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((len(tokens), KQ_HIDDEN)).astype(np.float32)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(embed, Q8), raw_dtype=Q8)
    writer.add_tensor("output_norm.weight", np.ones(KQ_HIDDEN, dtype=np.float32))
    kv = KQ_HIDDEN // KQ_HEADS * KQ_KV_HEADS
    for i in range(2):
        for name, rows, cols, qtype in (("attn_q", KQ_HIDDEN, KQ_HIDDEN, q4k), ("attn_k", kv, KQ_HIDDEN, q4k),
                                        ("attn_v", kv, KQ_HIDDEN, q6k), ("attn_output", KQ_HIDDEN, KQ_HIDDEN, q4k),
                                        ("ffn_gate", KQ_FFN, KQ_HIDDEN, q4k), ("ffn_up", KQ_FFN, KQ_HIDDEN, q4k),
                                        ("ffn_down", KQ_HIDDEN, KQ_FFN, q6k)):
            values = kquant_rows(qtype, rows, cols, rng, scale=(2e-4, 2e-3))
            writer.add_tensor(f"blk.{i}.{name}.weight", values, raw_dtype=qtype)
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(KQ_HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
