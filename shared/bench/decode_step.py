"""`kvrelay bench decode-step`: a decode step's time on a GPU against its memory-bandwidth floor.

A decode step reads every weight once and every sequence's KV once; on a GPU little else costs, so its floor is
(weight bytes + KV bytes read) / the device's bandwidth. The bandwidth is measured in the same invocation: a
device-to-device copy of 2 GiB, counting the bytes read and the bytes written (what an H200's ~4.8 TB/s HBM
figure counts too).

The model is random Llama weights of a chosen shape (default: Llama 3.2 1B's: 16 layers, hidden 2048, 32 heads,
8 KV heads, vocabulary 128,256, tied embeddings), written as a HF checkpoint in a temporary folder and loaded as
any model is. Each batch size's requests have `--context` tokens of context, their blocks scattered over the
cache; each timed step is the model runner's whole decode step (inputs, forward, greedy sampling, the tokens
back on the host), the contexts growing by one token a step, as in serving. The same steps run with CUDA graphs
(the default) and eagerly (--enforce-eager) in the same invocation. Apart from them, the forward and the greedy
argmax alone are timed on the GPU (CUDA events around back-to-back calls), replaying a graph and launched eagerly:
`forward_graph_over_floor` is the GPU's share of the step against its floor, `step_over_floor` the host's
included (its inputs prepared, the tokens read back).

    kvrelay bench decode-step --batches 1 16 64 256 --context 1024
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvrelay.bench.report import emit, machine

HELP = "GPU decode step time against the bandwidth floor (weights + KV bytes / measured memcpy bandwidth)"

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256], help="decode batch sizes")
    p.add_argument("--context", type=int, default=1024, help="tokens of context per sequence")
    p.add_argument("--steps", type=int, default=30, help="timed steps per batch size (after 3 warm-up steps)")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=LLAMA_1B["num_hidden_layers"], help="decoder layers of the model")
    p.add_argument("--no-eager", action="store_true", help="skip the eager runs")
    p.add_argument("--output", default="bench/results/decode_step.json")


def write_random_llama(folder: Path, shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> None:
    """A HF Llama checkpoint of random weights (drawn on `device`, std 0.02, norms 1) and its config.json."""
    from safetensors.torch import save_file

    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads, d = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {"model.embed_tokens.weight": (shape["vocab_size"], h), "model.norm.weight": None}
    for n in range(layers):
        p = f"model.layers.{n}."
        tensors |= {p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv_heads * d, h),
                    p + "self_attn.v_proj.weight": (kv_heads * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                    p + "input_layernorm.weight": None, p + "post_attention_layernorm.weight": None}
    weights = {name: (torch.ones(h, dtype=dtype) if size is None else
                      (torch.randn(size, generator=gen, device=device) * 0.02).to(dtype).cpu())
               for name, size in tensors.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
              "max_position_embeddings": 131072, "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": str(dtype).removeprefix("torch."), **shape}
    (folder / "config.json").write_text(json.dumps(config))


def memcpy_bandwidth(device: str, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Bytes read plus written per second by the best of `repeats` device-to-device copies of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / best


class DecodeDriver:
    """A model runner and the scheduler outputs of decode steps: `batch` requests of `context` tokens, then a
    token more each step (blocks scattered over the cache)."""

    def __init__(self, folder: Path, args: argparse.Namespace, eager: bool, max_batch: int, max_len: int) -> None:
        from kvrelay.engine.config import EngineConfig
        from kvrelay.engine.model_info import load_model_info
        from kvrelay.engine.model_runner import ModelRunner

        self.block_size = 16
        blocks_per_seq = -(-max_len // self.block_size)
        config = EngineConfig().with_kwargs(
            model=str(folder), dtype=args.dtype, device=args.device, enforce_eager=eager, max_num_seqs=max_batch,
            num_gpu_blocks_override=max_batch * blocks_per_seq + 1, block_size=self.block_size)
        self.runner = ModelRunner(config, load_model_info(config.model))
        self.num_blocks = config.cache.num_gpu_blocks_override
        self.runner.allocate_kv_cache(self.num_blocks)
        start = time.perf_counter()
        self.runner.capture_graphs(max_len)  # (nothing when eager)
        self.graph_seconds = time.perf_counter() - start
        self.blocks_per_seq = blocks_per_seq
        self.vocab = self.runner.vocab_size

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for p in self.runner.model.parameters():
            if p.data_ptr() not in seen and p.stride() != (0, 0):  # a projection on quantized blocks holds none
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        return total

    def kv_bytes_per_token(self) -> int:
        return self.runner.bytes_per_block // self.block_size

    def time_steps(self, batch: int, context: int, steps: int, warmup: int = 3) -> list[float]:
        from kvrelay.common.sampling_params import SamplingParams
        from kvrelay.engine.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

        rng = random.Random(batch)
        free = list(range(1, self.num_blocks))
        rng.shuffle(free)
        params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 1, ignore_eos=True)
        ids = [f"r{batch}-{n}" for n in range(batch)]
        new = tuple(NewRequestData(rid, tuple(rng.randrange(self.vocab) for _ in range(context)), context, params,
                                   tuple(free[n * self.blocks_per_seq:(n + 1) * self.blocks_per_seq]), context - 1)
                    for n, rid in enumerate(ids))
        one = {rid: 1 for rid in ids}
        first = SchedulerOutput(new, (), one, batch, frozenset(), frozenset())
        self.runner.execute(first)
        seconds = []
        for step in range(warmup + steps):
            cached = tuple(CachedRequestData(rid, (), context + step) for rid in ids)
            start = time.perf_counter()
            self.runner.execute(SchedulerOutput((), cached, one, batch, frozenset(), frozenset()))
            seconds.append(time.perf_counter() - start)  # execute returns the tokens on the host: synchronized
        self.runner.execute(SchedulerOutput((), (), {}, 0, frozenset(ids), frozenset()))
        return seconds[warmup:]

    def time_forwards(self, batch: int, context: int, iters: int = 20) -> dict[str, float]:
        """Seconds of the model's decode forward and greedy argmax alone, as the GPU runs them back to back (CUDA
        events around `iters` calls): replaying the runner's graph for this batch, and launched eagerly."""
        from kvrelay.engine.attention.base import AttentionMetadata

        model, caches, bs, dev = self.runner.model, self.runner.kv_caches, self.block_size, self.runner.device
        blocks = torch.randperm(self.num_blocks - 1, device=dev)[: batch * self.blocks_per_seq] + 1
        tables = blocks.view(batch, self.blocks_per_seq).to(torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        last = context - 1
        meta = AttentionMetadata(
            num_reqs=batch, num_decodes=batch, num_decode_tokens=batch,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev), seq_lens=lens,
            query_lens_cpu=[1] * batch, seq_lens_cpu=[context] * batch, max_query_len=1, max_seq_len=context,
            block_tables=tables, slot_mapping=tables[:, last // bs].long() * bs + last % bs, block_size=bs)
        ids = torch.randint(0, self.vocab, (batch,), device=dev)
        pos = torch.full((batch,), last, dtype=torch.int64, device=dev)
        graphs = self.runner.graphs  # the ladder up to the largest batch: this one or the next size up
        size = graphs.size_for(batch, meta) if graphs is not None else None
        if size is None:
            raise RuntimeError(f"no CUDA graph holds {batch} rows")
        steps = {"graph": lambda: model.greedy_tokens(graphs.replay(size, ids, pos, meta)),
                 "eager": lambda: model.greedy_tokens(model(ids, pos, caches, meta))}
        out = {}
        with torch.inference_mode():
            for name, step in steps.items():
                for _ in range(3):
                    step()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    step()
                end.record()
                end.synchronize()
                out[name] = start.elapsed_time(end) / 1e3 / iters
        return out


def measure(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    bandwidth = memcpy_bandwidth(args.device)
    shape = {**LLAMA_1B, "num_hidden_layers": args.layers}
    max_batch, max_len = max(args.batches), args.context + args.steps + 8
    result = {"machine": machine(), "device": torch.cuda.get_device_name(args.device), "dtype": args.dtype,
              "shape": shape, "context": args.context, "memcpy_bytes_per_s": bandwidth, "runs": []}
    with tempfile.TemporaryDirectory(prefix="kvrelay-decode-step-") as tmp:
        write_random_llama(Path(tmp), shape, dtype, args.device)
        modes = ["graphs"] + ([] if args.no_eager else ["eager"])
        for mode in modes:
            driver = DecodeDriver(Path(tmp), args, mode == "eager", max_batch, max_len)
            weights, kv_token = driver.weight_bytes(), driver.kv_bytes_per_token()
            result.update(weight_bytes=weights, kv_bytes_per_token=kv_token)
            if mode == "graphs":
                result["graph_capture_s"] = round(driver.graph_seconds, 2)
            for batch in args.batches:
                seconds = driver.time_steps(batch, args.context, args.steps)
                kv = batch * (args.context + args.steps // 2) * kv_token  # read each step, on average
                floor = (weights + kv) / bandwidth
                step = statistics.median(seconds)
                run = {"mode": mode, "batch": batch, "step_ms": round(step * 1e3, 4),
                       "step_ms_best": round(min(seconds) * 1e3, 4), "floor_ms": round(floor * 1e3, 4),
                       "step_over_floor": round(step / floor, 3), "kv_bytes": kv}
                if mode == "graphs":  # the forward alone, at exactly --context tokens
                    floor = (weights + batch * args.context * kv_token) / bandwidth
                    for name, sec in driver.time_forwards(batch, args.context).items():
                        run[f"forward_{name}_ms"] = round(sec * 1e3, 4)
                        run[f"forward_{name}_over_floor"] = round(sec / floor, 3)
                result["runs"].append(run)
                print(json.dumps(run), flush=True)
            del driver
            torch.cuda.empty_cache()
    return result


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("kvrelay bench decode-step: needs a CUDA device (the floor is a GPU's memory bandwidth)")
    emit(measure(args), args.output)
    return 0
