"""`kvrelay bench accuracy`: what a quantized way of serving a model costs in accuracy, in one run.

For a GGUF model, two of our engines on the same weights: `--quantization gguf` (the file's blocks) and the file
dequantized once to float32 (the reference our other paths are held to), and, when llama.cpp's
`llama-perplexity` is at hand (--llama-perplexity; kvrelay.bench.llamacpp_baseline.find_tool), llama.cpp on the
same GGUF and text.

- Perplexity on held-out text (the docstrings of the benchmark corpus's standard library modules, never a
  prompt of a test), computed as llama-perplexity does: chunks of --ctx tokens (the first replaced by BOS when
  the model adds one), each scoring the tokens of its second half given everything before them in the chunk.
  The blocks' engine computes every row on its int8 kernel here, as its decode steps do, and as llama.cpp
  computes all rows (in serving, prefill chunks of more than 128 rows dequantize tiles, float32's values computed
  in the model's dtype, but for Q4_0, Q4_1 and Q8_0 on a CPU with AVX512-VNNI, which run on the kernel).
- Greedy agreement with the float32 engine, and with llama.cpp's own server when at hand (--llama-server):
  --prompts prompts of the same text generate --max-tokens tokens greedily under each; the share of tokens
  before the first divergence, and of positions equal.
- The quantized KV caches (--kv-cache-dtypes, default fp8 and int8), each against the cache of the model's
  dtype (--kv-compute-dtype, bfloat16) on the same dequantized weights: the same perplexity, and agreement on
  chat prompts (CHAT_QUESTIONS through the model's chat template, as users and the e2e checks send them), greedy
  to --max-tokens or the end of the answer:
  - free-running, as above. On a small model in bf16 this mostly measures noise: the same engine and cache,
    one prompt at a time against batched, part ways early too (reported as the auto arm's
    greedy_agreement_alone_vs_batched);
  - teacher-forced (top1_agreement_with_auto): on the reference's own answers, the share of positions where the
    quantized cache's most likely next token is the reference cache's. One flip does not count every later token.

    kvrelay bench accuracy
    kvrelay bench accuracy --model my.Q4_0.gguf --chunks 16
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import re
import subprocess
import tempfile

from kvrelay.bench.llamacpp_baseline import find_tool, gguf_file
from kvrelay.bench.report import emit, machine
from kvrelay.bench.workload import iter_corpus_docs

# What the KV cache arms ask: questions as users send them to a chat model.
CHAT_QUESTIONS = (
    "What is a KV cache?", "Explain photosynthesis in two sentences.", "Write a haiku about the sea.",
    "What is the capital of France, and why is it famous?", "Give me three tips for learning Python.",
    "How does a hash table work?", "Summarize the plot of Romeo and Juliet.", "What causes rain?",
    "Write a short email asking for a meeting on Friday.", "What is the difference between TCP and UDP?",
    "List five fruits that are high in vitamin C.", "How do I reverse a list in Python?",
    "Why is the sky blue?", "What is machine learning?", "Translate 'good morning' into Spanish and French.",
    "Describe a cat to someone who has never seen one.",
)

HELP = "perplexity and greedy agreement of --quantization gguf against float32 and llama.cpp on the same GGUF"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="a .gguf file or 'default'")
    p.add_argument("--ctx", type=int, default=512, help="tokens per perplexity chunk (llama-perplexity's -c)")
    p.add_argument("--chunks", type=int, default=8, help="perplexity chunks (llama-perplexity's --chunks)")
    p.add_argument("--prompts", type=int, default=8,
                   help="text prompts for the GGUF arms' greedy agreement (the KV cache arms ask CHAT_QUESTIONS)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="tokens of text per agreement prompt")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="greedy tokens per agreement prompt (chat answers may end sooner)")
    p.add_argument("--llama-perplexity", default=None,
                   help="llama.cpp's llama-perplexity (default: $KVRELAY_LLAMACPP_BIN's, else the peer kit's; none: "
                        "left out)")
    p.add_argument("--llama-server", default=None,
                   help="llama.cpp's llama-server, for greedy agreement with llama.cpp (default: as "
                        "--llama-perplexity; none: left out)")
    p.add_argument("--kv-cache-dtypes", default="fp8,int8",
                   help="quantized KV caches to hold against the --kv-compute-dtype cache (comma-separated; 'none')")
    p.add_argument("--kv-compute-dtype", default="bfloat16", help="the model dtype of the KV cache arms")
    p.add_argument("--output", default="bench/results/accuracy.json", help="where the JSON goes")


def heldout_text(min_chars: int) -> str:
    text, docs = "", iter_corpus_docs()
    for doc in docs:
        text += doc + "\n\n"
        if len(text) >= min_chars:
            break
    return text


def chunked_tokens(tokens: list[int], ctx: int, chunks: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: consecutive runs of `ctx` tokens, the first of each replaced by BOS."""
    out = []
    for i in range(min(chunks, len(tokens) // ctx)):
        chunk = tokens[i * ctx : (i + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        out.append(chunk)
    return out


def perplexity(llm, chunks: list[list[int]]) -> float:
    """exp of the mean negative log-likelihood of each chunk's tokens past its first half (llama-perplexity's)."""
    from kvrelay.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    nll, count = 0.0, 0
    for chunk in chunks:
        (out,) = llm.generate([chunk], params, use_tqdm=False)
        first = len(chunk) // 2
        for lp in out.prompt_logprobs[first + 1:]:
            nll -= lp.logprob
            count += 1
    return math.exp(nll / count)


def greedy(llm, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = True) -> list[list[int]]:
    from kvrelay.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def chat_prompts(tokenizer) -> list[list[int]]:
    """CHAT_QUESTIONS as the model's chat template renders them for the server."""
    return [tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": q}]), add_special_tokens=False)
            for q in CHAT_QUESTIONS]


def agreement(ours: list[list[int]], reference: list[list[int]]) -> dict:
    """Over the reference's tokens: the share before each sequence's first divergence (an answer that ends early
    or runs on diverges where the shorter ends), and the share of positions equal."""
    def first_divergence(x: list[int], y: list[int]) -> int:
        return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))

    total = sum(len(y) for y in reference)
    prefix = sum(first_divergence(x, y) for x, y in zip(ours, reference))
    return {"tokens": total, "before_first_divergence": prefix / total,
            "positions_equal": top1_agreement(ours, reference)}


def top1(llm, prompts: list[list[int]], continuations: list[list[int]]) -> list[list[int]]:
    """Teacher-forced: the most likely next token at each position of each continuation, given the prompt and
    the continuation's tokens before it (one prefill of prompt + continuation)."""
    from kvrelay.common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([list(p) + list(c) for p, c in zip(prompts, continuations)], params, use_tqdm=False)
    return [[lp.top[0][0] for lp in o.prompt_logprobs[len(p):]] for o, p in zip(outs, prompts)]


def top1_agreement(ours: list[list[int]], reference: list[list[int]]) -> float:
    """The share of the reference's positions where ours holds the same token."""
    return sum(a == b for x, y in zip(ours, reference) for a, b in zip(x, y)) / sum(len(y) for y in reference)


def llama_perplexity(binary: str, gguf: str, text_file: str, ctx: int, chunks: int, threads: int) -> float:
    argv = [binary, "-m", gguf, "-f", text_file, "-c", str(ctx), "--chunks", str(chunks), "-t", str(threads),
            "-b", str(ctx)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
    return float(found.group(1))


def llama_server_greedy(binary: str, gguf: str, prompts: list[list[int]], max_tokens: int,
                        threads: int) -> list[list[int]]:
    """llama.cpp's greedy tokens for each prompt (token ids in, token ids out), from its own server on a free
    loopback port; stopped afterwards."""
    import httpx

    from kvrelay.common.process import ChildProcess
    from kvrelay.common.system import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [binary, "-m", gguf, "-t", str(threads), "--host", "127.0.0.1", "--port", str(port), "-c", "4096"]

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    with tempfile.TemporaryDirectory(prefix="kvrelay-llama-server-") as logs, \
            ChildProcess.start("llama-server", argv, log_dir=logs) as server:
        server.wait_ready(ready, timeout_s=120)
        out = []
        for prompt in prompts:
            body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "top_k": 1, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True}
            out.append(list(httpx.post(f"{url}/completion", json=body, timeout=600).json()["tokens"]))
        return out


def _bos_if_added(gguf: str) -> int | None:
    """The BOS token llama.cpp puts at the start of each chunk, when the GGUF says to add one."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)

    def value(key: str):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    return int(value("tokenizer.ggml.bos_token_id")) if value("tokenizer.ggml.add_bos_token") else None


def run(args: argparse.Namespace) -> int:
    import torch

    from kvrelay.common.tokenizer import Tokenizer
    from kvrelay.engine.llm import LLM
    from kvrelay.engine.models.gguf_blocks import kernel_on_every_row
    from kvrelay.model_files.resolve import resolve_model

    try:
        gguf = gguf_file(args.model)
    except ValueError as e:
        raise SystemExit(f"bench accuracy: {e}") from None
    binary, server = find_tool("llama-perplexity", args.llama_perplexity), find_tool("llama-server", args.llama_server)
    tokenizer = Tokenizer(resolve_model(args.model).path)
    text = heldout_text(args.ctx * (args.chunks + 1) * 8)
    tokens = tokenizer.encode(text, add_special_tokens=False)
    chunks = chunked_tokens(tokens, args.ctx, args.chunks, _bos_if_added(gguf))
    step = max(1, (len(tokens) - args.prompt_tokens) // max(1, args.prompts))
    prompts = [tokens[i * step : i * step + args.prompt_tokens] for i in range(args.prompts)]
    report = {"benchmark": "accuracy", "machine": machine(), "model": gguf,
              "args": {k: v for k, v in vars(args).items() if k != "func"},
              "text": {"tokens_scored": len(chunks) * (args.ctx - args.ctx // 2 - 1), "chunks": len(chunks)}}
    outputs = {}
    for name, quantization in (("gguf_blocks", "gguf"), ("float32", None)):
        llm = LLM(model=args.model, dtype="float32", quantization=quantization, enable_prefix_caching=False,
                  max_model_len=max(args.ctx + 1, args.prompt_tokens + args.max_tokens))
        with kernel_on_every_row() if quantization else contextlib.nullcontext():
            report[name] = {"perplexity": perplexity(llm, chunks)}
        outputs[name] = greedy(llm, prompts, args.max_tokens)
        del llm
        gc.collect()
    report["gguf_blocks"]["greedy_agreement_with_float32"] = agreement(outputs["gguf_blocks"], outputs["float32"])
    report["gguf_blocks"]["perplexity_over_float32"] = report["gguf_blocks"]["perplexity"] / \
        report["float32"]["perplexity"]
    if binary is not None:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(text)
            f.flush()
            ppl = llama_perplexity(binary, gguf, f.name, args.ctx, args.chunks, torch.get_num_threads())
        report["llamacpp"] = {"perplexity_binary": binary, "perplexity": ppl}
        report["gguf_blocks"]["perplexity_over_llamacpp"] = report["gguf_blocks"]["perplexity"] / ppl
        report["float32"]["perplexity_over_llamacpp"] = report["float32"]["perplexity"] / ppl
    if server is not None:
        theirs = llama_server_greedy(server, gguf, prompts, args.max_tokens, torch.get_num_threads())
        report.setdefault("llamacpp", {})["server"] = server
        for name in ("gguf_blocks", "float32"):
            report[name]["greedy_agreement_with_llamacpp"] = agreement(outputs[name], theirs)
    kv_dtypes = [] if args.kv_cache_dtypes == "none" else args.kv_cache_dtypes.split(",")
    if kv_dtypes:
        report["kv_cache"] = kv_cache_arms(args, kv_dtypes, chunks, chat_prompts(tokenizer))
    emit(report, args.output)
    return 0


def kv_cache_arms(args: argparse.Namespace, kv_dtypes: list[str], chunks: list[list[int]],
                  prompts: list[list[int]]) -> dict:
    """Each quantized KV cache against the cache of the model's dtype, on the dense weights: perplexity, and on
    the chat prompts greedy agreement with the unquantized cache's answers, free-running and teacher-forced."""
    from kvrelay.engine.llm import LLM

    out: dict = {"compute_dtype": args.kv_compute_dtype, "chat_prompts": len(prompts)}
    tokens, tops = {}, {}
    for kv in ["auto", *kv_dtypes]:
        llm = LLM(model=args.model, dtype=args.kv_compute_dtype, kv_cache_dtype=kv, enable_prefix_caching=False,
                  max_model_len=max(args.ctx + 1, max(map(len, prompts)) + args.max_tokens))
        out[kv] = {"perplexity": perplexity(llm, chunks), "kv_cache_blocks": llm.engine.num_blocks}
        tokens[kv] = greedy(llm, prompts, args.max_tokens, ignore_eos=False)
        if kv == "auto":
            alone = [greedy(llm, [p], args.max_tokens, ignore_eos=False)[0] for p in prompts]
            out[kv]["greedy_agreement_alone_vs_batched"] = agreement(alone, tokens[kv])
        tops[kv] = top1(llm, prompts, tokens["auto"])
        del llm
        gc.collect()
    out["auto"]["top1_agreement_with_its_own_answers"] = top1_agreement(tops["auto"], tokens["auto"])
    for kv in kv_dtypes:
        out[kv]["perplexity_over_auto"] = out[kv]["perplexity"] / out["auto"]["perplexity"]
        out[kv]["greedy_agreement_with_auto"] = agreement(tokens[kv], tokens["auto"])
        out[kv]["top1_agreement_with_auto"] = top1_agreement(tops[kv], tops["auto"])
        out[kv]["tokens_over_auto"] = out[kv]["kv_cache_blocks"] / out["auto"]["kv_cache_blocks"]
    return out
