"""`kvrelay bench spec-decode`: speculative decoding (n-gram lookup by default) against plain decoding, on a
copy-heavy workload, in one invocation.

The workload is built from real text available offline, asked through the model's chat template: Python
standard-library functions to refactor (rename a parameter or the function, use f-strings, add type hints,
each returning the whole function) and standard-library documentation to fix a typo in or summarise. Such
outputs repeat long spans of their prompt, which prompt lookup finds.

Both engines decode the same requests greedily (their outputs must be token-identical, and the report says
whether they were) at batch 1 (one request at a time) and batch 16 (16 requests in flight, closed loop),
taking turns (request by request at batch 1) so that both see the same load from the rest of the machine. Per
request, ITL = (time of the last token - time of the first) / (output tokens - 1): the mean time per output
token once decoding started (TPOT). Reported: output tokens/s, mean and p50/p90 ITL, TTFT, the speed-ups
(plain / speculative ITL), and the acceptance rate (accepted / proposed drafts) with its per-position counts.

    kvrelay bench spec-decode
    kvrelay bench spec-decode --speculative-config '{"method": "ngram", "num_speculative_tokens": 6}'
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from kvrelay.bench.report import emit
from kvrelay.bench.workload import iter_corpus_docs

HELP = "speculative decoding vs plain decoding: tokens/s and ITL at batch 1 and 16, acceptance rate"
DEFAULT_OUTPUT = "bench/results/spec_decode.json"
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
NOISE_NOTE = "wall-clock on a shared machine: other processes compete for the CPU cores, numbers are noisy"

# Standard-library functions to refactor: short, self-contained, stable across Python versions.
REFACTOR_FUNCTIONS = (
    "textwrap.indent", "textwrap.dedent", "shutil.copyfileobj", "os.path.commonprefix", "posixpath.splitext",
    "json.dump", "heapq.nsmallest", "bisect.insort_right", "fnmatch.filter", "calendar.monthrange",
    "base64.b32encode", "string.capwords", "glob.escape", "shlex.quote", "difflib.get_close_matches",
    "statistics.median", "statistics.mode", "random.Random.choices", "copy.deepcopy", "functools.cmp_to_key",
)
CODE_TASKS = (
    "Rename the parameter `{param}` to `{param}_value` in the following function and return the whole function:",
    "Rewrite the following Python function to use f-strings where possible. Return the whole function.",
    "Rename the function `{name}` to `{name}_v2` and return the whole function, unchanged otherwise:",
    "Add type hints to the following function and return the whole function:",
)
TEXT_TASKS = (
    "Fix the typo in the following text and return the corrected text:",
    "Summarize the following text in a few sentences, quoting its key sentences:",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvrelay.engine.args import add_engine_args

    add_engine_args(p)
    p.set_defaults(speculative_config=DEFAULT_SPEC)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16], help="requests in flight")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per batch size (default: 8 at batch 1, 2 x the batch size above)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most (greedy)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output", default=DEFAULT_OUTPUT, help="where the JSON goes too")


# -- workload -------------------------------------------------------------------------------------------


def _function_source(dotted: str) -> str | None:
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
            return inspect.getsource(obj)
        except (AttributeError, OSError, TypeError):
            return None
    return None


def build_prompts(num: int) -> list[tuple[str, str]]:
    """(kind, user message) pairs: two code tasks for each text task, over distinct functions and documents."""
    docs = [d for d in iter_corpus_docs() if 400 <= len(d) <= 1200]
    sources = [(f, s) for f in REFACTOR_FUNCTIONS if (s := _function_source(f)) and 8 <= s.count("\n") <= 45]
    prompts = []
    for i in range(num):
        if i % 3 == 2:
            doc = docs[(i * 7) % len(docs)]
            task = TEXT_TASKS[(i // 3) % len(TEXT_TASKS)]
            if task.startswith("Fix the typo"):
                doc = doc.replace("the ", "teh ", 1)
            prompts.append(("text", f"{task}\n\n{doc}"))
            continue
        name, src = sources[i % len(sources)]
        short = name.rsplit(".", 1)[-1]
        params = re.search(r"def \w+\((?:self, )?(\w+)", src)
        task = CODE_TASKS[i % len(CODE_TASKS)].format(name=short, param=params.group(1) if params else "x")
        prompts.append(("code", f"{task}\n\n```python\n{src}```"))
    return prompts


# -- running ----------------------------------------------------------------------------------------------


@dataclass
class _Timing:
    start: float
    first: float | None = None
    last: float = 0.0
    tokens: list[int] = field(default_factory=list)

    def add(self, now: float, tokens) -> None:
        if tokens:
            if self.first is None:
                self.first = now
            self.last = now
            self.tokens.extend(tokens)


def run_closed_loop(engine, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[float, list[_Timing]]:
    """Keep `batch` requests in flight until all are done; (elapsed seconds, per-request timings)."""
    from kvrelay.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    queue = deque(enumerate(prompts))
    timings: dict[int, _Timing] = {}
    live = 0
    t0 = time.perf_counter()
    while queue or live:
        while queue and live < batch:
            i, prompt = queue.popleft()
            timings[i] = _Timing(time.perf_counter())
            engine.add_request(str(i), prompt, params)
            live += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            timings[int(out.req_id)].add(now, out.new_token_ids)
            if out.finish_reason is not None:
                live -= 1
    return time.perf_counter() - t0, [timings[i] for i in range(len(prompts))]


def summarize(elapsed: float, timings: list[_Timing]) -> dict:
    itls = [(t.last - t.first) / (len(t.tokens) - 1) for t in timings if t.first is not None and len(t.tokens) > 1]
    ttfts = [t.first - t.start for t in timings if t.first is not None]
    output = sum(len(t.tokens) for t in timings)
    q = statistics.quantiles(itls, n=10) if len(itls) >= 2 else [itls[0]] * 9 if itls else [0.0] * 9
    return {
        "requests": len(timings), "output_tokens": output, "elapsed_s": elapsed,
        "output_tokens_per_s": output / elapsed,
        "itl_ms_mean": 1000 * statistics.fmean(itls) if itls else None,
        "itl_ms_p50": 1000 * statistics.median(itls) if itls else None, "itl_ms_p90": 1000 * q[8],
        "ttft_ms_mean": 1000 * statistics.fmean(ttfts) if ttfts else None,
    }


def spec_stats(before, after) -> dict:
    drafts = after.spec_num_drafts - before.spec_num_drafts
    proposed = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    old = before.spec_accepted_per_pos
    per_pos = [n - (old[i] if i < len(old) else 0) for i, n in enumerate(after.spec_accepted_per_pos)]
    return {
        "num_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "mean_accepted_per_draft": accepted / drafts if drafts else None,
        "accepted_per_position": per_pos,
    }


def interleaved(engines: dict, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """Both engines on the same requests, alternating (plain, speculative) per request at batch 1 and per
    wave of requests otherwise, so that both meet the same load from whatever else runs on the machine."""
    wave = 1 if batch == 1 else len(prompts)
    timings: dict[str, list[_Timing]] = {name: [] for name in engines}
    elapsed = dict.fromkeys(engines, 0.0)
    before = {name: copy.deepcopy(e.counters()) for name, e in engines.items()}  # counters are live
    for i in range(0, len(prompts), wave):
        names = list(engines) if (i // wave) % 2 == 0 else list(reversed(engines))
        for name in names:
            seconds, t = run_closed_loop(engines[name], prompts[i : i + wave], batch, max_tokens)
            elapsed[name] += seconds
            timings[name].extend(t)
    out = {name: {**summarize(elapsed[name], timings[name]), "spec": spec_stats(before[name], e.counters())}
           for name, e in engines.items()}
    plain, spec = timings["plain"], timings["speculative"]
    out["greedy_outputs_identical"] = [t.tokens for t in plain] == [t.tokens for t in spec]
    paired = [_itl(a) / _itl(b) for a, b in zip(plain, spec) if _itl(a) and _itl(b)]
    out["itl_speedup_median_per_request"] = statistics.median(paired) if paired else None
    return out


def _itl(t: _Timing) -> float | None:
    return (t.last - t.first) / (len(t.tokens) - 1) if t.first is not None and len(t.tokens) > 1 else None


def run(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.bench.throughput import machine_info
    from kvrelay.common.tokenizer import Tokenizer
    from kvrelay.engine.args import engine_config
    from kvrelay.engine.core import EngineCore

    if args.threads:
        torch.set_num_threads(args.threads)
    counts = {b: args.num_requests or (8 if b == 1 else 2 * b) for b in args.batch_sizes}
    spec = args.speculative_config
    engines = {}
    for name, config in (("plain", None), ("speculative", spec)):
        args.speculative_config = config
        engines[name] = EngineCore(engine_config(args))
    args.speculative_config = spec
    info = engines["plain"].info
    tokenizer = Tokenizer(info.path)
    kinds_msgs = build_prompts(max(counts.values()))
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": m}]) for _, m in kinds_msgs]
    for e in engines.values():
        run_closed_loop(e, [prompts[0][:16]], 1, 4)  # first-call allocations and kernel selection
    report = {
        "benchmark": "spec_decode", "model": info.model_id, "dtype": str(info.dtype).removeprefix("torch."),
        "speculative_config": json.loads(spec),
        "workload": {"kinds": [k for k, _ in kinds_msgs], "max_tokens": args.max_tokens,
                     "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts), "requests": counts},
        "itl_definition": "per request (last token time - first token time) / (output tokens - 1), averaged",
        "machine": {**machine_info(), "torch_threads": torch.get_num_threads()},
    }
    for batch in args.batch_sizes:
        r = interleaved(engines, prompts[: counts[batch]], batch, args.max_tokens)
        r["plain"].pop("spec")
        plain, fast = r["plain"], r["speculative"]
        r["itl_speedup"] = plain["itl_ms_mean"] / fast["itl_ms_mean"] if fast["itl_ms_mean"] else None
        r["throughput_ratio"] = fast["output_tokens_per_s"] / plain["output_tokens_per_s"]
        report[f"batch_{batch}"] = r
    del engines
    gc.collect()
    emit(report, args.output)
    return 0

