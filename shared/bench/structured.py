"""`kvrelay bench structured`: what grammar-constrained decoding costs, against unconstrained in the same run.

One engine in this process (the default model unless --model), two measurements:

1. Step cost. What constrained rows add to a step is the grammar work around the sampler: fill each
   constrained row's bitmask, mask the logits, advance each matcher by its token. `sampler` times exactly that
   part of a step, on the real vocabulary, for a batch of --batch rows with 0, half and all of them constrained
   (real matchers, under a JSON schema whose string cannot close; variants interleaved, medians), and reports
   the time each constrained row adds. `engine` runs whole engine steps of --batch decoding requests the same
   three ways (interleaved rounds, medians): the model's forward dominates a step, so there the difference is
   within the machine's noise unless the grammar work is large. The per-row pieces (fill, apply, accept) are
   timed on their own too.
2. Time to first token. --repetitions single requests each (a fresh prompt every time, so no prefix-cache hit):
   unconstrained; under a schema never seen before (its compile is on the path); and under that same schema
   again (cached). Reported as medians, with the TTFT a first-seen schema adds over the cached one and what the
   cached one adds over unconstrained. The grammar backend's one-time start (reading the tokenizer) is
   reported on its own.

    kvrelay bench structured --dtype float32 --num-threads 1
    kvrelay bench structured --batch 4 --steps 8 --repetitions 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvrelay.bench.offline import run_closed_loop
from kvrelay.bench.report import emit, machine
from kvrelay.common.sampling_params import SamplingParams, StructuredOutputs

HELP = "structured outputs: per-step cost of constrained rows and TTFT of a first-seen vs cached schema"

# A string of at least 2000 characters: the rows cannot finish it within the measured steps.
_LONG_SCHEMA = StructuredOutputs.json_schema({"type": "object", "required": ["story"], "additionalProperties": False,
                                              "properties": {"story": {"type": "string", "minLength": 2000}}})


def _ttft_schema(i: int) -> StructuredOutputs:
    """A realistic nested schema, new for every i (a property name differs)."""
    return StructuredOutputs.json_schema({"type": "object", "properties": {
        f"name_{i}": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "required": ["city", "zip"], "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}},
        "required": [f"name_{i}", "age", "tags", "address"], "additionalProperties": False})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="model folder, .gguf or 'default' (SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="auto resolves to float32 on CPUs without native bf16")
    p.add_argument("--batch", type=int, default=8, help="decoding requests in the step-cost batch")
    p.add_argument("--steps", type=int, default=12, help="engine steps timed per variant and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the engine-step variants")
    p.add_argument("--repetitions", type=int, default=5, help="requests per TTFT variant")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--output", default="bench/results/structured.json", help="JSON result file")


def _per_variant(samples: dict[int, list[float]], batch: int) -> dict:
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {f"{k}_of_{batch}_constrained": {
        "ms": round(v * 1e3, 3), "ratio_vs_unconstrained": round(v / med[0], 4),
        "added_ms_per_constrained_row": round((v - med[0]) / k * 1e3, 3) if k else 0.0} for k, v in med.items()}


def engine_steps(engine, prompt, batch: int, steps: int, rounds: int) -> dict:
    """Seconds per engine step of `batch` decoding rows, 0, half or all of them under the long schema."""
    engine.compile_grammar(_LONG_SCHEMA).result()
    samples: dict[int, list[float]] = {k: [] for k in sorted({0, batch // 2, batch})}
    for r in range(rounds):
        for k in samples:
            ids = [f"s{r}-{k}-{i}" for i in range(batch)]
            for i, rid in enumerate(ids):
                engine.add_request(rid, prompt(f"Write story number {i} as JSON."), SamplingParams(
                    temperature=1.0, seed=i, max_tokens=10_000, ignore_eos=True,
                    structured_outputs=_LONG_SCHEMA if i < k else None))
            started: set[str] = set()
            while len(started) < batch:  # prefills, until every row decodes
                started.update(o.req_id for o in engine.step())
            t0 = time.perf_counter()
            for _ in range(steps):
                outs = engine.step()
                assert len(outs) == batch and not any(o.finish_reason for o in outs), "a row finished early"
            samples[k].append((time.perf_counter() - t0) / steps)
            engine.abort(ids)
            engine.step()
    return _per_variant(samples, batch)


def sampler_steps(engine, batch: int, reps: int) -> dict:
    """The grammar work of one step around the sampler, for `batch` rows of which 0, half, all constrained."""
    import torch

    from kvrelay.engine.sampler import Sampler, SamplingRow, TokenBitmask
    from kvrelay.engine.structured import bitmask_words

    vocab, compiled = engine.vocab_size, engine.compile_grammar(_LONG_SCHEMA).result()
    sampler, words = Sampler(vocab), torch.zeros(batch, bitmask_words(vocab), dtype=torch.int32)
    rows = [SamplingRow(SamplingParams(temperature=1.0, seed=i), [1, 2, 3], [], 100) for i in range(batch)]
    matchers = {k: [compiled.matcher() for _ in range(k)] for k in sorted({0, batch // 2, batch})}
    samples: dict[int, list[float]] = {k: [] for k in matchers}
    torch.manual_seed(0)
    for _ in range(reps):
        for k, ms in matchers.items():
            logits = torch.randn(batch, vocab)
            t0 = time.perf_counter()
            for j, m in enumerate(ms):
                m.fill_bitmask(words, j)
            tokens = sampler(logits, rows, TokenBitmask(list(range(k)), words[:k]) if k else None).token_ids
            assert all(m.accept(t) for m, t in zip(ms, tokens))
            samples[k].append(time.perf_counter() - t0)
    return _per_variant(samples, batch)


def row_pieces(engine, tokenizer) -> dict:
    """Per constrained row, in isolation: bitmask fill, bitmask application, matcher advance (microseconds)."""
    import torch

    from kvrelay.engine.sampler import TokenBitmask, apply_token_bitmask
    from kvrelay.engine.structured import bitmask_words

    matcher = engine.compile_grammar(_ttft_schema(-1)).result().matcher()
    tokens = tokenizer.encode('{"name_-1": "Ada", "age": 36, "tags": ["a", "b"], '
                              '"address": {"city": "Paris", "zip": "75001"}}')
    words = torch.zeros(1, bitmask_words(engine.vocab_size), dtype=torch.int32)
    logits, times = torch.randn(8, engine.vocab_size), {"bitmask_fill_us": [], "bitmask_apply_us": [],
                                                        "matcher_accept_us": []}
    for t in tokens:
        t0 = time.perf_counter()
        matcher.fill_bitmask(words, 0)
        t1 = time.perf_counter()
        apply_token_bitmask(logits, TokenBitmask([0], words))
        t2 = time.perf_counter()
        assert matcher.accept(t)
        for key, dt in zip(times, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
            times[key].append(dt)
    return {**{k: round(statistics.median(v) * 1e6, 1) for k, v in times.items()}, "tokens": len(tokens)}


def ttft(engine, prompt: list[int], spec: StructuredOutputs | None = None) -> float:
    _, (timing,) = run_closed_loop(engine, [(prompt, SamplingParams(temperature=0, max_tokens=1,
                                                                    structured_outputs=spec))])
    return timing.ttft_s


def ttft_variants(engine, prompt, repetitions: int) -> dict:
    """A fresh prompt each time (so the prompt's own compute is the same kind in all three)."""
    rows: dict[str, list[float]] = {"unconstrained": [], "first_seen_schema": [], "cached_schema": []}
    for rep in range(repetitions):
        spec = _ttft_schema(rep * 7919 + int(time.time()) % 10_000)
        rows["unconstrained"].append(ttft(engine, prompt(f"Person {rep}a, as JSON please.")))
        rows["first_seen_schema"].append(ttft(engine, prompt(f"Person {rep}b, as JSON please."), spec))
        rows["cached_schema"].append(ttft(engine, prompt(f"Person {rep}c, as JSON please."), spec))
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
            "first_seen_adds_ms": round((med["first_seen_schema"] - med["cached_schema"]) * 1e3, 2),
            "cached_adds_ms": round((med["cached_schema"] - med["unconstrained"]) * 1e3, 2),
            "samples_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in rows.items()}}


def measure(args: argparse.Namespace) -> dict:
    import torch

    from kvrelay.common.tokenizer import Tokenizer
    from kvrelay.engine.config import engine_config_from_kwargs
    from kvrelay.engine.core import EngineCore

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = EngineCore(engine_config_from_kwargs(args.model, args.dtype, num_gpu_blocks_override=1024,
                                                  max_num_seqs=max(64, args.batch)))
    tokenizer = Tokenizer(engine.info.path)
    prompt = (lambda text: tokenizer.apply_chat_template([{"role": "user", "content": text}]))  # noqa: E731
    try:
        t0 = time.perf_counter()
        engine.compile_grammar(StructuredOutputs.json_schema({"type": "object"})).result()
        backend_start = time.perf_counter() - t0
        ttft(engine, prompt("Warm up, please."))
        steps = {"sampler": sampler_steps(engine, args.batch, max(20, args.steps * 4)),
                 "engine": engine_steps(engine, prompt, args.batch, args.steps, args.rounds)}
        return {"benchmark": "structured", "model": engine.info.model_id, "dtype": str(engine.info.dtype),
                "vocab_size": engine.vocab_size, "backend": engine.config.structured.structured_outputs_backend,
                "machine": machine(),
                "batch": args.batch, "steps": args.steps, "step_cost": steps,
                "row_pieces": row_pieces(engine, tokenizer), "backend_start_ms": round(backend_start * 1e3, 1),
                "ttft": ttft_variants(engine, prompt, args.repetitions)}
    finally:
        engine.shutdown()


def run(args: argparse.Namespace) -> int:
    emit(measure(args), args.output)
    return 0
