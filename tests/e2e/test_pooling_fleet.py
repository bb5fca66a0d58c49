"""Pooling-only models served by real nodes behind the gateway, one node each, started together:
- a cross-encoder (a tiny random LlamaForSequenceClassification carrying the default model's tokenizer):
  /v1/rerank and /v1/score equal transformers' sigmoid of the head on tokenizer(query, document), its pooling
  metrics count them, and it neither embeds nor chats (400);
- a sentence-transformers BERT embedder (tiny random weights, a WordPiece tokenizer made here, modules.json asking
  for mean pooling): the openai SDK's embeddings equal transformers' BertModel mean-pooled and normalised; it does
  not chat (400).
"""

from __future__ import annotations

import json
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
WORDS = "the a of to is in paris france capital city river dragons breathe fire berlin germany where".split()
TEXTS = ["Paris is the capital of France", "where is the river", "dragons breathe fire in Germany"]


def _bert(folder: Path):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    config = BertConfig(vocab_size=5 + len(WORDS), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    torch.manual_seed(4)
    hf = BertModel(config).eval()
    hf.save_pretrained(folder)
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    return hf, BertTokenizerFast.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, default_model_dir):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("pooling")
    xenc, bert = root / "tiny-xenc", root / "tiny-bert"
    hf_xenc = make_tiny_classifier(xenc, "llama", 1, seed=3, vocab_size=49152, max_position_embeddings=512)
    copy_tokenizer(Path(default_model_dir), xenc)
    hf_bert, bert_tokenizer = _bert(bert)
    nodes = start_nodes([("decode", tiny_args(str(xenc), "auto", "--node-id", "xenc-0", blocks=256)),
                         ("decode", tiny_args(str(bert), "auto", "--node-id", "bert-0", blocks=64))])
    gws = []
    try:
        gws = [GatewayThread(model=str(m), decode=(n.address,), capacity_wait=1) for m, n in zip((xenc, bert), nodes)]
        yield {"xenc": (gws[0], hf_xenc, AutoTokenizer.from_pretrained(str(xenc)), nodes[0]),
               "bert": (gws[1], hf_bert, bert_tokenizer)}
    finally:
        for gw in gws:
            gw.close()
        stop_nodes(nodes)


def _want(hf, tokenizer, query: str, doc: str) -> float:
    with torch.inference_mode():
        return float(torch.sigmoid(hf(**tokenizer(query, doc, return_tensors="pt")).logits[0, 0]))


def test_rerank_and_score_equal_the_transformers_cross_encoder(fleet):
    gw, hf, tokenizer, node = fleet["xenc"]
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


def test_a_cross_encoder_neither_embeds_nor_chats(fleet):
    gw, _, _, _ = fleet["xenc"]
    r = httpx.post(gw.url + "/v1/embeddings", headers=HEADERS, json={"input": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "cannot embed" in r.json()["error"]["message"]
    r = httpx.post(gw.url + "/v1/completions", headers=HEADERS, json={"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 400 and "classify pooling requests only" in r.json()["error"]["message"], r.text
    r = httpx.post(gw.url + "/v1/rerank", headers=HEADERS, json={"query": QUERY, "documents": DOCS})
    assert r.status_code == 200  # and it still serves


def test_bert_embeddings_equal_transformers_mean_pooled(fleet):
    gw, hf, tokenizer = fleet["bert"]
    got = gw.client().embeddings.create(model="tiny-bert", input=TEXTS)
    for data, text in zip(got.data, TEXTS, strict=True):
        with torch.inference_mode():
            hidden = hf(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        want = torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)
        assert torch.nn.functional.cosine_similarity(torch.tensor(data.embedding), want, dim=0) > 1 - 1e-5
    assert got.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)


def test_an_encoder_does_not_chat(fleet):
    gw, _, _ = fleet["bert"]
    r = httpx.post(gw.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": "where is paris", "max_tokens": 2})
    assert r.status_code == 400 and "is an encoder" in r.json()["error"]["message"], r.text
