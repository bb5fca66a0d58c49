"""`kvrelay bench multiturn`: multi-turn chat sessions whose contexts outgrow the KV cache, with and without the
host's offload tier (--kv-offload-bytes), in one invocation.

Each session is a conversation: every turn sends the whole context so far (the earlier turns, the model's answers,
a new user message of random tokens) and waits a think time before the next. The sessions run at once against one
colocated node with a small KV cache (`--kv-cache-memory`), so by a session's next turn the other sessions have
evicted its context. Without the tier that context is computed again; with it, it is loaded from shared memory.

The same conversations (same seeds; greedy, fixed answer lengths) run on a node without the tier, then on one with
it (`--rounds` pairs, alternating which goes first). Reported per arm: TTFT p50/p90 over the turns after the
first, output tokens per second over the whole run, the node's prefix-cache hit tokens and blocks loaded; and
the ratios against the no-tier arm of the same round. The KV cache is sized from the model and KV dtype so that
the total context is `--context-over-capacity` (4, the issue's workload) times what it holds; the result gives
the capacity the node reported.

    kvrelay bench multiturn                                   # default model, 8 sessions x 6 turns
    kvrelay bench multiturn --sessions 4 --turns 4 --rounds 1
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shutil
import statistics
import tempfile
import threading
import time

from kvrelay.bench.fleet import Node
from kvrelay.bench.report import emit, machine
from kvrelay.common.process import stop_all
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.common.units import byte_size
from kvrelay.common.wire import sampling_to_proto
from kvrelay.proto_gen.kvrelay.engine.v1 import engine_pb2 as pb

logger = logging.getLogger(__name__)

HELP = "multi-turn chats past the KV cache's size, with and without the host's offload tier (node processes)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="model folder, .gguf or 'default' (SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="auto resolves to float32 on CPUs without native bf16")
    p.add_argument("--sessions", type=int, default=8, help="conversations at once")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation")
    p.add_argument("--user-tokens", type=int, default=200, help="tokens of each new user message")
    p.add_argument("--output-tokens", type=int, default=32, help="tokens of each answer (greedy, ignore_eos)")
    p.add_argument("--think-time", type=float, default=1.0, help="seconds between an answer and the next turn")
    p.add_argument("--kv-cache-memory", type=byte_size, default=None,
                   help="the node's KV cache (default: sized from the model and dtype so that the conversations' "
                        "total context is --context-over-capacity times what it holds)")
    p.add_argument("--context-over-capacity", type=float, default=4.0,
                   help="the conversations' total context over the KV cache's capacity, when --kv-cache-memory is "
                        "not given (the issue's workload: 4)")
    p.add_argument("--kv-offload-bytes", type=byte_size, default=2**30, help="the tier's shared memory")
    p.add_argument("--num-threads", type=int, default=2, help="torch threads of the node")
    p.add_argument("--rounds", type=int, default=1, help="pairs of arms, alternating which runs first")
    p.add_argument("--seed", type=int, default=0, help="seed of the user messages")
    p.add_argument("--output", default="bench/results/multiturn.json", help="JSON result file")


def _conversation(stub, sid: int, args: argparse.Namespace, vocab: int, turns: list[dict], start: float,
                  stagger: float, errors: list[BaseException]) -> None:
    try:
        _turns(stub, sid, args, vocab, turns, start, stagger)
    except BaseException as e:  # noqa: BLE001 - the arm fails with it once every conversation has ended
        errors.append(e)


def _turns(stub, sid: int, args: argparse.Namespace, vocab: int, turns: list[dict], start: float,
           stagger: float) -> None:
    rng = random.Random(args.seed * 1000 + sid)
    params = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True))
    context: list[int] = []
    time.sleep(stagger)
    for turn in range(args.turns):
        context += [rng.randrange(100, vocab - 100) for _ in range(args.user_tokens)]
        t0 = time.perf_counter()
        first = None
        out: list[int] = []
        for chunk in stub.Generate(pb.GenerateRequest(request_id=f"s{sid}-t{turn}-{start}", prompt_token_ids=context,
                                                      params=params), timeout=900):
            if first is None:
                first = time.perf_counter() - t0
            out += chunk.token_ids
        turns.append({"session": sid, "turn": turn, "prompt_tokens": len(context), "ttft_s": first,
                      "e2e_s": time.perf_counter() - t0, "output_tokens": len(out)})
        context += out
        time.sleep(args.think_time)


def run_arm(args: argparse.Namespace, tier: bool) -> dict:
    flags = ["--model", args.model, "--dtype", args.dtype, "--num-threads", str(args.num_threads),
             "--kv-cache-memory", str(args.kv_cache_memory), "--shutdown-timeout", "10", "--max-num-seqs",
             str(args.sessions)]
    store = tempfile.mkdtemp(prefix="kvrelay-multiturn-tier-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    if tier:
        flags += ["--kv-offload-bytes", str(args.kv_offload_bytes), "--kv-offload-path", store]
    logs, done = tempfile.mkdtemp(prefix="kvrelay-multiturn-"), False  # the logs are kept only if the arm fails
    (node,) = Node.start_many([("decode", flags)], env={"OMP_NUM_THREADS": str(args.num_threads)}, log_dir=logs)
    try:
        stub = node.stub()
        info = stub.GetNodeInfo(pb.NodeInfoRequest(), timeout=10)
        load = stub.GetLoad(pb.LoadRequest(), timeout=10)
        capacity = load.total_kv_blocks * info.block_size
        longest = args.turns * (args.user_tokens + args.output_tokens)
        if longest > info.max_model_len:
            raise SystemExit(f"a conversation's last turn needs {longest} tokens and the node takes "
                             f"{info.max_model_len} (the model's context, or what its KV cache holds): give "
                             "--kv-cache-memory more, or fewer --turns or --user-tokens")
        turns: list[dict] = []
        errors: list[BaseException] = []
        start = time.perf_counter()
        threads = [threading.Thread(target=_conversation, args=(stub, s, args, info.vocab_size, turns, start,
                                                                s * args.think_time / args.sessions, errors))
                   for s in range(args.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"{len(errors)} conversations failed; the first: {errors[0]!r}")
        elapsed = time.perf_counter() - start
        metrics = node.metrics()
        done = True
    finally:
        stop_all([node.process])
        shutil.rmtree(store, ignore_errors=True)
        if done:
            shutil.rmtree(logs, ignore_errors=True)
        else:
            logger.error("the node's log: %s", logs)
    later = sorted(t["ttft_s"] for t in turns if t["turn"] > 0)
    context = args.sessions * args.turns * (args.user_tokens + args.output_tokens)
    arm = {
        "tier": tier, "elapsed_s": elapsed, "kv_capacity_tokens": capacity, "total_context_tokens": context,
        "context_over_capacity": context / capacity,
        "ttft_p50_s": statistics.median(later), "ttft_p90_s": later[int(0.9 * (len(later) - 1))],
        "first_turn_ttft_p50_s": statistics.median(t["ttft_s"] for t in turns if t["turn"] == 0),
        "output_tokens_per_s": sum(t["output_tokens"] for t in turns) / elapsed,
        "prefix_cache_hit_tokens": metrics.value("vllm:prefix_cache_hits_total") or 0,
        "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
        "blocks_loaded": metrics.value("kvrelay:kv_offload_blocks_total", event="loaded") or 0,
        "blocks_offloaded": metrics.value("kvrelay:kv_offload_blocks_total", event="offloaded") or 0,
        "checksum_failures": metrics.value("kvrelay:kv_offload_tier_blocks_total", event="checksum_failures") or 0,
        "load_token_cost": metrics.value("kvrelay:kv_offload_token_cost") or 0,  # what routing weighs a tier hit by
        "engine_seconds_on_tier": {stage: metrics.value("kvrelay:kv_offload_engine_seconds_total", stage=stage) or 0
                                   for stage in ("offload", "fetch", "load")},
        "turns": turns,
    }
    logger.info("tier %s: TTFT p50 %.3fs p90 %.3fs, %.1f output tok/s, %d blocks loaded", tier, arm["ttft_p50_s"],
                arm["ttft_p90_s"], arm["output_tokens_per_s"], arm["blocks_loaded"])
    return arm


def kv_memory_for(args: argparse.Namespace) -> int:
    """The KV cache that holds 1 / --context-over-capacity of the conversations' total context, in the node's KV
    dtype (`--dtype auto` resolved as the node will)."""
    from kvrelay.engine.auto_dtype import auto_dtype
    from kvrelay.engine.config import parse_dtype
    from kvrelay.engine.model_info import read_model_shape

    dtype = auto_dtype("cpu") if args.dtype == "auto" else parse_dtype(args.dtype)
    per_token = read_model_shape(args.model).kv_bytes_per_token(dtype.itemsize)
    context = args.sessions * args.turns * (args.user_tokens + args.output_tokens)
    return int(context / args.context_over_capacity) * per_token


def run(args: argparse.Namespace) -> int:
    if args.kv_cache_memory is None:
        args.kv_cache_memory = kv_memory_for(args)
    rounds = []
    for r in range(args.rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        arms = {tier: run_arm(args, tier) for tier in order}
        base, tier = arms[False], arms[True]
        rounds.append({
            "order": ["tier" if t else "no_tier" for t in order], "no_tier": base, "tier": tier,
            "ttft_p50_ratio": base["ttft_p50_s"] / tier["ttft_p50_s"],
            "ttft_p90_ratio": base["ttft_p90_s"] / tier["ttft_p90_s"],
            "throughput_ratio": tier["output_tokens_per_s"] / base["output_tokens_per_s"],
        })
    summary = {k: statistics.mean(r[k] for r in rounds) for k in ("ttft_p50_ratio", "ttft_p90_ratio",
                                                                   "throughput_ratio")}
    emit({"benchmark": "multiturn", "model": args.model, "machine": machine(),
          "workload": {k: getattr(args, k) for k in ("sessions", "turns", "user_tokens", "output_tokens",
                                                     "think_time", "kv_cache_memory", "kv_offload_bytes",
                                                     "num_threads")},
          "summary": summary,
          "note": "ratios: no tier / tier for TTFT (turns after the first), tier / no tier for output tok/s; each "
                  "round's two arms ran back to back in this invocation", "rounds": rounds}, args.output)
    return 0
