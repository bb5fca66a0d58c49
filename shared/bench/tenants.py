"""`kvrelay bench tenants`: does one tenant's flood hurt another tenant's latency?

One `kvrelay up` fleet with a keys file (gateway.auth): tenant A's key is limited to --a-rpm requests per minute
(and with --a-max-concurrent to that many requests in progress), tenant B's key has no limit. Two phases, taking
turns (alone, flood, alone, flood, ... for --rounds), so both meet the same machine:
- alone: B sends streamed chat requests at Poisson arrivals of --b-rate per second (first, 10 s of it unmeasured,
  so that no phase carries the fleet's first requests);
- flood: B the same, while A sends --flood-factor times its share (--a-rpm / 60 per second).

The gateway answers A's excess with 429 before any work (its bucket lives in Redis, gateway.ratelimit), so what
B feels of A is A's admitted share only. Reported: B's TTFT p50/p90 per phase and the flood/alone ratio (the
issue's bar: p90 within 1.25x), A's admitted and refused counts against its limit (within 10%), and whether every
429 carried Retry-After and OpenAI's x-ratelimit-* headers.

    kvrelay bench tenants
    kvrelay bench tenants --b-rate 2 --a-rpm 120 --flood-factor 10 --duration 30 --rounds 2
    kvrelay bench tenants --reserved-cores 1     # the engine on a core the gateway and the clients leave alone
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from pathlib import Path

from kvrelay.bench.client import Client
from kvrelay.bench.fleet import Server
from kvrelay.bench.report import emit, machine
from kvrelay.bench.stats import percentiles
from kvrelay.bench.workload import TextSource, alone_then_loaded, p90_ratio, send_poisson
from kvrelay.common.system import usable_cores
from kvrelay.gateway.ratelimit import burst

WARMUP_S = 10.0  # B alone before the first phase, not measured
HELP = "multi-tenant fairness: tenant B's TTFT alone and while tenant A floods past its rate limit, in one run"
_KEYS = {"A": "sk-bench-tenant-a", "B": "sk-bench-tenant-b"}
_HEADERS = ("retry-after", "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="the model `kvrelay up` serves")
    p.add_argument("--up-flags", nargs=argparse.REMAINDER, default=[],
                   help="more `kvrelay up` flags (last on the line), e.g. --up-flags --prefill 1 --decode 1")
    p.add_argument("--reserved-cores", type=int, default=0, metavar="N",
                   help="`kvrelay up --reserved-cores N`: the engines on cores of their own, the gateway, Redis and "
                        "this load generator on the first N")
    p.add_argument("--b-rate", type=float, default=2.0, help="tenant B's requests per second (Poisson)")
    p.add_argument("--a-rpm", type=int, default=120, help="tenant A's limit, requests per minute")
    p.add_argument("--a-max-concurrent", type=int, default=None,
                   help="tenant A's key's max_concurrent (default: none, the rate limit only)")
    p.add_argument("--flood-factor", type=float, default=10.0, help="A sends this many times its limit")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of each phase")
    p.add_argument("--rounds", type=int, default=2, help="alone/flood pairs")
    p.add_argument("--prompt-tokens", type=int, default=96, help="corpus text per request, in tokens")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="bench/results/tenants.json", help="where the JSON goes")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for the fleet to come up")


async def _phase(url: str, args: argparse.Namespace, flood: bool, bodies, seed: int) -> dict:
    clients = {name: Client(url, key, timeout_s=120) for name, key in _KEYS.items()}
    try:
        def post(name: str):
            return lambda: clients[name].post("chat", next(bodies))

        runs = [send_poisson(args.b_rate, args.duration, random.Random(seed), post("B"))]
        if flood:
            rate = args.a_rpm / 60.0 * args.flood_factor
            runs.append(send_poisson(rate, args.duration, random.Random(seed + 1), post("A")))
        replies = await asyncio.gather(*runs)
    finally:
        for client in clients.values():
            await client.close()
    b = replies[0]
    out = {"b_ok": sum(r.ok for r in b), "b_failed": sum(not r.ok for r in b),
           "b_ttft_ms": percentiles([r.ttft_s for r in b if r.ok and r.ttft_s is not None], 1000.0, digits=1)}
    if flood:
        a = replies[1]
        refused = [r for r in a if r.status == 429]
        out.update(a_sent=len(a), a_ok=sum(r.ok for r in a), a_429=len(refused),
                   a_other=len(a) - len(refused) - sum(r.ok for r in a),
                   a_429_headers_ok=all(all(h in r.headers for h in _HEADERS) for r in refused))
    return out


def _bodies(args: argparse.Namespace):
    from kvrelay.common.tokenizer import Tokenizer
    from kvrelay.model_files.resolve import resolve_model

    source = TextSource(Tokenizer(resolve_model(args.model).path))
    rng = random.Random(args.seed)
    while True:
        yield {"model": None, "messages": [{"role": "user", "content": source.window(rng, args.prompt_tokens)}],
               "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}


def _refill_s(rpm: int) -> float:
    return burst(rpm) / rpm * 60.0 * 1.05


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-tenants-") as tmp:
        keys = Path(tmp) / "keys.json"
        a_key = {"key": _KEYS["A"], "tenant": "A", "rpm": args.a_rpm}
        if args.a_max_concurrent:
            a_key["max_concurrent"] = args.a_max_concurrent
        keys.write_text(json.dumps([a_key, {"key": _KEYS["B"], "tenant": "B"}]))
        flags = ["--model", args.model, "--api-keys-file", str(keys), *args.up_flags]
        if args.reserved_cores:
            flags += ["--reserved-cores", str(args.reserved_cores)]
        with Server.up(flags, log_dir=tmp, timeout_s=args.ready_timeout, name="bench-tenants") as server:
            if args.reserved_cores:  # the fleet has placed itself: the clients join the gateway's cores
                os.sched_setaffinity(0, usable_cores()[:args.reserved_cores])
            bodies = _bodies(args)
            # Discarded: B alone for a few seconds, so that the first measured phase does not carry the fleet's
            # first requests (they measured 2x the later alone phases' p90).
            asyncio.run(_phase(server.base_url, argparse.Namespace(**{**vars(args), "duration": WARMUP_S}), False,
                               bodies, args.seed - 1))

            def measure(flood: bool, r: int) -> dict:
                time.sleep(_refill_s(args.a_rpm) if flood and r else 0.0)  # each flood starts from A's full burst
                return asyncio.run(_phase(server.base_url, args, flood, bodies, args.seed + 10 * r))

            phases = alone_then_loaded(args.rounds, "flood", measure)
    floods = [p for p in phases if p["phase"] == "flood"]
    # What A may have had in one flood: a full bucket (its burst) plus the refill during the phase.
    allowance = burst(args.a_rpm) + args.a_rpm * args.duration / 60.0  # (a concurrency cap may admit less)
    report = {
        "benchmark": "tenants", "machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "func"},
        "phases": phases,
        "b_ttft_p90_ratio_flood_over_alone": p90_ratio(phases, "b_ttft_ms", "flood"),
        "a_admitted_over_allowance": [round(p["a_ok"] / allowance, 3) for p in floods],
        "a_429_headers_ok": all(p["a_429_headers_ok"] for p in floods),
    }
    emit(report, args.output)
    return 0
