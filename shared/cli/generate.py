"""`kvrelay generate`: run the engine offline on prompts and print the completions."""

from __future__ import annotations

import argparse
import json

from kvrelay.cli.args import HelpFormatter
from kvrelay.engine.args import add_engine_args, engine_kwargs


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline", description="Generate a completion offline.",
                       formatter_class=HelpFormatter)
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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvrelay.engine.llm import LLM, SamplingParams

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
