"""The benchmarks' statistics, computed one way everywhere: percentiles, latency summaries, bootstrap confidence
intervals, throughput rates and repeated timings.

Percentiles use numpy's linear interpolation. Confidence intervals are percentile bootstraps with a fixed seed, so
a result file can be recomputed exactly from its samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


def percentiles(values: Sequence[float], scale: float = 1.0, ps: Sequence[int] = PERCENTILES,
                digits: int | None = None) -> dict:
    """{"p50": ..., "p90": ..., "p99": ...} of values x scale (None without values), rounded to `digits`."""
    a = np.asarray(values, dtype=np.float64) * scale
    out = {f"p{p}": float(np.percentile(a, p)) if a.size else None for p in ps}
    return out if digits is None or not a.size else {k: round(v, digits) for k, v in out.items()}


def distribution(values: Sequence[float], scale: float = 1000.0) -> dict:
    """count, mean, std, min, max and percentiles of values x scale (seconds in, milliseconds out by default)."""
    a = np.asarray(values, dtype=np.float64) * scale
    if not a.size:
        return {"count": 0, "mean": None, "std": None, "min": None, "max": None, **percentiles(a)}
    return {"count": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
            "max": float(a.max()), **percentiles(a)}


def bootstrap_ci(values: Sequence[float], stat: Callable = np.median, confidence: float = 0.95,
                 resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """[low, high] of the `confidence` interval of stat(values), None for fewer than two values."""
    a = np.asarray(values, dtype=np.float64)
    if a.size < 2:
        return None
    draws = np.random.default_rng(seed).choice(a, size=(resamples, a.size))
    estimates = np.apply_along_axis(stat, 1, draws)
    tail = (1 - confidence) / 2 * 100
    return [float(np.percentile(estimates, tail)), float(np.percentile(estimates, 100 - tail))]


def summary(values: Sequence[float], scale: float = 1.0) -> dict:
    """The median of values x scale with its 95% bootstrap interval, and the count."""
    a = np.asarray(values, dtype=np.float64) * scale
    return {"median": float(np.median(a)) if a.size else None, "ci95": bootstrap_ci(a), "n": int(a.size)}


def rates(elapsed_s: float, num_requests: int, input_tokens: int, output_tokens: int) -> dict:
    """Requests, output tokens and all tokens (input + output) per second over `elapsed_s`."""
    return {"elapsed_s": elapsed_s, "requests_per_s": num_requests / elapsed_s,
            "output_tokens_per_s": output_tokens / elapsed_s,
            "total_tokens_per_s": (input_tokens + output_tokens) / elapsed_s}


def ratios(ours: dict, theirs: dict, keys: Sequence[str] = ("requests_per_s", "output_tokens_per_s",
                                                            "total_tokens_per_s")) -> dict:
    return {k: ours[k] / theirs[k] for k in keys}


def timings(fn: Callable, min_seconds: float, min_runs: int = 3, warmup: int = 1,
            args: Sequence | None = None) -> list[float]:
    """Seconds of each call of `fn`, repeated until `min_seconds` have passed and at least `min_runs` calls; with
    `args`, call i is fn(args[i % len(args)])."""
    def call(i: int) -> object:
        return fn() if args is None else fn(args[i % len(args)])

    for i in range(warmup):
        call(i)
    out: list[float] = []
    while sum(out) < min_seconds or len(out) < min_runs:
        t0 = time.perf_counter()
        call(len(out))
        out.append(time.perf_counter() - t0)
    return out
