"""The trace format and the generators."""

from __future__ import annotations

import json

import pytest

from kvrelay.sim.trace import TOKEN_HIGH, TOKEN_LOW, PromptSource, TraceRequest, read_trace, write_trace
from kvrelay.sim.workloads import ChatShape, DayShape, Shape, burst_windows, chat, day, fixed_count, llmd


def test_round_trip_and_order(tmp_path):
    reqs = [TraceRequest(1.5, 8, prefix_group="t1", prefix_len=100, suffix_len=20, tenant="t1"),
            TraceRequest(0.25, 4, prompt_tokens=(5, 6, 7), session="s", model="m", output_tokens=(1, 2))]
    path = write_trace(tmp_path / "t.jsonl", reqs)
    assert json.loads(path.read_text().splitlines()[1]) == {
        "arrival_s": 0.25, "prompt_tokens": [5, 6, 7], "output_len": 4, "session": "s", "model": "m",
        "output_tokens": [1, 2]}
    assert read_trace(path) == sorted(reqs, key=lambda r: r.arrival_s)
    assert [r.prompt_len for r in read_trace(path)] == [3, 120]


@pytest.mark.parametrize("bad, message", [
    ({"arrival_s": 0, "output_len": 1}, "either prompt_tokens or prefix_group"),
    ({"arrival_s": 0, "output_len": 1, "prompt_tokens": [1], "prefix_group": "g"}, "either"),
    ({"arrival_s": 0, "output_len": 0, "prompt_tokens": [1]}, "output_len"),
    ({"arrival_s": -1, "output_len": 1, "prompt_tokens": [1]}, "arrival_s"),
    ({"arrival_s": 0, "output_len": 1, "prefix_group": "g", "prefix_len": 0, "suffix_len": 0}, "prompt of >= 1"),
    ({"arrival_s": 0, "output_len": 1, "prompt_tokens": [1], "colour": "red"}, "unknown trace fields"),
])
def test_bad_lines_name_their_line(tmp_path, bad, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"arrival_s": 0, "output_len": 1, "prompt_tokens": [1]}) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{message}"):
        read_trace(path)


def test_groups_share_prefixes_and_suffixes_are_unique():
    a = TraceRequest(0, 1, prefix_group="g", prefix_len=300, suffix_len=50)
    b = TraceRequest(0, 1, prefix_group="g", prefix_len=200, suffix_len=50)
    src = PromptSource()
    pa, pb = src.prompt(0, a), src.prompt(1, b)
    assert pa[:200] == pb[:200] and pa[200:] != pb[200:250] and len(pa) == 350 and len(pb) == 250
    assert pa[300:] != src.prompt(2, a)[300:]  # the suffix is keyed by the request's line
    assert all(TOKEN_LOW <= t < TOKEN_HIGH for t in pa)
    # A stream's prefix does not depend on who asked first or for how much.
    assert PromptSource().stream("x", 5000)[:10] == PromptSource().stream("x", 10)[:10]
    assert PromptSource().prompt(0, a) == pa


def test_a_chat_turn_finds_the_previous_answer_in_its_prompt():
    turns = chat(0.5, 60.0, seed=2, shape=ChatShape(system_len=100, user_len=20, output_len=30, mean_turns=4))
    by_session: dict[str, list[TraceRequest]] = {}
    for t in turns:
        by_session.setdefault(t.session, []).append(t)
    src = PromptSource()
    multi = [ts for ts in by_session.values() if len(ts) > 1]
    assert multi
    for ts in multi:
        for first, second in zip(ts, ts[1:]):
            answer = src.output_tokens(0, first)
            assert second.prefix_len == first.prefix_len + 30 + 20 and second.arrival_s > first.arrival_s
            assert src.prompt(1, second)[first.prefix_len:first.prefix_len + 30] == answer


def test_generators_are_deterministic_and_follow_their_rates():
    shape = Shape(tenants=5, prefix_len=10, suffix_len=5, output_len=3)
    a, b = llmd(10.0, 200.0, seed=4, shape=shape), llmd(10.0, 200.0, seed=4, shape=shape)
    assert a == b and 1800 < len(a) < 2200 and {r.tenant for r in a} == {f"tenant-{i}" for i in range(5)}
    assert fixed_count(a, 10) == a[:10]
    with pytest.raises(ValueError, match="only"):
        fixed_count(a, 10**6)
    d = DayShape(peak_qps=10.0, day_s=1000.0, bursts=0, requests=shape)
    reqs = day(seed=1, shape=d)
    trough = sum(1 for r in reqs if r.arrival_s < 100 or r.arrival_s > 900)
    peak = sum(1 for r in reqs if 400 <= r.arrival_s < 600)
    assert peak > 3 * trough
    windows = burst_windows(DayShape(bursts=3, day_s=1000.0, burst_s=50.0), seed=1)
    assert len(windows) == 3 and all(b - a == pytest.approx(50.0) for a, b in windows)
    bursty = DayShape(peak_qps=10.0, day_s=1000.0, bursts=3, burst_s=50.0, burst_factor=3.0)
    assert bursty.rate(windows[0][0] + 1, windows) == pytest.approx(3 * bursty.rate(windows[0][0] + 1, []))
