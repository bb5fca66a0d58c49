"""`kvrelay bench serve`: a load generator for any OpenAI-compatible endpoint (kvrelay's gateway, vLLM, ...).

Every request streams. Per request: TTFT (send -> first content chunk), ITL (gaps between content chunks), E2E,
prompt/completion tokens (`usage` via stream_options.include_usage; without it the content chunks are counted
and the prompt length is estimated), success or the error text. The report (kvrelay.bench.report) has
p50/p90/p99 of TTFT, ITL, E2E and TPOT, request/output/total token throughput, goodput under the given SLOs,
output tokens/s over time, and latency CDF plots.

Load shapes: --concurrency N keeps N requests in flight; --request-rate R sends sessions at Poisson arrivals
(seeded by --seed; --concurrency then caps requests in flight). The turns of a multi-turn conversation are sent
one after the other, each after the previous reply. Warmup requests (other text: seed + 1) run first and are
not measured. The run stops after --num-requests or --duration, and never lasts beyond --max-duration.

    kvrelay bench serve --base-url http://127.0.0.1:8000/v1 --concurrency 16 --num-requests 200
    kvrelay bench serve --dataset multi-tenant --tenants 8 --request-rate 4 --duration 120 --label cache_aware
    kvrelay bench serve --dataset multi-turn --turns 5 --slo-ttft-ms 500 --slo-itl-ms 50 --ignore-eos
    kvrelay bench serve --compare bench/results/serve-round_robin.json bench/results/serve-cache_aware.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from kvrelay.bench import report
from kvrelay.bench.client import Client
from kvrelay.bench.report import RequestRecord
from kvrelay.bench.workload import (
    DATASETS,
    Conversation,
    DatasetSpec,
    Session,
    TextSource,
    completion_prompt,
    iter_arrivals,
    iter_sessions,
)

logger = logging.getLogger(__name__)

DEFAULT_NUM_REQUESTS = 100
DEFAULT_CONCURRENCY = 8
HELP = "load-test an OpenAI-compatible endpoint (TTFT, ITL, goodput)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("endpoint")
    e.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible API root (ends in /v1)")
    e.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (none if not given)")
    e.add_argument("--model", default=None, help="model name (default: the first from GET /models)")
    e.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="chat: /chat/completions with messages; completions: /completions with a plain prompt")
    e.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    e.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos=true (vLLM/kvrelay extension) so each request generates max_tokens")
    e.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    e.add_argument("--request-timeout", type=float, default=300.0, help="seconds before a request counts as failed")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=int, default=None,
                      help=f"requests in flight (default {DEFAULT_CONCURRENCY}); with --request-rate: the cap")
    load.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (seeded)")
    load.add_argument("--warmup", type=int, default=2, help="requests sent first and left out of the stats")
    load.add_argument("--num-requests", type=int, default=None,
                      help=f"measured requests (default {DEFAULT_NUM_REQUESTS}, unlimited with --duration)")
    load.add_argument("--duration", type=float, default=None, help="send new requests for this many seconds")
    load.add_argument("--max-duration", type=float, default=3600.0,
                      help="hard cap in seconds on the whole run (warmup included); requests still running fail")
    d = p.add_argument_group("dataset (lengths in tokens with --tokenizer, else in words)")
    d.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random: mixed lengths; multi-tenant: shared system prompts; multi-turn: growing chats")
    d.add_argument("--tokenizer", default=None, help="tokenizer folder to measure lengths in tokens")
    d.add_argument("--seed", type=int, default=0, help="text, lengths, tenants and Poisson arrivals")
    d.add_argument("--min-input", type=int, default=32, help="shortest user message")
    d.add_argument("--max-input", type=int, default=512, help="longest user message")
    d.add_argument("--min-output", type=int, default=16, help="smallest max_tokens")
    d.add_argument("--max-output", type=int, default=128, help="largest max_tokens")
    d.add_argument("--max-tokens", type=int, default=None, help="fixed max_tokens (sets --min/--max-output)")
    d.add_argument("--tenants", type=int, default=4, help="multi-tenant: distinct shared system prompts")
    d.add_argument("--system-len", type=int, default=1024, help="multi-tenant: system prompt length")
    d.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    s = p.add_argument_group("SLOs (goodput: requests meeting all given SLOs)")
    s.add_argument("--slo-ttft-ms", type=float, default=None, help="time to first token")
    s.add_argument("--slo-itl-ms", type=float, default=None, help="the request's mean inter-token latency")
    s.add_argument("--slo-e2e-ms", type=float, default=None, help="end-to-end latency")
    o = p.add_argument_group("output")
    o.add_argument("--label", default=None, help="run name (default: <dataset>-c<N> or <dataset>-r<R>)")
    o.add_argument("--output", default=None, help="JSON file (default bench/results/serve-<label>.json); PNGs beside")
    o.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    o.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    o.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"), default=None,
                   help="no load: print B/A ratios of two saved runs, write compare JSON (--output) and a CDF plot")


def dataset_spec(args: argparse.Namespace, seed: int | None = None) -> DatasetSpec:
    lo, hi = (args.max_tokens, args.max_tokens) if args.max_tokens else (args.min_output, args.max_output)
    return DatasetSpec(name=args.dataset, seed=args.seed if seed is None else seed, min_input=args.min_input,
                       max_input=args.max_input, min_output=lo, max_output=hi, tenants=args.tenants,
                       system_len=args.system_len, turns=args.turns)


def default_label(args: argparse.Namespace) -> str:
    if args.request_rate is not None:
        return f"{args.dataset}-r{args.request_rate:g}"
    return f"{args.dataset}-c{args.concurrency or DEFAULT_CONCURRENCY}"


def check_args(args: argparse.Namespace) -> None:
    for name in ("concurrency", "num_requests"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
    for name in ("request_rate", "duration", "max_duration", "request_timeout"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be > 0")
    if args.warmup < 0:
        raise ValueError("--warmup: must be >= 0")
    if args.extra_body is not None and not isinstance(json.loads(args.extra_body), dict):
        raise ValueError("--extra-body: must be a JSON object")


@dataclass
class Sender:
    """Sends one turn through the client and fills its record."""

    client: Client
    args: argparse.Namespace
    model: str
    source: TextSource

    async def send(self, rec: RequestRecord, messages: list[dict], max_tokens: int, t0: float) -> None:
        args = self.args
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": args.temperature, "stream": True,
                "stream_options": {"include_usage": True}, **({"ignore_eos": True} if args.ignore_eos else {})}
        if args.endpoint == "chat":
            body["messages"] = messages
        else:
            body["prompt"] = completion_prompt(messages)
        reply = await self.client.post(args.endpoint, {**body, **json.loads(args.extra_body or "{}")})
        rec.start_s, rec.end_s, rec.e2e_s = reply.start - t0, reply.end - t0, reply.end - reply.start
        rec.ttft_s, rec.itl_s, rec.text = reply.ttft_s, reply.itl_s, reply.text
        rec.chunk_times_s = [t - t0 for t in reply.chunk_times]
        rec.error = reply.error or ("" if reply.chunk_times else "stream ended without content")
        rec.success = reply.status == 200 and not rec.error
        if usage := reply.usage:
            rec.prompt_tokens = usage.get("prompt_tokens") or 0
            rec.completion_tokens = usage.get("completion_tokens") or 0
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            rec.usage_from_server = True
        elif rec.success:
            rec.completion_tokens = len(reply.chunk_times)
            prompt = messages if args.endpoint == "chat" else [{"content": body["prompt"]}]
            rec.prompt_tokens = sum(self.source.measure(m["content"]) for m in prompt)


class Budget:
    """Hands out request indices until the request count or the deadline is reached."""

    def __init__(self, limit: int | None, deadline: float | None) -> None:
        self.limit, self.deadline, self.taken = limit, deadline, 0

    def exhausted(self) -> bool:
        return (self.limit is not None and self.taken >= self.limit) or (
            self.deadline is not None and time.perf_counter() >= self.deadline)

    def take(self) -> int | None:
        if self.exhausted():
            return None
        self.taken += 1
        return self.taken - 1


@dataclass
class Phase:
    """One phase (warmup or measured): its sessions, request budget and collected records."""

    sender: Sender
    sessions: Iterator[Session]
    budget: Budget
    limit: asyncio.Semaphore
    t0: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    bar: tqdm | None = None

    async def run_session(self, session: Session, first: int | None = None) -> None:
        conv = Conversation(session)
        for t, turn in enumerate(session.turns):
            index = first if t == 0 and first is not None else self.budget.take()
            if index is None:
                return
            rec = RequestRecord(index, session.index, t)
            async with self.limit:
                self.records.append(rec)
                await self.sender.send(rec, conv.ask(turn), turn.max_tokens, self.t0)
            conv.answer(rec.text)
            if self.bar is not None:
                self.bar.update(1)
            if not rec.success:
                return  # the next turn needs this reply

    async def run_concurrency(self, workers: int) -> None:
        async def worker() -> None:
            while not self.budget.exhausted():
                await self.run_session(next(self.sessions))

        await asyncio.gather(*(worker() for _ in range(workers)))

    async def run_poisson(self, rate: float, seed: int) -> None:
        tasks = []
        try:
            for due in iter_arrivals(rate, seed):
                await asyncio.sleep(max(0.0, self.t0 + due - time.perf_counter()))
                if (index := self.budget.take()) is None:
                    break
                tasks.append(asyncio.ensure_future(self.run_session(next(self.sessions), index)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()


async def run_load(args: argparse.Namespace, source: TextSource, records: list[RequestRecord]) -> dict:
    """Warmup, then the measured phase (appending its records as they start); returns the run's facts."""
    cap = args.concurrency or (DEFAULT_CONCURRENCY if args.request_rate is None else 10_000)
    async with Client(args.base_url, args.api_key, args.request_timeout) as client:
        model = args.model or (await client.models() or [None])[0]
        if model is None:
            raise ValueError("GET /models listed no model; pass --model")
        sender = Sender(client, args, model, source)
        if args.warmup:
            sessions = iter_sessions(dataset_spec(args, args.seed + 1), source)
            warm = Phase(sender, sessions, Budget(args.warmup, None), asyncio.Semaphore(cap), time.perf_counter())
            await warm.run_concurrency(min(cap, args.warmup))
            logger.info("warmup: %d requests, %d failed", len(warm.records), sum(not r.success for r in warm.records))
        limit = args.num_requests or (None if args.duration else DEFAULT_NUM_REQUESTS)
        t0 = time.perf_counter()
        budget = Budget(limit, t0 + args.duration if args.duration else None)
        with tqdm(total=limit, unit="req", desc="bench serve", disable=args.no_progress) as bar:
            phase = Phase(sender, iter_sessions(dataset_spec(args), source), budget, asyncio.Semaphore(cap), t0,
                          records, bar)
            if args.request_rate is None:
                await phase.run_concurrency(cap)
            else:
                await phase.run_poisson(args.request_rate, args.seed)
    return {"model": model, "concurrency": cap if args.concurrency or args.request_rate is None else None,
            "num_requests": limit}


