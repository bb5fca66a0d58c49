"""A cross-encoder (a tiny random LlamaForSequenceClassification carrying the default model's tokenizer) served by
a real node behind the gateway: /v1/rerank and /v1/score equal transformers' sigmoid of the head on
tokenizer(query, document); it cannot embed or chat, and says so with a 400."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from tests.helpers.gateway import API_KEY, GatewayThread
from tests.helpers.models import copy_tokenizer, make_tiny_classifier
from tests.helpers.nodes import start_nodes, stop_nodes, tiny_args

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
QUERY = "Where is Paris?"
DOCS = ["Paris is in France.", "Dragons breathe fire.", "The capital of France is Paris.", "Berlin is in Germany."]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_dir):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("xenc") / "tiny-xenc"
    hf = make_tiny_classifier(folder, "llama", 1, seed=3, vocab_size=49152, max_position_embeddings=512)
    copy_tokenizer(Path(default_model_dir), folder)
    (node,) = start_nodes([("decode", tiny_args(str(folder), "auto", "--node-id", "xenc-0", blocks=256))])
    gw = GatewayThread(model=str(folder), decode=(node.address,), capacity_wait=1)
    try:
        yield gw, hf, AutoTokenizer.from_pretrained(str(folder)), node
    finally:
        gw.close()
        stop_nodes([node])


def _want(hf, tokenizer, query: str, doc: str) -> float:
    with torch.inference_mode():
        return float(torch.sigmoid(hf(**tokenizer(query, doc, return_tensors="pt")).logits[0, 0]))


def test_rerank_and_score_equal_the_transformers_cross_encoder(served):
    gw, hf, tokenizer, node = served
    want = [_want(hf, tokenizer, QUERY, d) for d in DOCS]
    r = httpx.post(gw.url + "/v1/rerank", headers=HEADERS, json={"query": QUERY, "documents": DOCS, "top_n": 3})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(4), key=lambda i: -want[i])[:3]
    for x in results:
        assert abs(x["relevance_score"] - want[x["index"]]) < 1e-5 and x["document"]["text"] == DOCS[x["index"]]
    r = httpx.post(gw.url + "/v1/score", headers=HEADERS, json={"text_1": QUERY, "text_2": DOCS})
    assert [round(d["score"], 5) for d in r.json()["data"]] == [round(w, 5) for w in want]
    pairs = [tokenizer(QUERY, d)["input_ids"] for d in DOCS]
    assert r.json()["usage"]["prompt_tokens"] == sum(map(len, pairs))
    metrics = node.metrics()  # pooled requests have their own series, not the generation histograms
    assert metrics.value("kvrelay:pooling_requests_total", model_name="tiny-xenc") == 8
    assert metrics.value("kvrelay:pooled_tokens_total", model_name="tiny-xenc") == 2 * sum(map(len, pairs))
    assert not metrics.value("vllm:time_to_first_token_seconds_count", model_name="tiny-xenc")


def test_a_cross_encoder_neither_embeds_nor_chats(served):
    gw, _, _, _ = served
    r = httpx.post(gw.url + "/v1/embeddings", headers=HEADERS, json={"input": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "cannot embed" in r.json()["error"]["message"]
    r = httpx.post(gw.url + "/v1/completions", headers=HEADERS, json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 400 and "classify pooling requests only" in r.json()["error"]["message"], r.text
    r = httpx.post(gw.url + "/v1/rerank", headers=HEADERS, json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 200  # and it still serves
