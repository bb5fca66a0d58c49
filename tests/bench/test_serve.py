"""`kvrelay bench serve` against the stand-in OpenAI server of conftest.py: its measurements are checked
against the server's known sleeps, its datasets and its A/B comparison."""

from __future__ import annotations

import itertools
import json
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvrelay.bench import report
from kvrelay.bench.report import RequestRecord
from kvrelay.bench.workload import (
    Conversation,
    DatasetSpec,
    TextSource,
    completion_prompt,
    iter_arrivals,
    iter_sessions,
)
from kvrelay.cli import main as cli_main
from tests.bench.conftest import MODEL


def bench(fake, tmp_path, *flags: str, label: str = "t", capsys=None, rc: int = 0) -> dict:
    """Runs `kvrelay bench serve` (plots with --plot); returns the saved JSON."""
    out = tmp_path / f"{label}.json"
    argv = ["--base-url", fake.url, "--no-progress", "--label", label, "--output", str(out), "--warmup", "0", *flags]
    if "--plot" in argv:
        argv.remove("--plot")
    else:
        argv.append("--no-plot")
    assert cli_main(["bench", "serve", *argv]) == rc
    result = json.loads(out.read_text())
    if capsys is not None:
        assert json.loads(capsys.readouterr().out) == report.summary(result)
    return result


def user_texts(bodies: list[dict]) -> list[str]:
    return [b["messages"][-1]["content"] for b in bodies]


# -- the load generator against the server ------------------------------------------------------------


def test_counts_warmup_default_model_json_and_plots(fake, tmp_path, capsys):
    r = bench(fake, tmp_path, "--warmup", "3", "--num-requests", "12", "--concurrency", "4", "--max-tokens", "5",
              "--plot", capsys=capsys)
    assert len(fake.bodies) == 15  # 3 warmup + 12 measured
    assert r["num_requests"] == r["completed"] == 12 and r["failed"] == 0
    assert sorted(q["index"] for q in r["requests"]) == list(range(12))
    assert all(q["start_s"] >= 0 and q["usage_from_server"] and q["completion_tokens"] == 5 for q in r["requests"])
    assert r["total_cached_tokens"] == 24 and r["prefix_hit_ratio"] == 2 / 7
    # warmup text comes from another seed: the measured prompts are those of a run without warmup
    measured = iter_sessions(DatasetSpec(seed=0, min_output=5, max_output=5), TextSource())
    assert sorted(user_texts(fake.bodies[3:])) == sorted(next(measured).turns[0].user for _ in range(12))
    assert not set(user_texts(fake.bodies[:3])) & set(user_texts(fake.bodies[3:]))
    body = fake.bodies[-1]
    assert body["model"] == MODEL and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body
    assert r["total_output_tokens"] == 60 and r["total_input_tokens"] == 7 * 12
    for key in ("label", "base_url", "model", "endpoint", "dataset", "load", "duration_s", "request_throughput",
                "output_throughput", "total_token_throughput", "ttft_ms", "itl_ms", "e2e_ms", "tpot_ms",
                "goodput", "timeline", "errors", "plots", "requests"):
        assert key in r, key
    assert set(r["ttft_ms"]) >= {"p50", "p90", "p99", "mean"}
    assert r["model"] == MODEL and r["load"]["mode"] == "concurrency" and r["load"]["concurrency"] == 4
    assert r["output_throughput"] == pytest.approx(60 / r["duration_s"])
    assert sum(r["timeline"]["output_tokens_per_s"]) * r["timeline"]["bucket_s"] == pytest.approx(60)
    for png in r["plots"].values():
        assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_percentiles_match_the_server_sleeps(fake, tmp_path):
    fake.first_delay = lambda body: 0.15
    fake.gap = lambda i: 0.08 if i % 5 == 0 else 0.02  # gaps 1..10: 20% are 80 ms
    r = bench(fake, tmp_path, "--num-requests", "12", "--concurrency", "4", "--max-tokens", "11", "--warmup", "2")
    # Sleeps are lower bounds; the upper slack absorbs the stand-in server's own request handling (FastAPI in a
    # thread of this process) and scheduling on a shared, possibly busy 2-core machine.
    slack = 100.0
    ttft, itl, e2e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
    assert 150.0 <= ttft["min"] and ttft["p50"] <= 150 + slack  # the role-only chunk is not the first token
    assert ttft["count"] == 12 and itl["count"] == 12 * 10
    assert 15.0 <= itl["p50"] <= 20 + 30  # 80% of the gaps are 20 ms ...
    assert 70.0 <= itl["p90"] <= 80 + slack  # ... and 20% are 80 ms
    # p99 is the second largest of the 120 gaps: one scheduling stall of the busy machine moves it (a run here
    # saw 327 ms), so it gets only the lower bound; the medians below pin each sleep to its place.
    assert 70.0 <= itl["p99"]
    gaps_ms = np.array([q["itl_s"] for q in r["requests"]]) * 1000.0  # [request, gap before chunk 1..10]
    assert np.median(gaps_ms[:, [4, 9]]) >= 75.0 and np.median(np.delete(gaps_ms, [4, 9], axis=1)) <= 20 + 30
    assert 470.0 <= e2e["min"] and e2e["p50"] <= 470 + 2 * slack  # 150 + 8 x 20 + 2 x 80
    assert 30.0 <= r["tpot_ms"]["p50"] <= 32 + slack / 10
    for key, values in report.latency_samples(r).items():  # the percentiles of the recorded samples
        for p in (50, 90, 99):
            assert r[key][f"p{p}"] == pytest.approx(np.percentile(values, p), abs=1e-3)


