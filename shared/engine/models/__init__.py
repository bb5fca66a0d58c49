"""Model implementations: architecture name (config.json `architectures`) -> class, and the loader."""

from __future__ import annotations

from torch import nn

from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from .loader import load_model

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}

__all__ = ["MODEL_REGISTRY", "get_model_class", "load_model", "supported_architectures"]


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(arch: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[arch]
    except KeyError:
        raise ValueError(
            f"unsupported model architecture {arch!r}; supported: {', '.join(supported_architectures())}"
        ) from None
