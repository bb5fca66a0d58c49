"""The benchmarks' statistics: exact values on known samples."""

from __future__ import annotations

import time

import pytest

from kvrelay.bench import stats


def test_percentiles_interpolate_linearly_and_scale():
    values = [0.001 * i for i in range(1, 101)]  # 1..100 ms in seconds
    p = stats.percentiles(values, 1000)
    assert p == {"p50": pytest.approx(50.5), "p90": pytest.approx(90.1), "p99": pytest.approx(99.01)}
    assert stats.percentiles([], 1000) == {"p50": None, "p90": None, "p99": None}
    assert stats.percentiles([3.0], ps=(10, 90)) == {"p10": 3.0, "p90": 3.0}
    assert stats.percentiles([0.0012345, 0.0012345], 1000, digits=3) == {"p50": 1.234, "p90": 1.234, "p99": 1.234}
    assert stats.percentiles([], digits=3)["p50"] is None


def test_distribution_in_milliseconds():
    d = stats.distribution([0.010, 0.020, 0.030, 0.040])
    assert d["count"] == 4 and d["mean"] == pytest.approx(25.0) and d["min"] == pytest.approx(10.0)
    assert d["max"] == pytest.approx(40.0) and d["std"] == pytest.approx(11.180, abs=1e-3)
    assert d["p50"] == pytest.approx(25.0)
    assert stats.distribution([]) == {"count": 0, "mean": None, "std": None, "min": None, "max": None, "p50": None,
                                      "p90": None, "p99": None}


def test_bootstrap_interval_is_seeded_and_holds_the_median():
    values = [1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 10.0]
    low, high = stats.bootstrap_ci(values)
    assert low <= 3.0 <= high and low >= 1.0 and high <= 10.0
    assert stats.bootstrap_ci(values) == [low, high]  # the same seed, the same interval
    assert stats.bootstrap_ci([5.0] * 10) == [5.0, 5.0]
    assert stats.bootstrap_ci([1.0]) is None
    s = stats.summary([0.1, 0.2, 0.3], scale=10)
    assert s["median"] == pytest.approx(2.0) and s["n"] == 3 and s["ci95"][0] <= 2.0 <= s["ci95"][1]
    assert stats.summary([]) == {"median": None, "ci95": None, "n": 0}


def test_rates_and_ratios():
    r = stats.rates(2.0, num_requests=4, input_tokens=100, output_tokens=60)
    assert r == {"elapsed_s": 2.0, "requests_per_s": 2.0, "output_tokens_per_s": 30.0, "total_tokens_per_s": 80.0}
    assert stats.ratios(r, stats.rates(4.0, 4, 100, 60)) == {"requests_per_s": 2.0, "output_tokens_per_s": 2.0,
                                                             "total_tokens_per_s": 2.0}


def test_timings_repeat_until_the_time_and_the_count():
    calls = []
    out = stats.timings(lambda: calls.append(time.sleep(0.002)), min_seconds=0.0, min_runs=3, warmup=2)
    assert len(out) == 3 and len(calls) == 5 and all(t >= 0.002 for t in out)
    out = stats.timings(lambda: time.sleep(0.005), min_seconds=0.03)
    assert sum(out) >= 0.03 and len(out) >= 3
    seen = []
    assert len(stats.timings(seen.append, 0.0, min_runs=5, warmup=1, args="abc")) == 5
    assert seen == ["a", "a", "b", "c", "a", "b"]  # the warm-up call, then five cycling through args
