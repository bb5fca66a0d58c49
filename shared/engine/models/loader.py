"""Build a model from a HF folder (config.json + safetensors, single or sharded).

The model is built on the meta device, materialised uninitialised on the target device, and each
checkpoint tensor is copied straight into its parameter (or its row range of a fused one), converting the
dtype on the way: at most one checkpoint tensor is held beside the model at any time.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kvrelay.engine.attention.base import AttentionBackend
from kvrelay.engine.quant_config import CHECKPOINT_METHODS, QuantConfigError, quant_spec

from .ops import layer_ops
from .weight_targets import copy_into, weight_targets

logger = logging.getLogger(__name__)

_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: AttentionBackend | str,
    gguf_blocks: str | Path | None = None,
    quantization: str | None = None,
) -> nn.Module:
    """attn_backend: an AttentionBackend, or a name for kvrelay.engine.attention.get_attention_backend.
    gguf_blocks: the GGUF the folder was converted from, whose tensors are kept in their block formats
    (`--quantization gguf`, gguf_loader.py); None: the folder's safetensors. quantization awq, gptq or fp8: the
    folder holds such a checkpoint, kept quantized (quant_weights.py)."""
    from transformers import AutoConfig  # slow to import; only loading needs it

    from . import get_model_class

    device = torch.device(device)
    if isinstance(attn_backend, str):
        from kvrelay.engine.attention import get_attention_backend

        attn_backend = get_attention_backend(attn_backend, device)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    archs = getattr(hf_config, "architectures", None) or []
    if len(archs) != 1:
        raise ValueError(f"{model_dir}: config.json must name exactly one architecture, got {archs}")
    compute = compute_dtype(dtype, device)
    if compute != dtype:
        logger.info("%s matmuls are slow on this CPU: computing in %s on %s-rounded weights", dtype, compute, dtype)
    with torch.device("meta"):
        model = get_model_class(archs[0])(hf_config, attn_backend, compute, layer_ops(device))
    model.to_empty(device=device)
    model.after_materialize(device)
    round_to = dtype if compute != dtype else None
    if gguf_blocks is not None:
        from .gguf_loader import load_gguf_weights

        if device.type != "cpu":
            raise ValueError("quantization: gguf runs on CPU only")
        load_gguf_weights(model, Path(gguf_blocks), round_to=round_to)
    elif quantization in CHECKPOINT_METHODS:
        from .quant_weights import load_quantized_weights

        spec = quant_spec(json.loads((Path(model_dir) / "config.json").read_text()))
        if spec is None or spec.method != quantization:
            raise QuantConfigError(f"{quantization}: {model_dir} is not a {quantization} checkpoint")
        load_quantized_weights(model, checkpoint_files(Path(model_dir)), spec, round_to=round_to)
    else:
        load_weights(model, checkpoint_files(Path(model_dir)), round_to=round_to)
    model.after_load()
    return model.eval()


def compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the model computes in when asked for `dtype` on `device`.

    A CPU without native bf16/fp16 matmul (no AVX512/AMX: oneDNN reports no support) runs torch's bf16
    GEMM 5-15x slower than fp32. There the model computes in fp32 on weights rounded to the requested
    dtype, while the caller's KV cache may stay in the narrow dtype: the same values at fp32 speed.
    """
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    checks = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
    try:
        native = bool(getattr(torch.ops.mkldnn, checks[dtype])())
    except (AttributeError, KeyError, RuntimeError):
        native = True  # cannot tell: honour the request
    return dtype if native else torch.float32


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"{model_dir}: no safetensors weights (only .safetensors checkpoints load)")
    return found


def _renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def load_weights(model: nn.Module, files: list[Path], round_to: torch.dtype | None = None) -> None:
    """Copy every checkpoint tensor into its parameter; round_to first rounds values to that dtype."""
    targets = weight_targets(model)
    tied = getattr(model, "arch", None) is not None and model.arch.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    renames = getattr(model, "CHECKPOINT_RENAMES", ())  # a checkpoint's prefixes -> this model's module names
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = _renamed(stored, renames)
                if name.endswith(_SKIPPED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                if name not in targets:
                    unexpected.append(name)
                    continue
                param, rows = targets[name]
                tensor = f.get_tensor(stored)
                copy_into(param, rows, tensor if round_to is None else tensor.to(round_to), name)
                loaded.add(name)
    if unexpected:
        raise ValueError(f"checkpoint has tensors this model does not know: {unexpected[:8]}")
    missing = sorted(set(targets) - loaded - ({"lm_head.weight"} if tied else set()))
    if missing:
        raise ValueError(f"checkpoint lacks tensors the model needs: {missing[:8]} ({len(missing)} in all)")
