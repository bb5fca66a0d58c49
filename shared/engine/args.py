"""The engine's command-line flags (as vLLM's `EngineArgs`): the node commands, `kvrelay generate` and the
benchmarks that build engines all take the same flags with the same meanings, vLLM's names where vLLM has one.
"""

from __future__ import annotations

import argparse

from kvrelay.engine.config import (
    DEFAULT_BLOCK_SIZE,
    EngineConfig,
    SchedulingPolicy,
    SpeculativeConfig,
    engine_config_from_kwargs,
)

SCHEDULING_POLICIES = [p.value for p in SchedulingPolicy]


def add_engine_args(p: argparse.ArgumentParser, serving: bool = False) -> None:
    """`serving`: for a server's engine, whose requests arrive over time (the waiting order defaults to sjf);
    offline, everything arrives at once and fcfs keeps the caller's order, as vLLM does."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default",
                   help="HF-style model folder, a .gguf file, or 'default' (SmolLM2-135M-Instruct, converted once)")
    g.add_argument("--dtype", default="auto",
                   help="auto (the faster of float32 and bfloat16 on this machine), bfloat16, float32; "
                        "float16 on CUDA only")
    g.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block (fleet-wide)")
    g.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of KV cache (CPU default 2 GiB; on CUDA it overrides "
                        "--gpu-memory-utilization); the log says how many tokens fit")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of device memory for weights plus KV cache")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    g.add_argument("--max-waiting-requests", type=int, default=0,
                   help="requests (and queued decode reservations) that may wait for room; past it new ones are "
                        "refused, which the gateway answers with 429 (0: no bound)")
    g.add_argument("--admission-headroom", action=argparse.BooleanOptionalAction, default=True,
                   help="admit a request only if the KV blocks it takes leave room for the running requests' "
                        "prompts and one block each to grow into (fewer preemptions, each of which recomputes)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prompt prefixes")
    g.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="sjf" if serving else "fcfs",
                   help="waiting order (fcfs; priority: by the request's priority, then arrival; sjf: the shortest "
                        "prompt first, each second waited worth 1000 prompt tokens, so a burst's short prompts "
                        "start decoding while long ones compute); with priority, the lowest priority is "
                        "preempted first when KV blocks run out")
    g.add_argument("--attention-backend", choices=["auto", "torch", "flash_attn"], default="auto",
                   help="auto: flash-attn on CUDA when installed, else the portable torch backend")
    g.add_argument("--structured-outputs-backend", choices=["xgrammar"], default="xgrammar",
                   help="grammar engine of response_format / structured_outputs / tool_choice constraints")
    g.add_argument("--speculative-config", type=speculative_json, default=None,
                   help='speculative decoding, as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": "<folder>", '
                        '"num_speculative_tokens": 4}\'')


def speculative_json(text: str) -> str:
    """Checks the JSON (argparse reports a bad one with the flag's name) and keeps the text to pass on."""
    try:
        SpeculativeConfig.from_dict(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine flags as vLLM-style keyword arguments (what `LLM(...)` takes)."""
    return dict(
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_waiting_requests=args.max_waiting_requests,
        admission_headroom=args.admission_headroom,
        enable_prefix_caching=args.enable_prefix_caching,
        policy=args.scheduling_policy,
        attention_backend=args.attention_backend,
        structured_outputs_backend=getattr(args, "structured_outputs_backend", "xgrammar"),
        speculative_config=getattr(args, "speculative_config", None),
    )


def engine_config(args: argparse.Namespace, **extra) -> EngineConfig:
    return engine_config_from_kwargs(args.model, args.dtype, **engine_kwargs(args), **extra)
