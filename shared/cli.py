"""The `kvrelay` command line."""

from __future__ import annotations

import argparse
import json
import sys

from shared.config import DEFAULT_BLOCK_SIZE
from shared.log import configure_logging

DESCRIPTION = """kvrelay: disaggregated LLM serving (OpenAI gateway, prefill and decode pools, paged KV cache).

Commands:
  up         bring up a whole fleet on this machine (Redis, prefill and decode nodes, gateway)
  gateway    the OpenAI-compatible gateway (HTTP) and its gRPC API
  prefill    a prefill node
  decode     a decode node
  generate   run the engine offline on a prompt and print the completion
  bench      benchmarks (engine throughput vs transformers, KV transfer, serving, routing, TTFT)
"""


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default="default",
                   help="HF-style model folder, a .gguf file, or 'default' (SmolLM2-135M-Instruct, converted once)")
    g.add_argument("--dtype", default="auto", help="auto (bfloat16), bfloat16, float32; float16 on CUDA only")
    g.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda, cuda:N")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per KV block (fleet-wide)")
    g.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of KV cache on CPU (default 2 GiB); the log says how many tokens fit")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: fraction of device memory for weights plus KV cache")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    g.add_argument("--max-num-seqs", type=int, default=128, help="most requests running at once")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prompt prefixes")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="waiting order, and who is preempted first when KV blocks run out")
    g.add_argument("--attention-backend", choices=["auto", "torch", "flash_attn"], default="auto",
                   help="auto: flash-attn on CUDA when installed, else the portable torch backend")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
        policy=args.scheduling_policy,
        attention_backend=args.attention_backend,
    )


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline", description="Generate a completion offline.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_args(p)
    s = p.add_argument_group("sampling")
    s.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    s.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    s.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before stop tokens count")
    s.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 disables")
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None, help="the same seed gives the same tokens anywhere")
    s.add_argument("--n", type=int, default=1, help="completions per prompt")
    s.add_argument("--logprobs", type=int, default=None, help="also return the top-N logprobs of each token")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--json", action="store_true", help="print JSON with token ids instead of plain text")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from shared.llm import LLM, SamplingParams

    params = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, logprobs=args.logprobs, ignore_eos=args.ignore_eos,
    )
    llm = LLM(model=args.model, dtype=args.dtype, **engine_kwargs(args))
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompt]
    else:
        prompts = list(args.prompt)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if args.json:
        print(json.dumps([_output_json(text, out) for text, out in zip(args.prompt, outputs)], indent=2))
    else:
        for out in outputs:
            for comp in out.outputs:
                print(comp.text)
    return 0


def _output_json(prompt: str, out) -> dict:
    return {
        "prompt": prompt,
        "prompt_token_ids": out.prompt_token_ids,
        "num_cached_tokens": out.num_cached_tokens,
        "outputs": [
            {
                "index": c.index,
                "text": c.text,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "logprobs": None if c.logprobs is None else [_lp_json(lp) for lp in c.logprobs],
            }
            for c in out.outputs
        ],
    }


def _lp_json(lp) -> dict:
    return {"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank,
            "top": [{"token_id": t, "logprob": v} for t, v in lp.top]}


def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks", description="Benchmarks that print JSON and write bench/results/.")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    from shared.bench import register

    register(bsub)
    kv = bsub.add_parser("kv-transfer", help="KV transfer GB/s per connector vs memcpy", add_help=False)
    kv.add_argument("rest", nargs=argparse.REMAINDER)
    kv.set_defaults(func=lambda a: _delegate("kv_transfer.bench", a.rest))


def _delegate(module: str, argv: list[str]) -> int:
    import importlib

    return importlib.import_module(module).main(argv) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_bench(sub)
    from shared.launcher import register as register_up

    register_up(sub)
    from shared.gateway_cli import register as register_gateway

    register_gateway(sub)
    from shared.node_cli import register as register_nodes

    register_nodes(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"kvrelay: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
