"""Tiny random-weight HF checkpoints for tests: `make_tiny_checkpoint(arch, path) -> path`.

`arch` is a variant name from TINY_ARCHS (or a HF architecture name, meaning its plain variant). Weights
are drawn with a fixed seed at a scale where a wrong implementation visibly changes the logits (HF's own
init leaves biases zero and norms one, which would hide loading bugs). No tokenizer is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# variant -> (config class name, overrides of _COMMON)
_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=3)),
    "llama-tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "mistral-window": ("MistralConfig", dict(sliding_window=24)),  # shorter than the test prompts
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=4)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),  # head_dim != hidden / heads
}
TINY_ARCHS = tuple(_VARIANTS)
_BY_ARCHITECTURE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def tiny_config(arch: str, **extra: Any):
    import transformers

    variant = _BY_ARCHITECTURE.get(arch, arch)
    if variant not in _VARIANTS:
        raise ValueError(f"unknown tiny checkpoint {arch!r}; choose one of {TINY_ARCHS}")
    cls_name, overrides = _VARIANTS[variant]
    return getattr(transformers, cls_name)(**{**_COMMON, **overrides, **extra})


def make_tiny_checkpoint(
    arch: str, path: str | Path, seed: int = 0, max_shard_size: str | None = None, **config: Any
) -> Path:
    """Write a fp32 checkpoint (config.json + safetensors) into `path` and return it.

    max_shard_size (e.g. "100KB") writes a sharded checkpoint with model.safetensors.index.json; `config`
    overrides config values (e.g. vocab_size=49152 for a draft model of the default model).
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = tiny_config(arch, **config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


def make_tiny_classifier(path: str | Path, arch: str, num_labels: int, seed: int = 1, **config: Any):
    """A random *ForSequenceClassification (a cross-encoder with `num_labels` outputs) saved into `path`; the
    transformers model too, in eval mode, as the reference."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(
        tiny_config(arch, num_labels=num_labels, pad_token_id=0, **config), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return model.eval()


def copy_tokenizer(tokenizer_dir: Path, path: Path) -> None:
    """The tokenizer files of `tokenizer_dir` (the default model's) into the model folder `path`."""
    import shutil

    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def make_tiny_with_tokenizer(path: Path, tokenizer_dir: Path, **config: Any) -> Path:
    """A tiny random llama whose vocabulary matches the default model's tokenizer (49152), so text
    round-trips and grammars compile against a real vocabulary; `config` overrides config values."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", **config)
    config.vocab_size, config.max_position_embeddings = 49152, 2048
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    copy_tokenizer(tokenizer_dir, path)
    return path


IMAGE_SIZE, PATCH = 28, 7  # a tiny LLaVA's images: 28x28 after preprocessing, 16 placeholder tokens each


def make_tiny_llava(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A random LLaVA (CLIP vision tower, projector, tiny Llama LM) on the default model's tokenizer with an added
    `<image>` token, saved with its LlavaProcessor (CLIP preprocessing, 28x28) in transformers' layout."""
    from transformers import AutoTokenizer, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from kvrelay.bench.vision_model import save_llava_processor

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = tiny_config("llama")
    text.vocab_size, text.max_position_embeddings = len(tokenizer), 2048
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                              image_size=IMAGE_SIZE, patch_size=PATCH, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-2,
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight", "layer_norm1.weight", "layer_norm2.weight",
                              "pre_layrnorm.weight")):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
    model.save_pretrained(path)
    save_llava_processor(path, tokenizer, IMAGE_SIZE, PATCH)
    (path / "generation_config.json").write_text((tokenizer_dir / "generation_config.json").read_text())
    return path


def png(seed: int, width: int, height: int) -> bytes:
    """A random RGB image as PNG bytes."""
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(out, "PNG")
    return out.getvalue()
