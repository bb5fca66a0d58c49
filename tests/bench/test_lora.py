"""`kvrelay bench lora` on a tiny model: every configuration runs the same workload, the report holds each one against
the base model, more adapters than slots are counted as slot evictions, and the random adapters it writes load in
PEFT and change the model's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvrelay.bench import lora, parse_args
from kvrelay.engine.models import load_model
from tests.helpers.models import make_tiny_checkpoint, make_tiny_with_tokenizer


@pytest.mark.timeout(300)
def test_adapter_counts_against_the_base_model_on_a_tiny_model(tmp_path, default_model_dir):
    model = make_tiny_with_tokenizer(tmp_path / "tiny", Path(default_model_dir))
    out = tmp_path / "lora.json"
    args = parse_args(lora.__name__, [
        "--model", str(model), "--dtype", "float32", "--adapter-counts", "1", "3", "--max-loras", "2",
        "--lora-rank", "4", "--batch-size", "6", "--max-tokens", "3", "--input-len", "8", "16", "--rounds", "2",
        "--kv-cache-memory", str(32 * 2**20), "--output", str(out)])
    assert lora.run(args) == 0
    r = json.loads(out.read_text())
    results = r["results"]
    assert list(results) == ["base", "1_adapters", "3_adapters"]
    for name, res in results.items():
        assert res["requests"] == 12 and res["output_tokens"] == 36, name  # 6 requests x 3 tokens, 2 rounds
        assert res["throughput_vs_base"] == pytest.approx(res["output_tokens_per_s"]
                                                          / results["base"]["output_tokens_per_s"])
    assert results["base"]["slot_evictions"] == 0 and results["3_adapters"]["slot_evictions"] > 0
    assert r["lora"] == {"max_loras": 2, "rank": 4, "adapters": "random, every projection"}


def test_random_adapters_load_in_peft_and_change_the_output(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = make_tiny_checkpoint("qwen2", tmp_path / "base")
    ours = load_model(base, torch.float32, "cpu", "torch")
    folder = lora.write_random_adapter(ours, tmp_path / "a", rank=4, seed=0)
    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    ids = torch.tensor([[5, 9, 200, 31]])
    plain = hf(input_ids=ids).logits
    tuned = PeftModel.from_pretrained(hf, str(folder))(input_ids=ids).logits
    assert (tuned - plain).abs().max() > 1e-3  # every projection's weights were taken, and they matter