def measure(args: argparse.Namespace) -> dict:
    """The whole benchmark: the result (per-request records included)."""
    from kvrelay.common.tokenizer import Tokenizer

    source = TextSource(Tokenizer(args.tokenizer) if args.tokenizer else None)
    records: list[RequestRecord] = []
    started = time.time()
    try:
        facts = asyncio.run(asyncio.wait_for(run_load(args, source, records), args.max_duration))
    except asyncio.TimeoutError:
        logger.warning("stopped at --max-duration %g s", args.max_duration)
        facts = {"model": args.model, "stopped_at_max_duration": True}
    config = {
        "base_url": args.base_url, "endpoint": args.endpoint, "model": facts.get("model"),
        "dataset": {**dataset_spec(args).__dict__, "length_unit": source.unit, "tokenizer": args.tokenizer},
        "load": {"mode": "concurrency" if args.request_rate is None else "poisson",
                 "concurrency": facts.get("concurrency"), "request_rate": args.request_rate, "seed": args.seed,
                 "warmup": args.warmup, "num_requests": facts.get("num_requests"), "duration_s": args.duration,
                 "max_duration_s": args.max_duration, "request_timeout_s": args.request_timeout},
        "ignore_eos": args.ignore_eos, "temperature": args.temperature, "started_at": started,
        "stopped_at_max_duration": bool(facts.get("stopped_at_max_duration")),
    }
    slos = {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms, "e2e_ms": args.slo_e2e_ms}
    return report.build_result(args.label or default_label(args), config, records, slos)


def run(args: argparse.Namespace) -> int:
    if args.compare:
        report.run_compare(args.compare[0], args.compare[1], args.output, not args.no_plot)
        return 0
    check_args(args)
    result = measure(args)
    path = report.save(result, args.output or f"bench/results/serve-{result['label']}.json", not args.no_plot)
    logger.info("wrote %s", path)
    print(json.dumps(report.summary(result), indent=2))
    return 0 if result["completed"] else 1
