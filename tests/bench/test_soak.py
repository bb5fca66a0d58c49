"""`kvrelay bench soak`: how answers are judged, and a short real run (burst + crashes) on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.bench import parse_args, soak
from kvrelay.bench.soak_workload import Outcome, Tally, build_requests
from tests.e2e.test_gateway import make_tiny_with_tokenizer
from tests.helpers.procs import alive, descendants


@pytest.mark.parametrize("outcome,verdict", [
    (Outcome(200, text="hi"), "ok"),
    (Outcome(200, text="hi", done=False), "bad"),  # a stream without [DONE]
    (Outcome(200, error="node failed"), "bad"),  # an error event in the stream
    (Outcome(400, error="x", error_body=True), "client"),
    (Outcome(422, error="x"), "bad"),  # a 4xx without an OpenAI error body
    (Outcome(429, error="x", error_body=True, retry_after="1"), "rejected"),
    (Outcome(503, error="x", error_body=True), "bad"),  # no Retry-After
    (Outcome(502, error="x", error_body=True, retry_after="1"), "bad"),
    (Outcome(0, error="ReadError", done=False), "bad"),
])
def test_verdicts(outcome, verdict):
    assert outcome.verdict == verdict


def test_tally_counts_failures_and_mismatches(default_tokenizer):
    reqs = build_requests(default_tokenizer, 12, seed=0, max_tokens=4)
    assert {r.endpoint for r in reqs} == {"chat", "completions"} and {r.stream for r in reqs} == {False, True}
    assert sum(r.checked for r in reqs) == 8  # greedy and seeded; unseeded ones are only required to succeed
    assert all(80 <= default_tokenizer_len(default_tokenizer, r) <= 460 for r in reqs)
    checked = [r for r in reqs if r.checked]
    ref = {r.name: "same" for r in checked}
    t = Tally()
    t.add(Outcome(200, text="same"), checked[0], ref)
    t.add(Outcome(200, text="different"), checked[1], ref)
    t.add(Outcome(429, error="busy", error_body=True, retry_after="1"), checked[2], ref)
    t.add(Outcome(400, error="bad", error_body=True))
    report = t.report()
    assert (report["sent"], report["completed"], report["failed"], report["mismatches"]) == (4, 2, 1, 1)
    assert report["mismatched_requests"] == [checked[1].name]


def default_tokenizer_len(tok, req) -> int:
    text = req.body["messages"][0]["content"] if req.endpoint == "chat" else req.body["prompt"]
    return len(tok.encode(text))


def test_started_lines_name_the_current_pids(tmp_path):
    log = tmp_path / "up.log"
    log.write_text("x INFO kvrelay.up: started decode-0 (pid 11), log a\nx INFO kvrelay.up: started gateway (pid 12)\n"
                   "x INFO kvrelay.up: started decode-0 (pid 13), log a\n")
    assert soak._STARTED.findall(log.read_text()) == [("decode-0", "11"), ("gateway", "12"), ("decode-0", "13")]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_short_soak_on_a_tiny_model(tmp_path, default_model_dir):
    """Burst with malformed requests on a small KV cache, then crashes under load: nothing fails, nothing
    differs from the fault-free run, no block leaks, and no process is left behind."""
    model = make_tiny_with_tokenizer(tmp_path / "tiny-soak", Path(default_model_dir))
    args = parse_args(soak.__name__, [
        "--model", str(model), "--duration", "25", "--kill-every", "8", "--concurrency", "3", "--num-prompts", "12",
        "--burst", "40", "--prefill", "1", "--decode", "2", "--kv-cache-memory", str(64 * 12288),
        "--settle-timeout", "60", "--output-dir", str(tmp_path)])
    spawned: list[set[int]] = []
    real_enter = soak.FleetProcess.__enter__

    def enter(self):
        out = real_enter(self)
        spawned.append(descendants(self.proc.pid) | {self.proc.pid})
        return out

    soak.FleetProcess.__enter__ = enter
    try:
        code = soak.run(args)
    finally:
        soak.FleetProcess.__enter__ = real_enter
    report = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0 and report["ok"], json.dumps(report, indent=1)[:4000]
    burst = report["burst"]
    assert burst["valid"]["completed"] == 40 and burst["malformed"]["verdicts"] == {"client": 4}
    assert report["soak"]["failed"] == 0 and report["soak"]["mismatches"] == 0 and report["soak"]["completed"] > 0
    assert report["faults"] and report["leaked_blocks"] == 0
    assert all(n["running"] == n["waiting"] == n["blocks_in_use"] == 0 for n in report["nodes_after"])
    assert not [p for pids in spawned for p in pids if alive(p)], "processes left behind"
