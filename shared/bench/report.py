"""How benchmarks report: JSON on stdout and in a file (`emit`), and the results of served runs (`bench serve`,
`bench fleet`): their statistics, files and A/B comparison.

A served result: latencies in milliseconds (mean, std, min, max, p50/p90/p99); ITL pools the gaps between the
content chunks of all successful requests; TPOT is per request (E2E - TTFT) / (completion tokens - 1); goodput
counts the measured requests that succeeded and meet every given SLO (the ITL SLO applies to the request's mean
inter-token latency); the timeline holds output tokens/s and completed requests/s per second of the run.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from kvrelay.bench import plots
from kvrelay.bench.stats import PERCENTILES, distribution

# (metric path in the result, which direction is better)
COMPARE_METRICS = (
    ("request_throughput", "higher"), ("output_throughput", "higher"), ("total_token_throughput", "higher"),
    ("goodput.request_rate", "higher"), ("goodput.fraction", "higher"), ("prefix_hit_ratio", "higher"),
    *((f"{m}.p{p}", "lower") for m in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms") for p in PERCENTILES),
)


def emit(report: dict, path: str | Path | None) -> Path | None:
    """Print `report` as indented JSON and, given a path, write it there too (folders created)."""
    text = json.dumps(report, indent=2)
    print(text)
    if path is None:
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return out


def machine() -> dict:
    """The machine a result was taken on: platform, CPU, cores, Python, and torch's threads and the versions of
    torch and transformers when the benchmark uses them."""
    out = {"host": platform.node(), "platform": platform.platform(),
           "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
           "python": platform.python_version()}
    if torch := sys.modules.get("torch"):
        out.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    if transformers := sys.modules.get("transformers"):
        out["transformers"] = transformers.__version__
    return out


@dataclass
class RequestRecord:
    """One measured request of a served run. Times in seconds; start, end and chunk times from the run's start."""

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


def tpot_s(rec: RequestRecord) -> float | None:
    if rec.completion_tokens < 2 or rec.ttft_s is None:
        return None
    return (rec.e2e_s - rec.ttft_s) / (rec.completion_tokens - 1)


def meets_slos(rec: RequestRecord, slos: dict) -> bool:
    """Whether a successful request meets every given SLO (values in ms; None: not given)."""
    values = {"ttft_ms": rec.ttft_s, "itl_ms": float(np.mean(rec.itl_s)) if rec.itl_s else 0.0, "e2e_ms": rec.e2e_s}
    return rec.success and all(limit is None or values[k] * 1000.0 <= limit for k, limit in slos.items())


