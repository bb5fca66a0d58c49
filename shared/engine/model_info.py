"""What the engine needs to know about a model before loading it: where it is, its id, dtype, limits."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from kvrelay.engine.auto_dtype import auto_dtype
from kvrelay.engine.config import ModelConfig, parse_dtype
from kvrelay.model_files.resolve import resolve_model


@dataclass(frozen=True)
class ModelInfo:
    path: str  # HF-style folder
    model_id: str  # names the model in hashes, the registry and the API
    device: torch.device
    dtype: torch.dtype
    eos_token_id: int | None
    max_position_embeddings: int
    architecture: str
    # generation_config may list more end tokens than the one eos (Llama 3 instruct: <|eot_id|>); like vLLM,
    # the engine stops on them as stop tokens unless ignore_eos.
    extra_eos_token_ids: tuple[int, ...] = ()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return auto_dtype(device.type)
    dtype = parse_dtype(name)
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("dtype: float16 is not supported on CPU; use bfloat16 or float32")
    return dtype


def load_model_info(config: ModelConfig) -> ModelInfo:
    resolved = resolve_model(config.model)
    with open(os.path.join(resolved.path, "config.json")) as f:
        hf = json.load(f)
    device = resolve_device(config.device)
    eos_ids = _eos_token_ids(resolved.path, hf)
    return ModelInfo(
        path=resolved.path,
        model_id=resolved.model_id,
        device=device,
        dtype=resolve_dtype(config.dtype, device),
        eos_token_id=eos_ids[0] if eos_ids else None,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        architecture=(hf.get("architectures") or ["?"])[0],
        extra_eos_token_ids=eos_ids[1:],
    )


def _eos_token_ids(path: str, hf: dict) -> tuple[int, ...]:
    """The end tokens, generation_config's first; its list wins over config.json's."""
    gen_path = os.path.join(path, "generation_config.json")
    eos = hf.get("eos_token_id")
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id", eos)
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(dict.fromkeys(int(t) for t in ids))
