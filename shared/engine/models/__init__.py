"""Model implementations: architecture name (config.json `architectures`) -> class, and the loader."""

from __future__ import annotations

from torch import nn

from .bert import BertModel
from .llama import (
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen2ForSequenceClassification,
    Qwen3ForCausalLM,
    Qwen3ForSequenceClassification,
)
from .llava import LlavaForConditionalGeneration
from .loader import load_model

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    # Cross-encoders and rerankers: pooling requests of type classify only (engine/pooling.py)
    "LlamaForSequenceClassification": LlamaForSequenceClassification,
    "Qwen2ForSequenceClassification": Qwen2ForSequenceClassification,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    # Encoders (sentence-transformers' BERT embedders): whole sequences per step, embedding requests only
    "BertModel": BertModel,
    # Vision-language: a CLIP encoder and projector before a Llama LM; images in the prompt (models/llava.py)
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,
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
