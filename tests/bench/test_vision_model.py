"""The benchmarks' LLaVA built around a language model's folder (kvrelay.bench.vision_model): text alone answers as
the language model did, an image prompt answers as transformers' LLaVA on the same folder, and a built folder is
reused."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from kvrelay.bench.vision_model import llava_from_lm
from kvrelay.common.records import ImageInput
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.tokenizer import Tokenizer
from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvrelay.engine.core import EngineCore
from kvrelay.model_files.vision import vision_spec
from tests.helpers.models import make_tiny_with_tokenizer, png

MAX_TOKENS = 8


def _greedy(model: Path, prompt: list[int], images=()) -> list[int]:
    engine = EngineCore(EngineConfig(model=ModelConfig(model=str(model), dtype="float32", device="cpu"),
                                     cache=CacheConfig(num_gpu_blocks_override=32)))
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       images=images)
    tokens = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
    return tokens


def test_a_llava_around_a_language_model(tmp_path, default_model_dir):
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    lm = make_tiny_with_tokenizer(tmp_path / "lm", Path(default_model_dir))
    vlm = llava_from_lm(lm, tmp_path / "vlm", image_size=28, patch=7, vision_hidden=32, vision_layers=2)
    assert llava_from_lm(lm, vlm) == vlm  # built once
    spec = vision_spec(vlm)
    assert spec is not None and spec.tokens_per_image == 16

    text = Tokenizer(lm).apply_chat_template([{"role": "user", "content": "Name a colour."}])
    assert _greedy(vlm, text) == _greedy(lm, text)

    tokenizer = Tokenizer(vlm)
    rendered = tokenizer.render_chat([{"role": "user", "content": "<image>\nWhat is it?"}])
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    at = ids.index(spec.image_token_id)
    prompt = ids[:at] + [spec.image_token_id] * 16 + ids[at + 1 :]
    image = png(5, 40, 28)
    got = _greedy(vlm, prompt, [ImageInput(at, 16, image)])
    processor = AutoProcessor.from_pretrained(vlm)
    inputs = processor(text=rendered, images=[Image.open(io.BytesIO(image))], return_tensors="pt")
    model = LlavaForConditionalGeneration.from_pretrained(vlm, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
    assert got == want[0, inputs["input_ids"].shape[1] :].tolist()
