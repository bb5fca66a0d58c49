"""`kvrelay bench spec-decode` on a tiny model: both engines decode the same tokens, the report holds both sides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.bench import parse_args, spec_decode
from kvrelay.bench.workload import copy_tasks
from tests.helpers.models import make_tiny_with_tokenizer


def test_copy_tasks_repeat_their_source():
    tasks = copy_tasks(6)
    assert [kind for kind, _ in tasks] == ["code", "code", "text"] * 2
    assert tasks == copy_tasks(6) and len({text for _, text in tasks}) == 6
    assert all("```python\ndef " in text for kind, text in tasks if kind == "code")
    assert "teh " in tasks[2][1] and tasks[5][1].startswith("Summarize")


@pytest.mark.timeout(300)
def test_plain_and_speculative_on_a_tiny_model(tmp_path, default_model_dir):
    model = make_tiny_with_tokenizer(tmp_path / "tiny", Path(default_model_dir))
    out = tmp_path / "spec.json"
    args = parse_args(spec_decode.__name__, [
        "--model", str(model), "--dtype", "float32", "--batch-sizes", "1", "2", "--num-requests", "2",
        "--max-tokens", "6", "--kv-cache-memory", str(64 * 2**20), "--output", str(out)])
    assert spec_decode.run(args) == 0
    r = json.loads(out.read_text())
    assert r["speculative_config"]["method"] == "ngram" and r["workload"]["requests"] == {"1": 2, "2": 2}
    for batch in ("batch_1", "batch_2"):
        b = r[batch]
        assert b["greedy_outputs_identical"]
        assert b["plain"]["requests"] == b["speculative"]["requests"] == 2
        assert b["plain"]["output_tokens"] == b["speculative"]["output_tokens"] == 12
        assert "spec" not in b["plain"] and b["speculative"]["spec"]["num_drafts"] >= 0
        assert b["throughput_ratio"] == pytest.approx(
            b["speculative"]["output_tokens_per_s"] / b["plain"]["output_tokens_per_s"])
        assert b["itl_speedup_per_request"]["n"] == 2
