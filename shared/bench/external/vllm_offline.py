"""Run by vLLM's own Python (its venv), never imported by kvrelay: `python vllm_offline.py SPEC.json RESULT.json`.

SPEC: {"model", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "seed",
       "requests": [{"prompt_token_ids": [...], "max_tokens": N}, ...], "warmup": true}
Writes RESULT.json: elapsed seconds of the timed generate call, load seconds, vLLM's version, and every request's
output token ids (for the greedy agreement check). vLLM starts its engine core with
multiprocessing spawn, hence the main guard. Greedy, ignore_eos, prefix caching off, all requests at once.
"""

import json
import sys
import time


def main() -> int:
    from vllm import LLM, SamplingParams, TokensPrompt

    with open(sys.argv[1]) as f:
        spec = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              max_num_seqs=spec["max_num_seqs"], max_num_batched_tokens=spec.get("max_num_batched_tokens"),
              enable_prefix_caching=False, seed=spec.get("seed", 0))
    load_s = time.perf_counter() - t0
    reqs = spec["requests"]
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    if spec.get("warmup", True):
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    import vllm

    result = {"elapsed_s": elapsed, "load_s": load_s, "vllm_version": getattr(vllm, "__version__", "?"),
              "tokens": [list(o.outputs[0].token_ids) for o in outs]}
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
