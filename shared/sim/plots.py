"""The plots of docs/fleet.md (matplotlib, written as PNG): TTFT CDFs per policy, prefix hit ratio against node
count, the planner's frontier, an autoscaled day."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def ttft_cdfs(cdfs: dict, qps: float, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for (q, policy), values in sorted(cdfs.items(), key=lambda kv: kv[0][1]):
        if q != qps or not values:
            continue
        v = np.sort(np.asarray(values))
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT, llm-d shape, 8 nodes, {qps:g} QPS")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def hit_ratio_by_nodes(rows: list[dict], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for policy in policies:
        pts = sorted((r["nodes"], r["prefix_hit_ratio"]) for r in rows if r["policy"] == policy)
        ax.plot([n for n, _ in pts], [h for _, h in pts], marker="o", label=policy)
    cached = sorted({(r["nodes"], r["would_hit_ratio"]) for r in rows if r["policy"] == "precise"})
    ax.plot([n for n, _ in cached], [h for _, h in cached], "k--", label="cached somewhere (precise run)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("nodes")
    ax.set_ylabel("prefix hit ratio")
    ax.set_ylim(0, 1)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def frontier(rows: list[dict], path: Path, slo_ttft_s: float | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for kind, marker in (("colocated", "o"), ("disaggregated", "s")):
        pts = [(r["nodes"], r["ttft_p90_s"]) for r in rows if (r["colocated"] > 0) == (kind == "colocated")]
        if pts:
            ax.scatter([n for n, _ in pts], [t for _, t in pts], marker=marker, label=kind)
    if slo_ttft_s:
        ax.axhline(slo_ttft_s, color="r", linestyle="--", label="TTFT p90 SLO")
    ax.set_yscale("log")
    ax.set_xlabel("nodes")
    ax.set_ylabel("p90 TTFT (s, log)")
    ax.set_title("planner: shapes tried")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def autoscaled_day(timeline: list[tuple[float, int, int]], arrivals: list[float], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    t = [x[0] for x in timeline]
    ax.step(t, [x[1] for x in timeline], where="post", label="prefill (or colocated) nodes")
    ax.step(t, [x[2] for x in timeline], where="post", label="decode nodes")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("nodes serving")
    ax2 = ax.twinx()
    if arrivals:
        bins = np.arange(0, max(arrivals) + 60, 60)
        counts, edges = np.histogram(arrivals, bins=bins)
        ax2.plot(edges[:-1], counts / 60, color="gray", alpha=0.5, label="arrivals/s")
        ax2.set_ylabel("arrivals per second")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def scale_plots(report: dict, cdfs: dict, out: Path) -> list[Path]:
    paths = []
    sweep = report.get("sweep")
    if sweep and cdfs:
        qps = sweep.get("best_qps") or max(q for q, _ in cdfs)
        paths.append(ttft_cdfs(cdfs, qps, out / "ttft_cdf_8_nodes.png"))
    if report.get("nodes"):
        paths.append(hit_ratio_by_nodes(report["nodes"]["rows"], out / "hit_ratio_by_nodes.png"))
    return paths
