"""PNG charts of benchmark results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

_COLORS = {"kvrelay": "#2b6cb0", "HF transformers": "#dd6b20", "vLLM (CPU)": "#38a169", "matmul ceiling": "#a0aec0"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _systems(result: dict) -> list[tuple[str, dict]]:
    systems = [("kvrelay", result["ours"])]
    for key, label in (("hf", "HF transformers"), ("vllm", "vLLM (CPU)")):
        if isinstance(result.get(key), dict):
            systems.append((label, result[key]))
    return systems


def _bars(ax, labels: list[str], values: list[float], title: str, unit: str) -> None:
    bars = ax.bar(labels, values, color=[_COLORS.get(label, "#718096") for label in labels])
    for bar, value in zip(bars, values):
        ax.annotate(f"{value:,.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=9)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(unit)
    ax.margins(y=0.15)


def _subtitle(result: dict) -> str:
    w, m = result["workload"], result["model"]
    ratio = result.get("ours_over_hf", {}).get("output_tokens_per_s")
    parts = [
        f"{m['model_id']} ({m['dtype']}), {w['num_requests']} requests, "
        f"in {w['input_len_range'][0]}-{w['input_len_range'][1]}, out {w['output_len_range'][0]}-"
        f"{w['output_len_range'][1]} tokens, workload {w['fingerprint'][:12]}",
        f"{result['machine']['cpu_count']} CPUs, shared machine (noisy); kvrelay reaches "
        f"{100 * result['ours']['fraction_of_ceiling']:.1f}% of the matmul ceiling",
    ]
    if ratio is not None:
        parts[1] += f", {ratio:.2f}x HF output tok/s"
    vllm_ratio = result.get("ours_over_vllm", {}).get("output_tokens_per_s")
    if vllm_ratio is not None:
        parts[1] += f", {vllm_ratio:.2f}x vLLM output tok/s"
    return "\n".join(parts)


def plot_throughput(result: dict, path: str | Path) -> Path:
    """Output tok/s (with the matmul ceiling), total tok/s and requests/s, ours vs HF."""
    plt = _pyplot()
    systems = _systems(result)
    names = [name for name, _ in systems]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.6))
    _bars(axes[0], names + ["matmul ceiling"],
          [s["output_tokens_per_s"] for _, s in systems] + [result["ceiling"]["output_tokens_per_s"]],
          "output tokens/s", "tokens/s")
    _bars(axes[1], names, [s["total_tokens_per_s"] for _, s in systems], "total (input + output) tokens/s",
          "tokens/s")
    _bars(axes[2], names, [s["requests_per_s"] for _, s in systems], "requests/s", "requests/s")
    fig.suptitle("kvrelay bench throughput", fontsize=12)
    fig.text(0.5, 0.005, _subtitle(result), ha="center", va="bottom", fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
