"""`kvrelay bench decode-attention`: the native CPU paged-decode kernel vs the portable gather + SDPA path.

One layer of decode attention for a batch of requests whose blocks are scattered over a large cache (as
after hours of serving), SmolLM2's shape by default (9 query heads, 3 kv heads, head size 64, fp32 or bf16).
The cache is allocated as the engine allocates it (kvrelay.engine.host_memory: huge pages where the kernel
allows). Both paths run on the same inputs in the same invocation; the JSON gives milliseconds per layer, the
KV bytes read per second, the speed-up, the largest difference between the two outputs, and the cache the
kernels prefetch KV rows into on this machine.

    kvrelay bench decode-attention --decodes 128 --context 600 --dtype bfloat16
    kvrelay bench decode-attention --dtype bfloat16 --kv-cache-dtype int8   # also: the bf16 cache, same run

With --kv-cache-dtype fp8 or int8 both paths read the quantized cache, and the native kernel also reads the same
values in a cache of --dtype, in the same invocation: what the quantized cache's reads cost or save per layer.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from kvrelay.bench.report import emit, machine
from kvrelay.bench.stats import timings


def _metadata(tables: torch.Tensor, lens: torch.Tensor, block_size: int):
    """A decode-only step: each request's new token is the last of its context."""
    from kvrelay.engine.attention.base import AttentionMetadata

    nd = len(lens)
    last = lens.long() - 1
    slots = tables.long()[torch.arange(nd), last // block_size] * block_size + last % block_size
    return AttentionMetadata(
        num_reqs=nd, num_decodes=nd, num_decode_tokens=nd,
        query_start_loc=torch.arange(nd + 1, dtype=torch.int32), seq_lens=lens,
        query_lens_cpu=[1] * nd, seq_lens_cpu=lens.tolist(), max_query_len=1, max_seq_len=int(lens.max()),
        block_tables=tables, slot_mapping=slots, block_size=block_size)


def measure(args: argparse.Namespace) -> dict:
    from kvrelay.engine import host_memory
    from kvrelay.engine import kernels as cpu_kernels
    from kvrelay.engine.attention.base import cache_row, dequantize_int8, quantize_int8
    from kvrelay.engine.attention.torch_backend import TorchAttentionBackend
    from kvrelay.engine.config import kv_cache_torch_dtype

    torch.manual_seed(0)
    bs, kvh, d, heads = args.block_size, args.kv_heads, args.head_size, args.heads
    blocks_per_req = -(-args.context // bs)
    num_blocks = max(args.num_blocks, args.decodes * blocks_per_req)
    dtype = getattr(torch, args.dtype)
    kv = host_memory.zeros((2, num_blocks, bs, kvh, d), dtype, torch.device("cpu"))
    kv.copy_(torch.randn(kv.shape))
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)  # scattered, as a long-running pool leaves them
    tables = torch.tensor([order[i * blocks_per_req:(i + 1) * blocks_per_req] for i in range(args.decodes)],
                          dtype=torch.int32)
    lens = torch.full((args.decodes,), args.context, dtype=torch.int32)
    q = torch.randn(args.decodes, heads, d).to(dtype)
    scale = d ** -0.5
    if cpu_kernels.load() is None:
        raise SystemExit("the native kernel could not be built here (no C++ compiler?)")
    meta = _metadata(tables, lens, bs)
    # The step's new k/v are the values already in their slots, so writing them leaves the cache as it is.
    flat = kv.view(2, -1, kvh, d)
    k, v = flat[0, meta.slot_mapping].clone(), flat[1, meta.slot_mapping].clone()
    native, portable = TorchAttentionBackend(use_native=True), TorchAttentionBackend(use_native=False)
    unquantized = kv
    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, dtype)
    if kv_dtype != dtype:  # the quantized cache, and the same values in the --dtype cache to set beside it
        kv = quantize_int8(kv) if kv_dtype == torch.int8 else kv.to(kv_dtype)
        unquantized = (kv.float() if kv_dtype != torch.int8 else dequantize_int8(kv)).to(dtype)
        flat = unquantized.view(2, -1, kvh, d)
        k, v = flat[0, meta.slot_mapping].clone(), flat[1, meta.slot_mapping].clone()
    run_native = lambda: native.forward(q, k, v, kv, meta, scale)  # noqa: E731
    run_portable = lambda: portable.forward(q, k, v, kv, meta, scale)  # noqa: E731
    diff = (run_native().float() - run_portable().float()).abs().max().item()
    t_native, t_portable = (statistics.fmean(timings(fn, args.seconds)) for fn in (run_native, run_portable))
    kv_bytes = args.decodes * args.context * kvh * cache_row(d, kv_dtype) * 2 * kv.element_size()
    extra = {}
    if kv is not unquantized:
        t_plain = statistics.fmean(timings(lambda: native.forward(q, k, v, unquantized, meta, scale), args.seconds))
        extra = {"native_over_a_cache_of_dtype": {"ms_per_layer": t_plain * 1e3},
                 "quantized_speedup": t_plain / t_native}
    return {
        "benchmark": "decode_attention", "machine": machine(),
        "shape": {"decodes": args.decodes, "context": args.context, "heads": heads, "kv_heads": kvh,
                  "head_size": d, "block_size": bs, "num_blocks": num_blocks, "dtype": args.dtype},
        "kv_prefetch": cpu_kernels.kv_prefetch_target(),
        "native": {"ms_per_layer": t_native * 1e3, "kv_gb_per_s": kv_bytes / t_native / 1e9},
        "portable": {"ms_per_layer": t_portable * 1e3, "kv_gb_per_s": kv_bytes / t_portable / 1e9},
        "native_speedup": t_portable / t_native,
        "max_abs_diff": diff,
        "kv_cache_dtype": args.kv_cache_dtype,
        **extra,
    }


HELP = "native CPU decode kernel vs gather + SDPA, one layer"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--decodes", type=int, default=64, help="requests decoding one token each")
    p.add_argument("--context", type=int, default=600, help="tokens of context per request")
    p.add_argument("--heads", type=int, default=9, help="query heads")
    p.add_argument("--kv-heads", type=int, default=3, help="key/value heads")
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="queries and KV cache")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "int8"], default="auto",
                   help="the cache's dtype (auto: --dtype)")
    p.add_argument("--num-blocks", type=int, default=2900, help="blocks in the cache (the requests' are scattered)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seconds", type=float, default=2.0, help="timing per path")
    p.add_argument("--output", default=None, help="also write the JSON here")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    emit(measure(args), args.output)
    return 0

