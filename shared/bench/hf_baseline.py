"""The Hugging Face transformers baseline: `AutoModelForCausalLM.generate` on the throughput workload, and the
agreement of greedy tokens between two systems.

Requests go in arrival order, in fixed batches (left padding, sdpa attention, greedy). Each batch generates
exactly its longest output length for every row; a request counts only its own output length as useful tokens
(the rest is the price of static batching and is reported as waste).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from kvrelay.bench.stats import rates
from kvrelay.bench.workload import BenchRequest


def pad_token_id(model) -> int:
    for tid in (getattr(model.config, "pad_token_id", None), getattr(model.config, "eos_token_id", None)):
        if isinstance(tid, list):
            tid = tid[0] if tid else None
        if tid is not None:
            return int(tid)
    return 0


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask, [batch, longest], prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def generate_batch(model, batch: Sequence[BenchRequest], pad_id: int) -> list[list[int]]:
    """Each request's own output tokens (its output_len first tokens of the batch's generation). Greedy, exactly
    the longest output length: no EOS token, so that, like our engine's ignore_eos, an EOS is generated and
    decoding goes on, the logits of both systems processed the same way."""
    from transformers import GenerationConfig

    ids, mask = left_pad([r.prompt_token_ids for r in batch], pad_id)
    n = max(r.output_len for r in batch)
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id,
                              eos_token_id=None, use_cache=True)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config)
    return [out[row, ids.shape[1]:ids.shape[1] + r.output_len].tolist() for row, r in enumerate(batch)]


def batches(requests: Sequence[BenchRequest], size: int) -> list[Sequence[BenchRequest]]:
    if size < 1:
        raise ValueError(f"hf_batch_size: must be >= 1, got {size}")
    return [requests[i:i + size] for i in range(0, len(requests), size)]


def run_hf(path: str, dtype: torch.dtype, requests: Sequence[BenchRequest], batch_size: int,
           progress: bool = True, device: torch.device | str = "cpu") -> tuple[dict, list[list[int]]]:
    """Time transformers on the workload, on our engine's device; (metrics, each request's output tokens)."""
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    load_s = time.perf_counter() - t0
    pad_id = pad_token_id(model)
    generate_batch(model, [BenchRequest(0, requests[0].prompt_token_ids[:8], 2, 0)], pad_id)  # warm-up
    tokens: list[list[int]] = []
    t0 = time.perf_counter()
    with tqdm(total=len(requests), desc="hf requests", unit="req", disable=not progress) as bar:
        for batch in batches(requests, batch_size):
            tokens.extend(generate_batch(model, batch, pad_id))
            bar.update(len(batch))
    return {**hf_metrics(time.perf_counter() - t0, requests, batch_size, tokens), "load_s": load_s}, tokens


def hf_metrics(elapsed: float, requests: Sequence[BenchRequest], batch_size: int,
               tokens: Sequence[Sequence[int]]) -> dict:
    useful = sum(min(len(t), r.output_len) for t, r in zip(tokens, requests))
    generated = sum(len(b) * max(r.output_len for r in b) for b in batches(requests, batch_size))
    padded_prompt = sum(len(b) * max(r.input_len for r in b) for b in batches(requests, batch_size))
    inputs = sum(r.input_len for r in requests)
    return {**rates(elapsed, len(requests), inputs, useful), "batch_size": batch_size, "attn_implementation": "sdpa",
            "generated_tokens": generated, "useful_output_tokens": useful,
            "wasted_output_fraction": 1.0 - useful / generated, "padded_prompt_tokens": padded_prompt,
            "wasted_prompt_fraction": 1.0 - inputs / padded_prompt}


def compare_greedy(ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]],
                   requests: Sequence[BenchRequest]) -> dict:
    """Position-wise agreement of greedy tokens. Rounding differs between two systems, and after the first
    different token the continuations diverge, so this is informative, never a failure."""
    per_request, same, total = [], 0, 0
    for a, b, r in zip(ours, theirs, requests):
        a, b = list(a[: r.output_len]), list(b[: r.output_len])
        matches = sum(x == y for x, y in zip(a, b))
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        per_request.append({"index": r.index, "tokens": r.output_len, "identical": matches, "identical_prefix": prefix})
        same, total = same + matches, total + r.output_len
    return {"requests_checked": len(per_request), "identical_token_fraction": same / total if total else 1.0,
            "identical_prefix_fraction": sum(p["identical_prefix"] for p in per_request) / total if total else 1.0,
            "per_request": per_request}
