"""LLaVA: a CLIP vision encoder and a two-layer projector in front of a Llama-family language model.

An image becomes `tokens_per_image` feature vectors (the encoder's patch states at `vision_feature_layer`, the CLS
state dropped under the "default" strategy, then projected to the LM's width); they replace the embeddings of the
image's placeholder tokens in the prompt, and the LM runs as it always does: paged KV, chunked prefill, prefix
cache. Only the prefill side encodes images; what a decode node receives is KV.

Checkpoint names: transformers saves LLaVA either as `language_model.model.*`, `language_model.lm_head.*`,
`vision_tower.*`, `multi_modal_projector.*` or with a `model.` prefix (`model.language_model.*`, ...); CLIP's
own `vision_model.` level may be there or not. `CHECKPOINT_RENAMES` maps each onto this module's names.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvrelay.engine.attention.base import AttentionBackend
from kvrelay.engine.models.ops import LayerOps

from .llama import LlamaForCausalLM

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTIVATIONS)}") from None


class _Embeddings(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(c.hidden_size, dtype=dtype), requires_grad=False)
        self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, c.patch_size, bias=False,
                                         dtype=dtype)
        self.position_embedding = nn.Embedding((c.image_size // c.patch_size) ** 2 + 1, c.hidden_size, dtype=dtype)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [n, patches, hidden]
        cls = self.class_embedding.expand(pixels.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden, dtype=dtype)
                                                                  for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, hidden = x.shape
        q, k, v = (p(x).view(n, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch of its image
        return self.out_proj(out.transpose(1, 2).reshape(n, t, hidden))


class _MLP(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size, dtype=dtype)
        self.act = _activation(getattr(c, "hidden_act", "quick_gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        eps = getattr(c, "layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = _Attention(c.hidden_size, c.num_attention_heads, dtype)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=eps, dtype=dtype)
        self.mlp = _MLP(c, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_EncoderLayer(c, dtype) for _ in range(c.num_hidden_layers)])


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer up to one layer's hidden states (HF's `hidden_states[feature_layer]`)."""

    def __init__(self, c: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = _Embeddings(c, dtype)
        eps = getattr(c, "layer_norm_eps", 1e-5)
        self.pre_layrnorm = nn.LayerNorm(c.hidden_size, eps=eps, dtype=dtype)  # sic: HF's tensor names
        self.encoder = _Encoder(c, dtype)
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=eps, dtype=dtype)  # loaded; LLaVA never uses it

    def forward(self, pixels: torch.Tensor, feature_layer: int) -> torch.Tensor:
        layers = len(self.encoder.layers)
        depth = feature_layer if feature_layer >= 0 else layers + 1 + feature_layer  # states after `depth` layers
        if not 0 <= depth <= layers:
            raise ValueError(f"vision_feature_layer {feature_layer} outside a {layers}-layer encoder")
        h = self.pre_layrnorm(self.embeddings(pixels))
        for layer in self.encoder.layers[:depth]:
            h = layer(h)
        return h


class _Projector(nn.Module):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        bias = bool(getattr(hf_config, "multimodal_projector_bias", True))
        vision, text = hf_config.vision_config.hidden_size, hf_config.text_config.hidden_size
        self.linear_1 = nn.Linear(vision, text, bias=bias, dtype=dtype)
        self.linear_2 = nn.Linear(text, text, bias=bias, dtype=dtype)
        self.act = _activation(getattr(hf_config, "projector_hidden_act", "gelu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(LlamaForCausalLM):
    """The language model is LlamaForCausalLM's (its names, its kernels, LoRA); `encode_images` adds the rest."""

    CHECKPOINT_RENAMES = (
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("model.vision_tower.vision_model.", "vision_tower."),
        ("model.vision_tower.", "vision_tower."),
        ("vision_tower.vision_model.", "vision_tower."),
        ("model.multi_modal_projector.", "multi_modal_projector."),
    )

    def __init__(self, hf_config: Any, attn_backend: AttentionBackend, dtype: torch.dtype,
                 ops: LayerOps | None = None) -> None:
        super().__init__(hf_config.text_config, attn_backend, dtype, ops)
        layer = getattr(hf_config, "vision_feature_layer", -2)
        if not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer: a list of layers ({layer}) is not supported")
        self.feature_layer = layer
        self.keep_cls = getattr(hf_config, "vision_feature_select_strategy", "default") != "default"
        self.vision_tower = ClipVisionTower(hf_config.vision_config, dtype)
        self.multi_modal_projector = _Projector(hf_config, dtype)

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixel values [n, 3, H, W] -> the LM-width features of each image's placeholder tokens [n, tokens, hidden]."""
        states = self.vision_tower(pixels.to(self.dtype), self.feature_layer)
        return self.multi_modal_projector(states if self.keep_cls else states[:, 1:])
