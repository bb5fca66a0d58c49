"""`kvrelay bench lora`: throughput and ITL of one engine serving requests for 1, 4, 8 and 32 distinct LoRA adapters,
against the base model alone, on the same workload and in the same run.

One engine (--enable-lora, --max-loras 8 by default) serves every configuration: the same requests (corpus prompts,
a fixed number of greedy output tokens each, all in flight at once), spread round-robin over the configuration's
adapters ("base": no adapter). With more adapters than --max-loras, the scheduler runs at most that many in a step
and the rest wait their turn (slot evictions are counted). The configurations take turns, in one order then the
reverse (--rounds), so each meets the same load from the rest of the machine; the prefix cache is off, so no
configuration reuses another's prompts.

The adapters are random PEFT adapters (--lora-rank, on every projection) written for the model into a temporary
folder, or the folders given with --adapters (reused round-robin when fewer than a configuration needs).
Per request, ITL = (time of the last token - time of the first) / (output tokens - 1).

    kvrelay bench lora
    kvrelay bench lora --adapter-counts 8 --lora-rank 8 --batch-size 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from kvrelay.bench.offline import Timing, run_closed_loop, summarize_timings
from kvrelay.bench.report import emit, machine
from kvrelay.bench.workload import WorkloadSpec, build_workload
from kvrelay.common.sampling_params import SamplingParams

HELP = "LoRA: tokens/s and ITL with 1, 4, 8 and 32 adapters against the base model alone, in one run"
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvrelay.engine.args import add_engine_args

    add_engine_args(p)
    p.set_defaults(enable_lora=True, max_loras=8, enable_prefix_caching=False)
    p.add_argument("--adapter-counts", type=int, nargs="+", default=[1, 4, 8, 32],
                   help="distinct adapters the requests are spread over, per configuration (base always runs)")
    p.add_argument("--adapters", nargs="+", default=None, metavar="FOLDER",
                   help="PEFT adapter folders to use (default: random adapters of --lora-rank)")
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the random adapters")
    p.add_argument("--batch-size", type=int, default=32, help="requests, all in flight at once")
    p.add_argument("--input-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"),
                   help="prompt lengths in tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (greedy, no early stop)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the configurations, alternating their order")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output", default="bench/results/lora.json", help="where the JSON goes too")


def write_random_adapter(model, folder: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter (adapter_config.json + adapter_model.safetensors) on every projection of `model` (an
    engine model: lora_targets() gives the shapes), at a scale that changes its tokens."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    modules = set()
    for layer, module, shards in model.lora_targets():
        in_features = module.weight.shape[1]
        for name, (_, out_features) in shards.items():
            parent = "self_attn" if name in _ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.02
            modules.add(name)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": sorted(modules), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def run(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.common.tokenizer import Tokenizer
    from kvrelay.engine.args import engine_config
    from kvrelay.engine.core import EngineCore

    if args.threads:
        torch.set_num_threads(args.threads)
    counts = sorted(set(args.adapter_counts))
    most = max(counts)
    args.max_cpu_loras = max(most, args.max_cpu_loras or 0, args.max_loras)  # the configurations swap slots only
    args.max_lora_rank = max(args.max_lora_rank, args.lora_rank)
    engine = EngineCore(engine_config(args))
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-lora-") as tmp:
        folders = [Path(f) for f in args.adapters] if args.adapters else [
            write_random_adapter(engine.runner.model, Path(tmp) / f"a{i}", args.lora_rank, seed=i) for i in range(most)]
        names = [f"a{i}" for i in range(most)]
        for name, folder in zip(names, [folders[i % len(folders)] for i in range(most)]):
            engine.add_lora(name, engine.read_lora(name, str(folder)))
        report = _measure(args, engine, Tokenizer(engine.info.path), names, counts)
    engine.shutdown()
    emit(report, args.output)
    return 0


def _measure(args: argparse.Namespace, engine, tokenizer, names: list[str], counts: list[int]) -> dict:
    spec = WorkloadSpec(num_requests=args.batch_size, input_len=tuple(args.input_len),
                        output_len=(args.max_tokens, args.max_tokens))
    prompts = [r.prompt_token_ids for r in build_workload(tokenizer.encode, spec, engine.vocab_size)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    requests = [(p, params) for p in prompts]
    configs = {"base": [""] * len(prompts)}
    configs.update({f"{k}_adapters": [names[i % k] for i in range(len(prompts))] for k in counts})
    run_closed_loop(engine, requests[:4], loras=[names[0], "", names[0], ""])  # first-call allocations
    elapsed = dict.fromkeys(configs, 0.0)
    timings: dict[str, list[Timing]] = {name: [] for name in configs}
    evictions = dict.fromkeys(configs, 0)
    stats = engine.lora.stats
    for r in range(args.rounds):
        for name in list(configs) if r % 2 == 0 else list(reversed(configs)):
            before = stats.slot_evictions
            seconds, t = run_closed_loop(engine, requests, loras=configs[name])
            elapsed[name] += seconds
            timings[name].extend(t)
            evictions[name] += stats.slot_evictions - before
    out = {name: {**summarize_timings(elapsed[name], timings[name]), "slot_evictions": evictions[name]}
           for name in configs}
    base = out["base"]["output_tokens_per_s"]
    for name in configs:
        out[name]["throughput_vs_base"] = out[name]["output_tokens_per_s"] / base
    info = engine.info
    return {
        "benchmark": "lora", "model": info.model_id, "dtype": str(info.dtype).removeprefix("torch."),
        "lora": {"max_loras": engine.config.lora.max_loras, "rank": args.lora_rank if not args.adapters else None,
                 "adapters": args.adapters or "random, every projection"},
        "workload": {"requests": len(prompts), "in_flight": len(prompts), "max_tokens": args.max_tokens,
                     "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts), "rounds": args.rounds},
        "itl_definition": "per request (last token time - first token time) / (output tokens - 1), averaged",
        "machine": machine(), "results": out,
    }