def test_goodput_counts_requests_meeting_all_slos(fake, tmp_path):
    fake.first_delay = lambda body: 0.01 if body["max_tokens"] < 8 else 0.4
    r = bench(fake, tmp_path, "--num-requests", "16", "--concurrency", "8", "--min-output", "4", "--max-output",
              "12", "--slo-ttft-ms", "200", "--slo-e2e-ms", "10000")
    fast = sum(q["completion_tokens"] < 8 for q in r["requests"])
    good = sum(q["ttft_s"] <= 0.2 for q in r["requests"])
    assert 0 < fast < 16
    assert r["goodput"]["slo"] == {"ttft_ms": 200.0, "e2e_ms": 10000.0}
    assert r["goodput"]["requests"] == good
    assert r["goodput"]["fraction"] == pytest.approx(good / 16)
    assert r["goodput"]["request_rate"] == pytest.approx(good / r["duration_s"])
    # the slow requests (>= 400 ms) always miss; the fast ones (10 ms) meet it unless the machine stalls 190 ms
    assert fast // 2 <= good <= fast


def test_slo_rules():
    rec = RequestRecord(0, 0, 0, success=True, error="", ttft_s=0.05, e2e_s=0.2, itl_s=[0.01, 0.03])
    assert report.meets_slos(rec, {"ttft_ms": 60, "itl_ms": 20, "e2e_ms": 200})
    assert not report.meets_slos(rec, {"itl_ms": 19.9})  # mean ITL is 20 ms
    assert not report.meets_slos(rec, {"ttft_ms": 40, "itl_ms": None})
    rec.success = False
    assert not report.meets_slos(rec, {})


def test_poisson_rate_follows_the_seeded_schedule(fake, tmp_path):
    r = bench(fake, tmp_path, "--request-rate", "25", "--num-requests", "15", "--seed", "5", "--max-tokens", "2")
    expected = list(itertools.islice(iter_arrivals(25, seed=5), 15))
    starts = sorted(q["start_s"] for q in r["requests"])
    assert len(starts) == 15 and r["load"]["mode"] == "poisson"
    late = [got - want for got, want in zip(starts, expected)]
    # never early; late only by scheduling noise (a stall on a busy shared machine delays the sends due during it,
    # then the schedule catches up)
    assert min(late) >= -0.002 and np.median(late) <= 0.1
    assert expected[-1] <= r["duration_s"] <= expected[-1] + 0.5
    gaps = np.diff(list(itertools.islice(iter_arrivals(25, seed=1), 4000)))
    assert np.mean(gaps) == pytest.approx(1 / 25, rel=0.05)


