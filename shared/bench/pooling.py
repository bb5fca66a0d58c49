"""`kvrelay bench pooling`: do embedding requests slow the chat beside them?

One `kvrelay up` fleet serves both. Two phases take turns (alone, mixed, alone, mixed, ... for --rounds), so both
meet the same machine:
- alone: streamed chat requests at Poisson arrivals of --chat-rate per second;
- mixed: the same chat, while /v1/embeddings requests of --batch texts each arrive at --embed-rate per second.
With --image-rate > 0 both phases also carry chats with an image each (a new random PNG of --image-size pixels,
every third one a repeat of an earlier image) at that rate; a text-only --model then serves as the language model
of a LLaVA folder built for the run (kvrelay.bench.vision_model: random CLIP tower and projector).

Reported: chat TTFT p50/p90 per phase and the mixed/alone ratio of p90s summed over rounds (the issue's bar:
1.2x), every request's status (all must succeed), embeddings per second, and the fleet's KV blocks once the
load is over (nothing left held: `vllm:kv_cache_usage_perc` 0 on every node, from the gateway's /metrics).

    kvrelay bench pooling
    kvrelay bench pooling --chat-rate 1 --embed-rate 2 --batch 8 --duration 60 --rounds 3
    kvrelay bench pooling --image-rate 0.5      # chat, embeddings and images together
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import tempfile
import time
from pathlib import Path

from kvrelay.bench.client import Client
from kvrelay.bench.fleet import Server
from kvrelay.bench.report import emit, machine
from kvrelay.bench.stats import percentiles
from kvrelay.bench.vision_model import llava_from_lm
from kvrelay.bench.workload import TextSource, alone_then_loaded, p90_ratio, send_poisson
from kvrelay.model_files.resolve import resolve_model
from kvrelay.model_files.vision import vision_spec

HELP = "embeddings beside chat: chat TTFT alone and with embedding requests, in one run; nothing left held"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="the model `kvrelay up` serves")
    p.add_argument("--up-flags", nargs=argparse.REMAINDER, default=[], help="more flags for `kvrelay up` (last)")
    p.add_argument("--chat-rate", type=float, default=1.0, help="chat requests per second (Poisson)")
    p.add_argument("--embed-rate", type=float, default=2.0, help="embedding requests per second in mixed phases")
    p.add_argument("--batch", type=int, default=8, help="texts per embedding request")
    p.add_argument("--image-rate", type=float, default=0.0,
                   help="chats with an image per second in mixed phases (0: none); a text-only model gets a "
                        "vision tower for the run")
    p.add_argument("--image-size", type=int, default=256, help="width and height of each request's image")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of each phase")
    p.add_argument("--rounds", type=int, default=2, help="alone/mixed pairs")
    p.add_argument("--prompt-tokens", type=int, default=96, help="corpus text per chat prompt and text, in tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per chat request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench/results/pooling.json", help="where the JSON goes")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for the fleet to come up")


async def _phase(url: str, args: argparse.Namespace, mixed: bool, texts, seed: int) -> dict:
    async with Client(url, timeout_s=120) as client:
        def chat():
            return client.post("chat", {"model": None, "messages": [{"role": "user", "content": next(texts)}],
                                        "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                                        "ignore_eos": True})

        def embed():
            body = json.dumps({"input": [next(texts) for _ in range(args.batch)]}).encode()
            return client.request("POST", "embeddings", body)

        pictures = _images(args.image_size, seed)

        def look():
            url = "data:image/png;base64," + base64.b64encode(next(pictures)).decode()
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": next(texts)}]
            return client.post("chat", {"model": None, "messages": [{"role": "user", "content": content}],
                                        "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                                        "ignore_eos": True})

        runs = [send_poisson(args.chat_rate, args.duration, random.Random(seed), chat)]
        if args.image_rate > 0:  # in both phases: what differs between them is the pooling load
            runs.append(send_poisson(args.image_rate, args.duration, random.Random(seed + 2), look))
        if mixed:
            runs.append(send_poisson(args.embed_rate, args.duration, random.Random(seed + 1), embed))
        started = time.perf_counter()
        replies = await asyncio.gather(*runs)
        wall = time.perf_counter() - started
    chats = replies[0]
    out = {"chat_ok": sum(r.ok for r in chats), "chat_failed": sum(not r.ok for r in chats),
           "chat_ttft_ms": percentiles([r.ttft_s for r in chats if r.ok and r.ttft_s is not None], 1000.0, digits=1)}
    if args.image_rate > 0:
        looks = replies[1]
        out.update(image_ok=sum(r.ok for r in looks), image_failed=sum(not r.ok for r in looks),
                   image_ttft_ms=percentiles([r.ttft_s for r in looks if r.ok and r.ttft_s is not None], 1000.0,
                                             digits=1))
    if mixed:
        embeds = replies[-1]
        out.update(embed_ok=sum(r.ok for r in embeds), embed_failed=sum(not r.ok for r in embeds),
                   texts_per_s=round(sum(r.ok for r in embeds) * args.batch / wall, 2),
                   embed_ms=percentiles([r.end - r.start for r in embeds if r.ok], 1000.0, digits=1))
    return out


def _images(size: int, seed: int):
    """PNG bytes of random images; every third a repeat of one sent before (its prefix-cache hit)."""
    import io

    import numpy as np
    from PIL import Image

    rng, sent = np.random.default_rng(seed), []
    while True:
        if sent and len(sent) % 3 == 2:
            yield sent[int(rng.integers(len(sent)))]
        out = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB").save(out, "PNG")
        sent.append(out.getvalue())
        yield sent[-1]


def _texts(args: argparse.Namespace):
    from kvrelay.common.tokenizer import Tokenizer

    source = TextSource(Tokenizer(resolve_model(args.model).path))
    rng = random.Random(args.seed)
    while True:
        yield source.window(rng, args.prompt_tokens)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-pooling-") as tmp:
        if args.image_rate > 0 and vision_spec(resolve_model(args.model).path) is None:
            args.model = str(llava_from_lm(resolve_model(args.model).path, Path(tmp) / "llava"))
        flags = ["--model", args.model, *args.up_flags]
        with Server.up(flags, log_dir=tmp, timeout_s=args.ready_timeout, name="bench-pooling") as server:
            texts = _texts(args)
            phases = alone_then_loaded(args.rounds, "mixed", lambda mixed, r: asyncio.run(
                _phase(server.base_url, args, mixed, texts, args.seed + 10 * r)))
            time.sleep(2.0)  # the last loads the nodes published
            usage = [s.value for s in server.metrics().select("vllm:kv_cache_usage_perc")]
    report = {
        "benchmark": "pooling", "machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "func"},
        "phases": phases,
        "chat_ttft_p90_ratio_mixed_over_alone": p90_ratio(phases, "chat_ttft_ms", "mixed"),
        "all_succeeded": all(not p["chat_failed"] and not p.get("embed_failed") and not p.get("image_failed")
                             for p in phases),
        "kv_cache_usage_after": usage,
    }
    emit(report, args.output)
    return 0
