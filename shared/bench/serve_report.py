"""Statistics, JSON, PNG plots and the A/B comparison of `kvrelay bench serve` runs.

Latencies are reported in milliseconds: mean, std, min, max and the p50/p90/p99 percentiles (numpy's linear
interpolation). ITL pools the gaps between content chunks of all successful requests; TPOT is per request
(E2E - TTFT) / (completion tokens - 1). Goodput counts the measured requests that succeeded and meet every given
SLO (the ITL SLO applies to the request's mean inter-token latency).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)
BUCKET_S = 1.0
LATENCIES = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))
# (metric path in the result, which direction is better)
COMPARE_METRICS = (
    ("request_throughput", "higher"), ("output_throughput", "higher"), ("total_token_throughput", "higher"),
    ("goodput.request_rate", "higher"), ("goodput.fraction", "higher"), ("prefix_hit_ratio", "higher"),
    *((f"{m}.p{p}", "lower") for m in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms") for p in PERCENTILES),
)


@dataclass
class RequestRecord:
    """One measured request. Times are seconds; start/end/chunk times are relative to the bench start."""

    index: int
    session: int
    turn: int
    start_s: float = 0.0
    end_s: float = 0.0
    success: bool = False
    error: str = "not finished (cancelled at --max-duration)"
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunk_times_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, where the server reports it
    usage_from_server: bool = False
    text: str = ""


# -- statistics ---------------------------------------------------------------------------------------


def distribution(values_s: Sequence[float]) -> dict:
    """Summary of latencies given in seconds, reported in milliseconds."""
    if not len(values_s):
        return {"count": 0, "mean": None, "std": None, "min": None, "max": None,
                **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"count": int(a.size), "mean": float(a.mean()), "std": float(a.std()), "min": float(a.min()),
           "max": float(a.max())}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    return out


def tpot_s(rec) -> float | None:
    if rec.completion_tokens < 2 or rec.ttft_s is None:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.completion_tokens - 1)


def meets_slos(rec, slos: dict) -> bool:
    """Whether a successful request meets every given SLO (values in ms; None: not given)."""
    mean_itl = sum(rec.itl_s) / len(rec.itl_s) if rec.itl_s else 0.0
    values = {"ttft_ms": rec.ttft_s, "itl_ms": mean_itl, "e2e_ms": rec.e2e_s}
    return rec.success and all(limit is None or values[k] * 1000.0 <= limit for k, limit in slos.items())


def goodput(records: Sequence, slos: dict, duration: float) -> dict:
    good = sum(meets_slos(r, slos) for r in records)
    return {"slo": {k: v for k, v in slos.items() if v is not None}, "requests": good,
            "fraction": good / len(records) if records else 0.0,
            "request_rate": good / duration if duration > 0 else 0.0}


def timeline(records: Sequence, duration: float, bucket: float = BUCKET_S) -> dict:
    """Output tokens/s and completed requests/s in `bucket`-second buckets from the bench start."""
    n = max(1, math.ceil(duration / bucket))
    tokens, done = np.zeros(n), np.zeros(n)
    for r in records:
        if not r.success or not r.chunk_times_s:
            continue
        per_chunk = r.completion_tokens / len(r.chunk_times_s)
        for t in r.chunk_times_s:
            tokens[min(int(t // bucket), n - 1)] += per_chunk
        done[min(int(r.end_s // bucket), n - 1)] += 1
    return {"bucket_s": bucket, "output_tokens_per_s": (tokens / bucket).round(3).tolist(),
            "requests_completed_per_s": (done / bucket).round(3).tolist()}


def build_result(label: str, config: dict, records: Sequence, slos: dict) -> dict:
    """The run's result: config, counts, throughputs, latency distributions, goodput, timeline, records."""
    ok = [r for r in records if r.success]
    duration = max((r.end_s for r in records), default=0.0)
    prompt, completion = sum(r.prompt_tokens for r in ok), sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    rate = (lambda x: x / duration if duration > 0 else 0.0)
    return {
        "benchmark": "serve", "label": label, **config,
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": dict(Counter(r.error[:200] for r in records if not r.success).most_common(10)),
        "requests_without_usage": sum(not r.usage_from_server for r in ok),
        "duration_s": duration, "total_input_tokens": prompt, "total_output_tokens": completion,
        "total_cached_tokens": cached, "prefix_hit_ratio": cached / prompt if prompt else 0.0,
        "request_throughput": rate(len(ok)), "output_throughput": rate(completion),
        "total_token_throughput": rate(prompt + completion),
        "ttft_ms": distribution([r.ttft_s for r in ok]),
        "itl_ms": distribution([g for r in ok for g in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in ok]),
        "tpot_ms": distribution([t for r in ok if (t := tpot_s(r)) is not None]),
        "goodput": goodput(records, slos, duration),
        "timeline": timeline(records, duration),
        "requests": [_record_json(r) for r in records],
    }


def _record_json(rec) -> dict:
    d = asdict(rec)
    for key in ("text", "chunk_times_s"):
        d.pop(key)
    d["itl_s"] = [round(g, 6) for g in rec.itl_s]
    for key in ("start_s", "end_s", "ttft_s", "e2e_s"):
        d[key] = None if d[key] is None else round(d[key], 6)
    return d