def test_multi_turn_conversations_grow_with_the_server_replies(fake, tmp_path):
    r = bench(fake, tmp_path, "--dataset", "multi-turn", "--turns", "3", "--num-requests", "9", "--concurrency",
              "3", "--max-tokens", "3", "--min-input", "5", "--max-input", "20")
    assert r["completed"] == 9
    assert sorted(len(b["messages"]) for b in fake.bodies) == [1, 1, 1, 3, 3, 3, 5, 5, 5]
    for i, body in enumerate(fake.bodies):
        assistant = [m["content"] for m in body["messages"] if m["role"] == "assistant"]
        assert all(a in fake.replies[:i] for a in assistant)  # replies the server returned earlier
        if len(body["messages"]) == 5:  # the third turn holds the whole second-turn exchange
            prev = next(b for b in fake.bodies if b["messages"] == body["messages"][:3])
            assert body["messages"][3]["content"] == fake.replies[fake.bodies.index(prev)]
    assert sorted(q["turn"] for q in r["requests"]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_multi_tenant_shares_system_prompts(fake, tmp_path):
    bench(fake, tmp_path, "--dataset", "multi-tenant", "--tenants", "2", "--system-len", "300", "--num-requests",
          "10", "--max-tokens", "2", "--min-input", "5", "--max-input", "30")
    systems = [b["messages"][0]["content"] for b in fake.bodies]
    assert all(b["messages"][0]["role"] == "system" for b in fake.bodies)
    assert len(set(systems)) == 2 and all(len(s.split()) > 300 for s in systems)
    assert len(set(user_texts(fake.bodies))) == 10


def test_completions_endpoint_without_usage_counts_chunks(fake, tmp_path):
    fake.usage = False
    r = bench(fake, tmp_path, "--endpoint", "completions", "--num-requests", "4", "--max-tokens", "6",
              "--ignore-eos", "--extra-body", '{"top_k": 3}', "--model", "other")
    assert all(b["prompt"].endswith("Assistant:") and b["ignore_eos"] and b["top_k"] == 3 for b in fake.bodies)
    assert all(b["model"] == "other" for b in fake.bodies)
    assert r["requests_without_usage"] == 4
    assert all(q["completion_tokens"] == 6 and q["prompt_tokens"] > 0 for q in r["requests"])


def test_failures_are_recorded_with_their_error(fake, tmp_path):
    fake.fail_every = 3
    r = bench(fake, tmp_path, "--num-requests", "9", "--concurrency", "1", "--max-tokens", "2")
    assert r["completed"] == 6 and r["failed"] == 3
    (error, count), = r["errors"].items()
    assert count == 3 and error.startswith("HTTP 503") and "overloaded" in error
    assert r["goodput"]["fraction"] == pytest.approx(6 / 9)


def test_bounded_by_request_timeout_and_duration(fake, tmp_path):
    fake.first_delay = lambda body: 3.0
    t = time.monotonic()
    r = bench(fake, tmp_path, "--num-requests", "2", "--concurrency", "2", "--request-timeout", "0.3", label="a",
              rc=1)
    assert time.monotonic() - t < 5
    assert r["failed"] == 2 and all(e.startswith("timeout") for e in r["errors"])
    fake.first_delay = lambda body: 0.01
    t = time.monotonic()
    r = bench(fake, tmp_path, "--duration", "0.6", "--concurrency", "2", "--max-tokens", "4", label="b")
    assert time.monotonic() - t < 5
    assert r["completed"] >= 6 and r["load"]["num_requests"] is None
    # A request is handed out before the deadline and sent just after (15 us past it was seen on loaded cores).
    assert max(q["start_s"] for q in r["requests"]) < 0.6 + 0.05 and 0.6 <= r["duration_s"] < 1.0


def test_max_duration_stops_everything(fake, tmp_path):
    fake.first_delay = lambda body: 3.0
    t = time.monotonic()
    out = tmp_path / "cap.json"
    assert cli_main(["bench", "serve", "--base-url", fake.url, "--no-progress", "--no-plot", "--warmup", "0",
                                       "--num-requests", "3", "--max-duration", "1.0", "--output", str(out)]) == 1
    assert time.monotonic() - t < 5
    r = json.loads(out.read_text())
    assert r["stopped_at_max_duration"] and r["completed"] == 0 and r["failed"] == 3


def test_compare_two_runs(fake, tmp_path, capsys):
    fake.first_delay = lambda body: 0.02
    a = bench(fake, tmp_path, "--num-requests", "6", "--max-tokens", "3", label="colocated")
    fake.first_delay = lambda body: 0.3
    b = bench(fake, tmp_path, "--num-requests", "6", "--max-tokens", "3", label="disagg")
    capsys.readouterr()
    out = tmp_path / "cmp.json"
    assert cli_main(["bench", "serve", "--compare", str(tmp_path / "colocated.json"), str(tmp_path / "disagg.json"),
                     "--output", str(out)]) == 0
    table = capsys.readouterr().out
    assert "ttft_ms.p50" in table and "colocated" in table and "disagg" in table
    cmp = json.loads(out.read_text())
    row = next(m for m in cmp["metrics"] if m["metric"] == "ttft_ms.p50")
    assert row["b_over_a"] == pytest.approx(b["ttft_ms"]["p50"] / a["ttft_ms"]["p50"])
    assert row["b_over_a"] > 1.2 and row["winner"] == "A"
    assert open(cmp["plots"]["latency_cdf"], "rb").read(4) == b"\x89PNG"


# -- datasets -----------------------------------------------------------------------------------------


def test_datasets_are_deterministic_and_sized():
    source = TextSource()
    spec = DatasetSpec(name="multi-turn", seed=3, min_input=10, max_input=40, turns=2)
    a = [next(s) for s in [iter_sessions(spec, source)] for _ in range(5)]
    assert a == [next(s) for s in [iter_sessions(spec, source)] for _ in range(5)]
    assert a != [next(s) for s in [iter_sessions(DatasetSpec(name="multi-turn", seed=4), source)] for _ in range(5)]
    assert all(len(s.turns) == 2 for s in a)
    assert all(10 <= source.measure(t.user) - 6 <= 40 for s in a for t in s.turns)  # 6 header words


def test_token_lengths_with_a_tokenizer():
    class Bytes:  # a byte-level stand-in tokenizer
        def encode(self, text, add_special_tokens=True):
            return list(text.encode())

        def decode(self, ids):
            return bytes(ids).decode(errors="replace")

    source = TextSource(Bytes())
    assert source.unit == "tokens"
    text = source.window(random.Random(0), 300)
    assert abs(source.measure(text) - 300) <= 6


def test_conversation_and_completion_prompt():
    session = next(iter_sessions(DatasetSpec(name="multi-tenant", tenants=1, system_len=5), TextSource()))
    conv = Conversation(session)
    msgs = conv.ask(session.turns[0])
    assert [m["role"] for m in msgs] == ["system", "user"]
    conv.answer("fine")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]
    prompt = completion_prompt(conv.messages)
    assert prompt.startswith(session.system) and prompt.endswith("Assistant: fine\n\nAssistant:")


def test_timeline_buckets():
    recs = [SimpleNamespace(success=True, chunk_times_s=[0.1, 0.5, 1.2], completion_tokens=6, end_s=1.3),
            SimpleNamespace(success=False, chunk_times_s=[0.2], completion_tokens=0, end_s=0.3)]
    tl = report.timeline(recs, duration=2.5)
    assert tl["output_tokens_per_s"] == [4.0, 2.0, 0.0] and tl["requests_completed_per_s"] == [0.0, 1.0, 0.0]