def timeline(records: Sequence[RequestRecord], duration: float, bucket: float = 1.0) -> dict:
    """Output tokens/s and completed requests/s in `bucket`-second buckets from the run's start."""
    n = max(1, math.ceil(duration / bucket))
    tokens, done = np.zeros(n), np.zeros(n)
    for r in records:
        if r.success and r.chunk_times_s:
            for t in r.chunk_times_s:
                tokens[min(int(t // bucket), n - 1)] += r.completion_tokens / len(r.chunk_times_s)
            done[min(int(r.end_s // bucket), n - 1)] += 1
    return {"bucket_s": bucket, "output_tokens_per_s": (tokens / bucket).round(3).tolist(),
            "requests_completed_per_s": (done / bucket).round(3).tolist()}


def build_result(label: str, config: dict, records: Sequence[RequestRecord], slos: dict) -> dict:
    """The run's result: config, counts, throughputs, latency distributions, goodput, timeline, records."""
    ok = [r for r in records if r.success]
    duration = max((r.end_s for r in records), default=0.0)
    prompt, completion = sum(r.prompt_tokens for r in ok), sum(r.completion_tokens for r in ok)
    cached, good = sum(r.cached_tokens for r in ok), sum(meets_slos(r, slos) for r in records)
    rate = (lambda x: x / duration if duration > 0 else 0.0)  # noqa: E731
    return {
        "benchmark": "serve", "label": label, **config,
        "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "errors": dict(Counter(r.error[:200] for r in records if not r.success).most_common(10)),
        "requests_without_usage": sum(not r.usage_from_server for r in ok),
        "duration_s": duration, "total_input_tokens": prompt, "total_output_tokens": completion,
        "total_cached_tokens": cached, "prefix_hit_ratio": cached / prompt if prompt else 0.0,
        "request_throughput": rate(len(ok)), "output_throughput": rate(completion),
        "total_token_throughput": rate(prompt + completion),
        "ttft_ms": distribution([r.ttft_s for r in ok]), "itl_ms": distribution([g for r in ok for g in r.itl_s]),
        "e2e_ms": distribution([r.e2e_s for r in ok]),
        "tpot_ms": distribution([t for r in ok if (t := tpot_s(r)) is not None]),
        "goodput": {"slo": {k: v for k, v in slos.items() if v is not None}, "requests": good,
                    "fraction": good / len(records) if records else 0.0, "request_rate": rate(good)},
        "timeline": timeline(records, duration),
        "requests": [_record_json(r) for r in records],
    }


def _record_json(rec: RequestRecord) -> dict:
    d = {k: v for k, v in asdict(rec).items() if k not in ("text", "chunk_times_s")}
    d["itl_s"] = [round(g, 6) for g in rec.itl_s]
    for key in ("start_s", "end_s", "ttft_s", "e2e_s"):
        d[key] = None if d[key] is None else round(d[key], 6)
    return d


def summary(result: dict) -> dict:
    """The result without its per-request records (what is printed)."""
    return {k: v for k, v in result.items() if k != "requests"}


def latency_samples(result: dict) -> dict[str, np.ndarray]:
    """TTFT, ITL and E2E samples in ms of a saved result's successful requests."""
    ok = [r for r in result.get("requests", []) if r["success"]]
    return {"ttft_ms": np.array([r["ttft_s"] for r in ok]) * 1000.0,
            "itl_ms": np.array([g for r in ok for g in r["itl_s"]]) * 1000.0,
            "e2e_ms": np.array([r["e2e_s"] for r in ok]) * 1000.0}


def save(result: dict, path: str | Path, plot: bool = True) -> Path:
    """The JSON and, with `plot`, the latency CDFs beside it (<stem>-latency.png)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if plot:
        result["plots"] = {"latency_cdf": str(_sibling(path, "latency"))}
        plots.latency_cdfs([(result["label"], latency_samples(result))], result["plots"]["latency_cdf"])
    path.write_text(json.dumps(result, indent=1))
    return path


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(f"{path.stem}-{suffix}.png")


# -- comparison ---------------------------------------------------------------------------------------


def _get(result: dict, dotted: str):
    for part in dotted.split("."):
        result = result.get(part) if isinstance(result, dict) else None
    return result


def compare(a: dict, b: dict) -> dict:
    """B/A ratio of each metric, and which run is better on it."""
    rows = []
    for metric, better in COMPARE_METRICS:
        va, vb = _get(a, metric), _get(b, metric)
        winner = None
        if va is not None and vb is not None and va != vb:
            winner = "B" if (vb > va) == (better == "higher") else "A"
        rows.append({"metric": metric, "better": better, "a": va, "b": vb,
                     "b_over_a": vb / va if va and vb is not None else None, "winner": winner})
    return {"a": a.get("label"), "b": b.get("label"), "metrics": rows}


def format_table(comparison: dict) -> str:
    num = (lambda v: "-" if v is None else f"{v:,.3f}")  # noqa: E731
    lines = [f"A = {comparison['a']}    B = {comparison['b']}", f"{'metric':<28}{'A':>14}{'B':>14}{'B/A':>10}  better"]
    for row in comparison["metrics"]:
        lines.append(f"{row['metric']:<28}{num(row['a']):>14}{num(row['b']):>14}{num(row['b_over_a']):>10}  "
                     f"{row['winner'] or '='} ({row['better']} is better)")
    return "\n".join(lines)


def run_compare(path_a: str, path_b: str, output: str | None, plot: bool = True) -> dict:
    """`--compare A.json B.json`: prints the ratio table, writes the comparison JSON and a combined CDF plot."""
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    comparison = compare(a, b)
    path = Path(output or f"bench/results/compare-{a.get('label')}-vs-{b.get('label')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    comparison["files"] = {"a": str(path_a), "b": str(path_b)}
    if plot:
        comparison["plots"] = {"latency_cdf": str(_sibling(path, "cdf"))}
        plots.latency_cdfs([(f"A: {a.get('label')}", latency_samples(a)), (f"B: {b.get('label')}", latency_samples(b))],
                           comparison["plots"]["latency_cdf"])
    path.write_text(json.dumps(comparison, indent=1))
    print(format_table(comparison))
    print(f"wrote {path}")
    return comparison
