"""A LLaVA folder made from a language model's folder, for benchmarks that need images (no model hub here).

The language model keeps its weights (the default model: SmolLM2-135M-Instruct) and its tokenizer gains an
`<image>` token (a new embedding row: the mean of the others); the CLIP vision tower and the projector are random
at transformers' initialisation. The answers about an image mean nothing; the work per image (preprocessing, the
encoder, `tokens_per_image` more prompt tokens) is what a model of this shape costs, which is what a load test
measures. Built once per folder and reused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def save_llava_processor(out: Path, tokenizer, image_size: int, patch: int) -> None:
    """The folder's LlavaProcessor: CLIP preprocessing to `image_size` squares, the tokenizer with `<image>`."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    side = {"height": image_size, "width": image_size}
    LlavaProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": image_size}, crop_size=side),
                   tokenizer=tokenizer, patch_size=patch, vision_feature_select_strategy="default",
                   image_token="<image>", num_additional_image_tokens=1).save_pretrained(out)


def llava_from_lm(lm_dir: str | Path, out: str | Path, image_size: int = 112, patch: int = 14,
                  vision_hidden: int = 256, vision_layers: int = 4, seed: int = 0) -> Path:
    """Write a LlavaForConditionalGeneration into `out` around the LM at `lm_dir`; returns `out`."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    out, lm_dir = Path(out), Path(lm_dir)
    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(str(lm_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = AutoConfig.from_pretrained(str(lm_dir))
    weights = load_file(str(lm_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    rows = len(tokenizer) - embed.shape[0]
    text.vocab_size = len(tokenizer)
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=4 * vision_hidden,
                              num_hidden_layers=vision_layers, num_attention_heads=max(1, vision_hidden // 64),
                              image_size=image_size, patch_size=patch, projection_dim=vision_hidden)
    config = LlavaConfig(vision_config=vision, text_config=text, vision_feature_layer=-2,
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", tie_word_embeddings=text.tie_word_embeddings)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    state = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    state["embed_tokens.weight"] = torch.cat([embed, embed.mean(0, keepdim=True).expand(rows, -1)])
    model.model.language_model.load_state_dict(state, strict=True)
    if not text.tie_word_embeddings:
        head = weights["lm_head.weight"]
        model.lm_head.weight.data.copy_(torch.cat([head, head.mean(0, keepdim=True).expand(rows, -1)]))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    save_llava_processor(out, tokenizer, image_size, patch)
    if (lm_dir / "generation_config.json").is_file():
        shutil.copy(lm_dir / "generation_config.json", out / "generation_config.json")
    (out / "kvrelay_bench_model.json").write_text(json.dumps({"language_model": str(lm_dir), "vision": "random"}))
    return out