def summary(result: dict) -> dict:
    """The result without the per-request records (what is printed)."""
    return {k: v for k, v in result.items() if k != "requests"}


# -- files --------------------------------------------------------------------------------------------


def save(result: dict, path: str | Path, plot: bool = True) -> Path:
    """Writes the JSON and, with `plot`, <stem>-latency.png and <stem>-throughput.png beside it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if plot:
        result["plots"] = {"latency_cdf": str(_sibling(path, "latency")),
                           "throughput": str(_sibling(path, "throughput"))}
        plot_latency_cdfs([(result["label"], result)], result["plots"]["latency_cdf"])
        plot_throughput(result, result["plots"]["throughput"])
    path.write_text(json.dumps(result, indent=1))
    return path


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(f"{path.stem}-{suffix}.png")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_samples(result: dict) -> dict[str, np.ndarray]:
    """TTFT, ITL and E2E samples in ms of a result's successful requests."""
    ok = [r for r in result.get("requests", []) if r["success"]]
    return {"ttft_ms": np.array([r["ttft_s"] for r in ok]) * 1000.0,
            "itl_ms": np.array([g for r in ok for g in r["itl_s"]]) * 1000.0,
            "e2e_ms": np.array([r["e2e_s"] for r in ok]) * 1000.0}


def plot_latency_cdfs(runs: Sequence[tuple[str, dict]], path: str | Path) -> Path:
    """One panel per latency (TTFT, ITL, E2E), one CDF line per run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for name, result in runs:
        samples = latency_samples(result)
        for ax, (key, _) in zip(axes, LATENCIES):
            values = np.sort(samples[key])
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=name)
    for ax, (_, title) in zip(axes, LATENCIES):
        ax.set_title(f"{title} CDF", fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of requests" if title != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(" vs ".join(name for name, _ in runs), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def plot_throughput(result: dict, path: str | Path) -> Path:
    """Output tokens/s and completed requests/s per 1 s bucket over the run."""
    plt = _pyplot()
    tl = result["timeline"]
    tokens, done = tl["output_tokens_per_s"], tl["requests_completed_per_s"]
    x = np.arange(len(tokens) + 1) * tl["bucket_s"]  # bucket edges; the last value is repeated to draw its step
    fig, ax = plt.subplots(figsize=(9, 4))
    lines = ax.step(x, tokens + tokens[-1:], where="post", color="#2b6cb0", label="output tokens/s")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    lines += ax2.step(x, done + done[-1:], where="post", color="#dd6b20", alpha=0.6, label="requests completed/s")
    ax2.set_ylabel("requests/s")
    ax.legend(handles=lines, loc="lower center", fontsize=8)
    ax.set_title(f"{result['label']}: {result['completed']} requests, "
                 f"{result['output_throughput']:.1f} output tok/s overall", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


# -- comparison ---------------------------------------------------------------------------------------


def _get(result: dict, dotted: str):
    value = result
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def compare(a: dict, b: dict) -> dict:
    """B/A ratio of each metric, and which run is better on it."""
    rows = []
    for metric, better in COMPARE_METRICS:
        va, vb = _get(a, metric), _get(b, metric)
        ratio = vb / va if va and vb is not None else None
        winner = None
        if va is not None and vb is not None and va != vb:
            winner = "B" if (vb > va) == (better == "higher") else "A"
        rows.append({"metric": metric, "better": better, "a": va, "b": vb, "b_over_a": ratio, "winner": winner})
    return {"a": a.get("label"), "b": b.get("label"), "metrics": rows}


def format_table(comparison: dict) -> str:
    lines = [f"A = {comparison['a']}    B = {comparison['b']}",
             f"{'metric':<28}{'A':>14}{'B':>14}{'B/A':>10}  better"]
    for row in comparison["metrics"]:
        ratio = "-" if row["b_over_a"] is None else f"{row['b_over_a']:.3f}"
        lines.append(f"{row['metric']:<28}{_num(row['a']):>14}{_num(row['b']):>14}{ratio:>10}  "
                     f"{row['winner'] or '='} ({row['better']} is better)")
    return "\n".join(lines)


def _num(value) -> str:
    return "-" if value is None else f"{value:,.3f}"


def run_compare(path_a: str, path_b: str, output: str | None, plot: bool = True) -> int:
    """`--compare A.json B.json`: prints the ratio table, writes the comparison JSON and a combined CDF plot."""
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    comparison = compare(a, b)
    path = Path(output or f"bench/results/compare-{a.get('label')}-vs-{b.get('label')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    comparison["files"] = {"a": str(path_a), "b": str(path_b)}
    if plot:
        comparison["plots"] = {"latency_cdf": str(_sibling(path, "cdf"))}
        plot_latency_cdfs([(f"A: {a.get('label')}", a), (f"B: {b.get('label')}", b)], _sibling(path, "cdf"))
    path.write_text(json.dumps(comparison, indent=1))
    print(format_table(comparison))
    print(f"wrote {path}")
    return 0
