"""`kvrelay generate`: run the engine offline on prompts and print the completions."""

from __future__ import annotations

import argparse
import json

from kvrelay.cli.args import HelpFormatter, add_field_flags
from kvrelay.common.sampling_params import SamplingParams
from kvrelay.engine.args import add_engine_args, engine_kwargs

# The flags' defaults: SamplingParams' own, but greedy and longer (an offline look at what the model says).
DEFAULTS = SamplingParams(temperature=0.0, max_tokens=64)
_SAMPLING_HELP = {
    "max_tokens": "tokens to generate at most",
    "min_tokens": "tokens to generate before stop tokens count",
    "temperature": "0 is greedy",
    "top_p": "sample from the most likely tokens whose probabilities add up to this (1: all)",
    "top_k": "sample from this many most likely tokens (0: all)",
    "min_p": "drop tokens less likely than this fraction of the most likely one (0: none)",
    "repetition_penalty": "above 1, tokens already in the prompt or output get less likely (1: off)",
    "presence_penalty": "subtract this from the logits of tokens already generated (0: off)",
    "frequency_penalty": "subtract this times its count from the logit of each token already generated (0: off)",
    "n": "completions per prompt",
}
_SAMPLING_FLAGS = (*_SAMPLING_HELP, "seed", "logprobs", "ignore_eos")  # each sets the SamplingParams field


def register(sub) -> None:
    d = DEFAULTS
    p = sub.add_parser("generate", help="generate text offline", description="Generate a completion offline.",
                       formatter_class=HelpFormatter)
    add_engine_args(p)
    s = p.add_argument_group("sampling")
    s.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    s.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_field_flags(s, d, _SAMPLING_HELP)
    s.add_argument("--seed", type=int, default=d.seed, help="the same seed gives the same tokens anywhere")
    s.add_argument("--logprobs", type=int, default=d.logprobs, help="also return the top-N logprobs of each token")
    s.add_argument("--ignore-eos", action="store_true", default=d.ignore_eos,
                   help="keep generating past the end-of-sequence token")
    s.add_argument("--json", action="store_true", help="print JSON with token ids instead of plain text")
    p.set_defaults(func=run)


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{name: getattr(args, name) for name in _SAMPLING_FLAGS})


def run(args: argparse.Namespace) -> int:
    from kvrelay.engine.llm import LLM

    params = sampling_params(args)
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
