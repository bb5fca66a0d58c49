"""Images in chat through real nodes and gateways, with the unmodified openai SDK: a tiny random LLaVA (CLIP tower,
projector, Llama LM on the default model's tokenizer) served colocated (one node) and disaggregated (a prefill node
hands the KV to a decode node over UCX). Greedy answers equal transformers' on the same weights and image, both
ways; a repeat hits the prefix cache through the image, another image with the same text only up to it; only the
prefill node encodes; bad images are 400s that leave the fleet serving."""

from __future__ import annotations

import base64
import io

import grpc
import openai
import pytest
import torch

from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2 as gpb
from kvrelay.proto_gen.kvrelay.gateway.v1 import gateway_pb2_grpc as gpb_grpc
from tests.helpers.gateway import GatewayThread
from tests.helpers.models import make_tiny_llava, png
from tests.helpers.nodes import BLOCK, start_nodes, stop_nodes, tiny_args

TEXT = "Here is a picture of something for you to look at closely, please: "
QUESTION = "What is it?"
MAX_TOKENS = 8


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _messages(image: bytes | str, text: str = QUESTION) -> list[dict]:
    url = image if isinstance(image, str) else data_url(image)
    return [{"role": "user", "content": [{"type": "text", "text": TEXT},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, default_model_dir):
    model = make_tiny_llava(tmp_path_factory.mktemp("vision") / "llava", default_model_dir)
    nodes = start_nodes([("prefill", tiny_args(str(model), "ucx", "--node-id", "vlm-prefill")),
                         ("decode", tiny_args(str(model), "ucx", "--node-id", "vlm-decode")),
                         ("decode", tiny_args(str(model), "ucx", "--node-id", "vlm-colocated"))])
    gws = []
    try:
        limits = dict(max_images_per_request=2, max_image_pixels=80 * 80, capacity_wait=1)
        gws.append(GatewayThread(model=str(model), decode=(nodes[2].address,), **limits))
        gws.append(GatewayThread(model=str(model), prefill=(nodes[0].address,), decode=(nodes[1].address,),
                                 local_prefill_threshold=0, grpc_port=0, **limits))
        yield {"model": model, "colocated": gws[0], "disaggregated": gws[1], "prefill": nodes[0],
               "decode": nodes[1]}
    finally:
        for gw in gws:
            gw.close()
        stop_nodes(nodes)


@pytest.fixture(scope="module")
def hf(fleet):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(fleet["model"], dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(fleet["model"])


def _want(hf, image: bytes) -> str:
    from PIL import Image

    model, processor = hf
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"{TEXT}\n<image>\n{QUESTION}"}], add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=[Image.open(io.BytesIO(image))], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def _chat(gw: GatewayThread, messages: list[dict]):
    return gw.client().chat.completions.create(model=str(gw.gateway.model_id), messages=messages,
                                               max_tokens=MAX_TOKENS, temperature=0)


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_answers_equal_transformers_and_the_cache_is_per_image(fleet, hf, mode):
    gw = fleet[mode]
    first, second = png(30 if mode == "colocated" else 40, 45, 30), png(31 if mode == "colocated" else 41, 30, 30)
    reply = _chat(gw, _messages(first))
    assert reply.choices[0].message.content == _want(hf, first)
    again = _chat(gw, _messages(first))
    assert again.choices[0].message.content == reply.choices[0].message.content
    prompt = reply.usage.prompt_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    other = _chat(gw, _messages(second))
    assert other.choices[0].message.content == _want(hf, second)
    if mode == "colocated":  # one node: its cache is the whole story
        text_blocks = other.usage.prompt_tokens_details.cached_tokens
        assert cached == (prompt - 1) // BLOCK * BLOCK  # everything but the last block, image and all
        assert 0 < text_blocks < cached  # only the text before the image


def test_only_the_prefill_node_encodes(fleet):
    _chat(fleet["disaggregated"], _messages(png(50, 28, 28)))
    encoded = fleet["prefill"].metrics().value("kvrelay:images_encoded_total")
    assert encoded is not None and encoded >= 1
    assert (fleet["decode"].metrics().value("kvrelay:images_encoded_total") or 0) == 0


def test_images_through_the_grpc_api(fleet):
    gw, image = fleet["disaggregated"], png(70, 33, 29)
    want = gw.client().chat.completions.create(
        model=str(gw.gateway.model_id), max_tokens=MAX_TOKENS, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                               {"type": "text", "text": QUESTION}]}])
    with grpc.insecure_channel(f"127.0.0.1:{gw.gateway.grpc_port}") as channel:
        stub = gpb_grpc.GatewayStub(channel)

        def generate(*images: bytes):
            chat = gpb.Chat(messages=[gpb.ChatMessage(role="user", content=QUESTION, images=list(images))])
            return stub.Generate(gpb.GenerateRequest(chat=chat, params=gpb.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0)), timeout=60)

        reply = list(generate(image))
        assert "".join(c.text for m in reply for c in m.choices) == want.choices[0].message.content
        with pytest.raises(grpc.RpcError) as info:
            list(generate(b"not an image"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "chat.messages[0].images[0]: could not decode" in info.value.details()


@pytest.mark.parametrize("case", ["undecodable", "not_base64", "too_many_pixels", "too_many_images", "http_url",
                                  "placeholder_in_text"])
def test_bad_images_are_400_and_the_fleet_keeps_serving(fleet, case):
    gw = fleet["disaggregated"]
    good = png(60, 28, 28)
    messages = {
        "undecodable": _messages(data_url(b"\x89PNG but not really")),
        "not_base64": _messages("data:image/png;base64,@@@"),
        "too_many_pixels": _messages(png(61, 100, 90)),
        "too_many_images": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(good)}}
                                                         for _ in range(3)]}],
        "http_url": _messages("http://127.0.0.1:9/cat.png"),
        "placeholder_in_text": _messages(good, "and <image> again?"),
    }[case]
    with pytest.raises(openai.BadRequestError) as err:
        _chat(gw, messages)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and body["param"], body
    assert _chat(gw, _messages(good)).choices[0].finish_reason in ("stop", "length")
