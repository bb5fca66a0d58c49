"""`kvrelay bench spec-decode`: speculative decoding (n-gram lookup by default) against plain decoding, on a
copy-heavy workload, in one invocation.

The workload (kvrelay.bench.workload.copy_tasks) asks, through the model's chat template, to refactor Python
standard-library functions and to fix a typo in or summarise their documentation: outputs that repeat long spans
of their prompt, which prompt lookup finds.

Both engines decode the same requests greedily (their outputs must be token-identical, and the report says
whether they were) at batch 1 (one request at a time) and batch 16 (16 requests in flight, closed loop), taking
turns (request by request at batch 1) so that both see the same load from the rest of the machine. Per request,
ITL = (time of the last token - time of the first) / (output tokens - 1): the mean time per output token once
decoding started (TPOT). Reported: output tokens/s, mean and p50/p90 ITL, TTFT, the speed-ups (plain /
speculative ITL; the per-request median with its 95% interval), and the acceptance rate (accepted / proposed
drafts) with its per-position counts.

    kvrelay bench spec-decode
    kvrelay bench spec-decode --speculative-config '{"method": "ngram", "num_speculative_tokens": 6}'
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

from kvrelay.bench.offline import Timing, run_closed_loop, summarize_timings
from kvrelay.bench.report import emit, machine
from kvrelay.bench.stats import summary
from kvrelay.bench.workload import copy_tasks
from kvrelay.common.sampling_params import SamplingParams

HELP = "speculative decoding vs plain decoding: tokens/s and ITL at batch 1 and 16, acceptance rate"
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvrelay.engine.args import add_engine_args

    add_engine_args(p)
    p.set_defaults(speculative_config=DEFAULT_SPEC)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="requests in flight")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per batch size (default: 8 at batch 1, 2 x the batch size above)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most (greedy)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output", default="bench/results/spec_decode.json", help="where the JSON goes too")


def spec_stats(before, after) -> dict:
    drafts = after.spec_num_drafts - before.spec_num_drafts
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    old = before.spec_accepted_per_pos
    return {"num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_per_draft": accepted / drafts if drafts else None,
            "accepted_per_position": [n - (old[i] if i < len(old) else 0)
                                      for i, n in enumerate(after.spec_accepted_per_pos)]}


def interleaved(engines: dict, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """Both engines on the same requests, alternating (plain, speculative) per request at batch 1 and per wave of
    requests otherwise, so that both meet the same load from whatever else runs on the machine."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    wave = 1 if batch == 1 else len(prompts)
    timings: dict[str, list[Timing]] = {name: [] for name in engines}
    elapsed = dict.fromkeys(engines, 0.0)
    before = {name: copy.deepcopy(e.counters()) for name, e in engines.items()}  # counters are live
    for i in range(0, len(prompts), wave):
        for name in list(engines) if (i // wave) % 2 == 0 else list(reversed(engines)):
            seconds, t = run_closed_loop(engines[name], [(p, params) for p in prompts[i:i + wave]], batch)
            elapsed[name] += seconds
            timings[name].extend(t)
    out = {name: {**summarize_timings(elapsed[name], timings[name]), "spec": spec_stats(before[name], e.counters())}
           for name, e in engines.items()}
    plain, spec = timings["plain"], timings["speculative"]
    out["greedy_outputs_identical"] = [t.tokens for t in plain] == [t.tokens for t in spec]
    out["itl_speedup_per_request"] = summary([a.tpot_s / b.tpot_s for a, b in zip(plain, spec)
                                              if a.tpot_s and b.tpot_s])
    out["plain"].pop("spec")
    fast = out["speculative"]
    out["itl_speedup"] = out["plain"]["itl_ms_mean"] / fast["itl_ms_mean"] if fast["itl_ms_mean"] else None
    out["throughput_ratio"] = fast["output_tokens_per_s"] / out["plain"]["output_tokens_per_s"]
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.common.tokenizer import Tokenizer
    from kvrelay.engine.args import engine_config
    from kvrelay.engine.core import EngineCore

    if args.threads:
        torch.set_num_threads(args.threads)
    counts = {b: args.num_requests or (8 if b == 1 else 2 * b) for b in args.batch_sizes}
    spec = args.speculative_config
    engines = {name: EngineCore(engine_config(argparse.Namespace(**{**vars(args), "speculative_config": config})))
               for name, config in (("plain", None), ("speculative", spec))}
    info = engines["plain"].info
    tokenizer = Tokenizer(info.path)
    tasks = copy_tasks(max(counts.values()))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}]) for _, m in tasks]
    for e in engines.values():  # first-call allocations and kernel selection
        run_closed_loop(e, [(prompts[0][:16], SamplingParams(temperature=0.0, max_tokens=4))])
    report = {
        "benchmark": "spec_decode", "model": info.model_id, "dtype": str(info.dtype).removeprefix("torch."),
        "speculative_config": json.loads(spec),
        "workload": {"kinds": [k for k, _ in tasks], "max_tokens": args.max_tokens,
                     "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts), "requests": counts},
        "itl_definition": "per request (last token time - first token time) / (output tokens - 1), averaged",
        "machine": machine(),
    }
    for batch in args.batch_sizes:
        report[f"batch_{batch}"] = interleaved(engines, prompts[: counts[batch]], batch, args.max_tokens)
    for e in engines.values():
        e.shutdown()
    emit(report, args.output)
    return 0

