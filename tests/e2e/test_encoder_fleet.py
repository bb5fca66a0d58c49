"""A sentence-transformers BERT embedder (tiny random weights, a WordPiece tokenizer made here, modules.json
asking for mean pooling) served by a real node behind the gateway: the openai SDK's embeddings equal
transformers' BertModel mean-pooled and normalised; it does not chat (400)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from tests.helpers.gateway import API_KEY, GatewayThread
from tests.helpers.nodes import start_nodes, stop_nodes, tiny_args

WORDS = "the a of to is in paris france capital city river dragons breathe fire berlin germany where".split()
TEXTS = ["Paris is the capital of France", "where is the river", "dragons breathe fire in Germany"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    folder = tmp_path_factory.mktemp("bert") / "tiny-bert"
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
    (node,) = start_nodes([("decode", tiny_args(str(folder), "auto", "--node-id", "bert-0", blocks=64))])
    gw = GatewayThread(model=str(folder), decode=(node.address,), capacity_wait=1)
    try:
        yield gw, hf, BertTokenizerFast.from_pretrained(str(folder))
    finally:
        gw.close()
        stop_nodes([node])


def test_embeddings_equal_transformers_mean_pooled(served):
    gw, hf, tokenizer = served
    got = gw.client().embeddings.create(model="tiny-bert", input=TEXTS)
    for data, text in zip(got.data, TEXTS, strict=True):
        with torch.inference_mode():
            hidden = hf(**tokenizer(text, return_tensors="pt")).last_hidden_state[0]
        want = torch.nn.functional.normalize(hidden.mean(dim=0), dim=0)
        assert torch.nn.functional.cosine_similarity(torch.tensor(data.embedding), want, dim=0) > 1 - 1e-5
    assert got.usage.prompt_tokens == sum(len(tokenizer(t)["input_ids"]) for t in TEXTS)


def test_an_encoder_does_not_chat(served):
    gw, _, _ = served
    r = httpx.post(gw.url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": "where is paris", "max_tokens": 2})
    assert r.status_code == 400 and "is an encoder" in r.json()["error"]["message"], r.text
