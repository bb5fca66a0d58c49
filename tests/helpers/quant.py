"""AWQ, GPTQ and FP8 checkpoints made from a tiny fp32 checkpoint, each in its format's published layout (AutoAWQ's
gemm packing, AutoGPTQ's v1 packing, llm-compressor's and HF's fine-grained FP8), together with the dense
checkpoint of the very values they dequantize to: the reference HF transformers computes with.

The dequantized values are computed here from the integers and scales before they are packed, never by unpacking,
so the engine's unpacking is checked against the formats, not against itself.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: slot i of a word holds output column order[i]
FP8_MAX = 448.0


def _pack_words(values: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack `values` (ints < 2**bits) along `axis`, 32 / bits to an int32 word, slot i in bits [i*bits, ...)."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    words = np.zeros(v.shape[:-1], dtype=np.uint32)
    for slot in range(per):
        words |= v[..., order[slot] if order else slot] << np.uint32(bits * slot)
    return torch.from_numpy(np.moveaxis(words, -1, axis).copy().view(np.int32))


def _asym4(w: torch.Tensor, groups: torch.Tensor, n_groups: int):
    """4-bit with a zero point per (row, group): ints [out, in], fp16 scales and int zeros [out, groups]."""
    scales = torch.empty(w.shape[0], n_groups)
    zeros = torch.empty(w.shape[0], n_groups)
    for g in range(n_groups):
        cols = w[:, groups == g]
        lo, hi = cols.min(dim=1).values.clamp(max=0), cols.max(dim=1).values.clamp(min=0)
        scales[:, g] = ((hi - lo) / 15).clamp(min=1e-6)
        zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(0, 15)
    scales = scales.half().float()
    q = torch.clamp(torch.round(w / scales[:, groups]) + zeros[:, groups], 0, 15)
    return q.int(), scales, zeros.int()


def _sym4(w: torch.Tensor, groups: torch.Tensor, n_groups: int):
    """GPTQ's symmetric 4-bit: zero point 8 everywhere."""
    scales = torch.stack([w[:, groups == g].abs().max(dim=1).values / 7 for g in range(n_groups)], dim=1)
    scales = scales.clamp(min=1e-6).half().float()
    zeros = torch.full_like(scales, 8).int()
    q = torch.clamp(torch.round(w / scales[:, groups]) + 8, 0, 15)
    return q.int(), scales, zeros


def quantize_checkpoint(src: Path, dst: Path, ref: Path, method: str, group_size: int = 32,
                        act_order: bool = False, block: tuple[int, int] | None = None, seed: int = 0) -> None:
    """Write `method`'s checkpoint of the fp32 checkpoint `src` into `dst`, and into `ref` the dense checkpoint of
    what it dequantizes to. method: awq, gptq or fp8 (block: per-block scales)."""
    state = load_file(str(src / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dense = dict(state)
    rng = np.random.default_rng(seed)
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or module.rpartition(".")[2] not in PROJECTIONS:
            quantized[name] = w
            continue
        out, cols = w.shape
        if method == "fp8":
            deq = _fp8(quantized, module, w, block)
        else:
            n_groups = cols // group_size
            groups = torch.arange(cols) // group_size
            if act_order:  # each input channel's group follows a permutation (GPTQ's desc_act)
                groups = torch.from_numpy(rng.permutation(cols)) // group_size
            q, scales, zeros = (_asym4 if method == "awq" else _sym4)(w, groups, n_groups)
            deq = (q - zeros[:, groups]).float() * scales[:, groups]
            if method == "awq":
                quantized[f"{module}.qweight"] = _pack_words(q.t().numpy(), 4, 1, AWQ_ORDER)
                quantized[f"{module}.qzeros"] = _pack_words(zeros.t().numpy(), 4, 1, AWQ_ORDER)
            else:
                quantized[f"{module}.qweight"] = _pack_words(q.t().numpy(), 4, 0)
                quantized[f"{module}.qzeros"] = _pack_words((zeros - 1).t().numpy(), 4, 1)  # v1: zero minus one
                quantized[f"{module}.g_idx"] = groups.int()
            quantized[f"{module}.scales"] = scales.t().contiguous().half()
        dense[name] = deq
    dst.mkdir(parents=True, exist_ok=True)
    ref.mkdir(parents=True, exist_ok=True)
    for folder in (dst, ref):
        for f in src.iterdir():
            if f.name != "model.safetensors":
                shutil.copy(f, folder / f.name)
    save_file(quantized, str(dst / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in dense.items()}, str(ref / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(method, group_size, act_order, block)
    (dst / "config.json").write_text(json.dumps(config))


def quantization_config(method: str, group_size: int = 32, act_order: bool = False,
                        block: tuple[int, int] | None = None) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order, "sym": True,
                "checkpoint_format": "gptq"}
    out = {"quant_method": "fp8", "activation_scheme": "dynamic" if block else "static"}
    if block:
        out["weight_block_size"] = list(block)
    return out


def _fp8(out: dict[str, torch.Tensor], module: str, w: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    if block is None:
        scale = w.abs().max() / FP8_MAX
        w8 = (w / scale).to(torch.float8_e4m3fn)
        out[f"{module}.weight"], out[f"{module}.weight_scale"] = w8, scale.reshape(())
        out[f"{module}.input_scale"] = torch.tensor(0.02)  # a static activation scale, which the engine ignores
        return w8.float() * scale
    bo, bi = block
    rows, cols = w.shape
    scale = torch.empty(-(-rows // bo), -(-cols // bi))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].abs().max().clamp(min=1e-6) / FP8_MAX
    full = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    w8 = (w / full).to(torch.float8_e4m3fn)
    out[f"{module}.weight"], out[f"{module}.weight_scale_inv"] = w8, scale
    return w8.float() * full
