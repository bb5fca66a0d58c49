"""The Hugging Face transformers baseline: `AutoModelForCausalLM.generate` on the benchmark workload.

Requests go in arrival order, in fixed batches (left padding, sdpa attention, greedy). Each batch
generates exactly its longest output length for every row; a request counts only its own output length
as useful tokens (the rest is the price of static batching and is reported as waste).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from kvrelay.bench.workload import BenchRequest


def load_hf_model(path: str, dtype: torch.dtype, device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def pad_token_id(model) -> int:
    cfg = model.config
    for tid in (getattr(cfg, "pad_token_id", None), getattr(cfg, "eos_token_id", None)):
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


def generation_config(num_tokens: int, pad_id: int):
    """Greedy, exactly `num_tokens` new tokens.

    There is no EOS token: like our engine's ignore_eos, an EOS may be generated and decoding goes on,
    so the logits of both systems are processed the same way (min_new_tokens then suppresses nothing).
    """
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                            pad_token_id=pad_id, eos_token_id=None, use_cache=True)


class _StepStreamer:
    """Shows the decode step of the running batch on the progress bar (generate calls put() per step)."""

    def __init__(self, bar, num_tokens: int) -> None:
        self.bar, self.num_tokens, self.calls = bar, num_tokens, 0

    def put(self, value) -> None:
        self.calls += 1  # the first call carries the prompt
        step = self.calls - 1
        if step and (step % 8 == 0 or step == self.num_tokens):
            self.bar.set_postfix_str(f"batch step {step}/{self.num_tokens}")

    def end(self) -> None:
        pass


@torch.inference_mode()
def generate_batch(model, batch: Sequence[BenchRequest], pad_id: int, bar=None) -> list[list[int]]:
    """Each request's own output tokens (its output_len first tokens of the batch's generation)."""
    ids, mask = left_pad([r.prompt_token_ids for r in batch], pad_id)
    num_tokens = max(r.output_len for r in batch)
    streamer = _StepStreamer(bar, num_tokens) if bar is not None and not bar.disable else None
    out = model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                         generation_config=generation_config(num_tokens, pad_id), streamer=streamer)
    new = out[:, ids.shape[1]:]
    return [new[row, : r.output_len].tolist() for row, r in enumerate(batch)]


def batches(requests: Sequence[BenchRequest], size: int) -> list[Sequence[BenchRequest]]:
    if size < 1:
        raise ValueError(f"hf_batch_size: must be >= 1, got {size}")
    return [requests[i:i + size] for i in range(0, len(requests), size)]


def run_hf(path: str, dtype: torch.dtype, requests: Sequence[BenchRequest], batch_size: int,
           progress: bool = True, device: torch.device | str = "cpu") -> tuple[dict, list[list[int]]]:
    """Time transformers on the workload, on our engine's device; returns (metrics, each request's output tokens)."""
    t0 = time.perf_counter()
    model = load_hf_model(path, dtype, device)
    load_s = time.perf_counter() - t0
    pad_id = pad_token_id(model)
    generate_batch(model, [BenchRequest(0, requests[0].prompt_token_ids[:8], 2, 0)], pad_id)  # warm-up
    tokens: list[list[int]] = []
    bar = tqdm(total=len(requests), desc="hf requests", unit="req", disable=not progress)
    t0 = time.perf_counter()
    for batch in batches(requests, batch_size):
        tokens.extend(generate_batch(model, batch, pad_id, bar))
        bar.update(len(batch))
    elapsed = time.perf_counter() - t0
    bar.close()
    metrics = hf_metrics(elapsed, requests, batch_size, tokens)
    metrics["load_s"] = load_s
    return metrics, tokens


def hf_metrics(elapsed: float, requests: Sequence[BenchRequest], batch_size: int,
               tokens: Sequence[Sequence[int]]) -> dict:
    useful = sum(min(len(t), r.output_len) for t, r in zip(tokens, requests))
    generated = sum(len(b) * max(r.output_len for r in b) for b in batches(requests, batch_size))
    padded_prompt = sum(len(b) * max(r.input_len for r in b) for b in batches(requests, batch_size))
    inputs = sum(r.input_len for r in requests)
    return {
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": useful / elapsed,
        "total_tokens_per_s": (inputs + useful) / elapsed,
        "batch_size": batch_size,
        "attn_implementation": "sdpa",
        "generated_tokens": generated,
        "useful_output_tokens": useful,
        "wasted_output_fraction": 1.0 - useful / generated,
        "padded_prompt_tokens": padded_prompt,
        "wasted_prompt_fraction": 1.0 - inputs / padded_prompt,
    }


def compare_greedy(ours: Sequence[Sequence[int]], hf: Sequence[Sequence[int]],
                   requests: Sequence[BenchRequest]) -> dict:
    """Position-wise agreement of greedy tokens. bf16 rounding differs between the two systems, and after
    the first different token the continuations diverge, so this is informative, never a failure."""
    per_request = []
    same = total = 0
    for a, b, r in zip(ours, hf, requests):
        a, b = list(a[: r.output_len]), list(b[: r.output_len])
        matches = sum(x == y for x, y in zip(a, b))
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        per_request.append({"index": r.index, "tokens": r.output_len, "identical": matches,
                            "identical_prefix": prefix})
        same, total = same + matches, total + r.output_len
    return {
        "requests_checked": len(per_request),
        "identical_token_fraction": same / total if total else 1.0,
        "identical_prefix_fraction": (sum(p["identical_prefix"] for p in per_request) / total) if total else 1.0,
        "per_request": per_request,
    }
