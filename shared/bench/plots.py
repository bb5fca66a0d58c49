"""PNG charts of benchmark results (matplotlib's Agg backend: no display needed): throughput bars of the offline
benchmark against its baselines, and latency CDFs of served runs."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

_COLORS = {"kvrelay": "#2b6cb0", "HF transformers": "#dd6b20", "vLLM (CPU)": "#38a169", "matmul ceiling": "#a0aec0"}
_LATENCIES = (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path, dpi: int = 100) -> Path:
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return Path(path)


def throughput(result: dict, path: str | Path) -> Path:
    """`bench throughput`: output tok/s (with the matmul ceiling), total tok/s and requests/s of each system."""
    plt = _pyplot()
    systems = [("kvrelay", result["ours"])] + [(label, result[key]) for key, label in (
        ("hf", "HF transformers"), ("vllm", "vLLM (CPU)")) if isinstance(result.get(key), dict)]
    names = [name for name, _ in systems]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    panels = ((names + ["matmul ceiling"], [s["output_tokens_per_s"] for _, s in systems]
               + [result["ceiling"]["output_tokens_per_s"]], "output tokens/s", "tokens/s"),
              (names, [s["total_tokens_per_s"] for _, s in systems], "total (input + output) tokens/s", "tokens/s"),
              (names, [s["requests_per_s"] for _, s in systems], "requests/s", "requests/s"))
    for ax, (labels, values, title, unit) in zip(axes, panels):
        bars = ax.bar(labels, values, color=[_COLORS.get(label, "#718096") for label in labels])
        for bar, value in zip(bars, values):
            ax.annotate(f"{value:,.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=9)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)
        ax.margins(y=0.15)
    w, m = result["workload"], result["model"]
    note = (f"{m['model_id']} ({m['dtype']}), {w['num_requests']} requests, in {w['input_len_range'][0]}-"
            f"{w['input_len_range'][1]}, out {w['output_len_range'][0]}-{w['output_len_range'][1]} tokens, workload "
            f"{w['fingerprint'][:12]}\n{result['machine']['cpu_count']} CPUs; kvrelay reaches "
            f"{100 * result['ours']['fraction_of_ceiling']:.1f}% of the matmul ceiling")
    for key, label in (("hf", "HF"), ("vllm", "vLLM")):
        if f"ours_over_{key}" in result:
            note += f", {result[f'ours_over_{key}']['output_tokens_per_s']:.2f}x {label} output tok/s"
    fig.suptitle("kvrelay bench throughput", fontsize=12)
    fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    return _save(fig, path, dpi=110)


def latency_cdfs(runs: Sequence[tuple[str, dict[str, np.ndarray]]], path: str | Path) -> Path:
    """One panel per latency (TTFT, ITL, E2E), one CDF line per (name, samples in ms) run."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (key, title) in zip(axes, _LATENCIES):
        for name, samples in runs:
            values = np.sort(samples[key])
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=name)
        ax.set_title(f"{title} CDF", fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of gaps" if title == "ITL" else "fraction of requests")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.suptitle(" vs ".join(name for name, _ in runs), fontsize=10)
    fig.tight_layout()
    return _save(fig, path)

