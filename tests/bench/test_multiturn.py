"""`kvrelay bench multiturn` end to end on a tiny model: both arms run the same conversations on real node
processes, and only the tier's node loads blocks instead of computing them."""

from __future__ import annotations

import json

import pytest

from kvrelay.bench import multiturn, parse_args
from tests.helpers.models import make_tiny_checkpoint


@pytest.mark.timeout(240)
def test_both_arms_run_the_same_turns_and_only_the_tier_loads(tmp_path):
    model = str(make_tiny_checkpoint("llama", tmp_path / "tiny", max_position_embeddings=1024))
    out = tmp_path / "multiturn.json"
    # 2 conversations x 4 turns of 64 + 8 tokens (576 in all) on 320 tokens of KV (12,288 bytes a block of 16).
    args = parse_args("kvrelay.bench.multiturn", [
        "--model", model, "--dtype", "float32", "--sessions", "2", "--turns", "4", "--user-tokens", "64",
        "--output-tokens", "8", "--think-time", "0.1", "--kv-cache-memory", str(20 * 12288), "--num-threads", "1",
        "--kv-offload-bytes", "16MiB", "--output", str(out)])
    assert multiturn.run(args) == 0
    (round_,) = json.loads(out.read_text())["rounds"]
    base, tier = round_["no_tier"], round_["tier"]
    for arm in (base, tier):
        assert sorted((t["session"], t["turn"], t["prompt_tokens"]) for t in arm["turns"]) == [
            (s, k, 72 * k + 64) for s in range(2) for k in range(4)]
        assert all(t["output_tokens"] == 8 and t["ttft_s"] > 0 for t in arm["turns"])
        assert arm["kv_capacity_tokens"] == 320 and arm["context_over_capacity"] == pytest.approx(576 / 320)
    assert base["blocks_loaded"] == 0 and tier["blocks_loaded"] > 0 and tier["checksum_failures"] == 0
    assert base["load_token_cost"] == 0 and 0 < tier["load_token_cost"] <= 1  # what routing weighs its hits by
    assert tier["prefix_cache_hit_tokens"] > base["prefix_cache_hit_tokens"]


def test_the_cache_is_sized_to_a_quarter_of_the_conversations(tmp_path):
    """Without --kv-cache-memory the cache holds 1/4 of the total context, in the KV dtype asked for: 2 x 4 turns of
    72 tokens are 576, so 144 tokens at 768 bytes each (3 layers x K and V x 2 heads x 16 dims x 4 bytes)."""
    model = str(make_tiny_checkpoint("llama", tmp_path / "tiny", max_position_embeddings=1024))
    flags = ["--model", model, "--sessions", "2", "--turns", "4", "--user-tokens", "64", "--output-tokens", "8"]
    assert multiturn.kv_memory_for(parse_args("kvrelay.bench.multiturn", [*flags, "--dtype", "float32"])) == 144 * 768
    assert multiturn.kv_memory_for(parse_args("kvrelay.bench.multiturn", [
        *flags, "--dtype", "bfloat16", "--context-over-capacity", "2"])) == 288 * 384
