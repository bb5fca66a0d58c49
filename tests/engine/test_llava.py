"""A vision-language model (LLaVA layout: CLIP tower, projector, Llama LM; random weights) against transformers:
the preprocessing, greedy tokens with one and two images (whole, chunked across steps, and after a prefix-cache
hit on the same image), the cache never shared across images beyond the text before them, and bad images refused
with nothing held."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from kvrelay.common.records import ImageInput
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.engine.core import EngineCore
from kvrelay.model_files.vision import decode_image, preprocess, vision_spec
from tests.helpers.models import make_tiny_llava, png

MAX_TOKENS = 10
BLOCK = 16


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory, default_model_dir):
    return make_tiny_llava(tmp_path_factory.mktemp("llava") / "m", default_model_dir)


@pytest.fixture(scope="module")
def hf(llava_dir):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(llava_dir)


def _engine(llava_dir, chunk: int = 2048) -> EngineCore:
    return EngineCore(EngineConfig(
        model=ModelConfig(model=str(llava_dir), dtype="float32", device="cpu"),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
    ))


@pytest.fixture(scope="module")
def engine(llava_dir):
    return _engine(llava_dir)


def _prompt(processor, text: str, images: list[bytes]) -> tuple[list[int], list[ImageInput]]:
    """The chat prompt with each `<image>` expanded to its placeholder tokens, as the gateway builds it."""
    spec = processor.tokenizer
    rendered = spec.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=False)
    ids = spec.encode(rendered, add_special_tokens=False)
    image_id = spec.convert_tokens_to_ids("<image>")
    out, found = [], []
    for t in ids:
        if t == image_id:
            found.append(len(out))
            out.extend([image_id] * 16)
        else:
            out.append(t)
    assert len(found) == len(images)
    return out, [ImageInput(offset=o, length=16, data=d) for o, d in zip(found, images, strict=True)]


def _hf_tokens(hf, text: str, images: list[bytes]) -> list[int]:
    from PIL import Image

    model, processor = hf
    rendered = processor.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                       add_generation_prompt=True, tokenize=False)
    inputs = processor(text=rendered, images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def _run(engine: EngineCore, rid: str, prompt: list[int], images: list[ImageInput]) -> tuple[list[int], int]:
    engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                       images=images)
    tokens, cached = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.req_id == rid:
                tokens.extend(out.new_token_ids)
                cached = out.num_cached_tokens
    return tokens, cached


def _all_free(engine: EngineCore) -> bool:
    engine.step()  # the runner forgets finished requests on the next step
    pool = engine.kv.pool
    return pool.num_free_blocks == pool.num_blocks and not engine.runner.states


def test_preprocessing_equals_transformers(llava_dir, hf):
    from PIL import Image

    spec = vision_spec(llava_dir)
    assert spec is not None and spec.tokens_per_image == 16 and spec.image_token == "<image>"
    for seed, (w, h) in enumerate([(28, 28), (50, 37), (31, 90)]):
        data = png(seed, w, h)
        theirs = hf[1].image_processor(Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]
        np.testing.assert_allclose(preprocess(decode_image(data), spec), theirs, atol=1e-6)


@pytest.mark.parametrize("case", ["one", "two", "chunked"])
def test_greedy_tokens_equal_transformers(llava_dir, engine, hf, case):
    images = [png(1, 40, 30)] if case != "two" else [png(2, 28, 28), png(3, 64, 48)]
    text = "Describe <image> in a word." if case != "two" else "<image> or <image>: which one is brighter?"
    prompt, inputs = _prompt(hf[1], text, images)
    target = engine if case != "chunked" else _engine(llava_dir, chunk=24)  # an image spans two steps
    got, _ = _run(target, f"vlm-{case}", prompt, inputs)
    assert got == _hf_tokens(hf, text, images)
    assert _all_free(target)


def test_prefix_cache_is_per_image(engine, hf):
    first, second = png(10, 36, 36), png(11, 36, 36)
    text = "A long preamble that fills more than one block of sixteen tokens before the image: <image> what is it?"
    prompt, inputs = _prompt(hf[1], text, [first])
    want, _ = _run(engine, "cache-a", prompt, inputs)
    again, cached = _run(engine, "cache-b", prompt, inputs)
    assert again == want and cached >= (inputs[0].end // BLOCK) * BLOCK  # through the image, from the cache
    other_prompt, other = _prompt(hf[1], text, [second])
    assert other_prompt == prompt  # the same tokens: only the image differs
    got, cached = _run(engine, "cache-c", other_prompt, other)
    assert cached == (other[0].offset // BLOCK) * BLOCK  # the text before the image, nothing after
    assert got == _hf_tokens(hf, text, [second])
    assert _all_free(engine)


def test_bad_images_are_refused_holding_nothing(engine, hf, default_model_dir):
    prompt, inputs = _prompt(hf[1], "Look: <image>", [png(20, 28, 28)])
    params = SamplingParams(max_tokens=4)
    bad = [
        ([ImageInput(inputs[0].offset, 16, b"not an image")], "could not decode"),
        ([], "image tokens for 0 images"),
        ([ImageInput(inputs[0].offset + 1, 16, inputs[0].data)], "not all image tokens"),
        ([ImageInput(inputs[0].offset, 15, inputs[0].data)], "placeholder tokens"),
    ]
    for images, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", prompt, params, images=images)
    assert not engine.has_unfinished() and _all_free(engine)
    text_only = EngineCore(EngineConfig(model=ModelConfig(model=str(default_model_dir), dtype="float32",
                                                          device="cpu"),
                                        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=16)))
    with pytest.raises(ValueError, match="takes no images"):
        text_only.add_request("t", [1, 2, 3], params, images=inputs)


def test_offline_llm_takes_images_as_vllm_does(llava_dir, hf):
    import base64

    from PIL import Image

    from kvrelay.engine.llm import LLM, SamplingParams

    llm = LLM(model=str(llava_dir), dtype="float32", kv_cache_memory=4 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    image = png(40, 36, 30)
    text = "Describe <image> in a word."
    rendered = hf[1].tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False)
    want = _hf_tokens(hf, text, [image])
    for picture in (image, Image.open(io.BytesIO(image))):  # bytes, or a PIL image (the same pixels as PNG)
        out = llm.generate({"prompt": rendered, "multi_modal_data": {"image": picture}}, params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == want
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    parts = [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "in a word."}]
    got = llm.chat([{"role": "user", "content": parts}], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == _hf_tokens(hf, "Describe\n<image>\nin a word.", [image])
    with pytest.raises(ValueError, match="1 image placeholders .* for 2 images"):
        llm.generate({"prompt": rendered, "multi_modal_data": {"image": [image, image]}}, params, use_tqdm=False)
