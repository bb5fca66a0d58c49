"""`kvrelay bench soak`: how answers are judged, and a short real run (burst + crashes) on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.bench import parse_args, soak
from kvrelay.bench.client import Reply
from tests.helpers.models import make_tiny_with_tokenizer
from tests.helpers.procs import alive


@pytest.mark.parametrize("reply,verdict", [
    (Reply(200, text="hi", done=True), "ok"),
    (Reply(200, text="hi"), "bad"),  # a stream without [DONE]
    (Reply(200, error="stream error: node failed", done=True), "bad"),  # an error event in the stream
    (Reply(400, error="x", error_body=True, done=True), "client"),
    (Reply(422, error="x", done=True), "bad"),  # a 4xx without an OpenAI error body
    (Reply(429, {"retry-after": "1"}, error="x", error_body=True, done=True), "rejected"),
    (Reply(503, error="x", error_body=True, done=True), "bad"),  # no Retry-After
    (Reply(502, {"retry-after": "1"}, error="x", error_body=True, done=True), "bad"),
    (Reply(0, error="ReadError"), "bad"),
])
def test_verdicts(reply, verdict):
    assert soak.verdict(reply) == verdict


@pytest.mark.timeout(600)
def test_a_short_soak_on_a_tiny_model(tmp_path, default_model_dir, spawned):
    """Burst with malformed requests on a small KV cache, then crashes under load: nothing fails, nothing
    differs from the fault-free run, no block leaks, and no process is left behind."""
    model = make_tiny_with_tokenizer(tmp_path / "tiny-soak", Path(default_model_dir))
    args = parse_args(soak.__name__, [
        "--model", str(model), "--duration", "8", "--kill-every", "5", "--concurrency", "3", "--num-prompts", "12",
        "--burst", "40", "--prefill", "1", "--decode", "2", "--kv-cache-memory", str(64 * 12288),
        "--settle-timeout", "60", "--output-dir", str(tmp_path)])
    code = soak.run(args)
    report = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0 and report["ok"], json.dumps(report, indent=1)[:4000]
    burst = report["burst"]
    assert burst["valid"]["completed"] == 40 and burst["malformed"]["verdicts"] == {"client": 4}
    assert report["soak"]["failed"] == 0 and report["soak"]["mismatches"] == 0 and report["soak"]["completed"] > 0
    assert report["soak"]["checked_against_reference"] > 0
    assert report["faults"] and report["leaked_blocks"] == 0 and report["gateway"]["kvrelay:retries_total"] >= 0
    assert all(n["running"] == n["waiting"] == n["blocks_in_use"] == 0 for n in report["nodes_after"])
    assert not [p for pids in spawned for p in pids if alive(p)], "processes left behind"
